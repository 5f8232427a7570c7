/* NVIDIA's CUDA runtime on the simulator: device queries, allocation, memsets,
 * synchronous and asynchronous copies, pinned memory, streams and events, every
 * byte verified. Usage: cudart_smoke GPUS TOTAL_BYTES. Prints "OK" and exits 0;
 * exits 2 on a failed call, 3 on a wrong value. */
#include "cudart_common.h"

#define N (8u << 20)

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: cudart_smoke GPUS TOTAL_BYTES\n");
        return 1;
    }
    int want_gpus = atoi(argv[1]);
    size_t want_total = strtoull(argv[2], NULL, 10);
    int n = 0, v = 0, dev = -1;

    CHECK(cudaRuntimeGetVersion(&v));
    ASSERT(v == 12090);
    CHECK(cudaDriverGetVersion(&v));
    ASSERT(v >= 12000);
    CHECK(cudaGetDeviceCount(&n));
    ASSERT(n == want_gpus);

    for (int d = 0; d < n; d++) {
        struct cudaDeviceProp prop;
        CHECK(cudaGetDeviceProperties(&prop, d));
        ASSERT(strcmp(prop.name, "Kiwi Simulated GPU") == 0);
        ASSERT(prop.totalGlobalMem == want_total);
        ASSERT(prop.major == 8 && prop.minor == 0);
        ASSERT(prop.multiProcessorCount == 108);
        ASSERT(prop.pciBusID == 0x10 + d);
        int attr = 0;
        CHECK(cudaDeviceGetAttribute(&attr, cudaDevAttrMemoryPoolsSupported, d));
        ASSERT(attr == 1);
    }
    EXPECT(cudaSetDevice(n), cudaErrorInvalidDevice);
    cudaGetLastError();
    CHECK(cudaSetDevice(n - 1));
    CHECK(cudaGetDevice(&dev));
    ASSERT(dev == n - 1);

    size_t free0 = 0, total = 0;
    CHECK(cudaMemGetInfo(&free0, &total));
    ASSERT(total == want_total);
    ASSERT(free0 <= total);

    /* Allocation is visible in MemGetInfo (the machine counts every process). */
    unsigned char *a = NULL, *b = NULL;
    CHECK(cudaMalloc((void **)&a, N));
    CHECK(cudaMalloc((void **)&b, N));
    size_t free1 = 0;
    CHECK(cudaMemGetInfo(&free1, &total));
    ASSERT(free1 + 2 * (size_t)N <= free0);

    unsigned char *h = malloc(N);
    ASSERT(h != NULL);

    /* Memset, read back. */
    CHECK(cudaMemset(a, 0xA5, N));
    CHECK(cudaMemcpy(h, a, N, cudaMemcpyDeviceToHost));
    ASSERT(check_value(h, N, 0xA5) == N);

    /* Host -> device -> device -> host. */
    fill_pattern(h, N, 1);
    CHECK(cudaMemcpy(a, h, N, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b, a, N, cudaMemcpyDeviceToDevice));
    memset(h, 0, N);
    CHECK(cudaMemcpy(h, b, N, cudaMemcpyDeviceToHost));
    ASSERT(check_pattern(h, N, 1) == N);
    /* cudaMemcpyDefault: the runtime tells host from device by unified addressing. */
    fill_pattern(h, N, 2);
    CHECK(cudaMemcpy(a, h, N, cudaMemcpyDefault));
    memset(h, 0, N);
    CHECK(cudaMemcpy(h, a, N, cudaMemcpyDefault));
    ASSERT(check_pattern(h, N, 2) == N);

    /* Pinned memory, a stream, events around asynchronous copies. */
    unsigned char *pinned = NULL;
    CHECK(cudaMallocHost((void **)&pinned, N));
    fill_pattern(pinned, N, 3);
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    CHECK(cudaEventRecord(e0, s));
    CHECK(cudaMemcpyAsync(b, pinned, N, cudaMemcpyHostToDevice, s));
    CHECK(cudaMemsetAsync(b, 0x3C, 4096, s));
    CHECK(cudaMemcpyAsync(a, b, N, cudaMemcpyDeviceToDevice, s));
    unsigned char *back = NULL;
    CHECK(cudaHostAlloc((void **)&back, N, cudaHostAllocDefault));
    CHECK(cudaMemcpyAsync(back, a, N, cudaMemcpyDeviceToHost, s));
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaStreamQuery(s));
    CHECK(cudaEventQuery(e1));
    float ms = -1.0f;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    ASSERT(ms >= 0.0f);
    /* Stream order: copy in, memset the head, copy on, copy out. */
    ASSERT(check_value(back, 4096, 0x3C) == 4096);
    ASSERT(memcmp(back + 4096, pinned + 4096, N - 4096) == 0);

    /* Default stream and device-wide sync. */
    CHECK(cudaMemsetAsync(a, 0x11, N, 0));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(h, a, N, cudaMemcpyDeviceToHost));
    ASSERT(check_value(h, N, 0x11) == N);

    /* A bad pointer is refused. */
    EXPECT(cudaMemcpy(h, (void *)(uintptr_t)0x1000, 16, cudaMemcpyDeviceToHost),
           cudaErrorInvalidValue);
    cudaGetLastError();

    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFreeHost(pinned));
    CHECK(cudaFreeHost(back));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    size_t free2 = 0;
    CHECK(cudaMemGetInfo(&free2, &total));
    ASSERT(free2 >= free1 + 2 * (size_t)N);
    CHECK(cudaGetLastError());
    free(h);
    puts("OK");
    return 0;
}
