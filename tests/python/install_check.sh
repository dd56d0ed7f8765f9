#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# tests/python/install_check.sh BUILD_DIR PYTHON: installs a built tree into a temporary prefix and
# imports the installed vmmalloc package from outside the sources, with no VMMALLOC_* variable:
# its generated _paths.py must lead it to the installed libvmmalloc.so and libvmmalloc_torch.so.
set -euo pipefail
build="$(cd "$1" && pwd)"
py="${2:-python3}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/vmm-py-install.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; exit 1; }
site="$(sed -n 's/^VMM_PYTHON_INSTALL_DIR:STRING=//p' "$build/CMakeCache.txt")"
[[ "$site" = /* ]] || site="$tmp/prefix/$site"
[[ -f "$site/vmmalloc/_paths.py" ]] || { echo "no vmmalloc/_paths.py under $site"; exit 1; }
cd "$tmp"  # not the source tree: its python/ must not be found
env -u VMMALLOC_LIB_DIR -u VMMALLOC_TORCH_LIB PYTHONPATH="$site" PYTHONDONTWRITEBYTECODE=1 "$py" - "$tmp/prefix" <<'PY'
import os, sys
prefix = os.path.realpath(sys.argv[1])
import vmmalloc
import vmmalloc.torch as vt
inside = lambda p: os.path.realpath(p).startswith(prefix + os.sep)
assert inside(vmmalloc.__file__), "imported %s, not the installed package" % vmmalloc.__file__
lib = vmmalloc.find_library()
assert inside(lib), "libvmmalloc.so from %s, not the prefix" % lib
tlib = vt.find_library()
assert inside(tlib), "libvmmalloc_torch.so from %s, not the prefix" % tlib
b = vmmalloc.GrowableBuffer.host(8 << 20)
b.resize(3 << 20)
b.memoryview()[-1] = 9
assert b.memoryview()[-1] == 9 and b.size == 3 << 20
kv = vmmalloc.KVCache.host(layers=2, kv_heads=2, head_dim=64, max_seqs=2, max_tokens=100)
kv.append(kv.open(), 10)
assert kv.stats()["pages_mapped"] == 4
vt.load()  # the installed libvmmalloc_torch.so loads and binds
print("installed package ok:", os.path.dirname(vmmalloc.__file__), lib, tlib)
PY
