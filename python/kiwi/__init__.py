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
    ``ip.events``. Without the shim it prints one line and registers nothing.
    Returns whether hooks were registered."""
    out = stream if stream is not None else sys.stderr
    if not available():
        out.write("kiwi: %s; the extension does nothing\n" % NOT_LOADED)
        return False
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
