/* A small free while a kernel still writes the memory (driver API, NVIDIA's cuda.h).
 * Usage:
 *   free_reuse KIB
 * Allocates a small keeper and X (KIB KiB, small enough to share a chunk with it
 * under Kiwi), queues on a non-blocking stream a 300 ms spin and then a fill of X
 * with 0xdeadbeef, and frees X at once (cuMemFree waits for the context's work,
 * "implicitly synchronizes"). Then it allocates Y of the same size, prints "SAME"
 * when Y got X's address, fills Y with a pattern by a synchronous copy (on the
 * legacy stream, not ordered with the non-blocking one), waits for the context and
 * checks every word of Y. Prints "OK"; exits 2 on a failed call, 3 on a wrong
 * word. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: free_reuse KIB\n");
        return 1;
    }
    size_t n = (size_t)atoi(argv[1]) << 10;
    unsigned long long words = n / 4;
    CUdevice dev;
    CUcontext ctx;
    CUstream s;
    CUmodule mod;
    CUfunction fill, spin;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuModuleLoadData(&mod, "kiwi"));
    CHECK(cuModuleGetFunction(&fill, mod, "kiwi_fill"));
    CHECK(cuModuleGetFunction(&spin, mod, "kiwi_spin"));

    CUdeviceptr keep, x, y;
    CHECK(cuMemAlloc(&keep, 4096));
    CHECK(cuMemAlloc(&x, n));
    unsigned long long ns = 300ull * 1000 * 1000;
    void *spin_args[] = {&ns};
    CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, spin_args, NULL));
    unsigned int dead = 0xdeadbeefu;
    void *fill_args[] = {&x, &dead, &words};
    CHECK(cuLaunchKernel(fill, 1, 1, 1, 32, 1, 1, 0, s, fill_args, NULL));
    CHECK(cuMemFree(x));

    CHECK(cuMemAlloc(&y, n));
    printf("%s\n", y == x ? "SAME" : "OTHER");
    unsigned int *h = malloc(n);
    if (!h) return 1;
    for (size_t i = 0; i < words; i++)
        h[i] = (unsigned int)i * 2654435761u;
    CHECK(cuMemcpyHtoD(y, h, n));
    CHECK(cuCtxSynchronize());
    for (size_t i = 0; i < words; i++)
        h[i] = 0;
    CHECK(cuMemcpyDtoH(h, y, n));
    for (size_t i = 0; i < words; i++)
        if (h[i] != (unsigned int)i * 2654435761u) {
            printf("word %zu of Y is %#x, want %#x\n", i, h[i],
                   (unsigned int)i * 2654435761u);
            fflush(stdout);
            return 3;
        }
    CHECK(cuMemFree(y));
    CHECK(cuMemFree(keep));
    printf("OK\n");
    fflush(stdout);
    return 0;
}
