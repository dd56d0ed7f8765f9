// SPDX-License-Identifier: Apache-2.0
// trace_writer: trace recording. See trace_writer.hpp.
#include "frontend/trace_writer.hpp"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>

namespace vmm {

namespace {

std::atomic<std::uint64_t> next_serial{1};

// This thread's ids in the writer it used last: set under the writer's mu, read by this thread
// only. An id never changes once given, so a hit lets the ids be formatted outside the lock.
// One entry: a thread that alternates between two tracing allocators looks its ids up each time.
struct tl_ids {
  std::uint64_t writer = 0;  // trace_writer::serial; 0 = none
  unsigned thread = 0;
  stream_t stream = nullptr;
  unsigned stream_id = 0;
  bool stream_known = false;
};
thread_local tl_ids tl;

}  // namespace

trace_writer::trace_writer() : serial(next_serial.fetch_add(1, std::memory_order_relaxed)) {}

status trace_writer::open(const std::string& path) {
  f = std::fopen(path.c_str(), "w");
  if (!f) return {errc::invalid_value, errno, "cannot open options.trace_path for writing", "fopen"};
  buf.reserve(kFlushAt + 128);
  buf = "# vmmalloc-trace v2 pid=" + std::to_string(::getpid()) + " clock=steady\n";
  t0 = std::chrono::steady_clock::now();
  return {};
}

void trace_writer::event(char kind, std::uintptr_t p, std::size_t n, stream_t s) {
  // Formatted outside the lock where possible, so threads recording at once wait less
  // (bench/RESULTS.md has the cost).
  char line[128];  // at most 1 + 16 hex + 20 + 10 + 10 + 20 digits + 6 separators = 83
  char* const end = line + sizeof line - 8;  // to_chars never reaches the separators' room
  char* e = line;
  *e++ = kind;
  *e++ = ' ';
  e = std::to_chars(e, end, p, 16).ptr;
  *e++ = ' ';
  e = std::to_chars(e, end, n).ptr;
  *e++ = ' ';
  // Fast path: this thread already has its id here and used this stream last time.
  const bool known = tl.writer == serial && tl.stream_known && tl.stream == s;
  if (known) {
    e = std::to_chars(e, end, tl.stream_id).ptr;
    *e++ = ' ';
    e = std::to_chars(e, end, tl.thread).ptr;
    *e++ = ' ';
  }
  std::unique_lock g(mu);
  if (!known) {
    if (tl.writer != serial) {
      tl = tl_ids{};
      tl.thread = threads.try_emplace(std::this_thread::get_id(), static_cast<unsigned>(threads.size()) + 1)
                      .first->second;
      tl.writer = serial;
    }
    unsigned id = 0;  // the default stream is 0, as in the traces; others 1, 2, ... by first use
    if (s) id = ids.try_emplace(s, static_cast<unsigned>(ids.size()) + 1).first->second;
    tl.stream = s, tl.stream_id = id, tl.stream_known = true;
    e = std::to_chars(e, end, id).ptr;
    *e++ = ' ';
    e = std::to_chars(e, end, tl.thread).ptr;
    *e++ = ' ';
  }
  // The clock under the lock: line order and time order agree. steady_clock does not go back;
  // the max keeps the file valid even where a clock misbehaves across cores (costs a compare).
  auto ns = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  if (ns < last_ns) ns = last_ns;
  last_ns = ns;
  e = std::to_chars(e, end, ns).ptr;
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
