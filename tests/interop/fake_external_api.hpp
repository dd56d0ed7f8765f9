// SPDX-License-Identifier: Apache-2.0
// A fake external_api over host memory, for the host tests of external_arena / external_semaphore.
//
// Streams are tags. A fence recorded on a stream is pending while that stream is held (hold /
// release) or while a semaphore wait queued on it before the fence is unsatisfied (the GPU
// semantics: everything after a wait on a stream waits). Semaphore values are set by the test
// (set_value), standing in for Vulkan's signal. fds follow CUDA's rule: a successful import owns
// the fd; destroy closes it, and reports a fd that someone else closed first (premature_close).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "vmmalloc/vulkan_interop.hpp"

namespace fake {

inline bool fd_open(int fd) { return fd >= 0 && ::fcntl(fd, F_GETFD) != -1; }

// Open fds of this process (for leak checks).
inline int open_fds() {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd)
    if (fd_open(fd)) ++n;
  return n;
}

class api final : public vmm::vk::external_api {
 public:
  // failure injection
  bool fail_import = false, fail_map = false, fail_fence = false, fail_sem_import = false;
  // what happened
  std::vector<std::string> log;
  int premature_close = 0;       // an owned fd was closed by someone else before destroy
  int owned_memory_fd = -1;      // the fd the last successful import owns
  std::uint64_t imported_size = 0;
  bool imported_dedicated = false;
  int live_memories = 0, live_buffers = 0, live_semaphores = 0, live_fences = 0;

  const char* name() override { return "fake"; }

  vmm::result<void*> import_memory(int fd, std::uint64_t size, bool dedicated) override {
    log.push_back("import_memory");
    if (fail_import) return {nullptr, {vmm::errc::invalid_value, 1, "fake import failure", "fake_import"}};
    if (!fd_open(fd)) return {nullptr, {vmm::errc::invalid_value, 1, "fd not open", "fake_import"}};
    auto* m = new mem{fd, size, dedicated};
    owned_memory_fd = fd;
    imported_size = size;
    imported_dedicated = dedicated;
    ++live_memories;
    return {m, {}};
  }
  vmm::result<void*> map_buffer(void* memory, std::uint64_t offset, std::uint64_t size) override {
    log.push_back("map_buffer");
    auto* m = static_cast<mem*>(memory);
    if (fail_map) return {nullptr, {vmm::errc::out_of_memory, 2, "fake map failure", "fake_map"}};
    if (offset + size > m->size) return {nullptr, {vmm::errc::invalid_value, 1, "range", "fake_map"}};
    void* p = std::aligned_alloc(4096, (size + 4095) / 4096 * 4096);
    buffers.insert(p);
    ++live_buffers;
    return {p, {}};
  }
  vmm::status free_buffer(void* ptr) override {
    log.push_back("free_buffer");
    if (!buffers.erase(ptr)) return {vmm::errc::invalid_value, 1, "not a mapped buffer", "fake_free"};
    std::free(ptr);
    --live_buffers;
    return {};
  }
  vmm::status destroy_memory(void* memory) override {
    log.push_back("destroy_memory");
    auto* m = static_cast<mem*>(memory);
    if (!fd_open(m->fd)) ++premature_close;
    else ::close(m->fd);  // CUDA closes the fd it owns
    delete m;
    --live_memories;
    return {};
  }

  vmm::result<void*> import_semaphore(int fd, vmm::vk::semaphore_kind kind) override {
    log.push_back("import_semaphore");
    if (fail_sem_import) return {nullptr, {vmm::errc::not_supported, 3, "fake semaphore failure", "fake_sem"}};
    auto* s = new sem{fd, kind, 0};
    last_sem_ = s;
    ++live_semaphores;
    return {s, {}};
  }
  vmm::status signal_semaphore(void* s, std::uint64_t value, vmm::stream_t st) override {
    log.push_back("signal " + std::to_string(value) + " on " + sname(st));
    static_cast<sem*>(s)->value = value;  // immediate: fine for these tests
    return {};
  }
  vmm::status wait_semaphore(void* s, std::uint64_t value, vmm::stream_t st) override {
    log.push_back("wait " + std::to_string(value) + " on " + sname(st));
    waits[st].push_back({static_cast<sem*>(s), value});
    return {};
  }
  vmm::status destroy_semaphore(void* s) override {
    log.push_back("destroy_semaphore");
    auto* p = static_cast<sem*>(s);
    if (!fd_open(p->fd)) ++premature_close;
    else ::close(p->fd);
    for (auto& [st, v] : waits)
      for (auto& w : v)
        if (w.s == p) w.s = nullptr;  // a destroyed semaphore's waits count as satisfied
    delete p;
    --live_semaphores;
    return {};
  }

  vmm::result<vmm::fence_t> record_fence(vmm::stream_t st) override {
    log.push_back("record_fence on " + sname(st));
    if (fail_fence) return {0, {vmm::errc::other, 4, "fake fence failure", "fake_fence"}};
    const vmm::fence_t id = next_++;
    fences[id] = {st, held.count(st) != 0, waits[st].size()};
    ++live_fences;
    return {id, {}};
  }
  bool fence_done(vmm::fence_t f) override {
    auto it = fences.find(f);
    if (it == fences.end()) return true;
    const fence& fe = it->second;
    if (fe.held) return false;
    const auto& w = waits[fe.stream];
    for (std::size_t i = 0; i < fe.waits_before && i < w.size(); ++i)
      if (w[i].s && w[i].s->value < w[i].value) return false;
    return true;
  }
  vmm::status wait_fence(vmm::fence_t f) override {
    if (!fence_done(f)) return {vmm::errc::other, 5, "fake fence would block forever", "fake_wait"};
    return {};
  }
  void drop_fence(vmm::fence_t f) override {
    if (fences.erase(f)) --live_fences;
  }

  // ---- test controls ----
  void hold(vmm::stream_t s) { held.insert(s); }
  void release(vmm::stream_t s) {  // completes the stream's held fences
    held.erase(s);
    for (auto& [id, fe] : fences)
      if (fe.stream == s) fe.held = false;
  }
  static void set_value(void* semaphore_handle, std::uint64_t v) { static_cast<sem*>(semaphore_handle)->value = v; }
  void* last_semaphore() const { return last_sem_; }
  std::size_t waits_on(vmm::stream_t s) { return waits[s].size(); }

 private:
  struct mem {
    int fd;
    std::uint64_t size;
    bool dedicated;
  };
  struct sem {
    int fd;
    vmm::vk::semaphore_kind kind;
    std::uint64_t value;
  };
  struct wait_entry {
    sem* s;
    std::uint64_t value;
  };
  struct fence {
    vmm::stream_t stream;
    bool held;
    std::size_t waits_before;
  };
  static std::string sname(vmm::stream_t s) {  // appended: gcc 12's -Wrestrict misfires on "s" + temporary
    std::string n = "s";
    n += std::to_string(reinterpret_cast<std::uintptr_t>(s));
    return n;
  }
  std::set<void*> buffers;
  std::set<vmm::stream_t> held;
  std::map<vmm::stream_t, std::vector<wait_entry>> waits;
  std::map<vmm::fence_t, fence> fences;
  vmm::fence_t next_ = 1;
  void* last_sem_ = nullptr;

};

}  // namespace fake
