/* Shared by the real-runtime test programs: compiled against NVIDIA's
 * cuda_runtime_api.h and linked with NVIDIA's libcudart.so.12 (both fetched by
 * scripts/fetch-cuda-runtime.sh), never against anything of ours. */
#ifndef KIWI_CUDART_COMMON_H
#define KIWI_CUDART_COMMON_H

#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(call)                                                            \
    do {                                                                       \
        cudaError_t r_ = (call);                                               \
        if (r_ != cudaSuccess) {                                               \
            fprintf(stderr, "FAIL %s:%d %s -> %d %s\n", __FILE__, __LINE__,   \
                    #call, (int)r_, cudaGetErrorName(r_));                     \
            exit(2);                                                           \
        }                                                                      \
    } while (0)

#define EXPECT(call, want)                                                     \
    do {                                                                       \
        cudaError_t r_ = (call);                                               \
        if (r_ != (want)) {                                                    \
            fprintf(stderr, "FAIL %s:%d %s -> %d %s, want %s (%d)\n",         \
                    __FILE__, __LINE__, #call, (int)r_, cudaGetErrorName(r_),  \
                    #want, (int)(want));                                       \
            exit(2);                                                           \
        }                                                                      \
    } while (0)

#define ASSERT(cond)                                                           \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "FAIL %s:%d %s\n", __FILE__, __LINE__, #cond);    \
            exit(3);                                                           \
        }                                                                      \
    } while (0)

/* The byte at offset i of a buffer filled with seed s. */
static inline unsigned char pattern_byte(size_t i, unsigned s) {
    uint64_t x = (uint64_t)i * 0x9E3779B97F4A7C15ull + s;
    return (unsigned char)(x >> 56);
}

static inline void fill_pattern(unsigned char *p, size_t n, unsigned s) {
    for (size_t i = 0; i < n; i++)
        p[i] = pattern_byte(i, s);
}

/* Index of the first byte that differs from the pattern, or n. */
static inline size_t check_pattern(const unsigned char *p, size_t n, unsigned s) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != pattern_byte(i, s))
            return i;
    return n;
}

/* Index of the first byte that is not v, or n. */
static inline size_t check_value(const unsigned char *p, size_t n, unsigned char v) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            return i;
    return n;
}

/* Sleeps ms milliseconds (a notebook's CPU phase). */
static inline void sleep_ms(int ms) {
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

#endif
