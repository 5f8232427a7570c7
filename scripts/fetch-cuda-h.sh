#!/bin/sh
# Puts NVIDIA's real cuda.h in target/cuda-include/ (once), from the CUDA runtime
# wheel on PyPI, for the simulator's ABI test (sim/core/tests/c_program.rs).
# Usage: scripts/fetch-cuda-h.sh [DEST_DIR]   (prints the include directory)
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-"$root/target/cuda-include"}
if [ -f "$dest/cuda.h" ]; then
    echo "$dest"
    exit 0
fi
pip=""
for p in pip3 pip; do
    if command -v "$p" >/dev/null 2>&1; then pip=$p; break; fi
done
if [ -z "$pip" ]; then
    if command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
        pip="python3 -m pip"
    else
        echo "fetch-cuda-h: neither pip nor python3 -m pip is available" >&2
        exit 1
    fi
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The runtime wheel ships include/cuda.h (the driver API header).
# Pinned: the same wheel scripts/fetch-cuda-runtime.sh takes the runtime from.
$pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "nvidia-cuda-runtime-cu12==12.9.79" >&2
whl=$(ls "$tmp"/*.whl | head -n 1)
python3 - "$whl" "$tmp/x" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.endswith("/include/cuda.h")]
    if not names:
        sys.exit("fetch-cuda-h: no include/cuda.h in " + sys.argv[1])
    z.extract(names[0], sys.argv[2])
    print(names[0], file=sys.stderr)
PY
mkdir -p "$dest"
# Tests run this concurrently: each copies to its own name, and the rename is atomic.
cp "$(find "$tmp/x" -name cuda.h | head -n 1)" "$dest/.cuda.h.$$"
mv -f "$dest/.cuda.h.$$" "$dest/cuda.h"
echo "$dest"
