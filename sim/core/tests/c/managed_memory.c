/* Managed memory takes device memory where it is, as with the driver: nothing when
 * allocated (an allocation may exceed what the device has free), each 2 MiB block
 * once a device touches it (a memset) or a prefetch moves it there, given back by a
 * prefetch to the host and by cuMemFree. A block that finds no room stays on the
 * host; the bytes are right wherever they are. Every check fails on a simulator
 * that keeps managed memory always resident.
 *
 * Run on a GPU of 1 GiB or more; prints "OK" or names the failure.
 * Compiled against NVIDIA's cuda.h, linked with -lcuda; one GPU. */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "driver_check.h"

static size_t free_now(void) {
    size_t f, t;
    CHECK(cuMemGetInfo(&f, &t));
    return f;
}

#define EXPECT_FREE(want)                                                      \
    do {                                                                       \
        size_t f_ = free_now();                                                \
        if (f_ != (size_t)(want)) {                                            \
            fprintf(stderr, "FAIL %s:%d free %zu MiB, want %zu MiB\n",        \
                    __FILE__, __LINE__, f_ >> 20, (size_t)(want) >> 20);       \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

#define MIB (1ull << 20)

int main(void) {
    CUdevice dev;
    CUcontext ctx;
    CUstream s;
    CUdeviceptr m, big, plain;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    const size_t free0 = free_now();

    /* Allocated: nothing on the device yet. */
    CHECK(cuMemAllocManaged(&m, 256 * MIB, CU_MEM_ATTACH_GLOBAL));
    EXPECT_FREE(free0);
    /* A device's touch faults the touched blocks in: 10 MiB of it, 5 blocks. */
    CHECK(cuMemsetD8(m, 7, 10 * MIB));
    CHECK(cuCtxSynchronize());
    EXPECT_FREE(free0 - 10 * MIB);
    /* A prefetch to the device moves the rest, in stream order. */
    CHECK(cuMemPrefetchAsync(m, 256 * MIB, dev, s));
    CHECK(cuStreamSynchronize(s));
    EXPECT_FREE(free0 - 256 * MIB);
    /* To the host: all of it given back, the bytes unchanged. */
    CHECK(cuMemPrefetchAsync(m, 256 * MIB, CU_DEVICE_CPU, s));
    CHECK(cuStreamSynchronize(s));
    EXPECT_FREE(free0);
    const unsigned char *h = (const unsigned char *)(uintptr_t)m;
    for (size_t i = 0; i < 10 * MIB; i += 4093)
        ASSERT(h[i] == 7);
    /* A part of it (the v2 call): the blocks it overlaps. */
    CUmemLocation gpu = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    CHECK(cuMemPrefetchAsync_v2(m + 3 * MIB, 2 * MIB, gpu, 0, s));
    CHECK(cuStreamSynchronize(s));
    EXPECT_FREE(free0 - 4 * MIB);

    /* More than the device has free is allocated; what does not fit stays on the
     * host, and the device's memory is never overcommitted. */
    CHECK(cuMemAllocManaged(&big, free0 + 256 * MIB, CU_MEM_ATTACH_GLOBAL));
    CHECK(cuMemPrefetchAsync(big, free0 + 256 * MIB, dev, s));
    CHECK(cuStreamSynchronize(s));
    EXPECT_FREE(0);
    /* Plain memory now finds no room; managed memory moved out makes it. */
    EXPECT(cuMemAlloc(&plain, 64 * MIB), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(cuMemPrefetchAsync(big, free0 + 256 * MIB, CU_DEVICE_CPU, s));
    CHECK(cuStreamSynchronize(s));
    EXPECT_FREE(free0 - 4 * MIB);
    CHECK(cuMemAlloc(&plain, 64 * MIB));
    CHECK(cuMemFree(plain));

    /* Freed: what it had on the device is given back. */
    CHECK(cuMemFree(big));
    CHECK(cuMemFree(m));
    EXPECT_FREE(free0);
    /* Not managed memory, or a bad device: the driver's refusals. */
    CHECK(cuMemAlloc(&plain, 2 * MIB));
    EXPECT(cuMemPrefetchAsync(plain, 2 * MIB, dev, s), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemAllocManaged(&m, 2 * MIB, CU_MEM_ATTACH_GLOBAL));
    EXPECT(cuMemPrefetchAsync(m, 2 * MIB, 7, s), CUDA_ERROR_INVALID_DEVICE);
    CHECK(cuMemFree(m));
    CHECK(cuMemFree(plain));
    CHECK(cuStreamDestroy(s));
    CHECK(cuDevicePrimaryCtxRelease(dev));
    puts("OK");
    return 0;
}
