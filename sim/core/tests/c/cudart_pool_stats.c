/* A stream-ordered pool's statistics through NVIDIA's CUDA runtime, as RMM, CuPy and
 * PyTorch's async backend read them: used and reserved memory of the device's pool
 * and of a pool of our own, current and high-water mark, and the mark's reset.
 * The same answers with and without Kiwi. Prints "OK"; exits 2 on a failed call, 3
 * on a wrong figure. */
#include "cudart_common.h"

#define MIB (1ull << 20)

static uint64_t attr(cudaMemPool_t pool, enum cudaMemPoolAttr a) {
    uint64_t v = 0;
    CHECK(cudaMemPoolGetAttribute(pool, a, &v));
    return v;
}

int main(void) {
    CHECK(cudaSetDevice(0));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaMemPool_t pool;
    CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    uint64_t used0 = attr(pool, cudaMemPoolAttrUsedMemCurrent);

    void *p = NULL, *q = NULL;
    CHECK(cudaMallocAsync(&p, 256 * MIB, s));
    CHECK(cudaMallocAsync(&q, 64 * MIB, s));
    CHECK(cudaMemsetAsync(p, 1, 256 * MIB, s));
    CHECK(cudaStreamSynchronize(s));
    uint64_t used = attr(pool, cudaMemPoolAttrUsedMemCurrent);
    uint64_t reserved = attr(pool, cudaMemPoolAttrReservedMemCurrent);
    printf("default pool: used %llu MiB, reserved %llu MiB\n",
           (unsigned long long)(used / MIB), (unsigned long long)(reserved / MIB));
    ASSERT(used - used0 >= 320 * MIB && used - used0 < 330 * MIB);
    ASSERT(reserved >= used);
    ASSERT(attr(pool, cudaMemPoolAttrUsedMemHigh) >= used);

    CHECK(cudaFreeAsync(p, s));
    CHECK(cudaStreamSynchronize(s));
    used = attr(pool, cudaMemPoolAttrUsedMemCurrent);
    ASSERT(used - used0 >= 64 * MIB && used - used0 < 70 * MIB);
    ASSERT(attr(pool, cudaMemPoolAttrUsedMemHigh) - used0 >= 320 * MIB);
    /* The high-water mark resets to what is used now. */
    uint64_t zero = 0;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    ASSERT(attr(pool, cudaMemPoolAttrUsedMemHigh) < 70 * MIB + used0);

    /* A pool of our own counts its own allocations, not the default pool's. */
    struct cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    cudaMemPool_t mine;
    CHECK(cudaMemPoolCreate(&mine, &props));
    void *r = NULL;
    CHECK(cudaMallocFromPoolAsync(&r, 32 * MIB, mine, s));
    CHECK(cudaStreamSynchronize(s));
    ASSERT(attr(mine, cudaMemPoolAttrUsedMemCurrent) >= 32 * MIB);
    ASSERT(attr(mine, cudaMemPoolAttrReservedMemCurrent) >= 32 * MIB);
    ASSERT(attr(pool, cudaMemPoolAttrUsedMemCurrent) == used);
    CHECK(cudaFreeAsync(r, s));
    CHECK(cudaFreeAsync(q, s));
    CHECK(cudaStreamSynchronize(s));
    ASSERT(attr(mine, cudaMemPoolAttrUsedMemCurrent) == 0);
    ASSERT(attr(pool, cudaMemPoolAttrUsedMemCurrent) == used0);
    CHECK(cudaMemPoolDestroy(mine));
    puts("OK");
    return 0;
}
