"""A PyTorch-like process under the shim, for shim/tests/hint_py.rs: it allocates GPU
memory itself through the driver API (ctypes on libcuda.so.1: the simulator in the
tests, reached through the shim's wrappers as a real application's calls are) and
installs a fake `torch` whose caching allocator "holds" that allocation as one
segment: the first USED MiB a live tensor, the rest a cached free block. With
KIWI_TEST_ENABLE=1 it calls kiwi.enable(), whose thread tells the shim the free
block is dead before each swap-out.

Usage: hint_e2e.py MIB USED_MIB ROUNDS PAUSE_MS
Fills the first USED MiB with a pattern, prints "RUNNING" and waits for a line on
stdin; then ROUNDS times rewrites its first MiB (a submission) and idles PAUSE_MS so
that a waiting partner gets the GPU. At the end it reads the USED MiB back and prints
one JSON line: whether they verified, what kiwi.enable() returned, kiwi.hint_stats().
"""

import ctypes
import json
import os
import sys
import time
import types

import kiwi
from simcuda import check, open_context

MIB = 1 << 20
size, used = int(sys.argv[1]) * MIB, int(sys.argv[2]) * MIB
rounds, pause = int(sys.argv[3]), int(sys.argv[4]) / 1000.0

cuda = ctypes.CDLL("libcuda.so.1")


class DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def library_of(f):
    """The file of the library that defines function pointer `f` (dladdr)."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:  # glibc < 2.34: in libdl
        dladdr = ctypes.CDLL("libdl.so.2").dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    info = DlInfo()
    if not dladdr(ctypes.cast(f, ctypes.c_void_p), ctypes.byref(info)):
        return None
    return os.path.basename(info.dli_fname.decode())


# With libkiwi.so preloaded, dlsym on libcuda's handle (what ctypes does) answers the
# shim's wrapper: the driver calls below go through the shim as a C program's do.
alloc_in = library_of(cuda.cuMemAlloc_v2)


open_context()
ptr = ctypes.c_uint64()
check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc_v2")
cuda.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
cuda.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]

pattern = (bytes(range(251)) * (used // 251 + 1))[:used]
host = (ctypes.c_char * used).from_buffer_copy(pattern)
check(cuda.cuMemcpyHtoD_v2(ptr.value, host, used), "cuMemcpyHtoD_v2")
check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")


class FakeCuda(types.ModuleType):
    """torch.cuda as the hint thread uses it. An older PyTorch's signature (no
    include_traces) and block format (no block address)."""

    snapshots = 0

    def is_initialized(self):
        return True

    def memory_snapshot(self):
        FakeCuda.snapshots += 1
        return [
            {
                "device": 0,
                "address": ptr.value,
                "total_size": size,
                "allocated_size": used,
                "active_size": used,
                "stream": 0,
                "segment_type": "large",
                "blocks": [
                    {"size": used, "state": "active_allocated"},
                    {"size": size - used, "state": "inactive"},
                ],
            }
        ]


torch = types.ModuleType("torch")
torch.cuda = FakeCuda("torch.cuda")
sys.modules["torch"] = torch
sys.modules["torch.cuda"] = torch.cuda

out = {"enabled": None, "cuMemAlloc_v2_in": alloc_in}
if os.environ.get("KIWI_TEST_ENABLE") == "1":
    out["enabled"] = kiwi.enable()
    out["enabled_again"] = kiwi.enable()

print("RUNNING", flush=True)
if not sys.stdin.readline():
    sys.exit("no go")
for _ in range(rounds):
    check(cuda.cuMemcpyHtoD_v2(ptr.value, host, MIB), "cuMemcpyHtoD_v2")
    check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
    time.sleep(pause)

back = (ctypes.c_char * used)()
check(cuda.cuMemcpyDtoH_v2(back, ptr.value, used), "cuMemcpyDtoH_v2")
out["verified"] = back.raw == pattern
out["threads"] = sorted(t.name for t in __import__("threading").enumerate())
out["snapshots"] = FakeCuda.snapshots
out["stats"] = kiwi.hint_stats()
out["disabled"] = kiwi.disable()
print(json.dumps(out), flush=True)
