/* Stream-ordered memory through NVIDIA's CUDA runtime: cudaMallocAsync and
 * cudaFreeAsync on a non-blocking stream, the device's default pool and a pool of
 * our own (attributes, cudaMallocFromPoolAsync), pointer attributes, limits and
 * memory advice. Every byte verified. Prints "OK"; exits 2 on a failed call, 3 on
 * a wrong value. */
#include "cudart_common.h"

#define N (4u << 20)
#define ROUNDS 8

int main(void) {
    int dev = 0;
    CHECK(cudaSetDevice(dev));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    unsigned char *h = NULL;
    CHECK(cudaMallocHost((void **)&h, N));
    size_t free0 = 0, total = 0;
    CHECK(cudaMemGetInfo(&free0, &total));

    /* Allocate, fill, copy out and free in stream order, round after round. */
    for (int r = 0; r < ROUNDS; r++) {
        unsigned char *p = NULL;
        CHECK(cudaMallocAsync((void **)&p, N, s));
        CHECK(cudaMemsetAsync(p, 0x40 + r, N, s));
        CHECK(cudaMemsetAsync(p + N / 2, 0x80 + r, 4096, s));
        CHECK(cudaMemcpyAsync(h, p, N, cudaMemcpyDeviceToHost, s));
        CHECK(cudaFreeAsync(p, s));
        CHECK(cudaStreamSynchronize(s));
        ASSERT(check_value(h, N / 2, 0x40 + r) == N / 2);
        ASSERT(check_value(h + N / 2, 4096, 0x80 + r) == 4096);
        ASSERT(check_value(h + N / 2 + 4096, N / 2 - 4096, 0x40 + r) == N / 2 - 4096);
    }
    size_t free1 = 0;
    CHECK(cudaMemGetInfo(&free1, &total));
    ASSERT(free1 + (1u << 20) >= free0); /* the frees gave the memory back */

    /* The default pool and its attributes. */
    cudaMemPool_t pool;
    CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    cudaMemPool_t cur;
    CHECK(cudaDeviceGetMemPool(&cur, dev));
    ASSERT(cur == pool);
    uint64_t thr = UINT64_MAX, v = 1;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &v));
    ASSERT(v == UINT64_MAX);
    unsigned char *q = NULL;
    CHECK(cudaMallocAsync((void **)&q, N, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &v));
    ASSERT(v >= N);

    /* Pointer attributes: device memory from the pool, pinned host memory, and a
     * host pointer the driver does not know. */
    struct cudaPointerAttributes pa;
    CHECK(cudaPointerGetAttributes(&pa, q));
    ASSERT(pa.type == cudaMemoryTypeDevice && pa.device == dev && pa.devicePointer == q);
    CHECK(cudaPointerGetAttributes(&pa, h));
    ASSERT(pa.type == cudaMemoryTypeHost && pa.hostPointer == h);
    int local = 0;
    CHECK(cudaPointerGetAttributes(&pa, &local));
    ASSERT(pa.type == cudaMemoryTypeUnregistered);
    CHECK(cudaFreeAsync(q, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &v));
    ASSERT(v == 0);
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &v));
    ASSERT(v >= N);
    CHECK(cudaMemPoolTrimTo(pool, 0));

    /* A pool of our own. */
    struct cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev;
    cudaMemPool_t mine;
    CHECK(cudaMemPoolCreate(&mine, &props));
    ASSERT(mine != pool);
    unsigned char *m = NULL;
    CHECK(cudaMallocFromPoolAsync((void **)&m, N, mine, s));
    fill_pattern(h, N, 9);
    CHECK(cudaMemcpyAsync(m, h, N, cudaMemcpyHostToDevice, s));
    unsigned char *back = malloc(N);
    ASSERT(back != NULL);
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemcpy(back, m, N, cudaMemcpyDeviceToHost));
    ASSERT(check_pattern(back, N, 9) == N);
    CHECK(cudaMemPoolGetAttribute(mine, cudaMemPoolAttrUsedMemCurrent, &v));
    ASSERT(v >= N);
    CHECK(cudaFreeAsync(m, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemPoolDestroy(mine));
    /* The default pool cannot be destroyed. */
    EXPECT(cudaMemPoolDestroy(pool), cudaErrorInvalidValue);
    cudaGetLastError();

    /* Limits. */
    size_t lim = 0;
    CHECK(cudaDeviceSetLimit(cudaLimitMallocHeapSize, 64u << 20));
    CHECK(cudaDeviceGetLimit(&lim, cudaLimitMallocHeapSize));
    ASSERT(lim == 64u << 20);
    CHECK(cudaDeviceGetLimit(&lim, cudaLimitStackSize));
    ASSERT(lim > 0);

    /* Advice on managed memory is accepted; on plain device memory it is not. */
    unsigned char *um = NULL;
    CHECK(cudaMallocManaged((void **)&um, N, cudaMemAttachGlobal));
    CHECK(cudaMemAdvise(um, N, cudaMemAdviseSetPreferredLocation, dev));
    CHECK(cudaMemAdvise(um, N, cudaMemAdviseSetReadMostly, dev));
    unsigned char *plain = NULL;
    CHECK(cudaMalloc((void **)&plain, N));
    EXPECT(cudaMemAdvise(plain, N, cudaMemAdviseSetReadMostly, dev), cudaErrorInvalidValue);
    cudaGetLastError();
    CHECK(cudaFree(plain));
    CHECK(cudaFree(um));

    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFreeHost(h));
    free(back);
    CHECK(cudaGetLastError());
    puts("OK");
    return 0;
}
