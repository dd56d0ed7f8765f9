#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Write what tools/gpu-check measured into bench/RESULTS.md.

    tools/results.py OUTDIR [OUTDIR...] [--results FILE] [--only ID,ID] [--dry-run]

OUTDIR is the folder one tools/gpu-check run wrote ($OUT, else ./gpu-check-out): summary.txt and
the logs beside it. For each step that ran there, the text between

    <!-- results:ID:begin -->   and   <!-- results:ID:end -->

in RESULTS.md is replaced by that run's table, under one line naming the card, the driver, the
commit, the date and the command that measures it again. Sections with no new data stay as they
are. With several folders a later one wins. A section missing from the file is added at its end.
The same folders give the same file: a second run changes nothing.

Sections and where their data comes from:
  tests        summary.txt (build, torch_ext, tests, failed_tests); ctest.log (skipped tests)
  sanitizer    summary.txt (memcheck, racecheck)
  race         summary.txt (race); ctest.log (what the failed runs reported)
  matrix       summary.txt (matrix, the growth/release matrix table)
  stress       summary.txt (stress); ctest.log (the stress test's messages)
  replay       summary.txt (replay table, torch replay rows)
  models       real_models.md, else summary.txt; a run with --rounds goes to models-rounds
  cap          summary.txt (under one memory cap)
  hf           kv_transformers.md, else summary.txt (transformers caches)
  serve        serve_transformers.md (continuous batching against transformers)
A --quick run of models or hf is a smoke test: it is written only when --only names its section.
  alloc_free, trace, growth, driver, random, kvcache
               extras.log: the output of each benchmark of the bench step (trace: the
               trace_overhead rows of bench_alloc_free), as each section's own tables (the
               peers side by side, per-mapping costs); Google Benchmark's rows as printed where
               VMM_GPU_CHECK_BENCHES or a filter left a section's benchmarks out

Python 3, standard library only.
"""

import argparse
import os
import re
import sys

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TITLES = {
    "models": "Real PyTorch processes", "models-rounds": "Real PyTorch processes, in rounds",
    "cap": "Under one memory cap", "hf": "transformers caches",
    "serve": "Continuous batching against transformers", "kvcache": "KV cache, decode workload",
    "replay": "Replay of the shared trace", "alloc_free": "Allocate + free pairs",
    "trace": "Trace recording overhead", "growth": "Growth", "driver": "Driver costs",
    "random": "Random allocations", "tests": "Tests", "sanitizer": "compute-sanitizer",
    "stress": "GPU stress", "race": "The race", "matrix": "Growth/release matrix",
}
BENCH_SECTION = {"bench_alloc_free": "alloc_free", "bench_growth": "growth", "bench_driver": "driver",
                 "bench_random": "random", "bench_kvcache": "kvcache"}
BLOCKS = {"growth/release matrix": "matrix", "replay table": "replay", "transformers caches": "hf",
          "real PyTorch processes": "models", "under one memory cap": "cap", "torch replay rows": "torch"}
TAIL = re.compile(r"^(time|result|logs) {2,}\S")
GBENCH = re.compile(r"^(\S+)\s+([\d.]+(?:e[-+]?\d+)?) (ns|us|ms|s)\s+([\d.]+(?:e[-+]?\d+)?) (ns|us|ms|s)"
                    r"\s+(\d+)\s*(.*)$")
GBENCH_BAD = re.compile(r"^(\S+)\s+(ERROR OCCURRED|SKIPPED): *'?(.*?)'?$")


def read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return None


def parse_summary(lines):
    """summary.txt -> (key -> value, block name -> lines)."""
    keys, blocks, block = {}, {}, None
    for line in lines[1:]:
        head = next((b for b in BLOCKS if line.startswith(b) and line.endswith(":")), None)
        if head:
            block = blocks.setdefault(BLOCKS[head], [])
        elif TAIL.match(line) or block is None:
            block = None
            m = re.match(r"^(\S+) +(.*)$", line)
            if m:
                keys[m.group(1)] = m.group(2)
        else:
            block.append(line)
    return keys, blocks


def ran(value):
    """A step's summary value, when the step ran (not left out, not missing its program)."""
    return bool(value) and not re.match(r"(not |none built|skipped)", value)


def cell(s):
    return s.replace("|", "\\|").strip()


def gpu_check(steps, **env):
    extra = "".join(" %s='%s'" % (k, v) for k, v in env.items() if v)
    return "`VMM_GPU_CHECK_STEPS=%s%s tools/gpu-check`" % (steps, extra)


def step_args(value, default):
    """'--full: ok (300 s; ...)' -> the arguments, and the env value when they are not the default."""
    args = value.split(":", 1)[0].strip()
    return args, (args if args != default else "")


def strip_heading(lines):
    lines = list(lines)
    while lines and (not lines[0].strip() or lines[0].startswith("#")):
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def log_block(lines, start, stop=r"^=== (?!\$ |limit )"):
    """The lines after the first line matching `start`, up to the next line matching `stop`
    (run_step's command and limit lines are skipped)."""
    out, on = [], False
    for line in lines or []:
        if on and re.match(stop, line):
            break
        if on and not line.startswith("=== "):
            out.append(line)
        elif re.match(start, line):
            on = True
    return out


def bench_blocks(extras):
    """extras.log -> [(benchmark name, command line, output lines)] for the bench step's runs."""
    out, cur = [], None
    for line in extras or []:
        m = re.match(r"^=== benchmark (\S+)( \(torch\))?$", line)
        if m:
            cur = [m.group(1), "", []]
            out.append(cur)
        elif cur is not None and line.startswith("=== $ "):
            argv = line[6:].split()
            cur[1] = " ".join([os.path.basename(argv[0])] + argv[1:]) if argv else ""
        elif cur is not None and re.match(r"^=== (exit|limit|not run)", line):
            if line.startswith("=== exit"):
                cur = None
        elif cur is not None and line.startswith("=== "):
            cur = None
        elif cur is not None:
            cur[2].append(line)
    return out


def gbench_rows(lines, keep):
    rows = []
    for line in lines:
        m = GBENCH.match(line)
        if m and keep(m.group(1)):
            rows.append("| %s | %s %s | %s %s | %s | %s |" % (cell(m.group(1)), m.group(2), m.group(3),
                                                           m.group(4), m.group(5), m.group(6), cell(m.group(7))))
            continue
        m = GBENCH_BAD.match(line)
        if m and keep(m.group(1)):
            rows.append("| %s | | | | %s: %s |" % (cell(m.group(1)), m.group(2), cell(m.group(3))))
    return rows


def gbench_table(runs, keep):
    """Google Benchmark's console lines of several runs -> one markdown table, and the commands."""
    rows, cmds = [], []
    for _, cmd, lines in runs:
        r = gbench_rows(lines, keep)
        if r:
            rows += r
            cmds.append(cmd)
    if not rows:
        return None, cmds
    return ["| benchmark | time | CPU | iterations | counters |", "|---|---:|---:|---:|---|"] + rows, cmds


UNIT_NS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}
SUFFIX = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def gbench_values(runs):
    """Google Benchmark's console lines -> name -> (real time in ns, {counter: value})."""
    vals = {}
    for _, _, lines in runs:
        for line in lines:
            m = GBENCH.match(line)
            if m:
                ctr = {k: float(v) * SUFFIX[x] for k, v, x in
                       re.findall(r"(\S+?)=([\d.]+(?:e[-+]?\d+)?)([kMGmun]?)(?:/s)?(?=\s|$)", m.group(7))}
                vals[m.group(1)] = (float(m.group(2)) * UNIT_NS[m.group(3)], ctr)
    return vals


def num(x):
    """Three significant figures, thousands separated."""
    if x >= 1000:
        return "{:,.0f}".format(x)
    return "%.0f" % x if x >= 100 else "%.1f" % x if x >= 10 else "%.2f" % x


def per_second(x):
    return "%.2f M/s" % (x / 1e6) if x >= 1e6 else "%.1f k/s" % (x / 1e3)


SIZES = [(256, "256 B"), (4096, "4 KiB"), (65536, "64 KiB"), (262144, "256 KiB"), (1048576, "1 MiB"),
         (16777216, "16 MiB")]


def alloc_free_body(v):
    """The pairs by size and threads against the peers, then the pairs beside a growing thread."""
    rows = []
    for size, label in SIZES:
        for key, peer in (("vmmalloc_cuda", "vmmalloc"), ("cudaMallocAsync", "cudaMallocAsync"),
                          ("torch", "PyTorch caching")):
            t = [v.get("alloc_free/%s/bytes:%d/real_time/threads:%d" % (key, size, n)) for n in (1, 2, 4, 8, 16)]
            if all(t):
                ns = [x[0] for x in t]
                rows.append("| %s | %s | %s | %.2gx |" % (label, peer, " | ".join(num(x) for x in ns), ns[0] / ns[3]))
    if not rows:
        return None
    out = ["PyTorch caching is its caching allocator through libtorch's `raw_alloc` / "
           "`raw_delete` (`bench_alloc_free` built with `-DVMM_WITH_TORCH=ON`).", "",
           "| size | allocator | 1 | 2 | 4 | 8 | 16 threads | 8 vs 1 |", "|---|---|---:|---:|---:|---:|---:|---:|"] + rows
    beside = [(n, v["beside_growth/vmmalloc_cuda/real_time/threads:%d" % n][0]) for n in (1, 2, 4, 8, 16)
              if "beside_growth/vmmalloc_cuda/real_time/threads:%d" % n in v]
    if beside:
        out += ["", "Pairs while another thread grows the heap (`beside_growth`): the benchmark's threads make "
                "pairs of 256 KiB .. 4 MiB in turn while one more thread grows by a 256 MiB chunk at a time "
                "(8 held, then freed and trimmed), its driver calls outside the allocator's lock.", "",
                "| pair threads | ns per pair |", "|---:|---:|"] + ["| %d | %s |" % (n, num(x)) for n, x in beside]
    return out


def growth_body(v):
    inplace = [("after a shrink that released the chunk", "growth_inplace/vmmalloc_cuda/real_time"),
               ("after a shrink that kept the handle", "growth_inplace_kept/vmmalloc_cuda/real_time"),
               ("with the handle in the allocator's idle pool", "growth_inplace_shared/vmmalloc_cuda/real_time"),
               ("the same growth as 512 chunks of 2 MiB", "growth_inplace_2mib_chunks/vmmalloc_cuda/real_time"),
               ("into fresh memory", "growth_inplace_fresh/vmmalloc_cuda/iterations:8/real_time"),
               ("64 MiB steps up to 8 GiB, per step", "growth_steps/vmmalloc_cuda/64MiB_to_8GiB/real_time")]
    rows = ["| %s (`%s`) | %s |" % (label, name.split("/")[0], num(v[name][0] / 1e3)) for label, name in inplace
            if name in v]
    copy = ["| %s | %.2f |" % (label, v["growth_copy/%s/real_time" % key][0] / 1e6)
            for key, label in (("vmmalloc_cuda", "vmmalloc"), ("cudaMalloc", "cudaMalloc"),
                               ("cudaMallocAsync", "cudaMallocAsync")) if "growth_copy/%s/real_time" % key in v]
    if not rows and not copy:
        return None
    out = []
    if rows:
        out += ["In place (`vmm::growable_buffer`, CUDA backend):", "", "| variant | µs, real time |", "|---|---:|"] + rows
    if copy:
        out += ([""] if out else []) + ["By copying, against the peers:", "",
                                        "| allocate 2 GiB, copy 1 GiB, free the old buffer (`growth_copy`) | ms |",
                                        "|---|---:|"] + copy
    return out


def driver_body(v):
    found = []
    for name, (_, c) in v.items():
        m = re.match(r"^(remap\w*/(\w+))/handles:(\d+)$", name)
        if m and {"map_us", "access_us", "unmap_us"} <= c.keys():
            found.append((m.group(2) != "cuda", m.group(1), int(m.group(3)), c))
    if not found:
        return None
    beside = lambda c: "%.2f" % c["beside_moves"] if "beside_moves" in c else "–"
    return ["| benchmark | N | map | set-access (one call) | unmap | second thread's mappings meanwhile, a mapping |",
            "|---|---:|---:|---:|---:|---:|"] + [
        "| %s | %d | %.2f | %.1f | %.1f | %s |" % (b, n, c["map_us"], c["access_us"], c["unmap_us"], beside(c))
        for _, b, n, c in sorted(found, key=lambda f: f[:3])]


def random_body(v):
    rows = []
    for n in (1000, 10000):
        for mx in (1, 64):
            key = lambda a: "random/%s/N:%d/max_MiB:%d/real_time" % (a, n, mx)
            if not all(key(a) in v for a in ("vmmalloc_cuda", "cudaMallocAsync", "cudaMalloc")):
                continue
            vm, asy, cm = (v[key(a)][1] for a in ("vmmalloc_cuda", "cudaMallocAsync", "cudaMalloc"))
            rows.append("| {:,} | {} MiB | {} | {:.3f} | {} | {:.3f} | {} |".format(
                n, mx, per_second(vm["items_per_second"]), vm["mapped/live"], per_second(asy["items_per_second"]),
                asy["mapped/live"], per_second(cm["items_per_second"])))
    if not rows:
        return None
    return ["| N | max | vmmalloc CUDA | mapped/live | cudaMallocAsync | mapped/live | cudaMalloc |",
            "|---:|---:|---:|---:|---:|---:|---:|"] + rows


CURATED = {"alloc_free": alloc_free_body, "growth": growth_body, "driver": driver_body, "random": random_body}


def md_tables(lines):
    """Markdown table lines -> [(header cells, [row cells])]."""
    out, head = [], None
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            head = None
        elif head is None:
            head = cells
            out.append((head, []))
        elif not set(line) <= set("|-: "):
            out[-1][1].append(dict(zip(head, cells)))
    return out


def replay_body(replay, torch):
    """vmm-replay's tables (and the torch rows) -> one row an allocator, then the pages-touched bound."""
    names = {"vmmalloc (cuda)": "vmmalloc (CUDA backend)", "cudaMalloc": "cudaMalloc",
             "cudaMallocAsync": "cudaMallocAsync"}
    rows, bound = [], None
    for head, recs in md_tables(replay):
        for r in recs:
            if "ns/event" in head and r["allocator"] in names:
                calls = r["driver calls"] if r["allocator"].startswith("vmmalloc") else "–"
                rows.append([names[r["allocator"]], float(r["ns/event"]), r["mapped/live"],
                             "{:,}".format(int(calls)) if calls.isdigit() else calls])
            elif "pages touched" in head and r["allocator"] == "vmmalloc":
                bound = r
    # gpu-check's torch rows come without a header: the timing table's columns, default then expandable.
    torch_rows = [c for c in ([x.strip() for x in l.strip().strip("|").split("|")] for l in torch)
                  if len(c) == 8 and c[0] == "torch" and "MiB" not in c[1]]
    for label, c in zip(("PyTorch caching allocator (libtorch)", "PyTorch expandable segments"),
                        torch_rows if len(torch_rows) == 2 else []):
        rows.append([label, float(c[1]), c[5], "–"])
    if not rows:
        return None
    out = ["`vmm-replay bench/traces/trace-dev-small.txt.gz`, each allocator on the GPU:", "",
           "| allocator | ns/event | peak mapped / peak live | driver calls |", "|---|---:|---:|---:|"]
    out += ["| %s | %s | %s | %s |" % (a, num(ns), ratio, calls) for a, ns, ratio, calls in rows]
    if bound:
        out += ["", "Pages touched (2 MiB pages of vmmalloc's addresses holding a live byte, at their peak): %s x "
                "peak live; vmmalloc's peak mapped is %s x that." % (bound["touched/live"], bound["mapped/touched"])]
    return out


def quick(args):
    """A smoke test (--quick), not a measurement: its section is left alone unless --only names it."""
    return "--quick" in args.split()


def sections_of(outdir, only=None):
    """One gpu-check output folder -> {section id: (command, body lines)}."""
    summary = read(os.path.join(outdir, "summary.txt"))
    if summary is None:
        sys.exit("results.py: %s has no summary.txt (not a tools/gpu-check output folder?)" % outdir)
    keys, blocks = parse_summary(summary)
    ctest = read(os.path.join(outdir, "ctest.log")) or []
    extras = read(os.path.join(outdir, "extras.log")) or []
    out = {}

    if ran(keys.get("tests")):
        regex = ""
        for line in ctest:
            m = re.match(r"^=== \$ ctest .* -L gpu -R (\S+)", line)
            if m:
                regex = m.group(1)
        rows = ["| step | result |", "|---|---|"]
        for k in ("build", "torch_ext", "tests", "failed_tests"):
            if keys.get(k):
                rows.append("| %s | %s |" % (k.replace("_", " "), cell(keys[k])))
        found = (re.search(r"Test +#\d+: (\S+) .*\*\*\*Skipped", l) for l in ctest)
        skipped = sorted({m.group(1) for m in found if m})
        if skipped:
            rows += ["", "Skipped: %s." % ", ".join("`%s`" % s for s in skipped)]
        out["tests"] = (gpu_check("tests", VMM_GPU_CHECK_CTEST_REGEX=regex), rows)

    if ran(keys.get("memcheck")):
        rows = ["| tool, program | result |", "|---|---|"]
        for tool in ("memcheck", "racecheck"):
            for part in re.split(r"; (?=\w+: )", keys.get(tool, "")):
                name, _, res = part.partition(": ")
                if res:
                    rows.append("| %s, %s | %s |" % (tool, cell(name), cell(res)))
        out["sanitizer"] = (gpu_check("memcheck"), rows)

    if ran(keys.get("race")):
        v = keys["race"]
        m = re.match(r"(\d+) of (\d+) runs passed, (\d+) failed, (\d+) aborted(?:; memcheck: (.*))?$", v)
        if m:
            rows = ["| runs | passed | failed | killed by a signal | under memcheck |",
                    "|---:|---:|---:|---:|---|",
                    "| %s | %s | %s | %s | %s |" % (m.group(2), m.group(1), m.group(3), m.group(4),
                                                    cell(m.group(5) or "not run"))]
        else:
            rows = [v]
        seen = {}
        for line in log_block(ctest, r"^=== race: \d+ passed"):
            e = re.search(r"(ERROR: .*|FATAL ERROR.*|double free.*|corruption.*|terminate called.*)", line)
            if e:
                seen[e.group(1).strip()] = seen.get(e.group(1).strip(), 0) + 1
        if seen:
            rows += ["", "What the failed runs reported:", ""]
            rows += ["- `%s` (%d %s)" % (k, n, "run" if n == 1 else "runs") for k, n in seen.items()]
        runs = m.group(2) if m else "50"
        out["race"] = (gpu_check("race", VMM_GPU_CHECK_RACE_RUNS=runs if runs != "50" else ""), rows)

    if ran(keys.get("matrix")):
        rows = ["Result: %s." % keys["matrix"].rstrip(".")]
        if blocks.get("matrix"):
            rows += [""] + [l for l in blocks["matrix"] if l.strip()]
        out["matrix"] = (gpu_check("matrix"), rows)

    if ran(keys.get("stress")):
        ops = keys["stress"].split(" ops", 1)[0]
        rows = ["Result: %s." % keys["stress"].rstrip(".")]
        msgs = [re.sub(r"^.*MESSAGE: ", "", l) for l in log_block(ctest, r"^=== GPU stress", r"^=== exit")
                if "MESSAGE:" in l]
        if msgs:
            rows += [""] + ["- %s" % m for m in msgs]
        out["stress"] = (gpu_check("stress", VMM_GPU_CHECK_STRESS_OPS=ops if ops != "1000000" else ""), rows)

    if ran(keys.get("replay")):
        body = replay_body(blocks.get("replay", []), blocks.get("torch", []))
        if body:
            out["replay"] = (gpu_check("replay"), body)

    if ran(keys.get("models")):
        args, env = step_args(keys["models"], "--full")
        md = read(os.path.join(outdir, "real_models.md")) or blocks.get("models")
        sid = "models-rounds" if re.search(r"--rounds [2-9]|--rounds \d\d", args) else "models"
        if md and (not quick(args) or sid in (only or ())):
            out[sid] = (gpu_check("models", VMM_GPU_CHECK_MODELS_ARGS=env), strip_heading(md))

    if ran(keys.get("cap")):
        args, env = step_args(keys["cap"], "--cap-gib 24")
        if blocks.get("cap"):
            head = ["`bench/under_cap.py %s`:" % args, ""]
            out["cap"] = (gpu_check("cap", VMM_GPU_CHECK_CAP_ARGS=env), head + blocks["cap"])

    if ran(keys.get("hf")):
        args, env = step_args(keys["hf"], "--full")
        md = read(os.path.join(outdir, "kv_transformers.md")) or blocks.get("hf")
        if md and (not quick(args) or "hf" in (only or ())):
            out["hf"] = (gpu_check("hf", VMM_GPU_CHECK_HF_ARGS=env), strip_heading(md))

    if ran(keys.get("serve")):
        md = read(os.path.join(outdir, "serve_transformers.md"))
        if md:
            out["serve"] = (gpu_check("serve"), strip_heading(md))

    def runs_of(cmds):
        return "%s, which runs %s" % (gpu_check("bench"), ", ".join("`%s`" % c for c in cmds))

    if ran(keys.get("bench")):
        runs = bench_blocks(extras)
        for name, sid in BENCH_SECTION.items():
            mine = [r for r in runs if r[0] == name]
            if name == "bench_kvcache":  # its own markdown report, after progress lines on stderr
                out_lines = next((r[2] for r in reversed(mine) if any(l.startswith("|") for l in r[2])), None)
                if out_lines:
                    first = next(i for i, l in enumerate(out_lines) if l.startswith(("Device:", "|")))
                    lines = strip_heading(out_lines[first:])
                    out[sid] = (runs_of([mine[-1][1]]), lines)
                continue
            table, cmds = gbench_table(mine, lambda b: not b.startswith("trace_overhead/"))
            curated = CURATED[sid](gbench_values(mine)) if table else None
            if table:  # the section's own tables; Google Benchmark's rows where its benchmarks were filtered out
                out[sid] = (runs_of(cmds), curated or table)
            if name == "bench_alloc_free":
                table, cmds = gbench_table(mine, lambda b: b.startswith("trace_overhead/"))
                if table:
                    out["trace"] = (runs_of(cmds), table)
    return keys, out


def provenance(keys, command):
    commit = re.sub(r" \(\.deps/COMMIT\)$", "", keys.get("commit", "unknown"))
    return "%s · driver %s · commit %s · %s · %s" % (keys.get("card", "unknown"), keys.get("driver", "unknown"),
                                                      commit, keys.get("date", "unknown")[:10], command)


def replace(text, sid, body):
    begin, end = "<!-- results:%s:begin -->" % sid, "<!-- results:%s:end -->" % sid
    new = "%s\n%s\n%s" % (begin, "\n".join(body).rstrip("\n"), end)
    m = re.search(re.escape(begin) + r".*?" + re.escape(end), text, re.S)
    if m:
        return text[:m.start()] + new + text[m.end():]
    return text.rstrip("\n") + "\n\n## %s\n%s\n" % (TITLES.get(sid, sid), new)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdirs", nargs="+", metavar="OUTDIR", help="a folder one tools/gpu-check run wrote")
    ap.add_argument("--results", default=os.path.join(REPO, "bench", "RESULTS.md"), help="the file to rewrite")
    ap.add_argument("--only", help="comma list of section ids to write (default: all with new data)")
    ap.add_argument("--dry-run", action="store_true", help="say what would change, write nothing")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None

    found = {}
    for d in a.outdirs:
        keys, secs = sections_of(d, only)
        for sid, (command, lines) in secs.items():
            if only is None or sid in only:
                found[sid] = ([provenance(keys, command), ""] + list(lines), d)

    with open(a.results, encoding="utf-8") as f:
        text = f.read()
    new = text
    for sid, (body, d) in found.items():
        after = replace(new, sid, body)
        print("%-13s %s (from %s)" % (sid, "changed" if after != new else "unchanged", d))
        new = after
    if not found:
        print("results.py: no step with data in %s" % ", ".join(a.outdirs))
    if new != text and not a.dry_run:
        with open(a.results, "w", encoding="utf-8") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
