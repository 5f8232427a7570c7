"""What NVML tells this process, and what CUDA tells it, at the same moments: for
shim/tests/nvml_view.rs (issue #39). One JSON object on stdout.

Usage: python3 nvml_view.py MIB

1. Before CUDA: pynvml's free memory and process list (NVML used before CUDA).
2. CUDA through ctypes (libcuda.so.1, the simulator's): a context on GPU 0 and MIB
   MiB allocated; cuMemGetInfo's free and total.
3. Right after, in this same process: pynvml (memory v1 and v2, the compute lists
   in every version, graphics and MPS), nvitop's Device API and gpustat's query,
   each tool's own code path through libnvidia-ml.so.1 (dlopen + dlsym).

Then it waits for stdin to close, holding its memory, so the test can look at it
from outside too.
"""
import ctypes
import json
import os
import sys

import pynvml as N

MIB = 1 << 20


def check(result, what):
    if result != 0:
        sys.exit(f"nvml_view.py: {what} failed: CUresult {result}")


def pynvml_view(h):
    v1 = N.nvmlDeviceGetMemoryInfo(h)
    v2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)

    def pids(fn):
        return [[p.pid, p.usedGpuMemory] for p in fn(h)]

    # The unversioned (v1) list by hand: pynvml wraps only the newer ones.
    class V1(ctypes.Structure):
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

    fn = N._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses")
    count = ctypes.c_uint(0)
    first = fn(h, ctypes.byref(count), None)
    array = (V1 * max(count.value, 1))()
    second = fn(h, ctypes.byref(count), array)
    return {
        "v1": {"total": v1.total, "free": v1.free, "used": v1.used},
        "v2": {"total": v2.total, "reserved": v2.reserved, "free": v2.free, "used": v2.used},
        "compute_v3": pids(N.nvmlDeviceGetComputeRunningProcesses),
        "compute_v2": pids(N.nvmlDeviceGetComputeRunningProcesses_v2),
        "compute_v1": {
            "first": first,
            "second": second,
            "list": [[array[i].pid, array[i].usedGpuMemory] for i in range(count.value)],
        },
        "graphics": pids(N.nvmlDeviceGetGraphicsRunningProcesses),
        "mps": pids(N.nvmlDeviceGetMPSComputeRunningProcesses),
    }


mib = int(sys.argv[1])
N.nvmlInit()
handle = N.nvmlDeviceGetHandleByIndex(0)
report = {"pid": os.getpid(), "before_cuda": pynvml_view(handle)}

cuda = ctypes.CDLL("libcuda.so.1")
check(cuda.cuInit(0), "cuInit")
device = ctypes.c_int()
check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
context = ctypes.c_void_p()
check(cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device), "cuCtxCreate_v2")
pointer = ctypes.c_uint64()
check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(mib * MIB)), "cuMemAlloc_v2")
check(cuda.cuMemsetD8_v2(pointer, 7, ctypes.c_size_t(mib * MIB)), "cuMemsetD8_v2")
check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
free, total = ctypes.c_size_t(), ctypes.c_size_t()
check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
report["cuda"] = {"free": free.value, "total": total.value}
report["after_cuda"] = pynvml_view(handle)

from nvitop import Device  # noqa: E402

d = Device(0)
report["nvitop"] = {
    "free": d.memory_free(),
    "used": d.memory_used(),
    "total": d.memory_total(),
    "pids": sorted(d.processes().keys()),
}

import gpustat  # noqa: E402

g = gpustat.new_query().gpus[0]
report["gpustat"] = {
    "used_mib": g.memory_used,
    "total_mib": g.memory_total,
    "pids": sorted(p["pid"] for p in (g.processes or [])),
}
# The same figures again, to show nothing moved in between.
free2 = ctypes.c_size_t()
check(cuda.cuMemGetInfo_v2(ctypes.byref(free2), ctypes.byref(total)), "cuMemGetInfo_v2")
report["cuda_after_tools"] = {"free": free2.value}
print(json.dumps(report), flush=True)
sys.stdin.read()
