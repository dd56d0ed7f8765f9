#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Real PyTorch processes under four CUDA allocators: peak memory, speed, and identical outputs.

Every (model, allocator) pair runs in a process of its own (an allocator is chosen before the
first CUDA allocation and cannot change after), one after the other, on GPU 0:

  caching      PyTorch's caching allocator, default settings
  expandable   the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  async        PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  vmmalloc     vmmalloc.torch.enable() before the first CUDA allocation (libvmmalloc_torch.so);
               --env KEY=VAL (repeatable) is passed to these runs only, e.g.
               --env VMMALLOC_RELEASE_THRESHOLD=0 or --env VMMALLOC_OPTIONS=thread_cache=0
               (any option by name), to compare variants

Models, built from transformers configs with random weights (fixed seeds, nothing downloaded),
AdamW in bf16 autocast with fp32 master weights, eager attention (deterministic: see below):

  llama   a Llama-style decoder (357 M parameters in --full: weights, gradients and AdamW state
          alone are 5.3 GiB) trained on batches of varying batch x sequence length (up to 12 K
          tokens, sequences up to 2048), then greedy generate() calls of varying batch, prompt and
          output length
  bert    a BERT-base encoder, masked-LM training with varying batch sizes
  moe     a Mixtral-style mixture of experts (8 experts, top 2; data-dependent expert batches),
          training of varying shapes, then short generate() calls
  resnet  (not in the default set) a ResNet-50 from transformers' ResNetConfig, image
          classification training with varying batch sizes: a conv net

The suite of processes where expandable segments itself holds several percent over what is
allocated (--models gpt2,t5,cnn; not in the default set):

  gpt2    a GPT-2-medium-style decoder (learned positions, tied embeddings) trained on varying
          batch x sequence (at most 3,072 tokens a step), then greedy generate() at batches of
          96-256, where the peak is: the K/V cache grows by a torch.cat a token and layer
  t5      a T5-base-style encoder-decoder in bf16 autocast on varying source and target lengths,
          then greedy generate() of varying batch and source length
  cnn     the ResNet-50 shape in bf16 autocast, channels_last, cudnn.benchmark on (its algorithm
          search allocates workspaces of its own and picks algorithms per process: losses agree
          within 2 %, not bit for bit), varying batch and image resolution

Per run: peak held (caching, expandable: torch.cuda.max_memory_reserved; cudaMallocAsync: the
pool's reserved high water from torch.cuda.memory_stats, else cuMemPoolGetAttribute(
RESERVED_MEM_HIGH) on the default pool; vmmalloc: stats peak_physical), peak allocated
(torch.cuda.max_memory_allocated, which counts PyTorch's rounded block sizes; cudaMallocAsync: the
pool's used high water; vmmalloc: peak_allocated, PyTorch's requests in its 512 B units, counted exactly by
libvmmalloc_torch on every malloc and free), their ratio, the step in
which the held peak was reached, peaks per phase (init, train, generate), median training step
time, generate time (--generate-passes: the generate() calls run that many times in the process;
the last pass is the time reported, the first shown beside it, every pass's tokens must agree), process wall time, and the device memory in use (cudaMemGetInfo, sampled
after every step: an allocator-independent cross-check). For vmmalloc also where its memory sat:
stats(0) is read after every step and generate call, and the snapshot taken when peak_physical
rose is kept (requested, allocated, mapped, idle, free_chunk_bytes, slab_bytes, deferred; values
after the call in which the peak rose, the peak itself was inside it).

Outputs compared across allocators, against the first allocator run (caching, by default):
training losses within --loss-rtol, generated token ids identical. The runs are deterministic
(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, no TF32, eager attention): an
allocator cannot change a number, so losses are normally bit for bit equal; the tolerance covers
kernels that stay nondeterministic (--nondeterministic turns the settings off, --attn sdpa uses
PyTorch's fused attention).

Output: a markdown table on stdout, and real_models.md + real_models.json in --out (default
$VMM_OUT when set, else ./real-models-out). --trace DIR: the vmmalloc run of each model in
--trace-model (a comma list, default llama) records its allocation trace (VMMALLOC_TRACE, trace
format v2) into DIR/<model>-vmmalloc.trace.gz, and when
vmm-replay is found (--replay-bin, else build*/tools/replay/) the trace is replayed on the GPU
through vmmalloc and cudaMallocAsync so the replay's peaks can be set beside the real process's.

--lockstep (with two allocators) runs each round's two processes at once and passes a turn between
them: each training step, each generate() call and each stretch that uses the GPU untimed (init,
the probes, the exit) runs only while its process holds the turn, in the order A B B A A B ... So both
processes meet the machine in the same seconds: a drift of its speed over minutes (expandable
segments' GPT-2 step ranged over 1.58 x between processes run one after the other) falls on both
alike, though a difference between the two processes themselves does not cancel. Both processes'
memory must fit the device at once; each one's peaks are its own (the device-wide memory in use
is not reported, the other process shares it), and its times leave out its waits for the turn.

--profile-step N profiles one more training step (GPU kernel time against CPU time);
--profile-generate N profiles generate() call N once more after the timed passes (how long the GPU
ran kernels against the call's wall time: whether the call waits on the GPU or on the CPU); --alloc-probe
times allocate + free pairs through torch.empty in every process after its runs, and the report
gives each allocator's ns per pair beside the training steps' allocation count.

Time: a process start with torch and transformers imports costs ~5-10 s. --quick (tiny shapes)
takes ~10 s a run, ~2 minutes for the 12 runs. --full is sized for one H100: ~20-40 s a run,
~5-6 minutes for the 12 runs with two generate passes, under 8.5 with the default --budget of 500 s: a run whose
estimated time does not fit what is left is skipped and reported; every run prints its time.

Exit 0: every run passed and every output matched. 1: a run failed or timed out, an output
differs, or vmmalloc's check() or a failed allocation was reported. 2: usage. 77: no torch,
transformers or CUDA device.

    cmake --build build --target vmmalloc_torch          # libvmmalloc_torch.so
    python3 bench/real_models.py --quick
    python3 bench/real_models.py --full --out "$OUT"
    python3 bench/real_models.py --full --models llama --allocators caching,vmmalloc \\
        --env VMMALLOC_RELEASE_THRESHOLD=0
    python3 bench/real_models.py --full --models llama --trace "$OUT"
"""

import argparse
import glob
import gzip
import hashlib
import json
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, ".."))
T_START = time.perf_counter()
GiB = float(1 << 30)
MiB = float(1 << 20)

ALLOCATORS = ("caching", "expandable", "async", "vmmalloc")
LABEL = {"caching": "PyTorch caching", "expandable": "expandable segments", "async": "cudaMallocAsync",
         "vmmalloc": "vmmalloc"}
ALLOC_CONF = {"caching": None, "expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync",
              "vmmalloc": None}
HELD_SOURCE = {"caching": "torch.cuda.max_memory_reserved", "expandable": "torch.cuda.max_memory_reserved",
               "async": "pool ReservedMemHigh", "vmmalloc": "stats peak_physical"}
ALLOC_SOURCE = {"caching": "torch.cuda.max_memory_allocated", "expandable": "torch.cuda.max_memory_allocated",
                "async": "pool UsedMemHigh", "vmmalloc": "stats peak_allocated"}
VMM_AT_PEAK = ("peak_physical", "physical", "requested", "allocated", "mapped", "idle", "free_chunk_bytes",
               "slab_bytes", "deferred", "live")

# ---- the workloads ------------------------------------------------------------------------------
# train: (batch, sequence) per step (resnet: (batch, image side)); generate: (batch, prompt, new).
# Shapes vary step to step so the allocators see mixed sizes, as in a real job. estimate_s: the
# first run's time budget guess (later runs of a model use the slowest run so far).
MODELS = {
    "llama": {
        "family": "llama",
        "what": "Llama-style decoder, AdamW (bf16 autocast) on varying batch x sequence, then greedy generate()",
        "full": {
            "config": dict(vocab_size=32000, hidden_size=1280, intermediate_size=3456, num_hidden_layers=16,
                           num_attention_heads=20, num_key_value_heads=4, max_position_embeddings=4096),
            # At most 12 K tokens a step and batch 4 at 2048: eager attention keeps a batch x 20 heads
            # x seq^2 bf16 tensor a layer for backward (10.7 GB over 16 layers at 4 x 2048); the
            # largest steps peak near 30 GB allocated, so every allocator fits an 80 GB card.
            "train": [(8, 1024), (4, 2048), (16, 512), (2, 1536), (12, 1024), (32, 256), (4, 768), (1, 2048),
                      (6, 1280), (24, 384), (8, 1536), (3, 2048), (2, 512), (10, 896), (4, 1024), (18, 640),
                      (4, 1792), (16, 768), (48, 128), (8, 1280)],
            "generate": [(1, 128, 64), (8, 512, 96), (16, 256, 64), (4, 1024, 96), (32, 64, 48), (2, 1536, 48)],
            "estimate_s": 50,
        },
        "quick": {
            "config": dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
            "train": [(2, 32), (4, 16), (1, 64)],
            "generate": [(2, 8, 8), (3, 4, 6)],
            "estimate_s": 25,
        },
    },
    "bert": {
        "family": "bert",
        "what": "BERT-base encoder, masked-LM training (bf16 autocast) with varying batch sizes, sequence 256",
        "full": {
            "config": dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           intermediate_size=3072, max_position_embeddings=512),
            "train": [(32, 256), (8, 256), (64, 256), (16, 256), (128, 256), (48, 256), (24, 256), (96, 256),
                      (4, 256), (80, 256), (40, 256), (112, 256), (56, 256), (12, 256), (72, 256), (64, 256)],
            "generate": [],
            "estimate_s": 30,
        },
        "quick": {
            "config": dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=128),
            "train": [(4, 32), (2, 32), (8, 32)],
            "generate": [],
            "estimate_s": 25,
        },
    },
    "moe": {
        "family": "mixtral",
        "what": "Mixtral-style mixture of experts (8 experts, top 2), training of varying shapes, then generate()",
        "full": {
            "config": dict(vocab_size=32000, hidden_size=768, intermediate_size=1536, num_hidden_layers=8,
                           num_attention_heads=12, num_key_value_heads=4, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=4096, output_router_logits=True),
            "train": [(8, 512), (4, 1024), (16, 256), (2, 2048), (8, 1024), (32, 128), (4, 768), (12, 512),
                      (1, 1024), (6, 640), (16, 512), (3, 1536)],
            "generate": [(4, 128, 32), (16, 64, 24)],
            "estimate_s": 40,
        },
        "quick": {
            "config": dict(vocab_size=1000, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=256, output_router_logits=True),
            "train": [(2, 32), (4, 16)],
            "generate": [(2, 8, 6)],
            "estimate_s": 25,
        },
    },
    "resnet": {
        "family": "resnet",
        "what": "ResNet-50 (transformers ResNetConfig), image classification training with varying batch sizes",
        "full": {
            "config": dict(num_channels=3, embedding_size=64, hidden_sizes=[256, 512, 1024, 2048],
                           depths=[3, 4, 6, 3], layer_type="bottleneck", hidden_act="relu", num_labels=1000),
            "train": [(64, 224), (16, 224), (128, 224), (32, 224), (96, 224), (8, 224), (48, 224), (112, 224),
                      (24, 224), (80, 224)],
            "generate": [],
            "estimate_s": 40,
        },
        "quick": {
            "config": dict(num_channels=3, embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1],
                           layer_type="bottleneck", hidden_act="relu", num_labels=10),
            "train": [(4, 32), (2, 32), (8, 32)],
            "generate": [],
            "estimate_s": 25,
        },
    },
}
MODELS.update({
    "gpt2": {
        "family": "gpt2",
        "what": "GPT-2-medium-style decoder, AdamW (bf16 autocast) on varying batch x sequence, then greedy "
                "generate() at varying batch",
        "full": {
            "config": dict(vocab_size=50257, n_positions=1024, max_position_embeddings=1024, n_embd=1024,
                           n_layer=24, n_head=16),
            # Training of at most 3,072 tokens a step, then generate() at batches of 96-256: the
            # peak is in generate, where DynamicCache grows every layer's K and V by a torch.cat a
            # token (up to 12 GiB of bf16 K/V at once).
            "train": [(4, 512), (2, 768), (8, 256), (1, 768), (6, 384), (16, 128), (3, 640), (12, 192),
                      (4, 448), (2, 704), (8, 320), (5, 384)],
            "generate": [(128, 256, 320), (256, 128, 256), (192, 320, 384), (96, 512, 256)],
            "estimate_s": 80,
        },
        "quick": {
            "config": dict(vocab_size=1000, n_positions=128, max_position_embeddings=128, n_embd=64, n_layer=2,
                           n_head=4),
            "train": [(2, 32), (4, 16), (1, 64)],
            "generate": [(2, 8, 8), (3, 4, 6)],
            "estimate_s": 25,
        },
    },
    "t5": {
        "family": "t5",
        "what": "T5-base-style encoder-decoder, AdamW in bf16 autocast on varying source x target lengths, then "
                "greedy generate()",
        "full": {
            "config": dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12,
                           num_heads=12, feed_forward_proj="gated-gelu"),
            # Training of at most 2,048 source tokens a step, then generate() at batches of 384-640:
            # the peak is in generate, where the decoder's self-attention cache grows every layer's
            # K and V by a torch.cat a token, beside the cross-attention cache of the whole source.
            "train": [(8, 256, 64), (4, 512, 128), (16, 128, 32), (2, 1024, 256), (6, 320, 160), (12, 160, 48),
                      (3, 640, 192), (8, 256, 128), (4, 448, 96), (16, 96, 64)],
            "generate": [(512, 256, 192), (640, 192, 256), (384, 512, 160), (576, 320, 224)],
            "estimate_s": 60,
        },
        "quick": {
            "config": dict(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                           num_heads=4, feed_forward_proj="gated-gelu"),
            "train": [(2, 32, 8), (4, 16, 12)],
            "generate": [(2, 16, 6)],
            "estimate_s": 25,
        },
    },
    "cnn": {
        "family": "resnet",
        "channels_last": True,
        "cudnn_benchmark": True,
        "loss_rtol": 2e-2,  # cudnn.benchmark chooses algorithms per process: losses moved 0.4 % on an H200
        "what": "ResNet-50-shaped CNN, bf16 autocast, channels_last, cudnn.benchmark, varying batch and resolution",
        "full": {
            "config": dict(num_channels=3, embedding_size=64, hidden_sizes=[256, 512, 1024, 2048],
                           depths=[3, 4, 6, 3], layer_type="bottleneck", hidden_act="relu", num_labels=1000),
            # cudnn.benchmark searches every new shape (~3-5 s each on an H200): 8 shapes.
            "train": [(64, 224), (32, 288), (96, 160), (16, 384), (48, 256), (8, 448), (80, 192), (32, 320)],
            "generate": [],
            "estimate_s": 60,
        },
        "quick": {
            "config": dict(num_channels=3, embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1],
                           layer_type="bottleneck", hidden_act="relu", num_labels=10),
            "train": [(4, 32), (2, 48), (8, 40)],
            "generate": [],
            "estimate_s": 25,
        },
    },
})
DEFAULT_MODELS = ("llama", "bert", "moe")
SEED = 1234


# ---- pure helpers (tests/python/test_real_models.py runs them without torch) --------------------

def parse_env(items):
    """--env KEY=VAL ... -> dict; ValueError naming the bad item."""
    out = {}
    for it in items or []:
        key, eq, val = it.partition("=")
        if not eq or not key or not key.replace("_", "").isalnum():
            raise ValueError("--env %r: expected KEY=VALUE, e.g. VMMALLOC_RELEASE_THRESHOLD=0" % it)
        out[key] = val
    return out


def parse_cpus(text):
    """--cpus "0-3,8" -> [0, 1, 2, 3, 8]; ValueError naming the bad part."""
    out = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            first, last = -1, -1
        if first < 0 or last < first:
            raise ValueError("--cpus %r: %r is not a CPU number or a range like 0-7" % (text, part))
        out.update(range(first, last + 1))
    return sorted(out)


def pick(names, known, what):
    """A comma list checked against `known`, in the order given; ValueError on an unknown name."""
    got = [n.strip() for n in str(names).split(",") if n.strip()]
    bad = [n for n in got if n not in known]
    if bad or not got:
        raise ValueError("--%s: unknown %s (choose from %s)" % (what, ",".join(bad) or "(none)", ",".join(known)))
    return list(dict.fromkeys(got))


def gib(n):
    return "-" if n is None else "%.2f" % (n / GiB)


def size_label(n):
    """512 B, 64 KiB, 1 MiB: a power-of-two size in its largest whole unit."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return "%d %s" % (n >> shift, unit)
    return "%d B" % n


def ratio(a, b):
    return None if not a or not b else float(a) / float(b)


def step_label(phase, index, shape):
    return "%s %d (%s)" % (phase, index, "x".join(str(x) for x in shape))


def tokens_digest(tokens):
    return hashlib.sha256(json.dumps(tokens, separators=(",", ":")).encode()).hexdigest()[:16]


def first_token_difference(a, b):
    """(row, position, differing, total) of two token lists of lists, or None when equal."""
    if a == b:
        return None
    rows = max(len(a), len(b))
    first, differing, total = None, 0, 0
    for r in range(rows):
        ra = a[r] if r < len(a) else []
        rb = b[r] if r < len(b) else []
        for p in range(max(len(ra), len(rb))):
            total += 1
            x = ra[p] if p < len(ra) else None
            y = rb[p] if p < len(rb) else None
            if x != y:
                differing += 1
                if first is None:
                    first = (r, p)
    return {"row": first[0], "position": first[1], "differing": differing, "total": total}


def round_suffix(run):
    """" #N" for a run of round N >= 2 (--rounds), else ""."""
    return "" if run.get("round", 1) == 1 else " #%d" % run["round"]


def run_label(run, labels=None):
    """The allocator's name (its table label with labels=LABEL), with the round from the second on."""
    return (labels or {}).get(run["allocator"], run["allocator"]) + round_suffix(run)


def compare_runs(runs, rtol):
    """Outputs of every passed run against the model's reference run (the first passed one in
    allocator order). Returns a list of comparison dicts; `mismatches` lists what differs."""
    out = []
    by_model = {}
    for r in runs:
        by_model.setdefault(r["model"], []).append(r)
    for model, rs in by_model.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        if not ok:
            continue
        ref = ok[0]
        rtol_m = max(rtol, MODELS.get(model, {}).get("loss_rtol", 0.0))
        for r in ok[1:]:
            c = {"model": model, "allocator": run_label(r), "reference": run_label(ref), "mismatches": []}
            la, lb = ref.get("losses", []), r.get("losses", [])
            c["losses_exact"] = la == lb
            worst = 0.0
            if len(la) != len(lb):
                c["mismatches"].append("%d losses, the reference has %d" % (len(lb), len(la)))
            for i, (x, y) in enumerate(zip(la, lb)):
                if x != x or y != y:  # NaN
                    c["mismatches"].append("loss of step %d is NaN (%r vs %r)" % (i, y, x))
                    continue
                rel = abs(x - y) / max(abs(x), 1e-30)
                worst = max(worst, rel)
                if abs(x - y) > rtol_m * abs(x) + 1e-12:
                    c["mismatches"].append("loss of step %d: %.7g vs %.7g (relative %.2e > %.1e)" % (i, y, x, rel, rtol_m))
            c["losses_max_rel"] = worst
            ga, gb = ref.get("generate", []), r.get("generate", [])
            if not ga and not gb:
                c["tokens_equal"] = None
            else:
                c["tokens_equal"] = True
                if len(ga) != len(gb):
                    c["tokens_equal"] = False
                    c["mismatches"].append("%d generate calls, the reference has %d" % (len(gb), len(ga)))
                for i, (x, y) in enumerate(zip(ga, gb)):
                    d = first_token_difference(x.get("tokens", []), y.get("tokens", []))
                    if d:
                        c["tokens_equal"] = False
                        c.setdefault("first_token_difference", dict(d, call=i))
                        c["mismatches"].append(
                            "generate call %d (%s): tokens differ, first at row %d position %d (%d of %d differ)"
                            % (i, "x".join(str(v) for v in x.get("shape", [])), d["row"], d["position"],
                               d["differing"], d["total"]))
            out.append(c)
    return out


def generate_cell(run):
    """The last generate pass, the first in brackets when there were more."""
    if not run.get("generate"):
        return "-"
    first = run.get("generate_first_s")
    if first is not None and len(run.get("generate_passes_s", [])) > 1:
        return "%.2f (%.2f)" % (run["generate_s"], first)
    return "%.2f" % run["generate_s"]


def outputs_cell(run, comparisons):
    if run.get("status") != "ok":
        return ""
    for c in comparisons:
        if c["model"] == run["model"] and c["allocator"] == run_label(run):
            if c["mismatches"]:
                return "**MISMATCH** (%d)" % len(c["mismatches"])
            losses = "losses exact" if c["losses_exact"] else "losses within rtol (max %.1e)" % c["losses_max_rel"]
            toks = {True: ", tokens equal", False: ", tokens DIFFER", None: ""}[c["tokens_equal"]]
            return losses + toks
    return "reference"


def status_cell(run):
    s = run.get("status")
    if s == "ok":
        return None
    if s == "skipped":
        return "skipped: %s" % run.get("reason", "")
    return "%s: %s" % (s, str(run.get("error", "")).replace("|", "/").replace("\n", " ")[:140])


def markdown(result):
    """The report: what ran, the main table, peaks by phase, where vmmalloc's memory sat, notes."""
    meta, runs, comps = result["meta"], result["runs"], result["comparisons"]
    lines = ["### Real PyTorch processes: peak memory and speed by allocator (bench/real_models.py)", ""]
    lines.append("%s; torch %s, transformers %s; mode %s; %s; commit %s." % (
        meta.get("device", "?"), meta.get("torch", "?"), meta.get("transformers", "?"), meta.get("mode", "?"),
        meta.get("settings", ""), meta.get("commit", "?")))
    if meta.get("vmm_env"):
        lines.append("vmmalloc runs with: %s." % " ".join("%s=%s" % kv for kv in sorted(meta["vmm_env"].items())))
    lines.append("")
    for m in meta.get("models", []):
        spec = MODELS[m]
        params = next((r.get("parameters") for r in runs if r["model"] == m and r.get("parameters")), None)
        lines.append("- **%s**: %s%s." % (m, spec["what"], "; %.1f M parameters" % (params / 1e6) if params else ""))
    lines += ["", "| model | allocator | peak held GiB | peak allocated GiB | held / allocated | held vs caching "
                  "| held peak reached in | step median ms | train s | generate s | run s | outputs |",
              "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    caching_held = {r["model"]: r.get("held_peak") for r in runs
                    if r["allocator"] == "caching" and r.get("round", 1) == 1 and r.get("status") == "ok"}
    for r in runs:
        head = "| %s | %s " % (r["model"], run_label(r, LABEL))
        bad = status_cell(r)
        if bad:
            lines.append(head + "| %s | | | | | | | | %s | |" % (bad, "%.0f" % r["wall_s"] if r.get("wall_s") else ""))
            continue
        vs = ratio(r.get("held_peak"), caching_held.get(r["model"]))
        lines.append(head + "| %s | %s | %s | %s | %s | %s | %s | %s | %.0f | %s |" % (
            gib(r.get("held_peak")), gib(r.get("alloc_peak")),
            "%.3f" % ratio(r.get("held_peak"), r.get("alloc_peak")) if ratio(r.get("held_peak"), r.get("alloc_peak")) else "-",
            "%.3f" % vs if vs else "-", r.get("peak_at", "-"),
            "%.1f" % (r["median_step_s"] * 1e3) if r.get("median_step_s") is not None else "-",
            "%.2f" % r["train_s"] if r.get("train_s") is not None else "-",
            generate_cell(r), r.get("wall_s", 0.0), outputs_cell(r, comps)))
    lines += ["", "Held: %s. Allocated: %s (PyTorch counts its rounded block sizes, vmmalloc its block sizes "
                  "(256-byte units, slab slots) with the blocks its thread caches hold). Held vs caching: peak held / the caching allocator's for the same model. Generate s: "
                  "the last pass of the generate() calls, the first pass (first-call costs included) in brackets. Run s: the "
                  "process, imports included." % (
                      "; ".join("%s %s" % (LABEL[a], HELD_SOURCE[a]) for a in ALLOCATORS),
                      "; ".join("%s %s" % (LABEL[a], ALLOC_SOURCE[a]) for a in ALLOCATORS))]
    ok = [r for r in runs if r.get("status") == "ok"]
    lines += rounds_table(ok)
    lines += profile_table(ok)
    lines += profile_generate_table(ok)
    lines += probe_table(ok)
    lines += usage_table(ok)
    if ok:
        lines += ["", "Peak held by phase (GiB; peaks reset at each phase's start) and device memory in use "
                      "(cudaMemGetInfo above the process's start, the most seen after any step):", "",
                  "| model | allocator | init | train | generate | device in use, max sampled |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in ok:
            ph = r.get("phase_peaks", {})
            dev = r.get("device_used", {})
            lines.append("| %s | %s | %s | %s | %s | %s |" % (
                r["model"], run_label(r, LABEL), gib(ph.get("init", {}).get("held")),
                gib(ph.get("train", {}).get("held")), gib(ph.get("generate", {}).get("held")),
                gib(dev.get("max_above_start"))))
    vm = [r for r in ok if r["allocator"] == "vmmalloc" and r.get("vmm_at_peak")]
    if vm:
        lines += ["", "Where vmmalloc's memory sat when peak_physical last rose (GiB; stats(0) after the step or "
                      "generate call in which it rose):", "",
                  "| model | rose in | peak_physical | requested | allocated | mapped | idle | free chunks | "
                  "slabs | deferred | live blocks |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in vm:
            s = r["vmm_at_peak"]
            lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                r["model"] + round_suffix(r), s.get("at", "-"), gib(s.get("peak_physical")), gib(s.get("requested")),
                gib(s.get("allocated")), gib(s.get("mapped")), gib(s.get("idle")), gib(s.get("free_chunk_bytes")),
                gib(s.get("slab_bytes")), s.get("deferred", "-"), s.get("live", "-")))
    vt = [r for r in ok if r["allocator"] == "vmmalloc" and r.get("vmm_stats_end", {}).get("driver_ns") is not None]
    if vt:
        lines += ["", "Where vmmalloc's own time went (stats(0) at the end of the process: driver calls and "
                      "their wall time; fences: recording, querying and waiting for stream fences):", "",
                  "| model | driver calls | creates | maps | unmaps | set_access | releases | driver ms | "
                  "fences recorded / queried / waited | fence ms | chunks retired | train + generate s | "
                  "train step: median driver + fence ms | median step ms without them |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in vt:
            e = r["vmm_stats_end"]
            busy = (r.get("train_s") or 0.0) + (r.get("generate_s") or 0.0)
            ms = lambda k: "%.2f" % (r[k] * 1e3) if r.get(k) is not None else "-"
            lines.append("| %s | %d | %d | %d | %d | %d | %d | %.1f | %d / %d / %d | %.1f | %d | %.2f | %s | %s |" % (
                r["model"] + round_suffix(r), e.get("driver_calls", 0), e.get("creates", 0), e.get("maps", 0), e.get("unmaps", 0),
                e.get("set_access_calls", 0), e.get("releases", 0), e["driver_ns"] / 1e6, e.get("record_fences", 0),
                e.get("fence_queries", 0), e.get("fence_waits", 0), e.get("fence_ns", 0) / 1e6,
                e.get("chunks_retired", 0), busy, ms("median_step_driver_s"), ms("median_step_without_driver_s")))
    for tr in result.get("traces") or []:
        lines += ["", "Trace of the %s run under vmmalloc: %s (%s)." % (tr.get("model", "-"), tr.get("path", "-"),
                                                                      tr.get("status", ""))]
        for row in tr.get("rows", []):
            lines.append("- %s" % row)
    lines += ["", "Whole run: %.0f s. %s" % (result.get("seconds", 0), "PASSED" if result.get("passed") else "FAILED")]
    for f in result.get("failures", []):
        lines.append("- FAIL: " + f)
    for n in result.get("notes", []):
        lines.append("- note: " + n)
    return "\n".join(lines)


def top_ops(rows, n, width, fmt):
    """The first n of profile_summary's top entries as "name time; ...", names cut to width."""
    return "; ".join(fmt % (k.replace("|", "/")[:width], v) for k, v, _ in rows[:n]) or "-"


def profile_table(ok):
    """--profile-step: the profiled step of every run."""
    pr = [r for r in ok if r.get("profile")]
    if not pr:
        return []
    out = ["", "One training step under torch.profiler (--profile-step; an extra step after the timed ones, "
               "profiler overhead included; self times summed over all operations):", "",
           "| model | allocator | step | wall ms | GPU kernels ms | CPU ms | most GPU time | most CPU time |",
           "|---|---|---|---:|---:|---:|---|---|"]
    top = lambda rows: top_ops(rows, 2, 48, "%s %.1f")
    for r in pr:
        p = r["profile"]
        out.append("| %s | %s | %s | %.1f | %.1f | %.1f | %s | %s |" % (
            r["model"], run_label(r, LABEL), step_label("train", p["step"], tuple(p["shape"])), p["seconds"] * 1e3,
            p["gpu_self_ms"], p["cpu_self_ms"], top(p.get("top_gpu", [])), top(p.get("top_cpu", []))))
    return out


def profile_generate_table(ok):
    """--profile-generate: the profiled generate() call of every run."""
    pr = [r for r in ok if r.get("profile_generate")]
    if not pr:
        return []
    out = ["", "One generate() call under torch.profiler (--profile-generate; once more after the timed passes, "
               "profiler overhead included). GPU busy: the union of the kernels' intervals; the rest of the wall "
               "time the GPU waited for the CPU:", "",
           "| model | allocator | call | wall s | GPU busy s | GPU busy / wall | kernels | GPU kernels s | CPU self s | most CPU time |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    top = lambda rows: top_ops(rows, 3, 40, "%s %.0f")
    for r in pr:
        p = r["profile_generate"]
        out.append("| %s | %s | %s | %.2f | %.3f | %.3f | %s | %.3f | %.2f | %s |" % (
            r["model"], run_label(r, LABEL), step_label("generate", p["call"], tuple(p["shape"])), p["seconds"],
            p["gpu_busy_ms"] / 1e3, p["gpu_busy_ms"] / 1e3 / p["seconds"] if p["seconds"] else 0,
            "{:,}".format(p["kernels"]), p["gpu_self_ms"] / 1e3, p["cpu_self_ms"] / 1e3, top(p.get("top_cpu", []))))
    return out


def probe_table(ok):
    """--alloc-probe: ns per allocate + free pair through torch.empty, and the training steps'
    allocation count (what a difference per pair costs a step)."""
    pr = [r for r in ok if r.get("alloc_probe_ns")]
    if not pr:
        return []
    sizes = [str(n) for n in PROBE_SIZES] + ["churn"]
    head = [size_label(int(n)) if n != "churn" else "churn (mixed sizes)" for n in sizes]
    out = ["", "Allocate + free through torch.empty in each process after its runs (--alloc-probe; ns per pair, "
               "best of 5 x 20,000, Python's loop included), and allocations per training step (median):", "",
           "| model | allocator | " + " | ".join(head) + " | allocations per step | launch, start | launch, end "
           "| launch + allocation, start | launch + allocation, end |",
           "|---|---|" + "---:|" * (len(sizes) + 5)]
    for r in pr:
        p = r["alloc_probe_ns"]
        n = r.get("median_step_allocations")
        lp = [r.get("launch_probe_ns", {}).get(w) for w in ("start", "end")]
        lp += [r.get("launch_alloc_probe_ns", {}).get(w) for w in ("start", "end")]
        out.append("| %s | %s | %s | %s | %s |" % (r["model"], run_label(r, LABEL),
                   " | ".join("%.0f" % p[k] if p.get(k) is not None else "-" for k in sizes),
                   "{:,.0f}".format(n) if n is not None else "-",
                   " | ".join("%.0f" % v if v is not None else "-" for v in lp)))
    out += ["", "Launch: ns per in-place add on a tensor made beforehand (no allocation); launch + allocation: "
                "ns per out-of-place add (its result allocated, the previous one freed). Best of 5 x 20,000, "
                "Python's loop included, after the model's init (start) and after the probe above (end)."]
    return out


def usage_table(ok):
    """The process's CPU time, context switches and minor faults in each generate() pass."""
    ur = [r for r in ok if r.get("generate_passes_usage")]
    if not ur:
        return []
    out = ["", "The process in each generate() pass (getrusage: every thread of the process; involuntary "
               "switches: the kernel gave a CPU to another thread):", "",
           "| model | allocator | pass | wall s | user s | system s | voluntary switches | involuntary switches | "
           "minor faults |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in ur:
        for i, (t, u) in enumerate(zip(r["generate_passes_s"], r["generate_passes_usage"])):
            out.append("| %s | %s | %d | %.2f | %.2f | %.2f | %s | %s | %s |" % (
                r["model"], run_label(r, LABEL), i + 1, t, u["user_s"], u["sys_s"], "{:,}".format(u["voluntary"]),
                "{:,}".format(u["involuntary"]), "{:,}".format(u["minor_faults"])))
    return out


def rounds_table(ok):
    """With --rounds: per model and allocator the median over rounds, and each round's ratio to the
    reference allocator (the first of --allocators) of the same round: processes of one allocator
    moved by up to 32 % (median step) and 46 % (generate) between runs on one machine, so a single pair of
    runs says little about a few percent."""
    if not any(r.get("round", 1) > 1 for r in ok):
        return []
    med = lambda xs: statistics.median(xs) if xs else None
    out = ["", "Across rounds (each round runs every model and allocator once, the allocators in reverse "
               "order in even rounds; ratios against the same round's run of the first allocator; median "
               "of the rounds):", "",
           "| model | allocator | rounds | peak held GiB, min-max | step median ms | step vs reference, per round | "
           "generate s | generate vs reference, per round |", "|---|---|---:|---|---:|---|---:|---|"]
    models = list(dict.fromkeys(r["model"] for r in ok))
    for m in models:
        rs = [r for r in ok if r["model"] == m]
        allocs = list(dict.fromkeys(r["allocator"] for r in rs))
        ref = allocs[0]
        by = {(r["allocator"], r.get("round", 1)): r for r in rs}
        for al in allocs:
            mine = sorted((r for r in rs if r["allocator"] == al), key=lambda r: r.get("round", 1))
            held = [r["held_peak"] for r in mine if r.get("held_peak")]
            def ratios(key):
                out_r = []
                for r in mine:
                    b = by.get((ref, r.get("round", 1)))
                    if b and r.get(key) and b.get(key):
                        out_r.append(r[key] / b[key])
                return out_r
            steps = [r["median_step_s"] * 1e3 for r in mine if r.get("median_step_s") is not None]
            gens = [r["generate_s"] for r in mine if r.get("generate")]
            sr, gr = ratios("median_step_s"), ratios("generate_s")
            cell = lambda rr: "-" if not rr or al == ref else "%s (median %.3f)" % (
                " / ".join("%.3f" % x for x in rr), med(rr))
            out.append("| %s | %s | %d | %s | %s | %s | %s | %s |" % (
                m, LABEL.get(al, al), len(mine),
                "%s-%s" % (gib(min(held)), gib(max(held))) if held else "-",
                "%.1f" % med(steps) if steps else "-", cell(sr),
                "%.2f" % med(gens) if gens else "-", cell(gr)))
    return out


def judge(runs, comparisons):
    """(failures, notes) for the whole suite."""
    failures, notes = [], []
    for r in runs:
        name = "%s / %s" % (r["model"], run_label(r))
        st = r.get("status")
        if st == "skipped":
            notes.append("%s skipped: %s" % (name, r.get("reason", "")))
        elif st != "ok":
            err = str(r.get("error", "")).strip().splitlines()
            failures.append("%s %s: %s" % (name, st, err[-1] if err else "no error text"))
        else:
            if r.get("vmm_check"):
                failures.append("%s: vmmalloc check(): %s" % (name, r["vmm_check"]))
            for k in ("malloc_failures", "free_failures"):
                if r.get("vmm_stats_end", {}).get(k):
                    failures.append("%s: vmmalloc %s = %d" % (name, k, r["vmm_stats_end"][k]))
            if r.get("held_peak") is None:
                failures.append("%s: no peak held reading (%s)" % (name, r.get("held_error", "?")))
            for n in r.get("notes", []):
                notes.append("%s: %s" % (name, n))
    for c in comparisons:
        ms = c["mismatches"]
        for m in ms[:3]:  # the first few: the JSON has every one
            failures.append("%s / %s vs %s: %s" % (c["model"], c["allocator"], c["reference"], m))
        if len(ms) > 3:
            failures.append("%s / %s vs %s: ... and %d more differences (real_models.json)" % (
                c["model"], c["allocator"], c["reference"], len(ms) - 3))
    if runs and not any(r.get("status") == "ok" for r in runs):
        failures.append("no run completed")
    return failures, notes


# ---- the worker: one (model, allocator) in this process ----------------------------------------

class Baton:
    """The worker's end of --lockstep's turns (--baton IN,OUT: pipes from and to the driver): take()
    says the process is ready and blocks until the driver gives it the turn, give() hands it back.
    Without --baton both do nothing. `waited` sums the seconds spent blocked, which the phase times
    leave out."""

    def __init__(self, spec):
        self.fds = tuple(int(x) for x in spec.split(",")) if spec else None
        self.waited = 0.0
        self.turns = 0

    def take(self):
        if self.fds is None:
            return
        os.write(self.fds[1], b"r")
        t = time.perf_counter()
        if os.read(self.fds[0], 1) != b"g":
            raise RuntimeError("--lockstep: the driver closed the turns")
        self.waited += time.perf_counter() - t
        self.turns += 1

    def give(self):
        if self.fds is not None:
            os.write(self.fds[1], b"d")


class Probe:
    """The allocator's own peak counters: reset at a phase's start, read after every step."""

    def __init__(self, torch, allocator, dev, vt):
        self.torch, self.allocator, self.dev, self.vt = torch, allocator, dev, vt
        self.pool = None  # cudaMallocAsync: the driver's default pool of the device
        self.pool_error = None
        if allocator == "async":
            self.pool, self.pool_error = _default_pool(dev.index or 0)

    def reset(self):
        if self.allocator == "vmmalloc":
            self.vt.reset_peaks(self.dev.index or 0)
            return
        try:
            self.torch.cuda.reset_peak_memory_stats(self.dev)
        except Exception:
            if self.allocator != "async":
                raise
        if self.allocator == "async" and self.pool is not None:
            _pool_reset(self.pool)

    def read(self):
        """{held, allocated, held_now, allocated_now} in bytes (None where unknown)."""
        t = self.torch
        if self.allocator == "vmmalloc":
            s = self.vt.stats(self.dev.index or 0) or {}
            return {"held": s.get("peak_physical"), "allocated": s.get("peak_allocated"),
                    "held_now": s.get("physical"), "allocated_now": s.get("requested"), "vmm": s}
        if self.allocator == "async":
            held = alloc = held_now = alloc_now = None
            try:
                s = t.cuda.memory_stats(self.dev)
                held, alloc = s.get("reserved_bytes.all.peak"), s.get("allocated_bytes.all.peak")
                held_now, alloc_now = s.get("reserved_bytes.all.current"), s.get("allocated_bytes.all.current")
            except Exception:
                pass
            pool = _pool_attrs(self.pool) if self.pool is not None else None
            if pool:
                held = held or pool["reserved_high"]
                alloc = alloc or pool["used_high"]
                held_now = held_now if held_now is not None else pool["reserved_current"]
                alloc_now = alloc_now if alloc_now is not None else pool["used_current"]
            return {"held": held, "allocated": alloc, "held_now": held_now, "allocated_now": alloc_now, "pool": pool}
        return {"held": t.cuda.max_memory_reserved(self.dev), "allocated": t.cuda.max_memory_allocated(self.dev),
                "held_now": t.cuda.memory_reserved(self.dev), "allocated_now": t.cuda.memory_allocated(self.dev)}


def _driver():
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    for name, args in (("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
                       ("cuDeviceGetDefaultMemPool", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]),
                       ("cuMemPoolGetAttribute", [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]),
                       ("cuMemPoolSetAttribute", [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p])):
        f = getattr(lib, name)
        f.argtypes, f.restype = args, ctypes.c_int
    return lib


# CUmemPool_attribute (cuda.h): 5 reserved current, 6 reserved high, 7 used current, 8 used high.
_POOL_ATTRS = {"reserved_current": 5, "reserved_high": 6, "used_current": 7, "used_high": 8}


def _default_pool(ordinal):
    """The default memory pool of a device through the driver (the pool PyTorch's cudaMallocAsync
    backend allocates from), or (None, why)."""
    try:
        import ctypes

        lib = _driver()
        dev = ctypes.c_int()
        pool = ctypes.c_void_p()
        rc = lib.cuDeviceGet(ctypes.byref(dev), ordinal)
        if rc == 0:
            rc = lib.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev.value)
        if rc != 0:
            return None, "CUDA driver error %d" % rc
        return (lib, pool), None
    except Exception as e:
        return None, "%s: %s" % (type(e).__name__, e)


def _pool_attrs(pool):
    import ctypes

    lib, p = pool
    out = {}
    for k, attr in _POOL_ATTRS.items():
        v = ctypes.c_uint64()
        if lib.cuMemPoolGetAttribute(p, attr, ctypes.byref(v)) != 0:
            return None
        out[k] = int(v.value)
    return out


def _pool_reset(pool):
    """High-water marks back to the current values (setting them to 0 does that)."""
    import ctypes

    lib, p = pool
    for attr in (_POOL_ATTRS["reserved_high"], _POOL_ATTRS["used_high"]):
        zero = ctypes.c_uint64(0)
        lib.cuMemPoolSetAttribute(p, attr, ctypes.byref(zero))


def build_model(transformers, family, cfg_kwargs, attn):
    """The model for `family` from its config, with random weights drawn on the CPU from the
    current seed (the same numbers in every process). Returns (model, config, vocab)."""
    if family == "resnet":
        cfg = transformers.ResNetConfig(**cfg_kwargs)
        return transformers.ResNetForImageClassification(cfg), cfg, None
    common = dict(attn_implementation=attn)
    if family == "llama":
        cfg = transformers.LlamaConfig(**cfg_kwargs, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0,
                                       bos_token_id=1, eos_token_id=2, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(**cfg_kwargs, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2, **common)
        model = transformers.MixtralForCausalLM(cfg)
    elif family == "bert":
        cfg = transformers.BertConfig(**cfg_kwargs, pad_token_id=0, **common)
        model = transformers.BertForMaskedLM(cfg)
    elif family == "gpt2":
        cfg = transformers.GPT2Config(**cfg_kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=0, **common)
        model = transformers.GPT2LMHeadModel(cfg)
    elif family == "t5":
        cfg = transformers.T5Config(**cfg_kwargs, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **common)
        model = transformers.T5ForConditionalGeneration(cfg)
    else:
        raise ValueError("unknown family " + family)
    return model, cfg, cfg.vocab_size


def make_batch(torch, family, shape, vocab, num_labels, g):
    """One training batch on the CPU, drawn from generator g."""
    if family == "resnet":
        b, side = shape
        return {"pixel_values": torch.randn(b, 3, side, side, generator=g),
                "labels": torch.randint(0, num_labels, (b,), generator=g)}
    if family == "t5":
        b, src, tgt = shape
        ids = torch.randint(5, vocab, (b, src), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.randint(5, vocab, (b, tgt), generator=g)}
    b, s = shape
    ids = torch.randint(5, vocab, (b, s), generator=g)
    if family != "bert":
        return {"input_ids": ids, "labels": ids}
    masked = torch.rand(b, s, generator=g) < 0.15
    masked[:, 0] = True  # every row has a target: the loss is never a mean over nothing
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    mask_id = 103 if vocab > 103 else 4
    inputs = torch.where(masked, torch.full_like(ids, mask_id), ids)
    return {"input_ids": inputs, "attention_mask": torch.ones_like(ids), "labels": labels}


def worker(a):
    """One (model, allocator) run; writes its result as JSON to a.result. Exit 0, 1 or 77."""
    t0 = time.perf_counter()
    res = {"model": a.model, "allocator": a.allocator, "mode": a.mode, "status": "error", "notes": []}

    def save():
        res["worker_s"] = time.perf_counter() - t0
        with open(a.result, "w") as f:
            json.dump(res, f)

    if a.cpus:  # before torch starts its threads: they inherit the mask
        os.sched_setaffinity(0, parse_cpus(a.cpus))
        res["cpus"] = sorted(os.sched_getaffinity(0))
    if os.environ.get("REAL_MODELS_FAKE"):
        return fake_worker(a, res, save)
    try:
        import torch
        import transformers
    except Exception as e:
        res.update(status="skipped", reason="torch/transformers not importable (%s)" % e, exit77=True)
        save()
        return 77
    if not torch.cuda.is_available():
        res.update(status="skipped", reason="no CUDA device", exit77=True)
        save()
        return 77
    try:
        return run_workload(a, res, save, torch, transformers, t0)
    except Exception as e:
        res["error"] = "%s: %s" % (type(e).__name__, e)
        res["traceback"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
        save()
        return 1


def run_workload(a, res, save, torch, transformers, t0):
    import gc
    import warnings

    spec = MODELS[a.model][a.mode]
    family = MODELS[a.model]["family"]
    vt = None
    if a.allocator == "vmmalloc":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import vmmalloc.torch as vt

        res["vmm_library"] = vt.enable()  # before the first CUDA allocation
        res["vmm_mode"] = vt.mode()  # "extension" or "pluggable"
        res["vmm_env"] = {k: v for k, v in os.environ.items() if k.startswith("VMMALLOC_")}
    if not a.nondeterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if hasattr(torch, "utils") and hasattr(torch.utils, "deterministic"):
            # Deterministic mode would also fill every new tensor with NaN: a kernel per
            # allocation that changes no result here, only the timings.
            torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = bool(MODELS[a.model].get("cudnn_benchmark"))
    if torch.backends.cudnn.benchmark:
        torch.backends.cudnn.deterministic = False  # its search picks among every algorithm
    channels_last = bool(MODELS[a.model].get("channels_last"))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)  # the context and the allocator's first block
    torch.cuda.synchronize()
    res["import_s"] = time.perf_counter() - t0
    res.update(torch=torch.__version__, transformers=transformers.__version__,
               device=torch.cuda.get_device_name(dev), cuda=torch.version.cuda,
               alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
               allocator_backend=_safe(lambda: torch.cuda.memory.get_allocator_backend()))
    if a.allocator == "vmmalloc":
        res["vmm_config"] = vt.config(0)
    free0, total = torch.cuda.mem_get_info(dev)
    start_used = total - free0
    res["device_total"] = total
    dev_max = [0]
    probe = Probe(torch, a.allocator, dev, vt)
    peaks = {"held": 0, "allocated": 0}
    phase_peaks = {}
    track = {"peak_at": None, "vmm_at_peak": None, "vmm_best": -1}

    def sample(phase, label):
        m = probe.read()
        free, _ = torch.cuda.mem_get_info(dev)
        dev_max[0] = max(dev_max[0], total - free - start_used)
        pp = phase_peaks.setdefault(phase, {"held": 0, "allocated": 0})
        for k in ("held", "allocated"):
            v = m.get(k)
            if v is not None:
                pp[k] = max(pp[k], v)
                if k == "held" and v > peaks["held"]:
                    track["peak_at"] = label
                peaks[k] = max(peaks[k], v)
        if m.get("vmm") and m["vmm"].get("peak_physical", 0) > track["vmm_best"]:
            s = m["vmm"]
            track["vmm_best"] = s["peak_physical"]
            track["vmm_at_peak"] = dict({k: s.get(k) for k in VMM_AT_PEAK}, at=label)
        if m.get("pool"):
            res["pool_last"] = m["pool"]
        return m

    baton = Baton(a.baton)
    # ---- init: the model on the GPU (weights drawn on the CPU: the same in every process)
    baton.take()
    probe.reset()
    torch.manual_seed(SEED)
    ti = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # each warning once per place: a step loop would repeat them
        model, cfg, vocab = build_model(transformers, family, spec["config"], a.attn)
        if family == "mixtral" and hasattr(model, "set_experts_implementation"):
            try:
                model.set_experts_implementation(a.moe_experts)
                res["experts_implementation"] = a.moe_experts
            except Exception as e:  # an older or newer API: keep its default, say so
                res["notes"].append("set_experts_implementation(%r) failed: %s" % (a.moe_experts, e))
        res["parameters"] = sum(p.numel() for p in model.parameters())
        res["attn_implementation"] = str(getattr(cfg, "_attn_implementation", a.attn))
        model.to(dev)
        if channels_last:
            model.to(memory_format=torch.channels_last)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
        torch.cuda.synchronize()
        res["init_s"] = time.perf_counter() - ti
        sample("init", "init")
        if a.alloc_probe:
            launch_probe(torch, res, dev, "start")
        baton.give()

        # ---- train
        probe.reset()
        g = torch.Generator().manual_seed(SEED + 1)
        num_labels = getattr(cfg, "num_labels", 2)
        steps, losses = [], []
        tt, w0 = time.perf_counter(), baton.waited
        # vmmalloc's driver and fence time in each step, read outside the timed region.
        def vmm_driver_ns():
            s = vt.stats(0) or {}
            return s.get("driver_ns", 0) + s.get("fence_ns", 0)
        driver_ns = vmm_driver_ns if vt else None
        for i, shape in enumerate(spec["train"]):
            baton.take()
            n0 = alloc_count(torch, vt)
            batch = {k: v.to(dev) for k, v in make_batch(torch, family, shape, vocab, num_labels, g).items()}
            if channels_last:
                batch["pixel_values"] = batch["pixel_values"].contiguous(memory_format=torch.channels_last)
            d0 = driver_ns() if driver_ns else None
            s0 = time.perf_counter()
            out = train_step(torch, model, opt, batch)
            lv = float(out.loss.item())  # waits for the step
            secs = time.perf_counter() - s0
            del out, batch
            losses.append(lv)
            steps.append({"shape": list(shape), "loss": lv, "seconds": secs})
            if driver_ns:
                steps[-1]["vmm_driver_s"] = (driver_ns() - d0) / 1e9
            if n0 is not None:
                steps[-1]["allocations"] = alloc_count(torch, vt) - n0
            sample("train", step_label("train", i, shape))
            baton.give()
        res["train_s"] = time.perf_counter() - tt - (baton.waited - w0)
        res["steps"], res["losses"] = steps, losses
        if a.profile_step is not None:
            baton.take()
            profile_step(torch, a, res, spec, family, model, opt, vocab, num_labels, dev)
            sample("train", "profiled step")  # a peak it reaches is its own, not generate()'s
            baton.give()
        res["median_step_s"] = statistics.median(s["seconds"] for s in steps) if steps else None
        if steps and all("allocations" in s for s in steps):
            res["median_step_allocations"] = statistics.median(s["allocations"] for s in steps)
        if driver_ns and steps:
            res["median_step_driver_s"] = statistics.median(s["vmm_driver_s"] for s in steps)
            res["median_step_without_driver_s"] = statistics.median(s["seconds"] - s["vmm_driver_s"] for s in steps)

        # ---- generate: greedy, fixed lengths (min_new_tokens), no padding
        del opt
        model.zero_grad(set_to_none=True)
        gc.collect()
        gens = []
        if spec["generate"]:
            probe.reset()
            model.eval()
            if getattr(model.config, "output_router_logits", False):
                model.config.output_router_logits = False  # the auxiliary loss is for training only
            # Pass 1 includes first-call costs (kernel selection, cuBLAS workspaces); later passes
            # repeat the same calls warm (one allocator's generate times moved by up to 46 % between
            # processes). generate_s is the last pass, generate_first_s the first; every pass must
            # make the same tokens.
            passes, pass_usage = [], []
            for npass in range(a.generate_passes):
                u0 = process_usage()
                tg, w0 = time.perf_counter(), baton.waited
                for i, ((b, p, n), ids) in enumerate(zip(spec["generate"], generate_inputs(torch, spec, vocab))):
                    baton.take()
                    ids = ids.to(dev)
                    d0 = driver_ns() if driver_ns else None
                    g0 = time.perf_counter()
                    out = greedy_generate(torch, model, ids, n)
                    torch.cuda.synchronize()
                    secs = time.perf_counter() - g0
                    # An encoder-decoder returns the decoder's start token and the new ones.
                    toks = (out[:, 1:] if model.config.is_encoder_decoder else out[:, p:]).cpu()
                    if tuple(toks.shape) != (b, n):
                        raise RuntimeError("generate call %d made %s tokens, not %s" % (i, tuple(toks.shape), (b, n)))
                    dsecs = (driver_ns() - d0) / 1e9 if driver_ns else None
                    if npass == 0:
                        gens.append({"shape": [b, p, n], "seconds": secs, "tokens_per_s": b * n / secs,
                                     "tokens": toks.tolist()})
                        if dsecs is not None:
                            gens[i]["vmm_driver_s"] = dsecs
                    else:
                        gens[i].setdefault("later_seconds", []).append(secs)
                        if dsecs is not None:
                            gens[i].setdefault("later_vmm_driver_s", []).append(dsecs)
                        if toks.tolist() != gens[i]["tokens"]:
                            raise RuntimeError("generate call %d: pass %d made other tokens than pass 1" % (i, npass + 1))
                    del out, ids
                    sample("generate", step_label("generate", i, (b, p, n)))
                    baton.give()
                passes.append(time.perf_counter() - tg - (baton.waited - w0))
                pass_usage.append(usage_delta(u0, process_usage()))
            if a.profile_generate is not None:
                baton.take()
                profile_generate(torch, a, res, spec, model, vocab, dev)
                baton.give()
            res["generate_passes_s"] = passes
            res["generate_passes_usage"] = pass_usage
            res["generate_first_s"] = passes[0]
            res["generate_s"] = passes[-1]
        res["generate"] = gens
        if a.alloc_probe:
            baton.take()
            alloc_probe(torch, res, dev)
            launch_probe(torch, res, dev, "end")
            baton.give()
    res["determinism_warnings"] = sorted({str(w.message).split("\n")[0][:200] for w in caught
                                          if "determinis" in str(w.message)})

    free, _ = torch.cuda.mem_get_info(dev)
    if baton.fds is None:  # under --lockstep the other process shares the device
        res["device_used"] = {"start": start_used, "max_above_start": dev_max[0],
                              "end_above_start": total - free - start_used}
    else:
        res["lockstep"] = {"turns": baton.turns, "waited_s": baton.waited}
    res["held_peak"], res["alloc_peak"] = peaks["held"] or None, peaks["allocated"] or None
    if not peaks["held"]:
        res["held_error"] = probe.pool_error or "the allocator reported no held bytes"
    res["held_source"], res["alloc_source"] = HELD_SOURCE[a.allocator], ALLOC_SOURCE[a.allocator]
    res["phase_peaks"] = phase_peaks
    res["peak_at"] = track["peak_at"]
    if vt is not None:
        res["vmm_at_peak"] = track["vmm_at_peak"]
        res["vmm_stats_end"] = vt.stats(0)
        res["vmm_check"] = vt.check(0)
        if os.environ.get("VMMALLOC_TRACE"):
            vt.flush_trace()
    if a.allocator == "async" and probe.pool is None:
        res["notes"].append("default pool not readable through the driver: %s" % probe.pool_error)
    res["status"] = "ok"
    save()
    print("RESULT %s / %s: held %s GiB, allocated %s GiB, train %.2f s, generate %.2f s" % (
        a.model, a.allocator, gib(res["held_peak"]), gib(res["alloc_peak"]), res["train_s"],
        res.get("generate_s", 0.0)), flush=True)
    # --lockstep: the last turn is kept to the end, so the process's CUDA teardown (unmapping and
    # freeing all it held) runs in no turn of the other's.
    baton.take()
    return 0


def alloc_count(torch, vt):
    """Allocation requests so far: vmmalloc's stats, PyTorch's allocator's memory_stats(); None
    where neither counts them (cudaMallocAsync)."""
    if vt is not None:
        return (vt.stats(0) or {}).get("allocs")
    return torch.cuda.memory_stats().get("allocation.all.allocated")


PROBE_SIZES = (512, 64 << 10, 1 << 20, 16 << 20)


def alloc_probe(torch, res, dev, pairs=20000, repeats=5):
    """--alloc-probe: what one allocation costs the CPU through PyTorch in this process, after its
    training and generate() (the heap as the model left it): torch.empty + del of one size, and a
    churn of mixed sizes that frees the oldest of 32 live tensors. Best of `repeats`, ns per
    allocate + free pair, Python's loop included (the same in every process)."""
    def timed(body):
        return min(timed_runs(body, pairs, repeats))

    def fixed(n):
        def body(k):
            for _ in range(k):
                t = torch.empty(n, dtype=torch.uint8, device=dev)
                del t
        return body

    # Sizes from 256 B to 32 MiB, log-uniform, from a fixed seed: the same sequence in every process.
    rng = random.Random(SEED)
    mix = [int(256 * 2 ** rng.uniform(0, 17)) for _ in range(4096)]

    def churn(k):
        live = [torch.empty(mix[i], dtype=torch.uint8, device=dev) for i in range(32)]
        for i in range(k):
            live[i % 32] = torch.empty(mix[i % len(mix)], dtype=torch.uint8, device=dev)
        del live

    try:
        torch.cuda.synchronize()
        out = {str(n): timed(fixed(n)) for n in PROBE_SIZES}
        out["churn"] = timed(churn)
        torch.cuda.synchronize()
        res["alloc_probe_ns"] = out
    except Exception as e:
        note_failure(res, "--alloc-probe", e)


def timed_runs(body, n, repeats, sync=lambda: None):
    """body(n // 10) once to warm (caches filled, memory mapped), then `repeats` timed body(n): ns
    per unit of each, sync() ending the warm-up and each timed run."""
    body(n // 10)
    sync()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        body(n)
        sync()
        runs.append((time.perf_counter_ns() - t0) / n)
    return runs


def launch_probe(torch, res, dev, when, launches=20000, repeats=5):
    """--alloc-probe: what one kernel launch costs the CPU in this process, at the start (after the
    model's init) and the end (after generate()): an in-place add on a tensor made beforehand (no
    allocation: a difference between the allocators' processes here is the process's or the
    machine's), and an out-of-place add (one launch, one allocation and one free, as most
    operations make them). Best of `repeats` (every repeat kept), ns per launch, the stream
    synchronized after each repeat, Python's loop included."""
    try:
        x = torch.zeros(1024, device=dev)

        def inplace(k):
            for _ in range(k):
                x.add_(1)

        def outofplace(k):
            y = x
            for _ in range(k):
                y = x + 1
            del y

        for key, body in (("launch_probe_ns", inplace), ("launch_alloc_probe_ns", outofplace)):
            runs = timed_runs(body, launches, repeats, torch.cuda.synchronize)
            res.setdefault(key, {})[when] = min(runs)
            res.setdefault(key.replace("_ns", "_runs_ns"), {})[when] = runs
        del x
    except Exception as e:
        note_failure(res, "--alloc-probe launches", e)


def process_usage():
    """This process's CPU time (user, system), context switches (voluntary: it waited, e.g. on the
    GPU; involuntary: the kernel gave its CPU to another thread) and minor page faults so far."""
    import resource
    u = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": u.ru_utime, "sys_s": u.ru_stime, "voluntary": u.ru_nvcsw, "involuntary": u.ru_nivcsw,
            "minor_faults": u.ru_minflt}


def usage_delta(a, b):
    return {k: b[k] - a[k] for k in a}


def note_failure(res, what, e):
    """A measurement that failed leaves a note (its exception's first line) and the run goes on."""
    res["notes"].append("%s: %s: %s" % (what, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else ""))


def train_step(torch, model, opt, batch):
    """One training step: forward in bf16 autocast, backward, AdamW. Returns the model's output:
    its loss and logits stay alive until the caller drops it."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(**batch)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out


def profile_step(torch, a, res, spec, family, model, opt, vocab, num_labels, dev):
    """--profile-step N: one more training step of shape N after the timed ones (not in steps,
    losses or the medians), under torch.profiler: where its time went on the GPU (kernels) and on
    the CPU. A profiler that fails leaves a note; the run goes on."""
    shapes = spec["train"]
    if not 0 <= a.profile_step < len(shapes):
        res["notes"].append("--profile-step %d: this model has steps 0-%d" % (a.profile_step, len(shapes) - 1))
        return
    shape = shapes[a.profile_step]
    try:
        from torch.profiler import ProfilerActivity, profile
        g = torch.Generator().manual_seed(SEED + 3)
        batch = {k: v.to(dev) for k, v in make_batch(torch, family, shape, vocab, num_labels, g).items()}
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            s0 = time.perf_counter()
            out = train_step(torch, model, opt, batch)
            torch.cuda.synchronize()
            secs = time.perf_counter() - s0
        del out, batch
        res["profile"] = dict(profile_summary(prof.key_averages()), step=a.profile_step, shape=list(shape),
                              seconds=secs)
    except Exception as e:
        note_failure(res, "--profile-step", e)


def generate_inputs(torch, spec, vocab):
    """The input ids of the model's generate() calls, on the CPU: the same in every pass and run."""
    g = torch.Generator().manual_seed(SEED + 2)
    for b, p, _ in spec["generate"]:
        yield torch.randint(5, vocab, (b, p), generator=g)


def greedy_generate(torch, model, ids, n):
    """One greedy generate() call of exactly n new tokens, in bf16 autocast."""
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0)


def profile_generate(torch, a, res, spec, model, vocab, dev):
    """--profile-generate N: generate() call N once more after the timed passes (not in their
    times), under torch.profiler: how long the GPU ran kernels (their intervals' union) against
    the call's wall time, and where the CPU's time went. A profiler that fails leaves a note."""
    calls = spec["generate"]
    if not 0 <= a.profile_generate < len(calls):
        res["notes"].append("--profile-generate %d: this model has generate() calls 0-%d" % (
            a.profile_generate, len(calls) - 1))
        return
    b, p, n = calls[a.profile_generate]
    try:
        from torch.profiler import ProfilerActivity, profile
        ids = list(generate_inputs(torch, spec, vocab))[a.profile_generate].to(dev)  # as in the timed passes
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            g0 = time.perf_counter()
            out = greedy_generate(torch, model, ids, n)
            torch.cuda.synchronize()
            secs = time.perf_counter() - g0
        del out, ids
        kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                         if str(getattr(e, "device_type", "")).endswith("CUDA"))
        busy, end = 0.0, float("-inf")
        for st, en in kernels:  # the union of the intervals (us): concurrent kernels count once
            if en > end:
                busy += en - max(st, end)
                end = en
        res["profile_generate"] = dict(profile_summary(prof.key_averages()), call=a.profile_generate,
                                       shape=[b, p, n], seconds=secs, gpu_busy_ms=busy / 1e3, kernels=len(kernels))
    except Exception as e:
        note_failure(res, "--profile-generate", e)


def profile_summary(events, top=6):
    """Sums and the top entries of torch.profiler's key_averages(): self times in ms."""
    def gpu(e):  # self_device_time_total since torch 2.4, self_cuda_time_total before
        v = getattr(e, "self_device_time_total", None)
        return (v if v is not None else getattr(e, "self_cuda_time_total", 0)) / 1e3
    cpu = lambda e: e.self_cpu_time_total / 1e3
    ev = list(events)
    return {"gpu_self_ms": sum(gpu(e) for e in ev), "cpu_self_ms": sum(cpu(e) for e in ev),
            "top_gpu": [[e.key, gpu(e), e.count] for e in sorted(ev, key=gpu, reverse=True)[:top]],
            "top_cpu": [[e.key, cpu(e), e.count] for e in sorted(ev, key=cpu, reverse=True)[:top]]}


def _safe(f):
    try:
        return f()
    except Exception as e:
        return "unknown (%s)" % type(e).__name__


def fake_worker(a, res, save):
    """A stand-in for tests without torch (REAL_MODELS_FAKE = a JSON object): numbers derived from
    the names; "fail", "hang", "loss" (model/allocator -> added loss) and "flip" (tokens) inject
    what the driver must report."""
    spec = json.loads(os.environ["REAL_MODELS_FAKE"])
    key = "%s/%s" % (a.model, a.allocator)
    if key in spec.get("hang", []):
        time.sleep(3600)
    if key in spec.get("fail", []):
        res["error"] = "RuntimeError: injected failure"
        save()
        return 1
    if spec.get("skip77"):
        res.update(status="skipped", reason="no CUDA device", exit77=True)
        save()
        return 77
    w = MODELS[a.model][a.mode]
    base = (1 + ALLOCATORS.index(a.allocator)) * (1 << 30)
    res.update(status="ok", parameters=1000000, torch="fake", transformers="fake", device="fake device",
               held_peak=base + (1 << 29), alloc_peak=base, peak_at=step_label("train", 0, w["train"][0]),
               median_step_s=0.01, train_s=0.1, init_s=0.01, import_s=0.01,
               phase_peaks={"init": {"held": 1 << 20, "allocated": 1 << 20}, "train": {"held": base, "allocated": base}},
               device_used={"start": 0, "max_above_start": base + (1 << 29), "end_above_start": base})
    res["losses"] = [10.0 - i * 0.1 + spec.get("loss", {}).get(key, 0.0) for i in range(len(w["train"]))]
    toks = [[[7] * n for _ in range(b)] for b, _, n in w["generate"]]
    if key in spec.get("flip", []) and toks:
        toks[0][0][-1] = 8
    res["generate"] = [{"shape": [b, p, n], "seconds": 0.01, "tokens": t} for (b, p, n), t in zip(w["generate"], toks)]
    res["generate_s"] = 0.01 * len(w["generate"])
    if a.profile_step is not None and 0 <= a.profile_step < len(w["train"]):
        res["profile"] = {"step": a.profile_step, "shape": list(w["train"][a.profile_step]), "seconds": 0.02,
                          "gpu_self_ms": 12.5, "cpu_self_ms": 7.25, "top_gpu": [["gemm", 6.0, 4]],
                          "top_cpu": [["aten::mm", 2.0, 4]]}
    if a.profile_generate is not None and 0 <= a.profile_generate < len(w["generate"]):
        res["profile_generate"] = {"call": a.profile_generate, "shape": list(w["generate"][a.profile_generate]),
                                   "seconds": 0.5, "gpu_busy_ms": 125.0, "kernels": 4000, "gpu_self_ms": 130.0,
                                   "cpu_self_ms": 400.0, "top_gpu": [["gemm", 60.0, 400]],
                                   "top_cpu": [["aten::mm", 90.0, 400]]}
    if a.alloc_probe:
        res["alloc_probe_ns"] = {str(n): 1000.0 + 10 * ALLOCATORS.index(a.allocator) for n in PROBE_SIZES}
        res["alloc_probe_ns"]["churn"] = 1500.0
        res["median_step_allocations"] = 1234
        res["launch_probe_ns"] = {"start": 4000.0, "end": 4100.0 + ALLOCATORS.index(a.allocator)}
        res["launch_alloc_probe_ns"] = {"start": 5000.0, "end": 5200.0 + ALLOCATORS.index(a.allocator)}
    if a.generate_passes > 1 and w["generate"]:
        res["generate_first_s"] = 0.02 * len(w["generate"])
        res["generate_passes_s"] = [res["generate_first_s"]] + [res["generate_s"]] * (a.generate_passes - 1)
        res["generate_passes_usage"] = [{"user_s": 0.5 * t, "sys_s": 0.1 * t, "voluntary": 30, "involuntary": 7,
                                         "minor_faults": 1000} for t in res["generate_passes_s"]]
    if a.baton:  # the real worker's turns: init, each step, each generate() call, the probes
        baton, spans = Baton(a.baton), []
        for _ in range(1 + len(w["train"]) + len(w["generate"]) * a.generate_passes + bool(a.alloc_probe)):
            baton.take()
            spans.append([time.monotonic()])
            time.sleep(0.01)
            spans[-1].append(time.monotonic())
            baton.give()
        res["lockstep"] = {"turns": baton.turns, "waited_s": baton.waited}
        res["turn_spans"] = spans
        del res["device_used"]
    if a.allocator == "vmmalloc":
        res["vmm_at_peak"] = {"at": "train 0 (1x1)", "peak_physical": base, "requested": base, "mapped": base}
        res["vmm_stats_end"] = {"malloc_failures": 0, "free_failures": 0}
        res["vmm_check"] = ""
        res["vmm_env"] = {k: v for k, v in os.environ.items() if k.startswith("VMMALLOC_")}
        if os.environ.get("VMMALLOC_TRACE"):
            with open(os.environ["VMMALLOC_TRACE"], "w") as f:
                f.write("# vmmalloc-trace v2 fake\na 10 100 0 1 0\nf 10 100 0 1 5\n")
    save()
    if a.baton:
        baton.take()  # kept to the exit, as the real worker's last turn
    return 0


# ---- the driver ---------------------------------------------------------------------------------

def child_env(allocator, a, trace_path=None):
    env = dict(os.environ)
    # PYTORCH_ALLOC_CONF is the newer name of the same setting: neither may leak into another run.
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(k, None)
    if ALLOC_CONF[allocator]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF[allocator]
    if allocator == "vmmalloc":
        env.update(a.vmm_env)
        if trace_path:
            env["VMMALLOC_TRACE"] = trace_path
    else:
        env.pop("VMMALLOC_TRACE", None)
    if not a.nondeterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before cuBLAS starts: deterministic GEMMs
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def start_one(a, model, allocator, logdir, trace_path=None, rnd=1, baton=None):
    """Starts one worker process; returns what finish_one needs. baton: the worker's (IN, OUT) pipe
    ends of --lockstep's turns."""
    tag = "%s-%s" % (model, allocator) + ("" if rnd == 1 else "-r%d" % rnd)
    w = {"model": model, "allocator": allocator, "result": os.path.join(logdir, tag + ".json"),
         "log_path": os.path.join(logdir, tag + ".log")}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--allocator", allocator,
           "--mode", a.mode, "--result", w["result"], "--attn", a.attn, "--moe-experts", a.moe_experts,
           "--generate-passes", str(a.generate_passes)]
    if a.profile_step is not None:
        cmd += ["--profile-step", str(a.profile_step)]
    if a.profile_generate is not None:
        cmd += ["--profile-generate", str(a.profile_generate)]
    if a.alloc_probe:
        cmd.append("--alloc-probe")
    if a.cpus:
        cmd += ["--cpus", a.cpus]
    if a.nondeterministic:
        cmd.append("--nondeterministic")
    if baton:
        cmd += ["--baton", "%d,%d" % baton]
    w["t0"] = time.perf_counter()
    with open(w["log_path"], "w") as log:
        w["p"] = subprocess.Popen(cmd, env=child_env(allocator, a, trace_path), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, pass_fds=baton or ())
    return w


def stop_one(w):
    """Kills a worker and anything it started."""
    try:
        os.killpg(w["p"].pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finish_one(a, w, timeout, timed_out=None):
    """Waits for a started worker (killing it past timeout); returns its result dict with wall_s,
    exit_code, status. timed_out: the caller already stopped it for running too long."""
    p = w["p"]
    if timed_out is None:
        timed_out = False
        try:
            p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_one(w)
    rc = p.wait()
    wall = time.perf_counter() - w["t0"]
    res = {"model": w["model"], "allocator": w["allocator"], "status": "error"}
    if os.path.exists(w["result"]):
        try:
            with open(w["result"]) as f:
                res = json.load(f)
        except ValueError as e:
            res["error"] = "unreadable result: %s" % e
    res["wall_s"], res["exit_code"] = wall, rc
    with open(w["log_path"], errors="replace") as f:
        tail = f.read()[-3000:]
    if a.verbose:
        print(tail, flush=True)
    if timed_out:
        res.update(status="timeout", error="killed after %.0f s (the run's time limit)" % timeout)
    elif rc == 77 and res.get("exit77"):
        res["status"] = "skipped"
    elif rc != 0 and res.get("status") == "ok":
        res.update(status="error", error="exit %d after reporting success" % rc)
    elif rc != 0 and not res.get("error"):
        res["error"] = "exit %d without a result (killed? see the log tail)" % rc
    if res.get("status") not in ("ok", "skipped"):
        res["log_tail"] = tail
    return res


def run_one(a, model, allocator, timeout, logdir, trace_path=None, rnd=1):
    """Runs one worker process; returns its result dict with wall_s, exit_code, status."""
    return finish_one(a, start_one(a, model, allocator, logdir, trace_path, rnd), timeout)


def pass_turns(ready, go, deadline):
    """--lockstep's driver side: ready[i] / go[i] are the pipes from and to worker i. Turn k goes
    to the workers in the order 0 1 on even k, 1 0 on odd k, each after it says it is ready, and the
    next only after it says done; a worker whose pipe closed (it exited) is passed over. Returns
    False past the deadline (the caller stops both)."""
    live = [True] * len(ready)

    def read(i):
        left = deadline - time.perf_counter()
        if left <= 0 or not select.select([ready[i]], [], [], left)[0]:
            return None
        return os.read(ready[i], 1)

    k = 0
    while any(live):
        for i in (range(len(ready)) if k % 2 == 0 else reversed(range(len(ready)))):
            if not live[i]:
                continue
            m = read(i)
            if m == b"r":
                try:
                    os.write(go[i], b"g")
                except BrokenPipeError:
                    m = b""
                else:
                    m = read(i)
            if m is None:
                return False
            if m != b"d":  # closed: the worker exited (or broke the protocol, which ends its turns)
                live[i] = False
        k += 1
    return True


def run_pair(a, model, allocators, timeout, logdir, rnd):
    """--lockstep: both allocators' workers at once, taking turns (pass_turns); their results in
    the order given."""
    workers, mine = [], []
    for alloc in allocators:
        turn_r, turn_w = os.pipe()  # driver -> worker: the turn
        msg_r, msg_w = os.pipe()  # worker -> driver: ready, done
        workers.append(start_one(a, model, alloc, logdir, None, rnd, baton=(turn_r, msg_w)))
        os.close(turn_r)
        os.close(msg_w)
        mine.append((msg_r, turn_w))
    ok = pass_turns([r for r, _ in mine], [g for _, g in mine], time.perf_counter() + timeout)
    if not ok:
        for w in workers:
            stop_one(w)
    for r, g in mine:
        os.close(r)
        os.close(g)
    left = max(1.0, timeout - (time.perf_counter() - workers[0]["t0"]))
    res = [finish_one(a, w, left, None if ok else True) for w in workers]
    for r in res:
        if r.get("status") == "timeout":
            r["error"] = ("killed after %.0f s, the pair's time limit (under --lockstep each process waits "
                          "for the other's turns)" % timeout)
    return res


def find_replay(a):
    if a.replay_bin:
        return a.replay_bin if os.access(a.replay_bin, os.X_OK) else None
    found = sorted(glob.glob(os.path.join(REPO, "build*", "tools", "replay", "vmm-replay")), key=os.path.getmtime,
                   reverse=True)
    return found[0] if found else None


def replay_trace(a, run, trace_gz, budget_left, runs):
    """vmm-replay of the recorded trace on the GPU: vmmalloc's and cudaMallocAsync's peaks beside
    the real processes'. Returns the "trace" section of the result."""
    out = {"path": trace_gz, "rows": []}
    binp = find_replay(a)
    if not binp:
        out["status"] = "recorded; vmm-replay not found (build it, or --replay-bin): not replayed"
        return out
    if budget_left < 30:
        out["status"] = "recorded; not replayed (time budget spent)"
        return out
    js = trace_gz.replace(".trace.gz", ".replay.json")
    cmd = [binp, trace_gz, "--backend", "cuda", "--allocators", "vmmalloc,cudaMallocAsync,null", "--json", js]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=min(180, budget_left - 10), errors="replace")
        rc, text = p.returncode, p.stdout
    except subprocess.TimeoutExpired:
        out["status"] = "recorded; vmm-replay timed out"
        return out
    out["replay_s"] = time.perf_counter() - t0
    out["command"] = " ".join(cmd)
    if rc != 0 or not os.path.exists(js):
        out["status"] = "recorded; vmm-replay exited %d" % rc
        out["replay_output_tail"] = text[-2000:]
        return out
    with open(js) as f:
        rows = json.load(f)
    out["status"] = "replayed in %.0f s" % out["replay_s"]
    real = {r["allocator"]: r for r in runs if r["model"] == run["model"] and r.get("round", 1) == 1 and r.get("status") == "ok"}
    for r in rows:
        name = r.get("name")
        if name == "null":
            continue
        peak = r.get("peak_mapped_bytes")
        live = r.get("peak_live_bytes")
        ref = real.get("vmmalloc" if name == "vmmalloc" else "async" if name == "cudaMallocAsync" else "")
        line = "replay %s: peak held %s GiB (trace's peak live %s GiB), %.1f ns/event" % (
            name, gib(peak), gib(live), r.get("ns_per_op") or 0.0)
        if ref and ref.get("held_peak") and peak:
            line += "; the real process held %s GiB (replay / real %.3f)" % (gib(ref["held_peak"]), peak / ref["held_peak"])
        out["rows"].append(line)
        out.setdefault("replay", []).append({k: r.get(k) for k in ("name", "peak_mapped_bytes", "peak_live_bytes",
                                                                   "ns_per_op", "threads", "handoffs", "events")})
    return out


def commit_of():
    # tools/gpu-check's copy on the device machine may carry a stale .git; .deps/COMMIT is current.
    try:
        with open(os.path.join(REPO, ".deps", "COMMIT")) as f:
            c = f.readline().strip()
        if c:
            return c[:12]
    except OSError:
        pass
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def driver(a):
    os.makedirs(a.out, exist_ok=True)
    logdir = tempfile.mkdtemp(prefix="real-models-")
    trace_dir = None
    if a.trace:
        trace_dir = os.path.abspath(a.trace)
        os.makedirs(trace_dir, exist_ok=True)
    print("real_models: %s; models %s; allocators %s; budget %s; per-run limit %.0f s" % (
        a.mode, ",".join(a.models), ",".join(a.allocators), "%.0f s" % a.budget if a.budget else "none",
        a.run_timeout), flush=True)
    runs, slowest = [], {}
    skip77 = False
    traces = []  # one section a recorded model
    # Even rounds run the allocators in reverse order (A B, B A, A B ...): neither always runs
    # first, after a build or another model's process.
    order = lambda r: a.allocators if r % 2 == 1 else a.allocators[::-1]
    pending = None  # --lockstep: the second result of a pair run together
    for rnd, model, alloc in ((r, m, al) for r in range(1, a.rounds + 1) for m in a.models for al in order(r)):
        elapsed = time.perf_counter() - T_START
        # --lockstep: a pair's processes run at once, each about as long as both one after the other.
        est = slowest.get(model, MODELS[model][a.mode]["estimate_s"] * (2 if a.lockstep else 1))
        left = (a.budget - elapsed) if a.budget else None
        tpath = None
        if pending is not None:  # ran with the one before it
            r, pending = pending, None
        elif skip77:
            runs.append({"model": model, "allocator": alloc, "round": rnd, "status": "skipped",
                         "reason": "no torch/CUDA"})
            continue
        elif a.lockstep and alloc != order(rnd)[0]:
            runs.append({"model": model, "allocator": alloc, "round": rnd, "status": "skipped",
                         "reason": "--lockstep: the pair's first process was skipped"})
            continue
        elif left is not None and est > left:
            runs.append({"model": model, "allocator": alloc, "round": rnd, "status": "skipped",
                         "reason": "time budget (~%.0f s needed, %.0f s left)" % (est, max(0, left))})
            print("[%4.0fs] %-6s %-10s skipped: ~%.0f s does not fit the %.0f s left of the budget" % (
                elapsed, model, run_label(runs[-1]), est, max(0, left)), flush=True)
            continue
        elif a.lockstep:
            limit = min(2 * a.run_timeout, left if left is not None else 2 * a.run_timeout)
            r, pending = run_pair(a, model, order(rnd), limit, logdir, rnd)
        else:
            limit = a.run_timeout if left is None else min(a.run_timeout, left)
            if trace_dir and model in a.trace_models and alloc == "vmmalloc" and rnd == 1:
                tpath = os.path.join(trace_dir, "%s-vmmalloc.trace" % model)
            r = run_one(a, model, alloc, limit, logdir, tpath, rnd)
        r["round"] = rnd
        if r.get("status") == "skipped" and r.get("exit77"):
            skip77 = True
        if r.get("status") == "ok":
            slowest[model] = max(slowest.get(model, 0.0), r["wall_s"] * 1.1 + 3)
        runs.append(r)
        print("[%4.0fs] %-6s %-10s %s in %.1f s%s" % (
            time.perf_counter() - T_START, model, run_label(r), r.get("status"), r["wall_s"],
            "" if r.get("status") != "ok" else ": held %s GiB, allocated %s GiB, step median %.1f ms, "
            "train %.2f s, generate %.2f s (import %.1f s, init %.1f s)" % (
                gib(r.get("held_peak")), gib(r.get("alloc_peak")), (r.get("median_step_s") or 0) * 1e3,
                r.get("train_s") or 0, r.get("generate_s") or 0, r.get("import_s") or 0, r.get("init_s") or 0)),
            flush=True)
        if r.get("status") not in ("ok", "skipped"):
            print("       %s\n       log tail:\n%s" % (r.get("error"), "\n".join(
                "       | " + ln for ln in r.get("log_tail", "").splitlines()[-25:])), flush=True)
        if tpath and os.path.exists(tpath):
            gz = tpath + ".gz"
            with open(tpath, "rb") as src, gzip.open(gz, "wb", compresslevel=9) as dst:
                shutil.copyfileobj(src, dst)
            os.remove(tpath)
            left = (a.budget - (time.perf_counter() - T_START)) if a.budget else 600
            sec = {"model": model, "run_status": r.get("status"), "size_bytes": os.path.getsize(gz)}
            sec.update(replay_trace(a, r, gz, left, runs) if r.get("status") == "ok"
                       else {"path": gz, "status": "recorded by a run that failed", "rows": []})
            traces.append(sec)
        elif tpath:
            traces.append({"model": model, "path": tpath, "status": "no trace written (the run %s)" % r.get("status"),
                           "rows": []})
    if skip77 and not any(r.get("status") == "ok" for r in runs):
        print("real_models: skipped: %s" % next((r.get("reason") for r in runs if r.get("exit77")), "no CUDA"))
        shutil.rmtree(logdir, ignore_errors=True)
        return 77

    comparisons = compare_runs(runs, a.loss_rtol)
    failures, notes = judge(runs, comparisons)
    for sec in traces:
        if not str(sec.get("status", "")).startswith("replayed"):
            notes.append("trace of %s: %s" % (sec["model"], sec.get("status")))
        if sec.get("run_status") == "ok":
            notes.append("%s / vmmalloc recorded its trace (VMMALLOC_TRACE): its timings include the recording" %
                         sec["model"])
    ok = [r for r in runs if r.get("status") == "ok"]
    first = ok[0] if ok else {}
    for r in ok:
        if r["model"] == "llama" and a.mode == "full" and r.get("held_peak") and r["held_peak"] < 5 * GiB:
            notes.append("llama / %s: peak held %.2f GiB, below the 5 GiB the suite is sized for" % (
                r["allocator"], r["held_peak"] / GiB))
    meta = {"mode": a.mode, "models": a.models, "allocators": a.allocators, "device": first.get("device", "?"),
            "torch": first.get("torch", "?"), "transformers": first.get("transformers", "?"),
            "commit": commit_of(), "vmm_env": a.vmm_env, "budget_s": a.budget, "run_timeout_s": a.run_timeout,
            "loss_rtol": a.loss_rtol, "attn": a.attn, "moe_experts": a.moe_experts,
            "settings": "%s attention, %s, bf16 autocast, AdamW%s" % (
                a.attn, "nondeterministic" if a.nondeterministic else "deterministic algorithms",
                ", processes pinned to CPUs %s" % a.cpus if a.cpus else "") +
            (", each round's two processes at once, taking turns (--lockstep)" if a.lockstep else ""),
            "cpus": a.cpus, "lockstep": a.lockstep,
            "workloads": {m: MODELS[m][a.mode] for m in a.models}}
    total = time.perf_counter() - T_START
    result = {"meta": meta, "runs": runs, "comparisons": comparisons, "failures": failures, "notes": notes,
              "traces": traces, "seconds": total, "passed": not failures}
    md = markdown(result)
    print()
    print(md)
    with open(os.path.join(a.out, "real_models.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(a.out, "real_models.md"), "w") as f:
        f.write(md + "\n")
    if a.keep_logs:
        shutil.copytree(logdir, os.path.join(a.out, "real-models-logs"), dirs_exist_ok=True)
    shutil.rmtree(logdir, ignore_errors=True)
    print("written: %s/real_models.{md,json}" % a.out)
    print("real_models: %s (%.0f s)" % ("passed" if not failures else "FAILED", total))
    return 0 if not failures else 1


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny shapes: seconds a run, ~2 minutes in all")
    mode.add_argument("--full", action="store_true", help="the real sizes, under 8.5 minutes on one H100")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma list of %s (default %s)" % (",".join(MODELS), ",".join(DEFAULT_MODELS)))
    p.add_argument("--allocators", default=",".join(ALLOCATORS), help="comma list of %s" % ",".join(ALLOCATORS))
    p.add_argument("--env", action="append", default=[], metavar="KEY=VAL",
                   help="environment of the vmmalloc runs (repeatable), e.g. VMMALLOC_RELEASE_THRESHOLD=0")
    p.add_argument("--out", default=os.environ.get("VMM_OUT") or "real-models-out")
    p.add_argument("--trace", metavar="DIR", help="record the --trace-model runs under vmmalloc into DIR and replay them")
    p.add_argument("--trace-model", default="llama",
                   help="comma list of the models whose vmmalloc runs --trace records (default llama)")
    p.add_argument("--replay-bin", help="vmm-replay for --trace (default: the newest build*/tools/replay/vmm-replay)")
    p.add_argument("--budget", type=float, help="seconds for the whole suite; runs that would not fit are "
                                                "skipped (default 500 with --full, none with --quick)")
    p.add_argument("--run-timeout", type=float, help="seconds one run may take (default 180 --full, 120 --quick)")
    p.add_argument("--loss-rtol", type=float, default=1e-3, help="relative tolerance of training losses")
    p.add_argument("--attn", default="eager", choices=("eager", "sdpa"))
    p.add_argument("--moe-experts", default="eager", help="transformers' experts implementation of the moe model")
    p.add_argument("--profile-step", type=int, metavar="N", help="one more training step of shape N after the "
                   "timed ones, under torch.profiler: GPU kernel and CPU self times, and the top operations (its "
                   "optimizer step changes the weights generate() uses, in every run alike)")
    p.add_argument("--profile-generate", type=int, metavar="N", help="generate() call N once more after the "
                   "timed passes, under torch.profiler: the GPU's busy time (kernels) against the call's wall time, "
                   "and the top operations")
    p.add_argument("--alloc-probe", action="store_true", help="after generate(), time allocate + free pairs "
                   "through torch.empty in each process (512 B, 64 KiB, 1 MiB, 16 MiB, and a churn of mixed "
                   "sizes): the CPU cost of one allocation through PyTorch, wrapper included")
    p.add_argument("--cpus", metavar="LIST", help="pin every run's process to these CPUs (e.g. 0-7): one "
                   "allocator's step times moved by up to 32 %% between processes, mostly on the CPU side")
    p.add_argument("--rounds", type=int, default=1, help="run every model and allocator this many times, "
                   "round after round (even rounds in reverse allocator order); a table gives the medians and "
                   "each round's ratios to the first allocator")
    p.add_argument("--lockstep", action="store_true", help="with two allocators: run each round's two "
                   "processes at once, passing a turn between them for every step, generate() call and GPU "
                   "stretch (A B B A ...): a drift of the machine's speed falls on both (both must fit the "
                   "device together)")
    p.add_argument("--generate-passes", type=int, help="times the generate() calls run in one process; the "
                   "table shows the last pass and the first in brackets (default 2 --full, 1 --quick)")
    p.add_argument("--nondeterministic", action="store_true", help="leave PyTorch's deterministic settings off")
    p.add_argument("--keep-logs", action="store_true", help="copy every run's log into OUT/real-models-logs/")
    p.add_argument("--verbose", action="store_true", help="print each run's log tail")
    # The worker side (one run), started by the driver.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--allocator", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--baton", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        a.generate_passes = a.generate_passes or 1
        return a
    if not (a.quick or a.full):
        p.error("give --quick (tiny shapes) or --full (the real sizes)")
    a.mode = "full" if a.full else "quick"
    try:
        a.models = pick(a.models, tuple(MODELS), "models")
        a.allocators = pick(a.allocators, ALLOCATORS, "allocators")
        a.trace_models = pick(a.trace_model, tuple(MODELS), "trace-model")
        a.vmm_env = parse_env(a.env)
    except ValueError as e:
        p.error(str(e))
    if a.budget is None and a.full:
        a.budget = 500.0
    if a.run_timeout is None:
        a.run_timeout = 180.0 if a.full else 120.0
    if a.generate_passes is None:
        a.generate_passes = 2 if a.full else 1
    elif a.generate_passes < 1:
        p.error("--generate-passes must be at least 1")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    if a.lockstep and len(a.allocators) != 2:
        p.error("--lockstep runs two allocators' processes together: give --allocators A,B")
    if a.lockstep and a.trace:
        p.error("--lockstep and --trace: a recorded run's timings include the recording; run them apart")
    if a.cpus:
        try:
            cpus = parse_cpus(a.cpus)
        except ValueError as e:
            p.error(str(e))
        have = os.sched_getaffinity(0)
        if not set(cpus) <= have:
            p.error("--cpus %s: this process may run on CPUs %s only" % (a.cpus, ",".join(map(str, sorted(have)))))
    return a


def main(argv=None):
    a = parse(argv)
    if a.worker:
        return worker(a)
    return driver(a)


if __name__ == "__main__":
    sys.exit(main())
