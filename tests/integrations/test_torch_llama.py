#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A small Llama trained and sampled under PyTorch's allocator and under vmmalloc: same numbers.

Runs the same workload twice, each in a fresh process (an allocator can only be chosen before the
first CUDA allocation): a Llama built from transformers.LlamaConfig (hidden 512, 4 layers, 8 heads,
2 KV heads, vocabulary 8000, random weights from a fixed seed, nothing downloaded) trains a few
AdamW steps on fixed random token batches of varying length, then generates greedily with the KV
cache. Deterministic settings (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, no
TF32, eager attention): the allocator cannot change any number, so losses are compared for exact
equality (reported) and must agree within rtol 1e-5 (asserted); generated token ids must be equal.

Printed: a table of wall times and memory (vmmalloc's peak mapped bytes against PyTorch's
max_memory_reserved()); written as JSON to $VMM_OUT when set.

Exit 0: passed. 77: no torch, transformers or CUDA device. 1: a mismatch or an error.
Needs libvmmalloc_torch.so: $VMMALLOC_TORCH_LIB (set by ctest) or a build next to the sources.

    VMMALLOC_TORCH_LIB=build/src/integrations/libvmmalloc_torch.so python3 tests/integrations/test_torch_llama.py
"""

import json
import os
import subprocess
import sys
import time

from checks import SKIP, torch_or_skip  # tests/integrations/checks.py, beside this script

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(HERE, "..", "..", "tools", "python")

TRAIN_STEPS = 8
BATCH = 8
LENGTHS = [256, 96, 192, 128, 224, 64, 160, 256]  # varied shapes: the allocators see mixed sizes
PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 16, 32


def worker(mode):
    """One run; prints one JSON line prefixed RESULT."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before cuBLAS starts: deterministic GEMMs
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import warnings

    t_start = time.perf_counter()
    import torch

    res = {"mode": mode}
    if mode == "vmm":
        sys.path.insert(0, TOOLS)
        import vmmalloc_torch

        res["library"] = vmmalloc_torch.enable()  # before the first CUDA allocation
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    res["torch"], res["transformers"] = torch.__version__, transformers.__version__
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn: we record which ops warned
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    dev = torch.device("cuda", 0)
    res["device"] = torch.cuda.get_device_name(dev)

    cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    torch.manual_seed(1234)
    model = LlamaForCausalLM(cfg)  # weights drawn on the CPU: identical in both runs
    res["attn_implementation"] = getattr(model.config, "_attn_implementation", "?")
    res["parameters"] = sum(p.numel() for p in model.parameters())

    g = torch.Generator().manual_seed(99)
    batches = [torch.randint(3, cfg.vocab_size, (BATCH, n), generator=g) for n in LENGTHS[:TRAIN_STEPS]]
    prompt = torch.randint(3, cfg.vocab_size, (PROMPTS, PROMPT_LEN), generator=g)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        model.train()
        for ids in batches:
            ids = ids.to(dev)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.item())
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            gen = model.generate(input_ids=prompt.to(dev), attention_mask=torch.ones_like(prompt, device=dev),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 use_cache=True, pad_token_id=0)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    res["determinism_warnings"] = sorted({str(w.message).split("\n")[0][:160] for w in caught
                                          if "deterministic" in str(w.message)})
    res["losses"] = losses
    res["tokens"] = gen[:, PROMPT_LEN:].tolist()
    res["time_train_s"], res["time_generate_s"] = t1 - t0, t2 - t1
    res["time_workload_s"] = t2 - t0
    res["time_process_s"] = t2 - t_start
    free_b, total_b = torch.cuda.mem_get_info(dev)
    res["device_used_end"] = total_b - free_b  # whole device, context included: same meaning in both

    if mode == "vmm":
        import vmmalloc_torch

        s = vmmalloc_torch.stats(0)
        res["vmm"] = s
        res["vmm_config"] = vmmalloc_torch.config(0)
        res["vmm_check"] = vmmalloc_torch.check(0)
        res["peak_bytes"] = s["peak_mapped"]
    else:
        res["max_memory_reserved"] = torch.cuda.max_memory_reserved(dev)
        res["max_memory_allocated"] = torch.cuda.max_memory_allocated(dev)
        res["peak_bytes"] = res["max_memory_reserved"]
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def run(mode):
    env = dict(os.environ)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", mode], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    wall = time.perf_counter() - t0
    res = None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
    if p.returncode != 0 or res is None:
        print(p.stdout)
        print("test_torch_llama: the %s run failed (exit %d)" % (mode, p.returncode))
        sys.exit(1)
    res["wall_s"] = wall
    return res


def mib(n):
    return "%.1f" % (n / 2**20)


def main():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded, in this process or the runs
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    torch = torch_or_skip("test_torch_llama", also=("transformers",))
    if torch is None:
        return SKIP

    native = run("native")
    vmm = run("vmm")

    ok = True
    ln, lv = native["losses"], vmm["losses"]
    exact = ln == lv
    maxrel = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(ln, lv)) if ln else 0.0
    close = len(ln) == len(lv) == TRAIN_STEPS and all(
        abs(a - b) <= 1e-5 * abs(a) + 1e-8 for a, b in zip(ln, lv))
    tokens_equal = native["tokens"] == vmm["tokens"]
    ntok = sum(len(t) for t in vmm["tokens"])
    s = vmm["vmm"]

    print("device: %s; torch %s, transformers %s; %d parameters, attention %s" % (
        native["device"], native["torch"], native["transformers"], native["parameters"],
        native["attn_implementation"]))
    print("vmmalloc: %s" % vmm.get("vmm_config", ""))
    print()
    print("%-44s %16s %16s" % ("", "PyTorch caching", "vmmalloc"))
    print("%-44s %16.3f %16.3f" % ("train %d steps, s" % TRAIN_STEPS, native["time_train_s"], vmm["time_train_s"]))
    print("%-44s %16.3f %16.3f" % ("generate %d x %d tokens (KV cache), s" % (PROMPTS, NEW_TOKENS),
                                   native["time_generate_s"], vmm["time_generate_s"]))
    print("%-44s %16.3f %16.3f" % ("workload (train + generate), s", native["time_workload_s"], vmm["time_workload_s"]))
    print("%-44s %16.3f %16.3f" % ("process wall time, s", native["wall_s"], vmm["wall_s"]))
    print("%-44s %16s %16s" % ("peak MiB: max_memory_reserved | peak_mapped",
                               mib(native["max_memory_reserved"]), mib(s["peak_mapped"])))
    print("%-44s %16s %16s" % ("peak MiB: max_memory_allocated | allocated",
                               mib(native["max_memory_allocated"]), mib(s["peak_allocated"])))
    print("%-44s %16s %16s" % ("peak MiB: requested (vmmalloc)", "-", mib(s["peak_requested"])))
    print("%-44s %16s %16s" % ("device memory used at the end, MiB", mib(native["device_used_end"]),
                               mib(vmm["device_used_end"])))
    print("%-44s %16s %16d" % ("vmmalloc allocations / driver calls", "-", s["allocs"]) + " / %d" % s["driver_calls"])
    print()
    print("losses (PyTorch allocator): %s" % ["%.6f" % x for x in ln])
    print("losses equal: %s (max relative difference %.3g); generated tokens equal: %s (%d tokens)" % (
        "EXACTLY" if exact else "not bit for bit", maxrel, tokens_equal, ntok))
    for name, r in (("PyTorch allocator", native), ("vmmalloc", vmm)):
        if r["determinism_warnings"]:
            print("determinism warnings (%s run): %s" % (name, r["determinism_warnings"]))

    if not close:
        print("FAIL: losses differ beyond rtol 1e-5: %s vs %s" % (ln, lv))
        ok = False
    if not tokens_equal:
        print("FAIL: generated tokens differ")
        ok = False
    if vmm.get("vmm_check"):
        print("FAIL: vmmalloc check: %s" % vmm["vmm_check"])
        ok = False
    if s["allocs"] == 0 or s["peak_mapped"] == 0 or s["malloc_failures"] or s["free_failures"]:
        print("FAIL: vmmalloc did not serve the run: %s" % s)
        ok = False
    if not all(x == x and x > 0 for x in ln):
        print("FAIL: a loss is NaN or not positive")
        ok = False

    out = os.environ.get("VMM_OUT")
    if out:
        summary = {
            "device": native["device"], "torch": native["torch"], "transformers": native["transformers"],
            "losses_exact": exact, "losses_max_rel_diff": maxrel, "tokens_equal": tokens_equal,
            "native": native, "vmmalloc": vmm, "passed": ok,
        }
        if os.path.isdir(out):
            out = os.path.join(out, "torch_llama.json")
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
        print("written: %s" % out)
    print("test_torch_llama: %s" % ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2]))
    sys.exit(main())
