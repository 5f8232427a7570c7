/* Allocations made while the program holds the GPU, between kernels (driver API,
 * NVIDIA's cuda.h). Usage:
 *   alloc_churn ROUNDS MIB
 * Allocates MIB MiB (P) and zeroes it. Each round allocates 4 MiB (X), fills it
 * with the round's number (cuMemsetD32), adds 1 to every word of X and of P with
 * kernels, copies X back and checks every word, frees X and sleeps 5 ms (another
 * program over capacity forces drops meanwhile). At the end every word of P must be
 * ROUNDS. Prints "OK"; exits 2 on a failed call, 3 on a wrong word. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "check.h"

static int check(const unsigned int *h, size_t words, unsigned int want,
                 const char *what) {
    for (size_t i = 0; i < words; i++)
        if (h[i] != want) {
            printf("word %zu of %s is %u, want %u\n", i, what, h[i], want);
            fflush(stdout);
            return 0;
        }
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: alloc_churn ROUNDS MIB\n");
        return 1;
    }
    int rounds = atoi(argv[1]);
    size_t pn = (size_t)atoi(argv[2]) << 20, xn = 4 << 20;
    unsigned long long pw = pn / 4, xw = xn / 4;
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction add;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuModuleLoadData(&mod, "kiwi"));
    CHECK(cuModuleGetFunction(&add, mod, "kiwi_add"));
    CUdeviceptr p, x;
    CHECK(cuMemAlloc(&p, pn));
    CHECK(cuMemsetD32(p, 0, pw));
    unsigned int *h = malloc(pn > xn ? pn : xn);
    if (!h) return 1;
    unsigned int one = 1;
    for (int r = 0; r < rounds; r++) {
        CHECK(cuMemAlloc(&x, xn));
        CHECK(cuMemsetD32(x, (unsigned int)r, xw));
        void *xa[] = {&x, &one, &xw};
        CHECK(cuLaunchKernel(add, 1, 1, 1, 32, 1, 1, 0, NULL, xa, NULL));
        void *pa[] = {&p, &one, &pw};
        CHECK(cuLaunchKernel(add, 1, 1, 1, 32, 1, 1, 0, NULL, pa, NULL));
        CHECK(cuMemcpyDtoH(h, x, xn));
        if (!check(h, xw, (unsigned int)r + 1, "X")) return 3;
        CHECK(cuMemFree(x));
        usleep(5000);
    }
    CHECK(cuMemcpyDtoH(h, p, pn));
    if (!check(h, pw, (unsigned int)rounds, "P")) return 3;
    CHECK(cuMemFree(p));
    printf("OK\n");
    fflush(stdout);
    return 0;
}
