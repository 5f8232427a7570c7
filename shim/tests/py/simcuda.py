"""The driver-API set-up the Python test scripts share: libcuda.so.1 through ctypes
(the simulator in the tests; with libkiwi.so preloaded, its symbols resolve to the
shim's wrappers) and a context made current, as an application's first steps."""

import ctypes
import sys


def check(r, what):
    """Exits the script with a line naming the call when `r` is a CUDA error."""
    if r != 0:
        sys.exit("%s failed: CUDA error %d" % (what, r))


def open_context():
    """cuInit, device 0's primary context made current; returns the library."""
    cuda = ctypes.CDLL("libcuda.so.1")
    check(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return cuda
