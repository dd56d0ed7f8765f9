// trace_writer: records every allocation and free of an allocator (options.trace_path) in the
// trace format that vmm-replay reads.
#pragma once

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>

#include "vmmalloc/backend.hpp"

namespace vmm {

// Trace recording (options.trace_path): the shared trace format, one line per event, through a
// 1 MiB buffer. One mutex per event keeps the lines in the order the calls happened, which the
// replay needs (a free after its allocation). Stream handles become small ids in order of first use.
struct trace_writer {
  std::mutex mu;       // the buffer and the stream ids
  std::mutex file_mu;  // the file: taken after mu, held while a full buffer is written
  std::FILE* f = nullptr;
  std::string buf;
  std::unordered_map<stream_t, unsigned> ids;
  std::uint64_t events = 0;
  static constexpr std::size_t kFlushAt = std::size_t{1} << 20;

  status open(const std::string& path);
  // One event: formatted outside the lock; the critical section is a map lookup and an append.
  void event(char kind, std::uintptr_t p, std::size_t n, stream_t s);
  void flush();
  ~trace_writer();

 private:
  void write(const std::string& out);
  void flush_locked();
};

}  // namespace vmm
