"""Kiwi from inside a Python process: what the GPU sharing is doing to *this* process.

``libkiwi.so`` (preloaded by ``kiwictl run`` or in a Kiwi container) exports
``kiwi_status_json``; this package reads it through :mod:`ctypes`. Standard library
only.

- :func:`available`: whether the shim is loaded in this process.
- :func:`status`: this process's GPUs (a list of dicts, see ``docs/shim.md``); raises
  :class:`KiwiNotLoaded` without the shim.
- ``%load_ext kiwi`` (IPython): while a cell waits for the GPU, a live line on stderr
  says who holds it, its time left and the place in the queue; after a cell that
  waited, one summary line. Without the shim it says so once and does nothing.
- :func:`enable` (``%load_ext kiwi`` calls it too): a thread that tells the shim,
  before each swap-out, which GPU memory is dead (PyTorch's cached free blocks), so
  the swap-out does not copy it. :func:`hint_stats` counts what it did.
"""

import ctypes
import json
import sys
import threading
import time

__all__ = [
    "KiwiNotLoaded",
    "available",
    "status",
    "describe_wait",
    "enable",
    "disable",
    "hint_stats",
    "torch_dead_ranges",
    "load_ipython_extension",
    "unload_ipython_extension",
]
__version__ = "0.1.0"

NOT_LOADED = (
    "libkiwi.so is not loaded in this process: run it under `kiwictl run` "
    "or in a container of Kiwi's runtime"
)


class KiwiNotLoaded(RuntimeError):
    """The Kiwi shim is not loaded in this process."""


_lock = threading.Lock()
_status_fn = None  # None: not looked up yet; False: absent


def _fn():
    global _status_fn
    with _lock:
        if _status_fn is None:
            try:
                f = ctypes.CDLL(None).kiwi_status_json
            except (AttributeError, OSError):
                _status_fn = False
            else:
                f.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                f.restype = ctypes.c_ssize_t
                _status_fn = f
        return _status_fn or None


def _explain(on):
    """Shows (1) or silences (0) the shim's own wait lines on stderr; -1 asks.
    Returns whether they were shown (None without the shim)."""
    if _fn() is None:
        return None
    try:
        f = ctypes.CDLL(None).kiwi_explain
    except (AttributeError, OSError):
        return None
    f.argtypes = [ctypes.c_int]
    f.restype = ctypes.c_int
    return bool(f(on))


def available():
    """Whether ``libkiwi.so`` is loaded in this process."""
    return _fn() is not None


def _raw():
    f = _fn()
    if f is None:
        raise KiwiNotLoaded(NOT_LOADED)
    size = 4096
    for _ in range(8):
        buf = ctypes.create_string_buffer(size)
        n = f(buf, size)
        if n < 0:
            raise RuntimeError("kiwi_status_json failed inside libkiwi.so")
        if n < size:
            return json.loads(buf.value.decode("utf-8"))
        size = n + 1024
    raise RuntimeError("kiwi_status_json kept growing")


def status():
    """This process's GPUs, one dict each.

    Keys: ``index``, ``uuid``, ``holding``, ``exclusive``, ``waiting``, ``holder``,
    ``other_holders``, ``ahead``, ``quantum_left_s``, ``reason`` (while waiting),
    ``working_set_bytes``, ``resident_bytes``, ``swapped_bytes``, ``wait_s`` (this
    wait so far), ``waited_s``, ``held_s`` (totals, the current wait or hold
    included), ``grants``, ``last_wait_s``, ``last_swap_in_bytes``,
    ``last_swap_in_s``. An empty list before the process used a GPU.

    Raises :class:`KiwiNotLoaded` when the shim is not loaded.
    """
    return _raw()["gpus"]


def describe_wait(gpu):
    """The live line for a waiting GPU: "waiting for GPU 0: nb-a holds it, ~12 s
    left, 1 ahead of you"."""
    return "waiting for GPU %s: %s" % (gpu.get("index"), gpu.get("reason") or "waiting")


def _mib(n):
    if n >= 1 << 30:
        return "%.1f GiB" % (n / float(1 << 30))
    return "%.0f MiB" % (n / float(1 << 20))


# --- the discard hint (issue #26) -----------------------------------------------
#
# Before a swap-out (the gate closed, this process's GPU work drained) the shim asks
# which memory is dead; the "kiwi-hint" thread answers with kiwiMemDiscard for each
# dead range, then kiwi_hint_done. The swap-out leaves those bytes behind (they come
# back uninitialised). It waits KIWI_HINT_WAIT_MS (10 ms) at most for the answer, and
# any submission of this process after the question opened voids the answer, so a
# snapshot taken after the question can never lose a live byte.
#
# PyTorch's source of dead ranges: the caching allocator's snapshot,
# torch.cuda.memory_snapshot() (torch/cuda/memory.py; the format is the docstring of
# torch.cuda.memory._snapshot, and the "Understanding CUDA Memory Usage" page,
# docs/source/torch_cuda_memory): a list of segments, one per cudaMalloc, each
#   {"device", "address", "total_size", "segment_type": "small"|"large",
#    "is_expandable" (newer), "blocks": [...], ...}
# and each block
#   {"address" (newer; older versions lack it: the blocks tile the segment in
#    order, so it is the segment's address plus the sizes of the blocks before it),
#    "size", "state": "active_allocated" | "active_pending_free" | "inactive", ...}
# Only "inactive" blocks are free (cached, no tensor uses them); "active_pending_free"
# ones still wait on another stream's work. (The _snapshot docstring spells that
# state "active_awaiting_free"; the C++ that builds the dicts, torch/csrc/cuda/
# Module.cpp (THCPModule_memorySnapshot), later memory_snapshot.cpp, writes
# "active_pending_free". Neither is "inactive": neither is declared dead. The
# PyTorch 2.0-era Module.cpp writes no block "address" and no "is_expandable".)
# Expandable segments (expandable_segments:True) are mapped by PyTorch itself with
# cuMemCreate/cuMemMap, not allocations of the shim's: skipped.
#
# Nothing cheaper exists: memory_snapshot() is a thin wrapper over
# torch._C._cuda_memorySnapshot(...)["segments"], _snapshot() returns the same call
# whole (with the allocator's trace ring), memory_stats() has totals only. Since
# PyTorch 2.11, memory_snapshot(include_traces=False) leaves the trace entries out
# (the "lightweight/fast snapshot"): used where accepted.
#
# CuPy is not a source: its MemoryPool shows only totals (free_bytes(),
# n_free_blocks()); its free chunks live in C-level arenas (docs/shim.md, "From
# Python, in a notebook").

#: How long one kiwi_hint_wait call waits for a question, in ms (then it looks
#: whether disable() was called).
HINT_POLL_MS = 500
#: Dead ranges smaller than this are not declared: the calls would cost more than
#: the copy they save (and the shim keeps a bounded list of ranges per segment).
MIN_DEAD_BYTES = 1 << 20

_hint_lock = threading.Lock()
_hint_thread = None
_hint_stop = None
_hint_said = False
_stats_lock = threading.Lock()
_stats = {
    "questions": 0,
    "answered": 0,
    "ranges": 0,
    "bytes": 0,
    "refused": 0,
    "errors": 0,
    "seconds_last": 0.0,
}
# Keyword arguments memory_snapshot() accepts (include_traces: PyTorch >= 2.11).
_snapshot_kwargs = {"include_traces": False}


def hint_stats():
    """What the ``kiwi-hint`` thread did, as a dict: ``questions`` (swap-outs that
    asked), ``answered``, ``ranges`` and ``bytes`` (dead ranges declared, and their
    bytes), ``refused`` (ranges the shim refused: not its memory), ``errors`` (a
    source that failed; the answer was then empty), ``seconds_last`` (how long the
    last answer took)."""
    with _stats_lock:
        return dict(_stats)


def _count(**kw):
    with _stats_lock:
        for k, v in kw.items():
            if k == "seconds_last":
                _stats[k] = v
            else:
                _stats[k] += v


def torch_dead_ranges(segments, min_bytes=0):
    """The dead ranges of a PyTorch memory snapshot (the list
    ``torch.cuda.memory_snapshot()`` returns): ``[(address, bytes), ...]``, one per
    run of adjacent ``inactive`` blocks within one segment, largest first. Blocks in
    any other state, expandable segments and ranges under ``min_bytes`` are left
    out; so is anything that does not lie inside its segment."""
    out = []
    for seg in segments or ():
        try:
            if seg.get("is_expandable"):
                continue
            base = int(seg["address"])
            end = base + int(seg.get("total_size", 0))
            cursor = base
            run = None  # [start, end) of the current run of inactive blocks
            for b in seg.get("blocks") or ():
                size = int(b.get("size", 0))
                start = int(b["address"]) if b.get("address") is not None else cursor
                cursor = start + size
                inside = base <= start and cursor <= end
                if b.get("state") == "inactive" and size > 0 and inside:
                    if run is not None and run[1] == start:
                        run[1] = cursor
                        continue
                    if run is not None:
                        out.append((run[0], run[1] - run[0]))
                    run = [start, cursor]
                elif run is not None:
                    out.append((run[0], run[1] - run[0]))
                    run = None
            if run is not None:
                out.append((run[0], run[1] - run[0]))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    out = [r for r in out if r[1] >= max(min_bytes, 1)]
    out.sort(key=lambda r: -r[1])
    return out


def _torch_segments():
    """PyTorch's snapshot when this process imported torch and initialised CUDA;
    else None. Never imports torch."""
    global _snapshot_kwargs
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    # (A torch still being imported by another thread may lack either.)
    initialized = getattr(cuda, "is_initialized", None)
    if initialized is None or not initialized():
        return None
    if _snapshot_kwargs:
        try:
            return cuda.memory_snapshot(**_snapshot_kwargs)
        except TypeError:  # an older PyTorch: no include_traces
            _snapshot_kwargs = {}
    return cuda.memory_snapshot()


def _dead_ranges():
    segments = _torch_segments()
    if segments is None:
        return []
    return torch_dead_ranges(segments, MIN_DEAD_BYTES)


def _hint_fns():
    """(kiwi_hint_wait, kiwi_hint_done, kiwiMemDiscard) from the shim, or None."""
    if _fn() is None:
        return None
    try:
        lib = ctypes.CDLL(None)
        wait, done, discard = lib.kiwi_hint_wait, lib.kiwi_hint_done, lib.kiwiMemDiscard
    except (AttributeError, OSError):
        return None
    wait.argtypes = [ctypes.c_int]
    wait.restype = ctypes.c_int64
    done.argtypes = [ctypes.c_int64]
    done.restype = None
    discard.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    discard.restype = ctypes.c_int
    return wait, done, discard


def _answer(qid, done, discard):
    t0 = time.monotonic()
    ranges = nbytes = refused = errors = 0
    try:
        for addr, size in _dead_ranges():
            if discard(addr, size) == 0:
                ranges += 1
                nbytes += size
            else:
                refused += 1
    except Exception:  # a source failed: the answer is what was declared so far
        errors = 1
    try:
        # Counted first: once done, the swap-out goes on and the application may read
        # the stats.
        _count(
            answered=1,
            ranges=ranges,
            bytes=nbytes,
            refused=refused,
            errors=errors,
            seconds_last=time.monotonic() - t0,
        )
    finally:
        done(qid)


def _hint_loop(stop, fns):
    wait, done, discard = fns
    while not stop.is_set():
        try:
            # ctypes releases the GIL for the call: the thread costs nothing while
            # it waits.
            qid = wait(HINT_POLL_MS)
            if qid > 0:
                _count(questions=1)
                _answer(qid, done, discard)
        except Exception:
            _count(errors=1)
            stop.wait(0.1)


def enable(stream=None):
    """Starts, once per process, the ``kiwi-hint`` thread: before each swap-out it
    tells the shim which GPU memory is dead (PyTorch's cached free blocks, when this
    process uses PyTorch's CUDA), so the swap-out does not copy it. Never imports
    torch; never raises into the application. Returns True when the thread runs;
    without the shim it says so once (on ``stream``, stderr by default) and returns
    False."""
    global _hint_thread, _hint_stop, _hint_said
    fns = _hint_fns()
    with _hint_lock:
        if fns is None:
            if not _hint_said:
                _hint_said = True
                out = stream if stream is not None else sys.stderr
                try:
                    out.write("kiwi: %s; kiwi.enable() does nothing\n" % NOT_LOADED)
                except (OSError, ValueError):
                    pass
            return False
        if _hint_thread is not None and _hint_thread.is_alive():
            return True
        _hint_stop = threading.Event()
        _hint_thread = threading.Thread(
            target=_hint_loop, args=(_hint_stop, fns), name="kiwi-hint", daemon=True
        )
        _hint_thread.start()
        return True


def disable():
    """Stops the ``kiwi-hint`` thread (it leaves within ``HINT_POLL_MS``). Returns
    whether it was running."""
    global _hint_thread
    with _hint_lock:
        t, _hint_thread = _hint_thread, None
        if t is None:
            return False
        _hint_stop.set()
    if t is not threading.current_thread():
        t.join()
    return True


# --- the IPython extension ------------------------------------------------------

#: A GPU that waited at least this long during a cell gets the summary line.
SUMMARY_AFTER_S = 0.1
#: The live line appears once a wait is this old (short waits do not flicker).
SHOW_AFTER_S = 0.3


class _Watcher:
    """One cell's watcher: a thread that polls :func:`status` and keeps one live
    line on ``stream`` (carriage-return updates) while a GPU waits."""

    def __init__(self, stream=None, interval=0.2):
        self.stream = stream
        self.interval = interval
        self.before = {}
        self.holders = {}
        self.shown = 0
        self._stop = threading.Event()
        self._thread = None

    def _out(self):
        return self.stream if self.stream is not None else sys.stderr

    def _write(self, text):
        out = self._out()
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            pass

    def _show(self, line):
        pad = max(0, self.shown - len(line))
        self._write("\r" + line + " " * pad)
        self.shown = len(line)

    def _clear(self):
        if self.shown:
            self._write("\r" + " " * self.shown + "\r")
            self.shown = 0

    def start(self):
        try:
            self.before = {g["uuid"]: g for g in status()}
        except (KiwiNotLoaded, RuntimeError, ValueError):
            self.before = {}
        self._thread = threading.Thread(target=self._run, name="kiwi-watch", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self):
        try:
            gpus = status()
        except (KiwiNotLoaded, RuntimeError, ValueError):
            return
        waiting = [g for g in gpus if g.get("waiting") and g.get("wait_s", 0) >= SHOW_AFTER_S]
        for g in gpus:
            if g.get("waiting") and g.get("holder"):
                self.holders[g["uuid"]] = g["holder"]
        if waiting:
            self._show(describe_wait(waiting[0]))
        else:
            self._clear()

    def stop(self):
        """Stops the thread, clears the line and returns the summary (or None)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._clear()
        try:
            after = status()
        except (KiwiNotLoaded, RuntimeError, ValueError):
            return None
        parts = []
        for g in after:
            b = self.before.get(g["uuid"], {})
            waited = g.get("waited_s", 0) - b.get("waited_s", 0)
            if waited < SUMMARY_AFTER_S:
                continue
            text = "waited %.1f s for GPU %s" % (waited, g.get("index"))
            holder = self.holders.get(g["uuid"])
            if holder:
                text += " (%s held it)" % holder
            if g.get("grants", 0) > b.get("grants", 0) and g.get("last_swap_in_bytes"):
                text += "; swapped in %s in %.2f s" % (
                    _mib(g["last_swap_in_bytes"]),
                    g.get("last_swap_in_s") or 0.0,
                )
            parts.append(text)
        if not parts:
            return None
        return "kiwi: this cell " + "; ".join(parts)


class _Extension:
    def __init__(self, stream=None, interval=0.2):
        self.stream = stream
        self.interval = interval
        self.watcher = None
        # The live line says it all: the shim's own two lines would interrupt it.
        self.shim_lines = _explain(0)

    def pre_run_cell(self, info=None):
        if self.watcher is not None:
            self.watcher.stop()
        self.watcher = _Watcher(self.stream, self.interval)
        self.watcher.start()

    def post_run_cell(self, result=None):
        w, self.watcher = self.watcher, None
        if w is None:
            return
        summary = w.stop()
        if summary:
            w._write(summary + "\n")


_extensions = {}


def load_ipython_extension(ip, stream=None, interval=0.2):
    """``%load_ext kiwi``: registers ``pre_run_cell``/``post_run_cell`` hooks on
    ``ip.events`` and starts the discard hint (:func:`enable`). Without the shim it
    prints one line and registers nothing. Returns whether hooks were registered."""
    out = stream if stream is not None else sys.stderr
    if not available():
        out.write("kiwi: %s; the extension does nothing\n" % NOT_LOADED)
        return False
    enable(stream)
    if id(ip) in _extensions:
        return True
    ext = _Extension(stream, interval)
    ip.events.register("pre_run_cell", ext.pre_run_cell)
    ip.events.register("post_run_cell", ext.post_run_cell)
    _extensions[id(ip)] = ext
    return True


def unload_ipython_extension(ip):
    """``%unload_ext kiwi``: removes the hooks."""
    ext = _extensions.pop(id(ip), None)
    if ext is None:
        return
    if ext.watcher is not None:
        ext.watcher.stop()
        ext.watcher = None
    if ext.shim_lines:
        _explain(1)
    ip.events.unregister("pre_run_cell", ext.pre_run_cell)
    ip.events.unregister("post_run_cell", ext.post_run_cell)
