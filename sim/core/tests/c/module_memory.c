/* Each module loaded through the driver API costs its context device memory
 * (KIWI_SIM_MODULE_MEMORY) until it is unloaded or its context goes: cuMemGetInfo
 * shows it, a load that does not fit is CUDA_ERROR_OUT_OF_MEMORY, and unloading or
 * destroying the context gives it back. With lazy loading (the default; not with
 * CUDA_MODULE_LOADING=EAGER) the memory is taken at the module's first
 * cuModuleGetFunction, which loads its kernels, and that call is the one refused
 * when it does not fit. A library (cuLibraryLoadData, context-independent) costs
 * the same in each context it is loaded into: lazily at its first use there
 * (cuKernelGetFunction, or a launch of its CUkernel, refused with out of memory
 * when it does not fit), eagerly in the current context at its load; unloading it
 * gives every context's back. Every check fails on a simulator whose modules cost
 * nothing, or cost it at the other time.
 *
 * usage: module_memory <module MiB>   prints "OK" or names the failure
 * Compiled against NVIDIA's cuda.h, linked with -lcuda; one GPU. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

#include "driver_check.h"

static size_t free_now(void) {
    size_t f, t;
    CHECK(cuMemGetInfo(&f, &t));
    return f;
}

#define EXPECT_FREE(want)                                                      \
    do {                                                                       \
        size_t f_ = free_now();                                                \
        if (f_ != (size_t)(want)) {                                            \
            fprintf(stderr, "FAIL %s:%d free %zu bytes, want %zu\n", __FILE__, \
                    __LINE__, f_, (size_t)(want));                             \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

static int lazy;

/* Loads a module and gets a function of it, checking when its memory is taken. */
static void load(CUmodule *m, size_t mod) {
    CUfunction f;
    const size_t before = free_now();
    CHECK(cuModuleLoadData(m, "kiwi"));
    EXPECT_FREE(lazy ? before : before - mod);
    CHECK(cuModuleGetFunction(&f, *m, "kiwi_fill"));
    EXPECT_FREE(before - mod);
    CHECK(cuModuleGetFunction(&f, *m, "kiwi_add"));
    EXPECT_FREE(before - mod);
}

/* A library: its memory is taken in each context at its first use there. */
static void library(CUcontext primary, CUdevice dev, size_t mod) {
    CUlibrary lib;
    CUkernel k;
    CUfunction f;
    CUcontext other;
    CUdeviceptr p, big;
    const size_t free0 = free_now();
    CHECK(cuLibraryLoadData(&lib, "kiwi", NULL, NULL, 0, NULL, NULL, 0));
    EXPECT_FREE(lazy ? free0 : free0 - mod);
    CHECK(cuLibraryGetKernel(&k, lib, "kiwi_fill"));
    EXPECT(cuLibraryGetKernel(&k, lib, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
    CHECK(cuLibraryGetKernel(&k, lib, "kiwi_fill"));
    CHECK(cuKernelGetFunction(&f, k));
    EXPECT_FREE(free0 - mod);
    CHECK(cuKernelGetFunction(&f, k));
    EXPECT_FREE(free0 - mod);

    /* Another context: loaded there at the first launch of the kernel handle, which
     * is refused while it does not fit. */
    CHECK(cuCtxCreate(&other, 0, dev));
    const size_t free1 = free_now();
    CHECK(cuMemAlloc(&p, 4096));
    unsigned value = 7;
    unsigned long long words = 1024;
    void *args[] = {&p, &value, &words};
    CHECK(cuMemAlloc(&big, free_now() - mod / 2));
    EXPECT(cuLaunchKernel((CUfunction)k, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL),
           CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(cuMemFree(big));
    CHECK(cuLaunchKernel((CUfunction)k, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL));
    CHECK(cuCtxSynchronize());
    unsigned h[1024];
    CHECK(cuMemcpyDtoH(h, p, sizeof h));
    if (h[1023] != 7) {
        fprintf(stderr, "FAIL the library's kernel wrote %u, want 7\n", h[1023]);
        exit(1);
    }
    CHECK(cuMemFree(p));
    EXPECT_FREE(free1 - mod);
    /* Both contexts' code goes. */
    CHECK(cuLibraryUnload(lib));
    EXPECT_FREE(free1 + mod);
    EXPECT(cuKernelGetFunction(&f, k), CUDA_ERROR_INVALID_HANDLE);
    CHECK(cuCtxDestroy(other));
    CHECK(cuCtxSetCurrent(primary));
    EXPECT_FREE(free0);
}

int main(int argc, char **argv) {
    if (argc != 2 || atol(argv[1]) <= 0) {
        fprintf(stderr, "usage: module_memory MIB\n");
        return 2;
    }
    const size_t mod = (size_t)atol(argv[1]) << 20;
    CUdevice dev;
    CUcontext primary, extra;
    CUmodule m1, m2, m3, m4;
    CUfunction f;
    CUdeviceptr big;
    CUmoduleLoadingMode mode;
    CHECK(cuInit(0));
    CHECK(cuModuleGetLoadingMode(&mode));
    lazy = mode == CU_MODULE_LAZY_LOADING;
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&primary, dev));
    CHECK(cuCtxSetCurrent(primary));
    const size_t free0 = free_now();

    load(&m1, mod);
    EXPECT_FREE(free0 - mod);
    CHECK(cuModuleLoadDataEx(&m2, "kiwi", 0, NULL, NULL));
    CHECK(cuModuleGetFunction(&f, m2, "kiwi_fill"));
    EXPECT_FREE(free0 - 2 * mod);
    CHECK(cuModuleUnload(m1));
    EXPECT_FREE(free0 - mod);
    EXPECT(cuModuleUnload(m1), CUDA_ERROR_INVALID_HANDLE);
    EXPECT(cuModuleGetFunction(&f, m1, "kiwi_fill"), CUDA_ERROR_INVALID_HANDLE);
    EXPECT_FREE(free0 - mod);

    /* A module that does not fit: refused at load, or (lazy) at its first function,
     * which works once there is room. */
    CHECK(cuMemAlloc(&big, free0 - mod - mod / 2));
    if (lazy) {
        CHECK(cuModuleLoadData(&m3, "kiwi"));
        EXPECT(cuModuleGetFunction(&f, m3, "kiwi_fill"), CUDA_ERROR_OUT_OF_MEMORY);
        CHECK(cuMemFree(big));
        EXPECT_FREE(free0 - mod);
        CHECK(cuModuleGetFunction(&f, m3, "kiwi_fill"));
        EXPECT_FREE(free0 - 2 * mod);
        CHECK(cuModuleUnload(m3));
    } else {
        EXPECT(cuModuleLoadData(&m3, "kiwi"), CUDA_ERROR_OUT_OF_MEMORY);
        CHECK(cuMemFree(big));
    }
    EXPECT_FREE(free0 - mod);

    /* Destroying a context unloads its modules. */
    CHECK(cuCtxCreate(&extra, 0, dev));
    const size_t free1 = free_now();
    load(&m4, mod);
    EXPECT_FREE(free1 - mod);
    CHECK(cuCtxDestroy(extra));
    CHECK(cuCtxSetCurrent(primary));
    EXPECT_FREE(free0 - mod);

    CHECK(cuModuleUnload(m2));
    EXPECT_FREE(free0);
    library(primary, dev, mod);
    printf("OK %s\n", lazy ? "lazy" : "eager");
    return 0;
}
