// SPDX-License-Identifier: Apache-2.0
// Command-line conventions shared by the tools (vmm-replay, vmm-plot, vmm-info, vmm-demo), on top
// of CLI11: --help prints to stdout and exits 0; a usage error prints "TOOL: what" and a hint on
// stderr and exits 2 (the tools' exit code for bad usage).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include <CLI/CLI.hpp>

namespace vmm::tools {

[[noreturn]] inline void usage_error(const CLI::App& app, const std::string& what) {
  std::fprintf(stderr, "%s: %s\nRun with --help for more information.\n", app.get_name().c_str(), what.c_str());
  std::exit(2);
}

// Parses or exits: 0 after --help, 2 after a usage error.
inline void parse_or_exit(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    usage_error(app, e.what());
  }
}

}  // namespace vmm::tools
