/* PyTorch's expandable segments on the driver API (NVIDIA's cuda.h): one reserved
 * range grown by mapping its own physical handles of SEG_MIB MiB each (cuMemCreate,
 * cuMemMap, cuMemSetAccess), MIB MiB in all. Then BURSTS times: each handle's slice
 * set to its own value (burst and slice), 50 ms pause, everything read back and
 * checked. Then it shrinks as PyTorch's empty_cache does (the upper half unmapped,
 * then released), checks the rest, grows again and checks everything, and frees the
 * lower half as NCCL does (released while mapped, then unmapped). Usage:
 *   expandable MIB SEG_MIB BURSTS
 * With FILL_AS_MAPPED set, each handle is written as soon as it is mapped (as
 * torch.full does while the segment grows); with IDLE_MS_AFTER_MAPPED, it idles
 * that long once mapped. With EXPORT set, the first handle asks for an exportable (POSIX fd) handle type
 * and is exported after the first burst: it stays resident from then on.
 * Prints "MAPPED" once all its memory is mapped, a line per burst, then "OK". Exits
 * 2 on a failed call (its name printed), 3 on a wrong byte. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "check.h"

static unsigned char value(int burst, size_t slice) {
    return (unsigned char)(burst * 13 + (int)slice * 7 + 1);
}

/* Sets slices [from, to) to their values of `burst`. */
static void fill(CUdeviceptr base, size_t seg, size_t from, size_t to, int burst) {
    for (size_t i = from; i < to; i++)
        CHECK(cuMemsetD8(base + i * seg, value(burst, i), seg));
    CHECK(cuCtxSynchronize());
}

/* Checks slices [from, to) hold their values of `burst`; 0 or 3. */
static int verify(CUdeviceptr base, size_t seg, size_t from, size_t to, int burst,
                  unsigned char *h) {
    for (size_t i = from; i < to; i++) {
        CHECK(cuMemcpyDtoH(h, base + i * seg, seg));
        unsigned char v = value(burst, i);
        for (size_t k = 0; k < seg; k++)
            if (h[k] != v) {
                printf("burst %d: slice %zu byte %zu is %u, want %u\n", burst, i, k, h[k], v);
                return 3;
            }
    }
    return 0;
}

static void map_one(CUdeviceptr at, size_t seg, CUmemGenericAllocationHandle *h,
                    const CUmemAllocationProp *prop) {
    CHECK(cuMemCreate(h, seg, prop, 0));
    CHECK(cuMemMap(at, seg, 0, *h, 0));
    CUmemAccessDesc access = {0};
    access.location = prop->location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK(cuMemSetAccess(at, seg, &access, 1));
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: expandable MIB SEG_MIB BURSTS\n");
        return 1;
    }
    size_t seg = (size_t)atoi(argv[2]) << 20;
    size_t n = ((size_t)atoi(argv[1]) << 20) / seg;
    int bursts = atoi(argv[3]);
    if (n < 2 || bursts < 1)
        return 1;
    CUdevice dev;
    CUcontext ctx;
    CUmemAllocationProp prop = context_and_device_memory(&dev, &ctx);
    CUmemAllocationProp shareable = prop;
    shareable.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    int export = getenv("EXPORT") != NULL;
    CUmemGenericAllocationHandle *hs = calloc(n, sizeof *hs);
    unsigned char *h = malloc(seg);
    if (!hs || !h)
        return 1;
    CUdeviceptr base;
    CHECK(cuMemAddressReserve(&base, n * seg, 0, 0, 0));
    int touch = getenv("FILL_AS_MAPPED") != NULL;
    for (size_t i = 0; i < n; i++) {
        map_one(base + i * seg, seg, &hs[i], i == 0 && export ? &shareable : &prop);
        if (touch) /* as torch.full does: each piece is written as it grows */
            CHECK(cuMemsetD8(base + i * seg, 0, seg));
    }
    puts("MAPPED");
    fflush(stdout);
    if (getenv("IDLE_MS_AFTER_MAPPED")) /* an idle notebook's memory */
        usleep((useconds_t)atoi(getenv("IDLE_MS_AFTER_MAPPED")) * 1000);
    int bad;
    for (int b = 0; b < bursts; b++) {
        fill(base, seg, 0, n, b);
        if (b == 0 && export) {
            int fd = -1;
            CHECK(cuMemExportToShareableHandle(&fd, hs[0], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
            printf("EXPORTED %d\n", fd >= 0);
        }
        usleep(50000);
        if ((bad = verify(base, seg, 0, n, b, h)))
            return bad;
        printf("burst %d\n", b);
        fflush(stdout);
    }
    int last = bursts - 1;
    /* empty_cache: the upper half unmapped, then released. */
    size_t half = n / 2;
    for (size_t i = half; i < n; i++) {
        CHECK(cuMemUnmap(base + i * seg, seg));
        CHECK(cuMemRelease(hs[i]));
    }
    if ((bad = verify(base, seg, 0, half, last, h)))
        return bad;
    /* Grown again: new handles at the same addresses. */
    for (size_t i = half; i < n; i++)
        map_one(base + i * seg, seg, &hs[i], &prop);
    fill(base, seg, half, n, bursts);
    usleep(50000);
    if ((bad = verify(base, seg, 0, half, last, h)) || (bad = verify(base, seg, half, n, bursts, h)))
        return bad;
    /* NCCL's free: released while mapped, then unmapped. */
    for (size_t i = 0; i < half; i++) {
        CHECK(cuMemRelease(hs[i]));
        CHECK(cuMemUnmap(base + i * seg, seg));
    }
    for (size_t i = half; i < n; i++) {
        CHECK(cuMemUnmap(base + i * seg, seg));
        CHECK(cuMemRelease(hs[i]));
    }
    CHECK(cuMemAddressFree(base, n * seg));
    free(h);
    free(hs);
    puts("OK");
    return 0;
}
