/* Times the driver calls whose cost the simulator models as wall time
 * (KIWI_SIM_MEMCREATE_US_PER_2MIB, KIWI_SIM_PIN_GBPS); the test compares them
 * with the knobs.
 *
 * usage: time_costs memcreate MIB   prints the ms cuMemCreate of MIB took
 *        time_costs pin MIB         prints the ms cuMemHostAlloc, cuMemAllocHost
 *                                   and cuMemHostRegister of MIB took
 * Compiled against NVIDIA's cuda.h, linked with -lcuda. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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
    if (argc != 3) {
        fprintf(stderr, "usage: time_costs memcreate|pin MIB\n");
        return 2;
    }
    const size_t bytes = (size_t)atol(argv[2]) << 20;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));

    if (strcmp(argv[1], "memcreate") == 0) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = dev;
        CUmemGenericAllocationHandle h;
        double t = now_ms();
        CHECK(cuMemCreate(&h, bytes, &prop, 0));
        printf("%.3f\n", now_ms() - t);
        CHECK(cuMemRelease(h));
    } else if (strcmp(argv[1], "pin") == 0) {
        void *a, *b;
        double t = now_ms();
        CHECK(cuMemHostAlloc(&a, bytes, 0));
        double t_hostalloc = now_ms() - t;
        t = now_ms();
        CHECK(cuMemAllocHost(&b, bytes));
        double t_allochost = now_ms() - t;
        /* Registration pins memory the program already has (touched, so the
         * time measured is the pinning, not the first page faults). */
        void *c = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (c == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        t = now_ms();
        CHECK(cuMemHostRegister(c, bytes, 0));
        double t_register = now_ms() - t;
        printf("%.3f %.3f %.3f\n", t_hostalloc, t_allochost, t_register);
        CHECK(cuMemHostUnregister(c));
        CHECK(cuMemFreeHost(a));
        CHECK(cuMemFreeHost(b));
    } else {
        fprintf(stderr, "usage: time_costs memcreate|pin MIB\n");
        return 2;
    }
    return 0;
}
