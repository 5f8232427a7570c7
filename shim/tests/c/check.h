/* CHECK for the driver-API test programs in this folder: a failed call prints
 * "FAIL file:line call -> code NAME" on stdout (where the tests look) and exits 2.
 * And what several of them do with their memory. */
#ifndef KIWI_SHIM_TEST_CHECK_H
#define KIWI_SHIM_TEST_CHECK_H
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define CHECK(call)                                                            \
    do {                                                                       \
        CUresult r_ = (call);                                                  \
        if (r_ != CUDA_SUCCESS) {                                              \
            const char *n_ = "?";                                              \
            cuGetErrorName(r_, &n_);                                           \
            printf("FAIL %s:%d %s -> %d %s\n", __FILE__, __LINE__, #call,      \
                   (int)r_, n_);                                               \
            fflush(stdout);                                                    \
            exit(2);                                                           \
        }                                                                      \
    } while (0)

/* Memsets all of `d` (n bytes) `bursts` times to a value per burst, letting the
 * memory sit 50 ms after each, and checks every byte each time (copied to `h`).
 * Returns 0, or 3 after printing the first wrong byte. */
static inline int memset_bursts_verify(CUdeviceptr d, unsigned char *h, size_t n, int bursts) {
    for (int b = 0; b < bursts; b++) {
        unsigned char v = (unsigned char)(b * 13 + 5);
        CHECK(cuMemsetD8(d, v, n));
        CHECK(cuCtxSynchronize());
        usleep(50000);
        CHECK(cuMemcpyDtoH(h, d, n));
        for (size_t i = 0; i < n; i++)
            if (h[i] != v) {
                printf("burst %d: byte %zu is %u, want %u\n", b, i, h[i], v);
                return 3;
            }
    }
    return 0;
}

/* Initialises the driver, makes a context on device 0 (current) and returns the
 * properties of plain device memory there, as the VMM programs create it. */
static inline CUmemAllocationProp context_and_device_memory(CUdevice *dev, CUcontext *ctx) {
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(dev, 0));
    CHECK(cuCtxCreate(ctx, 0, *dev));
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = *dev;
    return prop;
}

#endif
