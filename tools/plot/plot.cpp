// SPDX-License-Identifier: Apache-2.0
// vmm-plot: memory over a trace's event index, as one self-contained SVG.
//
//   vmm-plot INPUT... -o OUT.svg [--title TEXT] [--samples N] [--width PX] [--height PX]
//
// INPUT is either
//  * an allocation trace (shared format, plain or .gz, read by vmm_replay_core's parser): plots the
//    live (requested) bytes after each event; or
//  * vmm-replay's JSON written with --samples N: plots, per allocator, live, mapped (physical
//    memory held) and reserved (virtual address space) bytes from its "timeline".
// Several inputs are drawn on one chart (e.g. a host run and a GPU run of the same trace).
//
// Picture: live bytes as a grey area (one series when every input replays the same trace), one
// colour per allocator, line style per kind (mapped solid, reserved dashed, live dotted when not
// shared), the peak of each series marked with a dot and a label placed where it overlaps nothing
// else, axes in B/KiB/MiB/GiB with 1-2-5 steps, a legend on the right. Reserved bytes far above
// everything else (vmmalloc reserves 2x the device memory up front) would flatten the chart: a
// reserved series more than 3x the largest live/mapped peak is listed in the legend with its value
// and not drawn.
//
// Every series is a <g class="series" data-allocator=".." data-kind="live|mapped|reserved"
// data-peak-bytes=".." data-peak-event=".." data-off-scale="true|false">, every peak marker a
// <g class="peak" ...>, so scripts (and the tests) can read the picture back.
//
// Exit codes: 0 ok, 1 cannot write the output, 2 usage or unreadable/malformed input.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "replay_json.hpp"
#include "timeline.hpp"
#include "tool_cli.hpp"
#include "trace.hpp"

namespace {

enum class kind { live, mapped, reserved };
const char* kind_name(kind k) { return k == kind::live ? "live" : k == kind::mapped ? "mapped" : "reserved"; }
const char* kind_words(kind k) {
  return k == kind::live ? "live (requested)" : k == kind::mapped ? "mapped (physical held)" : "reserved (VA)";
}

struct series {
  std::string who;  // allocator label; "" = the live series shared by every input
  kind k = kind::live;
  std::vector<double> x, y;  // event index, bytes
  double peak_x = 0, peak_y = 0;
  std::string colour, source;
  bool off_scale = false;
};

struct input_row {  // one allocator of one input (a trace input is one row without a name)
  std::string name, backend, trace;
  std::size_t input = 0;
  double events = 0;
  series live;
  std::optional<series> mapped, reserved;
};

struct cli {
  std::vector<std::string> inputs;
  std::string out, title;
  std::size_t samples = 2000;
  int width = 1200, height = 640;
};

[[noreturn]] void die(const std::string& msg, int code = 2) {
  std::fprintf(stderr, "vmm-plot: %s\n", msg.c_str());
  std::exit(code);
}

cli parse_cli(int argc, char** argv) {
  cli c;
  CLI::App app{"One self-contained SVG of memory over a trace's event index.", "vmm-plot"};
  app.add_option("INPUT", c.inputs,
                 "an allocation trace (plain or .gz): live bytes over the event index; or vmm-replay's JSON "
                 "written with --samples N --json FILE: live, mapped and reserved bytes per allocator");
  app.add_option("-o,--output", c.out, "the SVG to write")->type_name("FILE");
  app.add_option("--title", c.title, "chart title (default: from the inputs)");
  app.add_option("--samples", c.samples,
                 "points per series taken from a trace input (default 2000; each the maximum since the previous "
                 "one, plus the exact peak)")
      ->type_name("N");
  std::uint64_t width = 1200, height = 640;
  app.add_option("--width", width, "picture width in pixels (default 1200)")->type_name("PX");
  app.add_option("--height", height, "picture height in pixels (default 640)")->type_name("PX");
  vmm::tools::parse_or_exit(app, argc, argv);
  c.width = static_cast<int>(std::min<std::uint64_t>(width, 20000));
  c.height = static_cast<int>(std::min<std::uint64_t>(height, 20000));
  if (c.inputs.empty()) vmm::tools::usage_error(app, "no input given");
  if (c.out.empty()) vmm::tools::usage_error(app, "no output given (-o OUT.svg)");
  if (c.samples < 2) vmm::tools::usage_error(app, "--samples needs N >= 2");
  if (c.width < 480 || c.height < 320) vmm::tools::usage_error(app, "--width/--height: at least 480 x 320");
  return c;
}

std::string basename_of(const std::string& p) {
  auto k = p.find_last_of('/');
  return k == std::string::npos ? p : p.substr(k + 1);
}

// ---- inputs -----------------------------------------------------------------------------------

series to_series(kind k, const std::vector<std::size_t>& ev, const std::vector<std::uint64_t>& v,
                 const vmm::replay::series_peak& p) {
  series s;
  s.k = k;
  s.x.assign(ev.begin(), ev.end());
  s.y.assign(v.begin(), v.end());
  s.peak_x = double(p.event);
  s.peak_y = double(p.bytes);
  return s;
}

input_row read_trace(const std::string& path, std::size_t samples, std::size_t index) {
  vmm::replay::trace t;
  try {
    t = vmm::replay::parse_file(path);
  } catch (const vmm::replay::parse_error& e) {
    die(e.what());
  }
  if (t.events.empty()) die(path + ": no events");
  auto tl = vmm::replay::make_timeline(t.live_after, {}, {}, samples);
  input_row r;
  r.trace = path;
  r.input = index;
  r.events = double(t.events.size());
  r.live = to_series(kind::live, tl.event, tl.live, tl.peak_live);
  r.live.source = "computed from the trace";
  return r;
}

// A series as vmm-replay's JSON holds it, on the timeline's event indices.
series from_json(const vmm::plot::json_series& j, kind k, const std::vector<double>& ev) {
  series s;
  s.k = k;
  s.x = ev;
  s.y = j.y;
  s.peak_x = j.peak_event;
  s.peak_y = j.peak_bytes;
  s.source = j.source;
  return s;
}

std::vector<input_row> read_replay_json(const std::string& path, const std::string& text, std::size_t index) {
  std::vector<vmm::plot::replay_row> got;
  try {
    got = vmm::plot::read_replay_json(text, path);
  } catch (const vmm::plot::input_error& e) {
    die(e.what());
  }
  std::vector<input_row> out;
  for (auto& r : got) {
    input_row row;
    row.name = r.name;
    row.backend = r.backend;
    row.trace = r.trace;
    row.input = index;
    row.events = r.events;
    row.live = from_json(r.live, kind::live, r.event);
    row.live.source = "computed from the trace";
    if (r.mapped) row.mapped = from_json(*r.mapped, kind::mapped, r.event);
    if (r.reserved) row.reserved = from_json(*r.reserved, kind::reserved, r.event);
    out.push_back(std::move(row));
  }
  return out;
}

std::vector<input_row> read_input(const std::string& path, std::size_t samples, std::size_t index) {
  std::ifstream f(path, std::ios::binary);
  if (!f) die(path + ": cannot open: " + std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) die(path + ": read error");
  // gzip or anything not starting with '[' / '{' is a trace; the trace parser reports what is wrong.
  bool gz = text.size() >= 2 && static_cast<unsigned char>(text[0]) == 0x1f && static_cast<unsigned char>(text[1]) == 0x8b;
  std::size_t i = text.find_first_not_of(" \t\r\n");
  if (!gz && i != std::string::npos && (text[i] == '[' || text[i] == '{')) return read_replay_json(path, text, index);
  text.clear();
  text.shrink_to_fit();
  return {read_trace(path, samples, index)};
}

// ---- formatting -------------------------------------------------------------------------------

struct unit {
  double bytes;
  const char* name;
};
unit unit_for(double max_bytes) {
  if (max_bytes >= 2.0 * (1ull << 30)) return {double(1ull << 30), "GiB"};
  if (max_bytes >= 2.0 * (1 << 20)) return {double(1 << 20), "MiB"};
  if (max_bytes >= 2.0 * (1 << 10)) return {double(1 << 10), "KiB"};
  return {1, "B"};
}

// Three significant digits: "7.51 GiB", "750 MiB", "12 B".
std::string human_bytes(double b) {
  static const char* names[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int k = 0;
  while (b >= 1024 && k < 5) b /= 1024, ++k;
  char s[48];
  if (k == 0) std::snprintf(s, sizeof s, "%.0f B", b);
  else std::snprintf(s, sizeof s, b >= 100 ? "%.0f %s" : b >= 10 ? "%.1f %s" : "%.2f %s", b, names[k]);
  return s;
}

std::string with_commas(double v) {
  std::string d = std::to_string(static_cast<unsigned long long>(std::llround(v)));
  for (int i = int(d.size()) - 3; i > 0; i -= 3) d.insert(std::size_t(i), 1, ',');
  return d;
}

// Tick labels: up to 3 significant digits, no trailing zeros.
std::string trim_num(double v) {
  char s[32];
  std::snprintf(s, sizeof s, "%.3f", v);
  std::string r = s;
  while (r.back() == '0') r.pop_back();
  if (r.back() == '.') r.pop_back();
  return r == "-0" ? "0" : r;
}
std::string count_label(double v) {
  if (v >= 1e6) return trim_num(v / 1e6) + "M";
  if (v >= 1e3) return trim_num(v / 1e3) + "k";
  return trim_num(v);
}

// 1, 2 or 5 x 10^k, giving about `target` steps over range.
double nice_step(double range, double target) {
  double raw = range / std::max(1.0, target);
  double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double n = raw / mag;
  return (n < 1.5 ? 1 : n < 3 ? 2 : n < 7 ? 5 : 10) * mag;
}

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '&') o += "&amp;";
    else if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '"') o += "&quot;";
    else if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n') o += ' ';
    else o += c;
  }
  return o;
}

std::string fmt(double v) {  // SVG coordinates: one decimal is sub-pixel
  char s[32];
  std::snprintf(s, sizeof s, "%.1f", v);
  return s;
}

// Text width estimate (no font metrics in a self-contained file): DejaVu/Helvetica average about
// 0.6 em; a little more keeps boxes from clipping their text.
double text_w(const std::string& s, double size) { return 0.62 * size * double(s.size()); }

// Okabe-Ito (colour-blind safe), fixed per known allocator so charts agree with each other.
const char* colour_for(const std::string& name, std::vector<std::string>& used) {
  static const std::pair<const char*, const char*> fixed[] = {{"vmmalloc", "#0072B2"}, {"cudaMallocAsync", "#D55E00"},
                                                              {"torch", "#009E73"},    {"cudaMalloc", "#CC79A7"},
                                                              {"malloc", "#E69F00"},   {"null", "#56B4E9"}};
  static const char* spare[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#8C564B", "#7F7F7F"};
  for (auto& [n, c] : fixed)
    if (name == n && std::find(used.begin(), used.end(), c) == used.end()) return used.push_back(c), c;
  for (const char* c : spare)
    if (std::find(used.begin(), used.end(), c) == used.end()) return used.push_back(c), c;
  return "#333333";
}

// ---- layout helpers ---------------------------------------------------------------------------

struct box {
  double x, y, w, h;
  bool hits(const box& o, double pad = 2) const {
    return x < o.x + o.w + pad && o.x < x + w + pad && y < o.y + o.h + pad && o.y < y + h + pad;
  }
};

// ---- the chart --------------------------------------------------------------------------------

std::string render(std::vector<series> all, const cli& c, const std::string& title, const std::string& subtitle,
                   double events) {
  const double W = c.width, H = c.height;
  const double font = 12, small = 11;

  // Legend entries (and so its width) first: the plot gets what is left.
  struct entry {
    const series* s;
    std::string text;
  };
  std::vector<entry> legend;
  double legend_w = 0;
  for (auto& s : all) {
    std::string t = s.who.empty() ? std::string(kind_words(s.k)) : s.who + ": " + kind_words(s.k);
    if (s.off_scale) t += " " + human_bytes(s.peak_y) + " (off scale, not drawn)";
    legend.push_back({&s, t});
    legend_w = std::max(legend_w, 40 + text_w(t, small));
  }
  const std::string note1 = "dot: peak of the series";
  const std::string note2 = "each point: the maximum since the previous one";
  legend_w = std::max({legend_w, text_w(note2, 10) + 8, 160.0});
  legend_w = std::min(legend_w, W * 0.38);

  const double L = 86, T = 74, R = W - legend_w - 28, B = H - 64;
  // Long subtitles (many allocators) are cut rather than run off the picture.
  std::string sub = subtitle;
  const std::size_t fit = static_cast<std::size_t>((W - L - 16) / (0.62 * small));
  if (sub.size() > fit) sub = sub.substr(0, fit - 3) + "...";
  const double pw = R - L, ph = B - T;

  // Y range: drawn series only.
  double ymax = 1;
  for (auto& s : all)
    if (!s.off_scale) ymax = std::max(ymax, s.peak_y);
  const unit u = unit_for(ymax);
  const double ystep = nice_step(ymax * 1.12 / u.bytes, std::max(3.0, ph / 60)) * u.bytes;
  const double ytop = std::ceil(ymax * 1.12 / ystep) * ystep;
  const double xmax = std::max(1.0, events - 1);
  const double xstep = std::max(1.0, nice_step(xmax, std::max(2.0, pw / 110)));  // whole events
  auto X = [&](double e) { return L + pw * e / xmax; };
  auto Y = [&](double b) { return B - ph * b / ytop; };

  std::ostringstream o;
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << c.width << "\" height=\"" << c.height
    << "\" viewBox=\"0 0 " << c.width << ' ' << c.height
    << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"" << font << "\">\n"
    << "<title>" << esc(title) << "</title>\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n"
    << "<text x=\"" << fmt(L) << "\" y=\"28\" font-size=\"18\" font-weight=\"bold\" fill=\"#222\">" << esc(title)
    << "</text>\n"
    << "<text x=\"" << fmt(L) << "\" y=\"50\" font-size=\"" << small << "\" fill=\"#555\">" << esc(sub)
    << "</text>\n";

  // Grid, ticks, axis labels.
  o << "<g class=\"axes\" stroke=\"#e3e3e3\" stroke-width=\"1\">\n";
  for (double v = 0; v <= ytop * (1 + 1e-9); v += ystep)
    o << "<line x1=\"" << fmt(L) << "\" x2=\"" << fmt(R) << "\" y1=\"" << fmt(Y(v)) << "\" y2=\"" << fmt(Y(v)) << "\"/>\n";
  for (double v = 0; v <= xmax * (1 + 1e-9); v += xstep)
    o << "<line x1=\"" << fmt(X(v)) << "\" x2=\"" << fmt(X(v)) << "\" y1=\"" << fmt(T) << "\" y2=\"" << fmt(B) << "\"/>\n";
  o << "</g>\n<g class=\"ticks\" fill=\"#444\" font-size=\"" << small << "\">\n";
  for (double v = 0; v <= ytop * (1 + 1e-9); v += ystep)
    o << "<text x=\"" << fmt(L - 8) << "\" y=\"" << fmt(Y(v) + 4) << "\" text-anchor=\"end\">"
      << (v == 0 ? std::string("0") : trim_num(v / u.bytes) + " " + u.name) << "</text>\n";
  for (double v = 0; v <= xmax * (1 + 1e-9); v += xstep)
    o << "<text x=\"" << fmt(X(v)) << "\" y=\"" << fmt(B + 18) << "\" text-anchor=\"middle\">" << count_label(v)
      << "</text>\n";
  o << "</g>\n"
    << "<rect x=\"" << fmt(L) << "\" y=\"" << fmt(T) << "\" width=\"" << fmt(pw) << "\" height=\"" << fmt(ph)
    << "\" fill=\"none\" stroke=\"#999\"/>\n"
    << "<text x=\"" << fmt(L + pw / 2) << "\" y=\"" << fmt(B + 44) << "\" text-anchor=\"middle\" fill=\"#333\">"
    << "event index (allocations and frees, in trace order)</text>\n"
    << "<text transform=\"translate(20," << fmt(T + ph / 2) << ") rotate(-90)\" text-anchor=\"middle\" fill=\"#333\">"
    << "bytes (" << u.name << ")</text>\n";

  // Series: the shared live area first, then lines (reserved, mapped, live), so mapped sits on top.
  auto points = [&](const series& s) {
    std::string p;
    p.reserve(s.x.size() * 14);
    for (std::size_t i = 0; i < s.x.size(); ++i) (p += i ? " " : "") += fmt(X(s.x[i])) + "," + fmt(Y(s.y[i]));
    return p;
  };
  auto style = [&](const series& s) -> std::string {
    if (s.who.empty()) return "stroke=\"#444444\" stroke-width=\"1.3\"";
    std::string c = "stroke=\"" + s.colour + "\"";
    if (s.k == kind::mapped) return c + " stroke-width=\"2\"";
    if (s.k == kind::reserved) return c + " stroke-width=\"1.8\" stroke-dasharray=\"8,4\"";
    return c + " stroke-width=\"2\" stroke-dasharray=\"1.5,3.5\" stroke-linecap=\"round\"";
  };
  auto head = [&](const series& s) {
    return "<g class=\"series\" data-allocator=\"" + esc(s.who) + "\" data-kind=\"" + kind_name(s.k) +
           "\" data-peak-bytes=\"" + std::to_string(std::llround(s.peak_y)) + "\" data-peak-event=\"" +
           std::to_string(std::llround(s.peak_x)) + "\" data-off-scale=\"" + (s.off_scale ? "true" : "false") + "\">";
  };
  std::vector<const series*> order;
  for (kind k : {kind::live, kind::reserved, kind::mapped})
    for (auto& s : all)
      if (s.k == k) order.push_back(&s);
  o << "<defs><clipPath id=\"plot\"><rect x=\"" << fmt(L) << "\" y=\"" << fmt(T) << "\" width=\"" << fmt(pw)
    << "\" height=\"" << fmt(ph) << "\"/></clipPath></defs>\n";
  for (const series* s : order) {
    o << head(*s) << "<title>" << esc((s->who.empty() ? "" : s->who + ": ") + kind_words(s->k) + ", peak " +
                                      human_bytes(s->peak_y) + " at event " + with_commas(s->peak_x) +
                                      (s->source.empty() ? "" : "; " + s->source))
      << "</title>";
    if (!s->off_scale) {
      std::string p = points(*s);
      if (s->who.empty())
        o << "<polygon clip-path=\"url(#plot)\" fill=\"#000000\" fill-opacity=\"0.09\" stroke=\"none\" points=\""
          << fmt(X(s->x.front())) << "," << fmt(B) << " " << p << " " << fmt(X(s->x.back())) << "," << fmt(B)
          << "\"/>";
      o << "<polyline clip-path=\"url(#plot)\" fill=\"none\" stroke-linejoin=\"round\" " << style(*s) << " points=\""
        << p << "\"/>";
    }
    o << "</g>\n";
  }

  // Peak markers: dot on the line, label in the first free spot around it (boxes never overlap
  // each other, the dots, or the plot border when any spot allows it).
  std::vector<box> taken;
  struct mark {
    const series* s;
    double cx, cy;
  };
  std::vector<mark> marks;
  for (const series* s : order)
    if (!s->off_scale) {
      marks.push_back({s, X(s->peak_x), Y(s->peak_y)});
      taken.push_back({X(s->peak_x) - 5, Y(s->peak_y) - 5, 10, 10});
    }
  // Highest peaks get the spots closest to their dots.
  std::stable_sort(marks.begin(), marks.end(), [](const mark& a, const mark& b) { return a.cy < b.cy; });
  for (const mark& m : marks) {
    const series& s = *m.s;
    std::string l1 = (s.who.empty() ? std::string("live") : s.who + " " + kind_name(s.k)) + " peak " + human_bytes(s.peak_y);
    std::string l2 = "at event " + with_commas(s.peak_x);
    const double bw = std::max(text_w(l1, small), text_w(l2, 10)) + 10, bh = 30;
    std::optional<box> best;
    for (int step = 0; step < 40 && !best; ++step) {
      const double lift = step * (bh / 2 + 2);
      const box cands[] = {{m.cx + 9, m.cy - bh - 6 - lift, bw, bh}, {m.cx - 9 - bw, m.cy - bh - 6 - lift, bw, bh},
                           {m.cx + 9, m.cy + 6 + lift, bw, bh},      {m.cx - 9 - bw, m.cy + 6 + lift, bw, bh}};
      for (const box& b : cands) {
        if (b.x < L + 2 || b.x + b.w > R - 2 || b.y < T + 2 || b.y + b.h > B - 2) continue;
        if (std::any_of(taken.begin(), taken.end(), [&](const box& t) { return b.hits(t); })) continue;
        best = b;
        break;
      }
    }
    if (!best) best = box{std::clamp(m.cx + 9, L + 2, R - bw - 2), std::clamp(m.cy - bh - 6, T + 2, B - bh - 2), bw, bh};
    taken.push_back(*best);
    const box& b = *best;
    const std::string col = s.who.empty() ? "#444444" : s.colour;
    o << "<g class=\"peak\" data-allocator=\"" << esc(s.who) << "\" data-kind=\"" << kind_name(s.k)
      << "\" data-bytes=\"" << std::llround(s.peak_y) << "\" data-event=\"" << std::llround(s.peak_x) << "\">";
    // Leader from the dot to the box's nearest corner when the box sits away from the dot.
    double ax = std::clamp(m.cx, b.x, b.x + b.w), ay = std::clamp(m.cy, b.y, b.y + b.h);
    if (std::hypot(ax - m.cx, ay - m.cy) > 12)
      o << "<line x1=\"" << fmt(m.cx) << "\" y1=\"" << fmt(m.cy) << "\" x2=\"" << fmt(ax) << "\" y2=\"" << fmt(ay)
        << "\" stroke=\"" << col << "\" stroke-width=\"1\"/>";
    o << "<rect x=\"" << fmt(b.x) << "\" y=\"" << fmt(b.y) << "\" width=\"" << fmt(b.w) << "\" height=\"" << fmt(b.h)
      << "\" rx=\"3\" fill=\"#ffffff\" fill-opacity=\"0.9\" stroke=\"" << col << "\" stroke-width=\"0.8\"/>"
      << "<text x=\"" << fmt(b.x + 5) << "\" y=\"" << fmt(b.y + 13) << "\" font-size=\"" << small << "\" fill=\"" << col
      << "\" font-weight=\"bold\">" << esc(l1) << "</text>"
      << "<text x=\"" << fmt(b.x + 5) << "\" y=\"" << fmt(b.y + 25) << "\" font-size=\"10\" fill=\"#555\">" << esc(l2)
      << "</text>"
      << "<circle cx=\"" << fmt(m.cx) << "\" cy=\"" << fmt(m.cy) << "\" r=\"4.5\" fill=\"" << col
      << "\" stroke=\"#ffffff\" stroke-width=\"1.5\"/></g>\n";
  }

  // Legend.
  const double lx = R + 20;
  double ly = T + 4;
  o << "<g class=\"legend\" font-size=\"" << small << "\">\n"
    << "<text x=\"" << fmt(lx) << "\" y=\"" << fmt(ly + 4) << "\" font-weight=\"bold\" fill=\"#222\">series</text>\n";
  ly += 22;
  for (auto& e : legend) {
    const series& s = *e.s;
    double my = ly - 4;
    o << "<g class=\"legend-entry\" data-allocator=\"" << esc(s.who) << "\" data-kind=\"" << kind_name(s.k) << "\">";
    if (s.who.empty())
      o << "<rect x=\"" << fmt(lx) << "\" y=\"" << fmt(my - 6) << "\" width=\"28\" height=\"12\" fill=\"#000\" fill-opacity=\"0.09\"/>";
    o << "<line x1=\"" << fmt(lx) << "\" x2=\"" << fmt(lx + 28) << "\" y1=\"" << fmt(my) << "\" y2=\"" << fmt(my)
      << "\" " << style(s) << "/>"
      << "<text x=\"" << fmt(lx + 36) << "\" y=\"" << fmt(ly) << "\" fill=\"" << (s.off_scale ? "#777" : "#222") << "\">"
      << esc(e.text) << "</text></g>\n";
    ly += 20;
  }
  ly += 6;
  o << "<text x=\"" << fmt(lx) << "\" y=\"" << fmt(ly) << "\" font-size=\"10\" fill=\"#666\">" << esc(note1) << "</text>\n";
  o << "<text x=\"" << fmt(lx) << "\" y=\"" << fmt(ly + 14) << "\" font-size=\"10\" fill=\"#666\">" << esc(note2)
    << "</text>\n";
  o << "</g>\n</svg>\n";
  return o.str();
}

}  // namespace

int main(int argc, char** argv) {
  cli c = parse_cli(argc, argv);
  std::vector<input_row> rows;
  for (std::size_t k = 0; k < c.inputs.size(); ++k)
    for (auto& r : read_input(c.inputs[k], c.samples, k)) rows.push_back(std::move(r));

  // Labels: the allocator's name, with its backend (and input number) when names repeat.
  std::map<std::string, int> count;
  for (auto& r : rows) ++count[r.name];
  std::vector<std::string> used_colours;
  std::vector<std::string> labels;
  for (auto& r : rows) {
    std::string l = r.name;
    if (count[r.name] > 1 && !r.backend.empty()) l += " (" + r.backend + ")";
    labels.push_back(l);
  }
  const std::vector<std::string> first = labels;  // still repeated: add the input file's name
  for (std::size_t k = 0; k < rows.size(); ++k)
    if (std::count(first.begin(), first.end(), first[k]) > 1) labels[k] += " [" + basename_of(c.inputs[rows[k].input]) + "]";

  // One live series when every row replays the same trace (same length and peak); else one each.
  std::map<std::size_t, const char*> row_colour;
  for (int pass = 0; pass < 2; ++pass)
    for (std::size_t k = 0; k < rows.size(); ++k) {
      bool repeat = std::find_if(rows.begin(), rows.begin() + long(k), [&](auto& r) { return r.name == rows[k].name; }) !=
                    rows.begin() + long(k);
      if (!rows[k].name.empty() && repeat == (pass == 1)) row_colour[k] = colour_for(rows[k].name, used_colours);
    }
  bool shared = true;
  for (auto& r : rows)
    shared = shared && r.events == rows[0].events && r.live.peak_x == rows[0].live.peak_x &&
             r.live.peak_y == rows[0].live.peak_y;
  std::vector<series> all;
  double events = 0;
  for (auto& r : rows) events = std::max(events, r.events);
  if (shared) {
    // The densest copy (a trace input samples more finely than a replay JSON may).
    auto it = std::max_element(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.live.x.size() < b.live.x.size(); });
    all.push_back(it->live);
    all.back().who = "";
  }
  for (std::size_t k = 0; k < rows.size(); ++k) {
    auto& r = rows[k];
    bool any = !shared || r.mapped || r.reserved;
    if (!any || r.name.empty()) {
      if (!shared) {  // a trace input among others: its live series under the file's name
        all.push_back(r.live);
        all.back().who = basename_of(r.trace);
        all.back().colour = colour_for(all.back().who, used_colours);
      }
      continue;
    }
    const char* col = row_colour[k];
    auto add = [&](series s) {
      s.who = labels[k];
      s.colour = col;
      all.push_back(std::move(s));
    };
    if (!shared) add(r.live);
    if (r.mapped) add(*r.mapped);
    if (r.reserved) add(*r.reserved);
  }
  if (shared && all.size() == 1 && rows.size() == 1 && rows[0].name.empty()) all[0].source = "computed from the trace";

  // Reserved bytes far above the rest would flatten every other line: listed, not drawn.
  double scale = 0;
  for (auto& s : all)
    if (s.k != kind::reserved) scale = std::max(scale, s.peak_y);
  for (auto& s : all)
    if (s.k == kind::reserved && scale > 0 && s.peak_y > 3 * scale) s.off_scale = true;

  // Title and subtitle from the inputs.
  std::vector<std::string> traces;
  for (auto& r : rows)
    if (!r.trace.empty() && std::find(traces.begin(), traces.end(), basename_of(r.trace)) == traces.end())
      traces.push_back(basename_of(r.trace));
  std::string tnames;
  for (auto& t : traces) tnames += (tnames.empty() ? "" : ", ") + t;
  std::string title = c.title;
  bool from_json = std::any_of(rows.begin(), rows.end(), [](auto& r) { return !r.name.empty(); });
  if (title.empty())
    title = (from_json ? "Memory over the trace" : "Live bytes over the trace") +
            (tnames.empty() ? std::string() : ": " + tnames);
  std::string subtitle = with_commas(events) + (events == 1 ? " event" : " events");
  if (from_json) {
    std::string who;
    for (std::size_t k = 0; k < rows.size(); ++k)
      if (!rows[k].name.empty()) who += (who.empty() ? "" : ", ") + labels[k];
    subtitle += "; replayed by vmm-replay: " + who;
  } else {
    subtitle += "; live = bytes requested and not yet freed, computed from the trace";
  }

  std::string svg = render(std::move(all), c, title, subtitle, events);
  std::ofstream f(c.out, std::ios::binary | std::ios::trunc);
  if (!f) die(c.out + ": cannot write: " + std::strerror(errno), 1);
  f << svg;
  f.close();
  if (!f) die(c.out + ": write failed", 1);
  std::fprintf(stderr, "vmm-plot: wrote %s\n", c.out.c_str());
  return 0;
}
