// SPDX-License-Identifier: Apache-2.0
// external_arena, external_semaphore, release_after: the CUDA side of Vulkan interop, written
// against external_api only (no Vulkan headers, no CUDA runtime), so CI tests it on a fake.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "vmmalloc/vulkan_interop.hpp"

namespace vmm::vk {

const char* semaphore_kind_name(semaphore_kind k) noexcept {
  return k == semaphore_kind::timeline ? "timeline" : "binary";
}

namespace {

status fail(errc e, const char* what, const char* op) { return {e, 0, what, op}; }

// The fd rule: the library imports a dup (close-on-exec), never the caller's fd.
result<int> dup_fd(int fd, const char* op) {
  if (fd < 0) return {-1, fail(errc::invalid_value, "fd < 0", op)};
  int d = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (d < 0) {
    const int e = errno;
    return {-1, {e == EBADF ? errc::invalid_value : errc::other, e,
                 e == EBADF ? "EBADF: not an open fd" : "dup failed", op}};
  }
  return {d, {}};
}

bool pow2(std::uint64_t x) { return x && !(x & (x - 1)); }

// a rounded up to a power of two `al`; false on overflow.
bool align_up(std::uint64_t a, std::uint64_t al, std::uint64_t& out) {
  if (a > UINT64_MAX - (al - 1)) return false;
  out = (a + al - 1) & ~(al - 1);
  return true;
}

}  // namespace

// ---- external_arena ------------------------------------------------------------------------------

struct external_arena::impl {
  // A fence shared by the pieces of a deferred block that was split; dropped with the last piece.
  struct fence_ref {
    fence_ref(external_api* a, fence_t fe) : api(a), f(fe) {}
    fence_ref(const fence_ref&) = delete;
    fence_ref& operator=(const fence_ref&) = delete;
    ~fence_ref() { api->drop_fence(f); }
    external_api* api;
    fence_t f;
    bool done = false;
  };
  enum class state : std::uint8_t { free, live, deferred };
  struct block {
    std::uint64_t size = 0;
    state st = state::free;
    stream_t stream = nullptr;             // live: allocated on; deferred: freed on
    std::uint64_t requested = 0;           // live only
    std::shared_ptr<fence_ref> fence;      // deferred only
  };

  std::shared_ptr<external_api> api;
  void* memory = nullptr;  // the external memory (cudaExternalMemory_t)
  std::uintptr_t base = 0;
  std::uint64_t size = 0;
  bool dedicated = false;
  std::uint64_t alignment = 256;

  mutable std::mutex mu;
  std::map<std::uint64_t, block> blocks;  // offset -> block; the blocks tile [0, size)
  arena_stats st;                         // capacity, allocated, requested, deferred, counters

  // Deferred blocks whose fence completed become free; then free neighbours merge. O(blocks).
  void reap() {
    for (auto& [off, b] : blocks) {
      if (b.st != state::deferred) continue;
      if (!b.fence->done && api->fence_done(b.fence->f)) b.fence->done = true;
      if (b.fence->done) {
        b.st = state::free;
        b.fence.reset();
        b.stream = nullptr;
        st.deferred -= b.size;
        --st.deferred_blocks;
      }
    }
    merge_all();
  }

  void merge_all() {
    for (auto it = blocks.begin(); it != blocks.end();) {
      auto nx = std::next(it);
      if (nx != blocks.end() && it->second.st == state::free && nx->second.st == state::free) {
        it->second.size += nx->second.size;
        blocks.erase(nx);
      } else {
        it = nx;
      }
    }
  }

  status allocate(std::uint64_t bytes, std::uint64_t al, stream_t s, void*& out) {
    out = nullptr;
    if (!memory) return fail(errc::invalid_value, "empty arena", "external_arena::allocate");
    if (bytes == 0) return fail(errc::invalid_value, "size 0", "external_arena::allocate");
    if (al == 0) al = alignment;
    if (!pow2(al)) return fail(errc::invalid_value, "alignment not a power of two", "external_arena::allocate");
    if (al < alignment) al = alignment;
    if (al > size) return fail(errc::invalid_value, "alignment larger than the arena", "external_arena::allocate");
    std::uint64_t need;
    if (bytes > size || !align_up(bytes, alignment, need) || need > size)
      return fail(errc::out_of_memory, "larger than the arena", "external_arena::allocate");
    reap();
    for (auto it = blocks.begin(); it != blocks.end(); ++it) {
      const std::uint64_t off = it->first;
      block& b = it->second;
      // Free blocks serve every stream; a block deferred on s serves s (ordered behind the free).
      if (!(b.st == state::free || (b.st == state::deferred && b.stream == s))) continue;
      std::uint64_t a;
      if (!align_up(base + off, al, a)) continue;
      a -= base;
      if (a - off > b.size || b.size - (a - off) < need) continue;
      const block orig = b;  // the pieces around the allocation keep its state and fence
      const bool was_deferred = orig.st == state::deferred;
      if (a > off) {
        b.size = a - off;  // prefix stays as it was
      } else {
        blocks.erase(it);
      }
      block live;
      live.size = need;
      live.st = state::live;
      live.stream = s;
      live.requested = bytes;
      blocks[a] = live;
      const std::uint64_t end = a + need, orig_end = off + orig.size;
      if (end < orig_end) {
        block rest = orig;
        rest.size = orig_end - end;
        blocks[end] = rest;
      }
      if (was_deferred) {
        st.deferred -= need;
        if (a == off && end == orig_end) --st.deferred_blocks;
        if (a > off && end < orig_end) ++st.deferred_blocks;  // split into two deferred pieces
        ++st.reused_same_stream;
      }
      st.allocated += need;
      st.requested += bytes;
      ++st.live;
      ++st.allocs;
      out = reinterpret_cast<void*>(base + a);
      return {};
    }
    return fail(errc::out_of_memory,
                st.deferred ? "no free block fits (some memory is deferred: freed on other streams, "
                              "fences pending)"
                            : "no free block fits",
                "external_arena::allocate");
  }

  // The live block starting at p, or end().
  std::map<std::uint64_t, block>::iterator live_at(const void* p) {
    const auto u = reinterpret_cast<std::uintptr_t>(p);
    if (!memory || u < base || u - base >= size) return blocks.end();
    auto it = blocks.find(u - base);
    if (it == blocks.end() || it->second.st != state::live) return blocks.end();
    return it;
  }

  status deallocate(void* p, stream_t s) {
    auto it = live_at(p);
    if (it == blocks.end())
      return fail(errc::invalid_pointer, "not a live block of this arena (foreign, interior or freed)",
                  "external_arena::deallocate");
    auto f = api->record_fence(s);
    if (!f.ok()) return f.st;  // the block stays live
    std::shared_ptr<fence_ref> ref;
    try {
      ref = std::make_shared<fence_ref>(api.get(), f.value);
    } catch (const std::bad_alloc&) {
      api->drop_fence(f.value);
      return fail(errc::out_of_memory, "host memory for the fence", "external_arena::deallocate");
    }
    block& b = it->second;
    b.st = state::deferred;
    b.stream = s;
    b.fence = std::move(ref);
    st.allocated -= b.size;
    st.requested -= b.requested;
    b.requested = 0;
    st.deferred += b.size;
    ++st.deferred_blocks;
    --st.live;
    ++st.frees;
    return {};
  }

  status synchronize() {
    status first;
    for (auto& [off, b] : blocks)
      if (b.st == state::deferred && !b.fence->done) {
        status w = api->wait_fence(b.fence->f);
        if (w.ok()) b.fence->done = true;
        else if (first.ok()) first = w;
      }
    reap();
    return first;
  }

  status teardown() {
    if (!memory) return {};
    status first = synchronize();
    blocks.clear();  // drops the fences
    // The seed's order: the mapped buffer first, then the external memory (which closes its fd).
    if (status f = api->free_buffer(reinterpret_cast<void*>(base)); !f.ok() && first.ok()) first = f;
    if (status d = api->destroy_memory(memory); !d.ok() && first.ok()) first = d;
    memory = nullptr;
    base = 0;
    return first;
  }
};

external_arena::external_arena() = default;
external_arena::external_arena(external_arena&&) noexcept = default;
external_arena& external_arena::operator=(external_arena&& o) noexcept {
  if (this != &o) {
    close();
    p_ = std::move(o.p_);
  }
  return *this;
}
external_arena::~external_arena() { close(); }

status external_arena::close() noexcept {
  if (!p_) return {};
  std::lock_guard g(p_->mu);
  return p_->teardown();
}

status external_arena::try_import(std::shared_ptr<external_api> api, int fd, std::uint64_t size,
                                  bool dedicated, external_arena& out, const arena_options& o) noexcept {
  static constexpr const char* op = "external_arena::import";
  if (!api) return fail(errc::invalid_value, "no external_api", op);
  if (fd < 0) return fail(errc::invalid_value, "fd < 0", op);
  if (size == 0) return fail(errc::invalid_value, "size 0", op);
  if (!pow2(o.alignment)) return fail(errc::invalid_value, "alignment not a power of two", op);
  if (o.alignment > size) return fail(errc::invalid_value, "alignment larger than the memory", op);
  std::unique_ptr<impl> m;
  try {
    m = std::make_unique<impl>();
    m->blocks.emplace(0, impl::block{size, impl::state::free, nullptr, 0, nullptr});
  } catch (const std::bad_alloc&) {
    return fail(errc::out_of_memory, "host memory for the arena", op);
  }
  auto d = dup_fd(fd, op);
  if (!d.ok()) return d.st;
  auto mem = api->import_memory(d.value, size, dedicated);
  if (!mem.ok()) {
    ::close(d.value);  // a failed import leaves the fd with us: close our dup
    return mem.st;
  }
  // From here CUDA owns the dup: only destroy_memory may close it.
  auto ptr = api->map_buffer(mem.value, 0, size);
  if (!ptr.ok()) {
    api->destroy_memory(mem.value);
    return ptr.st;
  }
  m->api = std::move(api);
  m->memory = mem.value;
  m->base = reinterpret_cast<std::uintptr_t>(ptr.value);
  m->size = size;
  m->dedicated = dedicated;
  m->alignment = o.alignment;
  m->st.capacity = size;
  out = external_arena();  // tears down what `out` held
  out.p_ = std::move(m);
  return {};
}

external_arena external_arena::import(std::shared_ptr<external_api> api, int fd, std::uint64_t size,
                                      bool dedicated, const arena_options& o) {
  external_arena a;
  if (status s = try_import(std::move(api), fd, size, dedicated, a, o); !s.ok())
    throw_status(s, "vmm::vk::external_arena::import(" + std::to_string(size) + " B)");
  return a;
}

void* external_arena::try_allocate(std::uint64_t bytes, std::uint64_t alignment, stream_t s) noexcept {
  if (!p_) return nullptr;
  std::lock_guard g(p_->mu);
  void* out = nullptr;
  p_->allocate(bytes, alignment, s, out);
  return out;
}

void* external_arena::allocate(std::uint64_t bytes, std::uint64_t alignment, stream_t s) {
  if (!p_) throw_status(fail(errc::invalid_value, "empty arena", "external_arena::allocate"), "vmm::vk::external_arena");
  void* out = nullptr;
  status st;
  {
    std::lock_guard g(p_->mu);
    st = p_->allocate(bytes, alignment, s, out);
  }
  if (!st.ok()) throw_status(st, "vmm::vk::external_arena::allocate(" + std::to_string(bytes) + ")");
  return out;
}

status external_arena::try_deallocate(void* p, stream_t s) noexcept {
  if (!p) return {};
  if (!p_) return fail(errc::invalid_pointer, "empty arena", "external_arena::deallocate");
  std::lock_guard g(p_->mu);
  return p_->deallocate(p, s);
}

void external_arena::deallocate(void* p, stream_t s) {
  if (status st = try_deallocate(p, s); !st.ok()) throw_status(st, "vmm::vk::external_arena::deallocate");
}

bool external_arena::owns(const void* p) const noexcept {
  if (!p_) return false;
  std::lock_guard g(p_->mu);
  return p_->live_at(p) != p_->blocks.end();
}

std::uint64_t external_arena::offset_of(const void* p) const {
  const auto u = reinterpret_cast<std::uintptr_t>(p);
  if (!p_ || !p_->memory || u < p_->base || u - p_->base >= p_->size)
    throw_status(fail(errc::invalid_pointer, "outside the arena", "external_arena::offset_of"),
                 "vmm::vk::external_arena::offset_of");
  return u - p_->base;
}

void* external_arena::base() const noexcept { return p_ ? reinterpret_cast<void*>(p_->base) : nullptr; }
std::uint64_t external_arena::size() const noexcept { return p_ && p_->memory ? p_->size : 0; }
bool external_arena::dedicated() const noexcept { return p_ && p_->dedicated; }

arena_stats external_arena::stats() const {
  if (!p_) return {};
  std::lock_guard g(p_->mu);
  arena_stats s = p_->st;
  s.free = s.capacity - s.allocated - s.deferred;
  for (const auto& [off, b] : p_->blocks)
    if (b.st == impl::state::free && b.size > s.largest_free) s.largest_free = b.size;
  return s;
}

status external_arena::synchronize() noexcept {
  if (!p_) return {};
  std::lock_guard g(p_->mu);
  return p_->synchronize();
}

std::string external_arena::check() const {
  if (!p_ || !p_->memory) return "";
  std::lock_guard g(p_->mu);
  const impl& m = *p_;
  std::uint64_t at = 0, allocated = 0, requested = 0, deferred = 0, live = 0, ndef = 0;
  bool prev_free = false;
  for (const auto& [off, b] : m.blocks) {
    if (off != at) return "block at " + std::to_string(off) + " does not start where the last ended (" + std::to_string(at) + ")";
    if (b.size == 0) return "empty block at " + std::to_string(off);
    const bool is_free = b.st == impl::state::free;
    if (is_free && prev_free) return "two free neighbours at " + std::to_string(off);
    prev_free = is_free;
    switch (b.st) {
      case impl::state::free:
        if (b.fence) return "free block with a fence at " + std::to_string(off);
        break;
      case impl::state::live:
        if (b.size % m.alignment) return "live block at " + std::to_string(off) + " not a multiple of the alignment";
        allocated += b.size;
        requested += b.requested;
        ++live;
        if (b.requested == 0 || b.requested > b.size) return "live block with a bad requested size at " + std::to_string(off);
        break;
      case impl::state::deferred:
        if (!b.fence) return "deferred block without a fence at " + std::to_string(off);
        deferred += b.size;
        ++ndef;
        break;
    }
    at = off + b.size;
  }
  if (at != m.size) return "blocks end at " + std::to_string(at) + ", not at the size " + std::to_string(m.size);
  if (allocated != m.st.allocated) return "allocated bytes disagree with the stats";
  if (requested != m.st.requested) return "requested bytes disagree with the stats";
  if (deferred != m.st.deferred) return "deferred bytes disagree with the stats";
  if (live != m.st.live) return "live count disagrees with the stats";
  if (ndef != m.st.deferred_blocks) return "deferred block count disagrees with the stats";
  return "";
}

// ---- external_semaphore --------------------------------------------------------------------------

external_semaphore::external_semaphore() = default;
external_semaphore::external_semaphore(external_semaphore&& o) noexcept
    : api_(std::move(o.api_)), sem_(std::exchange(o.sem_, nullptr)), kind_(o.kind_) {}
external_semaphore& external_semaphore::operator=(external_semaphore&& o) noexcept {
  if (this != &o) {
    close();
    api_ = std::move(o.api_);
    sem_ = std::exchange(o.sem_, nullptr);
    kind_ = o.kind_;
  }
  return *this;
}
external_semaphore::~external_semaphore() { close(); }

status external_semaphore::close() noexcept {
  if (!sem_) return {};
  status s = api_->destroy_semaphore(sem_);
  sem_ = nullptr;
  return s;
}

status external_semaphore::try_import(std::shared_ptr<external_api> api, int fd, semaphore_kind kind,
                                      external_semaphore& out) noexcept {
  static constexpr const char* op = "external_semaphore::import";
  if (!api) return fail(errc::invalid_value, "no external_api", op);
  if (kind != semaphore_kind::binary && kind != semaphore_kind::timeline)
    return fail(errc::invalid_value, "unknown semaphore kind", op);
  auto d = dup_fd(fd, op);
  if (!d.ok()) return d.st;
  auto s = api->import_semaphore(d.value, kind);
  if (!s.ok()) {
    ::close(d.value);
    return s.st;
  }
  out.close();
  out.api_ = std::move(api);
  out.sem_ = s.value;
  out.kind_ = kind;
  return {};
}

external_semaphore external_semaphore::import(std::shared_ptr<external_api> api, int fd, semaphore_kind kind) {
  external_semaphore e;
  if (status s = try_import(std::move(api), fd, kind, e); !s.ok())
    throw_status(s, std::string("vmm::vk::external_semaphore::import(") + semaphore_kind_name(kind) + ")");
  return e;
}

semaphore_kind external_semaphore::kind() const noexcept { return kind_; }
bool external_semaphore::valid() const noexcept { return sem_ != nullptr; }

namespace {
status check_value(const external_semaphore& e, std::uint64_t value, const char* op) {
  if (!e.valid()) return fail(errc::invalid_value, "empty semaphore", op);
  if (e.kind() == semaphore_kind::binary && value != 0)
    return fail(errc::invalid_value, "a binary semaphore takes value 0", op);
  return {};
}
}  // namespace

status external_semaphore::try_signal(std::uint64_t value, stream_t s) noexcept {
  if (status c = check_value(*this, value, "external_semaphore::signal"); !c.ok()) return c;
  return api_->signal_semaphore(sem_, value, s);
}

status external_semaphore::try_wait(std::uint64_t value, stream_t s) noexcept {
  if (status c = check_value(*this, value, "external_semaphore::wait"); !c.ok()) return c;
  return api_->wait_semaphore(sem_, value, s);
}

void external_semaphore::signal(std::uint64_t value, stream_t s) {
  if (status st = try_signal(value, s); !st.ok()) throw_status(st, "vmm::vk::external_semaphore::signal");
}

void external_semaphore::wait(std::uint64_t value, stream_t s) {
  if (status st = try_wait(value, s); !st.ok()) throw_status(st, "vmm::vk::external_semaphore::wait");
}

// ---- release_after -------------------------------------------------------------------------------

void release_after(external_semaphore& sem, std::uint64_t value, external_arena& a, void* p, stream_t s) {
  // Check everything before queueing the wait: bad input queues nothing.
  if (!a.owns(p))
    throw_status(fail(errc::invalid_pointer, "not a live block of this arena", "release_after"),
                 "vmm::vk::release_after");
  sem.wait(value, s);
  a.deallocate(p, s);  // the fence it records sits behind the wait
}

void release_after(external_semaphore& sem, std::uint64_t value, allocator& a, void* p, stream_t s) {
  if (!p || a.usable_size(p) == 0)
    throw_status(fail(errc::invalid_pointer, "not a live allocation of this allocator", "release_after"),
                 "vmm::vk::release_after");
  sem.wait(value, s);
  a.deallocate(p, s);  // reuse on another stream waits for a fence recorded behind the wait
}

}  // namespace vmm::vk
