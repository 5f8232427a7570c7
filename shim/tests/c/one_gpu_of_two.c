/* A notebook that opens every visible GPU but works on one, through NVIDIA's CUDA
 * runtime: accelerate, TensorFlow and JAX open every GPU, and
 * torch.cuda.mem_get_info(1) makes a context on GPU 1. Usage:
 *   one_gpu_of_two BURSTS [gpu1]
 * Takes a context on GPU 1 (cudaFree(0) + cudaMemGetInfo), then on GPU 0 runs BURSTS
 * bursts of a 16 MiB memset and a copy back, every byte checked, 20 ms apart; prints
 * "max_burst_ms X" (the slowest burst, waits included) and "gpu0_done_ns T"
 * (CLOCK_MONOTONIC, the clock of the arbiter's event log). With "gpu1": then runs one
 * host function on GPU 1's default stream and prints "gpu1_work_ns T"
 * (CLOCK_MONOTONIC, when it ran). Prints "OK"; exits 2 on a failed call, 3 on a
 * wrong byte. */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHECK(call)                                                            \
    do {                                                                       \
        cudaError_t r_ = (call);                                               \
        if (r_ != cudaSuccess) {                                               \
            printf("FAIL %s:%d %s -> %d %s\n", __FILE__, __LINE__, #call,      \
                   (int)r_, cudaGetErrorName(r_));                             \
            exit(2);                                                           \
        }                                                                      \
    } while (0)

#define N (16u << 20)

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void CUDART_CB on_host(void *p) { *(uint64_t *)p = now_ns(); }

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: one_gpu_of_two BURSTS [gpu1]\n");
        return 1;
    }
    int bursts = atoi(argv[1]);
    int gpu1 = argc > 2 && strcmp(argv[2], "gpu1") == 0;
    size_t free1 = 0, total1 = 0;
    CHECK(cudaSetDevice(1));
    CHECK(cudaFree(0));
    CHECK(cudaMemGetInfo(&free1, &total1));
    CHECK(cudaSetDevice(0));

    unsigned char *d = NULL, *h = malloc(N);
    if (!h) return 1;
    CHECK(cudaMalloc((void **)&d, N));
    double worst = 0;
    for (int b = 0; b < bursts; b++) {
        uint64_t t = now_ns();
        unsigned char v = (unsigned char)(b * 7 + 1);
        CHECK(cudaMemset(d, v, N));
        CHECK(cudaMemcpy(h, d, N, cudaMemcpyDeviceToHost));
        double ms = (double)(now_ns() - t) / 1e6;
        if (ms > worst) worst = ms;
        for (size_t i = 0; i < N; i += 4093)
            if (h[i] != v) {
                printf("byte %zu is %u, want %u\n", i, h[i], v);
                return 3;
            }
        usleep(20000);
    }
    printf("max_burst_ms %.1f\ngpu0_done_ns %llu\n", worst, (unsigned long long)now_ns());
    CHECK(cudaFree(d));

    if (gpu1) {
        volatile uint64_t ran = 0;
        CHECK(cudaSetDevice(1));
        CHECK(cudaLaunchHostFunc(0, on_host, (void *)&ran));
        CHECK(cudaStreamSynchronize(0));
        if (!ran) {
            printf("the host function did not run\n");
            return 3;
        }
        printf("gpu1_work_ns %llu\n", (unsigned long long)ran);
    }
    printf("OK\n");
    fflush(stdout);
    return 0;
}
