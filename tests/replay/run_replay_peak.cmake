# SPDX-License-Identifier: Apache-2.0
# vmm-replay --samples: vmmalloc's "at_peak_mapped" on a trace whose peak is set by a huge request
# while a freed block leaves whole pages free in the spans (peak-trace.txt). Host backend.
include(${CMAKE_CURRENT_LIST_DIR}/replay_ok.cmake)
file(MAKE_DIRECTORY ${WORK})
vmm_replay_ok(out ${SRC}/peak-trace.txt --allocators vmmalloc,null --samples 10 --json ${WORK}/peak.json)
file(READ ${WORK}/peak.json j)

function(get out_var)
  string(JSON v ERROR_VARIABLE e GET "${j}" ${ARGN})
  if(e)
    message(FATAL_ERROR "JSON ${ARGN}: ${e}")
  endif()
  set(${out_var} "${v}" PARENT_SCOPE)
endfunction()

get(peak 0 peak_mapped_bytes)
get(tl_peak 0 timeline peaks mapped bytes)
get(phys 0 timeline at_peak_mapped physical_bytes)
get(alloc 0 timeline at_peak_mapped allocated_bytes)
get(free 0 timeline at_peak_mapped span_free_bytes)
get(blocks 0 timeline at_peak_mapped span_free_blocks)
get(whole 0 timeline at_peak_mapped span_free_whole_page_bytes)
get(largest 0 timeline at_peak_mapped span_largest_free_bytes)
message("peak ${peak}, at it: physical ${phys}, allocated ${alloc}, span free ${free} in ${blocks} blocks, "
        "whole pages ${whole}, largest ${largest}")
# The sample is the peak the timed pass reported (same trace, fresh instance, deterministic).
if(NOT phys EQUAL peak OR NOT phys EQUAL tl_peak)
  message(FATAL_ERROR "at_peak_mapped.physical_bytes ${phys}: want the peak ${peak} (timeline ${tl_peak})")
endif()
# 512 MiB + two 3 MiB blocks are live at the peak, and all of it is mapped.
if(alloc LESS 542113792 OR alloc GREATER phys)
  message(FATAL_ERROR "allocated_bytes ${alloc}: want >= 517 MiB and <= physical ${phys}")
endif()
# The freed 9 MiB block leaves free pages between blocks 1 and 3 that the huge request cannot use.
if(whole LESS 2097152 OR whole GREATER free OR largest GREATER free OR largest LESS 2097152 OR blocks LESS 1)
  message(FATAL_ERROR "span free ${free} in ${blocks} blocks, whole pages ${whole}, largest ${largest}: "
                      "want whole pages >= 2 MiB, both <= the free bytes")
endif()
# Span free memory is mapped memory that no block holds.
math(EXPR sum "${alloc} + ${free}")
if(sum GREATER phys)
  message(FATAL_ERROR "allocated ${alloc} + span free ${free} > physical ${phys}")
endif()
# The peers have nothing to say: null, and stderr names vmmalloc's line only.
string(JSON null_ap TYPE "${j}" 1 timeline at_peak_mapped)
if(NOT null_ap STREQUAL "NULL")
  message(FATAL_ERROR "null's at_peak_mapped is ${null_ap}, want null")
endif()
if(NOT out_err MATCHES "vmmalloc: at the mapped peak the spans held [0-9.]+ MiB free in [0-9]+ blocks \\([0-9.]+ MiB in whole pages, the largest block [0-9.]+ MiB\\)")
  message(FATAL_ERROR "the at-peak line is missing from stderr")
endif()
