// trace_writer: trace recording. See trace_writer.hpp.
#include "frontend/trace_writer.hpp"

#include <cerrno>
#include <charconv>

namespace vmm {

status trace_writer::open(const std::string& path) {
  f = std::fopen(path.c_str(), "w");
  if (!f) return {errc::invalid_value, errno, "cannot open options.trace_path for writing", "fopen"};
  buf.reserve(kFlushAt + 128);
  return {};
}

void trace_writer::event(char kind, std::uintptr_t p, std::size_t n, stream_t s) {
  // Formatted outside the lock: the critical section is a map lookup and a short append, so
  // threads recording at once wait less (bench/RESULTS.md has the cost either way).
  char line[80];  // 1 + 16 hex + 20 + 10 digits + separators; to_chars stops short of the end
  char* e = line;
  *e++ = kind;
  *e++ = ' ';
  e = std::to_chars(e, line + sizeof line - 8, p, 16).ptr;
  *e++ = ' ';
  e = std::to_chars(e, line + sizeof line - 8, n).ptr;
  *e++ = ' ';
  std::unique_lock g(mu);
  unsigned id = 0;  // the default stream is 0, as in the traces; others 1, 2, ... by first use
  if (s) id = ids.try_emplace(s, static_cast<unsigned>(ids.size()) + 1).first->second;
  e = std::to_chars(e, line + sizeof line - 8, id).ptr;
  *e++ = '\n';
  buf.append(line, e);
  ++events;
  if (buf.size() >= kFlushAt) {
    // Hand the full buffer to the file outside the event lock; file_mu, taken before mu is
    // released, keeps the buffers in order.
    std::string out;
    out.swap(buf);
    buf.reserve(kFlushAt + 128);
    std::lock_guard fg(file_mu);
    g.unlock();
    write(out);
  }
}

void trace_writer::write(const std::string& out) {
  if (f && !out.empty()) std::fwrite(out.data(), 1, out.size(), f), std::fflush(f);
}

void trace_writer::flush_locked() {
  std::lock_guard fg(file_mu);
  write(buf);
  buf.clear();
}

void trace_writer::flush() {
  std::lock_guard g(mu);
  flush_locked();
}

trace_writer::~trace_writer() {
  flush_locked();
  if (f) std::fclose(f);
}

}  // namespace vmm
