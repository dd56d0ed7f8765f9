// SPDX-License-Identifier: Apache-2.0
// vmm-plot's reader of vmm-replay's JSON (written with --samples N --json FILE; shape in
// tools/replay/README.md). Parsing is nlohmann-json's: full JSON, \u escapes (surrogate pairs
// included) decode to UTF-8; byte counts are read as numbers (exact up to 2^53 as doubles, 8 PiB).
// Errors are input_error with a message that says where: "line L, column C: ..." for malformed
// JSON, the allocator and the key for a result that does not have the expected shape.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace vmm::plot {

struct input_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct json_series {
  std::vector<double> y;          // one value per timeline event
  double peak_event = 0, peak_bytes = 0;  // as vmm-replay recorded it; else the largest sample
  std::string source;             // timeline.mapped_source / reserved_source, when given
};

struct replay_row {               // one allocator's entry
  std::string name, backend, trace;
  double events = 0;              // timeline.events: events in the trace
  std::vector<double> event;      // timeline.event: the event index of each sample
  json_series live;
  std::optional<json_series> mapped, reserved;  // null or absent: not observable
};

// TEXT is the file's content, PATH only names it in messages. Throws input_error.
std::vector<replay_row> read_replay_json(const std::string& text, const std::string& path);

}  // namespace vmm::plot
