"""A notebook-like run under Kiwi: a "cell" that fills GPU memory through the CUDA
driver API (ctypes on libcuda.so.1, the simulator in the tests), with the `kiwi`
extension loaded on a stand-in for IPython (`ip.events`), or a real IPython shell
when KIWI_TEST_IPYTHON=1. Prints one JSON object: what kiwi.status() said before
CUDA, while the cell waited and after it. With KIWI_TEST_GATE set it prints "READY"
once everything but the cell is done (imports, the context, the allocation, the
extension loaded) and waits for a line on stdin before the cell (a start gate: the
test starts the holder's quantum, then lets the cell ask for the GPU)."""

import ctypes
import json
import os
import sys
import threading
import time

import kiwi
from simcuda import check, open_context

out = {"available": kiwi.available(), "before_cuda": kiwi.status()}
cuda = open_context()
size = int(os.environ.get("CELL_MIB", "700")) << 20
ptr = ctypes.c_uint64()
check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc_v2")


def cell():
    # Waits in the shim until this process holds the GPU.
    check(cuda.cuMemsetD8_v2(ptr, ctypes.c_ubyte(7), ctypes.c_size_t(size)), "cuMemsetD8_v2")
    check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")


seen = {}
done = threading.Event()


def watch():
    # kiwi.status() from another thread while the cell waits.
    while not done.is_set():
        for g in kiwi.status():
            if g["waiting"] and g.get("holder") and "waiting" not in seen:
                seen["waiting"] = g
        time.sleep(0.05)


def gate():
    if os.environ.get("KIWI_TEST_GATE"):
        print("READY", flush=True)
        sys.stdin.readline()


t = threading.Thread(target=watch, daemon=True)
t.start()
if os.environ.get("KIWI_TEST_IPYTHON") == "1":
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext kiwi", store_history=False)
    shell.user_ns["cell"] = cell
    gate()
    r = shell.run_cell("cell()", store_history=False)
    out["ipython_ok"] = r.success
else:

    class Events:
        def __init__(self):
            self.callbacks = {}

        def register(self, name, fn):
            self.callbacks.setdefault(name, []).append(fn)

        def unregister(self, name, fn):
            self.callbacks[name].remove(fn)

        def fire(self, name, *args):
            for fn in list(self.callbacks.get(name, [])):
                fn(*args)

    class FakeIPython:
        events = Events()

    ip = FakeIPython()
    out["loaded"] = kiwi.load_ipython_extension(ip, interval=0.1)
    out["hooks"] = sorted(ip.events.callbacks)
    gate()
    ip.events.fire("pre_run_cell", None)
    cell()
    ip.events.fire("post_run_cell", None)
    kiwi.unload_ipython_extension(ip)
    out["hooks_after_unload"] = sum(len(v) for v in ip.events.callbacks.values())
done.set()
t.join()
out["waiting"] = seen.get("waiting")
out["after"] = kiwi.status()
sys.stderr.flush()
print(json.dumps(out))
