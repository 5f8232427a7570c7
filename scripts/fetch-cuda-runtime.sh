#!/bin/sh
# Puts NVIDIA's CUDA runtime in target/cuda-runtime-<version>/ (once), from the
# wheels on PyPI, for the simulator's real-runtime tests (sim/core/tests/cudart.rs,
# tests/tests/cudart.rs):
#   include/   cuda_runtime_api.h and friends (nvidia-cuda-runtime-cu12), plus
#              crt/host_defines.h, which they include (nvidia-cuda-nvcc-cu12)
#   lib/       libcudart.so.12
# Versions are pinned: the simulator's answers to the runtime's private interface
# (cuGetExportTable) are checked against this runtime.
# Usage: scripts/fetch-cuda-runtime.sh [DEST_DIR]   (prints the directory)
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/fetch-cuda-common.sh
. "$root/scripts/fetch-cuda-common.sh"
RUNTIME_VERSION=$CUDA_RUNTIME_VERSION
NVCC_VERSION=12.9.86
dest=${1:-"$root/target/cuda-runtime-$RUNTIME_VERSION"}
exit_if_fetched "$dest/.complete" "$dest"
find_pip fetch-cuda-runtime
parent=$(dirname "$dest")
mkdir -p "$parent"
# Built next to the destination (same file system), then renamed into place: tests
# run this concurrently, and a rename of a complete directory is atomic.
tmp=$(mktemp -d "$parent/.cuda-runtime.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
$pip download --quiet --no-deps --only-binary=:all: --dest "$tmp/wheels" \
    "nvidia-cuda-runtime-cu12==$RUNTIME_VERSION" "nvidia-cuda-nvcc-cu12==$NVCC_VERSION" >&2
python3 - "$tmp/wheels" "$tmp/out" <<'PY'
import os, shutil, sys, zipfile
wheels, out = sys.argv[1], sys.argv[2]
want = {
    "nvidia/cuda_runtime/include/": "include/",
    "nvidia/cuda_runtime/lib/libcudart.so.12": "lib/libcudart.so.12",
    "nvidia/cuda_nvcc/include/crt/": "include/crt/",
}
found = set()
for w in sorted(os.listdir(wheels)):
    with zipfile.ZipFile(os.path.join(wheels, w)) as z:
        for n in z.namelist():
            for src, dst in want.items():
                if n.startswith(src) and not n.endswith("/"):
                    target = os.path.join(out, dst + n[len(src):])
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with z.open(n) as f, open(target, "wb") as g:
                        shutil.copyfileobj(f, g)
                    found.add(src)
missing = set(want) - found
if missing:
    sys.exit("fetch-cuda-runtime: not in the wheels: " + ", ".join(sorted(missing)))
for h in ("include/cuda_runtime_api.h", "include/crt/host_defines.h"):
    if not os.path.isfile(os.path.join(out, h)):
        sys.exit("fetch-cuda-runtime: missing " + h)
PY
echo "nvidia-cuda-runtime-cu12==$RUNTIME_VERSION nvidia-cuda-nvcc-cu12==$NVCC_VERSION" >"$tmp/out/.complete"
if ! mv -T "$tmp/out" "$dest" 2>/dev/null; then
    # Another run got there first; its copy is complete (only complete copies are
    # renamed into place).
    [ -f "$dest/.complete" ] || { echo "fetch-cuda-runtime: could not create $dest" >&2; exit 1; }
fi
echo "$dest"
