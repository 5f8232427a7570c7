/* Stream memory operations (cuStreamWaitValue*, cuStreamWriteValue*,
 * cuStreamBatchMemOp) and cuMemHostGetDevicePointer on the simulator, as strict as
 * the real driver. Compiled against NVIDIA's cuda.h (which names the _v2 entry
 * points), linked with -lcuda; needs 2 GPUs. `stream_memops MODE` runs one part
 * and prints "OK", or names the failing check and exits 1.
 *
 * No sleep orders anything here: a wait whose condition does not hold yet is
 * NOT_READY whenever it is asked, and every wait for completion is bounded
 * (query_until_done). */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "driver_check.h"

extern char **environ;

typedef CUresult (*wait32_fn)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
typedef CUresult (*batch_fn)(CUstream, unsigned int, CUstreamBatchMemOpParams *,
                             unsigned int);

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* cuStreamQuery until the stream's work is done (bounded: 60 s), its result. */
static CUresult query_until_done(CUstream s) {
    double end = now_s() + 60;
    for (;;) {
        CUresult r = cuStreamQuery(s);
        if (r != CUDA_ERROR_NOT_READY)
            return r;
        if (now_s() > end) {
            fprintf(stderr, "FAIL: stream still busy after 60 s\n");
            exit(1);
        }
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
}

static volatile uint32_t *u32_at(void *p, size_t off) {
    return (volatile uint32_t *)((char *)p + off);
}

static volatile uint64_t *u64_at(void *p, size_t off) {
    return (volatile uint64_t *)((char *)p + off);
}

static void store32(void *p, size_t off, uint32_t v) {
    __atomic_store_n((uint32_t *)((char *)p + off), v, __ATOMIC_RELEASE);
}

static void store64(void *p, size_t off, uint64_t v) {
    __atomic_store_n((uint64_t *)((char *)p + off), v, __ATOMIC_RELEASE);
}

static CUcontext setup(int ordinal) {
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, ordinal));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    return ctx;
}

/* ---------------------------------------------------------------- device memory */

/* Writes then waits on device memory; a wait on the legacy lane released by a
 * write from a non-blocking stream; work after a wait runs after it. */
static void mode_device(void) {
    setup(0);
    CUdeviceptr d;
    CUstream s, nb;
    CHECK(cuMemAlloc(&d, 4096));
    CHECK(cuMemsetD8(d, 0, 4096));
    CHECK(cuStreamCreate(&s, CU_STREAM_DEFAULT));
    CHECK(cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));

    CHECK(cuStreamWriteValue32(s, d, 42, CU_STREAM_WRITE_VALUE_DEFAULT));
    CHECK(cuStreamWaitValue32(s, d, 42, CU_STREAM_WAIT_VALUE_EQ));
    CHECK(cuStreamWriteValue64(s, d + 8, 0x1122334455667788ull, 0));
    CHECK(cuStreamWaitValue64(s, d + 8, 0x1122334455667700ull, CU_STREAM_WAIT_VALUE_GEQ));
    CHECK(cuStreamWaitValue32(s, d, 2, CU_STREAM_WAIT_VALUE_AND | CU_STREAM_WAIT_VALUE_FLUSH));
    CHECK(cuStreamWriteValue32(s, d + 16, 7, 0));
    CHECK(cuStreamSynchronize(s));
    uint32_t got[6];
    CHECK(cuMemcpyDtoH(got, d, sizeof got));
    ASSERT(got[0] == 42);
    ASSERT(got[2] == 0x55667788u && got[3] == 0x11223344u);
    ASSERT(got[4] == 7);

    /* A wait on a blocking stream, released by a non-blocking stream's write. */
    CUevent after;
    CHECK(cuEventCreate(&after, CU_EVENT_DISABLE_TIMING));
    CHECK(cuStreamWaitValue32(s, d + 32, 5, CU_STREAM_WAIT_VALUE_EQ));
    CHECK(cuStreamWriteValue32(s, d + 36, 9, 0));
    CHECK(cuEventRecord(after, s));
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    EXPECT(cuEventQuery(after), CUDA_ERROR_NOT_READY);
    /* The write queued behind the wait has not run. */
    uint32_t later = 1;
    CHECK(cuMemcpyDtoHAsync(&later, d + 36, 4, nb));
    CHECK(cuStreamSynchronize(nb));
    ASSERT(later == 0);
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    CHECK(cuStreamWriteValue32(nb, d + 32, 5, 0));
    CHECK(query_until_done(s));
    CHECK(cuEventSynchronize(after));
    CHECK(cuMemcpyDtoH(&later, d + 36, 4));
    ASSERT(later == 9);

    /* A 64-bit wait on the legacy stream itself. */
    CHECK(cuStreamWaitValue64(NULL, d + 40, 1ull << 40, CU_STREAM_WAIT_VALUE_EQ));
    EXPECT(cuStreamQuery(NULL), CUDA_ERROR_NOT_READY);
    CHECK(cuStreamWriteValue64(nb, d + 40, 1ull << 40, 0));
    CHECK(cuCtxSynchronize());
    CHECK(cuStreamQuery(NULL));
    printf("OK\n");
}

/* ---------------------------------------------------------------- refusals */

static void mode_rules(void) {
    CUcontext c0 = setup(0);
    CUdevice d1;
    CUcontext c1, other;
    CUdeviceptr d, freed, managed, on1, foreign;
    CUstream s;
    int v;
    CHECK(cuDeviceGet(&d1, 1));
    CHECK(cuMemAlloc(&d, 4096));
    CHECK(cuMemsetD8(d, 0, 4096));
    CHECK(cuStreamCreate(&s, 0));

    /* Attributes: the v2 API, 64-bit words, NOR, flushes; the v1 API off (no
     * NVreg_EnableStreamMemOPs=1); host pointers usable for registered memory. */
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, 0));
    ASSERT(v == 1);
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, 0));
    ASSERT(v == 1);
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, 0));
    ASSERT(v == 1);
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, 0));
    ASSERT(v == 1);
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, 0));
    ASSERT(v == 0);
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1, 0));
    ASSERT(v == 0);
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1, 0));
    ASSERT(v == 0);

    /* The v1 entry points, as a program finds them by name, are not supported. */
    wait32_fn wait_v1 = (wait32_fn)dlsym(RTLD_DEFAULT, "cuStreamWaitValue32");
    wait32_fn write_v1 = (wait32_fn)dlsym(RTLD_DEFAULT, "cuStreamWriteValue32");
    wait32_fn wait_v1_ptsz = (wait32_fn)dlsym(RTLD_DEFAULT, "cuStreamWaitValue32_ptsz");
    ASSERT(wait_v1 && write_v1 && wait_v1_ptsz);
    EXPECT(wait_v1(s, d, 0, 0), CUDA_ERROR_NOT_SUPPORTED);
    EXPECT(write_v1(s, d, 0, 0), CUDA_ERROR_NOT_SUPPORTED);
    EXPECT(wait_v1_ptsz(s, d, 0, 0), CUDA_ERROR_NOT_SUPPORTED);

    /* Words aligned to their size. */
    EXPECT(cuStreamWaitValue32(s, d + 2, 0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWriteValue32(s, d + 1, 0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWaitValue64(s, d + 4, 0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWriteValue64(s, d + 12, 0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWriteValue32(s, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);

    /* Only the documented flags: a condition, optionally the flush bit; a write's
     * NO_MEMORY_BARRIER is the v1 API's only. */
    EXPECT(cuStreamWaitValue32(s, d, 0, 4), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWaitValue32(s, d, 0, 0x10), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWaitValue32(s, d, 0, 1u << 29), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWaitValue64(s, d, 0, 1u << 31), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWriteValue32(s, d, 0, 2), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWriteValue64(s, d, 0, CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER),
           CUDA_ERROR_INVALID_VALUE);
    CHECK(cuStreamWaitValue32(s, d, 0, CU_STREAM_WAIT_VALUE_EQ | CU_STREAM_WAIT_VALUE_FLUSH));
    CHECK(cuStreamSynchronize(s));

    /* Memory the stream's device cannot reach that way. Pageable host memory: */
    uint32_t *pageable = aligned_alloc(4096, 4096);
    ASSERT(pageable);
    memset(pageable, 0, 4096);
    EXPECT(cuStreamWaitValue32(s, (CUdeviceptr)pageable, 0, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWriteValue32(s, (CUdeviceptr)pageable, 1, 0), CUDA_ERROR_INVALID_VALUE);
    /* pinned but not mapped (no DEVICEMAP): allocated, */
    void *pinned;
    CHECK(cuMemAllocHost(&pinned, 4096));
    EXPECT(cuStreamWriteValue32(s, (CUdeviceptr)pinned, 1, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemHostAlloc(&pinned, 4096, CU_MEMHOSTALLOC_PORTABLE));
    EXPECT(cuStreamWaitValue32(s, (CUdeviceptr)pinned, 0, 0), CUDA_ERROR_INVALID_VALUE);
    /* or registered, */
    CHECK(cuMemHostRegister(pageable, 4096, CU_MEMHOSTREGISTER_PORTABLE));
    EXPECT(cuStreamWaitValue32(s, (CUdeviceptr)pageable, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemHostUnregister(pageable));
    /* registered with DEVICEMAP is fine, up to its end, */
    CHECK(cuMemHostRegister(pageable, 4096, CU_MEMHOSTREGISTER_DEVICEMAP));
    CHECK(cuStreamWriteValue32(s, (CUdeviceptr)pageable + 4092, 3, 0));
    CHECK(cuStreamSynchronize(s));
    ASSERT(pageable[1023] == 3);
    EXPECT(cuStreamWriteValue64(s, (CUdeviceptr)pageable + 4096, 3, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemHostUnregister(pageable));
    EXPECT(cuStreamWriteValue32(s, (CUdeviceptr)pageable, 1, 0), CUDA_ERROR_INVALID_VALUE);
    /* managed memory ("None of the operations accepts pointers to managed memory"), */
    CHECK(cuMemAllocManaged(&managed, 4096, CU_MEM_ATTACH_GLOBAL));
    EXPECT(cuStreamWriteValue32(s, managed, 1, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamWaitValue64(s, managed, 0, 0), CUDA_ERROR_INVALID_VALUE);
    /* freed device memory, */
    CHECK(cuMemAlloc(&freed, 4096));
    CHECK(cuMemFree(freed));
    EXPECT(cuStreamWriteValue32(s, freed, 1, 0), CUDA_ERROR_INVALID_VALUE);
    /* another context's memory on the same device, */
    CUdevice d0;
    CHECK(cuDeviceGet(&d0, 0));
    CHECK(cuCtxCreate(&other, 0, d0));
    CHECK(cuMemAlloc(&foreign, 4096));
    CHECK(cuCtxPopCurrent(NULL));
    CHECK(cuCtxSetCurrent(c0));
    EXPECT(cuStreamWriteValue32(s, foreign, 1, 0), CUDA_ERROR_INVALID_VALUE);
    /* another device's memory. */
    CHECK(cuDevicePrimaryCtxRetain(&c1, d1));
    CHECK(cuCtxSetCurrent(c1));
    CHECK(cuMemAlloc(&on1, 4096));
    CHECK(cuCtxSetCurrent(c0));
    EXPECT(cuStreamWaitValue32(s, on1, 0, 0), CUDA_ERROR_INVALID_VALUE);

    /* A VMM mapping takes memory operations once the stream's device may access it;
     * read-only access takes waits, not writes. */
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t gran = 0;
    CHECK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    CHECK(cuMemCreate(&h, gran, &prop, 0));
    CHECK(cuMemAddressReserve(&va, gran, 0, 0, 0));
    CHECK(cuMemMap(va, gran, 0, h, 0));
    EXPECT(cuStreamWriteValue32(s, va, 1, 0), CUDA_ERROR_INVALID_VALUE);
    CUmemAccessDesc acc;
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = 0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
    CHECK(cuMemSetAccess(va, gran, &acc, 1));
    EXPECT(cuStreamWriteValue32(s, va, 1, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuStreamWaitValue32(s, va, 0, CU_STREAM_WAIT_VALUE_GEQ));
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK(cuMemSetAccess(va, gran, &acc, 1));
    CHECK(cuStreamWriteValue64(s, va + gran - 8, 0xABCDull, 0));
    CHECK(cuStreamWaitValue64(s, va + gran - 8, 0xABCDull, CU_STREAM_WAIT_VALUE_EQ));
    CHECK(cuStreamSynchronize(s));
    uint64_t back = 0;
    CHECK(cuMemcpyDtoH(&back, va + gran - 8, 8));
    ASSERT(back == 0xABCDull);
    /* Inside the reservation but not mapped. */
    CHECK(cuMemUnmap(va, gran));
    EXPECT(cuStreamWaitValue32(s, va, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemAddressFree(va, gran));
    CHECK(cuMemRelease(h));
    printf("OK\n");
}

/* ---------------------------------------------------------------- host memory, threads */

struct release {
    void *p;
    size_t off;
    uint32_t v;
};

static void *release_later(void *arg) {
    struct release *r = arg;
    store32(r->p, r->off, r->v);
    return NULL;
}

/* Enqueues a 32-bit wait on `h + off` that does not hold for `before`, checks
 * that it keeps the stream busy, then stores `after` from this thread. */
static void wait_then_release32(CUstream s, void *h, size_t off, uint32_t before,
                                uint32_t value, unsigned flags, uint32_t after) {
    store32(h, off, before);
    CHECK(cuStreamWaitValue32(s, (CUdeviceptr)h + off, value, flags));
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    store32(h, off, after);
    CHECK(query_until_done(s));
}

static void mode_host(void) {
    setup(0);
    void *h;
    CUdeviceptr dp;
    CUstream s;
    CHECK(cuMemHostAlloc(&h, 4096, CU_MEMHOSTALLOC_DEVICEMAP));
    memset(h, 0, 4096);
    CHECK(cuMemHostGetDevicePointer(&dp, h, 0));
    ASSERT(dp == (CUdeviceptr)h);
    CHECK(cuStreamCreate(&s, 0));

    /* Another thread's store releases a wait; until then the stream, the work
     * behind the wait and an event recorded after it are pending. */
    CUevent after;
    CHECK(cuEventCreate(&after, CU_EVENT_DISABLE_TIMING));
    CHECK(cuStreamWaitValue32(s, dp, 5, CU_STREAM_WAIT_VALUE_GEQ));
    CHECK(cuStreamWriteValue32(s, dp + 64, 77, 0));
    CHECK(cuEventRecord(after, s));
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    EXPECT(cuEventQuery(after), CUDA_ERROR_NOT_READY);
    ASSERT(*u32_at(h, 64) == 0);
    /* A waiting stream costs almost no CPU: over 300 ms of wall time, this
     * process (its executor threads included) uses far less than one core. */
    struct timespec c0, c1;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
    double w0 = now_s();
    struct timespec pause = {0, 300000000};
    nanosleep(&pause, NULL);
    double wall = now_s() - w0;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
    double cpu = (c1.tv_sec - c0.tv_sec) + (c1.tv_nsec - c0.tv_nsec) / 1e9;
    if (cpu > 0.5 * wall) {
        fprintf(stderr, "FAIL: a waiting stream used %.0f ms of CPU in %.0f ms\n",
                cpu * 1e3, wall * 1e3);
        exit(1);
    }
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    ASSERT(*u32_at(h, 64) == 0);
    pthread_t t;
    struct release r = {h, 0, 5};
    ASSERT(pthread_create(&t, NULL, release_later, &r) == 0);
    CHECK(cuStreamSynchronize(s));
    ASSERT(pthread_join(t, NULL) == 0);
    CHECK(cuEventQuery(after));
    ASSERT(*u32_at(h, 64) == 77);

    /* Each condition, 32-bit: GEQ is cyclic ((int32_t)(*addr - value) >= 0). */
    wait_then_release32(s, h, 128, 0x7FFFFFFFu, 0x80000001u, CU_STREAM_WAIT_VALUE_GEQ,
                        0x80000001u);
    wait_then_release32(s, h, 128, 0xFFFFFFFFu, 0, CU_STREAM_WAIT_VALUE_GEQ, 0);
    wait_then_release32(s, h, 128, 3, 4, CU_STREAM_WAIT_VALUE_EQ, 4);
    wait_then_release32(s, h, 128, 0x1, 0x6, CU_STREAM_WAIT_VALUE_AND, 0x4);
    wait_then_release32(s, h, 128, 0xFFFFFFFFu, 0x0F, CU_STREAM_WAIT_VALUE_NOR, 0xFFFFFF00u);
    /* A condition that holds at once does not wait. */
    store32(h, 128, 9);
    CHECK(cuStreamWaitValue32(s, dp + 128, 9, CU_STREAM_WAIT_VALUE_EQ));
    CHECK(query_until_done(s));

    /* 64-bit: the whole word counts. */
    store64(h, 256, 1ull << 40);
    CHECK(cuStreamWaitValue64(s, dp + 256, (1ull << 40) + 1, CU_STREAM_WAIT_VALUE_GEQ));
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    store64(h, 256, (1ull << 40) + 1);
    CHECK(query_until_done(s));
    store64(h, 256, ~0ull);
    CHECK(cuStreamWaitValue64(s, dp + 256, 0, CU_STREAM_WAIT_VALUE_NOR));
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    store64(h, 256, 0x00000000FFFFFFFFull);
    CHECK(query_until_done(s));
    store64(h, 256, 1ull << 33);
    CHECK(cuStreamWaitValue64(s, dp + 256, 1ull << 32, CU_STREAM_WAIT_VALUE_AND));
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    store64(h, 256, 1ull << 32);
    CHECK(query_until_done(s));

    /* A write lands in host memory with the stream. */
    CHECK(cuStreamWriteValue64(s, dp + 512, 0x0102030405060708ull, 0));
    CHECK(cuStreamSynchronize(s));
    ASSERT(*u64_at(h, 512) == 0x0102030405060708ull);

    /* The driver pins registered pages: a wait goes on reading them after the
     * process unmapped the registered mapping (here a shared one, written through
     * another mapping of the same memory), until cuMemHostUnregister. */
    int mfd = memfd_create("stream-memops", 0);
    ASSERT(mfd >= 0 && ftruncate(mfd, 4096) == 0);
    void *view = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    void *other = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    ASSERT(view != MAP_FAILED && other != MAP_FAILED);
    CHECK(cuMemHostRegister(view, 4096, CU_MEMHOSTREGISTER_DEVICEMAP));
    CHECK(cuStreamWaitValue32(s, (CUdeviceptr)view + 8, 1, CU_STREAM_WAIT_VALUE_EQ));
    CHECK(cuStreamWriteValue32(s, (CUdeviceptr)view + 12, 2, 0));
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    ASSERT(munmap(view, 4096) == 0);
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    store32(other, 8, 1);
    CHECK(query_until_done(s));
    ASSERT(*u32_at(other, 12) == 2);
    CHECK(cuMemHostUnregister(view));
    EXPECT(cuStreamWriteValue32(s, (CUdeviceptr)view + 12, 3, 0), CUDA_ERROR_INVALID_VALUE);
    close(mfd);

    /* cuCtxSynchronize waits for a wait too. */
    CHECK(cuStreamWaitValue32(s, dp + 1024, 1, CU_STREAM_WAIT_VALUE_EQ));
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    struct release r2 = {h, 1024, 1};
    ASSERT(pthread_create(&t, NULL, release_later, &r2) == 0);
    CHECK(cuCtxSynchronize());
    ASSERT(pthread_join(t, NULL) == 0);
    CHECK(cuStreamQuery(s));
    printf("OK\n");
}

/* ---------------------------------------------------------------- another process */

static void *map_file(const char *path) {
    int fd = open(path, O_RDWR);
    ASSERT(fd >= 0);
    void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ASSERT(p != MAP_FAILED);
    close(fd);
    return p;
}

/* The other process, on GPU 1: releases the parent's wait with a write from its
 * own stream, then waits for the parent's answer (written by the parent's stream
 * once its wait ended). */
static void mode_child(const char *path) {
    setup(1);
    void *p = map_file(path);
    CUdeviceptr dp;
    CUstream s;
    CHECK(cuMemHostRegister(p, 4096, CU_MEMHOSTREGISTER_DEVICEMAP));
    CHECK(cuMemHostGetDevicePointer(&dp, p, 0));
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    /* The parent's stream waits for this write before it answers. */
    ASSERT(*u32_at(p, 0) == 0 && *u32_at(p, 4) == 0);
    CHECK(cuStreamWriteValue32(s, dp, 1, 0));
    CHECK(cuStreamWaitValue32(s, dp + 4, 2, CU_STREAM_WAIT_VALUE_EQ));
    CHECK(cuStreamWriteValue32(s, dp + 8, 3, 0));
    CHECK(query_until_done(s));
    CHECK(cuMemHostUnregister(p));
    printf("OK\n");
}

static void mode_cross_process(const char *dir) {
    setup(0);
    char path[4096];
    snprintf(path, sizeof path, "%s/flags", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    ASSERT(fd >= 0);
    ASSERT(ftruncate(fd, 4096) == 0);
    close(fd);
    void *p = map_file(path);
    CUdeviceptr dp;
    CUstream s;
    CHECK(cuMemHostRegister(p, 4096, CU_MEMHOSTREGISTER_DEVICEMAP));
    CHECK(cuMemHostGetDevicePointer(&dp, p, 0));
    CHECK(cuStreamCreate(&s, 0));
    CHECK(cuStreamWaitValue32(s, dp, 1, CU_STREAM_WAIT_VALUE_EQ));
    CHECK(cuStreamWriteValue32(s, dp + 4, 2, 0));
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    ASSERT(*u32_at(p, 4) == 0);

    pid_t pid;
    char *argv[] = {"/proc/self/exe", "child", path, NULL};
    ASSERT(posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ) == 0);
    /* Released by the child's write; the child then sees this stream's answer. */
    CHECK(query_until_done(s));
    ASSERT(*u32_at(p, 4) == 2);
    int status = 0;
    ASSERT(waitpid(pid, &status, 0) == pid);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    ASSERT(*u32_at(p, 8) == 3);
    CHECK(cuMemHostUnregister(p));
    printf("OK\n");
}

/* ---------------------------------------------------------------- batches */

static CUstreamBatchMemOpParams value_op(CUstreamBatchMemOpType op, CUdeviceptr addr,
                                         uint64_t value, unsigned flags) {
    CUstreamBatchMemOpParams p;
    memset(&p, 0, sizeof p);
    p.waitValue.operation = op;
    p.waitValue.address = addr;
    p.waitValue.value64 = value;
    p.waitValue.flags = flags;
    return p;
}

static void mode_batch(void) {
    setup(0);
    CUdeviceptr d;
    void *h;
    CUstream s;
    CHECK(cuMemAlloc(&d, 4096));
    CHECK(cuMemsetD8(d, 0, 4096));
    CHECK(cuMemHostAlloc(&h, 4096, CU_MEMHOSTALLOC_DEVICEMAP));
    memset(h, 0, 4096);
    CUdeviceptr hp = (CUdeviceptr)h;
    CHECK(cuStreamCreate(&s, 0));

    /* Mixed operations run in array order: writes and waits of both widths on
     * device memory, a flush and a barrier, then a wait on host memory that
     * holds the last write back. */
    CUstreamBatchMemOpParams ops[9];
    ops[0] = value_op(CU_STREAM_MEM_OP_WRITE_VALUE_32, d, 1, 0);
    ops[1] = value_op(CU_STREAM_MEM_OP_WAIT_VALUE_32, d, 1, CU_STREAM_WAIT_VALUE_EQ);
    ops[2] = value_op(CU_STREAM_MEM_OP_WRITE_VALUE_64, d + 8, 0xFEEDFACE00000001ull, 0);
    memset(&ops[3], 0, sizeof ops[3]);
    ops[3].flushRemoteWrites.operation = CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES;
    memset(&ops[4], 0, sizeof ops[4]);
    ops[4].memoryBarrier.operation = CU_STREAM_MEM_OP_BARRIER;
    ops[4].memoryBarrier.flags = CU_STREAM_MEMORY_BARRIER_TYPE_GPU;
    ops[5] = value_op(CU_STREAM_MEM_OP_WAIT_VALUE_64, d + 8, 0xFEEDFACE00000000ull,
                      CU_STREAM_WAIT_VALUE_GEQ);
    ops[6] = value_op(CU_STREAM_MEM_OP_WRITE_VALUE_32, hp + 16, 4, 0);
    ops[7] = value_op(CU_STREAM_MEM_OP_WAIT_VALUE_32, hp, 0x2, CU_STREAM_WAIT_VALUE_AND);
    ops[8] = value_op(CU_STREAM_MEM_OP_WRITE_VALUE_32, hp + 8, 5, 0);
    CHECK(cuStreamBatchMemOp(s, 9, ops, 0));
    /* Everything before the host wait ran; the write after it did not. */
    double end = now_s() + 60;
    while (*u32_at(h, 16) != 4) {
        ASSERT(now_s() < end);
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    ASSERT(*u32_at(h, 8) == 0);
    store32(h, 0, 0x3);
    CHECK(query_until_done(s));
    ASSERT(*u32_at(h, 8) == 5);
    uint64_t got[2];
    CHECK(cuMemcpyDtoH(got, d, sizeof got));
    ASSERT((uint32_t)got[0] == 1);
    ASSERT(got[1] == 0xFEEDFACE00000001ull);

    /* A batch with one bad entry is refused whole: its first write never runs. */
    CUstreamBatchMemOpParams bad[2];
    bad[0] = value_op(CU_STREAM_MEM_OP_WRITE_VALUE_32, d + 64, 9, 0);
    unsigned types[] = {0, 7, 99};
    for (unsigned i = 0; i < sizeof types / sizeof types[0]; i++) {
        memset(&bad[1], 0, sizeof bad[1]);
        bad[1].operation = types[i];
        EXPECT(cuStreamBatchMemOp(s, 2, bad, 0), CUDA_ERROR_INVALID_VALUE);
    }
    bad[1] = value_op(CU_STREAM_MEM_OP_WAIT_VALUE_32, d + 66, 0, 0); /* misaligned */
    EXPECT(cuStreamBatchMemOp(s, 2, bad, 0), CUDA_ERROR_INVALID_VALUE);
    bad[1] = value_op(CU_STREAM_MEM_OP_WAIT_VALUE_64, d + 68, 0, 0); /* misaligned */
    EXPECT(cuStreamBatchMemOp(s, 2, bad, 0), CUDA_ERROR_INVALID_VALUE);
    bad[1] = value_op(CU_STREAM_MEM_OP_WAIT_VALUE_32, d, 0, 5); /* bad condition */
    EXPECT(cuStreamBatchMemOp(s, 2, bad, 0), CUDA_ERROR_INVALID_VALUE);
    bad[1] = value_op(CU_STREAM_MEM_OP_WRITE_VALUE_32, d, 0,
                      CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER); /* v1 only */
    EXPECT(cuStreamBatchMemOp(s, 2, bad, 0), CUDA_ERROR_INVALID_VALUE);
    bad[1] = value_op(CU_STREAM_MEM_OP_WRITE_VALUE_32, (CUdeviceptr)&types, 0, 0);
    EXPECT(cuStreamBatchMemOp(s, 2, bad, 0), CUDA_ERROR_INVALID_VALUE); /* pageable */
    memset(&bad[1], 0, sizeof bad[1]);
    bad[1].flushRemoteWrites.operation = CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES;
    bad[1].flushRemoteWrites.flags = 1;
    EXPECT(cuStreamBatchMemOp(s, 2, bad, 0), CUDA_ERROR_INVALID_VALUE);
    memset(&bad[1], 0, sizeof bad[1]);
    bad[1].memoryBarrier.operation = CU_STREAM_MEM_OP_BARRIER;
    bad[1].memoryBarrier.flags = 2;
    EXPECT(cuStreamBatchMemOp(s, 2, bad, 0), CUDA_ERROR_INVALID_VALUE);
    /* The array: not NULL, 1 to 255 entries ("less than 256"); flags 0. */
    EXPECT(cuStreamBatchMemOp(s, 1, NULL, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamBatchMemOp(s, 0, bad, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamBatchMemOp(s, 1, bad, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuStreamSynchronize(s));
    uint32_t untouched = 1;
    CHECK(cuMemcpyDtoH(&untouched, d + 64, 4));
    ASSERT(untouched == 0);

    static CUstreamBatchMemOpParams many[256];
    for (unsigned i = 0; i < 256; i++)
        many[i] = value_op(CU_STREAM_MEM_OP_WRITE_VALUE_32, d + 1024 + 4 * i, i + 1, 0);
    EXPECT(cuStreamBatchMemOp(s, 256, many, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuStreamBatchMemOp(s, 255, many, 0));
    CHECK(cuStreamSynchronize(s));
    uint32_t words[256];
    CHECK(cuMemcpyDtoH(words, d + 1024, sizeof words));
    for (unsigned i = 0; i < 255; i++)
        ASSERT(words[i] == i + 1);
    ASSERT(words[255] == 0);

    /* The v1 batch is not supported (no NVreg_EnableStreamMemOPs=1). */
    batch_fn batch_v1 = (batch_fn)dlsym(RTLD_DEFAULT, "cuStreamBatchMemOp");
    ASSERT(batch_v1);
    EXPECT(batch_v1(s, 1, ops, 0), CUDA_ERROR_NOT_SUPPORTED);
    printf("OK\n");
}

/* ---------------------------------------------------------------- device pointers */

static void mode_device_pointer(void) {
    setup(0);
    CUdeviceptr dp, d;
    void *h;
    CHECK(cuMemAlloc(&d, 4096));

    /* Allocated with DEVICEMAP: the host pointer, inside the range too. */
    CHECK(cuMemHostAlloc(&h, 8192, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
    CHECK(cuMemHostGetDevicePointer(&dp, h, 0));
    ASSERT(dp == (CUdeviceptr)h);
    CHECK(cuMemHostGetDevicePointer(&dp, (char *)h + 100, 0));
    ASSERT(dp == (CUdeviceptr)h + 100);
    EXPECT(cuMemHostGetDevicePointer(&dp, (char *)h + 8192, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemHostGetDevicePointer(&dp, h, 1), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemHostGetDevicePointer(NULL, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemHostGetDevicePointer(&dp, h, 0));
    /* Its device pointer works as before: copies both ways, UVA copies, pointer
     * attributes. */
    memset(h, 0x11, 8192);
    CHECK(cuMemcpyHtoD(d, (void *)dp, 4096));
    CHECK(cuMemsetD8(d, 0x22, 16));
    CHECK(cuMemcpyDtoH((void *)(dp + 4096), d, 4096));
    ASSERT(((unsigned char *)h)[4096] == 0x22 && ((unsigned char *)h)[4096 + 16] == 0x11);
    CHECK(cuMemcpy(d, dp, 64));
    unsigned int mt = 0;
    CUdeviceptr attr_dp = 0;
    void *attr_hp = NULL;
    CHECK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dp));
    ASSERT(mt == CU_MEMORYTYPE_HOST);
    CHECK(cuPointerGetAttribute(&attr_dp, CU_POINTER_ATTRIBUTE_DEVICE_POINTER, dp));
    ASSERT(attr_dp == dp);
    CHECK(cuPointerGetAttribute(&attr_hp, CU_POINTER_ATTRIBUTE_HOST_POINTER, dp));
    ASSERT(attr_hp == h);
    CHECK(cuMemFreeHost(h));
    EXPECT(cuMemHostGetDevicePointer(&dp, h, 0), CUDA_ERROR_INVALID_VALUE);

    /* Pinned without DEVICEMAP, pageable, device memory: refused. */
    CHECK(cuMemHostAlloc(&h, 4096, 0));
    EXPECT(cuMemHostGetDevicePointer(&dp, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemFreeHost(h));
    CHECK(cuMemAllocHost(&h, 4096));
    EXPECT(cuMemHostGetDevicePointer(&dp, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemFreeHost(h));
    void *pageable = aligned_alloc(4096, 8192);
    ASSERT(pageable);
    EXPECT(cuMemHostGetDevicePointer(&dp, pageable, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemHostGetDevicePointer(&dp, (void *)d, 0), CUDA_ERROR_INVALID_VALUE);

    /* Registered: with DEVICEMAP only, until unregistered. */
    CHECK(cuMemHostRegister(pageable, 4096, 0));
    EXPECT(cuMemHostGetDevicePointer(&dp, pageable, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemHostUnregister(pageable));
    CHECK(cuMemHostRegister(pageable, 4096, CU_MEMHOSTREGISTER_DEVICEMAP));
    CHECK(cuMemHostGetDevicePointer(&dp, pageable, 0));
    ASSERT(dp == (CUdeviceptr)pageable);
    EXPECT(cuMemHostGetDevicePointer(&dp, (char *)pageable + 4096, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemHostUnregister(pageable));
    EXPECT(cuMemHostGetDevicePointer(&dp, pageable, 0), CUDA_ERROR_INVALID_VALUE);
    free(pageable);

    /* Without a current context (CUDA_ERROR_INVALID_CONTEXT). */
    CHECK(cuMemHostAlloc(&h, 4096, CU_MEMHOSTALLOC_DEVICEMAP));
    CUcontext cur;
    CHECK(cuCtxPopCurrent(&cur));
    EXPECT(cuMemHostGetDevicePointer(&dp, h, 0), CUDA_ERROR_INVALID_CONTEXT);
    CHECK(cuCtxPushCurrent(cur));
    CHECK(cuMemFreeHost(h));
    printf("OK\n");
}

/* ---------------------------------------------------------------- entry points */

static void *proc(const char *name, int version, cuuint64_t flags) {
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    CUresult r = cuGetProcAddress(name, &fn, version, flags, &st);
    return r == CUDA_SUCCESS ? fn : NULL;
}

static void *sym(const char *name) {
    void *fn = dlsym(RTLD_DEFAULT, name);
    ASSERT(fn);
    return fn;
}

/* cuGetProcAddress gives the v2 API from CUDA 11.7 on, v1 before, the per-thread
 * twins on request; the _ptsz twins run on the per-thread default stream. */
static void mode_procaddr(void) {
    setup(0);
    const char *bases[] = {"cuStreamWaitValue32", "cuStreamWaitValue64", "cuStreamWriteValue32",
                           "cuStreamWriteValue64", "cuStreamBatchMemOp"};
    for (unsigned i = 0; i < 5; i++) {
        char v2[64], v2pt[64], v1pt[64];
        snprintf(v2, sizeof v2, "%s_v2", bases[i]);
        snprintf(v2pt, sizeof v2pt, "%s_v2_ptsz", bases[i]);
        snprintf(v1pt, sizeof v1pt, "%s_ptsz", bases[i]);
        ASSERT(proc(bases[i], 12000, CU_GET_PROC_ADDRESS_DEFAULT) == sym(v2));
        ASSERT(proc(bases[i], 11070, CU_GET_PROC_ADDRESS_LEGACY_STREAM) == sym(v2));
        ASSERT(proc(bases[i], 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) == sym(v2pt));
        ASSERT(proc(bases[i], 11000, CU_GET_PROC_ADDRESS_DEFAULT) == sym(bases[i]));
        ASSERT(proc(bases[i], 11000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) == sym(v1pt));
    }
    ASSERT(proc("cuStreamWaitValue32", 8000, 0) == sym("cuStreamWaitValue32"));
    ASSERT(proc("cuStreamWaitValue64", 8000, 0) == NULL); /* 64-bit: CUDA 9.0 */
    ASSERT(proc("cuMemHostGetDevicePointer", 12000, 0) == sym("cuMemHostGetDevicePointer_v2"));

    /* The _v2_ptsz twins: stream 0 is this thread's per-thread stream. */
    void *h;
    CHECK(cuMemHostAlloc(&h, 4096, CU_MEMHOSTALLOC_DEVICEMAP));
    memset(h, 0, 4096);
    CUdeviceptr dp = (CUdeviceptr)h;
    wait32_fn wait_pt = (wait32_fn)sym("cuStreamWaitValue32_v2_ptsz");
    wait32_fn write_pt = (wait32_fn)sym("cuStreamWriteValue32_v2_ptsz");
    batch_fn batch_pt = (batch_fn)sym("cuStreamBatchMemOp_v2_ptsz");
    CHECK(wait_pt(0, dp, 1, CU_STREAM_WAIT_VALUE_EQ));
    CHECK(write_pt(0, dp + 4, 6, 0));
    CUstreamBatchMemOpParams op = value_op(CU_STREAM_MEM_OP_WRITE_VALUE_32, dp + 8, 7, 0);
    CHECK(batch_pt(0, 1, &op, 0));
    EXPECT(cuStreamQuery(CU_STREAM_PER_THREAD), CUDA_ERROR_NOT_READY);
    ASSERT(*u32_at(h, 4) == 0 && *u32_at(h, 8) == 0);
    store32(h, 0, 1);
    CHECK(query_until_done(CU_STREAM_PER_THREAD));
    ASSERT(*u32_at(h, 4) == 6 && *u32_at(h, 8) == 7);
    CHECK(cuMemFreeHost(h));
    printf("OK\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODE [ARGS]\n", argv[0]);
        return 2;
    }
    const char *m = argv[1];
    if (!strcmp(m, "device"))
        mode_device();
    else if (!strcmp(m, "rules"))
        mode_rules();
    else if (!strcmp(m, "host"))
        mode_host();
    else if (!strcmp(m, "cross-process") && argc == 3)
        mode_cross_process(argv[2]);
    else if (!strcmp(m, "child") && argc == 3)
        mode_child(argv[2]);
    else if (!strcmp(m, "batch"))
        mode_batch();
    else if (!strcmp(m, "device-pointer"))
        mode_device_pointer();
    else if (!strcmp(m, "procaddr"))
        mode_procaddr();
    else {
        fprintf(stderr, "unknown mode %s\n", m);
        return 2;
    }
    return 0;
}
