/* Compiled against NVIDIA's real cuda.h and linked with -lcuda against the
 * simulator: proves the simulator's ABI (types, enum values, struct layouts,
 * symbol names) matches the real driver's for the calls below. Prints "OK" and
 * exits 0 on success; prints the failing call and exits 1 otherwise. */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHECK(call)                                                            \
    do {                                                                       \
        CUresult r_ = (call);                                                  \
        if (r_ != CUDA_SUCCESS) {                                              \
            const char *n_ = "?";                                              \
            cuGetErrorName(r_, &n_);                                           \
            fprintf(stderr, "FAIL %s:%d %s -> %d %s\n", __FILE__, __LINE__,   \
                    #call, (int)r_, n_);                                       \
            return 1;                                                          \
        }                                                                      \
    } while (0)

#define EXPECT(call, want)                                                     \
    do {                                                                       \
        CUresult r_ = (call);                                                  \
        if (r_ != (want)) {                                                    \
            fprintf(stderr, "FAIL %s:%d %s -> %d, want %s (%d)\n", __FILE__,  \
                    __LINE__, #call, (int)r_, #want, (int)(want));             \
            return 1;                                                          \
        }                                                                      \
    } while (0)

#define ASSERT(cond)                                                           \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "FAIL %s:%d %s\n", __FILE__, __LINE__, #cond);    \
            return 1;                                                          \
        }                                                                      \
    } while (0)

static const char ptx[] = ".version 7.0\n.target sm_52\n.address_size 64\n"
                          ".visible .entry kiwi_fill() { ret; }\n";

static int host_calls = 0;
static void CUDA_CB on_host(void *p) { *(int *)p += 1; }

int main(void) {
    int n = 0, v = 0, major = 0;
    char name[128];
    size_t total = 0, free_ = 0;
    CUdevice dev;
    CUcontext ctx, cur;

    EXPECT(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    CHECK(cuInit(0));
    CHECK(cuDriverGetVersion(&v));
    ASSERT(v >= 12000);
    CHECK(cuDeviceGetCount(&n));
    ASSERT(n == 2); /* the test sets KIWI_SIM_GPUS=2 */
    EXPECT(cuDeviceGet(&dev, n), CUDA_ERROR_INVALID_DEVICE);
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDeviceGetName(name, sizeof name, dev));
    ASSERT(strstr(name, "Kiwi") != NULL);
    CUuuid u0, u1;
    CHECK(cuDeviceGetUuid(&u0, 0));
    CHECK(cuDeviceGetUuid_v2(&u1, 1));
    ASSERT(memcmp(u0.bytes, u1.bytes, 16) != 0);
    CHECK(cuDeviceTotalMem(&total, dev));
    ASSERT(total == (size_t)256 << 20); /* KIWI_SIM_MEMORY=256MiB */
    CHECK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    ASSERT(major >= 5);
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
    ASSERT(v == 1);
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_WARP_SIZE, dev));
    ASSERT(v == 32);

    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuCtxGetCurrent(&cur));
    ASSERT(cur == ctx);
    CHECK(cuMemGetInfo(&free_, &total));
    ASSERT(total == (size_t)256 << 20 && free_ <= total);

    /* Linear memory, copies, memsets. */
    enum { WORDS = 1 << 20 };
    CUdeviceptr d = 0;
    CHECK(cuMemAlloc(&d, WORDS * 4));
    uint32_t *h = malloc(WORDS * 4);
    for (uint32_t i = 0; i < WORDS; i++) h[i] = i;
    CHECK(cuMemcpyHtoD(d, h, WORDS * 4));
    memset(h, 0, WORDS * 4);
    CHECK(cuMemcpyDtoH(h, d + 4 * 100, 4 * 10));
    ASSERT(h[0] == 100 && h[9] == 109);
    CHECK(cuMemsetD32(d, 0xabcdef01u, WORDS));
    CHECK(cuMemcpyDtoH(h, d, WORDS * 4));
    ASSERT(h[0] == 0xabcdef01u && h[WORDS - 1] == 0xabcdef01u);
    EXPECT(cuMemcpyHtoD(d + WORDS * 4 - 4, h, 8), CUDA_ERROR_INVALID_VALUE);
    /* Absurd sizes are refused with the driver's errors, not a crash. */
    CUdeviceptr huge;
    EXPECT(cuMemAlloc(&huge, (size_t)1 << 62), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT(cuMemAlloc(&huge, (size_t)512 << 20), CUDA_ERROR_OUT_OF_MEMORY); /* > 256 MiB GPU */
    EXPECT(cuMemAddressReserve(&huge, (size_t)1 << 62, 0, 0, 0), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT(cuMemsetD32(d, 0, (size_t)-1), CUDA_ERROR_INVALID_VALUE);


    /* Kernels by entry name, launched through kernelParams and extra. */
    CUmodule mod;
    CUfunction fill, add, sum, spin;
    CHECK(cuModuleLoadData(&mod, ptx));
    CHECK(cuModuleGetFunction(&fill, mod, "kiwi_fill"));
    CHECK(cuModuleGetFunction(&add, mod, "kiwi_add"));
    CHECK(cuModuleGetFunction(&sum, mod, "kiwi_checksum"));
    CHECK(cuModuleGetFunction(&spin, mod, "kiwi_spin"));
    EXPECT(cuModuleGetFunction(&spin, mod, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    unsigned int value = 7;
    unsigned long long words = WORDS;
    void *fill_args[] = {&d, &value, &words};
    CHECK(cuLaunchKernel(fill, 64, 1, 1, 256, 1, 1, 0, s, fill_args, NULL));
    struct { CUdeviceptr p; unsigned int delta; unsigned int pad; unsigned long long w; } packed = {d, 5, 0, WORDS};
    size_t packed_size = sizeof packed;
    void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &packed, CU_LAUNCH_PARAM_BUFFER_SIZE, &packed_size, CU_LAUNCH_PARAM_END};
    CHECK(cuLaunchKernel(add, 64, 1, 1, 256, 1, 1, 0, s, NULL, extra));
    CUdeviceptr out;
    CHECK(cuMemAlloc(&out, 8));
    void *sum_args[] = {&d, &words, &out};
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimX = 64; cfg.gridDimY = 1; cfg.gridDimZ = 1;
    cfg.blockDimX = 256; cfg.blockDimY = 1; cfg.blockDimZ = 1;
    cfg.hStream = s;
    CHECK(cuLaunchKernelEx(&cfg, sum, sum_args, NULL));
    unsigned long long ns = 20 * 1000 * 1000;
    void *spin_args[] = {&ns};
    CUevent e0, e1;
    CHECK(cuEventCreate(&e0, 0));
    CHECK(cuEventCreate(&e1, 0));
    CHECK(cuEventRecord(e0, s));
    CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, spin_args, NULL));
    CHECK(cuEventRecord(e1, s));
    CHECK(cuLaunchHostFunc(s, on_host, &host_calls));
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    CHECK(cuStreamSynchronize(s));
    CHECK(cuStreamQuery(s));
    ASSERT(host_calls == 1);
    float ms = 0;
    CHECK(cuEventElapsedTime(&ms, e0, e1));
    ASSERT(ms >= 19.0f && ms < 200.0f);
    unsigned long long got = 0;
    CHECK(cuMemcpyDtoH(&got, out, 8));
    ASSERT(got == 12ull * WORDS);

    /* Pinned host memory and async copies on the per-thread stream. */
    void *pinned;
    CHECK(cuMemAllocHost(&pinned, 4096));
    CHECK(cuMemcpyDtoHAsync(pinned, d, 4096, CU_STREAM_PER_THREAD));
    CHECK(cuStreamSynchronize(CU_STREAM_PER_THREAD));
    ASSERT(((uint32_t *)pinned)[1023] == 12);
    CHECK(cuMemFreeHost(pinned));
    CHECK(cuMemHostRegister(h, 4096, 0));
    EXPECT(cuMemHostRegister(h, 4096, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    CHECK(cuMemHostUnregister(h));

    /* 2D copies and memsets with the real CUDA_MEMCPY2D layout. */
    {
        CUdeviceptr d2;
        size_t pitch = 0;
        CHECK(cuMemAllocPitch(&d2, &pitch, 100, 8, 4));
        ASSERT(pitch >= 100);
        CHECK(cuMemsetD2D8(d2, pitch, 0x11, 100, 8));
        static unsigned char hb[7][64];
        for (int r = 0; r < 7; r++)
            for (int c = 0; c < 64; c++) hb[r][c] = (unsigned char)(r * 64 + c + 1);
        CUDA_MEMCPY2D c2;
        memset(&c2, 0, sizeof c2);
        c2.srcMemoryType = CU_MEMORYTYPE_HOST;
        c2.srcHost = hb;
        c2.srcPitch = 64;
        c2.dstMemoryType = CU_MEMORYTYPE_DEVICE;
        c2.dstDevice = d2;
        c2.dstPitch = pitch;
        c2.dstXInBytes = 10;
        c2.dstY = 1;
        c2.WidthInBytes = 64;
        c2.Height = 7;
        CHECK(cuMemcpy2D(&c2));
        unsigned char *back = malloc(pitch * 8);
        CHECK(cuMemcpyDtoH(back, d2, pitch * 8));
        ASSERT(back[5] == 0x11);                          /* row 0 untouched */
        ASSERT(back[pitch + 9] == 0x11);                  /* left of the x offset */
        ASSERT(back[pitch + 10] == 1);                    /* hb[0][0] */
        ASSERT(back[3 * pitch + 15] == 2 * 64 + 5 + 1);   /* hb[2][5] */
        ASSERT(back[pitch + 74] == 0x11);                 /* right of the width */
        static unsigned char out2[7][64];
        CUDA_MEMCPY2D c3;
        memset(&c3, 0, sizeof c3);
        c3.srcMemoryType = CU_MEMORYTYPE_DEVICE;
        c3.srcDevice = d2;
        c3.srcPitch = pitch;
        c3.srcXInBytes = 10;
        c3.srcY = 1;
        c3.dstMemoryType = CU_MEMORYTYPE_HOST;
        c3.dstHost = out2;
        c3.dstPitch = 64;
        c3.WidthInBytes = 64;
        c3.Height = 7;
        CHECK(cuMemcpy2DAsync(&c3, s));
        CHECK(cuStreamSynchronize(s));
        ASSERT(memcmp(out2, hb, sizeof out2) == 0);
        c3.Height = 9; /* past the allocation */
        EXPECT(cuMemcpy2D(&c3), CUDA_ERROR_INVALID_VALUE);
        free(back);
        CHECK(cuMemFree(d2));
    }

    /* Managed memory: one pointer for host and device; pointer attributes. */
    {
        CUdeviceptr m;
        CHECK(cuMemAllocManaged(&m, 4096, CU_MEM_ATTACH_GLOBAL));
        uint32_t *hm = (uint32_t *)(uintptr_t)m;
        for (int i = 0; i < 1024; i++) hm[i] = 40;
        unsigned long long mw = 1024;
        unsigned int two = 2;
        void *margs[] = {&m, &two, &mw};
        CHECK(cuMemPrefetchAsync(m, 4096, dev, s));
        CHECK(cuLaunchKernel(add, 4, 1, 1, 256, 1, 1, 0, s, margs, NULL));
        CHECK(cuStreamSynchronize(s));
        ASSERT(hm[0] == 42 && hm[1023] == 42);
        unsigned int mt = 0;
        int managed = 0;
        CHECK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, m));
        ASSERT(mt == CU_MEMORYTYPE_UNIFIED);
        CHECK(cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, m));
        ASSERT(managed == 1);
        CHECK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d + 4));
        ASSERT(mt == CU_MEMORYTYPE_DEVICE);
        CUdeviceptr start = 0;
        CHECK(cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, d + 4));
        ASSERT(start == d);
        int ordinal = -1;
        CHECK(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, d));
        ASSERT(ordinal == 0);
        EXPECT(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)&mt),
               CUDA_ERROR_INVALID_VALUE);
        EXPECT(cuMemPrefetchAsync(d, 4096, dev, s), CUDA_ERROR_INVALID_VALUE); /* not managed */
        CHECK(cuMemFree(m));
    }

    /* Graphs: kernels captured on a stream run only when the graph is launched. */
    {
        CUdeviceptr gbuf;
        CHECK(cuMemAlloc(&gbuf, 4096));
        CHECK(cuMemsetD32(gbuf, 0, 1024));
        CUstream cs;
        CHECK(cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING));
        EXPECT(cuStreamBeginCapture(CU_STREAM_LEGACY, CU_STREAM_CAPTURE_MODE_GLOBAL),
               CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        CHECK(cuStreamBeginCapture(cs, CU_STREAM_CAPTURE_MODE_GLOBAL));
        CUstreamCaptureStatus cst;
        CHECK(cuStreamIsCapturing(cs, &cst));
        ASSERT(cst == CU_STREAM_CAPTURE_STATUS_ACTIVE);
        unsigned int three = 3;
        unsigned long long gw = 1024;
        void *gargs[] = {&gbuf, &three, &gw};
        CHECK(cuLaunchKernel(add, 4, 1, 1, 256, 1, 1, 0, cs, gargs, NULL));
        /* Synchronizing a capturing stream is refused and invalidates the capture. */
        EXPECT(cuStreamSynchronize(cs), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        CHECK(cuStreamIsCapturing(cs, &cst));
        ASSERT(cst == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
        EXPECT(cuLaunchKernel(add, 4, 1, 1, 256, 1, 1, 0, cs, gargs, NULL),
               CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        CUgraph graph = (CUgraph)1;
        EXPECT(cuStreamEndCapture(cs, &graph), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        ASSERT(graph == NULL);
        CHECK(cuStreamBeginCapture(cs, CU_STREAM_CAPTURE_MODE_GLOBAL));
        CHECK(cuLaunchKernel(add, 4, 1, 1, 256, 1, 1, 0, cs, gargs, NULL));
        CHECK(cuStreamEndCapture(cs, &graph));
        CHECK(cuStreamIsCapturing(cs, &cst));
        ASSERT(cst == CU_STREAM_CAPTURE_STATUS_NONE);
        uint32_t w0 = 99;
        CHECK(cuMemcpyDtoH(&w0, gbuf, 4));
        ASSERT(w0 == 0); /* captured, not run */
        CUgraphExec ge;
        CHECK(cuGraphInstantiate(&ge, graph, 0));
        CHECK(cuGraphUpload(ge, cs));
        CHECK(cuGraphLaunch(ge, cs));
        CHECK(cuGraphLaunch(ge, cs));
        CHECK(cuStreamSynchronize(cs));
        CHECK(cuMemcpyDtoH(&w0, gbuf + 4092, 4));
        ASSERT(w0 == 6);
        CHECK(cuGraphExecDestroy(ge));
        CHECK(cuGraphDestroy(graph));
        EXPECT(cuGraphLaunch(ge, cs), CUDA_ERROR_INVALID_VALUE);
        CHECK(cuStreamDestroy(cs));
        CHECK(cuMemFree(gbuf));
    }

    /* Function attributes, the module loading mode, context limits. */
    {
        int fv = 0;
        CHECK(cuFuncSetAttribute(add, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 64 << 10));
        CHECK(cuFuncGetAttribute(&fv, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, add));
        ASSERT(fv == 64 << 10);
        EXPECT(cuFuncSetAttribute(add, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 1 << 20),
               CUDA_ERROR_INVALID_VALUE);
        CUmoduleLoadingMode lm;
        CHECK(cuModuleGetLoadingMode(&lm));
        ASSERT(lm == CU_MODULE_LAZY_LOADING);
        size_t lim = 0;
        /* The stack is reserved for every resident thread when the limit is set
         * (108 SMs x 2048 threads): 64 bytes more each is 13.5 MiB; 1 MiB each does
         * not fit, is refused with out of memory and leaves the old value. */
        size_t free0 = 0, free1 = 0, total = 0;
        CHECK(cuMemGetInfo(&free0, &total));
        CHECK(cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 1088));
        CHECK(cuCtxGetLimit(&lim, CU_LIMIT_STACK_SIZE));
        ASSERT(lim == 1088);
        CHECK(cuMemGetInfo(&free1, &total));
        ASSERT(free0 - free1 == (size_t)64 * 108 * 2048);
        EXPECT(cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 1 << 20), CUDA_ERROR_OUT_OF_MEMORY);
        CHECK(cuCtxGetLimit(&lim, CU_LIMIT_STACK_SIZE));
        ASSERT(lim == 1088);
        CHECK(cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 1024));
        CHECK(cuMemGetInfo(&free1, &total));
        ASSERT(free1 == free0);
        EXPECT(cuCtxSetLimit(CU_LIMIT_MAX, 1), CUDA_ERROR_UNSUPPORTED_LIMIT);
    }

    /* VMM with the real CUmemAllocationProp / CUmemAccessDesc layouts. */
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 1;
    size_t gran = 0;
    CHECK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    ASSERT(gran == 2 << 20);
    CUdeviceptr va;
    CUmemGenericAllocationHandle mh;
    CHECK(cuMemAddressReserve(&va, 2 * gran, 0, 0, 0));
    CHECK(cuMemCreate(&mh, 2 * gran, &prop, 0));
    CHECK(cuMemMap(va, 2 * gran, 0, mh, 0));
    /* The memory is on device 1; the memset below runs from the current context
     * (device 0), so both devices are granted access. */
    CUmemAccessDesc acc[2];
    acc[0].location = prop.location;
    acc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    acc[1].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc[1].location.id = 0;
    acc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK(cuMemSetAccess(va, 2 * gran, acc, 2));
    CHECK(cuMemsetD8(va, 1, 2 * gran));
    CHECK(cuMemRelease(mh));
    CHECK(cuMemUnmap(va, 2 * gran));
    CHECK(cuMemAddressFree(va, 2 * gran));

    /* Entry points by base name. */
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    CHECK(cuGetProcAddress("cuMemAlloc", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
    ASSERT(fn == (void *)&cuMemAlloc_v2 && st == CU_GET_PROC_ADDRESS_SUCCESS);
    EXPECT(cuGetProcAddress("cuNoSuchCall", &fn, 12000, 0, &st), CUDA_ERROR_NOT_FOUND);
    ASSERT(fn == NULL && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);

    /* Every result code the simulator names has the real header's value. */
    static const struct { CUresult code; const char *name; } codes[] = {
        {CUDA_SUCCESS, "CUDA_SUCCESS"},
        {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
        {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
        {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
        {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED"},
        {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"},
        {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
        {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE"},
        {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
        {CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT"},
        {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED"},
        {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED"},
        {CUDA_ERROR_INVALID_SOURCE, "CUDA_ERROR_INVALID_SOURCE"},
        {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND"},
        {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM"},
        {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
        {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE"},
        {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"},
        {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
        {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY"},
        {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"},
        {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"},
        {CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE"},
        {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED"},
        {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
        {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
        {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED"},
        {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED"},
        {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
        {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN"},
    };
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
        const char *got = NULL;
        CHECK(cuGetErrorName(codes[i].code, &got));
        if (strcmp(got, codes[i].name) != 0) {
            fprintf(stderr, "FAIL error %d is %s in cuda.h but %s in the simulator\n",
                    (int)codes[i].code, codes[i].name, got);
            return 1;
        }
    }
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, dev));
    ASSERT(v == 1024);
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    ASSERT(v == 108);
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, dev));
    ASSERT(v == 1);
    EXPECT(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX, dev), CUDA_ERROR_INVALID_VALUE);

    const char *en = NULL;
    CHECK(cuGetErrorName(CUDA_ERROR_ILLEGAL_ADDRESS, &en));
    ASSERT(strcmp(en, "CUDA_ERROR_ILLEGAL_ADDRESS") == 0);

    /* A child forked after cuInit cannot use CUDA (as with the real driver). */
    {
        pid_t child = fork();
        if (child == 0) {
            CUdeviceptr x;
            _exit(cuMemAlloc(&x, 4096) == CUDA_ERROR_NOT_INITIALIZED ? 0 : 1);
        }
        int st = 0;
        ASSERT(child > 0 && waitpid(child, &st, 0) == child);
        ASSERT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        CHECK(cuCtxSynchronize()); /* the parent carries on */
    }

    CHECK(cuMemFree(d));
    CHECK(cuMemFree(out));
    CHECK(cuEventDestroy(e0));
    CHECK(cuEventDestroy(e1));
    CHECK(cuStreamDestroy(s));
    CHECK(cuModuleUnload(mod));
    CHECK(cuDevicePrimaryCtxRelease(dev));
    free(h);
    printf("OK\n");
    return 0;
}
