# SPDX-License-Identifier: Apache-2.0
# vmm-replay's error paths: a malformed line exits 2 naming file:line; a failed allocation (vmmalloc
# rejects size 0, a request the trace may legally hold) exits 3 naming the event and its line.
execute_process(COMMAND ${REPLAY} ${SRC}/bad-trace.txt --allocators vmmalloc
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 2)
  message(FATAL_ERROR "malformed trace: exit ${rc}, want 2")
endif()
if(NOT err MATCHES "bad-trace.txt:4: unknown event 'x'")
  message(FATAL_ERROR "malformed trace: message does not name line 4")
endif()

execute_process(COMMAND ${REPLAY} ${SRC}/zero-size-trace.txt --allocators null,vmmalloc
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 3)
  message(FATAL_ERROR "failed allocation: exit ${rc}, want 3")
endif()
if(NOT err MATCHES "allocation failed at event 1 \\(line 2: a 20 0 0")
  message(FATAL_ERROR "failed allocation: message does not name event 1 / line 2")
endif()

execute_process(COMMAND ${REPLAY} ${SRC}/bad-trace.txt --allocators nosuch
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 2)
  message(FATAL_ERROR "unknown allocator: exit ${rc}, want 2")
endif()

# --help prints every option on stdout and exits 0; an unknown option exits 2 and names it.
execute_process(COMMAND ${REPLAY} --help RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "--allocators" OR NOT out MATCHES "--samples")
  message(FATAL_ERROR "--help: exit ${rc}, want 0 and the options on stdout: ${out}${err}")
endif()
execute_process(COMMAND ${REPLAY} ${SRC}/bad-trace.txt --nosuch RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 2 OR NOT err MATCHES "--nosuch")
  message(FATAL_ERROR "unknown option: exit ${rc}, want 2 naming it: ${err}")
endif()
