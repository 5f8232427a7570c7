/* Kernels launched through NVIDIA's CUDA runtime, as nvcc's generated code does:
 * a fatbin registered at start-up (__cudaRegisterFatBinary, __cudaRegisterFunction:
 * the simulator accepts any image and resolves the built-in kernels by name), then
 * cudaLaunchKernel. The runtime 12.x loads the fatbin with cuLibraryLoadData and,
 * at a kernel's first launch, takes its function in the current context
 * (cuLibraryGetModule, cuModuleGetFunction): with lazy loading (the default since
 * CUDA 12.2) that is when the code takes device memory. Usage:
 *   cudart_kernels lazy MODULE_BYTES   the code's memory is taken at the first
 *                                      launch, not before; later launches take none
 *   cudart_kernels eager MODULE_BYTES  (CUDA_MODULE_LOADING=EAGER) none is taken at
 *                                      the first launch: it was at start-up
 *   cudart_kernels full MODULE_BYTES   the GPU filled but for less than the code:
 *                                      the first launch fails with out of memory,
 *                                      and works once memory is freed
 *   cudart_kernels run MIB             MIB MiB in 64 MiB chunks, set to 0 (so
 *                                      resident before any kernel), then each
 *                                      filled by a kernel and checked by another,
 *                                      then copied back and checked byte by byte
 * MODULE_BYTES is what the simulator charges a module (KIWI_SIM_MODULE_MEMORY).
 * Prints "pid <pid>" first and "OK" last; exits 2 on a failed call, 3 on a wrong
 * figure or byte. */
#include "cudart_common.h"

#include <unistd.h>

#define CHUNK (64ull << 20)

typedef struct {
    int magic;
    int version;
    const unsigned long long *data;
    void *filename_or_fatbins;
} fatbin_wrapper;

typedef struct {
    unsigned x, y, z;
} uint3_;

extern void **__cudaRegisterFatBinary(void *wrapper);
extern void __cudaRegisterFatBinaryEnd(void **handle);
extern void __cudaRegisterFunction(void **handle, const char *host_fun, char *device_fun,
                                   const char *device_name, int thread_limit, uint3_ *tid,
                                   uint3_ *bid, dim3 *bdim, dim3 *gdim, int *wsize);

/* A fatbin header (magic, version 1, header size 16, no entries). */
static const unsigned long long fatbin[2] __attribute__((aligned(8))) = {
    0x00100001BA55ED50ull, 0};
static fatbin_wrapper wrapper = {0x466243B1, 1, fatbin, NULL};

/* The host stubs the runtime knows each kernel by. */
static void kiwi_fill(void) {}
static void kiwi_checksum(void) {}

__attribute__((constructor)) static void register_kernels(void) {
    void **h = __cudaRegisterFatBinary(&wrapper);
    __cudaRegisterFunction(h, (const char *)kiwi_fill, (char *)"kiwi_fill", "kiwi_fill", -1,
                           NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFunction(h, (const char *)kiwi_checksum, (char *)"kiwi_checksum",
                           "kiwi_checksum", -1, NULL, NULL, NULL, NULL, NULL);
    __cudaRegisterFatBinaryEnd(h);
}

static const dim3 one = {1, 1, 1};

static cudaError_t fill(unsigned *p, unsigned value, unsigned long long words) {
    void *args[] = {&p, &value, &words};
    return cudaLaunchKernel((const void *)kiwi_fill, one, one, args, 0, 0);
}

static cudaError_t checksum(const unsigned *p, unsigned long long words,
                            unsigned long long *out) {
    void *args[] = {&p, &words, &out};
    return cudaLaunchKernel((const void *)kiwi_checksum, one, one, args, 0, 0);
}

static size_t free_now(void) {
    size_t f, t;
    CHECK(cudaMemGetInfo(&f, &t));
    return f;
}

/* The first launch takes `want` bytes (lazy) or none (eager); the next none. */
static void check_charges(size_t want) {
    unsigned *p;
    CHECK(cudaMalloc((void **)&p, 4096));
    size_t before = free_now();
    CHECK(fill(p, 7, 1024));
    CHECK(cudaDeviceSynchronize());
    size_t after_first = free_now();
    CHECK(fill(p, 9, 1024));
    CHECK(cudaDeviceSynchronize());
    size_t after_second = free_now();
    printf("first launch took %zu, second %zu\n", before - after_first,
           after_first - after_second);
    ASSERT(before - after_first == want);
    ASSERT(after_first == after_second);
    unsigned h[1024];
    CHECK(cudaMemcpy(h, p, sizeof h, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 1024; i++)
        ASSERT(h[i] == 9);
}

static void check_full(size_t code) {
    unsigned *p;
    CHECK(cudaMalloc((void **)&p, 4096));
    /* Take all but half the code's memory. */
    size_t left = free_now();
    ASSERT(left > code);
    void *big;
    CHECK(cudaMalloc(&big, left - code / 2));
    cudaError_t r = fill(p, 7, 1024);
    printf("launch on a full GPU: %d %s\n", (int)r, cudaGetErrorName(r));
    ASSERT(r == cudaErrorMemoryAllocation);
    CHECK(cudaFree(big));
    CHECK(fill(p, 7, 1024));
    CHECK(cudaDeviceSynchronize());
}

static void run(size_t mib) {
    unsigned chunks = (unsigned)((mib << 20) / CHUNK);
    ASSERT(chunks >= 1);
    unsigned **d = calloc(chunks, sizeof *d);
    unsigned long long *sums;
    CHECK(cudaMalloc((void **)&sums, chunks * sizeof *sums));
    unsigned long long words = CHUNK / 4;
    /* The memory first (resident once a memset runs), then the kernels. */
    for (unsigned c = 0; c < chunks; c++) {
        CHECK(cudaMalloc((void **)&d[c], CHUNK));
        CHECK(cudaMemset(d[c], 0, CHUNK));
    }
    CHECK(cudaDeviceSynchronize());
    for (unsigned c = 0; c < chunks; c++) {
        CHECK(fill(d[c], c + 1, words));
        CHECK(checksum(d[c], words, sums + c));
    }
    unsigned long long *h = calloc(chunks, sizeof *h);
    CHECK(cudaMemcpy(h, sums, chunks * sizeof *h, cudaMemcpyDeviceToHost));
    unsigned *back = malloc(CHUNK);
    for (unsigned c = 0; c < chunks; c++) {
        ASSERT(h[c] == (unsigned long long)(c + 1) * words);
        CHECK(cudaMemcpy(back, d[c], CHUNK, cudaMemcpyDeviceToHost));
        for (unsigned long long i = 0; i < words; i++)
            ASSERT(back[i] == c + 1);
    }
    printf("%u chunks filled and checked by kernels\n", chunks);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: cudart_kernels lazy|eager|full MODULE_BYTES | run MIB\n");
        return 1;
    }
    printf("pid %d\n", (int)getpid());
    fflush(stdout);
    size_t n = strtoull(argv[2], NULL, 10);
    CHECK(cudaFree(0));
    if (!strcmp(argv[1], "lazy"))
        check_charges(n);
    else if (!strcmp(argv[1], "eager"))
        check_charges(0);
    else if (!strcmp(argv[1], "full"))
        check_full(n);
    else if (!strcmp(argv[1], "run"))
        run(n);
    else {
        fprintf(stderr, "unknown mode %s\n", argv[1]);
        return 1;
    }
    printf("OK\n");
    return 0;
}
