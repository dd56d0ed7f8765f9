// SPDX-License-Identifier: Apache-2.0
// vmm-replay: replays an allocation trace through several allocators in one run and prints, for
// each, ns per event and how much memory it held against what was live.
//
//   vmm-replay TRACE [--backend host|cuda] [--allocators LIST] [--json FILE] [--check-every N]
//                    [--warm] [--device N] [--samples N] [--bound] [--hot N]
//                    [--threads recorded|one] [--lag N]
//                    [--option NAME=VALUE ...] (--help: every option)
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
//    vmm-plot. The timed numbers never include this pass. vmmalloc also says what it held at its
//    first sample of peak mapped bytes ("at_peak_mapped"): free span memory, how much of it lies
//    in whole pages and the largest free block, i.e. what a request that set the peak could not
//    use without new memory.
//  * --bound (also with --samples): that untimed pass also counts, after every event, the 2 MiB
//    pages of the allocator's addresses that hold a live requested byte (touched.hpp); its peak
//    is the least any allocator mapping whole pages could hold with the same placement. Reported
//    beside that pass's own peak mapped: touched / live is placement waste, mapped / touched is
//    memory kept mapped beyond the touched pages (reclaim waste).
//  * --hot N: that untimed pass also lists the N events whose call made the most driver calls
//    (vmmalloc's stats before and after each event): which requests grow or move memory.
//  * Threads (v2 traces): one replay thread per recorded thread, event i only after event i-1 has
//    returned, each thread alive until the pass ends (replay_pass.hpp); --threads one replays on
//    one thread. The hand-offs are harness cost: the null allocator pays them too, so "net of
//    null" removes them.
//  * --lag N: each stream's work stays N events behind the CPU (host backend: held fences; CUDA:
//    gate kernels), for stream-ordered allocators; every pass (warm-up, timed, sampling) alike.
//  * --option NAME=VALUE (repeatable): one of vmmalloc's options (README.md's table), parsed by
//    vmm::set_option, for vmmalloc only; the table's detail and the JSON's "options" show them.
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
#include "replay_pass.hpp"
#include "timeline.hpp"
#include "tool_cli.hpp"
#include "touched.hpp"
#include "trace.hpp"

namespace {

using namespace vmm::replay;

struct cli {
  std::string trace_path;
  std::string backend = "host";
  std::string allocators;  // empty: default for the backend
  std::string json;
  std::uint64_t check_every = 0;
  bool warm = false;
  int device = 0;
  std::uint64_t samples = 0;  // 0: no timeline
  bool bound = false;         // the pages-touched bound (from the untimed pass, as --samples)
  std::uint64_t hot = 0;      // the events that made the most driver calls (untimed pass); 0: none
  std::string threads = "recorded";  // recorded: one replay thread per recorded thread; one
  std::uint64_t lag = 0;             // events the streams run behind the CPU; 0: none
  std::vector<std::string> option_texts;  // --option NAME=VALUE, as given
  vmm::options vopts;                     // vmmalloc's options after them
  std::vector<std::string> vopt_set;      // NAME=VALUE of each option set, as set_option read it
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
  app.add_flag("--bound", c.bound,
               "add the pages-touched bound: the peak of 2 MiB pages holding a live byte, beside the peak mapped "
               "of the same untimed pass (placement waste vs reclaim waste); also with --samples");
  app.add_option("--hot", c.hot,
                 "list the N events whose call made the most driver calls (vmmalloc; from the untimed pass, as "
                 "--bound): where growth and moves go")
      ->type_name("N");
  app.add_option("--threads", c.threads,
                 "recorded (default): one replay thread per thread of a v2 trace, each event after the previous one "
                 "has returned; one: every event on one thread")
      ->check(CLI::IsMember({"recorded", "one"}));
  app.add_option("--lag", c.lag,
                 "keep each stream's work N events behind the CPU (0: off, default): fences recorded on a stream "
                 "complete N events later (host backend: held streams; CUDA: gate kernels), for stream-ordered "
                 "allocators (vmmalloc, cudaMallocAsync)")
      ->type_name("N");
  app.add_option("--option", c.option_texts,
                 "one of vmmalloc's options (README.md's options table), e.g. release_threshold=0 or "
                 "free_memory_margin=1G; repeatable; vmmalloc only")
      ->type_name("NAME=VALUE")
      ->take_all()
      ->allow_extra_args(false);
  vmm::tools::parse_or_exit(app, argc, argv);
  for (const std::string& text : c.option_texts) {
    const auto eq = text.find('=');
    if (eq == std::string::npos || eq == 0)
      vmm::tools::usage_error(app, "--option '" + text + "': expected NAME=VALUE, e.g. release_threshold=0");
    const std::string name = text.substr(0, eq);
    if (name == "device") vmm::tools::usage_error(app, "--option device: use --device N");
    std::string why;
    if (!vmm::set_option(c.vopts, name, text.substr(eq + 1), &why).ok())
      vmm::tools::usage_error(app, "--option: " + why);
    // Read back as the table writes it: "512M" stays "512M", "max" names the maximum.
    c.vopt_set.push_back(name + "=" + vmm::option_value(c.vopts, *vmm::find_option(name)));
  }
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

std::string mib(std::optional<std::uint64_t> b) { return b ? vmm::replay::mib(double(*b)) : "n/a"; }

// ---- passes -----------------------------------------------------------------------------------

// The sampling pass (--samples): untimed, reads the peer's memory after every event, checks the
// allocator's own count of requested bytes against the trace at every event (exit 4 if they
// differ), and cuts the per-event values down to a timeline. Series the peer cannot observe at
// every event are left out (reported in `note`), never filled in. Same threads and lag as the
// timed pass (opts), so the timeline shows what that pass did.
// hot (--hot): the events whose call made driver calls, as (calls, event), most calls first, at
// most `keep` of them; left empty (nullopt) when the peer does not count its calls.
pass_result sample_pass(peer& a, const trace& t, const std::vector<void*>& streams, std::vector<void*>& ptr,
                        std::size_t max_samples, pass_opts o, timeline& out, touched_pages& touched,
                        std::string& note, std::size_t keep,
                        std::optional<std::vector<std::pair<std::uint64_t, std::size_t>>>& hot) {
  std::vector<std::uint64_t> mapped, reserved;
  bool has_mapped = true, has_reserved = true;
  std::optional<std::uint64_t> calls = keep ? a.current().driver_calls : std::nullopt;
  std::vector<std::pair<std::uint64_t, std::size_t>> made;
  o.check_every = 0;
  o.sample = false;
  o.after_event = [&](std::size_t i) -> std::string {
    const event& e = t.events[i];  // a free leaves its address in ptr[e.id]
    const auto at = reinterpret_cast<std::uintptr_t>(ptr[e.id]);
    if (e.kind == op::alloc) touched.add(at, e.size);
    else if (e.kind == op::free) touched.remove(at, e.size);
    memory_now m = a.current();
    if (m.requested && *m.requested != t.live_after[i])
      return "stats().requested = " + std::to_string(*m.requested) + " after event " + std::to_string(i) + " (" +
             event_text(t, i) + "), but the trace has " + std::to_string(t.live_after[i]) + " bytes live";
    auto drop = [&](bool& has, std::vector<std::uint64_t>& v, const char* what) {
      has = false;
      if (i > 0)
        note += std::string(what) + " not observable after event " + std::to_string(i) + " (" + peer::error() +
                "), left out; ";
      v = {};
    };
    if (has_mapped && !m.mapped) drop(has_mapped, mapped, "mapped");
    if (has_reserved && !m.reserved) drop(has_reserved, reserved, "reserved");
    if (has_mapped) mapped.push_back(*m.mapped);
    if (has_reserved) reserved.push_back(*m.reserved);
    if (calls) {
      if (!m.driver_calls) return "driver calls not observable after event " + std::to_string(i) + ": " + peer::error();
      if (*m.driver_calls > *calls) made.emplace_back(*m.driver_calls - *calls, i);
      calls = m.driver_calls;
    }
    return {};
  };
  auto t0 = clk::now();
  pass_result r = run_pass(a, t, streams, ptr, o);
  r.seconds = std::chrono::duration<double>(clk::now() - t0).count();  // the whole (untimed) pass
  if (!r.exit_code) out = make_timeline(t.live_after, mapped, reserved, max_samples);
  if (calls) {  // most calls first; among equals the earlier event
    std::sort(made.begin(), made.end(),
              [](auto& x, auto& y) { return x.first != y.first ? x.first > y.first : x.second < y.second; });
    if (made.size() > keep) made.resize(keep);
    hot = std::move(made);
  }
  return r;
}

// What the peer held when its mapped bytes peaked (vmmalloc: free span memory a larger request
// could not use as one block), one line on stderr.
void print_at_peak(const std::string& name, const std::vector<std::pair<std::string, double>>& kv) {
  auto get = [&](const char* key) {
    for (auto& [k, v] : kv)
      if (k == key) return v;
    return -1.0;
  };
  if (get("span_free_bytes") < 0) return;
  std::fprintf(stderr, "vmm-replay: %s: at the mapped peak the spans held %s free in %.0f blocks (%s in whole pages, "
               "the largest block %s)\n", name.c_str(), vmm::replay::mib(get("span_free_bytes")).c_str(),
               get("span_free_blocks"), vmm::replay::mib(get("span_free_whole_page_bytes")).c_str(),
               vmm::replay::mib(get("span_largest_free_bytes")).c_str());
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
  std::vector<std::pair<std::string, double>> at_peak;  // --samples: the peer at the mapped peak
  std::optional<std::uint64_t> touched_bytes;      // --bound / --samples: peak pages touched x page
  std::optional<std::uint64_t> pass_mapped_bytes;  // the same untimed pass's peak mapped
  std::optional<std::vector<std::pair<std::uint64_t, std::size_t>>> hot;  // --hot: (driver calls, event)
  double sample_seconds = 0;
  std::size_t threads = 1;
  std::uint64_t handoffs = 0;
  std::uint64_t lag = 0, lag_actions = 0, lag_timeouts = 0;  // lag = 0: none applied
  std::string lag_how;                                       // what the lag did, or why there was none
  std::vector<std::string> options;                          // vmmalloc: --option NAME=VALUE in effect
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
  ojson ap = nullptr;
  for (auto& [key, v] : r.at_peak) ap[key] = json_num(v);
  o["at_peak_mapped"] = ap;
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
    o["trace_version"] = t.version;
    o["threads"] = r.threads;
    o["handoffs"] = r.handoffs;
    o["lag_events"] = r.lag;
    o["lag"] = r.lag_how.empty() ? ojson(nullptr) : ojson(r.lag_how);
    o["lag_actions"] = r.lag_actions;
    o["lag_timeouts"] = r.lag_timeouts;
    o["options"] = r.options;
    for (auto& [key, v] : r.mem.extra) o[key] = json_num(v);
    if (r.touched_bytes) {
      o["peak_touched_bytes"] = *r.touched_bytes;
      o["untimed_peak_mapped_bytes"] = json_opt(r.pass_mapped_bytes);
      o["touched_over_live"] = t.peak_live_bytes ? ojson(double(*r.touched_bytes) / double(t.peak_live_bytes))
                                                 : ojson(nullptr);
      o["mapped_over_touched"] = r.pass_mapped_bytes && *r.touched_bytes
                                     ? ojson(double(*r.pass_mapped_bytes) / double(*r.touched_bytes))
                                     : ojson(nullptr);
    }
    if (c.hot) {  // null: the allocator does not count its driver calls
      ojson h = r.hot ? ojson::array() : ojson(nullptr);
      if (r.hot)
        for (auto& [n, i] : *r.hot) h.push_back({{"event", i}, {"line", t.lines[i]}, {"driver_calls", n}});
      o["hot_events"] = h;
    }
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
  if (std::any_of(rows.begin(), rows.end(), [](const row& r) { return r.touched_bytes.has_value(); })) {
    std::printf("Pages-touched bound (untimed pass: 2 MiB pages holding a live byte, at their peak):\n\n");
    std::printf("| allocator | peak live | pages touched | peak mapped (same pass) | touched/live | mapped/touched |\n");
    std::printf("|---|---:|---:|---:|---:|---:|\n");
    for (auto& r : rows) {
      if (!r.touched_bytes) continue;
      char tl[32] = "n/a", mt[32] = "n/a";
      if (t.peak_live_bytes) std::snprintf(tl, sizeof tl, "%.3f", double(*r.touched_bytes) / double(t.peak_live_bytes));
      if (r.pass_mapped_bytes && *r.touched_bytes)
        std::snprintf(mt, sizeof mt, "%.3f", double(*r.pass_mapped_bytes) / double(*r.touched_bytes));
      std::printf("| %s | %s | %s | %s | %s | %s |\n", r.name.c_str(), mib(double(t.peak_live_bytes)).c_str(),
                  mib(double(*r.touched_bytes)).c_str(), mib(r.pass_mapped_bytes).c_str(), tl, mt);
    }
    std::printf("\n");
  }
  for (auto& r : rows) {
    if (!r.hot || r.hot->empty()) continue;
    std::printf("%s: the events that made the most driver calls (untimed pass):\n\n", r.name.c_str());
    std::printf("| event | driver calls | live after it | line in the trace |\n|---:|---:|---:|---|\n");
    for (auto& [n, i] : *r.hot)
      std::printf("| %zu | %" PRIu64 " | %s | %s |\n", i, n, mib(double(t.live_after[i])).c_str(), event_text(t, i).c_str());
    std::printf("\n");
  }
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
  if (name == "vmmalloc")
    return c.backend == "cuda" ? make_vmmalloc_cuda(c.device, c.vopts)
                               : make_vmmalloc_host(std::size_t{256} << 30, c.vopts);
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

// The lag for one peer instance (its own host backend, or the CUDA streams), or none and why.
std::unique_ptr<gpu_lag> lag_for(peer& a, const std::vector<void*>& streams, const cli& c, std::string& how) {
  how.clear();
  if (!c.lag) return nullptr;
  if (!a.stream_ordered()) {
    how = a.is_device() ? "none: " + a.name() + " synchronizes the device on free, a held stream would stall it"
                        : "none: " + a.name() + " has no streams";
    return nullptr;
  }
  if (a.is_device()) {
    auto l = make_cuda_lag(streams, c.lag);  // throws without nvcc or on a CUDA error
    how = l->describe();
    return l;
  }
  if (vmm::host_backend* hb = a.host_backend()) {
    auto l = make_host_lag(*hb, streams, c.lag);
    how = l->describe();
    return l;
  }
  how = "none: " + a.name() + " exposes no stream control";
  return nullptr;
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
  const schedule sched = make_schedule(t, c.threads == "recorded");

  std::printf("trace: %s (v%d)\n", t.source.c_str(), t.version);
  std::printf("  %zu events (%" PRIu64 " allocations, %" PRIu64 " frees, %" PRIu64 " trims), %zu blocks live at "
              "the end, at most %" PRIu32 " live at once, %zu stream(s)\n",
              t.events.size(), t.allocs, t.frees, t.trims, t.live_at_end.size(), t.slots, t.stream_ids.size());
  std::printf("  peak live %s after event %zu (line %" PRIu32 "); sizes %" PRIu64 " B .. %s; parsed in %.2f s\n",
              mib(double(t.peak_live_bytes)).c_str(), t.peak_live_event, t.lines[t.peak_live_event], t.min_size,
              mib(double(t.max_size)).c_str(), parse_s);
  if (t.version >= 2)
    std::printf("  %zu recorded thread(s), %" PRIu64 " frees by another thread, %" PRIu64
                " frees on another stream, recorded over %.3f s\n",
                t.thread_ids.size(), t.cross_thread_frees, t.cross_stream_frees, double(t.time_ns.back()) / 1e9);
  std::printf("  vmmalloc backend: %s; %s; %s\n", c.backend.c_str(),
              c.warm ? "warm (one untimed pass first)" : "cold (no warm-up pass)",
              c.check_every ? ("check() every " + std::to_string(c.check_every) + " events").c_str() : "no checks");
  if (sched.threads > 1)
    std::printf("  replay: %zu threads, one per recorded thread, in the recorded order (%" PRIu64 " hand-offs)\n",
                sched.threads, sched.handoffs);
  else
    std::printf("  replay: one thread%s\n",
                t.thread_ids.size() > 1 ? " (--threads one: the recorded threads' events in their order)" : "");
  if (c.lag) std::printf("  lag: streams run %" PRIu64 " events behind the CPU (stream-ordered allocators)\n", c.lag);
  if (!c.vopt_set.empty()) {
    std::string all;
    for (const auto& o : c.vopt_set) all += " " + o;
    std::printf("  vmmalloc options:%s\n", all.c_str());
  }
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
    std::string lag_how;
    std::unique_ptr<gpu_lag> lag;
    try {
      lag = lag_for(*a, *streams, c, lag_how);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "vmm-replay: %s: --lag: %s\n", name.c_str(), e.what());
      rc = 1;
      break;
    }

    pass_opts o;
    o.check_every = a->has_check() ? c.check_every : 0;  // vmmalloc's invariants
    o.progress = tty && t.events.size() >= 100000;
    o.sample = a->wants_samples();
    o.label = name.c_str();
    o.sched = &sched;
    o.lag = lag.get();
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
    if (lag) lag->actions = 0;
    pass_result r = run_pass(*a, t, *streams, ptr, o);
    if (r.exit_code) {
      std::fprintf(stderr, "vmm-replay: %s: %s\n", name.c_str(), r.failure.c_str());
      rc = r.exit_code;
      break;
    }
    row w;
    w.name = name;
    w.detail = a->detail();
    if (name == "vmmalloc") {
      w.options = c.vopt_set;
      for (const auto& o : c.vopt_set) w.detail += (&o == &c.vopt_set.front() ? "; " : " ") + o;
    }
    w.backend = name == "vmmalloc" ? c.backend : (a->is_device() ? "cuda" : "host");
    w.events = t.events.size();
    w.seconds = r.seconds;
    w.ns_per_op = r.seconds * 1e9 / double(t.events.size());
    w.checks = r.checks;
    w.threads = sched.threads;
    w.handoffs = sched.handoffs;
    w.lag = lag ? c.lag : 0;
    w.lag_how = lag_how;
    w.lag_actions = lag ? lag->actions : 0;
    w.lag_timeouts = lag ? lag->timeouts() : 0;
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
    if (c.lag)
      std::fprintf(stderr, "vmm-replay: %s: lag: %s%s\n", name.c_str(), lag_how.c_str(),
                   lag ? (", " + std::to_string(w.lag_actions) + (a->is_device() ? " gates" : " ticks")).c_str() : "");
    if (w.lag_timeouts)
      std::fprintf(stderr,
                   "vmm-replay: %s: warning: %" PRIu64 " gate kernel(s) opened by their 2 s timeout, not by the "
                   "replay: something waited for a held stream\n",
                   name.c_str(), w.lag_timeouts);
    rows.push_back(std::move(w));
    lag.reset();
    (void)a->release_cached();  // the next allocator starts with the memory given back

    if (c.samples || c.bound || c.hot) {
      // A fresh instance, so the sampled pass starts as the timed one did (cold, or after the
      // same untimed warm-up); the timed instance goes first so the two never coexist.
      a.reset();
      std::unique_ptr<peer> b;
      std::unique_ptr<gpu_lag> blag;
      try {
        b = make_by_name(name, c);
        blag = lag_for(*b, *streams, c, lag_how);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "vmm-replay: %s: cannot create (sampling pass): %s\n", name.c_str(), e.what());
        rc = 1;
        break;
      }
      pass_opts so;
      so.progress = o.progress;
      so.sched = &sched;
      so.lag = blag.get();
      if (c.warm) {
        pass_opts w2 = so;
        w2.label = "warm-up (sampling)";
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
      std::string note;
      const std::string label = name + " (sampling)";
      so.label = label.c_str();
      touched_pages touched(std::uint64_t{2} << 20);
      pass_result sr = sample_pass(*b, t, *streams, ptr, c.samples ? c.samples : 1, so, tl, touched, note, c.hot,
                                   rows.back().hot);
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
      if (!note.empty()) std::fprintf(stderr, "vmm-replay: %s (sampling pass): %s\n", name.c_str(), note.c_str());
      rows.back().touched_bytes = touched.peak_pages() * touched.page();
      if (tl.peak_mapped) rows.back().pass_mapped_bytes = tl.peak_mapped->bytes;
      std::fprintf(stderr, "vmm-replay: %s: untimed pass (%.2f s): %s pages touched at their peak%s\n", name.c_str(),
                   sr.seconds, mib(double(*rows.back().touched_bytes)).c_str(),
                   tl.peak_mapped ? (", peak mapped " + mib(double(tl.peak_mapped->bytes)) + " at event " +
                                     std::to_string(tl.peak_mapped->event))
                                        .c_str()
                                  : "");
      if (c.samples) {
        rows.back().at_peak = b->at_peak_mapped();
        print_at_peak(name, rows.back().at_peak);
        rows.back().tl = std::move(tl);
      }
      rows.back().sample_seconds = sr.seconds;
      blag.reset();
      (void)b->release_cached();
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
