/* Work in an older context while a newer one lives (driver API, NVIDIA's cuda.h):
 * two cuCtxCreate contexts on device 0, the first made current again. Usage:
 *   older_context MIB BURSTS [destroy-newer]
 * With destroy-newer the newer context is destroyed first (the older lives on).
 * Allocates MIB MiB in the older context and runs BURSTS bursts: a 150 ms spin
 * kernel and a fill of the memory queued behind it (so work is in flight when a
 * drop comes), a cuCtxSynchronize, every word copied back and checked, 50 ms
 * apart (another program over capacity forces drops meanwhile). Prints "OK";
 * exits 2 on a failed call, 3 on a wrong word. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "check.h"

int main(int argc, char **argv) {
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: older_context MIB BURSTS [destroy-newer]\n");
        return 1;
    }
    size_t n = (size_t)atoi(argv[1]) << 20;
    int bursts = atoi(argv[2]);
    CUdevice dev;
    CUcontext older, newer;
    CUmodule m;
    CUfunction spin, fill;
    CUdeviceptr d;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate(&older, 0, dev));
    CHECK(cuCtxCreate(&newer, 0, dev));
    if (argc == 4)
        CHECK(cuCtxDestroy(newer));
    CHECK(cuCtxSetCurrent(older));
    CHECK(cuModuleLoadData(&m, "kiwi"));
    CHECK(cuModuleGetFunction(&spin, m, "kiwi_spin"));
    CHECK(cuModuleGetFunction(&fill, m, "kiwi_fill"));
    CHECK(cuMemAlloc(&d, n));
    unsigned *h = malloc(n);
    if (!h) return 1;
    unsigned long long words = n / 4, ns = 150000000ull;
    for (int b = 0; b < bursts; b++) {
        unsigned v = (unsigned)(b * 7 + 3);
        void *spin_args[] = {&ns};
        void *fill_args[] = {&d, &v, &words};
        CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, NULL, spin_args, NULL));
        CHECK(cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, NULL, fill_args, NULL));
        CHECK(cuCtxSynchronize());
        CHECK(cuMemcpyDtoH(h, d, n));
        for (size_t i = 0; i < words; i++)
            if (h[i] != v) {
                printf("burst %d: word %zu is %u, want %u\n", b, i, h[i], v);
                return 3;
            }
        usleep(50000);
    }
    CHECK(cuMemFree(d));
    printf("OK\n");
    fflush(stdout);
    return 0;
}
