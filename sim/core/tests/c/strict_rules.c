/* The simulator is as strict as the real driver about VMM access, IPC and stream
 * ordering. Each section fails on a simulator that lets the call through.
 * Compiled against NVIDIA's cuda.h, linked with -lcuda; needs 2 GPUs. Prints "OK"
 * and exits 0, or names the failing check and exits 1. */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "driver_check.h"

static const char ptx[] = ".version 7.0\n.target sm_52\n.address_size 64\n";

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(void) {
    CUdevice d0, d1;
    CUcontext c0, c1;
    unsigned char host[4096];

    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&d0, 0));
    CHECK(cuDeviceGet(&d1, 1));
    CHECK(cuDevicePrimaryCtxRetain(&c0, d0));
    CHECK(cuDevicePrimaryCtxRetain(&c1, d1));
    CHECK(cuCtxSetCurrent(c0));

    /* A VMM mapping is reachable only from the devices cuMemSetAccess granted
     * (Driver API reference, cuMemSetAccess). */
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = d0;
    size_t gran = 0;
    CHECK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUmemGenericAllocationHandle h;
    CHECK(cuMemCreate(&h, gran, &prop, 0));
    CUdeviceptr va;
    CHECK(cuMemAddressReserve(&va, gran, 0, 0, 0));
    CHECK(cuMemMap(va, gran, 0, h, 0));
    CUmemAccessDesc acc;
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = d0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK(cuMemSetAccess(va, gran, &acc, 1));
    CHECK(cuMemsetD8(va, 0x5A, gran));
    CHECK(cuMemcpyDtoH(host, va, sizeof host));
    ASSERT(host[0] == 0x5A);
    /* Device 1 was not granted: neither copies nor kernels there reach it. */
    CHECK(cuCtxSetCurrent(c1));
    EXPECT(cuMemcpyDtoH(host, va, sizeof host), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemsetD8(va, 0, 16), CUDA_ERROR_INVALID_VALUE);
    {
        CUcontext tmp;
        CUmodule mod;
        CUfunction fill;
        CHECK(cuCtxCreate(&tmp, 0, d1));
        CHECK(cuModuleLoadData(&mod, ptx));
        CHECK(cuModuleGetFunction(&fill, mod, "kiwi_fill"));
        unsigned int v = 1;
        unsigned long long words = 16;
        void *args[] = {&va, &v, &words};
        CHECK(cuLaunchKernel(fill, 1, 1, 1, 32, 1, 1, 0, 0, args, NULL));
        EXPECT(cuCtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
        CHECK(cuCtxDestroy(tmp));
    }
    /* Granting device 1 read access lets it read, not write. */
    CHECK(cuCtxSetCurrent(c1));
    acc.location.id = d1;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
    CHECK(cuMemSetAccess(va, gran, &acc, 1));
    memset(host, 0, sizeof host);
    CHECK(cuMemcpyDtoH(host, va, sizeof host));
    ASSERT(host[0] == 0x5A && host[sizeof host - 1] == 0x5A);
    EXPECT(cuMemsetD8(va, 0, 16), CUDA_ERROR_INVALID_VALUE);
    /* ... and device 0 kept its read-write access. */
    CHECK(cuCtxSetCurrent(c0));
    CHECK(cuMemsetD8(va, 0x33, 16));

    /* IPC: only the base of a cuMemAlloc allocation can be exported; VMM memory
     * cannot (Driver API reference, cuIpcGetMemHandle). */
    CUipcMemHandle ipc;
    EXPECT(cuIpcGetMemHandle(&ipc, va), CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr lin;
    CHECK(cuMemAlloc(&lin, 1 << 20));
    CHECK(cuIpcGetMemHandle(&ipc, lin));
    EXPECT(cuIpcGetMemHandle(&ipc, lin + 4096), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemFree(lin));
    EXPECT(cuIpcGetMemHandle(&ipc, lin), CUDA_ERROR_INVALID_VALUE);

    CHECK(cuMemUnmap(va, gran));
    CHECK(cuMemRelease(h));
    CHECK(cuMemAddressFree(va, gran));

    /* A non-blocking stream is not ordered with the legacy stream (Driver API
     * reference, "Stream synchronization behavior"): legacy-stream work and its
     * synchronization do not wait for 300 ms of work on a non-blocking stream. */
    {
        CUmodule mod;
        CUfunction spin;
        CUstream nb, blocking;
        CUdeviceptr small;
        CHECK(cuModuleLoadData(&mod, ptx));
        CHECK(cuModuleGetFunction(&spin, mod, "kiwi_spin"));
        CHECK(cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));
        CHECK(cuStreamCreate(&blocking, CU_STREAM_DEFAULT));
        CHECK(cuMemAlloc(&small, 4096));
        unsigned long long ns = 300000000ull;
        void *args[] = {&ns};
        double t0 = now_ms();
        CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, nb, args, NULL));
        CHECK(cuMemsetD8Async(small, 0x44, 4096, CU_STREAM_LEGACY));
        CHECK(cuMemcpyDtoH(host, small, 4096)); /* synchronous, legacy stream */
        CHECK(cuStreamSynchronize(CU_STREAM_LEGACY));
        double legacy_ms = now_ms() - t0;
        ASSERT(host[0] == 0x44 && host[4095] == 0x44);
        EXPECT(cuStreamQuery(nb), CUDA_ERROR_NOT_READY);
        ASSERT(legacy_ms < 150.0);
        /* A blocking stream is ordered with the legacy stream: its synchronization
         * waits for legacy work before it. */
        CHECK(cuStreamSynchronize(nb));
        t0 = now_ms();
        CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, CU_STREAM_LEGACY, args, NULL));
        CHECK(cuMemsetD8Async(small, 0x45, 4096, blocking));
        CHECK(cuStreamSynchronize(blocking));
        ASSERT(now_ms() - t0 >= 290.0);
        /* cuCtxSynchronize waits for every stream, non-blocking ones included. */
        t0 = now_ms();
        CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, nb, args, NULL));
        CHECK(cuCtxSynchronize());
        ASSERT(now_ms() - t0 >= 290.0);
        CHECK(cuMemFree(small));
        CHECK(cuStreamDestroy(nb));
        CHECK(cuStreamDestroy(blocking));
    }

    CHECK(cuDevicePrimaryCtxRelease(d0));
    CHECK(cuDevicePrimaryCtxRelease(d1));
    puts("OK");
    return 0;
}
