# SPDX-License-Identifier: Apache-2.0
# vmm-replay on a small v2 trace (threads-trace.txt): one replay thread per recorded thread, with
# and without --lag, and --threads one; the JSON says what ran. Host backend only.
include(${CMAKE_CURRENT_LIST_DIR}/replay_ok.cmake)
function(replay_json out_var)
  vmm_replay_ok(out ${SRC}/threads-trace.txt --allocators vmmalloc,null --check-every 2
                --json ${WORK}/threads.json ${ARGN})
  file(READ ${WORK}/threads.json json)
  set(${out_var} "${json}" PARENT_SCOPE)
  set(OUT "${out}${out_err}" PARENT_SCOPE)
endfunction()

function(expect json index key want)
  string(JSON got ERROR_VARIABLE e GET "${json}" ${index} ${key})
  if(e OR NOT "${got}" STREQUAL "${want}")
    message(FATAL_ERROR "JSON entry ${index}: ${key} = '${got}' (${e}), want '${want}'")
  endif()
endfunction()

file(MAKE_DIRECTORY ${WORK})

# Recorded threads: 3 threads; thread changes between consecutive lines: 6 hand-offs.
replay_json(j)
if(NOT OUT MATCHES "3 recorded thread\\(s\\), 6 frees by another thread, 1 frees on another stream")
  message(FATAL_ERROR "the trace summary does not count the cross-thread / cross-stream frees")
endif()
if(NOT OUT MATCHES "replay: 3 threads, one per recorded thread, in the recorded order \\(6 hand-offs\\)")
  message(FATAL_ERROR "the replay mode line is missing")
endif()
expect("${j}" 0 name vmmalloc)
expect("${j}" 0 trace_version 2)
expect("${j}" 0 threads 3)
expect("${j}" 0 handoffs 6)
expect("${j}" 0 lag_events 0)
expect("${j}" 0 checks 6)
expect("${j}" 1 threads 3)

# --lag 4: vmmalloc's host backend holds the streams and completes them at events 4, 8, 12.
replay_json(j --lag 4)
expect("${j}" 0 lag_events 4)
expect("${j}" 0 lag_actions 3)
expect("${j}" 0 lag_timeouts 0)
string(JSON how GET "${j}" 0 lag)
if(NOT how MATCHES "^host backend: streams held, completed every 4 events")
  message(FATAL_ERROR "vmmalloc lag: '${how}'")
endif()
expect("${j}" 1 lag_events 0)  # null has no streams: no lag, and it says why
string(JSON how GET "${j}" 1 lag)
if(NOT how MATCHES "^none: null has no streams")
  message(FATAL_ERROR "null lag: '${how}'")
endif()

# --threads one: every event on one thread.
replay_json(j --threads one --lag 4)
expect("${j}" 0 threads 1)
expect("${j}" 0 handoffs 0)
expect("${j}" 0 lag_actions 3)

# --lag with --samples: the sampling pass replays with the same threads and lag, and agrees.
replay_json(j --lag 4 --samples 100)
string(JSON peak GET "${j}" 0 timeline peaks live bytes)
if(NOT peak EQUAL 10489856)
  message(FATAL_ERROR "timeline live peak ${peak}, want 10489856")
endif()

# vmm-plot reads v2 traces too: the live series and its peak.
execute_process(COMMAND ${PLOT} ${SRC}/threads-trace.txt -o ${WORK}/threads.svg RESULT_VARIABLE rc ERROR_VARIABLE err)
file(READ ${WORK}/threads.svg svg)
if(NOT rc EQUAL 0 OR NOT svg MATCHES "data-kind=\"live\" data-peak-bytes=\"10489856\" data-peak-event=\"4\"")
  message(FATAL_ERROR "vmm-plot on a v2 trace: exit ${rc} ${err}")
endif()

# Bad values are usage errors.
execute_process(COMMAND ${REPLAY} ${SRC}/threads-trace.txt --threads two RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 2 OR NOT err MATCHES "--threads")
  message(FATAL_ERROR "--threads two: exit ${rc}, want 2 naming --threads: ${err}")
endif()
