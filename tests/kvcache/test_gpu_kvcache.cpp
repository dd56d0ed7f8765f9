// SPDX-License-Identifier: Apache-2.0
// vmm::kv_cache on the CUDA backend. main() is tests/gpu/gpu_main.cpp: without a device this
// program prints why and exits 77.
//
//   pages    kernels write K/V across 2 MiB page boundaries (1024 tokens a page here), through
//            k(s, l) and through k_base(l) + slot * seq_stride (a decode step, no block table), and
//            read them back after other sequences grow, truncate and close around them and a new
//            sequence reuses the closed one's physical pages; cudaMemcpy both ways across a page
//            boundary; closing and trim(0) give the device memory back (cudaMemGetInfo)
//   ahead    with map-ahead, decode appends make no driver call; the data still checks
//   serving  the per_sequence layout (strided tokens) with map-ahead, and a prompt shared by
//            share_prefix: kernels read the shared pages at both sequences' addresses, write only
//            their own, and the sharer's tokens survive the source's close
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "gpu_util.cuh"
#include "kv_kernels.cuh"
#include "vmmalloc/kv_cache.hpp"

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

// 4 layers, 8 KV heads x 128 dims x fp16: T = 2 KiB, 1024 tokens a 2 MiB page; 8 slots of 4096
// tokens: seq_stride 8 MiB (4 pages), 8 buffers, 512 MiB reserved.
vmm::kv_cache_config cfg(std::size_t ahead = 0) {
  vmm::kv_cache_config c;
  c.layers = 4;
  c.kv_heads = 8;
  c.head_dim = 128;
  c.elem_bytes = 2;
  c.max_seqs = 8;
  c.max_tokens = 4096;
  c.map_ahead_pages = ahead;
  return c;
}

std::size_t nbuf(const vmm::kv_cache& kv) { return 2 * kv.config().layers; }
void* buf_ptr(const vmm::kv_cache& kv, vmm::seq_id s, std::size_t b) {
  return b % 2 ? kv.v(s, b / 2) : kv.k(s, b / 2);
}
void* buf_base(const vmm::kv_cache& kv, std::size_t b) { return b % 2 ? kv.v_base(b / 2) : kv.k_base(b / 2); }
std::uint64_t seed_of(std::uint64_t tag, std::size_t b) { return tag * 1000 + b; }

// Writes tokens [t0, t1) of every buffer of s, tagged `tag`.
void write(const vmm::kv_cache& kv, vmm::seq_id s, std::uint64_t tag, std::size_t t0, std::size_t t1) {
  for (std::size_t b = 0; b < nbuf(kv); ++b)
    kvtest::write_tokens(buf_ptr(kv, s, b), kv.token_bytes(), t0, t1, seed_of(tag, b), nullptr, kv.token_stride());
}

std::uint64_t check(const vmm::kv_cache& kv, vmm::seq_id s, std::uint64_t tag, std::size_t n) {
  std::uint64_t bad = 0;
  for (std::size_t b = 0; b < nbuf(kv); ++b)
    bad += kvtest::check_tokens(buf_ptr(kv, s, b), kv.token_bytes(), n, seed_of(tag, b), nullptr, kv.token_stride());
  return bad;
}

// One decode step: append 1 token to each sequence, then one kernel per buffer writes them all
// through the layer tensor (base + slot * S + pos * T).
struct live_seq {
  vmm::seq_id s;
  std::uint64_t tag;
  std::size_t n;
};
void decode_step(vmm::kv_cache& kv, std::vector<live_seq>& seqs) {
  kvtest::step st;
  for (auto& q : seqs) {
    REQUIRE(kv.append(q.s, 1) == q.n);
    st.slot[st.count] = q.s;
    st.pos[st.count] = q.n;
    ++st.count;
    ++q.n;
  }
  for (std::size_t b = 0; b < nbuf(kv); ++b) {
    for (std::size_t i = 0; i < seqs.size(); ++i) st.seed[i] = seed_of(seqs[i].tag, b);
    kvtest::write_step(buf_base(kv, b), kv.seq_stride(), kv.token_bytes(), st, nullptr, kv.token_stride());
  }
}

std::size_t free_memory() {
  std::size_t f = 0, t = 0;
  gpu::device_memory(f, t);
  return f;
}

void print_stats(const char* what, const vmm::kv_cache_stats& s) {
  std::printf(
      "%s: pages created %llu, reused %llu, released %llu, mapped %zu, pooled %zu; driver calls %llu "
      "(append %llu, map-ahead %llu); mapped %zu MiB for %zu MiB used\n",
      what, (unsigned long long)s.pages_created, (unsigned long long)s.pages_reused,
      (unsigned long long)s.pages_released, s.pages_mapped, s.pages_pooled, (unsigned long long)s.driver_calls,
      (unsigned long long)s.append_driver_calls, (unsigned long long)s.map_ahead_driver_calls,
      s.mapped_bytes / MiB, s.used_bytes / MiB);
  std::fflush(stdout);
}

}  // namespace

TEST_CASE("gpu kv_cache pages: K/V across page boundaries survive neighbours growing and closing") {
  kvtest::init();
  GPU_CHECK(cudaDeviceSynchronize());
  const std::size_t free0 = free_memory();
  {
    auto kv = vmm::kv_cache::cuda(cfg());
    REQUIRE(kv.page_size() == 2 * MiB);
    REQUIRE(kv.tokens_per_page() == 1024);
    REQUIRE(kv.seq_stride() == 8 * MiB);

    auto a = kv.open(), b = kv.open(), c = kv.open();
    kv.append(a, 1000);
    write(kv, a, 1, 0, 1000);
    kv.append(a, 100);  // 1000 -> 1100 crosses page 0 -> 1
    CHECK(kv.mapped_pages(a) == 2);
    write(kv, a, 1, 1000, 1100);
    kv.append(b, 2000);
    write(kv, b, 2, 0, 2000);
    kv.append(c, 1000);
    write(kv, c, 3, 0, 1000);

    // 100 decode steps: c crosses 1024, b crosses 2048, written through the layer tensors.
    std::vector<live_seq> seqs = {{a, 1, 1100}, {b, 2, 2000}, {c, 3, 1000}};
    for (int i = 0; i < 100; ++i) decode_step(kv, seqs);
    GPU_CHECK(cudaDeviceSynchronize());
    CHECK(check(kv, a, 1, 1200) == 0);
    CHECK(check(kv, b, 2, 2100) == 0);
    CHECK(check(kv, c, 3, 1100) == 0);

    // b closes; d reuses its physical pages and overwrites them; c shrinks and grows again.
    kv.close(b);
    const auto reused0 = kv.stats().pages_reused;
    auto d = kv.open();
    kv.append(d, 3000);
    CHECK(kv.stats().pages_reused - reused0 == 3 * nbuf(kv));  // b's 3 pages per buffer
    write(kv, d, 4, 0, 3000);
    GPU_CHECK(cudaDeviceSynchronize());  // no kernel may still use pages that truncate unmaps
    kv.truncate(c, 500);
    CHECK(kv.mapped_pages(c) == 1);
    kv.append(c, 1500);  // 2000: page 1 mapped again (from the pool)
    write(kv, c, 5, 500, 2000);
    GPU_CHECK(cudaDeviceSynchronize());

    CHECK(check(kv, a, 1, 1200) == 0);
    CHECK(check(kv, d, 4, 3000) == 0);
    // c: tokens [0, 500) kept tag 3, [500, 2000) tag 5.
    for (std::size_t bb = 0; bb < nbuf(kv); ++bb) {
      CHECK(kvtest::check_tokens(buf_ptr(kv, c, bb), kv.token_bytes(), 500, seed_of(3, bb)) == 0);
      auto* tail = static_cast<unsigned char*>(buf_ptr(kv, c, bb));
      // check_tokens indexes from token 0: check [500, 2000) by writing the expected prefix first
      // would disturb it, so read it back to the host instead.
      std::vector<std::uint64_t> host(1500 * kv.token_bytes() / 8);
      GPU_CHECK(cudaMemcpy(host.data(), tail + 500 * kv.token_bytes(), host.size() * 8, cudaMemcpyDeviceToHost));
      std::size_t bad = 0;
      for (std::size_t w = 0; w < host.size(); ++w)
        bad += host[w] != gpu::pattern_word(seed_of(5, bb), 500 * kv.token_bytes() / 8 + w);
      CHECK(bad == 0);
    }

    // cudaMemcpy both ways across the page boundary at token 1024 of a (tokens 1000..1100).
    {
      const std::size_t off = 1000 * kv.token_bytes(), n = 100 * kv.token_bytes();
      std::vector<unsigned char> in(n), out(n);
      for (std::size_t i = 0; i < n; ++i) in[i] = static_cast<unsigned char>(i * 131 + 7);
      auto* p = static_cast<unsigned char*>(kv.v(a, 3)) + off;
      GPU_CHECK(cudaMemcpy(p, in.data(), n, cudaMemcpyHostToDevice));
      GPU_CHECK(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost));
      CHECK(std::memcmp(in.data(), out.data(), n) == 0);
    }

    print_stats("gpu kv_cache pages", kv.stats());
    GPU_CHECK(cudaDeviceSynchronize());
    kv.close(a);
    kv.close(c);
    kv.close(d);
    auto s = kv.stats();
    CHECK(s.pages_mapped == 0);
    CHECK(s.pages_pooled > 0);
    CHECK(kv.trim(0) == s.pages_pooled);
    const std::size_t free1 = free_memory();
    if (!gpu::skip_meminfo_checks()) CHECK(free1 + 8 * MiB >= free0);
    else std::printf("meminfo: before %zu MiB, after trim(0) %zu MiB free\n", free0 / MiB, free1 / MiB);
  }
  const std::size_t free2 = free_memory();
  if (!gpu::skip_meminfo_checks()) CHECK(free2 + 8 * MiB >= free0);
}

TEST_CASE("gpu kv_cache map-ahead: decode appends make no driver call; data checks") {
  kvtest::init();
  auto kv = vmm::kv_cache::cuda(cfg(/*ahead=*/1));
  std::vector<live_seq> seqs;
  for (std::uint64_t i = 0; i < 4; ++i) {
    auto s = kv.open();
    kv.wait_map_ahead();
    const std::size_t prompt = 900 + 40 * i;  // within the first page, which the thread mapped
    kv.append(s, prompt);
    write(kv, s, 10 + i, 0, prompt);
    seqs.push_back({s, 10 + i, prompt});
  }
  CHECK(kv.stats().append_driver_calls == 0);
  kv.wait_map_ahead();
  const auto s0 = kv.stats();
  // 300 steps: every sequence crosses token 1024 (page 0 -> 1) on the way.
  for (int i = 0; i < 300; ++i) {
    decode_step(kv, seqs);
    kv.wait_map_ahead();  // deterministic: the thread catches up before the next step
  }
  GPU_CHECK(cudaDeviceSynchronize());
  const auto s1 = kv.stats();
  CHECK(s1.append_driver_calls == s0.append_driver_calls);
  CHECK(s1.appends - s0.appends == 1200);
  CHECK(s1.map_ahead_pages - s0.map_ahead_pages == 4);  // page 2 of each sequence, one ahead
  std::printf("gpu kv_cache map-ahead: 300 steps x 4 sequences: %llu driver calls on the append path, %llu by "
              "the map-ahead thread\n",
              (unsigned long long)(s1.append_driver_calls - s0.append_driver_calls),
              (unsigned long long)(s1.map_ahead_driver_calls - s0.map_ahead_driver_calls));
  for (auto& q : seqs) CHECK(check(kv, q.s, q.tag, q.n) == 0);
  print_stats("gpu kv_cache map-ahead", s1);
}

TEST_CASE("gpu kv_cache serving: per_sequence layout, map-ahead, a shared prompt") {
  kvtest::init();
  const std::size_t free0 = free_memory();
  {
    auto c = cfg();
    c.layout = vmm::kv_layout::per_sequence;  // R = 8 x 2 KiB = 16 KiB: 128 tokens a page
    c.map_ahead_tokens = 128;
    auto kv = vmm::kv_cache::cuda(c);
    CHECK(kv.token_stride() == 8 * kv.token_bytes());
    auto src = kv.open();
    kv.append(src, 2000);
    write(kv, src, 1, 0, 2000);
    auto dst = kv.share_prefix(src, 1900);  // 14 whole pages (1792 tokens) shared, the rest copied
    CHECK(kv.shared_tokens(dst) == 1792);
    CHECK(kv.stats().pages_aliased == 14);
    write(kv, dst, 1, 1792, 1900);  // the copy: the same tokens, tagged as the source's
    CHECK(check(kv, dst, 1, 1900) == 0);
    // Both decode on their own pages; the thread keeps the next page mapped.
    std::vector<live_seq> seqs{{src, 1, 2000}, {dst, 1, 1900}};
    kv.wait_map_ahead();
    const auto s0 = kv.stats();
    for (int i = 0; i < 300; ++i) {
      decode_step(kv, seqs);
      kv.wait_map_ahead();
    }
    GPU_CHECK(cudaDeviceSynchronize());
    CHECK(kv.stats().append_driver_calls == s0.append_driver_calls);
    CHECK(check(kv, src, 1, 2300) == 0);
    CHECK(check(kv, dst, 1, 2200) == 0);
    kv.close(src);  // dst keeps the shared pages
    CHECK(check(kv, dst, 1, 2200) == 0);
    const auto st = kv.stats();
    CHECK(st.pages_aliased == 0);
    CHECK(st.mapped_bytes < st.used_bytes + 2 * kv.page_size());  // one partial page and one ahead
    print_stats("gpu kv_cache serving", st);
    kv.close(dst);
    kv.trim(0);
  }
  const std::size_t free1 = free_memory();
  if (!gpu::skip_meminfo_checks()) CHECK(free1 + 8 * MiB >= free0);
}
