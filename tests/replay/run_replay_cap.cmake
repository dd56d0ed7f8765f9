# SPDX-License-Identifier: Apache-2.0
# A real training process recorded under a 24 GiB cap (bench/traces/README.md), replayed under
# memory_limit=24G with the GPU 0 and 1,000 events behind: every request is served, nothing held
# past the limit, check() passes.
include(${CMAKE_CURRENT_LIST_DIR}/replay_ok.cmake)
file(MAKE_DIRECTORY ${WORK})
foreach(lag 0 1000)
  vmm_replay_ok(out ${TRACE} --allocators vmmalloc --option memory_limit=24G --lag ${lag} --check-every 5000
                --json ${WORK}/cap-${lag}.json)
  file(READ ${WORK}/cap-${lag}.json json)
  string(JSON peak GET "${json}" 0 peak_mapped_bytes)
  string(JSON ratio GET "${json}" 0 mapped_over_live)
  string(JSON checks GET "${json}" 0 checks)
  if(checks LESS 1)
    message(FATAL_ERROR "lag ${lag}: no check() ran")
  endif()
  if(peak GREATER 25769803776)
    message(FATAL_ERROR "lag ${lag}: held ${peak} bytes, past the 24 GiB limit")
  endif()
  message("lag ${lag}: served under 24 GiB, peak held / peak live = ${ratio}")
endforeach()
