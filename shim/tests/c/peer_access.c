/* Another GPU's access to a shim allocation survives a swap (driver API, NVIDIA's
 * cuda.h; a machine of 2 GPUs). Usage:
 *   peer_access MIB
 * Allocates MIB MiB (a multiple of 2) on GPU 0, fills it, and grants GPU 1 read-write
 * access with cuMemSetAccess (as NCCL and PyTorch's peer copies do). A context on
 * GPU 1 copies 4 MiB out of it into its own memory and checks them. Prints "READY",
 * waits for a line on stdin (the test sends it once this program was swapped out on
 * GPU 0), then copies from GPU 1's context again: the swapped-in mappings must grant
 * GPU 1 access too. Prints "OK"; exits 2 on a failed call, 3 on a wrong byte. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define PIECE (4u << 20)

/* From GPU 1's context: copy PIECE bytes at `src` (GPU 0's memory) into `dst`
 * (GPU 1's) and check them. */
static void copy_and_check(CUcontext c1, CUdeviceptr dst, CUdeviceptr src,
                           unsigned char want, unsigned char *h) {
    CHECK(cuCtxSetCurrent(c1));
    CHECK(cuMemsetD8(dst, 0, PIECE));
    CHECK(cuMemcpyDtoD(dst, src, PIECE));
    CHECK(cuCtxSynchronize());
    CHECK(cuMemcpyDtoH(h, dst, PIECE));
    for (size_t i = 0; i < PIECE; i++)
        if (h[i] != want) {
            printf("byte %zu is %u, want %u\n", i, h[i], want);
            fflush(stdout);
            exit(3);
        }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: peer_access MIB\n");
        return 1;
    }
    size_t n = (size_t)atoi(argv[1]) << 20;
    CUdevice d0, d1;
    CUcontext c0, c1;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&d0, 0));
    CHECK(cuDeviceGet(&d1, 1));
    CHECK(cuDevicePrimaryCtxRetain(&c0, d0));
    CHECK(cuDevicePrimaryCtxRetain(&c1, d1));
    CHECK(cuCtxSetCurrent(c0));
    CUdeviceptr a, b;
    CHECK(cuMemAlloc(&a, n));
    CHECK(cuMemsetD8(a, 0x3c, n));
    CHECK(cuCtxSynchronize());
    CUmemAccessDesc desc[2];
    memset(desc, 0, sizeof desc);
    desc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc[0].location.id = d0;
    desc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    desc[1] = desc[0];
    desc[1].location.id = d1;
    CHECK(cuMemSetAccess(a, n, desc, 2));
    CHECK(cuCtxSetCurrent(c1));
    CHECK(cuMemAlloc(&b, PIECE));
    unsigned char *h = malloc(PIECE);
    if (!h) return 1;
    copy_and_check(c1, b, a + n / 2, 0x3c, h);
    copy_and_check(c1, b, a + n - PIECE, 0x3c, h);
    printf("READY\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        return 1;
    copy_and_check(c1, b, a, 0x3c, h);
    copy_and_check(c1, b, a + n / 2, 0x3c, h);
    copy_and_check(c1, b, a + n - PIECE, 0x3c, h);
    CHECK(cuMemFree(b));
    CHECK(cuCtxSetCurrent(c0));
    CHECK(cuMemFree(a));
    printf("OK\n");
    fflush(stdout);
    return 0;
}
