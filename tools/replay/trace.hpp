// Allocation traces (format: /work/shared/traces/README.md), parsed whole into memory before any
// replay, so the timed loop does vector indexing only:
//
//     a ADDR SIZE STREAM     allocate SIZE bytes, named ADDR (hex, optional 0x)
//     f ADDR SIZE STREAM     free ADDR (SIZE repeats the allocation's size)
//
// ADDR is a name that is reused after a free. The parser maps each live name to a dense slot id
// (0 .. slots-1, a slot is reused once its block is freed), so a replay keeps `void* ptr[slots]`
// and never hashes an address. STREAM (decimal, or hex with 0x) maps to a dense stream index.
// Blank lines and lines starting with '#' are skipped. Anything else that does not fit -- unknown
// op, missing or extra fields, bad numbers, allocating a live name, freeing a name that is not live,
// a free whose size differs from its allocation's -- is a parse_error carrying the line number.
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

enum class op : std::uint8_t { alloc = 0, free = 1 };

// 16 bytes: the replay loop streams through 1.3 M of these.
struct event {
  std::uint64_t size;    // bytes requested (a free repeats its allocation's size)
  std::uint32_t id;      // dense slot id of the block
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
  std::vector<event> events;
  // Parallel to events, for error messages and checks only (never read by the timed loop).
  std::vector<std::uint32_t> lines;       // source line of each event (1-based)
  std::vector<std::uint64_t> names;       // ADDR of each event
  std::vector<std::uint64_t> live_after;  // live requested bytes after each event
  std::vector<std::uint64_t> stream_ids;  // dense stream index -> STREAM as written
  std::vector<live_block> live_at_end;    // blocks never freed, in allocation order

  std::uint32_t slots = 0;                // ids are < slots (= most blocks live at once)
  std::uint64_t allocs = 0, frees = 0;
  std::uint64_t peak_live_bytes = 0;      // most requested bytes live at once
  std::size_t peak_live_event = 0;        // index of the event after which that peak is first reached
  std::uint64_t total_alloc_bytes = 0, min_size = 0, max_size = 0;
  std::uint64_t lines_read = 0;
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
