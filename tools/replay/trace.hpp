// SPDX-License-Identifier: Apache-2.0
// Allocation traces (format: docs/trace-format.md), parsed whole into memory before any replay, so
// the timed loop does vector indexing only. Two versions:
//
//   v1 (no header)                  v2 (first line "# vmmalloc-trace v2")
//     a ADDR SIZE STREAM              a ADDR SIZE STREAM THREAD TIME
//     f ADDR SIZE STREAM              f ADDR SIZE STREAM THREAD TIME
//     t 0 KEEP STREAM                 t 0 KEEP STREAM THREAD TIME
//
// a = allocate SIZE bytes, named ADDR (hex, optional 0x); f = free ADDR (SIZE repeats the
// allocation's size); t = the program gave the allocator's free memory back down to KEEP bytes
// (trim(KEEP); PyTorch's empty_cache is KEEP 0, and cuDNN's benchmark mode calls it after every
// search). v2 adds the recording thread (THREAD) and the CPU time of the call (TIME,
// ns since the trace started, never decreasing from one line to the next): the order of the lines
// is the order the events happened in, across threads.
//
// ADDR is a name that is reused after a free. The parser maps each live name to a dense slot id
// (0 .. slots-1, a slot is reused once its block is freed), so a replay keeps `void* ptr[slots]`
// and never hashes an address. STREAM and THREAD (decimal, or hex with 0x) map to dense indices.
// Blank lines and lines starting with '#' (other than the header) are skipped. Anything else that
// does not fit -- unknown op, missing or extra fields for the version, bad numbers, allocating a
// live name, freeing a name that is not live, a free whose size differs from its allocation's, a
// TIME below the previous line's, a header that is not on line 1 or names another version -- is a
// parse_error carrying the line number.
// Plain text and gzip are both read through zlib (gzopen reads uncompressed files transparently).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace vmm::replay {

enum class op : std::uint8_t { alloc = 0, free = 1, trim = 2 };

// 16 bytes: the replay loop streams through 1.3 M of these.
struct event {
  std::uint64_t size;    // bytes requested (a free repeats its allocation's size; a trim: KEEP)
  std::uint32_t id;      // dense slot id of the block (0 for a trim)
  std::uint16_t stream;  // dense stream index (see trace::stream_ids)
  op kind;
};
static_assert(sizeof(event) == 16);

struct live_block {
  std::uint32_t id;
  std::uint16_t stream;
  std::uint64_t size;
};

struct trace {
  std::string source;
  int version = 1;                        // 1: no header; 2: "# vmmalloc-trace v2"
  std::vector<event> events;
  // Parallel to events, for error messages and checks only (never read by the timed loop).
  std::vector<std::uint32_t> lines;       // source line of each event (1-based)
  std::vector<std::uint64_t> names;       // ADDR of each event
  std::vector<std::uint64_t> live_after;  // live requested bytes after each event
  std::vector<std::uint64_t> stream_ids;  // dense stream index -> STREAM as written
  // Threads: v1 traces have one (index 0, recorded id 0). Read by threaded replays to dispatch.
  std::vector<std::uint16_t> thread;      // dense thread index of each event
  std::vector<std::uint64_t> thread_ids;  // dense thread index -> THREAD as written
  std::vector<std::uint64_t> time_ns;     // v2 only (empty in v1): TIME of each event
  std::vector<live_block> live_at_end;    // blocks never freed, in allocation order

  std::uint32_t slots = 0;                // ids are < slots (= most blocks live at once)
  std::uint64_t allocs = 0, frees = 0, trims = 0;
  std::uint64_t peak_live_bytes = 0;      // most requested bytes live at once
  std::size_t peak_live_event = 0;        // index of the event after which that peak is first reached
  std::uint64_t total_alloc_bytes = 0, min_size = 0, max_size = 0;
  std::uint64_t lines_read = 0;
  std::uint64_t cross_thread_frees = 0;   // frees by another thread than the allocating one
  std::uint64_t cross_stream_frees = 0;   // frees on another stream than the allocation's
};

class parse_error : public std::runtime_error {
 public:
  parse_error(const std::string& source, std::size_t line, const std::string& what);
  std::size_t line() const noexcept { return line_; }  // 0 = not about one line (e.g. cannot open)

 private:
  std::size_t line_;
};

// Incremental parser: feed lines in order, then take the trace.
class parser {
 public:
  explicit parser(std::string source);
  ~parser();
  parser(const parser&) = delete;
  parser& operator=(const parser&) = delete;
  // One line without its newline (a trailing '\r' is ignored). Throws parse_error.
  void feed(std::string_view line, std::size_t lineno);
  trace finish();

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

// Reads PATH (.gz or plain). Throws parse_error.
trace parse_file(const std::string& path);
// Parses text held in memory (tests). Throws parse_error.
trace parse_text(std::string_view text, const std::string& source = "<text>");

}  // namespace vmm::replay
