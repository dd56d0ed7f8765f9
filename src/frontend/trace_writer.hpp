// SPDX-License-Identifier: Apache-2.0
// trace_writer: records every allocation and free of an allocator (options.trace_path) in the
// trace format that vmm-replay reads (v2, docs/trace-format.md).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "vmmalloc/backend.hpp"

namespace vmm {

// Trace recording (options.trace_path): "# vmmalloc-trace v2" then one line per event,
//   OP ADDR SIZE STREAM THREAD TIME
// (OP a, f, or t for trim(KEEP): "t 0 KEEP 0 THREAD TIME")
// through a 1 MiB buffer. One mutex per event keeps the lines in the order the calls happened,
// which the replay needs (a free after its allocation), and TIME (ns since open, steady clock) is
// read under it, so it never decreases from one line to the next. Streams and threads become
// small ids in order of first event (stream 0 = the default stream; threads from 1).
struct trace_writer {
  std::mutex mu;       // the buffer, the ids, the clock's last value
  std::mutex file_mu;  // the file: taken after mu, held while a full buffer is written
  std::FILE* f = nullptr;
  std::string buf;
  std::unordered_map<stream_t, unsigned> ids;
  std::unordered_map<std::thread::id, unsigned> threads;
  std::chrono::steady_clock::time_point t0;
  std::uint64_t last_ns = 0;
  std::uint64_t events = 0;
  const std::uint64_t serial;  // process-unique: the key of the thread-local id caches
  static constexpr std::size_t kFlushAt = std::size_t{1} << 20;

  trace_writer();
  status open(const std::string& path);
  // One event: formatted outside the lock; the critical section reads the clock, appends the
  // line, and looks ids up only the first time a thread or a stream shows up.
  void event(char kind, std::uintptr_t p, std::size_t n, stream_t s);
  void flush();
  ~trace_writer();

 private:
  void write(const std::string& out);
  void flush_locked();
};

}  // namespace vmm
