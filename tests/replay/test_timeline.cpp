// The timeline cut (tools/replay/timeline.hpp) used by vmm-replay --samples and vmm-plot, and
// vmm-plot's JSON reader (tools/plot/json.hpp).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "json.hpp"
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

TEST_CASE("plot json reader: values, nesting, errors with positions") {
  using namespace vmm::plot;
  jvalue v = json_reader(R"( [{"name": "vmmalloc", "n": 8162115584, "x": -1.5e3, "ok": true, "none": null,
                               "s": "a\"b\\c\u0041", "arr": [1, [2, {}], []]}] )")
                 .parse();
  REQUIRE(v.kind == jvalue::array);
  REQUIRE(v.arr.size() == 1);
  const jvalue& o = v.arr[0];
  CHECK(o.get("name")->str == "vmmalloc");
  CHECK(o.get("n")->num == 8162115584.0);
  CHECK(o.get("x")->num == -1500.0);
  CHECK(o.get("ok")->b);
  CHECK(o.get("none")->is_null());
  CHECK(o.get("s")->str == "a\"b\\cA");
  CHECK(o.get("arr")->arr[1].arr[1].kind == jvalue::object);
  CHECK(o.get("missing") == nullptr);

  auto error_of = [](const char* text) {
    try {
      (void)json_reader(text).parse();
    } catch (const json_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(error_of("[1, 2,\n  x]") == "line 2, column 3: unexpected character 'x'");
  CHECK(error_of("{\"a\" 1}").find("expected ':'") != std::string::npos);
  CHECK(error_of("[1] 2").find("unexpected text after") != std::string::npos);
  CHECK(error_of("\"abc").find("unterminated string") != std::string::npos);
  CHECK(error_of("[1.2.3]").find("bad number") != std::string::npos);
  CHECK(error_of("").find("unexpected end") != std::string::npos);
  CHECK(error_of(std::string(100, '[').c_str()).find("nested more than 64") != std::string::npos);
}
