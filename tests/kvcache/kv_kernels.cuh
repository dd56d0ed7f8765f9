// SPDX-License-Identifier: Apache-2.0
// Kernels of the kv_cache GPU test: write and check K/V tokens the way attention code addresses
// them. Plain C++ declarations (the doctest source is compiled by the host compiler); the kernels
// are in kv_kernels.cu. Every CUDA call is checked (GPU_CHECK from tests/gpu: aborts with the
// call, file:line and the runtime's error).
//
// The pattern: 8-byte word w of token t of a region tagged `seed` is
// gpu::pattern_word(seed, t * (T / 8) + w), T = token bytes (a multiple of 8). It depends on the
// token index, not on where a write started, so tokens written in several appends verify at once.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kvtest {

// Allocates the check counter and loads the kernels (self-test). Idempotent; after gpu::init().
void init();

// Writes tokens [t0, t1) of the region at p, R bytes apart (0: T, packed). Asynchronous on s.
void write_tokens(void* p, std::size_t T, std::size_t t0, std::size_t t1, std::uint64_t seed,
                  cudaStream_t s = nullptr, std::size_t R = 0);
// Counts wrong words among tokens [0, n) of the region at p. Synchronizes s.
std::uint64_t check_tokens(const void* p, std::size_t T, std::size_t n, std::uint64_t seed,
                           cudaStream_t s = nullptr, std::size_t R = 0);

// One decode step's writes, addressed like an attention kernel: for each of `count` sequences,
// token pos[i] of row slot[i] of the layer tensor at layer_base (row stride S bytes), tagged
// seed[i]. No block table: base + slot * S + pos * T.
constexpr int max_step = 16;
struct step {
  int count = 0;
  std::size_t slot[max_step] = {};
  std::size_t pos[max_step] = {};
  std::uint64_t seed[max_step] = {};
};
void write_step(void* layer_base, std::size_t S, std::size_t T, const step& st, cudaStream_t s = nullptr,
                std::size_t R = 0);

}  // namespace kvtest
