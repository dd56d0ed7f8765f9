// SPDX-License-Identifier: Apache-2.0
// The timeline cut (tools/replay/timeline.hpp) used by vmm-replay --samples and vmm-plot, and
// vmm-plot's reader of vmm-replay's JSON (tools/plot/replay_json.hpp, over nlohmann-json).
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "replay_json.hpp"
#include "timeline.hpp"

using namespace vmm::replay;
using u64v = std::vector<std::uint64_t>;

TEST_CASE("timeline: each sample is the maximum since the previous one, the peak is a sample") {
  // live after each event: 1M, 4M, 3M, 3M+512, 512, 0 -- peak 4M at event 1.
  const std::uint64_t M = 1 << 20;
  u64v live = {M, 4 * M, 3 * M, 3 * M + 512, 512, 0};
  timeline t = make_timeline(live, {}, {}, 2);
  // Buckets end at events 2 and 5; the peak (event 1) splits the first.
  CHECK(t.events == 6);
  CHECK(t.event == std::vector<std::size_t>{1, 2, 5});
  CHECK(t.live == u64v{4 * M, 3 * M, 3 * M + 512});
  CHECK(t.peak_live.event == 1);
  CHECK(t.peak_live.bytes == 4 * M);
  CHECK(t.mapped.empty());
  CHECK_FALSE(t.peak_mapped);
  CHECK_FALSE(t.peak_reserved);
}

TEST_CASE("timeline: first occurrence of a repeated peak; mapped and reserved cut alike") {
  u64v live = {5, 9, 1, 9, 2};
  u64v mapped = {8, 10, 10, 12, 12};
  u64v reserved = {100, 100, 100, 100, 100};
  timeline t = make_timeline(live, mapped, reserved, 1);
  CHECK(t.peak_live.event == 1);
  REQUIRE(t.peak_mapped);
  CHECK(t.peak_mapped->event == 3);
  CHECK(t.peak_mapped->bytes == 12);
  REQUIRE(t.peak_reserved);
  CHECK(t.peak_reserved->event == 0);
  // Boundaries: 0 (reserved peak), 1 (live peak), 3 (mapped peak), 4 (the one bucket's end).
  CHECK(t.event == std::vector<std::size_t>{0, 1, 3, 4});
  CHECK(t.live == u64v{5, 9, 9, 2});
  CHECK(t.mapped == u64v{8, 10, 12, 12});
  CHECK(t.reserved == u64v{100, 100, 100, 100});
}

TEST_CASE("timeline: random series against a brute-force cut") {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::size_t n = 1 + rng() % 3000, want = 1 + rng() % 300;
    u64v live(n), mapped(n);
    for (std::size_t i = 0; i < n; ++i) {
      live[i] = rng() % 1000000;
      mapped[i] = live[i] + rng() % 5000;
    }
    timeline t = make_timeline(live, mapped, {}, want);
    REQUIRE(t.event.size() <= want + 3);
    REQUIRE(t.event.size() == t.live.size());
    REQUIRE(t.event.size() == t.mapped.size());
    REQUIRE(t.event.back() == n - 1);
    REQUIRE(std::is_sorted(t.event.begin(), t.event.end()));
    REQUIRE(std::adjacent_find(t.event.begin(), t.event.end()) == t.event.end());
    std::size_t prev = 0;
    for (std::size_t k = 0; k < t.event.size(); ++k) {
      std::size_t e = t.event[k];
      REQUIRE(t.live[k] == *std::max_element(live.begin() + long(prev), live.begin() + long(e) + 1));
      REQUIRE(t.mapped[k] == *std::max_element(mapped.begin() + long(prev), mapped.begin() + long(e) + 1));
      prev = e + 1;
    }
    auto pl = std::max_element(live.begin(), live.end());
    REQUIRE(t.peak_live.bytes == *pl);
    REQUIRE(t.peak_live.event == std::size_t(pl - live.begin()));
    // The peak is a sample of its own, at its own event, with the peak value.
    auto at = std::find(t.event.begin(), t.event.end(), t.peak_live.event);
    REQUIRE(at != t.event.end());
    REQUIRE(t.live[std::size_t(at - t.event.begin())] == *pl);
    // Samples are evenly spaced: no gap between consecutive samples exceeds ceil(n / want).
    std::size_t gap = (n + want - 1) / want;
    for (std::size_t k = 1; k < t.event.size(); ++k) REQUIRE(t.event[k] - t.event[k - 1] <= gap);
  }
}

TEST_CASE("timeline: bad arguments are rejected") {
  u64v live = {1, 2, 3}, two = {1, 2};
  CHECK_THROWS_AS(make_timeline(live, two, {}, 10), std::invalid_argument);
  CHECK_THROWS_AS(make_timeline(live, {}, two, 10), std::invalid_argument);
  CHECK_THROWS_AS(make_timeline(live, {}, {}, 0), std::invalid_argument);
  CHECK(make_timeline({}, {}, {}, 5).event.empty());
}

namespace {
// The message read_replay_json throws for TEXT ("" when it does not throw).
std::string reader_error(const std::string& text) {
  try {
    (void)vmm::plot::read_replay_json(text, "r.json");
  } catch (const vmm::plot::input_error& e) {
    return e.what();
  }
  return {};
}
}  // namespace

TEST_CASE("plot json reader: a vmm-replay result, byte counts exact, null series, recorded peaks") {
  using namespace vmm::plot;
  auto rows = read_replay_json(R"J([{"name": "vmmalloc", "backend": "host", "trace": "t.gz", "ns_per_op": 1.5e1,
      "timeline": {"events": 10, "event": [2, 5, 9], "live": [8162115584, 4, 0], "mapped": [8162115584, 9, 1],
                   "reserved": null, "mapped_source": "stats()",
                   "peaks": {"live": {"event": 1, "bytes": 8162115584}, "mapped": null}}},
    {"name": "null", "timeline": {"events": 10, "event": [9], "live": [0]}}])J",
                               "r.json");
  REQUIRE(rows.size() == 2);
  const replay_row& v = rows[0];
  CHECK(v.name == "vmmalloc");
  CHECK(v.backend == "host");
  CHECK(v.trace == "t.gz");
  CHECK(v.events == 10);
  CHECK(v.event == std::vector<double>{2, 5, 9});
  CHECK(v.live.y[0] == 8162115584.0);
  CHECK(v.live.peak_event == 1);  // as recorded, not the largest sample's event (2)
  REQUIRE(v.mapped);
  CHECK(v.mapped->source == "stats()");
  CHECK(v.mapped->peak_event == 2);  // no recorded peak: the largest sample
  CHECK(v.mapped->peak_bytes == 8162115584.0);
  CHECK_FALSE(v.reserved);
  CHECK(rows[1].name == "null");
  CHECK_FALSE(rows[1].mapped);
}

TEST_CASE("plot json reader: \\u escapes outside ASCII (surrogate pairs too) round-trip as UTF-8") {
  using namespace vmm::plot;
  const std::string want = "caf\xc3\xa9 \xf0\x9f\x98\x80";  // "café 😀"
  auto tl = std::string(R"("timeline": {"events": 2, "event": [1], "live": [3]})");
  auto rows = read_replay_json(R"([{"name": "caf\u00e9 \ud83d\ude00", "backend": "\u00e9", )" + tl + "}]", "r.json");
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].name == want);
  CHECK(rows[0].backend == "\xc3\xa9");
  // What vmm-replay writes (nlohmann's dump: UTF-8 as is) reads back unchanged, and so does the
  // ASCII-only form (every non-ASCII character as \u escapes).
  nlohmann::json j = nlohmann::json::array(
      {{{"name", want}, {"timeline", {{"events", 2}, {"event", {1}}, {"live", {3}}}}}});
  CHECK(read_replay_json(j.dump(), "r.json")[0].name == want);
  std::string ascii = j.dump(-1, ' ', /*ensure_ascii=*/true);
  CHECK(ascii.find("\\u00e9") != std::string::npos);
  CHECK(ascii.find("\\ud83d\\ude00") != std::string::npos);
  CHECK(read_replay_json(ascii, "r.json")[0].name == want);
  // A lone surrogate is not a character: refused, with its position.
  CHECK(reader_error(R"([{"name": "\ud83d x"}])").find("r.json: not valid JSON: line 1, column") == 0);
}

TEST_CASE("plot json reader: malformed JSON and wrong shapes say where") {
  CHECK(reader_error("[1, 2,\n  x]").find("r.json: not valid JSON: line 2, column ") == 0);
  CHECK(reader_error("{\"a\" 1}").find("not valid JSON: line 1") != std::string::npos);
  CHECK(reader_error("[1] 2").find("not valid JSON") != std::string::npos);
  CHECK(reader_error("\"abc").find("not valid JSON") != std::string::npos);
  CHECK(reader_error("").find("not valid JSON") != std::string::npos);
  // Deep nesting is an error, not a stack overflow (nlohmann parses without recursion).
  CHECK(reader_error(std::string(200000, '[')).find("not valid JSON") != std::string::npos);
  CHECK(reader_error("[]").find("found no entries") != std::string::npos);
  CHECK(reader_error("[{\"x\": 1}]").find("entry 0 is not a vmm-replay result") != std::string::npos);
  CHECK(reader_error("[{\"name\": \"a\"}]").find("r.json: a has no timeline: write the JSON with vmm-replay --samples") == 0);
  CHECK(reader_error(R"([{"name": "a", "timeline": {"events": 5, "event": [1, 1], "live": [1, 1]}}])")
            .find("increasing event indices") != std::string::npos);
  CHECK(reader_error(R"([{"name": "a", "timeline": {"events": 5, "event": [1, 2], "live": [1]}}])")
            .find("timeline.live has 1 values, timeline.event has 2") != std::string::npos);
  CHECK(reader_error(R"([{"name": "a", "timeline": {"events": 5, "event": [1], "live": [-1]}}])")
            .find("not a byte count") != std::string::npos);
  CHECK(reader_error(R"([{"name": "a", "timeline": {"events": 5, "event": [1], "live": [1]}}])").empty());
}
