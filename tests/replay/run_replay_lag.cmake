# SPDX-License-Identifier: Apache-2.0
# The GPU running behind the CPU (vmm-replay --lag on the host backend: fences complete only up to
# LAG events late, 10,000 by default) must cost little memory: memory freed on a stream serves
# that stream's next requests while its fences are pending. Asserts peak mapped / peak live <=
# MAX_RATIO with the lag and that check() passed throughout (CHECK_EVERY events apart).
if(NOT LAG)
  set(LAG 10000)
endif()
if(NOT CHECK_EVERY)
  set(CHECK_EVERY 100000)
endif()
include(${CMAKE_CURRENT_LIST_DIR}/replay_ok.cmake)
vmm_replay_ok(out ${TRACE} --allocators vmmalloc --lag ${LAG} --check-every ${CHECK_EVERY} --json ${JSON})
file(READ ${JSON} json)
string(JSON ratio GET "${json}" 0 mapped_over_live)
string(JSON checks GET "${json}" 0 checks)
if(checks LESS 1)
  message(FATAL_ERROR "no check() ran")
endif()
if(ratio GREATER ${MAX_RATIO})
  message(FATAL_ERROR "with a lag of ${LAG} events, peak mapped / peak live = ${ratio} > ${MAX_RATIO}")
endif()
message("lag ${LAG}: peak mapped / peak live = ${ratio} (<= ${MAX_RATIO})")
