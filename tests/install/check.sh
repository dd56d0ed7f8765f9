#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# tests/install/check.sh BUILD_DIR: install a built vmmalloc tree into a temporary prefix, check what
# an adopter finds there, and build consumers against it the ways a user would, with no flags of
# their own (no -std, no include or library paths beyond what the package gives):
#   0. the tree: headers (vulkan_interop.hpp exactly when its library is there), libraries,
#      libvmmalloc_torch.so, LICENSE, the tools
#   1. CMake: find_package(vmmalloc), no CMAKE_CXX_STANDARD, no CUDA language: C++ on the static
#      and the shared library, C on the static one, Vulkan interop where installed; then a C-only
#      project (LANGUAGES C) on both libraries with find_package(CUDAToolkit) turned off
#   2. CMake with LANGUAGES CUDA: a .cu file compiled by nvcc (where the tree has nvcc)
#   3. pkg-config: C and C++ (cxxflags variable), each on the shared and on the static library
#   4. the Python package: importable with PYTHONPATH exactly as README.md writes it (the prefix
#      put for /opt/vmmalloc), one copy of it, no template, its _paths.py pointing at the
#      installed libraries
#   5. the tools start without libcudart on the loader path (ldd)
# Each consumer runs on the host backend and must print "<name> ok". Exit 0 when all pass.
# If BUILD_DIR was configured with VMM_SANITIZE, the consumers are built with the same sanitizers
# (the nvcc consumer and the Python library load are then left out).
set -euo pipefail

if [[ $# -ne 1 || ! -f "$1/CMakeCache.txt" ]]; then
  echo "usage: $0 BUILD_DIR   (a configured and built vmmalloc tree)" >&2
  exit 2
fi
build="$(cd "$1" && pwd)"
here="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/vmm-install-check.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
prefix="$tmp/prefix"
cc="${CC:-cc}"
cxx="${CXX:-c++}"

step() { printf -- '-- %s\n' "$*"; }
fail() { printf 'install check FAILED: %s\n' "$*" >&2; exit 1; }
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }

# Same sanitizers as the tree under test, or its instrumented static library will not link.
san="$(cache VMM_SANITIZE)"
san_flags=""
if [[ -n "$san" ]]; then san_flags="-fsanitize=${san//;/,} -fno-omit-frame-pointer"; fi

step "cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install"; }

run_consumer() {  # run_consumer NAME COMMAND...: runs it, expects "NAME ok" in its output
  local name="$1" out; shift
  out="$("$@" 2>&1)" || { printf '%s\n' "$out"; fail "$name exited non-zero"; }
  printf '%s\n' "$out"
  grep -qx "$name ok" <<<"$out" || fail "$name did not print '$name ok'"
}

# 0. The installed tree.
libdir_rel="$(cache CMAKE_INSTALL_LIBDIR)"
libdir="$prefix/$libdir_rel"
step "installed files under $prefix"
for f in include/vmmalloc/vmmalloc.hpp include/vmmalloc/vmmalloc.h include/vmmalloc/adapters.hpp \
         "$libdir_rel/libvmmalloc.a" "$libdir_rel/libvmmalloc.so" "$libdir_rel/libvmmalloc_torch.so" \
         "$libdir_rel/cmake/vmmalloc/vmmallocConfig.cmake" "$libdir_rel/cmake/vmmalloc/vmmallocCUDA20.cmake" \
         share/doc/vmmalloc/LICENSE; do
  [[ -f "$prefix/$f" ]] || fail "$f not installed"
done
grep -q "Apache License" "$prefix/share/doc/vmmalloc/LICENSE" || fail "share/doc/vmmalloc/LICENSE is not the Apache License"
# The Vulkan header is installed exactly when the library that implements it is.
if [[ -f "$libdir/libvmmalloc_vulkan.a" ]]; then
  [[ -f "$prefix/include/vmmalloc/vulkan_interop.hpp" && -f "$libdir/libvmmalloc_interop_core.a" ]] \
    || fail "libvmmalloc_vulkan.a installed without vulkan_interop.hpp or libvmmalloc_interop_core.a"
  echo "Vulkan interop: installed (header and libraries)"
else
  [[ ! -e "$prefix/include/vmmalloc/vulkan_interop.hpp" ]] \
    || fail "vulkan_interop.hpp installed without libvmmalloc_vulkan.a: its consumers could not link"
  echo "Vulkan interop: not built, header left out"
fi

# 1. CMake consumer: C++ (static, shared), C, Vulkan.
step "find_package(vmmalloc) consumer (no CMAKE_CXX_STANDARD, no CUDA language)"
cmake -S "$here" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_C_FLAGS="$san_flags" -DCMAKE_CXX_FLAGS="$san_flags" \
      -DCMAKE_EXE_LINKER_FLAGS="$san_flags" >"$tmp/configure.log" 2>&1 \
  || { cat "$tmp/configure.log"; fail "configure of the consumer"; }
cmake --build "$tmp/consumer" -j2 >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "build of the consumer"; }
run_consumer consumer_cxx "$tmp/consumer/consumer_cxx"
run_consumer consumer_cxx_shared "$tmp/consumer/consumer_cxx_shared"
# Through a file: with pipefail, grep -q quitting early could fail the pipeline (SIGPIPE in ldd).
ldd "$tmp/consumer/consumer_cxx_shared" >"$tmp/ldd.txt" 2>&1 || true
grep -q "$libdir/libvmmalloc.so" "$tmp/ldd.txt" \
  || { cat "$tmp/ldd.txt"; fail "consumer_cxx_shared does not load the installed libvmmalloc.so"; }
run_consumer consumer_c "$tmp/consumer/consumer_c"
if [[ -f "$libdir/libvmmalloc_vulkan.a" ]]; then
  [[ -x "$tmp/consumer/consumer_vulkan" ]] || fail "vmmalloc::vulkan installed but the consumer did not see the target"
  run_consumer consumer_vulkan "$tmp/consumer/consumer_vulkan"
fi

step "C-only find_package(vmmalloc) consumer (LANGUAGES C, no CUDA toolkit)"
cmake -S "$here/c_only" -B "$tmp/consumer_c_only" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DCMAKE_C_FLAGS="$san_flags" \
      -DCMAKE_EXE_LINKER_FLAGS="$san_flags" >"$tmp/configure_c.log" 2>&1 \
  || { cat "$tmp/configure_c.log"; fail "configure of the C-only consumer"; }
cmake --build "$tmp/consumer_c_only" -j2 >"$tmp/build_c.log" 2>&1 \
  || { cat "$tmp/build_c.log"; fail "build of the C-only consumer (static target's C++ runtime?)"; }
run_consumer consumer_c "$tmp/consumer_c_only/consumer_c"
run_consumer consumer_c "$tmp/consumer_c_only/consumer_c_shared"

# 2. nvcc consumer: only where the tree found nvcc; not in sanitizer trees (nvcc takes no -fsanitize).
nvcc="$(cache CMAKE_CUDA_COMPILER)"
if [[ -n "$nvcc" && -x "$nvcc" && -z "$san" ]]; then
  step "CUDA consumer: main.cu compiled by $nvcc"
  # CMAKE_CUDA_COMPILER only says which nvcc (the one the tree used); no flags.
  cmake -S "$here/cuda" -B "$tmp/consumer_cu" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_COMPILER="$nvcc" >"$tmp/configure_cu.log" 2>&1 \
    || { cat "$tmp/configure_cu.log"; fail "configure of the CUDA consumer"; }
  cmake --build "$tmp/consumer_cu" -v >"$tmp/build_cu.log" 2>&1 \
    || { cat "$tmp/build_cu.log"; fail "build of the CUDA consumer"; }
  grep -E "nvcc.* -std=c\+\+20 .*main\.cu" "$tmp/build_cu.log" >/dev/null \
    || { grep -E "main\.cu" "$tmp/build_cu.log"; fail "nvcc was not given -std=c++20 by the package"; }
  run_consumer consumer_cu "$tmp/consumer_cu/consumer_cu"
elif [[ -n "$san" ]]; then
  step "CUDA consumer left out (sanitizer tree)"
else
  step "CUDA consumer left out (no nvcc in this tree)"
fi

# 3. pkg-config consumers.
pcfile="$(find "$prefix" -name vmmalloc.pc -print -quit)"
[[ -n "$pcfile" ]] || fail "no vmmalloc.pc installed under $prefix"
PKG_CONFIG_PATH="$(dirname "$pcfile")"
export PKG_CONFIG_PATH
step "PKG_CONFIG_PATH=$PKG_CONFIG_PATH"
cflags="$(pkg-config --cflags vmmalloc)" || fail "pkg-config --cflags vmmalloc"
libs="$(pkg-config --libs vmmalloc)" || fail "pkg-config --libs vmmalloc"
static_libs="$(pkg-config --static --libs vmmalloc)" || fail "pkg-config --static --libs vmmalloc"
cxxflags="$(pkg-config --variable=cxxflags vmmalloc)"
echo "cflags: $cflags"
echo "cxxflags: $cxxflags"
echo "libs: $libs"
echo "static libs: $static_libs"
[[ "$cxxflags" == *-std=c++20* ]] || fail "vmmalloc.pc: the cxxflags variable lacks -std=c++20"
[[ "$cflags" != *-std=* ]] || fail "vmmalloc.pc: Cflags carry a language standard (C consumers use them too)"
grep -qx "License: Apache-2.0" "$pcfile" || fail "vmmalloc.pc has no License field"
[[ "$(pkg-config --variable=libdir vmmalloc)" -ef "$libdir" ]] \
  || fail "pkg-config's libdir is not $libdir (prefix in vmmalloc.pc is wrong?)"

step "$cc main.c \$(pkg-config --cflags --libs vmmalloc)   (shared library)"
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Wextra -Werror $san_flags $cflags "$here/main.c" -o "$tmp/consumer_c_pc" $libs \
      -Wl,-rpath,"$libdir" || fail "C consumer with pkg-config (shared)"
run_consumer consumer_c "$tmp/consumer_c_pc"

step "$cc main.c ... \$(pkg-config --static --libs vmmalloc)   (static archive, no C++ driver)"
# -l:libvmmalloc.a picks the archive even though the shared library sits beside it.
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Wextra -Werror $san_flags $cflags "$here/main.c" -o "$tmp/consumer_c_static" \
      ${static_libs//-lvmmalloc/-l:libvmmalloc.a} >"$tmp/link.log" 2>&1 \
  || { head -n 15 "$tmp/link.log"; fail "C consumer with pkg-config --static (Libs.private lacks -lstdc++?)"; }
run_consumer consumer_c "$tmp/consumer_c_static"

step "$cxx \$(pkg-config --variable=cxxflags vmmalloc) main.cpp \$(pkg-config --cflags --libs vmmalloc)   (shared, static)"
# shellcheck disable=SC2086
"$cxx" $cxxflags -Wall -Wextra -Werror $san_flags $cflags "$here/main.cpp" -o "$tmp/consumer_cxx_pc" $libs \
      -Wl,-rpath,"$libdir" || fail "C++ consumer with pkg-config (shared)"
run_consumer consumer_cxx "$tmp/consumer_cxx_pc"
# shellcheck disable=SC2086
"$cxx" $cxxflags -Wall -Wextra -Werror $san_flags $cflags "$here/main.cpp" -o "$tmp/consumer_cxx_static" \
      ${static_libs//-lvmmalloc/-l:libvmmalloc.a} || fail "C++ consumer with pkg-config --static"
run_consumer consumer_cxx "$tmp/consumer_cxx_static"

# 4. The Python package, with PYTHONPATH exactly as the README writes it.
python="$(cache VMM_INSTALL_PYTHON)"
readme="$here/../../README.md"
if [[ -f "$here/../../python/vmmalloc/__init__.py" ]]; then
  [[ -x "$python" ]] || python="$(command -v python3)" || fail "no python3 to import the package with"
  written="$(grep -o 'PYTHONPATH=/opt/vmmalloc[^ `]*' "$readme" | head -n 1)"
  [[ -n "$written" ]] || fail "README.md gives no PYTHONPATH=/opt/vmmalloc/..."
  pydir="$prefix${written#PYTHONPATH=/opt/vmmalloc}"
  copies="$(find "$prefix" -path '*/vmmalloc/__init__.py' | wc -l)"
  [[ "$copies" == 1 ]] || fail "the Python package is installed $copies times"
  ! find "$prefix" -name '*.in' | grep -q . || fail "a template is installed: $(find "$prefix" -name '*.in')"
  step "README's $written, here: PYTHONPATH=$pydir $python -c 'import vmmalloc, vmmalloc._paths'"
  [[ -f "$pydir/vmmalloc/__init__.py" && -f "$pydir/vmmalloc/_paths.py" ]] || fail "Python package not installed in $pydir"
  # Each LIB_DIRS entry, relative to the package folder, must be the installed libdir, holding the
  # libraries; the shared library must load (not in sanitizer trees: an uninstrumented python).
  PYTHONPATH="$pydir" PYTHONDONTWRITEBYTECODE=1 VMM_LIBDIR="$libdir" VMM_LOAD="${san:+no}" "$python" - <<'PY' \
    || fail "the installed Python package does not find the installed libraries"
import ctypes, os
import vmmalloc, vmmalloc._paths
pkg = os.path.dirname(os.path.abspath(vmmalloc.__file__))
dirs = [os.path.normpath(os.path.join(pkg, d)) for d in vmmalloc._paths.LIB_DIRS]
assert all(not os.path.isabs(d) for d in vmmalloc._paths.LIB_DIRS), vmmalloc._paths.LIB_DIRS
assert dirs and os.path.samefile(dirs[0], os.environ["VMM_LIBDIR"]), (dirs, os.environ["VMM_LIBDIR"])
for name in ("libvmmalloc_torch.so", "libvmmalloc.so"):
    assert os.path.isfile(os.path.join(dirs[0], name)), name + " not in " + dirs[0]
if os.environ.get("VMM_LOAD") != "no":
    lib = ctypes.CDLL(os.path.join(dirs[0], "libvmmalloc_torch.so"))
    assert hasattr(lib, "vmm_torch_malloc")
print("python package: LIB_DIRS", vmmalloc._paths.LIB_DIRS, "->", dirs[0])
PY
else
  step "Python package left out (no python/vmmalloc/ in this tree)"
fi

# 5. The tools: no libcudart at run time (cudart is linked statically), and they start.
step "tools: ldd, start with an empty LD_LIBRARY_PATH"
for t in vmm-replay vmm-demo vmm-info; do
  bin="$prefix/bin/$t"
  [[ -x "$bin" ]] || fail "$t not installed"
  ldd "$bin" >"$tmp/ldd.txt" 2>&1 || true
  ! grep -q "libcudart" "$tmp/ldd.txt" || { cat "$tmp/ldd.txt"; fail "$t needs libcudart at run time"; }
  ! grep -q "not found" "$tmp/ldd.txt" || { cat "$tmp/ldd.txt"; fail "$t has an unresolved library"; }
  rc=0
  LD_LIBRARY_PATH="" "$bin" --help >"$tmp/help.txt" 2>&1 || rc=$?
  [[ $rc -ne 127 ]] && ! grep -q "error while loading shared libraries" "$tmp/help.txt" \
    || { cat "$tmp/help.txt"; fail "$t does not start"; }
  echo "$t: no libcudart, starts (--help exit $rc)"
done

echo "install check passed"
