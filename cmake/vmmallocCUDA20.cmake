# SPDX-License-Identifier: Apache-2.0
# nvcc takes -std=c++20 from CUDA 12.0, but CMake releases before 3.25.2 (Debian 12 ships 3.25.1)
# do not know that flag: there CUDA_STANDARD 20 adds nothing (nvcc's default, C++17, is used) and
# the cuda_std_20 compile feature fails to generate. This teaches CMake the flag, with the values
# newer releases set themselves; where CMake already knows it, nothing changes.
# Include it after the CUDA language is enabled: vmmalloc's own build and vmmallocConfig.cmake do.
# The variables are directory-scoped: they apply to the including directory and those below it.
if(CMAKE_CUDA_COMPILER_LOADED AND CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA"
   AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0
   AND NOT "cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
  set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
endif()
