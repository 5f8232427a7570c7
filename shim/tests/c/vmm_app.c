/* An application that maps its own physical memory (driver API, NVIDIA's cuda.h),
 * as PyTorch's expandable segments and NCCL do: cuMemCreate of MIB MiB in one
 * handle, reserved, mapped, made accessible, then filled and checked BURSTS times.
 * Usage:
 *   vmm_app MIB BURSTS
 * Prints "CREATED" once its memory exists, then "OK". Exits 2 on a failed call (its
 * name printed), 3 on a wrong byte. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: vmm_app MIB BURSTS\n");
        return 1;
    }
    size_t bytes = (size_t)atoi(argv[1]) << 20;
    int bursts = atoi(argv[2]);
    CUdevice dev;
    CUcontext ctx;
    CUmemAllocationProp prop = context_and_device_memory(&dev, &ctx);
    size_t gran = 0;
    CHECK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    bytes = (bytes + gran - 1) / gran * gran;
    CUmemGenericAllocationHandle h;
    CHECK(cuMemCreate(&h, bytes, &prop, 0));
    puts("CREATED");
    fflush(stdout);
    CUdeviceptr d;
    CHECK(cuMemAddressReserve(&d, bytes, 0, 0, 0));
    CHECK(cuMemMap(d, bytes, 0, h, 0));
    CUmemAccessDesc access = {0};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK(cuMemSetAccess(d, bytes, &access, 1));
    unsigned char *host = malloc(bytes);
    if (!host)
        return 1;
    int bad = memset_bursts_verify(d, host, bytes, bursts);
    if (bad)
        return bad;
    CHECK(cuMemUnmap(d, bytes));
    CHECK(cuMemAddressFree(d, bytes));
    CHECK(cuMemRelease(h));
    free(host);
    puts("OK");
    return 0;
}
