/* A notebook that works, then goes idle on command (driver API, NVIDIA's cuda.h).
 * Usage:
 *   idle_holder MIB SPIN_MS [TOUCH_MIB [wait]]
 * Allocates MIB MiB (with "wait": then prints "ALLOCATED" and waits for a line before
 * any work) and fills it, then runs bursts (add 1 to the first TOUCH_MIB MiB,
 * default all of it, spin SPIN_MS on the GPU, wait for the GPU); prints "RUNNING"
 * after its first burst. Each line on
 * stdin toggles between working and idling: going idle it prints "IDLE <ns>", the
 * CLOCK_MONOTONIC time (the arbiter's clock) at which its last work was done. At the
 * end of its input it checks every byte on the GPU and prints "OK". Exits 2 on a
 * failed call, 3 on a wrong checksum. With PAUSE_MS set in its environment, it
 * pauses that long (on the CPU, the GPU idle) after each burst, as a training loop
 * that loads its next batch. */
#define _GNU_SOURCE
#include <cuda.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ULL + (unsigned long long)t.tv_nsec;
}

static int line_waiting(void) {
    struct pollfd p = {.fd = 0, .events = POLLIN};
    return poll(&p, 1, 0) > 0;
}

static const char ptx[] = ".version 7.0\n.target sm_52\n.address_size 64\n"
                          ".visible .entry kiwi_fill() { ret; }\n";

int main(int argc, char **argv) {
    if (argc < 3 || argc > 5) {
        fprintf(stderr, "usage: idle_holder MIB SPIN_MS [TOUCH_MIB [wait]]\n");
        return 1;
    }
    size_t bytes = (size_t)atoi(argv[1]) << 20;
    unsigned long long spin_ns = strtoull(argv[2], NULL, 10) * 1000000ULL;
    unsigned long long words = bytes / 4;
    unsigned long long touched = argc >= 4 ? ((size_t)atoi(argv[3]) << 20) / 4 : words;
    if (touched > words) touched = words;
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fill, add, sum, spin;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate(&ctx, 0, dev));
    CHECK(cuModuleLoadData(&mod, ptx));
    CHECK(cuModuleGetFunction(&fill, mod, "kiwi_fill"));
    CHECK(cuModuleGetFunction(&add, mod, "kiwi_add"));
    CHECK(cuModuleGetFunction(&sum, mod, "kiwi_checksum"));
    CHECK(cuModuleGetFunction(&spin, mod, "kiwi_spin"));
    CUdeviceptr d, out;
    CHECK(cuMemAlloc(&d, bytes));
    CHECK(cuMemAlloc(&out, 8));
    char line[64];
    if (argc == 5) {
        printf("ALLOCATED\n");
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin))
            return 1;
    }
    unsigned int value = 7;
    void *fill_args[] = {&d, &value, &words};
    CHECK(cuLaunchKernel(fill, 64, 1, 1, 256, 1, 1, 0, NULL, fill_args, NULL));
    unsigned long long bursts = 0, done = 0;
    const char *pause_env = getenv("PAUSE_MS");
    unsigned long long pause_ns = pause_env ? strtoull(pause_env, NULL, 10) * 1000000ULL : 0;
    for (;;) {
        unsigned int one = 1;
        void *add_args[] = {&d, &one, &touched};
        void *spin_args[] = {&spin_ns};
        CHECK(cuLaunchKernel(add, 64, 1, 1, 256, 1, 1, 0, NULL, add_args, NULL));
        CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, NULL, spin_args, NULL));
        CHECK(cuCtxSynchronize());
        done = now_ns();
        if (bursts++ == 0) {
            printf("RUNNING\n");
            fflush(stdout);
        }
        if (pause_ns) {
            unsigned long long until = now_ns() + pause_ns;
            while (now_ns() < until) {
            }
        }
        if (!line_waiting())
            continue;
        if (!fgets(line, sizeof line, stdin))
            break;
        printf("IDLE %llu\n", done);
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin))
            break;
    }
    void *sum_args[] = {&d, &words, &out};
    CHECK(cuLaunchKernel(sum, 64, 1, 1, 256, 1, 1, 0, NULL, sum_args, NULL));
    unsigned long long got = 0;
    CHECK(cuMemcpyDtoH(&got, out, 8));
    unsigned long long want = touched * (unsigned long long)(value + bursts) +
                              (words - touched) * (unsigned long long)value;
    if (got != want) {
        printf("MISMATCH checksum %llu want %llu after %llu bursts\n", got, want, bursts);
        return 3;
    }
    CHECK(cuMemFree(d));
    printf("OK\n");
    fflush(stdout);
    return 0;
}
