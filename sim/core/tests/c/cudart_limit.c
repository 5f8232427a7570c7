/* A runtime program that raises its stack size (cudaDeviceSetLimit), as a
 * recursive or register-spilling kernel needs: the driver reserves the stack for
 * every resident thread at once (cuCtxSetLimit). Usage:
 *   cudart_limit STACK_BYTES
 * Prints "pid <pid>", then "LIMIT <value>" once the limit is set and reads back,
 * then "OK" after a memset and copy of 1 MiB verify. Exits 2 on a failed call. */
#include "cudart_common.h"

#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: cudart_limit STACK_BYTES\n");
        return 1;
    }
    printf("pid %d\n", (int)getpid());
    fflush(stdout);
    size_t stack = strtoull(argv[1], NULL, 10);
    CHECK(cudaFree(0));
    CHECK(cudaDeviceSetLimit(cudaLimitStackSize, stack));
    size_t got = 0;
    CHECK(cudaDeviceGetLimit(&got, cudaLimitStackSize));
    printf("LIMIT %zu\n", got);
    fflush(stdout);
    unsigned char *d, h[1 << 20];
    CHECK(cudaMalloc((void **)&d, sizeof h));
    CHECK(cudaMemset(d, 5, sizeof h));
    CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
    ASSERT(check_value(h, sizeof h, 5) == sizeof h);
    printf("OK\n");
    return 0;
}
