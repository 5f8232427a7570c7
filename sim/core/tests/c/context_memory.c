/* Each context costs device memory that is never the application's to free or
 * swap (KIWI_SIM_CONTEXT_MEMORY): cuMemGetInfo shows it, allocations beyond the
 * capacity that counts it fail with CUDA_ERROR_OUT_OF_MEMORY, a context that does
 * not fit is refused, and destroying or resetting a context gives it back.
 * Every check fails on a simulator whose contexts cost nothing.
 *
 * usage: context_memory check <context MiB>   prints "OK" or names the failure
 *        context_memory hold                  retains a context, prints READY, sleeps
 * Compiled against NVIDIA's cuda.h, linked with -lcuda; one GPU of 1 GiB. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver_check.h"

#define EXPECT_FREE(want)                                                      \
    do {                                                                       \
        size_t f_, t_;                                                         \
        CHECK(cuMemGetInfo(&f_, &t_));                                         \
        if (f_ != (size_t)(want) || t_ != GIB) {                               \
            fprintf(stderr, "FAIL %s:%d free %zu MiB of %zu MiB, want %zu MiB\n", \
                    __FILE__, __LINE__, f_ >> 20, t_ >> 20,                    \
                    (size_t)(want) >> 20);                                     \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

static const size_t GIB = (size_t)1 << 30;
static const size_t MIB = (size_t)1 << 20;

int main(int argc, char **argv) {
    CUdevice dev;
    CUcontext primary, extra;
    CUdeviceptr a, b;

    if (argc < 2) {
        fprintf(stderr, "usage: context_memory check MIB | hold\n");
        return 2;
    }
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&primary, dev));
    CHECK(cuCtxSetCurrent(primary));

    if (strcmp(argv[1], "hold") == 0) {
        printf("READY\n");
        fflush(stdout);
        for (;;)
            pause();
    }
    if (strcmp(argv[1], "check") != 0 || argc < 3) {
        fprintf(stderr, "usage: context_memory check MIB | hold\n");
        return 2;
    }
    const size_t ctx = (size_t)atol(argv[2]) * MIB;
    if (ctx == 0 || ctx * 2 >= GIB) {
        fprintf(stderr, "context memory must be between 1 MiB and 511 MiB\n");
        return 2;
    }

    /* The primary context's memory is used from its first activation on. */
    EXPECT_FREE(GIB - ctx);

    /* Everything else is the application's: exactly that much can be allocated,
     * not a byte more. */
    CHECK(cuMemAlloc(&a, GIB - ctx));
    EXPECT_FREE(0);
    EXPECT(cuMemAlloc(&b, MIB), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(cuMemFree(a));
    EXPECT(cuMemAlloc(&a, GIB - ctx + MIB), CUDA_ERROR_OUT_OF_MEMORY);

    /* A second context does not fit next to an allocation that leaves less than
     * its cost free (Driver API reference, cuCtxCreate: CUDA_ERROR_OUT_OF_MEMORY),
     * and fits once the allocation is gone. */
    CHECK(cuMemAlloc(&a, GIB - 2 * ctx + MIB));
    EXPECT(cuCtxCreate(&extra, 0, dev), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(cuMemFree(a));
    CHECK(cuCtxCreate(&extra, 0, dev));
    EXPECT_FREE(GIB - 2 * ctx);
    /* cuMemFree of everything the application has does not give it back. */
    CHECK(cuMemAlloc(&a, MIB));
    CHECK(cuMemFree(a));
    EXPECT_FREE(GIB - 2 * ctx);

    /* Destroying a context gives its memory back. */
    CHECK(cuCtxDestroy(extra));
    CHECK(cuCtxSetCurrent(primary));
    EXPECT_FREE(GIB - ctx);

    /* Resetting the primary context gives its memory back (seen from another
     * context), and the next retain takes it again. */
    CHECK(cuDevicePrimaryCtxReset(dev));
    CHECK(cuCtxCreate(&extra, 0, dev));
    EXPECT_FREE(GIB - ctx);
    CHECK(cuCtxDestroy(extra));
    CHECK(cuDevicePrimaryCtxRetain(&primary, dev));
    CHECK(cuCtxSetCurrent(primary));
    EXPECT_FREE(GIB - ctx);

    printf("OK\n");
    return 0;
}
