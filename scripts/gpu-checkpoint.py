#!/usr/bin/env python3
"""The driver's checkpoint API on a real GPU, without Kiwi: what the simulator models
(sim/cuda/src/checkpoint.rs, docs/checkpoint.md). Prints one line per fact.

A child process (PyTorch) holds GIB GiB with a known pattern and a context; this
process, through libcuda.so.1 and ctypes, reads its state, tries the transitions the
driver should refuse, locks it (with a timeout), checkpoints it (timed, with
nvidia-smi's used memory before and after), restores it (timed) and unlocks it; the
child then checks every element. Also: a pid without CUDA state, and a lock while the
child's work is still queued.

Usage: scripts/gpu-checkpoint.py [GIB]   (needs root or CAP_SYS_ADMIN, driver 570+)
"""
import ctypes
import subprocess
import sys
import time

GIB = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
NAMES = {0: "CUDA_SUCCESS", 1: "INVALID_VALUE", 2: "OUT_OF_MEMORY", 3: "NOT_INITIALIZED",
         401: "ILLEGAL_STATE", 600: "NOT_READY", 800: "NOT_PERMITTED", 801: "NOT_SUPPORTED",
         909: "TIMEOUT"}
STATES = {0: "RUNNING", 1: "LOCKED", 2: "CHECKPOINTED", 3: "FAILED"}

CHILD = r"""
import sys, time, torch
n = int(float(sys.argv[1]) * (1 << 30)) // 4
x = torch.arange(n, device="cuda", dtype=torch.int32)
torch.cuda.synchronize()
print("ready", flush=True)
cmd = sys.stdin.readline().strip()
while cmd:
    if cmd == "spin":   # ~2 s of queued work, not waited for
        a = torch.randn(8192, 8192, device="cuda")
        for _ in range(200):
            a = a @ a
            a = a / a.norm()
        print("queued", flush=True)
    elif cmd == "check":
        ok = bool((x == torch.arange(n, device="cuda", dtype=torch.int32)).all())
        print(f"ok={ok}", flush=True)
    cmd = sys.stdin.readline().strip()
"""


class LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


def used_mib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else -1


def main():
    cu = ctypes.CDLL("libcuda.so.1")
    for name in ["cuCheckpointProcessGetState", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                 "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock",
                 "cuCheckpointProcessGetRestoreThreadId"]:
        if not hasattr(cu, name):
            print(f"checkpoint API: missing {name} (driver older than 570)")
            return
    name = lambda r: f"{r} {NAMES.get(r, '?')}"
    state = ctypes.c_uint(99)
    r = cu.cuCheckpointProcessGetState(1, ctypes.byref(state))
    print(f"before cuInit, get state: {name(r)}")
    assert cu.cuInit(0) == 0

    child = subprocess.Popen([sys.executable, "-c", CHILD, str(GIB)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    pid = child.pid
    plain = subprocess.Popen(["sleep", "60"])

    def st(p):
        s = ctypes.c_uint(99)
        r = cu.cuCheckpointProcessGetState(p, ctypes.byref(s))
        return name(r) if r else STATES.get(s.value, s.value)

    def step(f, p, arg=None):
        t = time.perf_counter()
        r = f(p, arg)
        return r, (time.perf_counter() - t) * 1e3

    print(f"pid without CUDA state: get state {st(plain.pid)}, lock {name(cu.cuCheckpointProcessLock(plain.pid, None))}")
    tid = ctypes.c_int(0)
    r = cu.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid))
    print(f"restore thread id: {name(r)} tid {tid.value} (pid {pid})")
    print(f"running: state {st(pid)}; checkpoint {name(cu.cuCheckpointProcessCheckpoint(pid, None))}, "
          f"restore {name(cu.cuCheckpointProcessRestore(pid, None))}, unlock {name(cu.cuCheckpointProcessUnlock(pid, None))}")

    # A lock while ~2 s of work is queued: with a 100 ms timeout, then without.
    child.stdin.write("spin\n"); child.stdin.flush()
    assert child.stdout.readline().strip() == "queued"
    a = LockArgs(100, 0)
    r, ms = step(cu.cuCheckpointProcessLock, pid, ctypes.byref(a))
    print(f"lock with 100 ms timeout and work queued: {name(r)} after {ms:.0f} ms, state then {st(pid)}")
    if r == 0:
        cu.cuCheckpointProcessUnlock(pid, None)
    a = LockArgs(0, 0)
    r, ms = step(cu.cuCheckpointProcessLock, pid, ctypes.byref(a))
    print(f"lock without timeout: {name(r)} after {ms:.0f} ms, state {st(pid)}; "
          f"lock again {name(cu.cuCheckpointProcessLock(pid, None))}, restore {name(cu.cuCheckpointProcessRestore(pid, None))}")

    before = used_mib()
    r, ck_ms = step(cu.cuCheckpointProcessCheckpoint, pid)
    after = used_mib()
    print(f"checkpoint of {GIB} GiB + context: {name(r)} in {ck_ms:.0f} ms; used {before} -> {after} MiB; state {st(pid)}; "
          f"unlock {name(cu.cuCheckpointProcessUnlock(pid, None))}")
    r, rs_ms = step(cu.cuCheckpointProcessRestore, pid)
    print(f"restore: {name(r)} in {rs_ms:.0f} ms; used {used_mib()} MiB; state {st(pid)}")
    r = cu.cuCheckpointProcessUnlock(pid, None)
    print(f"unlock: {name(r)}; state {st(pid)}")
    child.stdin.write("check\n"); child.stdin.flush()
    print(f"child after restore: {child.stdout.readline().strip()}")
    child.stdin.close(); child.wait(); plain.kill()


if __name__ == "__main__":
    main()
