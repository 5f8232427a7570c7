/* Shareable VMM memory across processes, as strict as the real driver:
 * cuMemCreate asking for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, exported with
 * cuMemExportToShareableHandle, sent over a Unix socket (SCM_RIGHTS) to a second
 * process (this program again, exec'd), imported there with
 * cuMemImportFromShareableHandle, mapped and written; the exporter sees the writes.
 * What the driver refuses is refused: exporting a handle created without that type,
 * other handle types, flags, importing a descriptor that is not exported memory.
 * Compiled against NVIDIA's cuda.h, linked with -lcuda. Prints "OK" and exits 0, or
 * names the failing check and exits 1. */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "driver_check.h"

#define WORDS(bytes) ((bytes) / sizeof(uint32_t))

static CUmemAllocationProp props(int types) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    p.requestedHandleTypes = (CUmemAllocationHandleType)types;
    return p;
}

static CUdeviceptr map_rw(CUmemGenericAllocationHandle h, size_t size) {
    CUdeviceptr va;
    CHECK(cuMemAddressReserve(&va, size, 0, 0, 0));
    CHECK(cuMemMap(va, size, 0, h, 0));
    CUmemAccessDesc acc;
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = 0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK(cuMemSetAccess(va, size, &acc, 1));
    return va;
}

static void check_words(CUdeviceptr va, size_t size, uint32_t seed) {
    uint32_t *h = malloc(size);
    CHECK(cuMemcpyDtoH(h, va, size));
    for (size_t i = 0; i < WORDS(size); i++) ASSERT(h[i] == ((uint32_t)(i * 2654435761u) ^ seed));
    free(h);
}

static void fill_words(CUdeviceptr va, size_t size, uint32_t seed) {
    uint32_t *h = malloc(size);
    for (size_t i = 0; i < WORDS(size); i++) h[i] = (uint32_t)(i * 2654435761u) ^ seed;
    CHECK(cuMemcpyHtoD(va, h, size));
    free(h);
}

static int send_fd(int sock, int fd, size_t size) {
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&size, sizeof size};
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = cbuf;
    m.msg_controllen = sizeof cbuf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    return sendmsg(sock, &m, 0) == (ssize_t)sizeof size ? 0 : -1;
}

static int recv_fd(int sock, size_t *size) {
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {size, sizeof *size};
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = cbuf;
    m.msg_controllen = sizeof cbuf;
    if (recvmsg(sock, &m, 0) != (ssize_t)sizeof *size) return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (!c || c->cmsg_type != SCM_RIGHTS) return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

static CUcontext setup(void) {
    CUdevice d;
    CUcontext c;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&d, 0));
    CHECK(cuDevicePrimaryCtxRetain(&c, d));
    CHECK(cuCtxSetCurrent(c));
    return c;
}

static const char ptx[] = ".version 7.0\n.target sm_52\n.address_size 64\n"
                          ".visible .entry kiwi_fill() { ret; }\n";

/* Exported while a stream's kernels keep adding to it: every addition lands (the
 * export changes nothing of the memory), and later ones reach an importer's view
 * of the same bytes (here, a second mapping of the same export). */
static void exported_while_kernels_run(CUmemAllocationProp posix, size_t gran) {
    enum { ADDS = 200 };
    size_t size = 4 * gran;
    CUmodule mod;
    CUfunction fill, add;
    CHECK(cuModuleLoadData(&mod, ptx));
    CHECK(cuModuleGetFunction(&fill, mod, "kiwi_fill"));
    CHECK(cuModuleGetFunction(&add, mod, "kiwi_add"));
    CUmemGenericAllocationHandle h;
    CHECK(cuMemCreate(&h, size, &posix, 0));
    CUdeviceptr va = map_rw(h, size);
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    unsigned int zero = 0, one = 1;
    unsigned long long words = WORDS(size);
    void *fill_args[] = {&va, &zero, &words};
    void *add_args[] = {&va, &one, &words};
    CHECK(cuLaunchKernel(fill, 64, 1, 1, 256, 1, 1, 0, s, fill_args, NULL));
    for (int i = 0; i < ADDS; i++) CHECK(cuLaunchKernel(add, 64, 1, 1, 256, 1, 1, 0, s, add_args, NULL));
    int fd = -1;
    CHECK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    ASSERT(cuStreamQuery(s) == CUDA_ERROR_NOT_READY); /* it did run alongside */
    CUmemGenericAllocationHandle imported;
    CHECK(cuMemImportFromShareableHandle(&imported, (void *)(uintptr_t)fd,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    CUdeviceptr view = map_rw(imported, size);
    CHECK(cuMemRelease(imported));
    CHECK(cuStreamSynchronize(s));
    uint32_t *w = malloc(size);
    CHECK(cuMemcpyDtoH(w, view, size));
    for (size_t i = 0; i < WORDS(size); i++) ASSERT(w[i] == ADDS);
    free(w);
    CHECK(cuMemUnmap(view, size));
    CHECK(cuMemAddressFree(view, size));
    CHECK(cuMemUnmap(va, size));
    CHECK(cuMemAddressFree(va, size));
    CHECK(cuMemRelease(h));
    CHECK(cuStreamDestroy(s));
    CHECK(cuModuleUnload(mod));
}

/* The second process: imports, checks the exporter's bytes, writes its own. */
static int importer(int sock) {
    setup();
    size_t size = 0;
    int fd = recv_fd(sock, &size);
    ASSERT(fd >= 0);
    CUmemGenericAllocationHandle h;
    EXPECT(cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                          CU_MEM_HANDLE_TYPE_WIN32),
           CUDA_ERROR_NOT_SUPPORTED);
    CHECK(cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd); /* the handle keeps the memory */
    CUdeviceptr va = map_rw(h, size);
    CHECK(cuMemRelease(h)); /* the mapping keeps it */
    check_words(va, size, 0x1111);
    fill_words(va, size, 0x2222);
    CHECK(cuCtxSynchronize());
    char done = 'd';
    ASSERT(write(sock, &done, 1) == 1);
    CHECK(cuMemUnmap(va, size));
    CHECK(cuMemAddressFree(va, size));
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "import") == 0) return importer(atoi(argv[2]));
    setup();
    int attr = 0;
    CHECK(cuDeviceGetAttribute(&attr, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0));
    ASSERT(attr == 1);
    size_t gran = 0;
    CUmemAllocationProp plain = props(0), posix = props(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                        win32 = props(CU_MEM_HANDLE_TYPE_WIN32);
    CHECK(cuMemGetAllocationGranularity(&gran, &plain, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    size_t size = 2 * gran;
    int fd = -1;

    /* A handle created without the POSIX type cannot be exported as one. */
    CUmemGenericAllocationHandle h0, h;
    CHECK(cuMemCreate(&h0, gran, &plain, 0));
    EXPECT(cuMemExportToShareableHandle(&fd, h0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
           CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemRelease(h0));
    /* Win32 handles do not exist on Linux. */
    EXPECT(cuMemCreate(&h0, gran, &win32, 0), CUDA_ERROR_NOT_SUPPORTED);

    CHECK(cuMemCreate(&h, size, &posix, 0));
    EXPECT(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_WIN32, 0),
           CUDA_ERROR_NOT_SUPPORTED);
    EXPECT(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1),
           CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemExportToShareableHandle(NULL, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
           CUDA_ERROR_INVALID_VALUE);
    /* Written before its first export: the bytes are there for the importer. */
    CUdeviceptr va = map_rw(h, size);
    fill_words(va, size, 0x1111);
    CHECK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    ASSERT(fd >= 0);
    check_words(va, size, 0x1111);
    exported_while_kernels_run(posix, gran);

    /* A descriptor that is not exported device memory is refused. */
    CUmemGenericAllocationHandle bad;
    int devnull = open("/dev/null", O_RDONLY);
    EXPECT(cuMemImportFromShareableHandle(&bad, (void *)(uintptr_t)devnull,
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemImportFromShareableHandle(&bad, (void *)(uintptr_t)-1,
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           CUDA_ERROR_INVALID_VALUE);

    int sv[2];
    ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        char arg[16];
        close(sv[0]);
        snprintf(arg, sizeof arg, "%d", sv[1]);
        execl("/proc/self/exe", argv[0], "import", arg, (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    ASSERT(send_fd(sv[0], fd, size) == 0);
    close(fd);
    char done = 0;
    ASSERT(read(sv[0], &done, 1) == 1 && done == 'd');
    int st = 0;
    ASSERT(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    /* The importer's writes are in the exporter's memory. */
    check_words(va, size, 0x2222);
    CHECK(cuMemUnmap(va, size));
    CHECK(cuMemAddressFree(va, size));
    CHECK(cuMemRelease(h));
    printf("OK\n");
    return 0;
}
