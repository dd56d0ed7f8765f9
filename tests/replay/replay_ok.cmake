# SPDX-License-Identifier: Apache-2.0
# vmm_replay_ok(<out_var> <args...>): runs ${REPLAY} <args...>, prints what it wrote and fails the
# test unless it exits 0; <out_var> gets its stdout, <out_var>_err its stderr. (A plain add_test
# with PASS_REGULAR_EXPRESSION would ignore the exit code.)
function(vmm_replay_ok out_var)
  execute_process(COMMAND ${REPLAY} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}")
  if(err)
    message("stderr:\n${err}")
  endif()
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " args "${ARGN}")
    message(FATAL_ERROR "vmm-replay ${args}: exit ${rc}, want 0")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
  set(${out_var}_err "${err}" PARENT_SCOPE)
endfunction()
