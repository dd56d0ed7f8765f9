# SPDX-License-Identifier: Apache-2.0
# vmm-replay --option NAME=VALUE: parsed by vmm::set_option and applied to vmmalloc.
#   bad name / bad value / no '=' -> exit 2 with set_option's message
#   release_threshold=0 -> the freed chunks are released (the default keeps them mapped)
#   memory_limit=16M -> a 24 MiB allocation fails (exit 3): the option reaches the allocator
# Needs REPLAY, SRC, WORK.
set(T ${SRC}/options-trace.txt)
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/replay_ok.cmake)

function(expect_usage what want_rc want_msg)
  execute_process(COMMAND ${REPLAY} ${T} --allocators vmmalloc ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL ${want_rc})
    message(FATAL_ERROR "${what}: exit ${rc}, want ${want_rc}\n${out}${err}")
  endif()
  string(FIND "${err}" "${want_msg}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${what}: stderr lacks '${want_msg}':\n${err}")
  endif()
endfunction()

expect_usage("unknown name" 2 "--option: unknown option 'nosuch' (expected one of device," --option nosuch=1)
expect_usage("bad value" 2 "--option: free_memory_margin='lots': not a size" --option free_memory_margin=lots)
expect_usage("no value" 2 "--option 'release_threshold': expected NAME=VALUE" --option release_threshold)
expect_usage("device" 2 "--option device: use --device N" --option device=1)
expect_usage("memory_limit reaches the allocator" 3 "allocation failed at event 0" --option memory_limit=16M)

# Runs the trace with ARGN, writes the JSON, returns one numeric field of vmmalloc's entry.
function(replay_field out_var field json)
  vmm_replay_ok(out ${T} --allocators vmmalloc --json ${json} ${ARGN})
  file(READ ${json} j)
  string(JSON v GET "${j}" 0 ${field})
  set(${out_var} "${v}" PARENT_SCOPE)
  set(${out_var}_out "${out}${out_err}" PARENT_SCOPE)
endfunction()

replay_field(kept chunk_releases ${WORK}/default.json)
replay_field(released chunk_releases ${WORK}/threshold0.json --option release_threshold=0 --option free_memory_margin=1G)
message("chunk_releases: default ${kept}, release_threshold=0 ${released}")
if(NOT kept EQUAL 0)
  message(FATAL_ERROR "default options released ${kept} chunks during the replay (want 0: kept mapped)")
endif()
if(NOT released EQUAL 4)
  message(FATAL_ERROR "release_threshold=0 released ${released} chunks (want 4: both freed 24 MiB blocks, each two handles of at most 16 MiB)")
endif()
file(READ ${WORK}/threshold0.json j)
string(JSON opts GET "${j}" 0 options)
string(JSON detail GET "${j}" 0 detail)
if(NOT opts MATCHES "\"release_threshold=0\"" OR NOT opts MATCHES "\"free_memory_margin=1G\"")
  message(FATAL_ERROR "JSON options: ${opts}")
endif()
if(NOT detail MATCHES "release_threshold=0 free_memory_margin=1G")
  message(FATAL_ERROR "JSON detail does not name the options: ${detail}")
endif()
if(NOT released_out MATCHES "vmmalloc options: release_threshold=0 free_memory_margin=1G")
  message(FATAL_ERROR "the header does not print the options:\n${released_out}")
endif()
