#!/usr/bin/env python3
"""What the simulator charges, measured on the real driver (scripts/gpu-validate.sh).

Prints one line per figure: page-locking (cuMemHostAlloc, and cuMemHostRegister of
4 KiB-page and transparent-huge-page memory), pinned and pageable copies each way
and both ways at once, and the VMM calls a swap-in makes (cuMemCreate per 2 MiB page
for 2 MiB and 64 MiB handles, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease).
Compare with the simulator's COSTS (bench/src/jobs.rs, docs/benchmarks.md).
Needs python3 with torch (to make the context) and the real libcuda.so.1.
"""
import ctypes
import mmap
import sys
import time

import torch

torch.zeros(1, device="cuda")
cu = ctypes.CDLL("libcuda.so.1")
V, ULL, SZ = ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t
GIB = 1 << 30
MIB2 = 2 << 20
N = int(sys.argv[1]) if len(sys.argv) > 1 else 4  # GiB per measurement


def ok(r, what):
    if r != 0:
        raise SystemExit(f"{what} failed: {r}")


def now():
    return time.perf_counter()


def line(name, value, unit, note=""):
    print(f"{name:<44} {value:10.2f} {unit}{'  ' + note if note else ''}", flush=True)


def anon(size, huge):
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def touch(m):
    page = b"\1" * 4096
    for off in range(0, len(m), 4096):
        m[off:off + 4096] = page


size = N * GIB
# Page-locking.
p = V()
t = now(); ok(cu.cuMemHostAlloc(ctypes.byref(p), SZ(size), 0), "cuMemHostAlloc"); dt = now() - t
line("pin: cuMemHostAlloc", size / dt / 1e9, "GB/s")
pinned = p
for huge in (False, True):
    for touched in (False, True):
        m, addr = anon(size, huge)
        if touched:
            touch(m)
        t = now(); ok(cu.cuMemHostRegister_v2(V(addr), SZ(size), 0), "cuMemHostRegister"); dt = now() - t
        line(f"pin: cuMemHostRegister {'THP' if huge else '4 KiB'}{', pre-touched' if touched else ''}",
             size / dt / 1e9, "GB/s")
        ok(cu.cuMemHostUnregister(V(addr)), "cuMemHostUnregister")
        del addr
        m.close()
# The shim pins its swap buffers one 64 MiB segment at a time.
SEG = 64 << 20
for huge in (False, True):
    m, addr = anon(size, huge)
    t = now()
    for off in range(0, size, SEG):
        ok(cu.cuMemHostRegister_v2(V(addr + off), SZ(SEG), 0), "cuMemHostRegister")
    dt = now() - t
    line(f"pin: cuMemHostRegister {'THP' if huge else '4 KiB'}, 64 MiB pieces", size / dt / 1e9, "GB/s")
    for off in range(0, size, SEG):
        ok(cu.cuMemHostUnregister(V(addr + off)), "cuMemHostUnregister")
    del addr
    m.close()
ps = []
t = now()
for _ in range(0, size, SEG):
    q = V()
    ok(cu.cuMemHostAlloc(ctypes.byref(q), SZ(SEG), 0), "cuMemHostAlloc")
    ps.append(q)
dt = now() - t
line("pin: cuMemHostAlloc, 64 MiB pieces", size / dt / 1e9, "GB/s")
for q in ps:
    ok(cu.cuMemFreeHost(q), "cuMemFreeHost")
with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
    print("transparent_hugepage:", f.read().strip())

# Copies.
d = ULL()
ok(cu.cuMemAlloc_v2(ctypes.byref(d), SZ(size)), "cuMemAlloc")
d2 = ULL()
ok(cu.cuMemAlloc_v2(ctypes.byref(d2), SZ(size)), "cuMemAlloc")
pinned2 = V()
ok(cu.cuMemHostAlloc(ctypes.byref(pinned2), SZ(size), 0), "cuMemHostAlloc")
ctypes.memset(pinned, 1, size)
ctypes.memset(pinned2, 2, size)


def best(f, n=3):
    times = []
    for _ in range(n):
        t = now()
        f()
        times.append(now() - t)
    return min(times)


h2d = size / best(lambda: ok(cu.cuMemcpyHtoD_v2(d, pinned, SZ(size)), "HtoD")) / 1e9
d2h = size / best(lambda: ok(cu.cuMemcpyDtoH_v2(pinned2, d2, SZ(size)), "DtoH")) / 1e9
line("copy: pinned host to device", h2d, "GB/s")
line("copy: pinned device to host", d2h, "GB/s")
s1, s2 = V(), V()
ok(cu.cuStreamCreate(ctypes.byref(s1), 1), "stream")
ok(cu.cuStreamCreate(ctypes.byref(s2), 1), "stream")


def duplex():
    ok(cu.cuMemcpyHtoDAsync_v2(d, pinned, SZ(size), s1), "HtoDAsync")
    ok(cu.cuMemcpyDtoHAsync_v2(pinned2, d2, SZ(size), s2), "DtoHAsync")
    ok(cu.cuStreamSynchronize(s1), "sync")
    ok(cu.cuStreamSynchronize(s2), "sync")


dup = size / best(duplex) / 1e9
line("copy: both ways at once, each way", dup, "GB/s", f"({dup / max(h2d, d2h):.2f}x of the faster one alone)")
m, addr = anon(size, False)
touch(m)
ph2d = size / best(lambda: ok(cu.cuMemcpyHtoD_v2(d, V(addr), SZ(size)), "HtoD")) / 1e9
pd2h = size / best(lambda: ok(cu.cuMemcpyDtoH_v2(V(addr), d2, SZ(size)), "DtoH")) / 1e9
line("copy: pageable host to device", ph2d, "GB/s", f"({ph2d / h2d:.2f}x of pinned)")
line("copy: pageable device to host", pd2h, "GB/s", f"({pd2h / d2h:.2f}x of pinned)")
del addr
m.close()
ok(cu.cuMemFree_v2(d), "free")
ok(cu.cuMemFree_v2(d2), "free")

# VMM: what a swap-in does per segment.
prop = (ctypes.c_int * 8)(1, 0, 1, 0, 0, 0, 0, 0)  # pinned, device 0
access = (ctypes.c_int * 3)(1, 0, 3)  # device 0, read-write
for seg in (MIB2, 64 << 20, GIB):
    n = size // seg
    hs = [ULL() for _ in range(n)]
    t = now()
    for h in hs:
        ok(cu.cuMemCreate(ctypes.byref(h), SZ(seg), prop, ULL(0)), "cuMemCreate")
    create = now() - t
    va = ULL()
    ok(cu.cuMemAddressReserve(ctypes.byref(va), SZ(size), SZ(0), ULL(0), ULL(0)), "reserve")
    t = now()
    for i, h in enumerate(hs):
        ok(cu.cuMemMap(ULL(va.value + i * seg), SZ(seg), SZ(0), h, ULL(0)), "cuMemMap")
    mapt = now() - t
    t = now()
    for i in range(n):
        ok(cu.cuMemSetAccess(ULL(va.value + i * seg), SZ(seg), access, SZ(1)), "cuMemSetAccess")
    acc = now() - t
    t = now()
    for i in range(n):
        ok(cu.cuMemUnmap(ULL(va.value + i * seg), SZ(seg)), "cuMemUnmap")
    unmap = now() - t
    t = now()
    for h in hs:
        ok(cu.cuMemRelease(h), "cuMemRelease")
    rel = now() - t
    ok(cu.cuMemAddressFree(va, SZ(size)), "free")
    pages = size / MIB2
    tag = f"{seg >> 20} MiB handles"
    line(f"vmm: cuMemCreate, {tag}", create / pages * 1e6, "us per 2 MiB", f"({size / create / 1e9:.1f} GB/s)")
    line(f"vmm: cuMemMap, {tag}", mapt / pages * 1e6, "us per 2 MiB")
    line(f"vmm: cuMemSetAccess, {tag}", acc / pages * 1e6, "us per 2 MiB")
    line(f"vmm: cuMemUnmap, {tag}", unmap / pages * 1e6, "us per 2 MiB")
    line(f"vmm: cuMemRelease, {tag}", rel / pages * 1e6, "us per 2 MiB")
    line(f"vmm: swap-in bound, {tag}", size / (create + mapt + acc) / 1e9, "GB/s",
         f"(create+map+access; {size / (create + mapt + acc) / 1e9 / h2d:.2f}x of the pinned copy)")
