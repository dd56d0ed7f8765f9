#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tools/results.py on a made-up gpu-check output folder (no GPU): the benchmark sections come out
as their own tables, the torch replay rows keep their labels, hand-kept text outside the generated
blocks stays, and a second run changes nothing."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.normpath(os.path.join(HERE, "..", "..", "tools", "results.py"))

SUMMARY = """vmmalloc gpu-check
card         Test GPU (1000 MiB, cc 9.0)
driver       999.1 (CUDA 13.0)
commit       abc1234 (.deps/COMMIT)
date         2026-12-03T01:00:00Z
replay       ok (28 s; replay.log, replay.json)
bench        bench_alloc_free ok (1 s) bench_driver ok (1 s) bench_growth ok (1 s) bench_random ok (1 s) (extras.log)
replay table:

| allocator | ns/event | net of null | peak live | peak mapped | mapped/live | peak reserved (VA) | driver calls |
|---|---:|---:|---:|---:|---:|---:|---:|
| vmmalloc (cuda) | 67.8 | 64.2 | 7692.2 MiB | 7888.0 MiB | 1.025 | 286312.0 MiB | 1469 |
| null | 3.5 | - | 7692.2 MiB | n/a | n/a | n/a | 0 |
| cudaMalloc | 5946.4 | 5942.9 | 7692.2 MiB | 7916.0 MiB | 1.029 | n/a | 1316791 |

Pages-touched bound (untimed pass: 2 MiB pages holding a live byte, at their peak):

| allocator | peak live | pages touched | peak mapped (same pass) | touched/live | mapped/touched |
|---|---:|---:|---:|---:|---:|
| vmmalloc | 7692.2 MiB | 7724.0 MiB | 7888.0 MiB | 1.004 | 1.021 |
torch replay rows (default, then expandable_segments):
| torch | 425.5 | 422.5 | 7692.2 MiB | 10166.0 MiB | 1.322 | n/a | n/a |
| torch | 431.8 | 428.3 | 7692.2 MiB | 8560.0 MiB | 1.113 | n/a | n/a |
time         200 s of 500 s
result       PASS
logs         /root/out
"""


def bench(name, lines):
    return ["=== benchmark %s" % name, "=== $ /b/bench/%s --benchmark_min_time=0.05" % name,
            "=== limit 90s, at 1s of 500s", "-" * 20] + lines + ["=== exit 0 after 1s", ""]


def pairs():
    out = []
    for peer, base in (("vmmalloc_cuda", 20.0), ("cudaMallocAsync", 1000.0)):
        for size in (256, 4096, 65536, 262144, 1048576, 16777216):
            for t in (1, 2, 4, 8, 16):
                out.append("alloc_free/%s/bytes:%d/real_time/threads:%d   %.1f ns   %.1f ns   1000 items_per_second=1M/s"
                           % (peer, size, t, base / t if peer.startswith("vmm") else base * t, base))
    out += ["beside_growth/vmmalloc_cuda/real_time/threads:%d   %d ns   500 ns   100000 growths=2k/s" % (t, 1000 - t)
            for t in (1, 2, 4, 8)]
    out += ["trace_overhead/vmmalloc_host/real_time   150 ns   150 ns   1000"]
    return out


EXTRAS = "\n".join(
    bench("bench_alloc_free", pairs())
    + bench("bench_driver", ["remap/cuda/handles:64   2.87 ms   2.87 ms   24 access_us=26.2015 map_us=0.901988 "
                             "piece_MiB=8 unmap_us=17.769",
                             "remap/host/handles:256   1.48 ms   1.46 ms   49 access_us=0.324382 map_us=3.32489 "
                             "piece_MiB=8 unmap_us=2.14124",
                             "remap_beside/cuda/handles:64   9.1 ms   9.1 ms   8 access_us=118.37 "
                             "beside_moves=0.4718 map_us=1.25 piece_MiB=8 unmap_us=22.01"])
    + bench("bench_growth", ["growth_copy/vmmalloc_cuda/real_time   1.81 ms   1.81 ms   38 old_MiB=1024",
                             "growth_copy/cudaMalloc/real_time   5.87 ms   1.94 ms   64 old_MiB=1024",
                             "growth_inplace_kept/vmmalloc_cuda/real_time   65.8 us   65.8 us   1051 old_MiB=1024"])
    + bench("bench_random", ["random/%s/N:1000/max_MiB:1/real_time   1 ms   1 ms   100 items_per_second=%s "
                             "mapped/live=%s ops=2k" % (a, ips, ml)
                             for a, ips, ml in (("vmmalloc_cuda", "4.23129M/s", "1.14004"),
                                                ("cudaMallocAsync", "984.773k/s", "1.0364"),
                                                ("cudaMalloc", "70.3843k/s", "0"))])) + "\n"

RESULTS = """# Results

## Allocate + free pairs

<!-- results:alloc_free:begin -->
old
<!-- results:alloc_free:end -->

### Kept by hand

a table nobody generates

## Driver costs

<!-- results:driver:begin -->
old
<!-- results:driver:end -->

## Growth

<!-- results:growth:begin -->
old
<!-- results:growth:end -->

## Random allocations

<!-- results:random:begin -->
old
<!-- results:random:end -->

## Replay of the shared trace

<!-- results:replay:begin -->
old
<!-- results:replay:end -->
"""


class Results(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="vmm-results-")
        self.out = os.path.join(self.dir, "out")
        os.mkdir(self.out)
        for name, text in (("summary.txt", SUMMARY), ("extras.log", EXTRAS)):
            with open(os.path.join(self.out, name), "w") as f:
                f.write(text)
        self.md = os.path.join(self.dir, "RESULTS.md")
        with open(self.md, "w") as f:
            f.write(RESULTS)

    def tearDown(self):
        shutil.rmtree(self.dir)

    def run_results(self, *extra):
        r = subprocess.run([sys.executable, SCRIPT, self.out, "--results", self.md] + list(extra),
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(self.md) as f:
            return r.stdout, f.read()

    def test_sections_are_tables_of_their_own(self):
        _, text = self.run_results("--only", "alloc_free,driver,growth,random,replay")
        self.assertNotIn("\nold\n", text)
        self.assertIn("Test GPU (1000 MiB, cc 9.0) · driver 999.1 (CUDA 13.0) · commit abc1234 · 2026-12-03", text)
        # pairs: one row a size and peer, threads across, and 8 threads against 1
        self.assertIn("| 256 B | vmmalloc | 20.0 | 10.0 | 5.00 | 2.50 | 1.20 | 8x |", text)
        self.assertIn("| 16 MiB | cudaMallocAsync | 1,000 | 2,000 | 4,000 | 8,000 | 16,000 | 0.12x |", text)
        self.assertIn("| 8 | 992 |", text)                                  # beside_growth
        self.assertNotIn("trace_overhead", text.split("## Driver costs")[0])  # its own section
        self.assertIn("| remap/cuda | 64 | 0.90 | 26.2 | 17.8 | – |", text)
        self.assertIn("| remap/host | 256 | 3.32 | 0.3 | 2.1 | – |", text)
        self.assertIn("| remap_beside/cuda | 64 | 1.25 | 118.4 | 22.0 | 0.47 |", text)
        self.assertIn("| vmmalloc | 1.81 |", text)
        self.assertIn("| cudaMalloc | 5.87 |", text)
        self.assertIn("| after a shrink that kept the handle (`growth_inplace_kept`) | 65.8 |", text)
        self.assertIn("| 1,000 | 1 MiB | 4.23 M/s | 1.140 | 984.8 k/s | 1.036 | 70.4 k/s |", text)
        self.assertIn("| vmmalloc (CUDA backend) | 67.8 | 1.025 | 1,469 |", text)
        self.assertIn("| cudaMalloc | 5,946 | 1.029 | – |", text)
        self.assertIn("| PyTorch caching allocator (libtorch) | 426 | 1.322 | – |", text)
        self.assertIn("| PyTorch expandable segments | 432 | 1.113 | – |", text)
        self.assertIn("1.004 x peak live; vmmalloc's peak mapped is 1.021 x that", text)
        self.assertIn("### Kept by hand\n\na table nobody generates", text)

    def test_second_run_changes_nothing(self):
        _, first = self.run_results()
        out, second = self.run_results()
        self.assertEqual(first, second)
        self.assertNotIn(" changed ", out)

    def test_mixed_torch_rows_are_left_out_not_mislabelled(self):
        # An older gpu-check kept the last four torch/null rows: the default run's bound rows and
        # the expandable run's timing rows. One timing row cannot say which run it is.
        with open(os.path.join(self.out, "summary.txt")) as f:
            s = f.read()
        s = s.replace("| torch | 425.5 | 422.5 | 7692.2 MiB | 10166.0 MiB | 1.322 | n/a | n/a |\n",
                      "| torch | 7692.2 MiB | 7730.0 MiB | 10166.0 MiB | 1.005 | 1.315 |\n")
        with open(os.path.join(self.out, "summary.txt"), "w") as f:
            f.write(s)
        _, text = self.run_results("--only", "replay")
        self.assertIn("| vmmalloc (CUDA backend) | 67.8 |", text)
        self.assertNotIn("PyTorch", text)

    def test_filtered_benchmarks_keep_google_benchmarks_rows(self):
        with open(os.path.join(self.out, "extras.log"), "w") as f:
            f.write("\n".join(bench("bench_random", ["random/vmmalloc_host/N:1000/max_MiB:1/real_time   1 ms   1 ms"
                                                     "   100 items_per_second=4.8M/s"])) + "\n")
        _, text = self.run_results("--only", "random")
        self.assertIn("| random/vmmalloc_host/N:1000/max_MiB:1/real_time | 1 ms | 1 ms | 100 |", text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
