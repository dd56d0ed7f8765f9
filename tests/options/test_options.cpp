// SPDX-License-Identifier: Apache-2.0
// options.def and what is generated from it: set_option / describe round trips and refusals,
// README.md's options table, the C API's vmm_policy mapping, libvmmalloc_torch's environment.
// Every case walks the table, so a new row is tested without touching this file.
//
// README.md's table is generated; after editing options.def, rewrite it with
//   build/tests/options/test_options --write-readme README.md
#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "vmmalloc/vmmalloc.h"
#include "vmmalloc/vmmalloc.hpp"
#include "vmmalloc_torch.h"

namespace {

using vmm::option_info;
using vmm::option_kind;

// ---- README.md's table -----------------------------------------------------------------------

constexpr std::string_view kBegin = "<!-- options-table:begin -->\n";
constexpr std::string_view kEnd = "<!-- options-table:end -->";

std::string cell(std::string_view s) {
  std::string out;
  for (char c : s) out += c == '|' ? std::string("\\|") : std::string(1, c);
  return out;
}

// gcc 12 (Release) warns -Wrestrict on const char* + std::string temporaries: strings are appended.
std::string code(std::string_view x, std::string_view after = "") {
  std::string s = "`";
  s += x;
  s += '`';
  s += after;
  return s;
}

// The block between the markers, from option_table().
std::string readme_table() {
  std::string s =
      "<!-- generated: edit include/vmmalloc/options.def, then run "
      "build/tests/options/test_options --write-readme README.md -->\n"
      "| option | default | environment variable | C field | what it does |\n"
      "|---|---|---|---|---|\n";
  for (const option_info& r : vmm::option_table()) {
    const std::string def = r.default_text.empty() ? "\"\"" : r.default_text;
    const std::string env = r.env.empty() ? "–" : code(r.env);
    const std::string c = r.in_c == vmm::c_field::none ? "–"
                          : r.in_c == vmm::c_field::as_is ? code(r.name, " (as is)")
                                                          : code(r.name);
    for (const std::string& col : {code(r.name), code(cell(def)), env, c, cell(r.doc)}) {
      s += "| ";
      s += col;
      s += ' ';
    }
    s += "|\n";
  }
  return s;
}

std::string read_file(const char* path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// [begin, end) of the generated block in README text (after the begin marker's line), or npos.
std::pair<std::size_t, std::size_t> block_of(const std::string& text) {
  const std::size_t b = text.find(kBegin);
  const std::size_t e = text.find(kEnd);
  if (b == std::string::npos || e == std::string::npos || e < b + kBegin.size()) return {std::string::npos, 0};
  return {b + kBegin.size(), e};
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) v.push_back(l);
  return v;
}

// A line diff (longest common subsequence): "- " lines only in `was`, "+ " lines only in `now`.
std::string diff(const std::string& was, const std::string& now) {
  const auto a = lines(was), b = lines(now);
  std::vector<std::vector<int>> l(a.size() + 1, std::vector<int>(b.size() + 1, 0));
  for (std::size_t i = a.size(); i-- > 0;)
    for (std::size_t j = b.size(); j-- > 0;)
      l[i][j] = a[i] == b[j] ? l[i + 1][j + 1] + 1 : std::max(l[i + 1][j], l[i][j + 1]);
  std::string out;
  std::size_t i = 0, j = 0;
  while (i < a.size() || j < b.size()) {
    if (i < a.size() && j < b.size() && a[i] == b[j]) ++i, ++j;
    else if (i < a.size() && (j == b.size() || l[i + 1][j] >= l[i][j + 1])) out += "- " + a[i++] + "\n";
    else out += "+ " + b[j++] + "\n";
  }
  return out;
}

int write_readme(const char* path) {
  std::string text = read_file(path);
  auto [b, e] = block_of(text);
  if (b == std::string::npos) {
    std::cerr << path << ": no " << kBegin.substr(0, kBegin.size() - 1) << " ... " << kEnd << " block\n";
    return 2;
  }
  const std::string now = readme_table();
  if (text.compare(b, e - b, now) == 0) {
    std::cout << path << ": options table up to date\n";
    return 0;
  }
  text.replace(b, e - b, now);
  std::ofstream(path, std::ios::binary) << text;
  std::cout << path << ": options table rewritten\n";
  return 0;
}

// ---- values to try, by kind --------------------------------------------------------------------

std::span<const std::string_view> names_of(option_kind k) {
  switch (k) {
    case option_kind::location: return vmm::location_kind_names;
    case option_kind::compression: return vmm::compression_mode_names;
    case option_kind::ipc: return vmm::ipc_kind_names;
    default: return {};
  }
}

// A value other than the row's default that every backend path accepts (sizes are multiples of
// the 2 MiB granularity, so the arena keeps them as they are).
std::string sample(const option_info& r) {
  switch (r.kind) {
    case option_kind::integer: return r.default_text == "1" ? "0" : "1";
    case option_kind::size: return r.default_text == "4M" ? "6M" : "4M";
    case option_kind::size_or_max: return r.default_text == "max" ? "64M" : "max";
    case option_kind::pow2: return r.default_text == "4K" ? "512" : "4K";
    case option_kind::boolean: return r.default_text == "true" ? "false" : "true";
    case option_kind::peers: return r.default_text == "[1,2]" ? "[]" : "[1,2]";
    case option_kind::path: return "options-trace-%d.txt";
    default: {
      const auto n = names_of(r.kind);
      for (std::size_t i = 0; i < n.size(); ++i)
        if (n[i] == r.default_text) return std::string(n[(i + 1) % n.size()]);
      FAIL("no enumerator names for " << r.name);
      return {};
    }
  }
}

// What a C++ caller only can say (the round trip covers it; the C and torch paths do not take it).
std::string exotic(const option_info& r) {
  switch (r.kind) {
    case option_kind::size: return "1536K";
    case option_kind::peers: return "[1,cpu,2:read,3:none]";
    case option_kind::path: return "/tmp/run.trace";
    default: return sample(r);
  }
}

// A value the row's kind refuses ("" for path, which takes anything).
std::string bad(const option_info& r) {
  switch (r.kind) {
    case option_kind::integer: return "x1";
    case option_kind::size: return "12Q";
    case option_kind::size_or_max: return "lots";
    case option_kind::pow2: return "384";
    case option_kind::boolean: return "maybe";
    case option_kind::peers: return "1,x";
    case option_kind::path: return "";
    default: return "nope";
  }
}

// describe()'s line back into options, row by row (values hold no spaces here).
vmm::options parse_described(const std::string& line) {
  vmm::options o;
  std::istringstream in(line);
  for (std::string tok; in >> tok;) {
    const auto eq = tok.find('=');
    REQUIRE(eq != std::string::npos);
    std::string why;
    INFO(tok);
    REQUIRE(vmm::set_option(o, tok.substr(0, eq), tok.substr(eq + 1), &why).ok());
  }
  return o;
}

void same_members(const vmm::options& a, const vmm::options& b) {
#define VMM_OPTION(kind, type, name, def, env, in_c, doc) CHECK_MESSAGE(a.name == b.name, #name);
#include "vmmalloc/options.def"
#undef VMM_OPTION
}

}  // namespace

// ---- the table and README.md ---------------------------------------------------------------------

TEST_CASE("the table: unique names and variables, defaults that read back") {
  const auto t = vmm::option_table();
  REQUIRE(!t.empty());
  for (std::size_t i = 0; i < t.size(); ++i) {
    INFO(t[i].name);
    CHECK(vmm::find_option(t[i].name) == &t[i]);
    CHECK(!t[i].doc.empty());
    if (!t[i].env.empty()) CHECK(t[i].env.starts_with("VMMALLOC_"));
    for (std::size_t j = 0; j < i; ++j) CHECK((t[j].env.empty() || t[j].env != t[i].env));
    vmm::options o;
    REQUIRE(vmm::set_option(o, t[i], sample(t[i])).ok());
    CHECK(vmm::option_value(o, t[i]) != t[i].default_text);  // the sample is not the default
    REQUIRE(vmm::set_option(o, t[i], t[i].default_text).ok());
    CHECK(vmm::describe(o) == vmm::describe(vmm::options{}));
  }
  CHECK(vmm::find_option("no_such_option") == nullptr);
}

TEST_CASE("README.md's options table is the one generated from options.def") {
  const std::string text = read_file(VMM_README);
  REQUIRE_MESSAGE(!text.empty(), "cannot read " VMM_README);
  auto [b, e] = block_of(text);
  REQUIRE_MESSAGE(b != std::string::npos, VMM_README " has no options-table:begin / options-table:end markers");
  const std::string was = text.substr(b, e - b), now = readme_table();
  if (was != now)
    FAIL_CHECK("README.md's options table differs from options.def (- README.md, + generated); run\n"
               "  build/tests/options/test_options --write-readme README.md\n"
               << diff(was, now));
}

// ---- set_option / describe ------------------------------------------------------------------------

TEST_CASE("describe -> set_option round trip: defaults, samples, C++-only values") {
  const vmm::options d;
  const std::string line = vmm::describe(d);
  CHECK(line.starts_with(std::string(vmm::option_table()[0].name) + "="));
  same_members(parse_described(line), d);

  for (auto pick : {&sample, &exotic}) {
    vmm::options o;
    for (const option_info& r : vmm::option_table()) {
      std::string why;
      INFO(r.name, " = ", pick(r));
      REQUIRE(vmm::set_option(o, r, pick(r), &why).ok());
    }
    const vmm::options back = parse_described(vmm::describe(o));
    same_members(back, o);
    CHECK(vmm::describe(back) == vmm::describe(o));
  }
}

TEST_CASE("values as text: suffixes, max, enumerators, peers, paths with spaces") {
  vmm::options o;
  auto set = [&](const char* name, const char* v) {
    std::string why;
    INFO(name, "=", v);
    REQUIRE(vmm::set_option(o, name, v, &why).ok());
    return vmm::option_value(o, *vmm::find_option(name));
  };
  CHECK(set("free_memory_margin", "16M") == "16M");
  CHECK(o.free_memory_margin == std::size_t{16} << 20);
  CHECK(set("free_memory_margin", " 64 KiB ") == "64K");
  CHECK(set("free_memory_margin", "2048m") == "2G");
  CHECK(set("free_memory_margin", "12345") == "12345");
  CHECK(set("free_memory_margin", "1536K") == "1536K");
  CHECK(set("memory_limit", "MAX") == "max");
  CHECK(o.memory_limit == SIZE_MAX);
  CHECK(set("memory_limit", "1T") == "1T");
  CHECK(set("alignment", "4k") == "4K");
  CHECK(set("thread_cache", "off") == "false");
  CHECK(set("thread_cache", "Yes") == "true");
  CHECK(set("location", "host_numa") == "host_numa");
  CHECK(o.location == vmm::location_kind::host_numa);
  CHECK(set("peers", "3, 1:read ,cpu") == "[3,1:read,cpu]");
  CHECK((o.peers == std::vector<vmm::access_desc>{{3, vmm::access_mode::read_write},
                                                   {1, vmm::access_mode::read},
                                                   {vmm::cpu_device, vmm::access_mode::read_write}}));
  CHECK(set("peers", "none") == "[]");
  CHECK(set("peers", "[]") == "[]");
  CHECK(set("trace_path", "/tmp/a b.trace") == "/tmp/a b.trace");
  CHECK(set("device", "-1") == "-1");
}

TEST_CASE("bad names and values: invalid_value, a message naming the option, options untouched") {
  vmm::options o;
  for (const option_info& r : vmm::option_table()) REQUIRE(vmm::set_option(o, r, exotic(r)).ok());
  const std::string before = vmm::describe(o);

  for (const option_info& r : vmm::option_table()) {
    if (bad(r).empty()) continue;
    INFO(r.name, "=", bad(r));
    std::string why;
    vmm::status st = vmm::set_option(o, r.name, bad(r), &why);
    CHECK(st.kind == vmm::errc::invalid_value);
    CHECK(why.starts_with(std::string(r.name) + "='" + bad(r) + "': "));
    CHECK(vmm::describe(o) == before);
    CHECK(vmm::set_option(o, r, bad(r), &why, "VAR").kind == vmm::errc::invalid_value);
    CHECK(why.starts_with("VAR='" + bad(r) + "': "));  // label: libvmmalloc_torch names its variable
  }
  std::string why;
  CHECK(vmm::set_option(o, "memory_limit", "lots", &why).kind == vmm::errc::invalid_value);
  CHECK(why == "memory_limit='lots': not a size (expected bytes with an optional K/M/G/T suffix, e.g. 512M, or max)");
  CHECK(vmm::set_option(o, "free_memory_margin", "12Q", &why).kind == vmm::errc::invalid_value);
  CHECK(why == "free_memory_margin='12Q': unknown suffix (expected bytes with an optional K/M/G/T suffix, e.g. 512M)");
  CHECK(vmm::set_option(o, "free_memory_margin", "max", &why).kind == vmm::errc::invalid_value);  // not size_or_max
  CHECK(vmm::set_option(o, "free_memory_margin", "99999999T", &why).kind == vmm::errc::invalid_value);
  CHECK(why.find("too large") != std::string::npos);
  CHECK(vmm::set_option(o, "free_memory_margin", "-3", &why).kind == vmm::errc::invalid_value);
  CHECK(vmm::set_option(o, "thread_cache", "maybe", &why).kind == vmm::errc::invalid_value);
  CHECK(why == "thread_cache='maybe': expected 0 or 1");
  CHECK(vmm::set_option(o, "compression", "zstd", &why).kind == vmm::errc::invalid_value);
  CHECK(why == "compression='zstd': expected off, prefer or require");
  CHECK(vmm::set_option(o, "peers", "1:write", &why).kind == vmm::errc::invalid_value);
  CHECK(vmm::set_option(o, "peers", "1,,2", &why).kind == vmm::errc::invalid_value);
  CHECK(vmm::set_option(o, "device", "3x", &why).kind == vmm::errc::invalid_value);

  CHECK(vmm::set_option(o, "no_such_option", "1", &why).kind == vmm::errc::invalid_value);
  CHECK(why.starts_with("unknown option 'no_such_option' (expected one of device, "));
  option_info stray = vmm::option_table()[0];  // a copy: not a row of the table
  CHECK(vmm::set_option(o, stray, "1", &why).kind == vmm::errc::invalid_value);
  CHECK(vmm::set_option(o, "memory_limit", "1G").ok());  // why is optional
  CHECK(vmm::set_option(o, "memory_limit", "x").kind == vmm::errc::invalid_value);
  CHECK(o.memory_limit == std::size_t{1} << 30);
}

// ---- the C API: vmm_policy -> vmm::options ----------------------------------------------------------

namespace {

vmm_policy host_policy() {
  vmm_policy p;
  vmm_policy_init(&p);
  p.backend = VMM_BACKEND_HOST;
  return p;
}

// The options a C policy ends up with, as the C++ allocator behind the handle sees them.
std::string c_describe(const vmm_policy& p) {
  vmm_allocator* a = nullptr;
  INFO(vmm_last_error());
  REQUIRE(vmm_create(&p, &a) == VMM_SUCCESS);
  std::string s = vmm::describe(vmm::from_c(a).opts());
  vmm_destroy(a);
  return s;
}
// The same through the C++ API (the arena rounds some values: both go through it).
std::string cpp_describe(const vmm::options& o) { return vmm::describe(vmm::allocator::host(o).opts()); }

template <class C, class T>
void to_c(const T& v, C& c) { c = static_cast<C>(v); }
void to_c(const std::string& v, const char*& c) { c = v.c_str(); }

// One in_c row: its sample through C, 0 through C, and what C refuses.
template <class CF, class OF>
void check_c_field(const option_info& r, CF c_field, OF o_field) {
  INFO("vmm_policy.", r.name);
  vmm::options want;
  REQUIRE(vmm::set_option(want, r, sample(r)).ok());
  vmm_policy p = host_policy();
  to_c(o_field(want), c_field(p));
  CHECK(c_describe(p) == cpp_describe(want));

  // 0 (NULL): the default (zero_default), or the value 0 itself (as_is).
  p = host_policy();
  c_field(p) = {};
  want = {};
  if (r.in_c == vmm::c_field::as_is) o_field(want) = {};
  CHECK(c_describe(p) == cpp_describe(want));

  using C = std::remove_reference_t<decltype(c_field(p))>;
  vmm_allocator* a = nullptr;
  p = host_policy();
  if constexpr (std::is_enum_v<C>) {
    const int seven = 7;  // what a C caller can store in an enum
    std::memcpy(&c_field(p), &seven, sizeof seven);
    CHECK(vmm_create(&p, &a) == VMM_ERROR_INVALID_VALUE);
    CHECK(std::string(vmm_last_error()).find(r.name) != std::string::npos);
  } else if constexpr (std::is_integral_v<C>) {
    if (r.kind == option_kind::pow2) {
      c_field(p) = 384;
      CHECK(vmm_create(&p, &a) == VMM_ERROR_INVALID_VALUE);
      CHECK(std::string(vmm_last_error()).find(r.name) != std::string::npos);
    }
  }
  CHECK(a == nullptr);
}

}  // namespace

TEST_CASE("C API: vmm_policy_init's policy gives the default options") {
  CHECK(c_describe(host_policy()) == cpp_describe(vmm::options{}));
  vmm_policy zero{};  // without vmm_policy_init: every zero_default field is right at 0
  zero.backend = VMM_BACKEND_HOST;
  vmm::options want;
  for (const option_info& r : vmm::option_table())
    if (r.in_c == vmm::c_field::as_is) REQUIRE(vmm::set_option(want, r, r.kind == option_kind::path ? "" : "0").ok());
  CHECK(c_describe(zero) == cpp_describe(want));
}

TEST_CASE("C API: every vmm_policy field of the table reaches vmm::options") {
  int fields = 0;
#define VMM_TEST_C_0(name)
#define VMM_TEST_C_1(name)                                                                        \
  ++fields;                                                                                       \
  check_c_field(                                                                                  \
      *vmm::find_option(#name), [](vmm_policy& p) -> auto& { return p.name; },                    \
      [](vmm::options& o) -> auto& { return o.name; });
#define VMM_TEST_C_2(name) VMM_TEST_C_1(name)
#define VMM_OPTION(kind, type, name, def, env, in_c, doc) VMM_TEST_C_##in_c(name)
#include "vmmalloc/options.def"
#undef VMM_OPTION
  int rows = 0;
  for (const option_info& r : vmm::option_table()) rows += r.in_c != vmm::c_field::none;
  CHECK(fields == rows);
}

// ---- libvmmalloc_torch: the environment -----------------------------------------------------------

namespace {
void unset_all() {
  for (const option_info& r : vmm::option_table())
    if (!r.env.empty()) unsetenv(std::string(r.env).c_str());
}
}  // namespace

TEST_CASE("libvmmalloc_torch reads every variable of the table") {
  setenv("VMMALLOC_TORCH_BACKEND", "host", 1);  // 8 simulated devices
  unset_all();

  // Every variable set to its sample at once: device 0 shows them all in its config line.
  for (const option_info& r : vmm::option_table())
    if (!r.env.empty()) setenv(std::string(r.env).c_str(), sample(r).c_str(), 1);
  const int rc = vmm_torch_init(0);
  unset_all();
  INFO(vmm_torch_last_error());
  REQUIRE(rc == 0);
  const std::string config = std::string(" ") + vmm_torch_config(0) + " ";
  INFO(config);
  CHECK(config.find(" backend=host ") != std::string::npos);
  for (const option_info& r : vmm::option_table()) {
    if (r.env.empty()) continue;
    vmm::options o;
    std::string v = sample(r);
    if (r.kind == option_kind::path)  // one file per device: device 0's "%d" is 0
      v.replace(v.find("%d"), 2, "0");
    REQUIRE(vmm::set_option(o, r, v).ok());
    std::string want = " ";
    want += r.name;
    want += '=';
    want += vmm::option_value(o, r);
    want += ' ';
    CHECK_MESSAGE(config.find(want) != std::string::npos, r.env);
  }

  // Each bad value refuses device 1, naming the variable; nothing is created.
  for (const option_info& r : vmm::option_table()) {
    if (r.env.empty() || bad(r).empty()) continue;
    setenv(std::string(r.env).c_str(), bad(r).c_str(), 1);
    const int bad_rc = vmm_torch_init(1);
    unset_all();
    const std::string err = vmm_torch_last_error();
    INFO(r.env, ": ", err);
    CHECK(bad_rc == -1);
    CHECK(err.find(std::string(r.env) + "='" + bad(r) + "': ") != std::string::npos);
    CHECK(vmm_torch_initialized(1) == 0);
  }
  REQUIRE(vmm_torch_init(1) == 0);  // defaults
  CHECK(std::string(vmm_torch_config(1)).find(" memory_limit=max ") != std::string::npos);
}

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]) == "--write-readme") {
      if (i + 1 >= argc) {
        std::cerr << "usage: " << argv[0] << " --write-readme README.md\n";
        return 2;
      }
      return write_readme(argv[i + 1]);
    }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
