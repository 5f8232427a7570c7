/* Times the driver calls whose cost the simulator models as wall time
 * (KIWI_SIM_MEMCREATE_US, KIWI_SIM_MEMCREATE_US_PER_2MIB, KIWI_SIM_PIN_GBPS and
 * the VMM calls' measured costs); the test compares them with the knobs.
 *
 * usage: time_costs memcreate MIB   prints the ms cuMemCreate of MIB took
 *        time_costs vmm N           prints the ms N cuMemMap, N cuMemSetAccess,
 *                                   N cuMemUnmap and N cuMemRelease of 2 MiB took
 *        time_costs pin MIB         prints the ms cuMemHostAlloc, cuMemAllocHost
 *                                   and cuMemHostRegister of MIB touched before
 *                                   took, the share of never-touched memory
 *                                   resident once registered, and the ms its
 *                                   cuMemHostRegister took
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

/* Pinned device memory on `dev`, no shareable handle types. */
static CUmemAllocationProp device_prop(CUdevice dev) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    return prop;
}

int main(int argc, char **argv) {
    CUdevice dev;
    CUcontext ctx;
    if (argc != 3) {
        fprintf(stderr, "usage: time_costs memcreate|pin MIB | vmm N\n");
        return 2;
    }
    const size_t bytes = (size_t)atol(argv[2]) << 20;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));

    if (strcmp(argv[1], "memcreate") == 0) {
        CUmemAllocationProp prop = device_prop(dev);
        CUmemGenericAllocationHandle h;
        double t = now_ms();
        CHECK(cuMemCreate(&h, bytes, &prop, 0));
        printf("%.3f\n", now_ms() - t);
        CHECK(cuMemRelease(h));
    } else if (strcmp(argv[1], "vmm") == 0) {
        const size_t n = (size_t)atol(argv[2]), page = 2 << 20;
        CUmemAllocationProp prop = device_prop(dev);
        CUmemAccessDesc acc;
        memset(&acc, 0, sizeof acc);
        acc.location = prop.location;
        acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        CUmemGenericAllocationHandle *h = calloc(n, sizeof *h);
        CUdeviceptr va;
        CHECK(cuMemAddressReserve(&va, n * page, 0, 0, 0));
        for (size_t i = 0; i < n; i++)
            CHECK(cuMemCreate(&h[i], page, &prop, 0));
        double t = now_ms();
        for (size_t i = 0; i < n; i++)
            CHECK(cuMemMap(va + i * page, page, 0, h[i], 0));
        double t_map = now_ms() - t;
        t = now_ms();
        for (size_t i = 0; i < n; i++)
            CHECK(cuMemSetAccess(va + i * page, page, &acc, 1));
        double t_access = now_ms() - t;
        t = now_ms();
        for (size_t i = 0; i < n; i++)
            CHECK(cuMemUnmap(va + i * page, page));
        double t_unmap = now_ms() - t;
        t = now_ms();
        for (size_t i = 0; i < n; i++)
            CHECK(cuMemRelease(h[i]));
        double t_release = now_ms() - t;
        printf("%.3f %.3f %.3f %.3f\n", t_map, t_access, t_unmap, t_release);
        CHECK(cuMemAddressFree(va, n * page));
        free(h);
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
        /* Registering memory never touched page-locks it: every page is then
         * resident (the driver populates it), as mincore says. */
        void *d = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (d == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        t = now_ms();
        CHECK(cuMemHostRegister(d, bytes, 0));
        double t_register_fresh = now_ms() - t;
        const size_t pages = bytes / 4096;
        unsigned char *in = malloc(pages);
        if (mincore(d, bytes, in) != 0) {
            perror("mincore");
            return 1;
        }
        size_t resident = 0;
        for (size_t i = 0; i < pages; i++)
            resident += in[i] & 1;
        printf("%.3f %.3f %.3f %.3f %.3f\n", t_hostalloc, t_allochost, t_register,
               (double)resident / (double)pages, t_register_fresh);
        free(in);
        CHECK(cuMemHostUnregister(d));
        munmap(d, bytes);
        CHECK(cuMemHostUnregister(c));
        CHECK(cuMemFreeHost(a));
        CHECK(cuMemFreeHost(b));
    } else {
        fprintf(stderr, "usage: time_costs memcreate|pin MIB\n");
        return 2;
    }
    return 0;
}
