/* Where simulated device memory lives (tests/device_memory.rs): in each GPU's
 * memory file, not in the process's own memory.
 *
 *   device_memory fill MIB    allocate MIB of device memory (cuMemAlloc), fill it
 *                             with cuMemsetD32, check samples; print the growth of
 *                             RssAnon and RssShmem (/proc/self/status, KiB) and OK
 *   device_memory hold MIB    allocate MIB (half cuMemAlloc, half VMM), fill it,
 *                             print READY and sleep until killed
 *   device_memory share MIB   write MIB of shareable VMM memory, export it, run
 *                             this program again as "import FD MIB" (the fd
 *                             inherited), which checks every word and writes its
 *                             own; check those; print OK
 *
 * With KIWI_TEST_CGROUP set, the process first moves itself into that cgroup
 * (writes its pid to $KIWI_TEST_CGROUP/cgroup.procs). Compiled against NVIDIA's
 * cuda.h, linked with -lcuda; a failure names its check and exits 1. */
#include <cuda.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "driver_check.h"

#define MIB (1024UL * 1024UL)

/* A field of /proc/self/status in KiB. */
static long status_kb(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    ASSERT(f != NULL);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0 && line[n] == ':') v = atol(line + n + 1);
    fclose(f);
    ASSERT(v >= 0);
    return v;
}

static void join_cgroup(void) {
    const char *cg = getenv("KIWI_TEST_CGROUP");
    char path[512];
    FILE *f;
    if (!cg) return;
    snprintf(path, sizeof path, "%s/cgroup.procs", cg);
    f = fopen(path, "w");
    ASSERT(f != NULL);
    fprintf(f, "%d\n", (int)getpid());
    ASSERT(fclose(f) == 0);
}

static CUcontext init(void) {
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    return ctx;
}

/* Fills [p, p+bytes) with `value` words and checks a word in every MiB. */
static void fill_and_check(CUdeviceptr p, size_t bytes, uint32_t value) {
    uint32_t got;
    CHECK(cuMemsetD32(p, value, bytes / 4));
    for (size_t at = 0; at < bytes; at += MIB) {
        CHECK(cuMemcpyDtoH(&got, p + at + (at / MIB % 7) * 4, 4));
        ASSERT(got == value);
    }
}

static int fill(size_t mib) {
    long anon0, shmem0;
    CUdeviceptr p;
    init();
    anon0 = status_kb("RssAnon");
    shmem0 = status_kb("RssShmem");
    CHECK(cuMemAlloc(&p, mib * MIB));
    fill_and_check(p, mib * MIB, 0x5eed0001u);
    printf("anon_kb=%ld shmem_kb=%ld\n", status_kb("RssAnon") - anon0,
           status_kb("RssShmem") - shmem0);
    CHECK(cuMemFree(p));
    printf("OK\n");
    return 0;
}

static CUmemAllocationProp props(int shareable) {
    CUmemAllocationProp pr;
    memset(&pr, 0, sizeof pr);
    pr.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    pr.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    pr.location.id = 0;
    if (shareable) pr.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return pr;
}

static CUdeviceptr map_rw(CUmemGenericAllocationHandle h, size_t size) {
    CUdeviceptr va;
    CUmemAccessDesc acc;
    CHECK(cuMemAddressReserve(&va, size, 0, 0, 0));
    CHECK(cuMemMap(va, size, 0, h, 0));
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = 0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK(cuMemSetAccess(va, size, &acc, 1));
    return va;
}

static int hold(size_t mib) {
    CUdeviceptr p;
    CUmemGenericAllocationHandle h;
    CUmemAllocationProp pr = props(0);
    size_t vmm = (mib / 2) & ~(size_t)1; /* a multiple of 2 MiB */
    init();
    CHECK(cuMemAlloc(&p, (mib - vmm) * MIB));
    fill_and_check(p, (mib - vmm) * MIB, 0xdead0001u);
    if (vmm > 0) {
        CHECK(cuMemCreate(&h, vmm * MIB, &pr, 0));
        fill_and_check(map_rw(h, vmm * MIB), vmm * MIB, 0xdead0002u);
    }
    printf("READY\n");
    fflush(stdout);
    for (;;) pause();
}

static void pattern(uint32_t *w, size_t words, uint32_t seed) {
    for (size_t i = 0; i < words; i++) w[i] = (uint32_t)(i * 2654435761u) ^ seed;
}

static void check_pattern(CUdeviceptr va, size_t bytes, uint32_t seed) {
    uint32_t *h = malloc(bytes);
    ASSERT(h != NULL);
    CHECK(cuMemcpyDtoH(h, va, bytes));
    for (size_t i = 0; i < bytes / 4; i++) ASSERT(h[i] == ((uint32_t)(i * 2654435761u) ^ seed));
    free(h);
}

static void write_pattern(CUdeviceptr va, size_t bytes, uint32_t seed) {
    uint32_t *h = malloc(bytes);
    ASSERT(h != NULL);
    pattern(h, bytes / 4, seed);
    CHECK(cuMemcpyHtoD(va, h, bytes));
    free(h);
}

static int import(int fd, size_t mib) {
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    init();
    CHECK(cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    va = map_rw(h, mib * MIB);
    check_pattern(va, mib * MIB, 0xa11ce);
    write_pattern(va, mib * MIB, 0xb0b);
    CHECK(cuMemUnmap(va, mib * MIB));
    CHECK(cuMemRelease(h));
    return 0;
}

static int share(size_t mib) {
    CUmemGenericAllocationHandle h;
    CUmemAllocationProp pr = props(1);
    CUdeviceptr va;
    int fd, status;
    char fds[16], mibs[16];
    pid_t child;
    init();
    CHECK(cuMemCreate(&h, mib * MIB, &pr, 0));
    va = map_rw(h, mib * MIB);
    /* Written while the bytes are in the GPU's file; the export moves them. */
    write_pattern(va, mib * MIB, 0xa11ce);
    CHECK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    ASSERT(fcntl(fd, F_SETFD, 0) == 0); /* the importer inherits it */
    snprintf(fds, sizeof fds, "%d", fd);
    snprintf(mibs, sizeof mibs, "%zu", mib);
    fflush(stdout);
    child = fork();
    ASSERT(child >= 0);
    if (child == 0) {
        execl("/proc/self/exe", "device_memory", "import", fds, mibs, (char *)NULL);
        _exit(127);
    }
    ASSERT(waitpid(child, &status, 0) == child);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    check_pattern(va, mib * MIB, 0xb0b);
    close(fd);
    CHECK(cuMemUnmap(va, mib * MIB));
    CHECK(cuMemRelease(h));
    printf("OK\n");
    return 0;
}

int main(int argc, char **argv) {
    join_cgroup();
    if (argc == 3 && strcmp(argv[1], "fill") == 0) return fill((size_t)atol(argv[2]));
    if (argc == 3 && strcmp(argv[1], "hold") == 0) return hold((size_t)atol(argv[2]));
    if (argc == 3 && strcmp(argv[1], "share") == 0) return share((size_t)atol(argv[2]));
    if (argc == 4 && strcmp(argv[1], "import") == 0)
        return import(atoi(argv[2]), (size_t)atol(argv[3]));
    fprintf(stderr, "usage: device_memory fill|hold|share MIB\n");
    return 1;
}
