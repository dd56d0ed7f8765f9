#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""bench/real_models.py without torch or a GPU: the comparison of outputs, the report's tables,
the workloads' sizes, and the driver end to end over stand-in workers (REAL_MODELS_FAKE): runs
that fail, hang or differ are reported and the suite keeps going."""

import argparse
import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.normpath(os.path.join(HERE, "..", "..", "bench", "real_models.py"))
spec = importlib.util.spec_from_file_location("real_models", SCRIPT)
rm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rm)


def run_entry(model, allocator, losses, gens=None, **kw):
    r = {"model": model, "allocator": allocator, "status": "ok", "losses": losses, "generate": gens or [],
         "held_peak": 3 << 30, "alloc_peak": 2 << 30, "wall_s": 12.0, "median_step_s": 0.05, "train_s": 1.0}
    r.update(kw)
    return r


def tables(md):
    """Each markdown table as a list of rows of cells (header first, separator dropped)."""
    out, cur = [], None
    for line in md.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cur is None:
                cur = []
                out.append(cur)
            if not all(set(c) <= set("-:") and c for c in cells):
                cur.append(cells)
        else:
            cur = None
    return out


class Pure(unittest.TestCase):
    def test_parse_env(self):
        self.assertEqual(rm.parse_env(["VMMALLOC_RELEASE_THRESHOLD=0", "A=b=c"]),
                         {"VMMALLOC_RELEASE_THRESHOLD": "0", "A": "b=c"})
        for bad in ("NOEQUALS", "=1", "BAD KEY=1"):
            with self.assertRaises(ValueError) as e:
                rm.parse_env([bad])
            self.assertIn(repr(bad), str(e.exception))

    def test_parse_cpus(self):
        self.assertEqual(rm.parse_cpus("0-3,8"), [0, 1, 2, 3, 8])
        self.assertEqual(rm.parse_cpus("2, 1,2"), [1, 2])
        for bad in ("", "a", "3-1", "-1", "0-", "1,,2"):
            with self.assertRaises(ValueError, msg=bad) as e:
                rm.parse_cpus(bad)
            self.assertIn("--cpus %r" % bad, str(e.exception))

    def test_pick(self):
        self.assertEqual(rm.pick("vmmalloc, caching,vmmalloc", rm.ALLOCATORS, "allocators"), ["vmmalloc", "caching"])
        with self.assertRaises(ValueError) as e:
            rm.pick("caching,cudaMalloc", rm.ALLOCATORS, "allocators")
        self.assertIn("unknown cudaMalloc", str(e.exception))
        with self.assertRaises(ValueError):
            rm.pick(",", rm.ALLOCATORS, "allocators")

    def test_compare_exact_within_and_beyond_tolerance(self):
        runs = [run_entry("llama", "caching", [10.0, 9.0, 8.0]),
                run_entry("llama", "expandable", [10.0, 9.0, 8.0]),
                run_entry("llama", "async", [10.0, 9.0 * (1 + 5e-4), 8.0]),
                run_entry("llama", "vmmalloc", [10.0, 9.0, 8.1])]
        c = {x["allocator"]: x for x in rm.compare_runs(runs, 1e-3)}
        self.assertEqual(set(c), {"expandable", "async", "vmmalloc"})
        self.assertTrue(all(x["reference"] == "caching" for x in c.values()))
        self.assertTrue(c["expandable"]["losses_exact"])
        self.assertEqual(c["expandable"]["mismatches"], [])
        self.assertFalse(c["async"]["losses_exact"])
        self.assertEqual(c["async"]["mismatches"], [])
        self.assertAlmostEqual(c["async"]["losses_max_rel"], 5e-4, places=9)
        self.assertEqual(len(c["vmmalloc"]["mismatches"]), 1)
        self.assertIn("loss of step 2", c["vmmalloc"]["mismatches"][0])
        self.assertIsNone(c["vmmalloc"]["tokens_equal"])  # no generate calls

    def test_compare_tokens_nan_and_lengths(self):
        gen = [{"shape": [2, 4, 3], "tokens": [[1, 2, 3], [4, 5, 6]]}]
        flipped = [{"shape": [2, 4, 3], "tokens": [[1, 2, 3], [4, 9, 6]]}]
        runs = [run_entry("moe", "expandable", [1.0, 2.0], gen),  # no caching run: the first passed one is the reference
                run_entry("moe", "async", [1.0, 2.0], flipped),
                run_entry("moe", "vmmalloc", [1.0, float("nan")], gen),
                run_entry("moe", "caching", [1.0], gen, status="error")]
        c = {x["allocator"]: x for x in rm.compare_runs(runs, 1e-3)}
        self.assertEqual(set(c), {"async", "vmmalloc"})  # the failed run is not compared
        self.assertEqual(c["async"]["reference"], "expandable")
        self.assertFalse(c["async"]["tokens_equal"])
        self.assertEqual(c["async"]["first_token_difference"],
                         {"row": 1, "position": 1, "differing": 1, "total": 6, "call": 0})
        self.assertIn("first at row 1 position 1", c["async"]["mismatches"][0])
        self.assertTrue(c["vmmalloc"]["tokens_equal"])
        self.assertIn("NaN", c["vmmalloc"]["mismatches"][0])
        short = rm.compare_runs([run_entry("x", "caching", [1.0, 2.0]), run_entry("x", "async", [1.0])], 1e-3)
        self.assertIn("1 losses, the reference has 2", short[0]["mismatches"][0])

    def test_first_token_difference_ragged(self):
        self.assertIsNone(rm.first_token_difference([[1, 2]], [[1, 2]]))
        d = rm.first_token_difference([[1, 2]], [[1, 2], [3]])
        self.assertEqual((d["row"], d["position"], d["differing"]), (1, 0, 1))

    def test_judge(self):
        runs = [run_entry("llama", "caching", [1.0]),
                run_entry("llama", "vmmalloc", [1.0], vmm_check="free list broken",
                          vmm_stats_end={"malloc_failures": 2, "free_failures": 0}),
                {"model": "llama", "allocator": "async", "status": "timeout", "error": "killed after 9 s"},
                {"model": "llama", "allocator": "expandable", "status": "skipped", "reason": "time budget"}]
        bad = run_entry("bert", "async", [float(i) + 0.5 for i in range(6)])
        runs += [run_entry("bert", "caching", [float(i) + 1 for i in range(6)]), bad]
        failures, notes = rm.judge(runs, rm.compare_runs(runs, 1e-3))
        text = "\n".join(failures)
        self.assertIn("llama / vmmalloc: vmmalloc check(): free list broken", text)
        self.assertIn("malloc_failures = 2", text)
        self.assertIn("llama / async timeout: killed after 9 s", text)
        self.assertIn("... and 3 more differences", text)  # six differing losses: three shown
        self.assertEqual(sum("bert / async vs caching" in f for f in failures), 4)
        self.assertIn("llama / expandable skipped: time budget", notes)
        none_ok = rm.judge([{"model": "x", "allocator": "caching", "status": "skipped", "reason": "r"}], [])[0]
        self.assertEqual(none_ok, ["no run completed"])

    def test_markdown_tables_are_rectangular(self):
        runs = [run_entry("llama", "caching", [1.0], phase_peaks={"train": {"held": 1 << 30}}, peak_at="train 3 (8x2048)"),
                run_entry("llama", "vmmalloc", [1.5], vmm_at_peak={"at": "train 4 (4x2048)", "peak_physical": 5 << 30,
                                                                 "requested": 4 << 30, "deferred": 0, "live": 12},
                          vmm_stats_end={"driver_calls": 40, "creates": 10, "maps": 12, "unmaps": 2, "set_access_calls": 12,
                                         "releases": 4, "driver_ns": 2500000, "record_fences": 3, "fence_queries": 9,
                                         "fence_waits": 1, "fence_ns": 120000, "chunks_retired": 2},
                          train_s=1.25, generate_s=0.5, median_step_driver_s=0.0031),
                {"model": "llama", "allocator": "async", "status": "error", "error": "RuntimeError: a | b\nsecond", "wall_s": 3.0},
                {"model": "llama", "allocator": "expandable", "status": "skipped", "reason": "time budget"}]
        comps = rm.compare_runs(runs, 1e-3)
        result = {"meta": {"models": ["llama"], "mode": "full", "vmm_env": {"VMMALLOC_RELEASE_THRESHOLD": "0"}},
                  "runs": runs, "comparisons": comps, "failures": ["x"], "notes": [], "seconds": 5, "passed": False}
        md = rm.markdown(result)
        ts = tables(md)
        self.assertEqual(len(ts), 4)  # main, phases, vmmalloc at its peak, vmmalloc's driver time
        for t in ts:
            self.assertTrue(all(len(row) == len(t[0]) for row in t), t)
        main = {row[1]: row for row in ts[0][1:]}
        self.assertEqual(main["PyTorch caching"][11], "reference")
        self.assertEqual(main["PyTorch caching"][6], "train 3 (8x2048)")
        self.assertEqual(main["vmmalloc"][11], "**MISMATCH** (1)")
        self.assertEqual(main["vmmalloc"][5], "1.000")  # held vs caching: the same held bytes
        self.assertTrue(main["cudaMallocAsync"][2].startswith("error: RuntimeError: a / b second"))
        self.assertEqual(main["expandable segments"][2], "skipped: time budget")
        self.assertEqual(ts[2][1][:3], ["llama", "train 4 (4x2048)", "5.00"])
        self.assertEqual(ts[3][1], ["llama", "40", "10", "12", "2", "12", "4", "2.5", "3 / 9 / 1", "0.1", "2", "1.75",
                                    "3.10", "-"])
        self.assertIn("VMMALLOC_RELEASE_THRESHOLD=0", md)
        self.assertIn("FAILED", md)

    def test_generate_cell_shows_the_last_pass_and_the_first(self):
        gens = [{"shape": [1, 2, 3], "tokens": [[1, 2, 3]]}]
        self.assertEqual(rm.generate_cell({"generate": gens, "generate_s": 0.5}), "0.50")
        self.assertEqual(rm.generate_cell({"generate": gens, "generate_s": 0.5, "generate_first_s": 0.75,
                                           "generate_passes_s": [0.75, 0.5]}), "0.50 (0.75)")
        self.assertEqual(rm.generate_cell({"generate": [], "generate_s": 0.5}), "-")

    def test_rounds_table_gives_medians_and_per_round_ratios(self):
        gens = [{"shape": [1, 2, 3], "tokens": [[1, 2, 3]]}]
        runs = []
        for rnd, (e_step, v_step, e_gen, v_gen) in enumerate([(0.100, 0.090, 2.0, 2.2), (0.100, 0.110, 2.0, 1.8),
                                                              (0.200, 0.210, 4.0, 4.0)], start=1):
            runs.append(run_entry("moe", "expandable", [1.0], gens, round=rnd, median_step_s=e_step, generate_s=e_gen,
                                  held_peak=(10 + rnd) << 30))
            runs.append(run_entry("moe", "vmmalloc", [1.0], gens, round=rnd, median_step_s=v_step, generate_s=v_gen,
                                  held_peak=12 << 30))
        rows = [ln.split(" | ") for ln in rm.rounds_table(runs) if ln.startswith("| moe")]
        self.assertEqual(len(rows), 2)
        e, v = rows
        self.assertEqual(e[2:4], ["3", "11.00-13.00"])
        self.assertEqual(e[4], "100.0")  # median of 100, 100, 200 ms
        self.assertEqual(e[5], "-")  # the reference has no ratio to itself
        self.assertEqual(v[4], "110.0")
        self.assertEqual(v[5], "0.900 / 1.100 / 1.050 (median 1.050)")
        self.assertEqual(v[7].rstrip(" |"), "1.100 / 0.900 / 1.000 (median 1.000)")
        self.assertEqual(rm.rounds_table(runs[:2]), [])  # one round: no table
        self.assertEqual(rm.run_label(runs[3], rm.LABEL), "vmmalloc #2")
        self.assertEqual(rm.run_label(runs[1], rm.LABEL), "vmmalloc")

    def test_profile_summary_and_table(self):
        class Ev:  # what torch.profiler's key_averages() holds, either name of the device time
            def __init__(self, key, dev_us, cpu_us, count, old=False):
                self.key, self.self_cpu_time_total, self.count = key, cpu_us, count
                setattr(self, "self_cuda_time_total" if old else "self_device_time_total", dev_us)
        ev = [Ev("gemm", 5000, 100, 4), Ev("aten::nonzero", 300, 2500, 16, old=True), Ev("aten::mm", 0, 900, 4)]
        p = rm.profile_summary(ev, top=2)
        self.assertAlmostEqual(p["gpu_self_ms"], 5.3)
        self.assertAlmostEqual(p["cpu_self_ms"], 3.5)
        self.assertEqual([k for k, _, _ in p["top_gpu"]], ["gemm", "aten::nonzero"])
        self.assertEqual([k for k, _, _ in p["top_cpu"]], ["aten::nonzero", "aten::mm"])
        run = run_entry("moe", "vmmalloc", [1.0], round=2, profile=dict(p, step=3, shape=[2, 2048], seconds=0.25))
        rows = [ln for ln in rm.profile_table([run]) if ln.startswith("| moe")]
        self.assertEqual(rows, ["| moe | vmmalloc #2 | train 3 (2x2048) | 250.0 | 5.3 | 3.5 | gemm 5.0; aten::nonzero 0.3 "
                                "| aten::nonzero 2.5; aten::mm 0.9 |"])
        self.assertEqual(rm.profile_table([run_entry("moe", "vmmalloc", [1.0])]), [])

    def test_alloc_probe_and_table(self):
        made = []

        class FakeTorch:  # torch.empty records the sizes asked for
            uint8 = "u8"

            class cuda:
                synchronize = staticmethod(lambda: None)

            @staticmethod
            def empty(n, dtype=None, device=None):
                made.append(n)
                return object()
        res = {"notes": []}
        rm.alloc_probe(FakeTorch, res, "cuda:0", pairs=100, repeats=2)
        self.assertEqual(res["notes"], [])
        p = res["alloc_probe_ns"]
        self.assertEqual(sorted(p), sorted([str(n) for n in rm.PROBE_SIZES] + ["churn"]))
        self.assertTrue(all(v > 0 for v in p.values()), p)
        for n in rm.PROBE_SIZES:  # warm-up + 2 timed rounds of each size
            self.assertEqual(made.count(n), 10 + 2 * 100)
        churn = [n for n in made if n not in rm.PROBE_SIZES]
        self.assertTrue(churn and min(churn) >= 256 and max(churn) <= 32 << 20, (min(churn), max(churn)))

        class Broken(FakeTorch):
            @staticmethod
            def empty(n, dtype=None, device=None):
                raise RuntimeError("CUDA out of memory\nmore")
        res = {"notes": []}
        rm.alloc_probe(Broken, res, "cuda:0", pairs=10, repeats=1)
        self.assertNotIn("alloc_probe_ns", res)
        self.assertEqual(res["notes"], ["--alloc-probe: RuntimeError: CUDA out of memory"])

        run = run_entry("moe", "vmmalloc", [1.0], round=2, median_step_allocations=20560,
                        alloc_probe_ns={"512": 1500.4, "65536": 1510, "1048576": 1600, "16777216": 1700, "churn": 2100})
        run["launch_probe_ns"] = {"start": 3950.4, "end": 4210.6}
        run["launch_alloc_probe_ns"] = {"start": 5100, "end": 5350}
        t = tables("\n".join(rm.probe_table([run, run_entry("moe", "caching", [1.0])])))
        self.assertEqual(t[0][0][2:7], ["512 B", "64 KiB", "1 MiB", "16 MiB", "churn (mixed sizes)"])
        self.assertEqual(t[0][1:], [["moe", "vmmalloc #2", "1500", "1510", "1600", "1700", "2100", "20,560",
                                     "3950", "4211", "5100", "5350"]])
        self.assertEqual(rm.probe_table([run_entry("moe", "vmmalloc", [1.0])]), [])

    def test_launch_probe(self):
        made = []

        class T:
            def add_(self, v):
                made.append("inplace")

            def __add__(self, v):
                made.append("new")
                return T()

        class FakeTorch:
            class cuda:
                synchronize = staticmethod(lambda: None)

            @staticmethod
            def zeros(n, device=None):
                return T()
        res = {"notes": []}
        rm.launch_probe(FakeTorch, res, "cuda:0", "start", launches=100, repeats=3)
        rm.launch_probe(FakeTorch, res, "cuda:0", "end", launches=100, repeats=3)
        self.assertEqual(res["notes"], [])
        for key in ("launch_probe_ns", "launch_alloc_probe_ns"):
            self.assertEqual(sorted(res[key]), ["end", "start"])
            runs = res[key.replace("_ns", "_runs_ns")]
            self.assertEqual([len(runs[w]) for w in ("start", "end")], [3, 3])
            self.assertEqual([res[key][w] for w in ("start", "end")], [min(runs["start"]), min(runs["end"])])
            self.assertTrue(all(v > 0 for v in res[key].values()))
        # warm-up + the timed repeats, of each kind, twice
        self.assertEqual((made.count("inplace"), made.count("new")), (2 * (10 + 300), 2 * (10 + 300)))

        class Broken(FakeTorch):
            @staticmethod
            def zeros(n, device=None):
                raise RuntimeError("CUDA error: launch failure")
        res = {"notes": []}
        rm.launch_probe(Broken, res, "cuda:0", "end")
        self.assertNotIn("launch_probe_ns", res)
        self.assertEqual(res["notes"], ["--alloc-probe launches: RuntimeError: CUDA error: launch failure"])

    def test_process_usage_counts_this_process(self):
        u0 = rm.process_usage()
        t0 = time.process_time()
        while time.process_time() - t0 < 0.05:
            pass
        d = rm.usage_delta(u0, rm.process_usage())
        self.assertEqual(sorted(d), ["involuntary", "minor_faults", "sys_s", "user_s", "voluntary"])
        self.assertGreater(d["user_s"] + d["sys_s"], 0.03)
        run = run_entry("t5", "vmmalloc", [1.0], generate_passes_s=[20.5, 18.25],
                        generate_passes_usage=[{"user_s": 19.0, "sys_s": 1.5, "voluntary": 1200, "involuntary": 35,
                                                "minor_faults": 4000},
                                               {"user_s": 17.0, "sys_s": 1.0, "voluntary": 1100, "involuntary": 20,
                                                "minor_faults": 10}])
        t = tables("\n".join(rm.usage_table([run, run_entry("t5", "expandable", [1.0])])))
        self.assertEqual(t[0][1:], [["t5", "vmmalloc", "1", "20.50", "19.00", "1.50", "1,200", "35", "4,000"],
                                    ["t5", "vmmalloc", "2", "18.25", "17.00", "1.00", "1,100", "20", "10"]])
        self.assertEqual(rm.usage_table([run_entry("t5", "vmmalloc", [1.0])]), [])

    def test_workloads(self):
        for name, m in rm.MODELS.items():
            for mode in ("quick", "full"):
                w = m[mode]
                self.assertTrue(w["train"], (name, mode))
                for shape in w["train"]:  # t5: batch, source, target; else batch, sequence or image side
                    self.assertEqual(len(shape), 3 if m["family"] == "t5" else 2, (name, mode))
                    self.assertTrue(all(isinstance(x, int) and x > 0 for x in shape))
                cfg = w["config"]
                for b, p, n in w["generate"]:
                    if m["family"] != "t5":  # relative positions: no table to outgrow
                        self.assertLessEqual(p + n, cfg["max_position_embeddings"], (name, mode))
                if m["family"] in ("llama", "mixtral", "bert", "gpt2"):
                    for b, s in w["train"]:
                        self.assertLessEqual(s, cfg["max_position_embeddings"], (name, mode))
                        self.assertLessEqual(b * s, 32768, (name, mode))  # logits and activations stay bounded
        # The llama of --full: weights + gradients + AdamW's two moments (16 B a parameter) alone
        # reach 5 GiB, so its peak does whatever the activations add.
        c = rm.MODELS["llama"]["full"]["config"]
        h, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
        kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
        params = layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + 2 * v * h + h
        self.assertGreater(16 * params, 5 << 30)
        self.assertTrue(len({s for s in rm.MODELS["llama"]["full"]["train"]}) >= 10)  # shapes vary
        self.assertTrue(len({b for b, _, _ in rm.MODELS["llama"]["full"]["generate"]}) >= 4)
        self.assertTrue(len({b for b, _ in rm.MODELS["bert"]["full"]["train"]}) >= 10)
        # The suite's processes vary what real jobs vary: batch and shapes, generate() batches.
        self.assertTrue(len({b for b, _, _ in rm.MODELS["gpt2"]["full"]["generate"]}) >= 4)
        self.assertTrue(len({(s, t) for _, s, t in rm.MODELS["t5"]["full"]["train"]}) >= 8)
        self.assertTrue(len({side for _, side in rm.MODELS["cnn"]["full"]["train"]}) >= 8)
        self.assertTrue(rm.MODELS["cnn"]["channels_last"] and rm.MODELS["cnn"]["cudnn_benchmark"])

    def test_child_env(self):
        a = argparse.Namespace(vmm_env={"VMMALLOC_RELEASE_THRESHOLD": "0"}, nondeterministic=False)
        old = dict(os.environ)
        try:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
            os.environ["PYTORCH_ALLOC_CONF"] = "garbage_collection_threshold:0.5"
            os.environ["VMMALLOC_TRACE"] = "/tmp/inherited"
            caching = rm.child_env("caching", a)
            self.assertNotIn("PYTORCH_CUDA_ALLOC_CONF", caching)
            self.assertNotIn("PYTORCH_ALLOC_CONF", caching)
            self.assertNotIn("VMMALLOC_RELEASE_THRESHOLD", caching)
            self.assertNotIn("VMMALLOC_TRACE", caching)
            self.assertEqual(rm.child_env("async", a)["PYTORCH_CUDA_ALLOC_CONF"], "backend:cudaMallocAsync")
            self.assertEqual(rm.child_env("expandable", a)["PYTORCH_CUDA_ALLOC_CONF"], "expandable_segments:True")
            v = rm.child_env("vmmalloc", a, "/tmp/t.trace")
            self.assertNotIn("PYTORCH_CUDA_ALLOC_CONF", v)
            self.assertEqual(v["VMMALLOC_RELEASE_THRESHOLD"], "0")
            self.assertEqual(v["VMMALLOC_TRACE"], "/tmp/t.trace")
            self.assertEqual(v["CUBLAS_WORKSPACE_CONFIG"], ":4096:8")
        finally:
            os.environ.clear()
            os.environ.update(old)


class Driver(unittest.TestCase):
    def run_suite(self, fake, *args, expect_rc):
        out = tempfile.mkdtemp(prefix="rm-test-")
        self.addCleanup(shutil.rmtree, out, True)
        env = dict(os.environ, REAL_MODELS_FAKE=json.dumps(fake))
        p = subprocess.run([sys.executable, SCRIPT, "--quick", "--out", out] + list(args), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        self.assertEqual(p.returncode, expect_rc, p.stdout[-3000:])
        res = None
        if os.path.exists(os.path.join(out, "real_models.json")):
            with open(os.path.join(out, "real_models.json")) as f:
                res = json.load(f)
        return p.stdout, res, out

    def test_all_pass(self):
        text, res, out = self.run_suite({}, "--env", "VMMALLOC_RELEASE_THRESHOLD=0", "--generate-passes", "2",
                                        expect_rc=0)
        self.assertTrue(res["passed"])
        self.assertEqual(len(res["runs"]), 12)
        self.assertEqual({r["status"] for r in res["runs"]}, {"ok"})
        self.assertTrue(os.path.exists(os.path.join(out, "real_models.md")))
        for r in res["runs"]:  # --env reaches the vmmalloc runs, and only them
            self.assertEqual(r.get("vmm_env", {}).get("VMMALLOC_RELEASE_THRESHOLD"),
                             "0" if r["allocator"] == "vmmalloc" else None)
        self.assertIn("real_models: passed", text)
        self.assertRegex(text, r"llama +vmmalloc +ok in [0-9.]+ s")  # each run's time is printed
        llama = next(r for r in res["runs"] if r["model"] == "llama" and r["allocator"] == "vmmalloc")
        self.assertEqual(len(llama["generate_passes_s"]), 2)  # --generate-passes reaches the workers
        with open(os.path.join(out, "real_models.md")) as f:
            md = f.read()
        self.assertIn("| 0.02 (0.04) |", md)  # the last pass, the first in brackets
        usage = [r for t in tables(md) for r in t if r[:2] == ["llama", "vmmalloc"] and len(r) == 9]
        self.assertEqual([r[2:4] for r in usage], [["1", "0.04"], ["2", "0.02"]])  # each pass's resources

    def test_failures_hangs_and_mismatches_are_reported_and_the_rest_runs(self):
        fake = {"fail": ["bert/expandable"], "hang": ["moe/async"], "loss": {"llama/async": 1.0},
                "flip": ["moe/vmmalloc"]}
        text, res, _ = self.run_suite(fake, "--run-timeout", "4", expect_rc=1)
        st = {(r["model"], r["allocator"]): r["status"] for r in res["runs"]}
        self.assertEqual(st[("bert", "expandable")], "error")
        self.assertEqual(st[("moe", "async")], "timeout")
        self.assertEqual(st[("moe", "vmmalloc")], "ok")  # ran after the hang was killed
        self.assertEqual(sum(s == "ok" for s in st.values()), 10)
        f = "\n".join(res["failures"])
        self.assertIn("bert / expandable error: RuntimeError: injected failure", f)
        self.assertIn("moe / async timeout: killed after 4 s", f)
        self.assertIn("llama / async vs caching: loss of step 0", f)
        self.assertIn("moe / vmmalloc vs caching: generate call 0", f)
        self.assertIn("**MISMATCH**", text)
        self.assertFalse(res["passed"])

    def test_rounds_run_every_pair_again_and_compare_every_round(self):
        fake = {"flip": ["llama/vmmalloc"]}
        text, res, out = self.run_suite(fake, "--models", "llama,bert", "--allocators", "caching,vmmalloc",
                                        "--rounds", "2", expect_rc=1)
        self.assertEqual([(r["model"], r["allocator"], r["round"]) for r in res["runs"]],
                         [(m, a, n) for n in (1, 2) for m in ("llama", "bert")
                          for a in (("caching", "vmmalloc") if n == 1 else ("vmmalloc", "caching"))])
        self.assertEqual(len(res["comparisons"]), 6)  # each model: 3 runs against its first
        with open(os.path.join(out, "real_models.md")) as f:
            md = f.read()
        self.assertIn("| llama | vmmalloc #2 |", md)
        self.assertIn("Across rounds", md)
        self.assertIn("| llama | vmmalloc | 2 |", md)
        fails = [f for f in res["failures"] if "tokens differ" in f]
        self.assertEqual(len(fails), 2, res["failures"])  # both rounds' flipped tokens are caught
        self.assertTrue(any("vmmalloc #2 vs caching" in f for f in fails))
        self.assertTrue(os.path.exists(os.path.join(out, "real_models.json")))

    def test_profile_step_reaches_the_workers_and_the_report(self):
        text, res, out = self.run_suite({}, "--models", "bert", "--allocators", "caching,vmmalloc",
                                        "--profile-step", "0", expect_rc=0)
        self.assertEqual([r["profile"]["step"] for r in res["runs"]], [0, 0])
        with open(os.path.join(out, "real_models.md")) as f:
            self.assertIn("under torch.profiler", f.read())

    def test_profile_generate_reaches_the_workers_and_the_report(self):
        text, res, out = self.run_suite({}, "--models", "llama", "--allocators", "caching,vmmalloc",
                                        "--profile-generate", "1", expect_rc=0)
        self.assertEqual([r["profile_generate"]["call"] for r in res["runs"]], [1, 1])
        with open(os.path.join(out, "real_models.md")) as f:
            rows = [r for t in tables(f.read()) for r in t if r[:2] == ["llama", "vmmalloc"] and len(r) == 10]
        self.assertEqual(len(rows), 1, rows)
        self.assertEqual(rows[0][3:6], ["0.50", "0.125", "0.250"])  # wall, GPU busy, their ratio

    def test_alloc_probe_reaches_the_workers_and_the_report(self):
        text, res, out = self.run_suite({}, "--models", "bert", "--allocators", "caching,vmmalloc",
                                        "--alloc-probe", expect_rc=0)
        self.assertEqual([r["alloc_probe_ns"]["churn"] for r in res["runs"]], [1500.0, 1500.0])
        with open(os.path.join(out, "real_models.md")) as f:
            rows = [r for t in tables(f.read()) for r in t if r[:2] == ["bert", "vmmalloc"] and r[-4:-2] == ["4000", "4103"]]
        self.assertEqual(rows, [["bert", "vmmalloc", "1030", "1030", "1030", "1030", "1500", "1,234", "4000", "4103",
                                 "5000", "5203"]])

    def test_cpus_pin_every_worker(self):
        cpu = min(os.sched_getaffinity(0))
        text, res, out = self.run_suite({}, "--models", "bert", "--allocators", "caching,vmmalloc",
                                        "--cpus", str(cpu), expect_rc=0)
        self.assertEqual([r["cpus"] for r in res["runs"]], [[cpu], [cpu]])
        self.assertIn("processes pinned to CPUs %d" % cpu, res["meta"]["settings"])
        outside = max(os.sched_getaffinity(0)) + 1
        p = subprocess.run([sys.executable, SCRIPT, "--quick", "--cpus", "0-%d" % outside],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2)
        self.assertIn("may run on CPUs", p.stderr)

    def test_lockstep_pairs_take_turns(self):
        text, res, out = self.run_suite({}, "--models", "bert,llama", "--allocators", "expandable,vmmalloc",
                                        "--rounds", "2", "--lockstep", "--alloc-probe", expect_rc=0)
        self.assertEqual([(r["model"], r["allocator"], r["round"]) for r in res["runs"]],
                         [(m, a, n) for n in (1, 2) for m in ("bert", "llama")
                          for a in (("expandable", "vmmalloc") if n == 1 else ("vmmalloc", "expandable"))])
        self.assertIn("taking turns (--lockstep)", res["meta"]["settings"])
        for n in (1, 2):
            first = "e" if n == 1 else "v"
            for m, turns in (("bert", 5), ("llama", 7)):  # init, the steps, generate() calls, the probes
                pair = [r for r in res["runs"] if r["model"] == m and r["round"] == n]
                self.assertEqual([r["lockstep"]["turns"] for r in pair], [turns, turns])
                self.assertNotIn("device_used", pair[0])  # the device is shared: not reported
                spans = sorted((s[0], s[1], r["allocator"][0]) for r in pair for s in r["turn_spans"])
                for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
                    self.assertLessEqual(end, start)  # one process at a time
                other = "v" if first == "e" else "e"
                self.assertEqual("".join(c for _, _, c in spans), ((first + other + other + first) * turns)[:2 * turns])

    def test_lockstep_hang_stops_its_pair_and_the_rest_runs(self):
        text, res, _ = self.run_suite({"hang": ["bert/vmmalloc"]}, "--models", "bert,llama", "--allocators",
                                      "expandable,vmmalloc", "--lockstep", "--run-timeout", "3", expect_rc=1)
        st = {(r["model"], r["allocator"]): r["status"] for r in res["runs"]}
        self.assertEqual(st, {("bert", "expandable"): "timeout", ("bert", "vmmalloc"): "timeout",
                              ("llama", "expandable"): "ok", ("llama", "vmmalloc"): "ok"})
        self.assertIn("bert / vmmalloc timeout: killed after 6 s, the pair's time limit", "\n".join(res["failures"]))

    def test_lockstep_skips_whole_pairs(self):
        text, res, _ = self.run_suite({}, "--models", "bert,llama", "--allocators", "expandable,vmmalloc",
                                      "--lockstep", "--budget", "10", expect_rc=1)  # a pair needs ~50 s
        self.assertEqual([(r["allocator"], r["status"], r["reason"][:12]) for r in res["runs"]],
                         [("expandable", "skipped", "time budget "), ("vmmalloc", "skipped", "--lockstep: ")] * 2)
        text, res, _ = self.run_suite({"skip77": True}, "--models", "bert,llama", "--allocators",
                                      "expandable,vmmalloc", "--lockstep", expect_rc=77)
        self.assertIn("real_models: skipped: no CUDA device", text)

    def test_lockstep_needs_two_allocators(self):
        for extra in (["--allocators", "caching,expandable,vmmalloc"], ["--allocators", "expandable,vmmalloc",
                                                                      "--trace", "/tmp/x"]):
            p = subprocess.run([sys.executable, SCRIPT, "--quick", "--lockstep"] + extra,
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 2)
            self.assertIn("--lockstep", p.stderr)

    def test_no_cuda_is_a_skip(self):
        text, res, _ = self.run_suite({"skip77": True}, expect_rc=77)
        self.assertIn("skipped", text)

    def test_budget_skips_runs_that_do_not_fit(self):
        text, res, _ = self.run_suite({}, "--budget", "10", expect_rc=1)  # quick estimates 25 s a run
        self.assertEqual({r["status"] for r in res["runs"]}, {"skipped"})
        self.assertIn("no run completed", res["failures"])
        self.assertIn("does not fit", text)

    def test_trace_is_recorded_compressed_and_reported(self):
        tdir = tempfile.mkdtemp(prefix="rm-trace-")
        self.addCleanup(shutil.rmtree, tdir, True)
        text, res, out = self.run_suite({}, "--models", "llama,bert", "--allocators", "caching,vmmalloc", "--trace", tdir,
                                        "--trace-model", "bert", "--replay-bin", "/nonexistent/vmm-replay", expect_rc=0)
        gz = os.path.join(tdir, "bert-vmmalloc.trace.gz")
        with gzip.open(gz, "rt") as f:
            self.assertTrue(f.readline().startswith("# vmmalloc-trace v2"))
        self.assertFalse(os.path.exists(os.path.join(tdir, "bert-vmmalloc.trace")))
        self.assertFalse(os.path.exists(os.path.join(tdir, "llama-vmmalloc.trace.gz")))
        self.assertEqual([t["path"] for t in res["traces"]], [gz])
        self.assertEqual(res["traces"][0]["model"], "bert")
        self.assertIn("vmm-replay not found", res["traces"][0]["status"])
        self.assertEqual(len(res["runs"]), 4)
        with open(os.path.join(out, "real_models.md")) as f:
            self.assertIn("Trace of the bert run under vmmalloc: %s" % gz, f.read())

    def test_trace_of_several_models(self):
        tdir = tempfile.mkdtemp(prefix="rm-trace-")
        self.addCleanup(shutil.rmtree, tdir, True)
        text, res, out = self.run_suite({}, "--models", "llama,bert", "--allocators", "vmmalloc", "--trace", tdir,
                                        "--trace-model", "bert,llama", "--replay-bin", "/nonexistent/vmm-replay",
                                        expect_rc=0)
        self.assertEqual(sorted(t["model"] for t in res["traces"]), ["bert", "llama"])
        for m in ("bert", "llama"):
            self.assertTrue(os.path.exists(os.path.join(tdir, "%s-vmmalloc.trace.gz" % m)))


if __name__ == "__main__":
    unittest.main(verbosity=2)
