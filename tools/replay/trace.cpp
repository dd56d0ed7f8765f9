// SPDX-License-Identifier: Apache-2.0
#include "trace.hpp"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <unordered_map>

#include <cstdio>
#include <cstdlib>

#ifdef VMM_REPLAY_ZLIB
#include <zlib.h>
#endif

namespace vmm::replay {

namespace {
std::string where(const std::string& source, std::size_t line) {
  std::string s = source;
  if (line) {
    s += ':';
    s += std::to_string(line);
  }
  return s;
}
}  // namespace

parse_error::parse_error(const std::string& source, std::size_t line, const std::string& what)
    : std::runtime_error(where(source, line) + ": " + what), line_(line) {}

namespace {

std::string hex(std::uint64_t v) {
  char b[32];
  auto r = std::to_chars(b, b + sizeof b, v, 16);
  return std::string(b, r.ptr);
}

// Splits on spaces/tabs; returns the number of fields found (up to max, +1 if more).
int split(std::string_view s, std::string_view* out, int max) {
  int n = 0;
  std::size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
    if (i == s.size()) break;
    std::size_t j = i;
    while (j < s.size() && s[j] != ' ' && s[j] != '\t') ++j;
    if (n == max) return max + 1;
    out[n++] = s.substr(i, j - i);
    i = j;
  }
  return n;
}

bool parse_u64(std::string_view s, int base, std::uint64_t& v, bool allow_0x = true) {
  if (allow_0x && s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    s.remove_prefix(2);
    base = 16;
  }
  if (s.empty()) return false;
  auto r = std::from_chars(s.data(), s.data() + s.size(), v, base);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

}  // namespace

struct parser::impl {
  struct live_info {
    std::uint32_t id;
    std::uint32_t line;
    std::uint64_t size;
    std::uint16_t stream;
    std::uint16_t thread;
  };
  trace t;
  std::unordered_map<std::uint64_t, live_info> live;  // ADDR -> block (parse time only)
  std::unordered_map<std::uint64_t, std::uint16_t> streams, threads;
  std::uint32_t last_time_line = 0;  // line of the previous event (v2 TIME order)
  std::vector<std::uint32_t> free_ids;  // slots whose block was freed: reused LIFO
  std::uint64_t live_bytes = 0;

  [[noreturn]] void fail(std::size_t line, const std::string& what) {
    throw parse_error(t.source, line, what);
  }
  // Dense index of a STREAM or THREAD value, added on first sight (at most 65535 of each).
  std::uint16_t dense(std::unordered_map<std::uint64_t, std::uint16_t>& m, std::vector<std::uint64_t>& ids,
                      std::uint64_t v, std::size_t lineno, const char* what) {
    if (auto it = m.find(v); it != m.end()) return it->second;
    if (ids.size() >= UINT16_MAX) fail(lineno, std::string("more than 65535 distinct ") + what);
    auto i = static_cast<std::uint16_t>(ids.size());
    m.emplace(v, i);
    ids.push_back(v);
    return i;
  }
};

namespace {
// "# vmmalloc-trace vN [anything]": the version header, only on line 1.
bool is_header(const std::string_view* f, int n) { return n >= 2 && f[0] == "#" && f[1] == "vmmalloc-trace"; }
}  // namespace

parser::parser(std::string source) : p_(std::make_unique<impl>()) {
  p_->t.source = std::move(source);
  p_->live.reserve(1 << 16);
}
parser::~parser() = default;

void parser::feed(std::string_view line, std::size_t lineno) {
  auto& P = *p_;
  P.t.lines_read = lineno;
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  std::string_view f[6];
  int n = split(line, f, 6);
  if (n == 0) return;  // blank
  if (f[0][0] == '#') {
    if (!is_header(f, n)) return;  // a comment
    if (lineno != 1) P.fail(lineno, "the version header ('# vmmalloc-trace v2') must be the first line");
    if (n < 3) P.fail(lineno, "version header without a version (expected '# vmmalloc-trace v2')");
    if (f[2] == "v1") P.t.version = 1;
    else if (f[2] == "v2") P.t.version = 2;
    else P.fail(lineno, "unsupported trace version '" + std::string(f[2].substr(0, 16)) + "' (this parser reads v1 and v2)");
    return;
  }
  if (f[0] != "a" && f[0] != "f" && f[0] != "t")
    P.fail(lineno, "unknown event '" + std::string(f[0].substr(0, 32)) + "' (expected 'a', 'f' or 't')");
  const bool v2 = P.t.version == 2;
  const int want = v2 ? 6 : 4;
  if (n != want) {
    std::string op(f[0]);
    if (v2)
      P.fail(lineno, std::string(n < want ? "missing" : "extra") + " fields (expected '" + op +
                         " ADDR SIZE STREAM THREAD TIME' in a v2 trace)");
    P.fail(lineno, n < want ? "missing fields (expected '" + op + " ADDR SIZE STREAM')"
                            : "extra fields (expected '" + op + " ADDR SIZE STREAM'; a trace with THREAD and TIME "
                              "starts with the line '# vmmalloc-trace v2')");
  }
  std::uint64_t addr, size, stream, tid = 0, time = 0;
  if (!parse_u64(f[1], 16, addr)) P.fail(lineno, "bad ADDR '" + std::string(f[1].substr(0, 40)) + "' (hex)");
  if (!parse_u64(f[2], 10, size)) P.fail(lineno, "bad SIZE '" + std::string(f[2].substr(0, 40)) + "' (decimal)");
  if (!parse_u64(f[3], 10, stream)) P.fail(lineno, "bad STREAM '" + std::string(f[3].substr(0, 40)) + "'");
  if (v2) {
    if (!parse_u64(f[4], 10, tid))
      P.fail(lineno, "bad THREAD '" + std::string(f[4].substr(0, 40)) + "' (decimal, or hex with 0x)");
    if (!parse_u64(f[5], 10, time, false))
      P.fail(lineno, "bad TIME '" + std::string(f[5].substr(0, 40)) + "' (decimal ns since the trace started)");
    if (!P.t.time_ns.empty() && time < P.t.time_ns.back())
      P.fail(lineno, "TIME " + std::to_string(time) + " is before the previous event's (" +
                         std::to_string(P.t.time_ns.back()) + " at line " + std::to_string(P.last_time_line) +
                         "): lines must be in the order the events happened");
  }
  if (f[0][0] == 't' && addr != 0) P.fail(lineno, "a trim ('t') names no block: its ADDR is 0");
  if (lineno > UINT32_MAX) P.fail(lineno, "trace too long (more than 2^32 lines)");

  const std::uint16_t si = P.dense(P.streams, P.t.stream_ids, stream, lineno, "streams");
  const std::uint16_t ti = P.dense(P.threads, P.t.thread_ids, tid, lineno, "threads");

  event e{};
  e.size = size;
  e.stream = si;
  if (f[0][0] == 't') {
    e.id = 0;
    e.kind = op::trim;
    ++P.t.trims;
  } else if (f[0][0] == 'a') {
    auto [it, fresh] = P.live.try_emplace(addr);
    if (!fresh)
      P.fail(lineno, "allocation of " + hex(addr) + ", which is still live (allocated at line " +
                         std::to_string(it->second.line) + ")");
    std::uint32_t id;
    if (!P.free_ids.empty()) {
      id = P.free_ids.back();
      P.free_ids.pop_back();
    } else {
      id = P.t.slots++;
    }
    it->second = {id, static_cast<std::uint32_t>(lineno), size, si, ti};
    e.id = id;
    e.kind = op::alloc;
    P.live_bytes += size;
    ++P.t.allocs;
    P.t.total_alloc_bytes += size;
    if (P.t.allocs == 1 || size < P.t.min_size) P.t.min_size = size;
    P.t.max_size = std::max(P.t.max_size, size);
  } else {
    auto it = P.live.find(addr);
    if (it == P.live.end()) P.fail(lineno, "free of " + hex(addr) + ", which is not live");
    if (it->second.size != size)
      P.fail(lineno, "free of " + hex(addr) + " with size " + std::to_string(size) +
                         ", allocated with size " + std::to_string(it->second.size) + " at line " +
                         std::to_string(it->second.line));
    e.id = it->second.id;
    e.kind = op::free;
    if (it->second.thread != ti) ++P.t.cross_thread_frees;
    if (it->second.stream != si) ++P.t.cross_stream_frees;
    P.free_ids.push_back(it->second.id);
    P.live.erase(it);
    P.live_bytes -= size;
    ++P.t.frees;
  }
  P.t.events.push_back(e);
  P.t.lines.push_back(static_cast<std::uint32_t>(lineno));
  P.t.names.push_back(addr);
  P.t.thread.push_back(ti);
  if (v2) {
    P.t.time_ns.push_back(time);
    P.last_time_line = static_cast<std::uint32_t>(lineno);
  }
  P.t.live_after.push_back(P.live_bytes);
  if (P.live_bytes > P.t.peak_live_bytes) {
    P.t.peak_live_bytes = P.live_bytes;
    P.t.peak_live_event = P.t.events.size() - 1;
  }
}

trace parser::finish() {
  auto& P = *p_;
  // Blocks still live, in allocation order (by line), so end-of-replay frees are deterministic.
  std::vector<impl::live_info> rest;
  rest.reserve(P.live.size());
  for (auto& [a, l] : P.live) rest.push_back(l);
  std::sort(rest.begin(), rest.end(), [](auto& x, auto& y) { return x.line < y.line; });
  for (auto& l : rest) P.t.live_at_end.push_back({l.id, l.stream, l.size});
  P.live.clear();
  return std::move(P.t);
}

namespace {
// Feeds every line of a stdio stream (no zlib fallback).
[[maybe_unused]] void feed_stream(std::FILE* f, parser& ps, const std::string& path) {
  char* buf = nullptr;
  std::size_t cap = 0;
  std::size_t lineno = 0;
  ssize_t n;
  struct freer {
    char*& b;
    ~freer() { std::free(b); }
  } fr{buf};
  while ((n = getline(&buf, &cap, f)) > 0) {
    ++lineno;
    std::size_t len = static_cast<std::size_t>(n);
    if (buf[len - 1] == '\n') --len;
    if (len > 4095) throw parse_error(path, lineno, "line longer than 4095 bytes");
    ps.feed(std::string_view(buf, len), lineno);
  }
  if (std::ferror(f)) throw parse_error(path, lineno + 1, std::string("read error: ") + std::strerror(errno));
}
}  // namespace

trace parse_file(const std::string& path) {
  parser ps(path);
#ifdef VMM_REPLAY_ZLIB
  gzFile g = gzopen(path.c_str(), "rb");
  if (!g) throw parse_error(path, 0, std::string("cannot open: ") + std::strerror(errno));
  gzbuffer(g, 1 << 20);
  struct closer {
    gzFile g;
    ~closer() { gzclose(g); }
  } c{g};
  // Lines are ~40 bytes; a line that does not fit the buffer is malformed anyway.
  char buf[4096];
  std::size_t lineno = 0;
  while (gzgets(g, buf, sizeof buf)) {
    ++lineno;
    std::size_t n = std::strlen(buf);
    bool nl = n && buf[n - 1] == '\n';
    if (!nl && n == sizeof buf - 1) throw parse_error(path, lineno, "line longer than 4095 bytes");
    ps.feed(std::string_view(buf, nl ? n - 1 : n), lineno);
  }
  int err = 0;
  const char* msg = gzerror(g, &err);
  if (err != Z_OK && err != Z_STREAM_END)
    throw parse_error(path, lineno + 1, std::string("read error: ") + (msg ? msg : "?"));
#else
  // Built without zlib: plain files directly, gzip files through `gzip -dc` (slower, same result).
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw parse_error(path, 0, std::string("cannot open: ") + std::strerror(errno));
  unsigned char magic[2] = {};
  bool gz = std::fread(magic, 1, 2, f) == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
  if (!gz) {
    std::rewind(f);
    struct closer {
      std::FILE* f;
      ~closer() { std::fclose(f); }
    } c{f};
    feed_stream(f, ps, path);
  } else {
    std::fclose(f);
    std::string q = "'";
    for (char ch : path) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    q += "'";
    std::FILE* p = popen(("gzip -dc -- " + q).c_str(), "r");
    if (!p) throw parse_error(path, 0, "cannot run gzip -dc (built without zlib)");
    try {
      feed_stream(p, ps, path);
    } catch (...) {
      pclose(p);
      throw;
    }
    if (pclose(p) != 0) throw parse_error(path, 0, "gzip -dc failed (corrupt or truncated .gz?)");
  }
#endif
  return ps.finish();
}

trace parse_text(std::string_view text, const std::string& source) {
  parser ps(source);
  std::size_t lineno = 0;
  while (!text.empty()) {
    auto nl = text.find('\n');
    ps.feed(text.substr(0, nl), ++lineno);
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
  return ps.finish();
}

}  // namespace vmm::replay
