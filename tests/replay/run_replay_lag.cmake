# SPDX-License-Identifier: Apache-2.0
# The GPU running behind the CPU (vmm-replay --lag on the host backend: fences complete only up to
# 10,000 events late) must cost little memory: memory freed on a stream serves that stream's next
# requests while its fences are pending. Asserts peak mapped / peak live <= MAX_RATIO with the
# lag (1.30 on this trace when such memory was skipped instead) and that check() passed throughout.
execute_process(
  COMMAND ${REPLAY} ${TRACE} --allocators vmmalloc --lag 10000 --check-every 100000 --json ${JSON}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}")
if(err)
  message("stderr:\n${err}")
endif()
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "vmm-replay --lag exited with ${rc}")
endif()
file(READ ${JSON} json)
string(JSON ratio GET "${json}" 0 mapped_over_live)
string(JSON checks GET "${json}" 0 checks)
if(checks LESS 1)
  message(FATAL_ERROR "no check() ran")
endif()
if(ratio GREATER ${MAX_RATIO})
  message(FATAL_ERROR "with a lag of 10000 events, peak mapped / peak live = ${ratio} > ${MAX_RATIO}")
endif()
message("lag 10000: peak mapped / peak live = ${ratio} (<= ${MAX_RATIO})")
