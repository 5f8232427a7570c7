/* An application that raises its context's stack size (cuCtxSetLimit), as a
 * recursive or register-spilling kernel needs; the driver reserves the stack for
 * every resident thread at once. Usage:
 *   set_limit STACK_BYTES
 * Prints "LIMIT <value>" once the limit is set and reads back, then "OK" after a
 * memset on the context verifies. Exits 2 on a failed call (its name and error
 * printed). */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: set_limit STACK_BYTES\n");
        return 1;
    }
    size_t stack = (size_t)atol(argv[1]);
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate(&ctx, 0, dev));
    CHECK(cuCtxSetLimit(CU_LIMIT_STACK_SIZE, stack));
    size_t got = 0;
    CHECK(cuCtxGetLimit(&got, CU_LIMIT_STACK_SIZE));
    printf("LIMIT %zu\n", got);
    fflush(stdout);
    CUdeviceptr d;
    CHECK(cuMemAlloc(&d, 1 << 20));
    CHECK(cuMemsetD8(d, 0x5a, 1 << 20));
    unsigned char h[64];
    CHECK(cuMemcpyDtoH(h, d, sizeof h));
    for (size_t i = 0; i < sizeof h; i++)
        if (h[i] != 0x5a)
            return 3;
    puts("OK");
    return 0;
}
