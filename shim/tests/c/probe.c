/* A small CUDA driver-API application for libkiwi.so's integration tests, compiled
 * against NVIDIA's cuda.h. Three ways into the driver, chosen at build/run time:
 *   - linked with -lcuda and calling the exports directly        (mode "link")
 *   - built with -DKIWI_DLOPEN: dlopen("libcuda.so.1") + dlsym    (mode "dlopen";
 *     cuLaunchKernel through the default dlsym@@GLIBC_2.34 and cuMemAlloc_v2 through
 *     the old dlsym@GLIBC_2.2.5, so both symbol versions are exercised)
 *   - linked, resolving everything through cuGetProcAddress_v2 with the
 *     per-thread-default-stream flag                              (mode "procaddr")
 * Work: allocate MIB MiB (one large allocation plus SMALL 4 KiB ones), fill it, then
 * BURSTS times: add 1 everywhere, spin GPU_MS on the GPU (or queue PROBE_KERNELS
 * kernels of PROBE_SPIN_US each), checksum on the GPU and verify, sleep CPU_MS. At the end every byte is copied back and checked.
 * Prints "resolve <name> <library> <symbol>" for the launch and allocation entry
 * points, "pid <pid>", then "OK". Exit 2 on a CUDA error (its name printed), 3 on a
 * mismatch. */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>

#ifdef KIWI_DLOPEN
#if defined(__x86_64__)
__asm__(".symver dlsym_old,dlsym@GLIBC_2.2.5");
#elif defined(__aarch64__)
__asm__(".symver dlsym_old,dlsym@GLIBC_2.17");
#endif
extern void *dlsym_old(void *, const char *);
#endif

typedef struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*CtxCreate)(CUcontext *, unsigned, CUdevice);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*ModuleLoadData)(CUmodule *, const void *);
    CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void **, void **);
    CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*CtxSynchronize)(void);
    CUresult (*MemGetInfo)(size_t *, size_t *);
    CUresult (*GetErrorName)(CUresult, const char **);
    CUresult (*MemAllocHost)(void **, size_t);
} Api;

static Api api;

static void die_cuda(const char *what, CUresult r) {
    const char *name = "?";
    if (api.GetErrorName) api.GetErrorName(r, &name);
    printf("CUDA error %s (%d) in %s\n", name ? name : "?", (int)r, what);
    fflush(stdout);
    exit(2);
}
#define CK(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) die_cuda(#call, r_); } while (0)

static void report(const char *name, void *fn) {
    Dl_info info;
    memset(&info, 0, sizeof info);
    if (fn && dladdr(fn, &info)) {
        const char *lib = info.dli_fname ? strrchr(info.dli_fname, '/') : NULL;
        printf("resolve %s %s %s\n", name, lib ? lib + 1 : (info.dli_fname ? info.dli_fname : "?"),
               info.dli_sname ? info.dli_sname : "?");
    } else {
        printf("resolve %s ? ?\n", name);
    }
}

static void resolve(const char *mode) {
    if (strcmp(mode, "dlopen") == 0) {
#ifdef KIWI_DLOPEN
        void *h = dlopen("libcuda.so.1", RTLD_NOW);
        if (!h) { printf("dlopen: %s\n", dlerror()); exit(2); }
#define R(field, name) api.field = (void *)dlsym(h, name)
        R(Init, "cuInit"); R(DeviceGet, "cuDeviceGet"); R(CtxCreate, "cuCtxCreate_v2");
        R(MemFree, "cuMemFree_v2"); R(ModuleLoadData, "cuModuleLoadData");
        R(ModuleGetFunction, "cuModuleGetFunction"); R(LaunchKernel, "cuLaunchKernel");
        R(MemcpyDtoH, "cuMemcpyDtoH_v2"); R(CtxSynchronize, "cuCtxSynchronize");
        R(MemGetInfo, "cuMemGetInfo_v2"); R(GetErrorName, "cuGetErrorName");
        R(MemAllocHost, "cuMemAllocHost_v2");
#undef R
        api.MemAlloc = (void *)dlsym_old(h, "cuMemAlloc_v2");
        report("dlsym:cuLaunchKernel", (void *)api.LaunchKernel);
        report("dlsym_old:cuMemAlloc_v2", (void *)api.MemAlloc);
#else
        printf("this build has no dlopen mode\n"); exit(2);
#endif
        return;
    }
#ifndef KIWI_DLOPEN
    api.Init = cuInit; api.DeviceGet = cuDeviceGet; api.CtxCreate = cuCtxCreate;
    api.MemAlloc = cuMemAlloc; api.MemFree = cuMemFree; api.ModuleLoadData = cuModuleLoadData;
    api.ModuleGetFunction = cuModuleGetFunction; api.LaunchKernel = cuLaunchKernel;
    api.MemcpyDtoH = cuMemcpyDtoH; api.CtxSynchronize = cuCtxSynchronize;
    api.MemGetInfo = cuMemGetInfo; api.GetErrorName = cuGetErrorName;
    api.MemAllocHost = cuMemAllocHost;
    if (strcmp(mode, "procaddr") == 0) {
        CUdriverProcAddressQueryResult st;
        cuuint64_t f = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
#define P(field, name) CK(cuGetProcAddress_v2(name, (void **)&api.field, 12000, f, &st))
        P(Init, "cuInit"); P(DeviceGet, "cuDeviceGet"); P(CtxCreate, "cuCtxCreate");
        P(MemAlloc, "cuMemAlloc"); P(MemFree, "cuMemFree"); P(ModuleLoadData, "cuModuleLoadData");
        P(ModuleGetFunction, "cuModuleGetFunction"); P(LaunchKernel, "cuLaunchKernel");
        P(MemcpyDtoH, "cuMemcpyDtoH"); P(CtxSynchronize, "cuCtxSynchronize");
        P(MemGetInfo, "cuMemGetInfo");
#undef P
    }
#endif
    report("cuLaunchKernel", (void *)api.LaunchKernel);
    report("cuMemAlloc", (void *)api.MemAlloc);
    report("cuMemcpyDtoH", (void *)api.MemcpyDtoH);
}

static const char ptx[] = ".version 7.0\n.target sm_52\n.address_size 64\n"
                          ".visible .entry kiwi_fill() { ret; }\n";

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s MODE MIB BURSTS GPU_MS CPU_MS SMALL [fork]\n", argv[0]);
        return 64;
    }
    const char *mode = argv[1];
    size_t mib = strtoull(argv[2], NULL, 10);
    int bursts = atoi(argv[3]);
    unsigned long long gpu_ns = strtoull(argv[4], NULL, 10) * 1000000ULL;
    int cpu_ms = atoi(argv[5]);
    int small = atoi(argv[6]);
    int do_fork = argc > 7 && strcmp(argv[7], "fork") == 0;
    /* PROBE_KERNELS=K, PROBE_SPIN_US=U: each burst queues K kernels of U µs instead
     * of one GPU_MS kernel. */
    long queued = getenv("PROBE_KERNELS") ? atol(getenv("PROBE_KERNELS")) : 0;
    unsigned long long queued_ns =
        (getenv("PROBE_SPIN_US") ? strtoull(getenv("PROBE_SPIN_US"), NULL, 10) : 10) * 1000ULL;
    printf("pid %d\n", (int)getpid());
    resolve(mode);
    fflush(stdout);

    CUdevice dev;
    CUcontext ctx;
    CK(api.Init(0));
    CK(api.DeviceGet(&dev, 0));
    CK(api.CtxCreate(&ctx, 0, dev));
    size_t free_ = 0, total = 0;
    CK(api.MemGetInfo(&free_, &total));
    printf("meminfo free %zu total %zu\n", free_, total);

    CUmodule mod;
    CUfunction fill, add, sum, spin;
    CK(api.ModuleLoadData(&mod, ptx));
    CK(api.ModuleGetFunction(&fill, mod, "kiwi_fill"));
    CK(api.ModuleGetFunction(&add, mod, "kiwi_add"));
    CK(api.ModuleGetFunction(&sum, mod, "kiwi_checksum"));
    CK(api.ModuleGetFunction(&spin, mod, "kiwi_spin"));

    size_t bytes = mib << 20;
    unsigned long long words = bytes / 4;
    CUdeviceptr d, out;
    CK(api.MemAlloc(&d, bytes));
    CK(api.MemAlloc(&out, 8));
    CUdeviceptr *smalls = calloc(small ? small : 1, sizeof *smalls);
    for (int i = 0; i < small; i++) CK(api.MemAlloc(&smalls[i], 4096));
    unsigned int value = 7;
    void *fill_args[] = {&d, &value, &words};
    CK(api.LaunchKernel(fill, 64, 1, 1, 256, 1, 1, 0, NULL, fill_args, NULL));
    for (int i = 0; i < small; i++) {
        unsigned int v = (unsigned)i;
        unsigned long long w = 1024;
        void *a[] = {&smalls[i], &v, &w};
        CK(api.LaunchKernel(fill, 1, 1, 1, 32, 1, 1, 0, NULL, a, NULL));
    }
    CK(api.CtxSynchronize());
    if (do_fork) {
        /* A data-loader worker: never touches CUDA. */
        pid_t c = fork();
        if (c == 0) { usleep(300 * 1000); _exit(0); }
    }

    for (int b = 0; b < bursts; b++) {
        unsigned int one = 1;
        void *add_args[] = {&d, &one, &words};
        CK(api.LaunchKernel(add, 64, 1, 1, 256, 1, 1, 0, NULL, add_args, NULL));
        if (queued) {
            /* Many short kernels queued at once (drop-latency measurement). */
            void *spin_args[] = {&queued_ns};
            for (long k = 0; k < queued; k++)
                CK(api.LaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, NULL, spin_args, NULL));
        } else if (gpu_ns) {
            void *spin_args[] = {&gpu_ns};
            CK(api.LaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, NULL, spin_args, NULL));
        }
        void *sum_args[] = {&d, &words, &out};
        CK(api.LaunchKernel(sum, 64, 1, 1, 256, 1, 1, 0, NULL, sum_args, NULL));
        unsigned long long got = 0;
        CK(api.MemcpyDtoH(&got, out, 8));
        unsigned long long want = words * (unsigned long long)(value + b + 1);
        if (got != want) {
            printf("MISMATCH burst %d checksum %llu want %llu\n", b, got, want);
            return 3;
        }
        if (cpu_ms) usleep(cpu_ms * 1000);
    }
    /* Every byte. */
    /* Pinned, like the shim's swap buffers: the copy is the bandwidth baseline. */
    unsigned int *host = NULL;
    CK(api.MemAllocHost((void **)&host, bytes));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    CK(api.MemcpyDtoH(host, d, bytes));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
    printf("copy_dtoh_bytes_per_s %.0f\n", secs > 0 ? bytes / secs : 0.0);
    unsigned int expect = value + bursts;
    for (unsigned long long i = 0; i < words; i++) {
        if (host[i] != expect) {
            printf("MISMATCH word %llu = %u want %u\n", i, host[i], expect);
            return 3;
        }
    }
    for (int i = 0; i < small; i++) {
        unsigned int w[1024];
        CK(api.MemcpyDtoH(w, smalls[i], 4096));
        for (int k = 0; k < 1024; k++)
            if (w[k] != (unsigned)i) { printf("MISMATCH small %d\n", i); return 3; }
        CK(api.MemFree(smalls[i]));
    }
    CK(api.MemFree(d));
    if (do_fork) { int st; wait(&st); }
    printf("OK\n");
    return 0;
}
