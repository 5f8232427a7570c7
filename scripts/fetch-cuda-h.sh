#!/bin/sh
# Puts NVIDIA's real cuda.h in target/cuda-include/ (once), from the CUDA runtime
# wheel on PyPI, for the simulator's ABI test (sim/core/tests/c_program.rs).
# Usage: scripts/fetch-cuda-h.sh [DEST_DIR]   (prints the include directory)
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/fetch-cuda-common.sh
. "$root/scripts/fetch-cuda-common.sh"
dest=${1:-"$root/target/cuda-include"}
exit_if_fetched "$dest/cuda.h" "$dest"
find_pip fetch-cuda-h
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The runtime wheel ships include/cuda.h (the driver API header).
# Pinned: the same wheel scripts/fetch-cuda-runtime.sh takes the runtime from.
$pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "nvidia-cuda-runtime-cu12==$CUDA_RUNTIME_VERSION" >&2
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
