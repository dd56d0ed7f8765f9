// SPDX-License-Identifier: Apache-2.0
// bench_kvcache: the decode workload of a serving engine, on four KV-cache schemes.
//
// Workload: 64 sequence slots, always full. Each sequence has a random prompt (32-2048 tokens,
// prefilled at once when it opens) and a random output length (32-1024 tokens). One step appends
// 1 token to every sequence (decode); a sequence that reached prompt + output closes and a new one
// opens and prefills in its slot at the start of the next step. The same seeded schedule drives
// every scheme. Nothing reads or writes the KV bytes: this measures the memory management only
// (the copy scheme's copies are part of its management).
//
//   vmmalloc kv_cache           vmm::kv_cache, no map-ahead: appends map pages themselves
//   vmmalloc kv_cache + ahead   map_ahead_pages = --ahead (1) or map_ahead_tokens = --ahead_tokens
//                               (128): a thread maps ahead of need
//   block table (16 tokens)     PagedAttention style: one preallocated pool (cudaMalloc), 16-token
//                               blocks over all layers from a free list, a block table per sequence
//   cudaMalloc + copy (x2)      one buffer per sequence; when full, cudaMalloc twice the capacity
//                               (geometric; first capacity = prompt rounded up to a power of two,
//                               capped at the maximum), cudaMemcpy the old contents, cudaFree it
//
// Shape (default): Llama-2-7B-like with GQA: 32 layers, 8 KV heads, head dim 128, fp16: 2 KiB per
// token per layer per K|V, 128 KiB per token over all layers; max 3072 tokens a sequence, so 64
// full sequences are 24 GiB. vmm pages are 2 MiB (the granularity): 1024 tokens per page.
//
// Columns: decode appends per second (only the 64 appends of each step are timed); mean and
// max of a whole step (turnover: closes, opens and prefills, then the decode appends); driver calls
// per step made inside decode appends, made by the map-ahead thread, and in all; mapped / used
// bytes (averaged over steps; mapped = physical memory held for KV: vmm pages, the whole block
// pool, the copy buffers' capacity); peak mapped; vmm pages reused / created.
//
// On a machine without a GPU the vmm schemes run on the host backend and the GPU schemes are
// left out (said on stderr). --quick: a small shape and few steps (a smoke test, seconds); then the
// two GPU schemes run over host malloc as stand-ins when there is no GPU.
//
// Map-ahead runs three times: --ahead (1) whole pages with steps back to back (the thread races
// the appends), the same with --model_us (2000) of sleep between steps standing in for the model's
// forward pass (a 7B model's decode step at batch 64 takes longer than that on an H100: the time a
// real server gives the thread), and --ahead_tokens (128) tokens ahead with the same model time
// (the next page is mapped only near a sequence's end: less memory held ahead).
//
//   bench_kvcache [--quick] [--steps=N] [--seed=N] [--ahead=PAGES] [--ahead_tokens=N] [--model_us=N] [--host]
//   (Google Benchmark flags such as --benchmark_min_time are accepted and ignored.)
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "peers.hpp"
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/kv_cache.hpp"

namespace {

using clk = std::chrono::steady_clock;
constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;

struct shape {
  std::size_t layers, kv_heads, head_dim, elem_bytes, max_tokens;
  std::size_t token_bytes() const { return kv_heads * head_dim * elem_bytes; }  // one layer, K or V
  std::size_t all_bytes() const { return 2 * layers * token_bytes(); }          // one token, everything
};

struct options {
  bool quick = false, force_host = false;
  int steps = 3000;
  std::uint64_t seed = 1;
  std::size_t ahead = 1, ahead_tokens = 128;
  int model_us = -1;  // -1: 2000 (full) or 200 (quick)
};

// What a scheme has done so far (driver/runtime calls) and holds now.
struct counts {
  std::uint64_t all = 0, append_path = 0, thread = 0;
};

class scheme {
 public:
  virtual ~scheme() = default;
  virtual std::string name() const = 0;
  virtual int open(std::size_t prompt) = 0;  // opens a sequence and prefills it; returns its handle
  virtual void append1(int h) = 0;           // one decode token
  virtual void close(int h) = 0;
  virtual counts calls() const = 0;
  virtual std::size_t mapped_bytes() const = 0;
  virtual std::size_t used_bytes() const = 0;
  virtual std::string pages() const { return "-"; }
  virtual void settle() {}
  virtual std::string check() const { return {}; }  // "" when its own accounting agrees
};

// ---- vmm::kv_cache ----

class vmm_scheme final : public scheme {
 public:
  vmm_scheme(vmm::kv_cache kv, std::string name) : kv_(std::move(kv)), name_(std::move(name)) {}
  std::string name() const override { return name_; }
  int open(std::size_t prompt) override {
    const auto s = kv_.open();
    kv_.append(s, prompt);
    tokens_ += prompt;
    return static_cast<int>(s);
  }
  void append1(int h) override {
    kv_.append(static_cast<vmm::seq_id>(h), 1);
    ++tokens_;
  }
  void close(int h) override {
    tokens_ -= kv_.length(static_cast<vmm::seq_id>(h));
    kv_.close(static_cast<vmm::seq_id>(h));
  }
  counts calls() const override {
    const auto s = kv_.stats();
    return {s.driver_calls, s.append_driver_calls, s.map_ahead_driver_calls};
  }
  std::size_t mapped_bytes() const override { return kv_.stats().mapped_bytes; }
  std::size_t used_bytes() const override { return kv_.stats().used_bytes; }
  std::string pages() const override {
    const auto s = kv_.stats();
    std::string r = std::to_string(s.pages_reused);
    if (s.pages_retained_reused) r += " + " + std::to_string(s.pages_retained_reused) + " still mapped";
    return r + " / " + std::to_string(s.pages_created);
  }
  std::string check() const override {
    const auto s = kv_.stats();
    if (s.used_bytes != tokens_ * 2 * kv_.config().layers * kv_.token_bytes())
      return "kv_cache used_bytes " + std::to_string(s.used_bytes) + " disagrees with the workload's tokens";
    if (s.mapped_bytes < s.used_bytes) return "kv_cache maps less than it uses";
    return {};
  }
  const vmm::kv_cache& kv() const { return kv_; }

 private:
  vmm::kv_cache kv_;
  std::string name_;
  std::size_t tokens_ = 0;
};

// ---- PagedAttention-style block table ----

class block_scheme final : public scheme {
 public:
  static constexpr std::size_t block_tokens = 16;
  block_scheme(std::unique_ptr<vmm::replay::peer> mem, const shape& sh, std::size_t slots)
      : mem_(std::move(mem)), sh_(sh) {
    // The pool holds every slot at its maximum: a block table never runs out, like vLLM sized to fit.
    const std::size_t per_seq = (sh.max_tokens + block_tokens - 1) / block_tokens;
    nblocks_ = per_seq * slots;
    pool_bytes_ = nblocks_ * block_tokens * sh.all_bytes();
    pool_ = mem_->allocate(pool_bytes_, nullptr);  // untimed, once
    if (!pool_)
      throw std::runtime_error("block pool of " + std::to_string(pool_bytes_ >> 20) +
                               " MiB: " + vmm::replay::peer::error());
    free_.reserve(nblocks_);
    for (std::size_t i = nblocks_; i-- > 0;) free_.push_back(static_cast<std::uint32_t>(i));
    seqs_.resize(slots);
    for (auto& s : seqs_) s.table.reserve(per_seq);
  }
  ~block_scheme() override {
    if (pool_) mem_->deallocate(pool_, pool_bytes_, nullptr);
  }
  std::string name() const override { return "block table (16 tokens)"; }
  int open(std::size_t prompt) override {
    int h = 0;
    while (seqs_[static_cast<std::size_t>(h)].open) ++h;
    seq& s = seqs_[static_cast<std::size_t>(h)];
    s.open = true;
    s.len = 0;
    for (std::size_t i = 0; i < prompt; ++i) grow(s);
    return h;
  }
  void append1(int h) override { grow(seqs_[static_cast<std::size_t>(h)]); }
  void close(int h) override {
    seq& s = seqs_[static_cast<std::size_t>(h)];
    free_.insert(free_.end(), s.table.begin(), s.table.end());
    tokens_ -= s.len;
    s.table.clear();
    s.open = false;
  }
  counts calls() const override { return {}; }  // the pool's one cudaMalloc was before the run
  std::size_t mapped_bytes() const override { return pool_bytes_; }
  std::size_t used_bytes() const override { return tokens_ * sh_.all_bytes(); }
  std::string pages() const override {
    return "blocks in use at peak: " + std::to_string(peak_used_) + " of " + std::to_string(nblocks_);
  }
  std::string check() const override {
    std::size_t in_tables = 0;
    for (auto& s : seqs_) in_tables += s.table.size();
    return in_tables + free_.size() == nblocks_ ? "" : "block table lost blocks";
  }

 private:
  struct seq {
    bool open = false;
    std::size_t len = 0;
    std::vector<std::uint32_t> table;  // block ids; the kernel reads this to find token t
  };
  void grow(seq& s) {
    if (s.len % block_tokens == 0) {
      s.table.push_back(free_.back());  // never empty: the pool fits every slot at max
      free_.pop_back();
      peak_used_ = std::max(peak_used_, nblocks_ - free_.size());
    }
    ++s.len;
    ++tokens_;
  }
  std::unique_ptr<vmm::replay::peer> mem_;
  shape sh_;
  void* pool_ = nullptr;
  std::size_t nblocks_ = 0, pool_bytes_ = 0, tokens_ = 0, peak_used_ = 0;
  std::vector<std::uint32_t> free_;
  std::vector<seq> seqs_;
};

// ---- one buffer per sequence, grown by allocate + copy + free ----

class copy_scheme final : public scheme {
 public:
  copy_scheme(std::unique_ptr<vmm::replay::peer> mem, const shape& sh, std::size_t slots, std::string label)
      : mem_(std::move(mem)), sh_(sh), label_(std::move(label)) {
    seqs_.resize(slots);
  }
  ~copy_scheme() override {
    for (auto& s : seqs_)
      if (s.p) mem_->deallocate(s.p, s.cap * sh_.all_bytes(), nullptr);
  }
  std::string name() const override { return label_; }
  int open(std::size_t prompt) override {
    int h = 0;
    while (seqs_[static_cast<std::size_t>(h)].p) ++h;
    seq& s = seqs_[static_cast<std::size_t>(h)];
    std::size_t cap = 32;
    while (cap < prompt) cap *= 2;
    s.cap = std::min(cap, sh_.max_tokens);
    s.p = alloc(s.cap);
    s.len = prompt;
    tokens_ += prompt;
    return h;
  }
  void append1(int h) override {
    seq& s = seqs_[static_cast<std::size_t>(h)];
    if (s.len == s.cap) {
      const std::size_t cap = std::min(2 * s.cap, sh_.max_tokens);
      void* p = alloc(cap);
      ++calls_;
      if (!mem_->copy(p, s.p, s.len * sh_.all_bytes())) fail("copy");
      release(s);
      s.p = p;
      s.cap = cap;
    }
    ++s.len;
    ++tokens_;
  }
  void close(int h) override {
    seq& s = seqs_[static_cast<std::size_t>(h)];
    tokens_ -= s.len;
    release(s);
    s.p = nullptr;
  }
  counts calls() const override { return {calls_, calls_, 0}; }
  std::size_t mapped_bytes() const override { return held_; }
  std::size_t used_bytes() const override { return tokens_ * sh_.all_bytes(); }
  void settle() override { mem_->synchronize(); }

 private:
  struct seq {
    void* p = nullptr;
    std::size_t cap = 0, len = 0;
  };
  [[noreturn]] void fail(const char* what) const {
    throw std::runtime_error(std::string(what) + ": " + vmm::replay::peer::error());
  }
  void* alloc(std::size_t cap) {
    ++calls_;
    void* p = mem_->allocate(cap * sh_.all_bytes(), nullptr);
    if (!p) fail("allocate");
    held_ += cap * sh_.all_bytes();
    return p;
  }
  void release(seq& s) {
    ++calls_;
    if (!mem_->deallocate(s.p, s.cap * sh_.all_bytes(), nullptr)) fail("free");
    held_ -= s.cap * sh_.all_bytes();
  }
  std::unique_ptr<vmm::replay::peer> mem_;
  shape sh_;
  std::string label_;
  std::vector<seq> seqs_;
  std::size_t tokens_ = 0, held_ = 0;
  std::uint64_t calls_ = 0;
};

// ---- the harness ----

struct schedule {
  std::vector<std::pair<std::size_t, std::size_t>> seqs;  // prompt, output
};

schedule make_schedule(std::uint64_t seed, std::size_t n, std::size_t max_prompt, std::size_t max_output) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::size_t> prompt(32, max_prompt), output(32, max_output);
  schedule s;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t p = prompt(rng);
    s.seqs.push_back({p, output(rng)});
  }
  return s;
}

struct result {
  std::string name, note;
  bool ok = false;
  double appends_per_s = 0, step_mean_us = 0, step_max_us = 0;
  double decode_calls_per_step = 0, thread_calls_per_step = 0, all_calls_per_step = 0;
  double mapped_over_used = 0, peak_mapped_gib = 0;
  std::string pages;
  std::uint64_t decode_appends = 0, opened = 0;
};

// model_us: the model's forward pass between steps, simulated by sleeping (untimed): what a
// background thread has in a real server to work in. 0 = steps back to back.
result run(scheme& sc, const schedule& sched, std::size_t slots, int steps, int model_us) {
  result r;
  r.name = sc.name();
  struct live {
    int h;
    std::size_t len, end;
  };
  std::vector<live> act;
  std::size_t next = 0;
  auto open_next = [&] {
    const auto& [p, o] = sched.seqs[next++ % sched.seqs.size()];
    return live{sc.open(p), p, p + o};
  };
  for (std::size_t i = 0; i < slots; ++i) act.push_back(open_next());  // warm-up fill, untimed
  sc.settle();

  double decode_s = 0, step_sum_s = 0, step_max_s = 0, mapped_sum = 0, used_sum = 0;
  std::size_t peak = 0;
  const counts c0 = sc.calls();
  std::uint64_t decode_calls = 0;
  for (int step = 0; step < steps; ++step) {
    const auto t0 = clk::now();
    for (auto& q : act)
      if (q.len >= q.end) {
        sc.close(q.h);
        q = open_next();
        ++r.opened;
      }
    const counts before = sc.calls();
    const auto t1 = clk::now();
    for (auto& q : act) {
      sc.append1(q.h);
      ++q.len;
    }
    const auto t2 = clk::now();
    decode_calls += sc.calls().append_path - before.append_path;
    r.decode_appends += act.size();
    const double d = std::chrono::duration<double>(t2 - t1).count();
    const double w = std::chrono::duration<double>(t2 - t0).count();
    decode_s += d;
    step_sum_s += w;
    step_max_s = std::max(step_max_s, w);
    const std::size_t m = sc.mapped_bytes();
    mapped_sum += double(m);
    used_sum += double(sc.used_bytes());
    peak = std::max(peak, m);
    if (model_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(model_us));
  }
  sc.settle();
  const counts c1 = sc.calls();
  r.appends_per_s = decode_s > 0 ? double(r.decode_appends) / decode_s : 0;
  r.step_mean_us = step_sum_s / steps * 1e6;
  r.step_max_us = step_max_s * 1e6;
  r.decode_calls_per_step = double(decode_calls) / steps;
  r.thread_calls_per_step = double(c1.thread - c0.thread) / steps;
  r.all_calls_per_step = double(c1.all - c0.all) / steps;
  r.mapped_over_used = used_sum > 0 ? mapped_sum / used_sum : 0;
  r.peak_mapped_gib = double(peak) / double(std::size_t{1} << 30);
  r.pages = sc.pages();
  r.note = sc.check();
  r.ok = r.note.empty();
  return r;
}

std::string fmt(double v, const char* f) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// Raises the open-file limit: the host backend holds one memfd per page.
void raise_fd_limit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &rl);
  }
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&](const char* k) -> const char* {
      const std::size_t n = std::strlen(k);
      return a.compare(0, n, k) == 0 ? a.c_str() + n : nullptr;
    };
    if (a == "--quick") o.quick = true;
    else if (a == "--host") o.force_host = true;
    else if (const char* v = val("--steps=")) o.steps = std::atoi(v);
    else if (const char* v = val("--seed=")) o.seed = std::strtoull(v, nullptr, 10);
    else if (const char* v = val("--ahead=")) o.ahead = std::strtoull(v, nullptr, 10);
    else if (const char* v = val("--model_us=")) o.model_us = std::atoi(v);
    else if (const char* v = val("--ahead_tokens=")) o.ahead_tokens = std::strtoull(v, nullptr, 10);
    else if (a.rfind("--benchmark_", 0) == 0) continue;  // tools/gpu-check passes Google Benchmark flags
    else {
      std::fprintf(stderr, "bench_kvcache: unknown argument '%s'\n"
                           "usage: bench_kvcache [--quick] [--steps=N] [--seed=N] [--ahead=PAGES] [--ahead_tokens=N] [--model_us=N] [--host]\n",
                   a.c_str());
      return 2;
    }
  }
  if (o.quick && o.steps == 3000) o.steps = 300;
  if (o.model_us < 0) o.model_us = o.quick ? 200 : 2000;
  if (o.steps <= 0 || o.ahead == 0) {
    std::fprintf(stderr, "bench_kvcache: --steps and --ahead must be > 0\n");
    return 2;
  }
  raise_fd_limit();

  constexpr std::size_t slots = 64, max_prompt = 2048, max_output = 1024;
  // Quick: 1 layer, 1 KV head: 512 B a token over everything (the copy stand-in stays small).
  const shape sh = o.quick ? shape{1, 1, 64, 2, max_prompt + max_output} : shape{32, 8, 128, 2, max_prompt + max_output};
  const schedule sched = make_schedule(o.seed, 4096, max_prompt, max_output);

  std::string why;
  const bool gpu = !o.force_host && vmm::replay::cuda_device_present(&why);
  bool vmm_cuda = false;
  if (gpu) {
    try {
      vmm::cuda_backend probe(0);
      vmm_cuda = probe.available();
      if (!vmm_cuda) why = probe.load_message();
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  if (!gpu || !vmm_cuda)
    std::fprintf(stderr, "bench_kvcache: no usable GPU (%s): vmm on the host backend; %s\n",
                 o.force_host ? "--host" : why.c_str(),
                 o.quick ? "block table and copy run over host malloc as stand-ins"
                         : "block table and cudaMalloc + copy left out (they need CUDA; --quick runs host stand-ins)");
  const bool on_gpu = gpu && vmm_cuda;

  vmm::kv_cache_config cfg;
  cfg.layers = sh.layers;
  cfg.kv_heads = sh.kv_heads;
  cfg.head_dim = sh.head_dim;
  cfg.elem_bytes = sh.elem_bytes;
  cfg.max_seqs = slots;
  cfg.max_tokens = sh.max_tokens;
  vmm::host_backend_options hopt;
  if (o.quick) hopt.granularity = 64 * KiB;  // 512 tokens a page of the quick shape: pages still turn over
  auto make_kv = [&](std::size_t ahead_pages, std::size_t ahead_tokens = 0, bool retain = false,
                     vmm::kv_layout layout = vmm::kv_layout::per_layer) {
    auto c = cfg;
    c.map_ahead_pages = ahead_pages;
    c.map_ahead_tokens = ahead_tokens;
    c.retain_closed = retain;
    c.layout = layout;
    return on_gpu ? vmm::kv_cache::cuda(c) : vmm::kv_cache::host(c, hopt);
  };

  std::vector<result> results;
  int failures = 0;
  auto attempt = [&](const char* name, auto&& make, int model_us = 0) {
    try {
      std::unique_ptr<scheme> sc = make();
      results.push_back(run(*sc, sched, slots, o.steps, model_us));
      if (!results.back().ok) ++failures;
    } catch (const std::exception& e) {
      result r;
      r.name = name;
      r.note = std::string("FAILED: ") + e.what();
      results.push_back(r);
      ++failures;
    }
    std::fprintf(stderr, "bench_kvcache: %s done\n", name);
  };
  const std::string ahead_name = "vmmalloc kv_cache + map-ahead " + std::to_string(o.ahead);
  const std::string ahead_model = ahead_name + ", " + std::to_string(o.model_us) + " µs model time/step";
  attempt("vmmalloc kv_cache", [&] { return std::make_unique<vmm_scheme>(make_kv(0), "vmmalloc kv_cache"); });
  attempt(ahead_name.c_str(), [&] { return std::make_unique<vmm_scheme>(make_kv(o.ahead), ahead_name + ", steps back to back"); });
  const std::string tokens_name = "vmmalloc kv_cache + map-ahead " + std::to_string(o.ahead_tokens) + " tokens";
  const std::string tokens_model = tokens_name + ", " + std::to_string(o.model_us) + " µs model time/step";
  if (o.model_us > 0) {
    attempt(ahead_model.c_str(), [&] { return std::make_unique<vmm_scheme>(make_kv(o.ahead), ahead_model); }, o.model_us);
    attempt(tokens_model.c_str(),
            [&] { return std::make_unique<vmm_scheme>(make_kv(0, o.ahead_tokens), tokens_model); }, o.model_us);
  }
  // retain_closed: a new sequence takes a closed slot's pages still mapped (vAttention's reuse).
  attempt("vmmalloc kv_cache, retain closed",
          [&] { return std::make_unique<vmm_scheme>(make_kv(0, 0, true), "vmmalloc kv_cache, retain closed"); });
  const std::string retain_model = "vmmalloc kv_cache, retain closed + map-ahead " + std::to_string(o.ahead_tokens) +
                                   " tokens, " + std::to_string(o.model_us) + " µs model time/step";
  if (o.model_us > 0)
    attempt(retain_model.c_str(),
            [&] { return std::make_unique<vmm_scheme>(make_kv(0, o.ahead_tokens, true), retain_model); }, o.model_us);
  // per_sequence: one buffer per sequence, at most one partly filled page each; map-ahead of one
  // page's tokens keeps the decode path free of driver calls.
  const auto per_seq = vmm::kv_layout::per_sequence;
  const std::size_t page_tokens = (on_gpu ? 2 * MiB : hopt.granularity) / sh.all_bytes();
  attempt("vmmalloc kv_cache, per_sequence", [&] {
    return std::make_unique<vmm_scheme>(make_kv(0, 0, false, per_seq), "vmmalloc kv_cache, per_sequence");
  });
  const std::string seq_model = "vmmalloc kv_cache, per_sequence + map-ahead " + std::to_string(page_tokens) +
                                " tokens, " + std::to_string(o.model_us) + " µs model time/step";
  if (o.model_us > 0)
    attempt(seq_model.c_str(),
            [&] { return std::make_unique<vmm_scheme>(make_kv(0, page_tokens, false, per_seq), seq_model); },
            o.model_us);
  if (on_gpu || o.quick) {
    auto mem = [&] { return on_gpu ? vmm::replay::make_cuda_malloc(0) : vmm::replay::make_malloc(); };
    attempt("block table", [&] { return std::make_unique<block_scheme>(mem(), sh, slots); });
    attempt("copy", [&] {
      return std::make_unique<copy_scheme>(mem(), sh, slots,
                                           on_gpu ? "cudaMalloc + copy (x2)" : "malloc + memcpy (x2, host stand-in)");
    });
  }

  // ---- report ----
  const std::string dev = on_gpu ? vmm::replay::cuda_device_description(0) : "host backend (no GPU)";
  std::printf("## KV cache, decode workload (bench_kvcache%s)\n\n", o.quick ? " --quick" : "");
  std::printf("Device: %s. Shape: %zu layers x %zu KV heads x %zu dims x %zu B = %zu B a token (all layers, "
              "K+V); max %zu tokens a sequence; %zu slots; prompts 32-%zu, outputs 32-%zu tokens; %d steps "
              "(seed %" PRIu64 "). vmm page %zu KiB = %zu tokens.\n\n",
              dev.c_str(), sh.layers, sh.kv_heads, sh.head_dim, sh.elem_bytes, sh.all_bytes(), sh.max_tokens,
              slots, max_prompt, max_output, o.steps, o.seed,
              results.empty() ? 0 : (on_gpu ? 2 * MiB : hopt.granularity) / KiB,
              (on_gpu ? 2 * MiB : hopt.granularity) / sh.token_bytes());
  std::printf("| scheme | decode appends/s | step mean µs | step max µs | driver calls/step: decode path | "
              "map-ahead thread | all | mapped / used | peak mapped GiB | pages reused / created |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : results) {
    if (!r.note.empty() && r.decode_appends == 0) {
      std::printf("| %s | %s | | | | | | | | |\n", r.name.c_str(), r.note.c_str());
      continue;
    }
    std::printf("| %s | %s M | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.name.c_str(),
                fmt(r.appends_per_s / 1e6, "%.2f").c_str(), fmt(r.step_mean_us, "%.1f").c_str(),
                fmt(r.step_max_us, "%.0f").c_str(), fmt(r.decode_calls_per_step, "%.3f").c_str(),
                fmt(r.thread_calls_per_step, "%.3f").c_str(), fmt(r.all_calls_per_step, "%.2f").c_str(),
                fmt(r.mapped_over_used, "%.3f").c_str(), fmt(r.peak_mapped_gib, "%.2f").c_str(), r.pages.c_str());
    if (!r.ok) std::printf("\nFAILED self-check of %s: %s\n", r.name.c_str(), r.note.c_str());
  }
  std::printf("\nDriver calls: vmm counts backend calls (cuMemCreate/Map/SetAccess/Unmap/Release); the copy "
              "scheme counts cudaMalloc + cudaMemcpy + cudaFree; the block table's pool is one cudaMalloc "
              "before the run. \"decode path\" = calls inside the 64 one-token appends of a step; \"all\" adds "
              "closes, opens and prefills (and the map-ahead thread). Opened %" PRIu64 " sequences in %d steps.\n",
              results.empty() ? 0 : results.front().opened, o.steps);
  for (const auto& r : results)
    if (r.name.find("map-ahead") != std::string::npos && r.ok)
      std::printf("\n%s: %.3f driver calls per decode step on the append path, %.3f per step by the "
                  "thread.\n", r.name.c_str(), r.decode_calls_per_step,
                  r.thread_calls_per_step);

  // ---- shared prefixes: N sequences that start with one 2,000-token prompt ----
  std::printf("\n### One prompt shared by N sequences\n\n");
  std::printf("Each sequence holds the %zu-token prompt: N copies (prefill each), or one prefill and N - 1 "
              "share_prefix() (the prompt's whole pages mapped again, read-only; the rest copied). Physical "
              "pages of the per_sequence layout, %s.\n\n",
              std::min<std::size_t>(2000, sh.max_tokens), dev.c_str());
  std::printf("| N | copies: pages | shared: pages | shared / copies | driver calls to share one |\n|---|---|---|---|---|\n");
  const std::size_t prompt = std::min<std::size_t>(2000, sh.max_tokens);
  for (std::size_t n : {std::size_t{2}, std::size_t{8}, std::size_t{32}, slots}) {
    try {
      auto kv = make_kv(0, 0, false, per_seq);
      const auto src = kv.open();
      kv.append(src, prompt);
      const std::size_t one = kv.stats().pages_mapped;
      const auto before = kv.stats().driver_calls;
      for (std::size_t i = 1; i < n; ++i) (void)kv.share_prefix(src, prompt);
      const auto st = kv.stats();
      std::printf("| %zu | %zu | %zu | %.3f | %.1f |\n", n, n * one, st.pages_mapped,
                  static_cast<double>(st.pages_mapped) / static_cast<double>(n * one),
                  n > 1 ? static_cast<double>(st.driver_calls - before) / static_cast<double>(n - 1) : 0.0);
    } catch (const std::exception& e) {
      std::printf("| %zu | FAILED: %s | | | |\n", n, e.what());
      ++failures;
    }
  }
  return failures ? 1 : 0;
}
