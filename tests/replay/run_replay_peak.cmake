# SPDX-License-Identifier: Apache-2.0
# vmm-replay --samples: vmmalloc's "at_peak_mapped" on a trace whose peak is set by a huge request
# while a freed block leaves whole pages free in the spans (peak-trace.txt); --bound: the
# pages-touched bound on the same trace. Host backend.
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

# --bound: the pages-touched bound. null's fake addresses are a bump from a 2 MiB-aligned base
# (256-byte steps): blocks 1, 3 and the 512 MiB one live at the peak touch pages 0-1, 6-7 and 7-263,
# 260 pages. vmmalloc's placement: peak live <= touched <= the same pass's peak mapped.
vmm_replay_ok(out ${SRC}/peak-trace.txt --allocators vmmalloc,null --bound --json ${WORK}/bound.json)
file(READ ${WORK}/bound.json j)
get(live 0 peak_live_bytes)
get(touched 0 peak_touched_bytes)
get(mapped 0 untimed_peak_mapped_bytes)
get(null_touched 1 peak_touched_bytes)
message("bound: live ${live}, vmmalloc touched ${touched}, mapped ${mapped}; null touched ${null_touched}")
if(NOT null_touched EQUAL 545259520)
  message(FATAL_ERROR "null: peak_touched_bytes ${null_touched}, want 260 pages (545259520)")
endif()
if(touched LESS live OR touched GREATER mapped)
  message(FATAL_ERROR "vmmalloc: touched ${touched}: want peak live ${live} <= it <= peak mapped ${mapped}")
endif()
if(NOT out MATCHES "\\| vmmalloc \\| 518\\.0 MiB \\| [0-9.]+ MiB \\| [0-9.]+ MiB \\| 1\\.[0-9]+ \\| 1\\.[0-9]+ \\|")
  message(FATAL_ERROR "the pages-touched table is missing from stdout")
endif()
# Without --bound or --samples there is no untimed pass and no bound.
vmm_replay_ok(out ${SRC}/peak-trace.txt --allocators null --json ${WORK}/nobound.json)
file(READ ${WORK}/nobound.json j)
string(JSON t ERROR_VARIABLE e TYPE "${j}" 0 peak_touched_bytes)
if(NOT e STREQUAL "" AND NOT e MATCHES "not found")
  message(FATAL_ERROR "${e}")
endif()
if(t STREQUAL "NUMBER")
  message(FATAL_ERROR "peak_touched_bytes written without --bound")
endif()
