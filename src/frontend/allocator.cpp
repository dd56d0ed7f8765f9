// allocator: the C++ front end. One lock serialises heap and arena; the arena's mapping work
// only happens inside heap calls that had to grow or release (the slow path).
#include <mutex>

#include "vmmalloc/vmmalloc.hpp"

namespace vmm {

namespace {
class category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "vmmalloc"; }
  std::string message(int c) const override { return errc_name(static_cast<errc>(c)); }
};

thread_local last_error_info tl_last;

void set_last(const status& s, const char* context) {
  tl_last.st = s;
  tl_last.message = s.ok() ? std::string() : std::string(context) + ": " + s.message();
}
}  // namespace

const std::error_category& category() noexcept {
  static category_impl c;
  return c;
}

const last_error_info& last_error() noexcept { return tl_last; }

error::error(const status& s, const std::string& what)
    : std::system_error(make_error_code(s.kind), what), st_(s) {}

void throw_status(const status& s, const std::string& context) {
  std::string msg = context + ": " + s.message();
  if (s.kind == errc::out_of_memory) throw out_of_memory(s, msg);
  throw error(s, msg);
}

struct allocator::impl {
  std::unique_ptr<arena> ar;
  std::unique_ptr<heap> hp;
  mutable std::mutex mu;
};

allocator::allocator(std::unique_ptr<backend_iface> b, const options& o) : p_(std::make_unique<impl>()) {
  p_->ar = std::make_unique<arena>(std::move(b), o);
  status s = p_->ar->open();
  if (!s.ok()) throw_status(s, "vmm::allocator");
  p_->hp = std::make_unique<heap>(*p_->ar);
}

static std::unique_ptr<backend_iface> make_cuda(int device) {
  auto m = std::make_unique<backend_model<cuda_backend>>(device);
  if (!m->get().available()) throw error(m->get().load_status(), m->get().load_message());
  return m;
}

allocator::allocator(const options& o) : allocator(make_cuda(o.device), o) {}

allocator::~allocator() {
  if (!p_) return;
  p_->hp.reset();  // metadata first, then the arena unmaps and releases everything
  p_->ar.reset();
}
allocator::allocator(allocator&&) noexcept = default;
allocator& allocator::operator=(allocator&&) noexcept = default;

allocator allocator::host(const options& o, const host_backend_options& h) {
  return allocator(make_backend<host_backend>(h), o);
}

void* allocator::try_allocate(std::size_t bytes, std::size_t alignment, stream_t s) noexcept {
  if (alignment == 0) alignment = p_->ar->opts().alignment;
  result<std::uintptr_t> r;
  {
    std::lock_guard g(p_->mu);
    r = p_->hp->allocate(bytes, alignment, s);
  }
  if (!r.ok()) {
    set_last(r.st, "allocate");
    return nullptr;
  }
  return reinterpret_cast<void*>(r.value);
}

void* allocator::allocate(std::size_t bytes, std::size_t alignment, stream_t s) {
  void* p = try_allocate(bytes, alignment, s);
  if (!p) throw_status(tl_last.st, "vmm::allocator::allocate(" + std::to_string(bytes) + ")");
  return p;
}

status allocator::try_deallocate(void* p, stream_t s) noexcept {
  if (!p) return {};
  status st;
  {
    std::lock_guard g(p_->mu);
    st = p_->hp->deallocate(reinterpret_cast<std::uintptr_t>(p), s);
  }
  if (!st.ok()) set_last(st, "deallocate");
  return st;
}

void allocator::deallocate(void* p, stream_t s) {
  status st = try_deallocate(p, s);
  if (!st.ok()) throw_status(st, "vmm::allocator::deallocate");
}

void allocator::record_stream(void* p, stream_t s) {
  status st;
  {
    std::lock_guard g(p_->mu);
    st = p_->hp->record_stream(reinterpret_cast<std::uintptr_t>(p), s);
  }
  if (!st.ok()) throw_status(st, "vmm::allocator::record_stream");
}

std::size_t allocator::usable_size(const void* p) const {
  std::lock_guard g(p_->mu);
  return p_->hp->usable_size(reinterpret_cast<std::uintptr_t>(p));
}

void allocator::trim(std::size_t keep) {
  status st;
  {
    std::lock_guard g(p_->mu);
    st = p_->hp->trim(keep);
  }
  if (!st.ok()) throw_status(st, "vmm::allocator::trim");
}

allocator_stats allocator::stats() const {
  std::lock_guard g(p_->mu);
  heap_stats h = p_->hp->stats();
  arena_stats a = p_->ar->stats();
  allocator_stats s;
  s.requested = h.requested;
  s.allocated = h.allocated;
  s.peak_requested = h.peak_requested;
  s.peak_allocated = h.peak_allocated;
  s.mapped = a.mapped;
  s.physical = a.physical;
  s.reserved = a.reserved;
  s.peak_mapped = a.peak_mapped;
  s.peak_physical = a.peak_physical;
  s.chunks = a.chunks;
  s.idle = a.idle;
  s.free_chunk_bytes = a.free_chunk_bytes;
  s.slab_bytes = h.slab_bytes;
  s.allocs = h.allocs;
  s.frees = h.frees;
  s.live = h.live;
  s.deferred = h.deferred;
  s.grows = h.grows;
  s.chunk_releases = h.chunk_releases;
  s.trims = h.trims;
  s.stitched = a.stitched;
  s.compression_fallbacks = a.compression_fallbacks;
  s.calls = a.calls;
  return s;
}

void allocator::reset_peaks() {
  std::lock_guard g(p_->mu);
  p_->hp->reset_peaks();
  p_->ar->reset_peaks();
}

std::string allocator::check() const {
  std::lock_guard g(p_->mu);
  return p_->hp->check();
}

std::size_t allocator::granularity() const { return p_->ar->granularity(); }
const options& allocator::opts() const { return p_->ar->opts(); }
backend_iface& allocator::backend() { return p_->ar->backend(); }

}  // namespace vmm
