# shellcheck shell=sh
# Sourced (not run) by scripts/fetch-cuda-h.sh and scripts/fetch-cuda-runtime.sh:
# what both do before they download NVIDIA's wheels from PyPI.

# The CUDA runtime wheel (nvidia-cuda-runtime-cu12) both take their files from.
# shellcheck disable=SC2034 # used by the scripts that source this file
CUDA_RUNTIME_VERSION=12.9.79

# Prints $2 and exits when $1 exists: fetched by an earlier run.
exit_if_fetched() {
    if [ -f "$1" ]; then
        echo "$2"
        exit 0
    fi
}

# Sets $pip to a pip command (pip3, pip or python3 -m pip), or exits naming the
# script ($1) when there is none.
find_pip() {
    pip=""
    for p in pip3 pip; do
        if command -v "$p" >/dev/null 2>&1; then pip=$p; break; fi
    done
    if [ -z "$pip" ]; then
        if command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
            pip="python3 -m pip"
        else
            echo "$1: neither pip nor python3 -m pip is available" >&2
            exit 1
        fi
    fi
}
