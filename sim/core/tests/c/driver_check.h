/* CHECK, EXPECT and ASSERT for the driver-API test programs in this folder: each
 * failure names the file, line and call, and exits 1. */
#ifndef KIWI_DRIVER_CHECK_H
#define KIWI_DRIVER_CHECK_H
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                            \
    do {                                                                       \
        CUresult r_ = (call);                                                  \
        if (r_ != CUDA_SUCCESS) {                                              \
            fprintf(stderr, "FAIL %s:%d %s -> %d\n", __FILE__, __LINE__, #call, \
                    (int)r_);                                                  \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

#define EXPECT(call, want)                                                     \
    do {                                                                       \
        CUresult r_ = (call);                                                  \
        if (r_ != (want)) {                                                    \
            fprintf(stderr, "FAIL %s:%d %s -> %d, want %s (%d)\n", __FILE__,  \
                    __LINE__, #call, (int)r_, #want, (int)(want));             \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

#define ASSERT(cond)                                                           \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "FAIL %s:%d %s\n", __FILE__, __LINE__, #cond);    \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

#endif
