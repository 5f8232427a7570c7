/* scripts/gpu-capture-rules.py in C: which driver calls break a stream capture.
 * The same calls, made the same way, print the same table, which
 * tests/c_program.rs compares with the one measured on an H100 (driver
 * 580.159.04) in docs/gpu-validation.md. For each call a capture is begun on a
 * blocking stream (flags 0) with cuStreamBeginCapture_v2, the call is made, and the
 * cell is the call's result / the capture's status after it (1 active,
 * 2 invalidated) / cuStreamEndCapture's result. Four places for the call: the
 * capturing thread with the capture begun GLOBAL and THREAD_LOCAL; another thread
 * (its default GLOBAL mode) beside a GLOBAL capture, and another thread that
 * switched itself to RELAXED with cuThreadExchangeStreamCaptureMode. "other" is a
 * non-blocking stream that does not capture, "legacy" stream NULL; the event was
 * recorded on "other" before the capture. Compiled against NVIDIA's cuda.h, linked
 * with -lcuda. Exits 1 when a setup call fails. */
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "driver_check.h"

#define MIB2 ((size_t)2 << 20)

static CUcontext ctx;
static CUstream cap, other;
static CUevent ev;
static CUdeviceptr dev;
static void *host;
static CUmemAllocationProp prop;

/* What a call made, undone after the capture ends (as the script's cleanup). */
static CUdeviceptr alloc_p, reserve_p;
static CUmemGenericAllocationHandle create_h;
static void *host_p;

static void cleanup(void) {
    if (alloc_p)
        CHECK(cuMemFree(alloc_p));
    if (create_h)
        CHECK(cuMemRelease(create_h));
    if (reserve_p)
        CHECK(cuMemAddressFree(reserve_p, MIB2));
    if (host_p)
        CHECK(cuMemFreeHost(host_p));
    alloc_p = reserve_p = 0;
    create_h = 0;
    host_p = NULL;
}

static CUresult get_flags_capturing(void) {
    unsigned int f;
    return cuStreamGetFlags(cap, &f);
}
static CUresult get_priority_capturing(void) {
    int p;
    return cuStreamGetPriority(cap, &p);
}
static CUresult get_ctx_capturing(void) {
    CUcontext c;
    return cuStreamGetCtx(cap, &c);
}
static CUresult is_capturing_capturing(void) {
    CUstreamCaptureStatus s;
    return cuStreamIsCapturing(cap, &s);
}
static CUresult query_capturing(void) { return cuStreamQuery(cap); }
static CUresult get_flags_other(void) {
    unsigned int f;
    return cuStreamGetFlags(other, &f);
}
static CUresult query_other(void) { return cuStreamQuery(other); }
static CUresult query_legacy(void) { return cuStreamQuery(NULL); }
static CUresult sync_other(void) { return cuStreamSynchronize(other); }
static CUresult event_query(void) { return cuEventQuery(ev); }
static CUresult event_record(void) { return cuEventRecord(ev, other); }
static CUresult ctx_get_current(void) {
    CUcontext c;
    return cuCtxGetCurrent(&c);
}
static CUresult ctx_set_current(void) { return cuCtxSetCurrent(ctx); }
static CUresult ctx_get_device(void) {
    CUdevice d;
    return cuCtxGetDevice(&d);
}
static CUresult mem_get_info(void) {
    size_t f, t;
    return cuMemGetInfo_v2(&f, &t);
}
static CUresult mem_alloc(void) { return cuMemAlloc_v2(&alloc_p, MIB2); }
static CUresult mem_create(void) { return cuMemCreate(&create_h, MIB2, &prop, 0); }
static CUresult address_reserve(void) {
    return cuMemAddressReserve(&reserve_p, MIB2, 0, 0, 0);
}
static CUresult host_alloc(void) { return cuMemHostAlloc(&host_p, MIB2, 0); }
static CUresult htod_async_other(void) {
    return cuMemcpyHtoDAsync_v2(dev, host, MIB2, other);
}
static CUresult htod_async_legacy(void) {
    return cuMemcpyHtoDAsync_v2(dev, host, MIB2, NULL);
}
static CUresult dtoh(void) { return cuMemcpyDtoH_v2(host, dev, MIB2); }
static CUresult ctx_sync(void) { return cuCtxSynchronize(); }

static const struct {
    const char *name;
    CUresult (*fn)(void);
} CALLS[] = {
    {"cuStreamGetFlags(capturing)", get_flags_capturing},
    {"cuStreamGetPriority(capturing)", get_priority_capturing},
    {"cuStreamGetCtx(capturing)", get_ctx_capturing},
    {"cuStreamIsCapturing(capturing)", is_capturing_capturing},
    {"cuStreamQuery(capturing)", query_capturing},
    {"cuStreamGetFlags(other)", get_flags_other},
    {"cuStreamQuery(other)", query_other},
    {"cuStreamQuery(legacy)", query_legacy},
    {"cuStreamSynchronize(other)", sync_other},
    {"cuEventQuery(other's)", event_query},
    {"cuEventRecord(other)", event_record},
    {"cuCtxGetCurrent", ctx_get_current},
    {"cuCtxSetCurrent(same)", ctx_set_current},
    {"cuCtxGetDevice", ctx_get_device},
    {"cuMemGetInfo_v2", mem_get_info},
    {"cuMemAlloc_v2", mem_alloc},
    {"cuMemCreate", mem_create},
    {"cuMemAddressReserve", address_reserve},
    {"cuMemHostAlloc", host_alloc},
    {"cuMemcpyHtoDAsync_v2(other)", htod_async_other},
    {"cuMemcpyHtoDAsync_v2(legacy)", htod_async_legacy},
    {"cuMemcpyDtoH_v2", dtoh},
    {"cuCtxSynchronize", ctx_sync},
};

struct job {
    CUresult (*fn)(void);
    int relaxed;
    CUresult r;
};

static void *body(void *p) {
    struct job *j = p;
    cuCtxSetCurrent(ctx);
    if (j->relaxed) {
        CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
        cuThreadExchangeStreamCaptureMode(&m);
    }
    j->r = j->fn();
    return NULL;
}

/* The call on another thread; -1 when it hangs (5 s). */
static int on_thread(CUresult (*fn)(void), int relaxed) {
    struct job j = {fn, relaxed, CUDA_ERROR_UNKNOWN};
    pthread_t t;
    ASSERT(pthread_create(&t, NULL, body, &j) == 0);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 5;
    if (pthread_timedjoin_np(t, NULL, &until) != 0)
        return -1;
    return (int)j.r;
}

static const char *PLACES[] = {"this thread, global", "this thread, thread-local",
                               "other thread", "other thread, relaxed"};

int main(void) {
    CUdevice d;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&d, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, d));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&cap, 0));
    CHECK(cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
    CHECK(cuEventCreate(&ev, 0));
    CHECK(cuEventRecord(ev, other));
    CHECK(cuMemAlloc_v2(&dev, MIB2));
    host = calloc(1, MIB2);
    ASSERT(host != NULL);
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;

    printf("| call |");
    for (int p = 0; p < 4; p++)
        printf(" %s |", PLACES[p]);
    printf("\n| --- | --- | --- | --- | --- |\n");
    for (size_t i = 0; i < sizeof CALLS / sizeof CALLS[0]; i++) {
        printf("| %s |", CALLS[i].name);
        for (int p = 0; p < 4; p++) {
            CUstreamCaptureMode mode =
                p == 1 ? CU_STREAM_CAPTURE_MODE_THREAD_LOCAL : CU_STREAM_CAPTURE_MODE_GLOBAL;
            CHECK(cuStreamBeginCapture_v2(cap, mode));
            int r = p < 2 ? (int)CALLS[i].fn() : on_thread(CALLS[i].fn, p == 3);
            if (r == -1) {
                printf(" hung |\n");
                fprintf(stderr, "FAIL %s hung in a capture\n", CALLS[i].name);
                return 1;
            }
            CUstreamCaptureStatus st = (CUstreamCaptureStatus)-1;
            cuStreamIsCapturing(cap, &st);
            CUgraph g = NULL;
            CUresult e = cuStreamEndCapture(cap, &g);
            if (g)
                CHECK(cuGraphDestroy(g));
            CHECK(cuCtxSynchronize());
            cleanup();
            printf(" %d / %d / %d |", r, (int)st, (int)e);
        }
        printf("\n");
        fflush(stdout);
    }
    printf("cells: the call's result / capture status after it (1 active, 2 invalidated) / "
           "EndCapture's result\n");
    CHECK(cuMemFree(dev));
    CHECK(cuEventDestroy(ev));
    CHECK(cuStreamDestroy(cap));
    CHECK(cuStreamDestroy(other));
    CHECK(cuDevicePrimaryCtxRelease(d));
    free(host);
    return 0;
}
