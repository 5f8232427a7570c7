#!/usr/bin/env python3
"""Which driver calls break a stream capture, on the real driver (scripts/gpu-validate.sh).

For each call the shim (or an application beside a capture) might make, a capture is
begun on a blocking stream, the call is made, and the table prints the call's result
and the capture's status after it (1 active, 2 invalidated) and EndCapture's result
(0, or 901 for an invalidated capture). Four places for the call: the capturing thread
in global mode (0) and in thread-local mode (1); another thread beside a global
capture, in its default (global) mode and in relaxed mode. The simulator
(sim/, docs/simulator.md) must refuse and invalidate as this table says.
Needs python3 with torch (to make the context) and the real libcuda.so.1.
"""
import ctypes
import threading

import torch

torch.zeros(1, device="cuda")
cu = ctypes.CDLL("libcuda.so.1")
V = ctypes.c_void_p
ctx = V()
assert cu.cuCtxGetCurrent(ctypes.byref(ctx)) == 0


def stream(flags):
    s = V()
    assert cu.cuStreamCreate(ctypes.byref(s), flags) == 0
    return s


cap = stream(0)    # blocking, as torch.cuda.Stream()
other = stream(1)  # non-blocking
ev = V()
assert cu.cuEventCreate(ctypes.byref(ev), 0) == 0
assert cu.cuEventRecord(ev, other) == 0
MIB2 = 2 << 20
dev = ctypes.c_ulonglong()
assert cu.cuMemAlloc_v2(ctypes.byref(dev), ctypes.c_size_t(MIB2)) == 0
host = ctypes.create_string_buffer(MIB2)
# CUmemAllocationProp: pinned (1), no handle types, location device (1) 0, no metadata.
prop = (ctypes.c_int * 8)(1, 0, 1, 0, 0, 0, 0, 0)
cleanup = []


def out_u():
    return ctypes.byref(ctypes.c_uint())


def alloc():
    p = ctypes.c_ulonglong()
    r = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(MIB2))
    if r == 0:
        cleanup.append(lambda: cu.cuMemFree_v2(p))
    return r


def create():
    h = ctypes.c_ulonglong()
    r = cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(MIB2), prop, ctypes.c_ulonglong(0))
    if r == 0:
        cleanup.append(lambda: cu.cuMemRelease(h))
    return r


def reserve():
    p = ctypes.c_ulonglong()
    r = cu.cuMemAddressReserve(ctypes.byref(p), ctypes.c_size_t(MIB2), ctypes.c_size_t(0),
                               ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
    if r == 0:
        cleanup.append(lambda: cu.cuMemAddressFree(p, ctypes.c_size_t(MIB2)))
    return r


def host_alloc():
    p = V()
    r = cu.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(MIB2), 0)
    if r == 0:
        cleanup.append(lambda: cu.cuMemFreeHost(p))
    return r


CALLS = [
    ("cuStreamGetFlags(capturing)", lambda: cu.cuStreamGetFlags(cap, out_u())),
    ("cuStreamGetPriority(capturing)", lambda: cu.cuStreamGetPriority(cap, ctypes.byref(ctypes.c_int()))),
    ("cuStreamGetCtx(capturing)", lambda: cu.cuStreamGetCtx(cap, ctypes.byref(V()))),
    ("cuStreamIsCapturing(capturing)", lambda: cu.cuStreamIsCapturing(cap, ctypes.byref(ctypes.c_int()))),
    ("cuStreamQuery(capturing)", lambda: cu.cuStreamQuery(cap)),
    ("cuStreamGetFlags(other)", lambda: cu.cuStreamGetFlags(other, out_u())),
    ("cuStreamQuery(other)", lambda: cu.cuStreamQuery(other)),
    ("cuStreamQuery(legacy)", lambda: cu.cuStreamQuery(None)),
    ("cuStreamSynchronize(other)", lambda: cu.cuStreamSynchronize(other)),
    ("cuEventQuery(other's)", lambda: cu.cuEventQuery(ev)),
    ("cuEventRecord(other)", lambda: cu.cuEventRecord(ev, other)),
    ("cuCtxGetCurrent", lambda: cu.cuCtxGetCurrent(ctypes.byref(V()))),
    ("cuCtxSetCurrent(same)", lambda: cu.cuCtxSetCurrent(ctx)),
    ("cuCtxGetDevice", lambda: cu.cuCtxGetDevice(ctypes.byref(ctypes.c_int()))),
    ("cuMemGetInfo_v2", lambda: cu.cuMemGetInfo_v2(ctypes.byref(ctypes.c_size_t()), ctypes.byref(ctypes.c_size_t()))),
    ("cuMemAlloc_v2", alloc),
    ("cuMemCreate", create),
    ("cuMemAddressReserve", reserve),
    ("cuMemHostAlloc", host_alloc),
    ("cuMemcpyHtoDAsync_v2(other)", lambda: cu.cuMemcpyHtoDAsync_v2(dev, host, ctypes.c_size_t(MIB2), other)),
    ("cuMemcpyHtoDAsync_v2(legacy)", lambda: cu.cuMemcpyHtoDAsync_v2(dev, host, ctypes.c_size_t(MIB2), None)),
    ("cuMemcpyDtoH_v2", lambda: cu.cuMemcpyDtoH_v2(host, dev, ctypes.c_size_t(MIB2))),
    ("cuCtxSynchronize", lambda: cu.cuCtxSynchronize()),
]


def on_thread(fn, relaxed):
    res = {}

    def body():
        cu.cuCtxSetCurrent(ctx)
        if relaxed:
            cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(ctypes.c_int(2)))
        res["r"] = fn()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(5)
    return res.get("r", "hung")


PLACES = [
    ("this thread, global", 0, lambda fn: fn()),
    ("this thread, thread-local", 1, lambda fn: fn()),
    ("other thread", 0, lambda fn: on_thread(fn, False)),
    ("other thread, relaxed", 0, lambda fn: on_thread(fn, True)),
]

print("| call | " + " | ".join(p[0] for p in PLACES) + " |")
print("| --- |" + " --- |" * len(PLACES))
for name, fn in CALLS:
    cells = []
    for _, mode, run in PLACES:
        assert cu.cuStreamBeginCapture_v2(cap, mode) == 0
        r = run(fn)
        st = ctypes.c_int(-1)
        cu.cuStreamIsCapturing(cap, ctypes.byref(st))
        g = V()
        e = cu.cuStreamEndCapture(cap, ctypes.byref(g))
        if g.value:
            cu.cuGraphDestroy(g)
        cu.cuCtxSynchronize()
        for c in cleanup:
            c()
        cleanup.clear()
        cells.append(f"{r} / {st.value} / {e}")
        if r == "hung":
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
            raise SystemExit(f"{name} hung in a capture")
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
print("cells: the call's result / capture status after it (1 active, 2 invalidated) / EndCapture's result")
