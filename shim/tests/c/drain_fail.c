/* Work still queued when a drop comes, and the drain before the swap-out fails
 * (driver API, NVIDIA's cuda.h; the simulator's KIWI_SIM_FAIL_SYNC makes the shim's
 * cuCtxSynchronize fail at once). Usage:
 *   drain_fail MIB
 * Allocates MIB MiB, fills it, then queues four memsets of all of it (values 1 to 4,
 * slow on a machine with a low KIWI_SIM_HBM_GBPS) on a non-blocking stream, prints
 * "QUEUED" and waits for a line on stdin (the test sends it once another program
 * took the GPU from this one). Then it waits for its stream and checks that every
 * byte is 4. Prints "OK"; exits 2 on a failed call, 3 on a wrong byte. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: drain_fail MIB\n");
        return 1;
    }
    size_t n = (size_t)atoi(argv[1]) << 20;
    CUdevice dev;
    CUcontext ctx;
    CUstream s;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUdeviceptr a;
    CHECK(cuMemAlloc(&a, n));
    CHECK(cuMemsetD8Async(a, 0, n, s));
    CHECK(cuStreamSynchronize(s));
    for (unsigned char v = 1; v <= 4; v++)
        CHECK(cuMemsetD8Async(a, v, n, s));
    printf("QUEUED\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        return 1;
    CHECK(cuStreamSynchronize(s));
    unsigned char *h = malloc(n);
    if (!h) return 1;
    CHECK(cuMemcpyDtoH(h, a, n));
    for (size_t i = 0; i < n; i++)
        if (h[i] != 4) {
            printf("byte %zu is %u, want 4\n", i, h[i]);
            fflush(stdout);
            return 3;
        }
    CHECK(cuMemFree(a));
    printf("OK\n");
    fflush(stdout);
    return 0;
}
