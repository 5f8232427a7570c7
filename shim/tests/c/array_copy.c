/* An application that copies into and out of a CUDA array (cuMemcpyHtoA_v2 /
 * cuMemcpyAtoH_v2) next to MIB MiB of ordinary device memory, for libkiwi.so's
 * gating test. Prints "called_ns T" just before the host-to-array copy and
 * "returned_ns T" just after it (CLOCK_MONOTONIC, the arbiter's clock), then "OK"
 * once the bytes came back. Exit 2 on a CUDA error, 3 on a mismatch. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + ts.tv_nsec;
}

#define CK(call)                                                                    \
    do {                                                                            \
        CUresult r_ = (call);                                                       \
        if (r_ != CUDA_SUCCESS) {                                                   \
            printf("CUDA error %d in %s\n", (int)r_, #call);                        \
            return 2;                                                               \
        }                                                                           \
    } while (0)

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 400;
    enum { N = 1 << 20 };
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr big;
    CUarray arr;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuCtxCreate(&ctx, 0, dev));
    CK(cuMemAlloc(&big, mib << 20));
    CUDA_ARRAY_DESCRIPTOR desc;
    memset(&desc, 0, sizeof desc);
    desc.Width = N;
    desc.Height = 0;
    desc.Format = CU_AD_FORMAT_UNSIGNED_INT8;
    desc.NumChannels = 1;
    CK(cuArrayCreate(&arr, &desc));
    unsigned char *in = malloc(N), *out = malloc(N);
    for (int i = 0; i < N; i++) in[i] = (unsigned char)(i * 7 + 3);
    printf("ready\n");
    fflush(stdout);
    unsigned long long called = now_ns();
    CK(cuMemcpyHtoA(arr, 0, in, N));
    unsigned long long returned = now_ns();
    printf("called_ns %llu\nreturned_ns %llu\n", called, returned);
    CK(cuMemcpyAtoH(out, arr, 0, N));
    if (memcmp(in, out, N) != 0) {
        printf("array bytes differ\n");
        return 3;
    }
    CK(cuArrayDestroy(arr));
    CK(cuMemFree(big));
    printf("OK\n");
    return 0;
}
