// vmm-replay: replays an allocation trace through several allocators in one run and prints, for
// each, ns per event and how much memory it held against what was live.
//
//   vmm-replay TRACE [--backend host|cuda] [--allocators LIST] [--json FILE] [--check-every N]
//                    [--warm] [--device N] [--samples N]      (--help: every option)
//
// Method (same for every allocator):
//  * The whole trace is parsed first (ADDR names -> dense slot ids), so the timed loop is vector
//    indexing plus one virtual call per event. The `null` allocator runs the same loop with fake
//    addresses: its ns/event is the harness's own cost, and the table shows each allocator net of it.
//  * Timed: wall clock from the first event to the last (plus a final synchronize for CUDA peers),
//    events = allocations + frees of the trace. Pauses for --check-every, memory sampling and
//    progress are timed separately and subtracted.
//  * Cold by default: each allocator starts empty, like vmmalloc and cudaMalloc always do.
//    --warm replays once untimed first (then frees the remainder and resets peaks), for every
//    allocator alike: cudaMallocAsync's pool and vmmalloc's chunks are then already grown.
//  * Blocks the trace never frees are freed after the timed region; then vmmalloc must report
//    check() == "" and stats().requested == 0.
//  * --samples N: after the timed pass, a fresh instance of the allocator replays the trace again,
//    untimed, reading its memory after every event (peer::current()); at most N samples of live,
//    mapped and reserved bytes plus each peak go into the JSON ("timeline", see timeline.hpp) for
//    vmm-plot. The timed numbers never include this pass.
//  * Progress: one overwritten line on stderr (percent, events/s, ETA), only when stderr is a tty.
// Exit codes: 0 ok, 1 setup (no driver / device, bad option value), 2 bad usage or malformed
// trace (with its line number), 3 an allocation or free failed, 4 check() or accounting failed.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "peers.hpp"
#include "timeline.hpp"
#include "tool_cli.hpp"
#include "trace.hpp"

namespace {

using namespace vmm::replay;
using clk = std::chrono::steady_clock;

struct cli {
  std::string trace_path;
  std::string backend = "host";
  std::string allocators;  // empty: default for the backend
  std::string json;
  std::uint64_t check_every = 0;
  bool warm = false;
  int device = 0;
  std::uint64_t samples = 0;  // 0: no timeline
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ','))
    if (!x.empty()) v.push_back(x);
  return v;
}

const char* const known_allocators[] = {"vmmalloc", "null", "malloc", "cudaMalloc", "cudaMallocAsync", "torch"};

cli parse_cli(int argc, char** argv) {
  cli c;
  CLI::App app{"Replays an allocation trace through several allocators in one run; prints, for each, ns per "
               "event and the memory it held against what was live.",
               "vmm-replay"};
  app.add_option("TRACE", c.trace_path, "trace file, plain text or .gz (format: docs/trace-format.md)");
  app.add_option("--backend", c.backend, "vmmalloc's backend: host (memfd, default) or cuda (the GPU)")
      ->check(CLI::IsMember({"host", "cuda"}));
  std::string peers = std::string("comma list of: vmmalloc, null, malloc") +
                      (have_cuda_peers() ? ", cudaMalloc, cudaMallocAsync" : "") + (have_torch_peer() ? ", torch" : "") +
                      " (default: vmmalloc,null; with --backend cuda also cudaMalloc,cudaMallocAsync)";
  app.add_option("--allocators", c.allocators, peers)->type_name("LIST");
  app.add_option("--json", c.json, "write the results as a JSON list")->type_name("FILE");
  app.add_option("--check-every", c.check_every, "run vmmalloc's check() every N events (time excluded)")
      ->type_name("N");
  app.add_flag("--warm", c.warm, "replay once untimed before the timed pass (every allocator)");
  app.add_option("--device", c.device, "CUDA device (default 0)")->type_name("N")->check(CLI::NonNegativeNumber);
  app.add_option("--samples", c.samples,
                 "add a timeline of live/mapped/reserved bytes (at most N samples + the peaks) per allocator to "
                 "the JSON, for vmm-plot; from a separate untimed pass")
      ->type_name("N");
  vmm::tools::parse_or_exit(app, argc, argv);
  if (c.trace_path.empty()) vmm::tools::usage_error(app, "no trace given");
  if (app.count("--samples") && c.samples == 0) vmm::tools::usage_error(app, "--samples needs N >= 1");
  if (c.samples && c.json.empty()) vmm::tools::usage_error(app, "--samples writes into the JSON: give --json FILE too");
  if (c.allocators.empty())
    c.allocators = c.backend == "cuda" ? "vmmalloc,cudaMalloc,cudaMallocAsync,null" : "vmmalloc,null";
  for (const auto& n : split_list(c.allocators))
    if (std::find(std::begin(known_allocators), std::end(known_allocators), n) == std::end(known_allocators))
      vmm::tools::usage_error(app, "unknown allocator '" + n + "' in --allocators");
  if (split_list(c.allocators).empty()) vmm::tools::usage_error(app, "--allocators is empty");
  return c;
}

std::string mib(double b) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1 << 20));
  return buf;
}
std::string mib(std::optional<std::uint64_t> b) { return b ? mib(double(*b)) : "n/a"; }

std::string event_text(const trace& t, std::size_t i) {
  const event& e = t.events[i];
  char buf[160];
  std::snprintf(buf, sizeof buf, "line %" PRIu32 ": %c %" PRIx64 " %" PRIu64 " %" PRIu64, t.lines[i],
                e.kind == op::alloc ? 'a' : 'f', t.names[i], e.size, t.stream_ids[e.stream]);
  return buf;
}

// ---- progress ---------------------------------------------------------------------------------

// One overwritten stderr line: percent, events/s (wall clock, pauses included), ETA. Only on a
// terminal. Redrawn at most 5 times a second; the caller decides how often to offer an update.
class progress_line {
 public:
  progress_line(bool on, std::string label, std::size_t total)
      : on_(on), label_(std::move(label)), total_(total), start_(clk::now()), last_(start_) {}
  ~progress_line() { clear(); }
  void update(std::size_t done) {
    if (!on_) return;
    auto now = clk::now();
    if (done < total_ && now - last_ < std::chrono::milliseconds(200)) return;
    last_ = now;
    double el = std::chrono::duration<double>(now - start_).count();
    double rate = el > 0 ? double(done) / el : 0;
    char eta[32] = "?";
    if (rate > 0) {
      auto left = static_cast<unsigned long>(double(total_ - done) / rate + 0.5);
      std::snprintf(eta, sizeof eta, "%lu:%02lu", left / 60, left % 60);
    }
    std::fprintf(stderr, "\r  %s: %5.1f%% (%zu / %zu events), %.2f M events/s, ETA %s\033[K", label_.c_str(),
                 100.0 * double(done) / double(total_ ? total_ : 1), done, total_, rate / 1e6, eta);
    drawn_ = true;
  }
  void clear() {
    if (drawn_) std::fprintf(stderr, "\r\033[K");
    drawn_ = false;
  }

 private:
  bool on_;
  std::string label_;
  std::size_t total_;
  clk::time_point start_, last_;
  bool drawn_ = false;
};

// ---- one pass ---------------------------------------------------------------------------------

struct pass_opts {
  std::uint64_t check_every = 0;
  bool progress = false;
  bool sample = false;
  std::uint64_t sample_every = 16384;  // ~80 samples for 1.3 M events; each is a few us, untimed
  const char* label = "";
};

struct pass_result {
  int exit_code = 0;  // 0 ok, 3 alloc/free failure, 4 check failure
  std::string failure;
  double seconds = 0, paused = 0;
  std::uint64_t checks = 0;
  std::string note;  // sampling pass: a series that stopped being observable, and why
};

pass_result run_pass(peer& a, const trace& t, const std::vector<void*>& streams, std::vector<void*>& ptr,
                     const pass_opts& o) {
  constexpr std::uint64_t progress_every = 1 << 17;
  const std::size_t n = t.events.size();
  progress_line bar(o.progress, o.label, n);
  const event* ev = t.events.data();
  void** slot = ptr.data();
  void* const* str = streams.data();
  const std::size_t peak_stop = t.peak_live_event + 1;
  pass_result r;

  auto next_multiple = [](std::size_t i, std::uint64_t k) { return (i / k + 1) * k; };
  auto next_stop = [&](std::size_t i) {
    std::size_t s = n;
    if (o.check_every) s = std::min<std::size_t>(s, next_multiple(i, o.check_every));
    if (o.sample) s = std::min<std::size_t>(s, next_multiple(i, o.sample_every));
    if (o.sample && peak_stop > i) s = std::min(s, peak_stop);
    if (o.progress) s = std::min<std::size_t>(s, next_multiple(i, progress_every));
    return s;
  };

  auto t0 = clk::now();
  std::size_t i = 0;
  while (i < n) {
    const std::size_t stop = next_stop(i);
    // The timed loop: vector indexing and one virtual call per event.
    for (; i < stop; ++i) {
      const event& e = ev[i];
      if (e.kind == op::alloc) {
        void* p = a.allocate(e.size, str[e.stream]);
        if (!p) [[unlikely]] {
          r.exit_code = 3;
          r.failure = "allocation failed at event " + std::to_string(i) + " (" + event_text(t, i) +
                      "; live before it: " + mib(double(i ? t.live_after[i - 1] : 0)) + "): " + peer::error();
          break;
        }
        slot[e.id] = p;
      } else if (!a.deallocate(slot[e.id], e.size, str[e.stream])) [[unlikely]] {
        r.exit_code = 3;
        r.failure = "free failed at event " + std::to_string(i) + " (" + event_text(t, i) + "): " + peer::error();
        break;
      }
    }
    if (r.exit_code) break;
    // A stop: sample / check / progress, all outside the measured time.
    auto p0 = clk::now();
    if (o.sample && (i % o.sample_every == 0 || i == peak_stop || i == n)) a.sample();
    if (o.check_every && i % o.check_every == 0) {
      ++r.checks;
      std::string c = a.check();
      if (!c.empty()) {
        r.exit_code = 4;
        r.failure = "check() failed after event " + std::to_string(i - 1) + " (" + event_text(t, i - 1) + "): " + c;
        break;
      }
      if (auto live = a.live_requested(); live && *live != t.live_after[i - 1]) {
        r.exit_code = 4;
        r.failure = "stats().requested = " + std::to_string(*live) + " after event " + std::to_string(i - 1) +
                    " (" + event_text(t, i - 1) + "), but the trace has " + std::to_string(t.live_after[i - 1]) +
                    " bytes live";
        break;
      }
    }
    if (o.progress && (i % progress_every == 0 || i == n)) bar.update(i);
    r.paused += std::chrono::duration<double>(clk::now() - p0).count();
  }
  if (!r.exit_code && !a.synchronize()) {
    r.exit_code = 3;
    r.failure = "synchronize after the replay failed: " + peer::error();
  }
  r.seconds = std::chrono::duration<double>(clk::now() - t0).count() - r.paused;
  bar.clear();
  return r;
}

// The sampling pass (--samples): untimed, reads the peer's memory after every event, checks the
// allocator's own count of requested bytes against the trace at every event (exit 4 if they
// differ), and cuts the per-event values down to a timeline. Series the peer cannot observe at
// every event are left out (reported on stderr), never filled in.
pass_result sample_pass(peer& a, const trace& t, const std::vector<void*>& streams, std::vector<void*>& ptr,
                        std::size_t max_samples, bool progress, const std::string& label, timeline& out) {
  const std::size_t n = t.events.size();
  pass_result r;
  progress_line bar(progress, label, n);
  std::vector<std::uint64_t> mapped, reserved;
  bool has_mapped = true, has_reserved = true;
  auto t0 = clk::now();
  for (std::size_t i = 0; i < n; ++i) {
    const event& e = t.events[i];
    if (e.kind == op::alloc) {
      void* p = a.allocate(e.size, streams[e.stream]);
      if (!p) {
        r.exit_code = 3;
        r.failure = "allocation failed at event " + std::to_string(i) + " (" + event_text(t, i) + "): " + peer::error();
        return r;
      }
      ptr[e.id] = p;
    } else if (!a.deallocate(ptr[e.id], e.size, streams[e.stream])) {
      r.exit_code = 3;
      r.failure = "free failed at event " + std::to_string(i) + " (" + event_text(t, i) + "): " + peer::error();
      return r;
    }
    memory_now m = a.current();
    if (m.requested && *m.requested != t.live_after[i]) {
      r.exit_code = 4;
      r.failure = "stats().requested = " + std::to_string(*m.requested) + " after event " + std::to_string(i) +
                  " (" + event_text(t, i) + "), but the trace has " + std::to_string(t.live_after[i]) + " bytes live";
      return r;
    }
    auto drop = [&](bool& has, std::vector<std::uint64_t>& v, const char* what) {
      has = false;
      if (i > 0) r.note += std::string(what) + " not observable after event " + std::to_string(i) + " (" + peer::error() + "), left out; ";
      v = {};
    };
    if (has_mapped && !m.mapped) drop(has_mapped, mapped, "mapped");
    if (has_reserved && !m.reserved) drop(has_reserved, reserved, "reserved");
    if (has_mapped) mapped.push_back(*m.mapped);
    if (has_reserved) reserved.push_back(*m.reserved);
    if (progress && (i & 0xffff) == 0) bar.update(i);
  }
  if (!a.synchronize()) {
    r.exit_code = 3;
    r.failure = "synchronize after the sampling pass failed: " + peer::error();
    return r;
  }
  bar.update(n);
  bar.clear();
  r.seconds = std::chrono::duration<double>(clk::now() - t0).count();
  out = make_timeline(t.live_after, mapped, reserved, max_samples);
  return r;
}

// Frees what the trace left live (untimed).
bool free_remaining(peer& a, const trace& t, const std::vector<void*>& streams, std::vector<void*>& ptr,
                    std::string& why) {
  for (const auto& b : t.live_at_end) {
    if (!a.deallocate(ptr[b.id], b.size, streams[b.stream])) {
      why = "freeing a block the trace left live (" + std::to_string(b.size) + " bytes) failed: " + peer::error();
      return false;
    }
  }
  if (!a.synchronize()) {
    why = "synchronize failed: " + peer::error();
    return false;
  }
  return true;
}

// ---- results ----------------------------------------------------------------------------------

struct row {
  std::string name, detail, backend;
  double ns_per_op = 0, seconds = 0;
  std::uint64_t events = 0, checks = 0;
  memory_report mem;
  std::optional<timeline> tl;  // --samples
  double sample_seconds = 0;
};

// JSON through nlohmann: ordered_json keeps the keys in the order documented in README.md.
using ojson = nlohmann::ordered_json;

// Counts stay integers in the JSON (extras are doubles in memory_report).
ojson json_num(double v) {
  if (v >= 0 && v < 1.8e19 && v == double(std::uint64_t(v))) return std::uint64_t(v);
  return v;
}
ojson json_opt(std::optional<std::uint64_t> v) { return v ? ojson(*v) : ojson(nullptr); }

// "timeline": {...}: the shape vmm-plot reads (documented in README.md).
ojson timeline_json(const timeline& tl, const row& r, const cli& c) {
  auto arr = [](const auto& v) { return v.empty() ? ojson(nullptr) : ojson(v); };
  auto peak = [](const std::optional<series_peak>& p) {
    return p ? ojson{{"event", p->event}, {"bytes", p->bytes}} : ojson(nullptr);
  };
  ojson o;
  o["events"] = tl.events;
  o["max_samples"] = c.samples;
  o["samples"] = tl.event.size();
  o["pass_seconds"] = r.sample_seconds;
  o["method"] =
      "separate untimed pass on a fresh instance after the timed one; each sample is the maximum over the events "
      "since the previous sample; each series' first peak event is a sample";
  o["mapped_source"] = tl.mapped.empty() ? ojson(nullptr) : ojson(r.mem.mapped_source);
  o["reserved_source"] = tl.reserved.empty()
                             ? ojson(nullptr)
                             : ojson(r.name == "vmmalloc" ? "stats().reserved (VA reserved at open)" : "peer");
  o["peaks"] = {{"live", peak(tl.peak_live)}, {"mapped", peak(tl.peak_mapped)}, {"reserved", peak(tl.peak_reserved)}};
  o["event"] = arr(tl.event);
  o["live"] = arr(tl.live);
  o["mapped"] = arr(tl.mapped);
  o["reserved"] = arr(tl.reserved);
  return o;
}

// A list with one allocator per line (diffable; the timeline makes a line long).
bool write_json(const std::string& path, const std::vector<row>& rows, const trace& t, const cli& c) {
  std::ofstream f(path);
  if (!f) return false;
  f << "[\n";
  for (std::size_t k = 0; k < rows.size(); ++k) {
    const row& r = rows[k];
    ojson o;
    o["name"] = r.name;
    o["ns_per_op"] = r.ns_per_op;
    o["peak_live_bytes"] = t.peak_live_bytes;
    o["peak_mapped_bytes"] = json_opt(r.mem.peak_mapped);
    o["peak_reserved_bytes"] = json_opt(r.mem.peak_reserved);
    o["driver_calls"] = json_opt(r.mem.driver_calls);
    o["mapped_over_live"] = r.mem.peak_mapped && t.peak_live_bytes
                                ? ojson(double(*r.mem.peak_mapped) / double(t.peak_live_bytes))
                                : ojson(nullptr);
    o["peak_mapped_source"] = r.mem.mapped_source;
    o["backend"] = r.backend;
    o["detail"] = r.detail;
    o["events"] = r.events;
    o["seconds"] = r.seconds;
    o["warm"] = c.warm;
    o["checks"] = r.checks;
    o["trace"] = t.source;
    for (auto& [key, v] : r.mem.extra) o[key] = json_num(v);
    if (r.tl) o["timeline"] = timeline_json(*r.tl, r, c);
    // Paths and driver messages are not guaranteed UTF-8: replace invalid bytes rather than throw.
    f << "  " << o.dump(-1, ' ', false, ojson::error_handler_t::replace) << (k + 1 < rows.size() ? "," : "") << "\n";
  }
  f << "]\n";
  return bool(f);
}

void print_table(const std::vector<row>& rows, const trace& t) {
  const row* null_row = nullptr;
  for (auto& r : rows)
    if (r.name == "null") null_row = &r;
  std::printf("\n| allocator | ns/event | net of null | peak live | peak mapped | mapped/live | peak reserved (VA) | driver calls |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (auto& r : rows) {
    char net[32] = "-", ratio[32] = "n/a", calls[32] = "n/a";
    if (null_row && &r != null_row) std::snprintf(net, sizeof net, "%.1f", r.ns_per_op - null_row->ns_per_op);
    if (r.mem.peak_mapped && t.peak_live_bytes)
      std::snprintf(ratio, sizeof ratio, "%.3f", double(*r.mem.peak_mapped) / double(t.peak_live_bytes));
    if (r.mem.driver_calls) std::snprintf(calls, sizeof calls, "%" PRIu64, *r.mem.driver_calls);
    std::string name = r.name + (r.name == "vmmalloc" ? " (" + r.backend + ")" : std::string());
    std::printf("| %s | %.1f | %s | %s | %s | %s | %s | %s |\n", name.c_str(), r.ns_per_op, net,
                mib(double(t.peak_live_bytes)).c_str(), mib(r.mem.peak_mapped).c_str(), ratio,
                mib(r.mem.peak_reserved).c_str(), calls);
  }
  std::printf("\n");
  for (auto& r : rows) {
    if (r.mem.peak_mapped && t.peak_live_bytes)
      std::printf("%s: peak mapped / peak live = %.3f  [peak mapped: %s]\n", r.name.c_str(),
                  double(*r.mem.peak_mapped) / double(t.peak_live_bytes), r.mem.mapped_source.c_str());
    else if (r.name != "null")
      std::printf("%s: peak mapped not observable here\n", r.name.c_str());
  }
}

// ---- factories by name ------------------------------------------------------------------------

std::unique_ptr<peer> make_by_name(const std::string& name, const cli& c) {
  if (name == "vmmalloc") return c.backend == "cuda" ? make_vmmalloc_cuda(c.device) : make_vmmalloc_host();
  if (name == "null") return make_null();
  if (name == "malloc") return make_malloc();
  if (name == "cudaMalloc" || name == "cudaMallocAsync" || name == "torch") {
    std::string why;
    if (!cuda_device_present(&why, c.device)) throw std::runtime_error("no usable CUDA device: " + why);
    if (name == "cudaMalloc") return make_cuda_malloc(c.device);
    if (name == "cudaMallocAsync") return make_cuda_malloc_async(c.device);
    return make_torch(c.device);
  }
  throw std::runtime_error("unknown allocator '" + name + "'");  // parse_cli checked the names
}

}  // namespace

int main(int argc, char** argv) {
  cli c = parse_cli(argc, argv);
  auto names = split_list(c.allocators);

  // The host backend holds one memfd per chunk: allow as many descriptors as the hard limit does.
  if (rlimit rl{}; getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }

  trace t;
  auto p0 = clk::now();
  try {
    t = parse_file(c.trace_path);
  } catch (const parse_error& e) {
    std::fprintf(stderr, "vmm-replay: %s\n", e.what());
    return 2;
  }
  double parse_s = std::chrono::duration<double>(clk::now() - p0).count();
  if (t.events.empty()) {
    std::fprintf(stderr, "vmm-replay: %s: no events\n", c.trace_path.c_str());
    return 2;
  }

  std::printf("trace: %s\n", t.source.c_str());
  std::printf("  %zu events (%" PRIu64 " allocations, %" PRIu64 " frees), %zu blocks live at the end, "
              "at most %" PRIu32 " live at once, %zu stream(s)\n",
              t.events.size(), t.allocs, t.frees, t.live_at_end.size(), t.slots, t.stream_ids.size());
  std::printf("  peak live %s after event %zu (line %" PRIu32 "); sizes %" PRIu64 " B .. %s; parsed in %.2f s\n",
              mib(double(t.peak_live_bytes)).c_str(), t.peak_live_event, t.lines[t.peak_live_event], t.min_size,
              mib(double(t.max_size)).c_str(), parse_s);
  std::printf("  vmmalloc backend: %s; %s; %s\n", c.backend.c_str(),
              c.warm ? "warm (one untimed pass first)" : "cold (no warm-up pass)",
              c.check_every ? ("check() every " + std::to_string(c.check_every) + " events").c_str() : "no checks");
  if (c.samples)
    std::printf("  timeline: at most %" PRIu64 " samples + peaks per allocator, from a separate untimed pass\n",
                c.samples);
  std::fflush(stdout);

  // Stream index -> handle. Stream id 0 is the default stream (nullptr) everywhere; others are
  // distinct tags on the host and real CUDA streams (created once) for device peers.
  std::vector<void*> host_streams(t.stream_ids.size(), nullptr), cuda_streams;
  for (std::size_t k = 0; k < t.stream_ids.size(); ++k)
    if (t.stream_ids[k] != 0) host_streams[k] = reinterpret_cast<void*>(std::uintptr_t{0x1000} + k);

  const bool tty = isatty(STDERR_FILENO);
  std::vector<row> rows;
  std::vector<void*> ptr(t.slots, nullptr);
  int rc = 0;
  for (const auto& name : names) {
    std::unique_ptr<peer> a;
    try {
      a = make_by_name(name, c);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "vmm-replay: %s: cannot create: %s\n", name.c_str(), e.what());
      rc = 1;
      break;
    }
    const std::vector<void*>* streams = &host_streams;
    if (a->is_device() && std::any_of(t.stream_ids.begin(), t.stream_ids.end(), [](auto s) { return s != 0; })) {
      try {
        if (cuda_streams.empty()) {
          auto made = make_cuda_streams(t.stream_ids.size());
          for (std::size_t k = 0; k < made.size(); ++k)
            if (t.stream_ids[k] == 0) std::swap(made[k], made[0]);
          cuda_streams = made;
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "vmm-replay: %s: %s\n", name.c_str(), e.what());
        rc = 1;
        break;
      }
      streams = &cuda_streams;
    }

    pass_opts o;
    o.check_every = a->has_check() ? c.check_every : 0;  // vmmalloc's invariants
    o.progress = tty && t.events.size() >= 100000;
    o.sample = a->wants_samples();
    o.label = name.c_str();
    std::string why;
    if (c.warm) {
      pass_opts w = o;
      w.label = "warm-up";
      pass_result wr = run_pass(*a, t, *streams, ptr, w);
      if (wr.exit_code) {
        std::fprintf(stderr, "vmm-replay: %s (warm-up pass): %s\n", name.c_str(), wr.failure.c_str());
        rc = wr.exit_code;
        break;
      }
      if (!free_remaining(*a, t, *streams, ptr, why)) {
        std::fprintf(stderr, "vmm-replay: %s (warm-up pass): %s\n", name.c_str(), why.c_str());
        rc = 3;
        break;
      }
    }
    a->reset_peaks();
    pass_result r = run_pass(*a, t, *streams, ptr, o);
    if (r.exit_code) {
      std::fprintf(stderr, "vmm-replay: %s: %s\n", name.c_str(), r.failure.c_str());
      rc = r.exit_code;
      break;
    }
    row w;
    w.name = name;
    w.detail = a->detail();
    w.backend = name == "vmmalloc" ? c.backend : (a->is_device() ? "cuda" : "host");
    w.events = t.events.size();
    w.seconds = r.seconds;
    w.ns_per_op = r.seconds * 1e9 / double(t.events.size());
    w.checks = r.checks;
    w.mem = a->report();  // peaks of the timed pass, before the untimed end-of-trace frees
    if (!free_remaining(*a, t, *streams, ptr, why)) {
      std::fprintf(stderr, "vmm-replay: %s: %s\n", name.c_str(), why.c_str());
      rc = 3;
      break;
    }
    if (std::string chk = a->check(); !chk.empty()) {
      std::fprintf(stderr, "vmm-replay: %s: check() after freeing everything: %s\n", name.c_str(), chk.c_str());
      rc = 4;
      break;
    }
    if (auto live = a->live_requested(); live && *live != 0) {
      std::fprintf(stderr, "vmm-replay: %s: stats().requested = %" PRIu64 " after freeing everything (want 0)\n",
                   name.c_str(), *live);
      rc = 4;
      break;
    }
    std::fprintf(stderr, "vmm-replay: %s (%s): %.1f ns/event, %.2f s%s\n", name.c_str(), w.detail.c_str(),
                 w.ns_per_op, w.seconds,
                 r.checks ? (", " + std::to_string(r.checks) + " checks passed").c_str() : "");
    rows.push_back(std::move(w));
    a->release_cached();  // the next allocator starts with the memory given back

    if (c.samples) {
      // A fresh instance, so the sampled pass starts as the timed one did (cold, or after the
      // same untimed warm-up); the timed instance goes first so the two never coexist.
      a.reset();
      std::unique_ptr<peer> b;
      try {
        b = make_by_name(name, c);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "vmm-replay: %s: cannot create (sampling pass): %s\n", name.c_str(), e.what());
        rc = 1;
        break;
      }
      if (c.warm) {
        pass_opts w2;
        w2.label = "warm-up (sampling)";
        w2.progress = o.progress;
        pass_result wr = run_pass(*b, t, *streams, ptr, w2);
        if (wr.exit_code || !free_remaining(*b, t, *streams, ptr, why)) {
          std::fprintf(stderr, "vmm-replay: %s (warm-up before sampling): %s\n", name.c_str(),
                       wr.exit_code ? wr.failure.c_str() : why.c_str());
          rc = wr.exit_code ? wr.exit_code : 3;
          break;
        }
      }
      b->reset_peaks();
      timeline tl;
      pass_result sr = sample_pass(*b, t, *streams, ptr, c.samples, o.progress, name + " (sampling)", tl);
      if (sr.exit_code) {
        std::fprintf(stderr, "vmm-replay: %s (sampling pass): %s\n", name.c_str(), sr.failure.c_str());
        rc = sr.exit_code;
        break;
      }
      if (!free_remaining(*b, t, *streams, ptr, why)) {
        std::fprintf(stderr, "vmm-replay: %s (sampling pass): %s\n", name.c_str(), why.c_str());
        rc = 3;
        break;
      }
      if (!sr.note.empty()) std::fprintf(stderr, "vmm-replay: %s (sampling pass): %s\n", name.c_str(), sr.note.c_str());
      std::fprintf(stderr, "vmm-replay: %s: timeline of %zu samples (untimed pass, %.2f s)%s\n", name.c_str(),
                   tl.event.size(), sr.seconds,
                   tl.peak_mapped ? (", peak mapped " + mib(double(tl.peak_mapped->bytes)) + " at event " +
                                     std::to_string(tl.peak_mapped->event))
                                        .c_str()
                                  : "");
      rows.back().tl = std::move(tl);
      rows.back().sample_seconds = sr.seconds;
      b->release_cached();
    }
  }
  destroy_cuda_streams(cuda_streams);

  if (!rows.empty()) print_table(rows, t);
  if (!c.json.empty() && !rows.empty()) {
    if (!write_json(c.json, rows, t, c)) {
      std::fprintf(stderr, "vmm-replay: cannot write %s\n", c.json.c_str());
      if (!rc) rc = 1;
    }
  }
  return rc;
}
