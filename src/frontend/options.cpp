// SPDX-License-Identifier: Apache-2.0
// Options as text: options.def's rows with one parser and one writer per kind. Each parser writes
// the member only once the whole value is read, so a bad value leaves the options as they were.
#include "vmmalloc/options.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>

namespace vmm {
namespace {

std::string lower(std::string_view s) {
  std::string t(s);
  for (auto& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return t;
}

std::string trim(std::string s) {
  s.erase(0, s.find_first_not_of(" \t"));
  s.erase(s.find_last_not_of(" \t") + 1);
  return s;
}

// Each parse_<kind> returns "" and writes `out`, or returns what is wrong (after "name='text': ")
// and leaves `out` alone. Each format_<kind> writes what its parse_<kind> reads back.

// "512M", "8GiB", "1t", "4096", "64 KB": binary multiples. allow_max: "max" / "inf" / "none".
std::string parse_size_text(std::string_view text, bool allow_max, std::size_t& out) {
  std::string t = trim(lower(text));
  if (allow_max && (t == "max" || t == "inf" || t == "none")) {
    out = std::numeric_limits<std::size_t>::max();
    return {};
  }
  auto bad = [&](const char* why) {
    return std::string(why) + " (expected bytes with an optional K/M/G/T suffix, e.g. 512M" +
           (allow_max ? ", or max)" : ")");
  };
  if (t.empty() || !std::isdigit(static_cast<unsigned char>(t[0]))) return bad("not a size");
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(t.c_str(), &end, 10);
  if (errno == ERANGE) return bad("too large");
  std::string suf = trim(end);
  unsigned shift = 0;
  if (suf.empty() || suf == "b") shift = 0;
  else if (suf == "k" || suf == "kb" || suf == "kib") shift = 10;
  else if (suf == "m" || suf == "mb" || suf == "mib") shift = 20;
  else if (suf == "g" || suf == "gb" || suf == "gib") shift = 30;
  else if (suf == "t" || suf == "tb" || suf == "tib") shift = 40;
  else return bad("unknown suffix");
  if (shift && v > (std::numeric_limits<std::size_t>::max() >> shift)) return bad("too large");
  out = static_cast<std::size_t>(v) << shift;
  return {};
}

// The largest binary suffix that divides it exactly: 8388608 -> "8M", 12345 -> "12345".
std::string format_size(std::size_t v) {
  static constexpr char suffix[] = "KMGT";
  for (unsigned i = 4; v && i >= 1; --i)
    if (v % (std::size_t{1} << (10 * i)) == 0) return std::to_string(v >> (10 * i)) + suffix[i - 1];
  return std::to_string(v);
}

std::string parse_size(std::string_view text, std::size_t& out) { return parse_size_text(text, false, out); }
std::string parse_size_or_max(std::string_view text, std::size_t& out) { return parse_size_text(text, true, out); }
std::string format_size_or_max(std::size_t v) {
  return v == std::numeric_limits<std::size_t>::max() ? "max" : format_size(v);
}

std::string parse_pow2(std::string_view text, std::size_t& out) {
  std::size_t v = 0;
  if (std::string why = parse_size_text(text, false, v); !why.empty()) return why;
  if (v == 0 || (v & (v - 1))) return "not a power of two (expected bytes with an optional K/M/G/T suffix, e.g. 4K)";
  out = v;
  return {};
}
std::string format_pow2(std::size_t v) { return format_size(v); }

// Integers read whole: "3x" is not 3.
bool read_int(const std::string& t, long lo, long hi, int& out) {
  if (t.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(t.c_str(), &end, 10);
  if (*end || errno || v < lo || v > hi) return false;
  out = static_cast<int>(v);
  return true;
}

std::string parse_int(std::string_view text, int& out) {
  return read_int(trim(std::string(text)), INT_MIN, INT_MAX, out) ? std::string() : "expected an integer";
}
std::string format_int(int v) { return std::to_string(v); }

std::string parse_bool(std::string_view text, bool& out) {
  std::string t = lower(text);
  if (t == "1" || t == "true" || t == "on" || t == "yes") out = true;
  else if (t == "0" || t == "false" || t == "off" || t == "no") out = false;
  else return "expected 0 or 1";
  return {};
}
std::string format_bool(bool v) { return v ? "true" : "false"; }

// Enumerators by name: "expected off, prefer or require".
template <class E>
std::string parse_enum(std::string_view text, E& out) {
  const std::string t = trim(lower(text));
  const auto names = enum_names(E{});
  for (std::size_t i = 0; i < names.size(); ++i)
    if (t == names[i]) {
      out = static_cast<E>(i);
      return {};
    }
  std::string why = "expected ";
  for (std::size_t i = 0; i < names.size(); ++i)
    why += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + std::string(names[i]);
  return why;
}
template <class E>
std::string format_enum(E v) {
  const auto names = enum_names(E{});
  const auto i = static_cast<std::size_t>(v);
  return i < names.size() ? std::string(names[i]) : std::to_string(i);
}
std::string parse_location(std::string_view t, location_kind& out) { return parse_enum(t, out); }
std::string parse_compression(std::string_view t, compression_mode& out) { return parse_enum(t, out); }
std::string parse_ipc(std::string_view t, ipc_kind& out) { return parse_enum(t, out); }
std::string format_location(location_kind v) { return format_enum(v); }
std::string format_compression(compression_mode v) { return format_enum(v); }
std::string format_ipc(ipc_kind v) { return format_enum(v); }

// "[1,3,cpu,2:read]", brackets optional; "none" or "" (or "[]") = no peers.
std::string parse_peers(std::string_view text, std::vector<access_desc>& out) {
  std::string t = trim(lower(text));
  if (t.size() >= 2 && t.front() == '[' && t.back() == ']') t = trim(t.substr(1, t.size() - 2));
  std::vector<access_desc> v;
  if (t != "none" && !t.empty()) {
    for (std::size_t i = 0; i <= t.size();) {
      std::size_t j = std::min(t.find(',', i), t.size());
      std::string item = trim(t.substr(i, j - i));
      access_desc d;
      bool ok = true;
      if (auto colon = item.find(':'); colon != std::string::npos) {
        ok = parse_enum(item.substr(colon + 1), d.mode).empty();
        item = trim(item.substr(0, colon));
      }
      if (item == "cpu") d.device = cpu_device;
      else ok = ok && read_int(item, 0, INT_MAX, d.device);
      if (!ok) return "expected none or a comma list of device ordinals (e.g. 1,3; cpu; 2:read for read only)";
      v.push_back(d);
      i = j + 1;
    }
  }
  out = std::move(v);
  return {};
}
std::string format_peers(const std::vector<access_desc>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    s += i ? "," : "";
    s += v[i].device == cpu_device ? std::string("cpu") : std::to_string(v[i].device);
    if (v[i].mode != access_mode::read_write) {
      s += ':';
      s += format_enum(v[i].mode);
    }
  }
  return s + "]";
}

std::string parse_path(std::string_view text, std::string& out) {
  out = text;
  return {};
}
std::string format_path(const std::string& v) { return v; }

// options.def's kind tokens (int and bool are keywords) as option_kind.
#define VMM_KIND_int option_kind::integer
#define VMM_KIND_size option_kind::size
#define VMM_KIND_size_or_max option_kind::size_or_max
#define VMM_KIND_pow2 option_kind::pow2
#define VMM_KIND_bool option_kind::boolean
#define VMM_KIND_location option_kind::location
#define VMM_KIND_compression option_kind::compression
#define VMM_KIND_ipc option_kind::ipc
#define VMM_KIND_peers option_kind::peers
#define VMM_KIND_path option_kind::path

// Per row: its member parsed and written by its kind (captureless lambdas: a constant table).
struct row_ops {
  std::string (*parse)(options&, std::string_view);
  std::string (*format)(const options&);
};
constexpr row_ops ops[] = {
#define VMM_OPTION(kind, type, name, def, env, in_c, doc)                         \
  {[](options& o, std::string_view v) { return parse_##kind(v, o.name); }, \
   [](const options& o) { return format_##kind(o.name); }},
#include "vmmalloc/options.def"
#undef VMM_OPTION
};

std::vector<option_info> make_table() {
  const options d;
  return {
#define VMM_OPTION(kind, type, name, def, env, in_c, doc) \
  {#name, VMM_KIND_##kind, env, static_cast<c_field>(in_c), doc, format_##kind(d.name)},
#include "vmmalloc/options.def"
#undef VMM_OPTION
  };
}

// The row's index in option_table(), or -1 for an option_info that is not one of its rows.
std::ptrdiff_t index_of(const option_info& row) {
  const auto t = option_table();
  for (std::size_t i = 0; i < t.size(); ++i)
    if (&t[i] == &row) return static_cast<std::ptrdiff_t>(i);
  return -1;
}

status invalid(std::string* why, std::string text) {
  if (why) *why = std::move(text);
  return {errc::invalid_value, EINVAL, "EINVAL", "vmm::set_option"};
}

}  // namespace

std::span<const option_info> option_table() {
  static const std::vector<option_info> table = make_table();
  return table;
}

const option_info* find_option(std::string_view name) {
  for (const option_info& r : option_table())
    if (r.name == name) return &r;
  return nullptr;
}

status set_option(options& o, const option_info& row, std::string_view value, std::string* why,
                  std::string_view label) {
  const std::ptrdiff_t i = index_of(row);
  if (i < 0) return invalid(why, std::string(row.name) + ": not a row of vmm::option_table()");
  if (std::string problem = ops[i].parse(o, value); !problem.empty())
    return invalid(why, std::string(label.empty() ? row.name : label) + "='" + std::string(value) + "': " + problem);
  return status::success();
}

status set_option(options& o, std::string_view name, std::string_view value, std::string* why) {
  if (const option_info* row = find_option(name)) return set_option(o, *row, value, why);
  std::string names;
  for (const option_info& r : option_table()) names += (names.empty() ? "" : ", ") + std::string(r.name);
  return invalid(why, "unknown option '" + std::string(name) + "' (expected one of " + names + ")");
}

std::string option_value(const options& o, const option_info& row) {
  const std::ptrdiff_t i = index_of(row);
  return i < 0 ? std::string() : ops[i].format(o);
}

std::string describe(const options& o) {
  std::string s;
  const auto t = option_table();
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (i) s += ' ';
    s += t[i].name;
    s += '=';
    s += ops[i].format(o);
  }
  return s;
}

}  // namespace vmm
