// A small JSON reader for vmm-plot: enough for vmm-replay's output (objects, arrays, numbers,
// strings, true/false/null), with errors that say where. Numbers are doubles: byte counts stay
// exact up to 2^53 (8 PiB). Nesting is limited to 64 levels so hostile input cannot exhaust the
// stack. Not a general-purpose library: \u escapes outside ASCII become '?'.
#pragma once

#include <charconv>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace vmm::plot {

struct json_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct jvalue {
  enum kind_t { null, boolean, number, string, array, object } kind = null;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<jvalue> arr;
  // Object members in order, keys and values side by side (a vector of pair<string, jvalue>
  // would need jvalue complete here, which clang's libstdc++ checks refuse).
  std::vector<std::string> keys;
  std::vector<jvalue> vals;

  const jvalue* get(std::string_view key) const {
    if (kind != object) return nullptr;
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (keys[i] == key) return &vals[i];
    return nullptr;
  }
  bool is_null() const { return kind == null; }
};

class json_reader {
 public:
  explicit json_reader(std::string_view text) : s_(text) {}

  jvalue parse() {
    jvalue v = value(0);
    ws();
    if (i_ != s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  std::string_view s_;
  std::size_t i_ = 0;

  [[noreturn]] void fail(const std::string& what) const {
    std::size_t line = 1, col = 1;
    for (std::size_t k = 0; k < i_ && k < s_.size(); ++k) {
      if (s_[k] == '\n') ++line, col = 1;
      else ++col;
    }
    throw json_error("line " + std::to_string(line) + ", column " + std::to_string(col) + ": " + what);
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  void expect(char c) {
    ws();
    if (i_ >= s_.size() || s_[i_] != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }
  bool literal(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }

  jvalue value(int depth) {
    if (depth > 64) fail("nested more than 64 levels");
    ws();
    if (i_ >= s_.size()) fail("unexpected end of input");
    jvalue v;
    char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.kind = jvalue::object;
      ws();
      if (i_ < s_.size() && s_[i_] == '}') return ++i_, v;
      for (;;) {
        ws();
        if (i_ >= s_.size() || s_[i_] != '"') fail("expected a key string");
        std::string k = str();
        expect(':');
        v.keys.push_back(std::move(k));
        v.vals.push_back(value(depth + 1));
        ws();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      ++i_;
      v.kind = jvalue::array;
      ws();
      if (i_ < s_.size() && s_[i_] == ']') return ++i_, v;
      for (;;) {
        v.arr.push_back(value(depth + 1));
        ws();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = jvalue::string;
      v.str = str();
      return v;
    }
    if (literal("true")) return v.kind = jvalue::boolean, v.b = true, v;
    if (literal("false")) return v.kind = jvalue::boolean, v;
    if (literal("null")) return v;
    if (c == '-' || (c >= '0' && c <= '9')) {
      std::size_t j = i_;
      while (j < s_.size() && (std::string_view("+-.eE").find(s_[j]) != std::string_view::npos ||
                               (s_[j] >= '0' && s_[j] <= '9')))
        ++j;
      auto r = std::from_chars(s_.data() + i_, s_.data() + j, v.num);
      if (r.ec != std::errc() || r.ptr != s_.data() + j) fail("bad number");
      v.kind = jvalue::number;
      i_ = j;
      return v;
    }
    fail(std::string("unexpected character '") + c + "'");
  }

  std::string str() {
    ++i_;  // opening quote
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) break;
      char e = s_[i_++];
      switch (e) {
        case '"': case '\\': case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) fail("short \\u escape");
          unsigned cp = 0;
          auto r = std::from_chars(s_.data() + i_, s_.data() + i_ + 4, cp, 16);
          if (r.ptr != s_.data() + i_ + 4) fail("bad \\u escape");
          i_ += 4;
          out += cp < 0x80 ? static_cast<char>(cp) : '?';
          break;
        }
        default: fail(std::string("bad escape '\\") + e + "'");
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }
};

}  // namespace vmm::plot
