#!/usr/bin/env bash
# tests/install/check.sh BUILD_DIR: install a built vmmalloc tree into a temporary prefix and build
# consumers against it, the three ways a user would:
#   1. CMake: find_package(vmmalloc CONFIG REQUIRED) + vmmalloc::vmmalloc (main.cpp and main.c)
#   2. pkg-config, C program, shared library:  cc main.c $(pkg-config --cflags --libs vmmalloc)
#   3. pkg-config, C program, static archive:  cc main.c ... $(pkg-config --static --libs vmmalloc)
#      (the library is C++: Libs.private must bring the C++ runtime)
# Each consumer runs on the host backend and must print "<name> ok". Exit 0 when all pass.
# If BUILD_DIR was configured with VMM_SANITIZE, the consumers are built with the same sanitizers.
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

step() { printf -- '-- %s\n' "$*"; }
fail() { printf 'install check FAILED: %s\n' "$*" >&2; exit 1; }

# Same sanitizers as the tree under test, or its instrumented static library will not link.
san="$(sed -n 's/^VMM_SANITIZE:STRING=//p' "$build/CMakeCache.txt")"
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

# 1. CMake consumer.
step "find_package(vmmalloc) consumer"
cmake -S "$here" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_C_FLAGS="$san_flags" -DCMAKE_CXX_FLAGS="$san_flags" \
      -DCMAKE_EXE_LINKER_FLAGS="$san_flags" >"$tmp/configure.log" 2>&1 \
  || { cat "$tmp/configure.log"; fail "configure of the consumer"; }
cmake --build "$tmp/consumer" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "build of the consumer"; }
run_consumer consumer_cxx "$tmp/consumer/consumer_cxx"
run_consumer consumer_c "$tmp/consumer/consumer_c"

# 2. and 3. pkg-config consumers.
pcfile="$(find "$prefix" -name vmmalloc.pc -print -quit)"
[[ -n "$pcfile" ]] || fail "no vmmalloc.pc installed under $prefix"
PKG_CONFIG_PATH="$(dirname "$pcfile")"
export PKG_CONFIG_PATH
step "PKG_CONFIG_PATH=$PKG_CONFIG_PATH"
cflags="$(pkg-config --cflags vmmalloc)" || fail "pkg-config --cflags vmmalloc"
libs="$(pkg-config --libs vmmalloc)" || fail "pkg-config --libs vmmalloc"
static_libs="$(pkg-config --static --libs vmmalloc)" || fail "pkg-config --static --libs vmmalloc"
echo "cflags: $cflags"
echo "libs: $libs"
echo "static libs: $static_libs"
libdir="$(pkg-config --variable=libdir vmmalloc)"
[[ -f "$libdir/libvmmalloc.so" && -f "$libdir/libvmmalloc.a" ]] \
  || fail "pkg-config's libdir ($libdir) does not hold the installed libraries (prefix in vmmalloc.pc is wrong?)"

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

echo "install check passed"
