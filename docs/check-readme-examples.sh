#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# docs/check-readme-examples.sh BUILD_DIR: compiles the C++ and C examples of README.md and of
# docs/*.md (the ```cpp and ```c blocks that define main) against include/ and BUILD_DIR's static
# library, with warnings as errors, and runs them. Without a GPU they fall back to the host backend,
# so every such example must run there. README.md must keep at least one C++ and one C example.
# Blocks marked ```c++ or ```cuda, and blocks without main(), are not compiled. README.md's
# ```python blocks that import no framework (torch, cupy, transformers) run with the package from
# python/ and BUILD_DIR's libvmmalloc.so (not in sanitizer trees: an uninstrumented python).
set -euo pipefail
root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
build="$(cd "${1:?usage: $0 BUILD_DIR}" && pwd)"
lib="$build/src/libvmmalloc.a"
[[ -f "$lib" ]] || { echo "no $lib: build the library first" >&2; exit 2; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Same sanitizers as the tree, or its instrumented archive will not link.
san="$(sed -n 's/^VMM_SANITIZE:STRING=//p' "$build/CMakeCache.txt" 2>/dev/null || true)"
san_flags=""
if [[ -n "$san" ]]; then san_flags="-fsanitize=${san//;/,}"; fi

# Writes each fenced block with a main() of markdown file $1 to $tmp/<tag>-<N>.<lang>, where <tag>
# names the file (README, or docs-<name>), and records "<file>:<line>" of the block in <...>.where.
extract() {
  local md="$1" tag="$2"
  awk -v dir="$tmp" -v tag="$tag" -v src="${md#"$root"/}" '
    /^```(cpp|c)$/ { lang = substr($0, 4); buf = ""; inside = 1; start = NR; next }
    /^```/ && inside {
      if (buf ~ /int main\(/) {
        n++; f = dir "/" tag "-" n "." lang
        printf "%s", buf > f; close(f)
        printf "%s:%d\n", src, start > (f ".where"); close(f ".where")
      }
      inside = 0; next
    }
    inside { buf = buf $0 "\n" }
  ' "$md"
}

extract "$root/README.md" README
for md in "$root"/docs/*.md; do
  [[ -e "$md" ]] || continue
  name="$(basename "$md" .md)"
  extract "$md" "docs-$name"
done

readme_cpp=0 readme_c=0 count=0
# shellcheck disable=SC2086  # san_flags: zero or more words
for f in "$tmp"/*.cpp "$tmp"/*.c; do
  [[ -e "$f" ]] || continue
  where="$(cat "$f.where")"
  case "$f" in
    *.cpp) c++ -std=c++20 -Wall -Wextra -Werror $san_flags -I"$root/include" "$f" "$lib" -ldl -lpthread -o "$f.bin" \
             || { echo "example at $where does not compile" >&2; exit 1; } ;;
    *.c)   cc -std=c11 -Wall -Wextra -Werror $san_flags -I"$root/include" "$f" "$lib" -lstdc++ -lm -ldl -lpthread -o "$f.bin" \
             || { echo "example at $where does not compile" >&2; exit 1; } ;;
  esac
  echo "-- example at $where: compiled, running"
  "$f.bin" || { echo "example at $where exited with status $?" >&2; exit 1; }
  case "$(basename "$f")" in
    README-*.cpp) readme_cpp=$((readme_cpp + 1)) ;;
    README-*.c) readme_c=$((readme_c + 1)) ;;
  esac
  count=$((count + 1))
done
readme_py=0
if [[ -z "$san" ]] && command -v python3 >/dev/null; then
  awk -v dir="$tmp" '
    /^```python$/ { buf = ""; inside = 1; start = NR; next }
    /^```/ && inside {
      if (buf !~ /import (torch|cupy|transformers)|vmmalloc\.(torch|cupy|hf)/) {
        n++; f = dir "/README-" n ".py"; printf "%s", buf > f; close(f)
        printf "README.md:%d\n", start > (f ".where"); close(f ".where")
      }
      inside = 0; next
    }
    inside { buf = buf $0 "\n" }
  ' "$root/README.md"
  for f in "$tmp"/README-*.py; do
    [[ -e "$f" ]] || continue
    echo "-- example at $(cat "$f.where"): running"
    VMMALLOC_LIB_DIR="$build/src" PYTHONPATH="$root/python" PYTHONDONTWRITEBYTECODE=1 python3 "$f" \
      || { echo "example at $(cat "$f.where") failed" >&2; exit 1; }
    readme_py=$((readme_py + 1))
  done
  (( readme_py >= 1 )) || { echo "README.md must keep a Python example that runs without a framework" >&2; exit 1; }
fi
(( readme_cpp >= 1 && readme_c >= 1 )) \
  || { echo "README.md must keep a C++ and a C example with main(); found $readme_cpp C++, $readme_c C" >&2; exit 1; }
echo "examples: $count compiled and ran ($readme_cpp C++ and $readme_c C from README.md), $readme_py Python ran"
