/* A reset primary context, then work in another context (driver API, NVIDIA's
 * cuda.h), as a library that calls cudaDeviceReset and then makes its own context.
 * Usage:
 *   reset_then_work MIB BURSTS
 * Retains the primary context, works in it (a memset of 1 MiB), frees, resets it
 * (cuDevicePrimaryCtxReset) and releases it; then creates a context (cuCtxCreate),
 * allocates MIB MiB there and runs BURSTS bursts: a memset to a new value, every
 * byte copied back and checked, 50 ms apart (another program over capacity forces
 * drops meanwhile). Prints "OK"; exits 2 on a failed call, 3 on a wrong byte. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "check.h"

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: reset_then_work MIB BURSTS\n");
        return 1;
    }
    size_t n = (size_t)atoi(argv[1]) << 20;
    int bursts = atoi(argv[2]);
    CUdevice dev;
    CUcontext p, c;
    CUdeviceptr d;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&p, dev));
    CHECK(cuCtxSetCurrent(p));
    CHECK(cuMemAlloc(&d, 1 << 20));
    CHECK(cuMemsetD8(d, 1, 1 << 20));
    CHECK(cuMemFree(d));
    CHECK(cuCtxSynchronize());
    CHECK(cuDevicePrimaryCtxReset(dev));
    CHECK(cuDevicePrimaryCtxRelease(dev));
    CHECK(cuCtxCreate(&c, 0, dev));
    unsigned char *h = malloc(n);
    if (!h) return 1;
    CHECK(cuMemAlloc(&d, n));
    int bad = memset_bursts_verify(d, h, n, bursts);
    if (bad) return bad;
    CHECK(cuMemFree(d));
    CHECK(cuCtxDestroy(c));
    printf("OK\n");
    fflush(stdout);
    return 0;
}
