// SPDX-License-Identifier: Apache-2.0
#include "replay_json.hpp"

#include <algorithm>

#include <nlohmann/json.hpp>

namespace vmm::plot {

namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& msg) { throw input_error(msg); }

// "line L, column C: what" from nlohmann's byte offset (1-based: the byte it stopped at).
std::string where_in(const std::string& text, const json::parse_error& e) {
  std::size_t end = std::min<std::size_t>(e.byte ? e.byte - 1 : 0, text.size());
  std::size_t line = 1, col = 1;
  for (std::size_t k = 0; k < end; ++k) {
    if (text[k] == '\n') ++line, col = 1;
    else ++col;
  }
  // what(): "[json.exception.parse_error.101] parse error at line 2, column 12: syntax error ...";
  // keep the part after the position, which says what was expected.
  std::string w = e.what();
  auto k = w.find(": ");
  return "line " + std::to_string(line) + ", column " + std::to_string(col) + ": " +
         (k == std::string::npos ? w : w.substr(k + 2));
}

const json* member(const json& o, const char* key) {
  if (!o.is_object()) return nullptr;
  auto it = o.find(key);
  return it == o.end() ? nullptr : &*it;
}

std::string string_or(const json& o, const char* key) {
  const json* v = member(o, key);
  return v && v->is_string() ? v->get<std::string>() : std::string();
}

// One series of a timeline: an array of byte counts as long as "event", or null / absent.
std::optional<json_series> series_of(const json& tl, const char* key, const std::vector<double>& ev,
                                     const std::string& where) {
  const json* a = member(tl, key);
  if (!a || a->is_null()) return std::nullopt;
  if (!a->is_array()) fail(where + ": timeline." + key + " is not an array");
  if (a->size() != ev.size())
    fail(where + ": timeline." + key + " has " + std::to_string(a->size()) + " values, timeline.event has " +
         std::to_string(ev.size()));
  json_series s;
  s.y.reserve(a->size());
  for (const json& v : *a) {
    if (!v.is_number() || v.get<double>() < 0)
      fail(where + ": timeline." + key + " holds a value that is not a byte count");
    s.y.push_back(v.get<double>());
  }
  // The peak as vmm-replay recorded it (exact event); if absent, the largest sample.
  const json* peaks = member(tl, "peaks");
  const json* p = peaks ? member(*peaks, key) : nullptr;
  const json* pe = p ? member(*p, "event") : nullptr;
  const json* pb = p ? member(*p, "bytes") : nullptr;
  if (pe && pb && pe->is_number() && pb->is_number()) {
    s.peak_event = pe->get<double>();
    s.peak_bytes = pb->get<double>();
  } else {
    auto it = std::max_element(s.y.begin(), s.y.end());
    s.peak_event = ev[std::size_t(it - s.y.begin())];
    s.peak_bytes = *it;
  }
  return s;
}

}  // namespace

std::vector<replay_row> read_replay_json(const std::string& text, const std::string& path) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    fail(path + ": not valid JSON: " + where_in(text, e));
  }
  std::vector<const json*> rows;
  if (root.is_array())
    for (const json& v : root) rows.push_back(&v);
  else if (root.is_object())
    rows.push_back(&root);
  if (rows.empty()) fail(path + ": expected vmm-replay's JSON (a list of allocators), found no entries");

  std::vector<replay_row> out;
  for (std::size_t k = 0; k < rows.size(); ++k) {
    const json& r = *rows[k];
    const json* name = member(r, "name");
    if (!name || !name->is_string())
      fail(path + ": entry " + std::to_string(k) + " is not a vmm-replay result (no \"name\")");
    replay_row row;
    row.name = name->get<std::string>();
    std::string where = path + ": " + row.name;
    const json* tl = member(r, "timeline");
    if (!tl || !tl->is_object())
      fail(where + " has no timeline: write the JSON with vmm-replay --samples N --json FILE");
    const json* ev = member(*tl, "event");
    const json* events = member(*tl, "events");
    if (!ev || !ev->is_array() || ev->empty()) fail(where + ": timeline.event is missing or empty");
    if (!events || !events->is_number() || events->get<double>() < 1) fail(where + ": timeline.events is missing");
    row.events = events->get<double>();
    for (const json& v : *ev) {
      double e = v.is_number() ? v.get<double>() : -1;
      if (e < 0 || e >= row.events || (!row.event.empty() && e <= row.event.back()))
        fail(where + ": timeline.event must hold increasing event indices below timeline.events");
      row.event.push_back(e);
    }
    row.backend = string_or(r, "backend");
    row.trace = string_or(r, "trace");
    auto live = series_of(*tl, "live", row.event, where);
    if (!live) fail(where + ": timeline.live is missing");
    row.live = std::move(*live);
    row.mapped = series_of(*tl, "mapped", row.event, where);
    row.reserved = series_of(*tl, "reserved", row.event, where);
    if (row.mapped) row.mapped->source = string_or(*tl, "mapped_source");
    if (row.reserved) row.reserved->source = string_or(*tl, "reserved_source");
    out.push_back(std::move(row));
  }
  return out;
}

}  // namespace vmm::plot
