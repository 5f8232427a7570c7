"""Holds device memory on the simulator until its stdin closes: the process the
monitoring-tool tests (sim/nvml/tests/monitoring_tools.rs) expect every tool to list.

Usage: python3 hold_memory.py GPU BYTES

Loads libcuda.so.1 (the simulator's, by LD_LIBRARY_PATH) with ctypes, creates a
context on GPU and allocates (and writes) BYTES there, then prints one line of JSON: its pid,
argv[0] as /proc shows it, what cuMemGetInfo says (free, total) with the
allocation held, and the GPU's compute capability as cuDeviceGetAttribute gives it.
"""
import ctypes
import json
import os
import sys


def check(result, what):
    if result != 0:
        sys.exit(f"hold_memory.py: {what} failed: CUresult {result}")


gpu, size = int(sys.argv[1]), int(sys.argv[2])
cuda = ctypes.CDLL("libcuda.so.1")
check(cuda.cuInit(0), "cuInit")
device = ctypes.c_int()
check(cuda.cuDeviceGet(ctypes.byref(device), gpu), "cuDeviceGet")
context = ctypes.c_void_p()
check(cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device), "cuCtxCreate_v2")
pointer = ctypes.c_uint64()
check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size)), "cuMemAlloc_v2")
# Written, so it is resident on the GPU under Kiwi too (shim/tests/nvml_view.rs).
check(cuda.cuMemsetD8_v2(pointer, 1, ctypes.c_size_t(size)), "cuMemsetD8_v2")
check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
free, total = ctypes.c_size_t(), ctypes.c_size_t()
check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
major, minor = ctypes.c_int(), ctypes.c_int()
check(cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device), "cuDeviceGetAttribute(major)")
check(cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device), "cuDeviceGetAttribute(minor)")
with open("/proc/self/cmdline", "rb") as f:
    argv0 = f.read().split(b"\0")[0].decode()
print(json.dumps({
    "pid": os.getpid(),
    "argv0": argv0,
    "free": free.value,
    "total": total.value,
    "compute_capability": [major.value, minor.value],
}), flush=True)
sys.stdin.read()
