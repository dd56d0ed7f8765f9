// SPDX-License-Identifier: Apache-2.0
// The trace parser (tools/replay/trace.hpp): v1 and v2 (docs/trace-format.md), line numbers in
// errors, .gz and plain input, and ADDR names reused after a free mapping to the right block.
#include <doctest/doctest.h>

#ifdef VMM_REPLAY_ZLIB
#include <zlib.h>
#endif

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "trace.hpp"

using namespace vmm::replay;
namespace fs = std::filesystem;

namespace {

// The line number a malformed input is rejected at (0 if it parses).
std::size_t bad_line(const std::string& text) {
  try {
    (void)parse_text(text);
  } catch (const parse_error& e) {
    return e.line();
  }
  return 0;
}

std::string error_of(const std::string& text) {
  try {
    (void)parse_text(text, "t.txt");
  } catch (const parse_error& e) {
    return e.what();
  }
  return "";
}

struct temp_file {
  fs::path path;
  explicit temp_file(const std::string& suffix) {
    static std::atomic<int> n{0};
    path = fs::temp_directory_path() /
           ("vmm-trace-test-" + std::to_string(getpid()) + "-" + std::to_string(n++) + suffix);
  }
  ~temp_file() {
    std::error_code ec;
    fs::remove(path, ec);
  }
};

const char* kSample =
    "a 7f0000000000 1000 0\n"
    "a 7f0000100000 50 0\n"
    "f 7f0000000000 1000 0\n"
    "a 7f0000000000 300 0\n"  // same name, new block
    "f 7f0000100000 50 0\n";

void check_sample(const trace& t) {
  REQUIRE(t.events.size() == 5);
  CHECK(t.allocs == 3);
  CHECK(t.frees == 2);
  CHECK(t.slots == 2);
  CHECK(t.peak_live_bytes == 1050);
  CHECK(t.peak_live_event == 1);
  REQUIRE(t.live_at_end.size() == 1);
  CHECK(t.live_at_end[0].size == 300);
  CHECK(t.live_at_end[0].id == t.events[3].id);
}

}  // namespace

TEST_CASE("well-formed trace: events, ids, live bytes") {
  trace t = parse_text(kSample);
  check_sample(t);
  CHECK(t.events[0].kind == op::alloc);
  CHECK(t.events[2].kind == op::free);
  CHECK(t.events[2].id == t.events[0].id);  // the free names the first block
  CHECK(t.events[4].id == t.events[1].id);
  CHECK(t.events[2].size == 1000);
  CHECK(t.live_after[0] == 1000);
  CHECK(t.live_after[2] == 50);
  CHECK(t.live_after[3] == 350);
  CHECK(t.live_after[4] == 300);
  CHECK(t.lines[4] == 5);
  CHECK(t.names[3] == 0x7f0000000000ull);
  CHECK(t.stream_ids.size() == 1);
  CHECK(t.min_size == 50);
  CHECK(t.max_size == 1000);
}

TEST_CASE("addresses are reused after free: each free names the latest block of that name") {
  // a X; f X; a X; f X with different sizes: the second free is the second block (size 200).
  trace t = parse_text("a 10 100 0\nf 10 100 0\na 10 200 0\nf 10 200 0\n");
  REQUIRE(t.events.size() == 4);
  CHECK(t.slots == 1);  // a freed slot is reused, so the replay table stays small
  CHECK(t.events[3].id == t.events[2].id);
  CHECK(t.events[3].size == 200);
  CHECK(t.live_at_end.empty());

  // Interleaved: while X's second block is live, Y keeps its own slot.
  trace u = parse_text("a 10 100 0\na 20 50 0\nf 10 100 0\na 10 300 0\nf 20 50 0\nf 10 300 0\n");
  REQUIRE(u.events.size() == 6);
  CHECK(u.events[1].id != u.events[0].id);
  CHECK(u.events[3].id != u.events[1].id);  // reused X's slot, not Y's live one
  CHECK(u.events[4].id == u.events[1].id);
  CHECK(u.events[5].id == u.events[3].id);
  CHECK(u.events[5].size == 300);
  CHECK(u.peak_live_bytes == 350);

  // The old size of a reused name is wrong after the realloc: reported, with the right lines.
  std::string e = error_of("a 10 100 0\nf 10 100 0\na 10 200 0\nf 10 100 0\n");
  CHECK(e.find("t.txt:4:") == 0);
  CHECK(e.find("allocated with size 200 at line 3") != std::string::npos);
}

TEST_CASE("malformed lines give their line number") {
  CHECK(bad_line("a 10 100 0\nx 10 100 0\n") == 2);             // unknown op
  CHECK(bad_line("a 10 100 0\n\na 20 100\n") == 3);             // missing field (blank line counted)
  CHECK(bad_line("a 10 100 0 7\n") == 1);                       // extra field
  CHECK(bad_line("a 10 100 0\na zz 100 0\n") == 2);             // bad hex
  CHECK(bad_line("a 10 1e3 0\n") == 1);                         // bad size
  CHECK(bad_line("a 10 -5 0\n") == 1);                          // negative size
  CHECK(bad_line("a 10 100 s0\n") == 1);                        // bad stream
  CHECK(bad_line("a 10 100 0\na 10 100 0\n") == 2);             // alloc of a live name
  CHECK(bad_line("a 10 100 0\nf 20 100 0\n") == 2);             // free of an unknown name
  CHECK(bad_line("a 10 100 0\nf 10 100 0\nf 10 100 0\n") == 3);  // double free
  CHECK(bad_line("a 10 100 0\nf 10 99 0\n") == 2);              // size mismatch
  CHECK(bad_line("a 10 99999999999999999999999 0\n") == 1);     // overflow
  CHECK(error_of("a 10 100 0\nfree 10 100 0\n").find("t.txt:2: unknown event 'free'") == 0);
  CHECK(error_of("a 10 100 0\na 10 5 0\n").find("still live (allocated at line 1)") != std::string::npos);
}

TEST_CASE("blank lines, comments, CRLF, 0x prefixes and several streams are accepted") {
  trace t = parse_text("# header\n\na 0x10 100 0\r\n  f 10\t100 0  \na 20 5 0x7f00\n");
  REQUIRE(t.events.size() == 3);
  CHECK(t.lines[0] == 3);
  CHECK(t.lines[1] == 4);
  CHECK(t.events[1].kind == op::free);
  CHECK(t.events[1].id == t.events[0].id);
  REQUIRE(t.stream_ids.size() == 2);
  CHECK(t.stream_ids[1] == 0x7f00);
  CHECK(t.events[2].stream == 1);
  CHECK(t.lines_read == 5);
}

TEST_CASE("v1: one thread, no times; a v1 header is accepted") {
  trace t = parse_text(kSample);
  CHECK(t.version == 1);
  CHECK(t.thread_ids == std::vector<std::uint64_t>{0});
  CHECK(t.thread == std::vector<std::uint16_t>(5, 0));
  CHECK(t.time_ns.empty());
  CHECK(t.cross_thread_frees == 0);
  trace h = parse_text(std::string("# vmmalloc-trace v1\n") + kSample);
  CHECK(h.version == 1);
  check_sample(h);
}

const char* kV2 =
    "# vmmalloc-trace v2 pid=4242 clock=steady\n"
    "a 7f0000000000 1000 0 101 0\n"
    "a 7f0000100000 50 0x7f00 0x66 1500\n"        // thread 102 (hex), stream 0x7f00
    "f 7f0000000000 1000 0 102 1500\n"            // freed by the other thread, same TIME is fine
    "# a comment between events\n"
    "a 7f0000000000 300 0x7f00 101 2000000\n"
    "f 7f0000100000 50 0 101 9000000000000\n";  // freed on another stream

TEST_CASE("v2: header, THREAD and TIME per event, the v1 fields unchanged") {
  trace t = parse_text(kV2);
  CHECK(t.version == 2);
  check_sample(t);  // the same five events as kSample
  CHECK(t.thread_ids == std::vector<std::uint64_t>{101, 102});
  CHECK(t.thread == std::vector<std::uint16_t>{0, 1, 1, 0, 0});
  CHECK(t.time_ns == std::vector<std::uint64_t>{0, 1500, 1500, 2000000, 9000000000000});
  CHECK(t.stream_ids == std::vector<std::uint64_t>{0, 0x7f00});
  CHECK(t.events[1].stream == 1);
  CHECK(t.lines == std::vector<std::uint32_t>{2, 3, 4, 6, 7});
  CHECK(t.cross_thread_frees == 2);  // line 4 (101 -> 102) and line 7 (102 -> 101)
  CHECK(t.cross_stream_frees == 1);  // line 7 (0x7f00 -> 0)
}

TEST_CASE("v2: malformed lines give their line number and say what is wrong") {
  const std::string h = "# vmmalloc-trace v2\n";
  // Missing or extra fields name the v2 layout.
  CHECK(error_of(h + "a 10 100 0\n") == "t.txt:2: missing fields (expected 'a ADDR SIZE STREAM THREAD TIME' in a v2 trace)");
  CHECK(error_of(h + "a 10 100 0 1 2 3\n").find("t.txt:2: extra fields") == 0);
  // Bad THREAD, bad TIME (decimal only), TIME going backwards (names the earlier line).
  CHECK(error_of(h + "a 10 100 0 x1 5\n") == "t.txt:2: bad THREAD 'x1' (decimal, or hex with 0x)");
  CHECK(error_of(h + "a 10 100 0 1 0x10\n") == "t.txt:2: bad TIME '0x10' (decimal ns since the trace started)");
  CHECK(error_of(h + "a 10 100 0 1 -1\n").find("t.txt:2: bad TIME") == 0);
  CHECK(error_of(h + "a 10 100 0 1 500\n\na 20 100 0 2 499\n") ==
        "t.txt:4: TIME 499 is before the previous event's (500 at line 2): lines must be in the order the events happened");
  // The v1 checks still apply, with v2's line numbers.
  CHECK(bad_line(h + "a 10 100 0 1 5\nf 10 99 0 2 6\n") == 3);
  CHECK(bad_line(h + "a 10 100 0 1 5\nf 20 100 0 2 6\n") == 3);
  // The header: only on line 1, with a known version.
  CHECK(error_of("a 10 100 0\n# vmmalloc-trace v2\n").find("t.txt:2: the version header") == 0);
  CHECK(error_of("\n# vmmalloc-trace v2\n").find("t.txt:2: the version header") == 0);
  CHECK(error_of("# vmmalloc-trace v3\n") == "t.txt:1: unsupported trace version 'v3' (this parser reads v1 and v2)");
  CHECK(error_of("# vmmalloc-trace\n").find("t.txt:1: version header without a version") == 0);
  // A v2 line in a file without the header: the message says how to mark a v2 trace.
  CHECK(error_of("a 10 100 0 1 5\n").find("'# vmmalloc-trace v2'") != std::string::npos);
  // Comments that merely look similar are comments.
  CHECK(parse_text("# vmmalloc-trace-tools v9\na 10 100 0\n").version == 1);
}

TEST_CASE("v2: many threads map to dense indices in order of first appearance") {
  std::string text = "# vmmalloc-trace v2\n";
  for (int i = 0; i < 300; ++i)
    text += "a " + std::to_string(0x1000 + i) + " 8 0 " + std::to_string(1000 - i) + " " + std::to_string(i) + "\n";
  trace t = parse_text(text);
  REQUIRE(t.thread_ids.size() == 300);
  CHECK(t.thread_ids[0] == 1000);
  CHECK(t.thread_ids[299] == 701);
  CHECK(t.thread[299] == 299);
}

TEST_CASE("plain files parse; a missing file is an error without a line number") {
  temp_file plain(".txt");
  {
    std::ofstream f(plain.path);
    f << kSample;
  }
  check_sample(parse_file(plain.path.string()));
  try {
    (void)parse_file("/nonexistent/trace.txt.gz");
    FAIL("no error");
  } catch (const parse_error& e) {
    CHECK(e.line() == 0);
    CHECK(std::string(e.what()).find("cannot open") != std::string::npos);
  }
}

#ifdef VMM_REPLAY_ZLIB
TEST_CASE(".gz and plain files parse to the same events") {
  temp_file plain(".txt"), gz(".txt.gz");
  {
    std::ofstream f(plain.path);
    f << kSample;
  }
  {
    gzFile g = gzopen(gz.path.c_str(), "wb");
    REQUIRE(g != nullptr);
    REQUIRE(gzputs(g, kSample) > 0);
    REQUIRE(gzclose(g) == Z_OK);
  }
  // The .gz really is compressed (gzip magic), so both paths of zlib are exercised.
  {
    std::ifstream f(gz.path, std::ios::binary);
    unsigned char m[2] = {};
    f.read(reinterpret_cast<char*>(m), 2);
    CHECK(m[0] == 0x1f);
    CHECK(m[1] == 0x8b);
  }
  trace a = parse_file(plain.path.string());
  trace b = parse_file(gz.path.string());
  check_sample(a);
  check_sample(b);
  REQUIRE(a.events.size() == b.events.size());
  for (std::size_t i = 0; i < a.events.size(); ++i) {
    CHECK(a.events[i].id == b.events[i].id);
    CHECK(a.events[i].size == b.events[i].size);
    CHECK(a.events[i].kind == b.events[i].kind);
  }
}

TEST_CASE("file errors: malformed line in a .gz, truncated .gz") {
  temp_file gz(".gz");
  {
    gzFile g = gzopen(gz.path.c_str(), "wb");
    REQUIRE(g != nullptr);
    gzputs(g, "a 10 100 0\na 20 100 0\nq\n");
    gzclose(g);
  }
  try {
    (void)parse_file(gz.path.string());
    FAIL("no error");
  } catch (const parse_error& e) {
    CHECK(e.line() == 3);
  }

  // A gzip stream cut in half: zlib reports it, the parser does not silently stop.
  temp_file cut(".gz");
  {
    std::string text;
    for (int i = 0; i < 20000; ++i) text += "a " + std::to_string(i + 1) + " 100 0\n";
    gzFile g = gzopen(gz.path.c_str(), "wb");
    REQUIRE(g != nullptr);
    gzputs(g, text.c_str());
    gzclose(g);
    auto size = fs::file_size(gz.path);
    fs::copy_file(gz.path, cut.path, fs::copy_options::overwrite_existing);
    fs::resize_file(cut.path, size / 2);
  }
  CHECK_THROWS_AS((void)parse_file(cut.path.string()), parse_error);
}
#endif  // VMM_REPLAY_ZLIB

TEST_CASE("trim events: counted, KEEP in their size, no block named, live bytes unchanged") {
  trace t = parse_text("# vmmalloc-trace v2\na 10 100 0 1 0\nt 0 0 0 1 1\nf 10 100 0 1 2\nt 0 4096 0 2 3\n");
  REQUIRE(t.events.size() == 4);
  CHECK(t.trims == 2);
  CHECK(t.allocs == 1);
  CHECK(t.frees == 1);
  CHECK(t.events[1].kind == op::trim);
  CHECK(t.events[3].size == 4096);
  CHECK(t.live_after == std::vector<std::uint64_t>{100, 100, 0, 0});
  CHECK(parse_text("t 0 0 0\n").trims == 1);  // v1 too
  CHECK(error_of("t 10 0 0\n") == "t.txt:1: a trim ('t') names no block: its ADDR is 0");
  CHECK(error_of("x 10 0 0\n") == "t.txt:1: unknown event 'x' (expected 'a', 'f' or 't')");
}
