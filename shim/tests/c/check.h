/* CHECK for the driver-API test programs in this folder: a failed call prints
 * "FAIL file:line call -> code NAME" on stdout (where the tests look) and exits 2. */
#ifndef KIWI_SHIM_TEST_CHECK_H
#define KIWI_SHIM_TEST_CHECK_H
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                            \
    do {                                                                       \
        CUresult r_ = (call);                                                  \
        if (r_ != CUDA_SUCCESS) {                                              \
            const char *n_ = "?";                                              \
            cuGetErrorName(r_, &n_);                                           \
            printf("FAIL %s:%d %s -> %d %s\n", __FILE__, __LINE__, #call,      \
                   (int)r_, n_);                                               \
            fflush(stdout);                                                    \
            exit(2);                                                           \
        }                                                                      \
    } while (0)

#endif
