/* Pointer attributes of the shim's allocations, resident and swapped out (driver
 * API, NVIDIA's cuda.h). Usage:
 *   ptr_attrs MIB
 * Allocates 4 KiB and MIB MiB on GPU 0, fills both, and asks cuPointerGetAttribute,
 * cuPointerGetAttributes and cuMemGetAddressRange about a pointer inside each: the
 * answers must be the allocation's own (device memory, GPU 0, its base and size, the
 * context, mapped). Asks once resident, prints "READY", waits for a line on stdin (the
 * test sends it once this program was swapped out), asks again, then checks every
 * byte. Prints "OK"; exits 2 on a failed call, 4 on a wrong answer (each printed), 3 on
 * a wrong byte. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* Every wrong answer is printed and counted; the program exits 4 at the end. */
static int wrong = 0;

#define TRY(call)                                                              \
    do {                                                                       \
        CUresult r_ = (call);                                                  \
        if (r_ != CUDA_SUCCESS) {                                              \
            printf("WRONG (%s): %s -> %d\n", phase, #call, (int)r_);           \
            wrong++;                                                           \
        }                                                                      \
    } while (0)

#define EXPECT(what, got, want)                                                \
    do {                                                                       \
        unsigned long long g_ = (unsigned long long)(got);                     \
        unsigned long long w_ = (unsigned long long)(want);                    \
        if (g_ != w_) {                                                        \
            printf("WRONG %s (%s): %#llx, want %#llx\n", what, phase, g_, w_); \
            wrong++;                                                           \
        }                                                                      \
    } while (0)

static void ask(const char *phase, CUcontext ctx, CUdeviceptr base, size_t size,
                CUdeviceptr p) {
    unsigned int type = 0, mapped = 0, managed = 7;
    int ordinal = -1;
    CUdeviceptr start = 0, dptr = 0;
    size_t len = 0;
    CUcontext c = NULL;
    TRY(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p));
    EXPECT("memory type", type, CU_MEMORYTYPE_DEVICE);
    TRY(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p));
    EXPECT("device ordinal", ordinal, 0);
    TRY(cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p));
    EXPECT("range start", start, base);
    TRY(cuPointerGetAttribute(&len, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p));
    EXPECT("range size", len, size);
    TRY(cuPointerGetAttribute(&c, CU_POINTER_ATTRIBUTE_CONTEXT, p));
    EXPECT("context", (size_t)c, (size_t)ctx);
    TRY(cuPointerGetAttribute(&dptr, CU_POINTER_ATTRIBUTE_DEVICE_POINTER, p));
    EXPECT("device pointer", dptr, p);
    TRY(cuPointerGetAttribute(&mapped, CU_POINTER_ATTRIBUTE_MAPPED, p));
    EXPECT("mapped", mapped, 1);

    CUpointer_attribute attrs[5] = {
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        CU_POINTER_ATTRIBUTE_IS_MANAGED};
    type = 0, ordinal = -1, start = 0, len = 0;
    void *data[5] = {&type, &ordinal, &start, &len, &managed};
    TRY(cuPointerGetAttributes(5, attrs, data, p));
    EXPECT("attributes: memory type", type, CU_MEMORYTYPE_DEVICE);
    EXPECT("attributes: device ordinal", ordinal, 0);
    EXPECT("attributes: range start", start, base);
    EXPECT("attributes: range size", len, size);
    EXPECT("attributes: managed", managed, 0);

    start = 0, len = 0;
    TRY(cuMemGetAddressRange(&start, &len, p));
    EXPECT("address range: base", start, base);
    EXPECT("address range: size", len, size);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: ptr_attrs MIB\n");
        return 1;
    }
    size_t n = (size_t)atoi(argv[1]) << 20, sn = 4096;
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CUdeviceptr big, small;
    /* The small one first: its chunk is the first the shim evicts (then the big
     * one's first 64 MiB), so a partial swap-out takes both pointers asked about. */
    CHECK(cuMemAlloc(&small, sn));
    CHECK(cuMemAlloc(&big, n));
    CHECK(cuMemsetD8(big, 0x5a, n));
    CHECK(cuMemsetD8(small, 0xa5, sn));
    CHECK(cuCtxSynchronize());
    /* Inside, not at the base: the allocation's range, not a mapping's. */
    CUdeviceptr in_big = big + 12345, mid_big = big + n / 2 + 12345,
                in_small = small + 100;
    const char *phase = "resident";
    ask(phase, ctx, big, n, in_big);
    ask(phase, ctx, big, n, mid_big);
    ask(phase, ctx, small, sn, in_small);
    printf("READY\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        return 1;
    phase = "swapped out";
    ask(phase, ctx, big, n, in_big);
    ask(phase, ctx, big, n, mid_big);
    ask(phase, ctx, small, sn, in_small);
    unsigned char *h = malloc(n);
    if (!h) return 1;
    CHECK(cuMemcpyDtoH(h, big, n));
    for (size_t i = 0; i < n; i++)
        if (h[i] != 0x5a) {
            printf("byte %zu is %u\n", i, h[i]);
            return 3;
        }
    CHECK(cuMemFree(big));
    CHECK(cuMemFree(small));
    fflush(stdout);
    if (wrong)
        return 4;
    printf("OK\n");
    fflush(stdout);
    return 0;
}
