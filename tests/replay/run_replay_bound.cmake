# SPDX-License-Identifier: Apache-2.0
# The pages-touched bound (vmm-replay --bound, no lag): peak mapped / pages touched <= MAX_RATIO,
# i.e. what vmmalloc keeps mapped beyond the 2 MiB pages that hold a live byte, and check()
# passed throughout (CHECK_EVERY events apart).
include(${CMAKE_CURRENT_LIST_DIR}/replay_ok.cmake)
vmm_replay_ok(out ${TRACE} --allocators vmmalloc --bound --check-every ${CHECK_EVERY} --json ${JSON})
file(READ ${JSON} json)
string(JSON ratio GET "${json}" 0 mapped_over_touched)
string(JSON checks GET "${json}" 0 checks)
if(checks LESS 1)
  message(FATAL_ERROR "no check() ran")
endif()
if(ratio GREATER ${MAX_RATIO})
  message(FATAL_ERROR "peak mapped / pages touched = ${ratio} > ${MAX_RATIO}")
endif()
message("peak mapped / pages touched = ${ratio} (<= ${MAX_RATIO})")
