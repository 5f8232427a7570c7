/* A JAX-like notebook: one large allocation, a small part of it used, and Kiwi's
 * discard hint (kiwiMemDiscard, found with dlsym as an application would) for the
 * rest. Driver API, NVIDIA's cuda.h.
 *
 * Usage: discard MODE MIB USED_MIB ROUNDS [SPIN_MS PAUSE_MS]
 *   MIB 0: 75% of the free memory cuMemGetInfo reports (JAX's preallocation).
 *   Fills the allocation with 7, runs one burst (add 1 to the first USED_MIB, spin
 *   SPIN_MS on the GPU, default 20), prints "RUNNING" and waits for a line on stdin;
 *   then runs ROUNDS more bursts, each followed by PAUSE_MS (default 150) on the CPU
 *   with the GPU idle, so that a waiting partner gets the GPU. At the end it checks
 *   its bytes on the GPU and prints "OK".
 * MODE, what happens after each burst:
 *   none           nothing: every byte is live.
 *   eager          discards the unused tail at once (it is dead until the next burst).
 *   hint           a thread answers the shim's questions (kiwi_hint_wait) by
 *                  discarding the unused tail.
 *   mute           a thread takes each of the shim's questions and never answers
 *                  (every byte is live): a swap-out waits its whole hint wait.
 *   all-then-part  discards the whole allocation, then writes the used part (the
 *                  write voids the discard: every byte must survive).
 *   discard-launch discards the tail, then launches a kernel over the whole
 *                  allocation (the launch voids it: every byte must survive).
 *   bad            only checks that bad ranges are refused (no rounds).
 * With eager/hint the tail is dead and only the used part is checked; with none,
 * mute and the voided modes the whole allocation is. Exits 2 on a failed call, 3 on
 * a wrong checksum, 4 when the hint functions are missing. */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

typedef CUresult (*discard_fn)(CUdeviceptr, size_t);
typedef int64_t (*hint_wait_fn)(int);
typedef void (*hint_done_fn)(int64_t);

static discard_fn kiwi_discard;
static hint_wait_fn kiwi_hint_wait;
static hint_done_fn kiwi_hint_done;
static CUdeviceptr tail;
static size_t tail_bytes;
static volatile int stopping;
static volatile unsigned long long answered;
static volatile unsigned long long taken;

static void *provider(void *arg) {
    (void)arg;
    while (!stopping) {
        int64_t id = kiwi_hint_wait(100);
        if (id <= 0)
            continue;
        if (tail_bytes && kiwi_discard(tail, tail_bytes) != CUDA_SUCCESS) {
            printf("FAIL hint discard\n");
            fflush(stdout);
            exit(2);
        }
        kiwi_hint_done(id);
        answered++;
    }
    return NULL;
}

/* Takes each question (the swap-out then waits for it) and never answers. */
static void *mute_provider(void *arg) {
    (void)arg;
    while (!stopping)
        if (kiwi_hint_wait(100) > 0)
            taken++;
    return NULL;
}

static void sleep_ms(unsigned ms) {
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static int bad_ranges(CUdeviceptr d, size_t bytes) {
    struct {
        CUdeviceptr p;
        size_t n;
        const char *what;
    } bad[] = {
        {0, 4096, "null"},
        {d, 0, "empty"},
        {d, bytes + 1, "past the end"},
        {d + bytes, 1, "after the allocation"},
        {d + 16, (size_t)-8, "overflow"},
        {(CUdeviceptr)(uintptr_t)&bytes, 8, "host memory"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        CUresult r = kiwi_discard(bad[k].p, bad[k].n);
        if (r != CUDA_ERROR_INVALID_VALUE) {
            printf("FAIL %s range: got %d, want CUDA_ERROR_INVALID_VALUE\n", bad[k].what, (int)r);
            return 3;
        }
    }
    if (kiwi_discard(d + 4096, bytes - 4096) != CUDA_SUCCESS) {
        printf("FAIL a good range was refused\n");
        return 3;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 5 && argc != 7) {
        fprintf(stderr, "usage: discard MODE MIB USED_MIB ROUNDS [SPIN_MS PAUSE_MS]\n");
        return 1;
    }
    const char *mode = argv[1];
    int rounds = atoi(argv[4]);
    unsigned long long spin_ns = (argc == 7 ? strtoull(argv[5], NULL, 10) : 20) * 1000000ULL;
    unsigned pause_ms = argc == 7 ? (unsigned)atoi(argv[6]) : 150;
    kiwi_discard = (discard_fn)dlsym(RTLD_DEFAULT, "kiwiMemDiscard");
    kiwi_hint_wait = (hint_wait_fn)dlsym(RTLD_DEFAULT, "kiwi_hint_wait");
    kiwi_hint_done = (hint_done_fn)dlsym(RTLD_DEFAULT, "kiwi_hint_done");
    if (strcmp(mode, "none") && (!kiwi_discard || !kiwi_hint_wait || !kiwi_hint_done)) {
        printf("FAIL kiwiMemDiscard not found: not running under Kiwi\n");
        return 4;
    }
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fill, add, sum, spin;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate(&ctx, 0, dev));
    CHECK(cuModuleLoadData(&mod, ".version 7.0\n.target sm_52\n.address_size 64\n"
                                 ".visible .entry kiwi_fill() { ret; }\n"));
    CHECK(cuModuleGetFunction(&fill, mod, "kiwi_fill"));
    CHECK(cuModuleGetFunction(&add, mod, "kiwi_add"));
    CHECK(cuModuleGetFunction(&sum, mod, "kiwi_checksum"));
    CHECK(cuModuleGetFunction(&spin, mod, "kiwi_spin"));
    size_t bytes = (size_t)atoi(argv[2]) << 20;
    if (bytes == 0) {
        size_t free_b, total_b;
        CHECK(cuMemGetInfo(&free_b, &total_b));
        bytes = free_b / 4 * 3 / 4 * 4;
    }
    /* Not a whole number of granules: the bytes after the allocation are reserved
     * but belong to no allocation. */
    if (!strcmp(mode, "bad"))
        bytes -= 65536;
    size_t used = (size_t)atoi(argv[3]) << 20;
    if (used > bytes)
        used = bytes;
    CUdeviceptr d, out;
    CHECK(cuMemAlloc(&d, bytes));
    CHECK(cuMemAlloc(&out, 8));
    printf("ALLOCATED %zu\n", bytes);
    fflush(stdout);
    if (!strcmp(mode, "bad"))
        return bad_ranges(d, bytes) ? 3 : (printf("OK\n"), 0);

    unsigned long long words = bytes / 4, used_words = used / 4;
    int voided = !strcmp(mode, "all-then-part") || !strcmp(mode, "discard-launch");
    /* The words each burst adds 1 to. */
    unsigned long long touched = !strcmp(mode, "discard-launch") ? words : used_words;
    tail = d + used;
    tail_bytes = bytes - used;
    unsigned int seven = 7, one = 1;
    void *fill_args[] = {&d, &seven, &words};
    CHECK(cuLaunchKernel(fill, 64, 1, 1, 256, 1, 1, 0, NULL, fill_args, NULL));
    pthread_t thread;
    if (!strcmp(mode, "hint"))
        pthread_create(&thread, NULL, provider, NULL);
    if (!strcmp(mode, "mute"))
        pthread_create(&thread, NULL, mute_provider, NULL);
    unsigned long long bursts = 0;
    char line[64];
    for (int r = 0; r <= rounds; r++) {
        if (!strcmp(mode, "discard-launch") && tail_bytes)
            CHECK(kiwi_discard(tail, tail_bytes));
        if (!strcmp(mode, "all-then-part"))
            CHECK(kiwi_discard(d, bytes));
        void *add_args[] = {&d, &one, &touched};
        void *spin_args[] = {&spin_ns};
        CHECK(cuLaunchKernel(add, 64, 1, 1, 256, 1, 1, 0, NULL, add_args, NULL));
        CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, NULL, spin_args, NULL));
        CHECK(cuCtxSynchronize());
        bursts++;
        if (!strcmp(mode, "eager") && tail_bytes)
            CHECK(kiwi_discard(tail, tail_bytes));
        if (r == 0) {
            printf("RUNNING\n");
            fflush(stdout);
            if (!fgets(line, sizeof line, stdin))
                return 1;
        } else {
            sleep_ms(pause_ms);
        }
    }
    stopping = 1;
    if (!strcmp(mode, "hint") || !strcmp(mode, "mute"))
        pthread_join(thread, NULL);
    int all_live = !strcmp(mode, "none") || !strcmp(mode, "mute");
    unsigned long long checked = voided || all_live ? words : used_words;
    void *sum_args[] = {&d, &checked, &out};
    CHECK(cuLaunchKernel(sum, 64, 1, 1, 256, 1, 1, 0, NULL, sum_args, NULL));
    unsigned long long got = 0;
    CHECK(cuMemcpyDtoH(&got, out, 8));
    unsigned long long hit = touched < checked ? touched : checked;
    unsigned long long want = hit * (7ULL + bursts) + (checked - hit) * 7ULL;
    if (got != want) {
        printf("MISMATCH checksum %llu want %llu after %llu bursts\n", got, want, bursts);
        return 3;
    }
    CHECK(cuMemFree(d));
    printf("OK bursts %llu answered %llu taken %llu\n", bursts, answered, taken);
    fflush(stdout);
    return 0;
}
