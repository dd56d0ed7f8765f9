# SPDX-License-Identifier: Apache-2.0
# One vmmalloc replay held to a memory ratio, with check() passing throughout (CHECK_EVERY events
# apart, 100,000 by default):
#   LAG=N    the GPU N events behind the CPU (vmm-replay --lag: fences complete up to N events
#            late); memory freed on a stream serves that stream's next requests while its fences
#            are pending, so the lag must cost little: peak mapped / peak live <= MAX_RATIO.
#   BOUND=1  no lag, the pages-touched bound (--bound): peak mapped / pages touched <= MAX_RATIO,
#            what vmmalloc keeps mapped beyond the 2 MiB pages that hold a live byte.
if(NOT CHECK_EVERY)
  set(CHECK_EVERY 100000)
endif()
if(BOUND)
  set(args --bound)
  set(key mapped_over_touched)
  set(what "peak mapped / pages touched")
else()
  set(args --lag ${LAG})
  set(key mapped_over_live)
  set(what "with a lag of ${LAG} events, peak mapped / peak live")
endif()
include(${CMAKE_CURRENT_LIST_DIR}/replay_ok.cmake)
vmm_replay_ok(out ${TRACE} --allocators vmmalloc ${args} --check-every ${CHECK_EVERY} --json ${JSON})
file(READ ${JSON} json)
string(JSON ratio GET "${json}" 0 ${key})
string(JSON checks GET "${json}" 0 checks)
if(checks LESS 1)
  message(FATAL_ERROR "no check() ran")
endif()
if(ratio GREATER ${MAX_RATIO})
  message(FATAL_ERROR "${what} = ${ratio} > ${MAX_RATIO}")
endif()
message("${what} = ${ratio} (<= ${MAX_RATIO})")
