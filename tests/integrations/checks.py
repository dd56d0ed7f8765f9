# SPDX-License-Identifier: Apache-2.0
"""The integration scripts' helpers: each check printed, the failed ones collected in `failures`;
torch_or_skip, the GPU scripts' opening."""

import importlib

SKIP = 77  # ctest's SKIP_RETURN_CODE for these scripts

failures = []


def torch_or_skip(name, also=()):
    """torch, or None after printing why `name` is skipped (return SKIP then): torch or a module
    in `also` is not importable (ImportError, or a broken install that fails on import), or there
    is no CUDA device. is_available() counts devices; CUDA is not started here."""
    try:
        torch = importlib.import_module("torch")
        for m in also:
            importlib.import_module(m)
    except Exception as e:
        print("%s: skipped: %s not importable (%s)" % (name, "/".join(("torch",) + tuple(also)), e))
        return None
    if not torch.cuda.is_available():
        print("%s: skipped: no CUDA device" % name)
        return None
    return torch


def expect(cond, what):
    print(("ok    " if cond else "FAIL  ") + what, flush=True)
    if not cond:
        failures.append(what)
