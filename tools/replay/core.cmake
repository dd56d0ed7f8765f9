# SPDX-License-Identifier: Apache-2.0
# The trace parser and the allocator peers, shared by vmm-replay, vmm-demo and bench/. Included
# from each of those directories (tools may be off while bench is on); defines the target once.
include_guard(GLOBAL)

find_package(ZLIB QUIET)
find_package(Threads REQUIRED)
add_library(vmm_replay_core STATIC
  ${CMAKE_CURRENT_LIST_DIR}/trace.cpp
  ${CMAKE_CURRENT_LIST_DIR}/timeline.cpp
  ${CMAKE_CURRENT_LIST_DIR}/peers.cpp
  ${CMAKE_CURRENT_LIST_DIR}/replay_pass.cpp)
target_include_directories(vmm_replay_core PUBLIC ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(vmm_replay_core PUBLIC vmmalloc Threads::Threads)
# zlib reads .gz (and plain) traces; without it the parser falls back to `gzip -dc`.
if(ZLIB_FOUND)
  target_link_libraries(vmm_replay_core PRIVATE ZLIB::ZLIB)
  target_compile_definitions(vmm_replay_core PRIVATE VMM_REPLAY_ZLIB=1)
else()
  message(STATUS "vmmalloc: zlib not found: vmm-replay reads .gz traces through gzip -dc")
endif()
target_compile_options(vmm_replay_core PRIVATE -Wall -Wextra)

# CUDA peers (cudaMalloc, cudaMallocAsync) need only cudart's C API: compiled by the C++ compiler,
# linked against cudart. Gated on nvcc like the rest of the project's GPU code.
# cudart is linked statically: the installed tools start where no libcudart is on the loader path
# (a driver-only machine, a toolkit somewhere else), and cudart_static loads libcuda at run time as
# vmmalloc does; an rpath to the build machine's toolkit would break both. Cost: ~1 MB per binary.
# With the torch peer, libtorch brings the shared cudart: one runtime per process, so that one.
if(VMM_WITH_TORCH)
  set(_vmm_cudart CUDA::cudart)
else()
  set(_vmm_cudart CUDA::cudart_static)
endif()
if(VMM_HAVE_NVCC AND TARGET ${_vmm_cudart})
  target_link_libraries(vmm_replay_core PUBLIC ${_vmm_cudart})
  target_compile_definitions(vmm_replay_core PUBLIC VMM_REPLAY_CUDA=1)
  # vmm-replay --lag on CUDA streams: the gate kernel (cuda_lag.cu), its own target so the C++
  # flags (-Wall, sanitizers) never reach nvcc.
  add_library(vmm_replay_gate STATIC ${CMAKE_CURRENT_LIST_DIR}/cuda_lag.cu)
  target_link_libraries(vmm_replay_gate PUBLIC CUDA::cudart)
  target_link_libraries(vmm_replay_core PRIVATE vmm_replay_gate)
  target_compile_definitions(vmm_replay_core PRIVATE VMM_REPLAY_CUDA_LAG=1)
  message(STATUS "vmmalloc: replay/demo/bench peers: cudaMalloc, cudaMallocAsync (cudart); --lag gate kernel (nvcc)")
else()
  message(STATUS "vmmalloc: replay/demo/bench peers: host only (no nvcc/cudart)")
endif()

option(VMM_WITH_TORCH "Add PyTorch's caching allocator as a replay/bench peer (needs libtorch)" OFF)
if(VMM_WITH_TORCH)
  find_package(Torch QUIET)
  if(Torch_FOUND AND TARGET CUDA::cudart)
    target_sources(vmm_replay_core PRIVATE ${CMAKE_CURRENT_LIST_DIR}/peers_torch.cpp)
    target_link_libraries(vmm_replay_core PUBLIC ${TORCH_LIBRARIES})
    target_compile_definitions(vmm_replay_core PUBLIC VMM_REPLAY_TORCH=1)
    message(STATUS "vmmalloc: torch peer enabled (${TORCH_LIBRARIES})")
  else()
    message(STATUS "vmmalloc: VMM_WITH_TORCH=ON but libtorch (with CUDA) not found: torch peer left out")
  endif()
endif()
