/* The simulator refuses, during stream capture, what the real driver refuses
 * (measured on an H100, driver 580.159.04: scripts/gpu-capture-rules.py, whose
 * table capture_table.c checks cell for cell; beyond it, CUDA Programming Guide,
 * "Stream Capture" -> "Prohibited and Unhandled Operations" and "Invalidation";
 * Driver API reference, cuStreamBeginCapture, cuThreadExchangeStreamCaptureMode,
 * cuStreamEndCapture, cuStreamIsCapturing). Each section below is one rule of
 * sim/cuda/src/capture.rs, and each fails on a simulator that lets the call
 * through. Compiled
 * against NVIDIA's cuda.h, linked with -lcuda. Prints "OK" and exits 0, or names
 * the failing check and exits 1. */
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver_check.h"

static CUcontext ctx;
static CUdeviceptr buf;

/* Ends the capture on s, which a refused call must have invalidated: the end
 * reports it and hands back no graph. */
static void end_invalidated(CUstream s) {
    CUstreamCaptureStatus st;
    CHECK(cuStreamIsCapturing(s, &st));
    ASSERT(st == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    /* Further work on the stream fails until the capture ends. */
    EXPECT(cuMemsetD8Async(buf, 1, 16, s), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    CUgraph g = (CUgraph)1;
    EXPECT(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    ASSERT(g == NULL);
    CHECK(cuStreamIsCapturing(s, &st));
    ASSERT(st == CU_STREAM_CAPTURE_STATUS_NONE);
}

/* Ends a capture that must still be valid. */
static void end_valid(CUstream s) {
    CUgraph g = NULL;
    CHECK(cuStreamEndCapture(s, &g));
    ASSERT(g != NULL);
    CHECK(cuGraphDestroy(g));
}

struct other {
    CUstream s;
    CUstreamCaptureMode my_mode;
    CUresult alloc_result;
    CUresult end_result;
};

/* Another thread, in its own capture mode, allocates while the main thread
 * captures, then tries to end the main thread's capture. */
static void *other_thread(void *p) {
    struct other *o = p;
    CUdeviceptr x = 0;
    if (cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
        return NULL;
    CUstreamCaptureMode m = o->my_mode;
    if (cuThreadExchangeStreamCaptureMode(&m) != CUDA_SUCCESS)
        return NULL;
    o->alloc_result = cuMemAlloc(&x, 4096);
    if (o->alloc_result == CUDA_SUCCESS)
        cuMemFree(x);
    CUgraph g;
    o->end_result = cuStreamEndCapture(o->s, &g);
    return NULL;
}

static void run_other(CUstream s, CUstreamCaptureMode mode, struct other *o) {
    pthread_t t;
    memset(o, 0, sizeof *o);
    o->s = s;
    o->my_mode = mode;
    o->alloc_result = o->end_result = CUDA_ERROR_UNKNOWN;
    ASSERT(pthread_create(&t, NULL, other_thread, o) == 0);
    ASSERT(pthread_join(t, NULL) == 0);
}

int main(void) {
    CUdevice dev;
    CUstream blocking, nonblocking;
    CUstreamCaptureStatus st;
    unsigned char host[64];

    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuMemAlloc(&buf, 1 << 20));
    CHECK(cuMemsetD8(buf, 0x11, 1 << 20));
    CHECK(cuStreamCreate(&blocking, CU_STREAM_DEFAULT));
    CHECK(cuStreamCreate(&nonblocking, CU_STREAM_NON_BLOCKING));

    /* Captured work does not run until the graph is launched. */
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    cuuint64_t id1 = 0, id2 = 0;
    CHECK(cuStreamGetCaptureInfo(nonblocking, &st, &id1, NULL, NULL, NULL));
    ASSERT(st == CU_STREAM_CAPTURE_STATUS_ACTIVE && id1 != 0);
    CHECK(cuMemsetD8Async(buf, 0x22, 64, nonblocking));
    CUgraph g;
    CHECK(cuStreamEndCapture(nonblocking, &g));
    CHECK(cuCtxSynchronize());
    CHECK(cuMemcpyDtoH(host, buf, 64));
    ASSERT(host[0] == 0x11 && host[63] == 0x11);
    CUgraphExec ge;
    CHECK(cuGraphInstantiate(&ge, g, 0));
    CHECK(cuGraphLaunch(ge, nonblocking));
    CHECK(cuStreamSynchronize(nonblocking));
    CHECK(cuMemcpyDtoH(host, buf, 64));
    ASSERT(host[0] == 0x22 && host[63] == 0x22);
    CHECK(cuGraphExecDestroy(ge));
    CHECK(cuGraphDestroy(g));

    /* Rule 1: synchronizing or querying the capturing stream. */
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CHECK(cuStreamGetCaptureInfo(nonblocking, &st, &id2, NULL, NULL, NULL));
    ASSERT(id2 != id1);
    EXPECT(cuStreamSynchronize(nonblocking), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(nonblocking);
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    EXPECT(cuStreamQuery(nonblocking), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(nonblocking);
    /* ... and asking it for its flags, even in a RELAXED capture (measured). */
    unsigned int flags;
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_RELAXED));
    EXPECT(cuStreamGetFlags(nonblocking, &flags), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(nonblocking);
    /* Its priority and context may be asked. */
    int prio;
    CUcontext c;
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CHECK(cuStreamGetPriority(nonblocking, &prio));
    CHECK(cuStreamGetCtx(nonblocking, &c));
    ASSERT(c == ctx);
    end_valid(nonblocking);

    /* Rule 2: cuCtxSynchronize encompasses every capture of the context, even one
     * on a non-blocking stream. */
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    EXPECT(cuCtxSynchronize(), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(nonblocking);

    /* Rule 3: the legacy stream while a blocking stream captures, refused with
     * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT in every mode: synchronizing it, and
     * synchronous calls (which run on it). */
    CHECK(cuStreamBeginCapture(blocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    EXPECT(cuStreamSynchronize(CU_STREAM_LEGACY), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    end_invalidated(blocking);
    CHECK(cuStreamBeginCapture(blocking, CU_STREAM_CAPTURE_MODE_RELAXED));
    EXPECT(cuMemcpyHtoD(buf, host, 64), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    end_invalidated(blocking);
    CHECK(cuStreamBeginCapture(blocking, CU_STREAM_CAPTURE_MODE_RELAXED));
    EXPECT(cuMemsetD8Async(buf, 0, 64, 0), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    end_invalidated(blocking);
    /* Its capture status cannot be asked either, but asking invalidates nothing
     * (Driver API reference, cuStreamIsCapturing). */
    CHECK(cuStreamBeginCapture(blocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    EXPECT(cuStreamIsCapturing(CU_STREAM_LEGACY, &st), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    EXPECT(cuStreamGetCaptureInfo(CU_STREAM_LEGACY, &st, &id2, NULL, NULL, NULL),
           CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    CHECK(cuStreamIsCapturing(blocking, &st));
    ASSERT(st == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    end_valid(blocking);
    /* ... but a non-blocking stream's capture does not involve the legacy stream. */
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_RELAXED));
    CHECK(cuMemcpyHtoD(buf, host, 64));
    CHECK(cuStreamSynchronize(CU_STREAM_LEGACY));
    CHECK(cuStreamIsCapturing(CU_STREAM_LEGACY, &st));
    ASSERT(st == CU_STREAM_CAPTURE_STATUS_NONE);
    end_valid(nonblocking);

    /* Rule 4: potentially unsafe calls, by the thread's capture mode. */
    CUdeviceptr p = 0;
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    EXPECT(cuMemAlloc(&p, 4096), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(nonblocking);
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    EXPECT(cuMemFree(buf), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(nonblocking);
    /* Pinning host memory, every way (cuMemHostAlloc measured, the others by
     * extension), and unpinning it. */
    void *pinned = NULL;
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    EXPECT(cuMemAllocHost(&pinned, 4096), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(nonblocking);
    void *page = aligned_alloc(4096, 4096);
    ASSERT(page != NULL);
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    EXPECT(cuMemHostRegister(page, 4096, 0), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(nonblocking);
    CHECK(cuMemHostRegister(page, 4096, 0));
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    EXPECT(cuMemHostUnregister(page), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(nonblocking);
    CHECK(cuMemHostUnregister(page));
    free(page);
    /* Waiting for work outside the capture: a stream that does not capture (the
     * capture here is the blocking stream's), an event recorded outside it
     * (cuStreamQuery, cuStreamSynchronize, cuEventQuery measured;
     * cuEventSynchronize by extension). */
    CUevent done;
    CHECK(cuEventCreate(&done, CU_EVENT_DEFAULT));
    CHECK(cuEventRecord(done, nonblocking));
    CHECK(cuStreamBeginCapture(blocking, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    EXPECT(cuEventSynchronize(done), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(blocking);
    CHECK(cuStreamBeginCapture(blocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    EXPECT(cuStreamSynchronize(nonblocking), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(blocking);
    /* ... which a RELAXED thread may do (as it may allocate, below). */
    CUstreamCaptureMode relaxed = CU_STREAM_CAPTURE_MODE_RELAXED;
    CHECK(cuThreadExchangeStreamCaptureMode(&relaxed));
    CHECK(cuStreamBeginCapture(blocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CHECK(cuEventSynchronize(done));
    CHECK(cuEventQuery(done));
    CHECK(cuStreamSynchronize(nonblocking));
    CHECK(cuStreamQuery(nonblocking));
    CHECK(cuMemAllocHost(&pinned, 4096));
    CHECK(cuMemFreeHost(pinned));
    end_valid(blocking);
    CHECK(cuThreadExchangeStreamCaptureMode(&relaxed));
    CHECK(cuEventDestroy(done));
    /* A thread in RELAXED mode may allocate during its own capture. */
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    CHECK(cuThreadExchangeStreamCaptureMode(&mode));
    ASSERT(mode == CU_STREAM_CAPTURE_MODE_GLOBAL);
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CHECK(cuMemAlloc(&p, 4096));
    CHECK(cuMemFree(p));
    end_valid(nonblocking);
    CHECK(cuThreadExchangeStreamCaptureMode(&mode));
    ASSERT(mode == CU_STREAM_CAPTURE_MODE_RELAXED);
    /* A capture begun RELAXED does not prohibit its own thread. */
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_RELAXED));
    CHECK(cuMemAlloc(&p, 4096));
    CHECK(cuMemFree(p));
    end_valid(nonblocking);
    /* Another thread in THREAD_LOCAL mode ignores this thread's GLOBAL capture,
     * and cannot end it. */
    struct other o;
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    run_other(nonblocking, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, &o);
    ASSERT(o.alloc_result == CUDA_SUCCESS);
    ASSERT(o.end_result == CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
    end_valid(nonblocking);
    /* Another thread in GLOBAL mode is prohibited by it, and invalidates it. */
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    run_other(nonblocking, CU_STREAM_CAPTURE_MODE_GLOBAL, &o);
    ASSERT(o.alloc_result == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(nonblocking);

    /* Rule 5: an event recorded inside a capture cannot be queried. */
    CUevent ev;
    CHECK(cuEventCreate(&ev, CU_EVENT_DEFAULT));
    CHECK(cuStreamBeginCapture(nonblocking, CU_STREAM_CAPTURE_MODE_RELAXED));
    CHECK(cuEventRecord(ev, nonblocking));
    EXPECT(cuEventQuery(ev), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(nonblocking);
    CHECK(cuEventDestroy(ev));

    /* Nothing captured above ever ran: buf still holds the host bytes copied in
     * the legacy-stream check (all from the 0x22 graph run). */
    CHECK(cuMemcpyDtoH(host, buf, 64));
    ASSERT(host[0] == 0x22 && host[63] == 0x22);

    CHECK(cuStreamDestroy(blocking));
    CHECK(cuStreamDestroy(nonblocking));
    CHECK(cuMemFree(buf));
    CHECK(cuDevicePrimaryCtxRelease(dev));
    puts("OK");
    return 0;
}
