#!/usr/bin/env bash
# docs/check-readme-examples.sh BUILD_DIR: compiles the C++ and C examples of README.md (the
# ```cpp and ```c blocks that define main) against include/ and BUILD_DIR's static library, with
# warnings as errors, and runs them. Without a GPU they fall back to the host backend.
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

# Write each fenced block with a main() to $tmp/example<N>.<lang>.
awk -v dir="$tmp" '
  /^```(cpp|c)$/ { lang = substr($0, 4); buf = ""; inside = 1; next }
  /^```/ && inside { if (buf ~ /int main\(/) { n++; f = dir "/example" n "." lang; printf "%s", buf > f; close(f) } inside = 0; next }
  inside { buf = buf $0 "\n" }
' "$root/README.md"

count=0
# shellcheck disable=SC2086  # san_flags: zero or more words
for f in "$tmp"/example*; do
  [[ -e "$f" ]] || break
  case "$f" in
    *.cpp) c++ -std=c++20 -Wall -Wextra -Werror $san_flags -I"$root/include" "$f" "$lib" -ldl -lpthread -o "$f.bin" ;;
    *.c)   cc -std=c11 -Wall -Wextra -Werror $san_flags -I"$root/include" "$f" "$lib" -lstdc++ -lm -ldl -lpthread -o "$f.bin" ;;
  esac
  echo "-- README example $(basename "$f"): compiled, running"
  "$f.bin"
  count=$((count + 1))
done
(( count >= 2 )) || { echo "expected at least 2 examples in README.md, found $count" >&2; exit 1; }
echo "README examples: $count compiled and ran"
