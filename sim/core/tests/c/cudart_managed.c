/* Managed memory through NVIDIA's CUDA runtime (issue #24, the managed-memory row):
 * cudaMallocManaged, a memset on the GPU, prefetches to the GPU and back to the host
 * (cudaMemPrefetchAsync, CUDA 8.0's signature, and cudaMemPrefetchAsync_v2, 12.2's),
 * advice, and every byte read on the host. Under Kiwi the first prefetch failed with
 * cudaErrorInvalidValue: the runtime asks the driver for CUDA 8.0's variant, and the
 * shim handed it the wrapper of 12.2's, which takes other arguments. Prints "OK". */
#include "cudart_common.h"

#define N (64u << 20)

int main(void) {
    unsigned char *um = NULL;
    CHECK(cudaSetDevice(0));
    CHECK(cudaMallocManaged((void **)&um, N, cudaMemAttachGlobal));
    CHECK(cudaMemset(um, 7, N));
    CHECK(cudaMemPrefetchAsync(um, N, 0, 0));
    CHECK(cudaMemAdvise(um, N, cudaMemAdviseSetPreferredLocation, 0));
    CHECK(cudaMemPrefetchAsync(um, N, cudaCpuDeviceId, 0));
    struct cudaMemLocation gpu = {cudaMemLocationTypeDevice, 0};
    CHECK(cudaMemPrefetchAsync_v2(um, N, gpu, 0, 0));
    struct cudaMemLocation host = {cudaMemLocationTypeHost, 0};
    CHECK(cudaMemPrefetchAsync_v2(um, N, host, 0, 0));
    CHECK(cudaDeviceSynchronize());
    for (size_t i = 0; i < N; i += 4093)
        ASSERT(um[i] == 7);
    /* Not managed: the driver refuses a prefetch of it, with or without Kiwi. */
    unsigned char *plain = NULL;
    CHECK(cudaMalloc((void **)&plain, N));
    EXPECT(cudaMemPrefetchAsync(plain, N, 0, 0), cudaErrorInvalidValue);
    cudaGetLastError();
    CHECK(cudaFree(plain));
    CHECK(cudaFree(um));
    puts("OK");
    return 0;
}
