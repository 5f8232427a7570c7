/* One copy over the simulated PCIe link, started on cue, so a test can run
 * several processes' copies at once and compare their times with one alone.
 *
 * usage: link_copies h2d|d2h MIB
 * Sets up (context, device and host buffers), prints READY, waits for a line on
 * stdin, makes one synchronous copy of MIB in the given direction and prints its
 * start and end (CLOCK_MONOTONIC, ms, comparable across processes).
 * Compiled against NVIDIA's cuda.h, linked with -lcuda. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "driver_check.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr d;
    if (argc != 3 || (strcmp(argv[1], "h2d") != 0 && strcmp(argv[1], "d2h") != 0)) {
        fprintf(stderr, "usage: link_copies h2d|d2h MIB\n");
        return 2;
    }
    const int h2d = strcmp(argv[1], "h2d") == 0;
    const size_t bytes = (size_t)atol(argv[2]) << 20;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuMemAlloc(&d, bytes));
    char *h = malloc(bytes);
    ASSERT(h != NULL);
    memset(h, 0x5a, bytes); /* touched: the copy does not pay first page faults */
    CHECK(cuMemsetD8(d, 0x5a, bytes));
    CHECK(cuCtxSynchronize());
    printf("READY\n");
    fflush(stdout);
    char line[16];
    if (fgets(line, sizeof line, stdin) == NULL) {
        return 1;
    }
    double t0 = now_ms();
    if (h2d) {
        CHECK(cuMemcpyHtoD(d, h, bytes));
    } else {
        CHECK(cuMemcpyDtoH(h, d, bytes));
    }
    double t1 = now_ms();
    printf("%.3f %.3f\n", t0, t1);
    CHECK(cuMemFree(d));
    free(h);
    return 0;
}
