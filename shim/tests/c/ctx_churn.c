/* Contexts that come and go before the work (driver API, NVIDIA's cuda.h). Usage:
 *   ctx_churn destroy|reset|modules|reset-modules|release-modules MIB BURSTS
 * destroy: cuCtxCreate twice, then cuCtxDestroy of the first (the second lives on;
 *          created while the first lives, it cannot reuse its handle).
 * reset:   retain the primary context, cuDevicePrimaryCtxReset, release, then a
 *          cuCtxCreate context and the primary one retained again.
 * modules: cuCtxCreate twice; in the first, a module loaded (its code too: a
 *          function got) and a 64 MiB malloc heap set; then cuCtxDestroy of the
 *          first a second later, which takes both with it (the second lives on).
 * reset-modules: the same in the retained primary context, which
 *          cuDevicePrimaryCtxReset then destroys (as cudaDeviceReset), taking both
 *          with it; released, then a cuCtxCreate context.
 * release-modules: the same, but only released: the driver resets the primary
 *          context when its last reference goes.
 * Then allocates MIB MiB in the last context and runs BURSTS bursts: a memset to a
 * new value, every byte copied back and checked, 50 ms apart (another program over
 * capacity forces drops meanwhile). Prints "OK"; exits 2 on a failed call, 3 on a
 * wrong byte. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: ctx_churn destroy|reset|modules|reset-modules|release-modules MIB BURSTS\n");
        return 1;
    }
    size_t n = (size_t)atoi(argv[2]) << 20;
    int bursts = atoi(argv[3]);
    CUdevice dev;
    CUcontext c1, c2, p;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    if (strcmp(argv[1], "destroy") == 0) {
        CHECK(cuCtxCreate(&c1, 0, dev));
        CHECK(cuCtxCreate(&c2, 0, dev));
        CHECK(cuCtxDestroy(c1));
        CHECK(cuCtxSetCurrent(c2));
    } else if (strcmp(argv[1], "modules") == 0) {
        CUmodule m;
        CUfunction f;
        CHECK(cuCtxCreate(&c1, 0, dev));
        CHECK(cuCtxCreate(&c2, 0, dev));
        CHECK(cuCtxSetCurrent(c1));
        CHECK(cuModuleLoadData(&m, "kiwi"));
        CHECK(cuModuleGetFunction(&f, m, "kiwi_fill"));
        CHECK(cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 64u << 20));
        /* Long enough for the shim to report them (its turn's next tick). */
        usleep(1000 * 1000);
        CHECK(cuCtxDestroy(c1));
        CHECK(cuCtxSetCurrent(c2));
    } else if (strcmp(argv[1], "reset-modules") == 0 || strcmp(argv[1], "release-modules") == 0) {
        CUmodule m;
        CUfunction f;
        CHECK(cuDevicePrimaryCtxRetain(&p, dev));
        CHECK(cuCtxSetCurrent(p));
        CHECK(cuModuleLoadData(&m, "kiwi"));
        CHECK(cuModuleGetFunction(&f, m, "kiwi_fill"));
        CHECK(cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 64u << 20));
        usleep(1000 * 1000);
        if (strcmp(argv[1], "reset-modules") == 0)
            CHECK(cuDevicePrimaryCtxReset(dev));
        CHECK(cuDevicePrimaryCtxRelease(dev));
        CHECK(cuCtxCreate(&c2, 0, dev));
    } else {
        CHECK(cuDevicePrimaryCtxRetain(&p, dev));
        CHECK(cuCtxSetCurrent(p));
        CHECK(cuCtxSynchronize());
        CHECK(cuDevicePrimaryCtxReset(dev));
        CHECK(cuDevicePrimaryCtxRelease(dev));
        CHECK(cuCtxCreate(&c2, 0, dev));
        CHECK(cuCtxDestroy(c2));
        CHECK(cuDevicePrimaryCtxRetain(&p, dev));
        CHECK(cuCtxSetCurrent(p));
    }
    CUdeviceptr d;
    unsigned char *h = malloc(n);
    if (!h) return 1;
    CHECK(cuMemAlloc(&d, n));
    int bad = memset_bursts_verify(d, h, n, bursts);
    if (bad) return bad;
    CHECK(cuMemFree(d));
    printf("OK\n");
    fflush(stdout);
    return 0;
}
