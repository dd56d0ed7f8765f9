# SPDX-License-Identifier: Apache-2.0
# Header-only libraries of the tools: nlohmann-json (JSON in and out) and CLI11 (command lines).
# The distro's packages first (nlohmann-json3-dev, libcli11-dev); on machines without them (the
# GPU machines: no network, no distro packages) copies of their include trees under .deps/, which
# tools/fetch-deps fills from the installed packages:
#   .deps/nlohmann/json.hpp   (the whole include/nlohmann tree: Debian ships it split, not single-header)
#   .deps/CLI/CLI.hpp         (the whole include/CLI tree)
# Included from tools/ and tests/replay/ (tests are configured first); defines the targets once,
# GLOBAL so both directories see them (imported targets are otherwise local to one directory).
include_guard(GLOBAL)

find_package(nlohmann_json 3 QUIET)
if(TARGET nlohmann_json::nlohmann_json)
  set_target_properties(nlohmann_json::nlohmann_json PROPERTIES IMPORTED_GLOBAL TRUE)
else()
  find_path(VMM_NLOHMANN_INCLUDE_DIR nlohmann/json.hpp PATHS ${PROJECT_SOURCE_DIR}/.deps NO_DEFAULT_PATH)
  if(NOT VMM_NLOHMANN_INCLUDE_DIR)
    message(FATAL_ERROR "nlohmann-json not found: install nlohmann-json3-dev (apt-get install nlohmann-json3-dev), "
                        "or run tools/fetch-deps on a machine that has it and carry .deps/")
  endif()
  add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED GLOBAL)
  set_target_properties(nlohmann_json::nlohmann_json PROPERTIES INTERFACE_INCLUDE_DIRECTORIES ${VMM_NLOHMANN_INCLUDE_DIR})
  message(STATUS "vmmalloc: nlohmann-json from ${VMM_NLOHMANN_INCLUDE_DIR}")
endif()

# Debian's libcli11-dev (2.1.2) installs CLI11Config.cmake with the target CLI11::CLI11.
find_package(CLI11 CONFIG QUIET)
if(TARGET CLI11::CLI11)
  set_target_properties(CLI11::CLI11 PROPERTIES IMPORTED_GLOBAL TRUE)
else()
  find_path(VMM_CLI11_INCLUDE_DIR CLI/CLI.hpp PATHS ${PROJECT_SOURCE_DIR}/.deps NO_DEFAULT_PATH)
  if(NOT VMM_CLI11_INCLUDE_DIR)
    message(FATAL_ERROR "CLI11 not found: install libcli11-dev (apt-get install libcli11-dev), "
                        "or run tools/fetch-deps on a machine that has it and carry .deps/")
  endif()
  add_library(CLI11::CLI11 INTERFACE IMPORTED GLOBAL)
  set_target_properties(CLI11::CLI11 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES ${VMM_CLI11_INCLUDE_DIR})
  message(STATUS "vmmalloc: CLI11 from ${VMM_CLI11_INCLUDE_DIR}")
endif()

# tools/common: the tools' shared command-line conventions (tool_cli.hpp) over CLI11.
add_library(vmm_tool_cli INTERFACE)
target_include_directories(vmm_tool_cli INTERFACE ${CMAKE_CURRENT_LIST_DIR}/common)
target_link_libraries(vmm_tool_cli INTERFACE CLI11::CLI11)
