/* CUDA IPC of cuMemAlloc memory between two processes (driver API, NVIDIA's cuda.h).
 *
 *   ipc export S_MIB P_MIB
 *     Allocates S MiB (to share) and P MiB (private) on GPU 0 and fills both with a
 *     pattern; cuIpcGetMemHandle(S); starts `ipc import` (itself, exec'd) and sends
 *     it the handle over a pipe. Once the importer opened S and checked the pattern,
 *     prints "READY" and waits for a line on stdin (the test sends it once this
 *     process was swapped out for another). Then the importer writes its own
 *     pattern over S, and this process checks S (the importer's bytes) and P (its
 *     own), tells the importer to close, prints "CLOSED", waits for another line
 *     (the test swaps it out again meanwhile), checks both again and prints "OK".
 *   ipc import RFD WFD
 *     The importer: first the hostile cases (a wrong token, a dead exporter, a
 *     foreign handle: each must fail), then cuIpcOpenMemHandle (twice: the same
 *     pointer), checks the pattern, and follows the exporter's orders on the pipes.
 *   ipc open HEX
 *     Opens the handle given as 128 hex digits and prints "RESULT <code>" and the
 *     time it took (for tests that play a hostile exporter).
 *
 * Exits 2 on a failed call (printed), 3 on a wrong byte, 4 on a wrong answer. */
#include <cuda.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHECK(call)                                                            \
    do {                                                                       \
        CUresult r_ = (call);                                                  \
        if (r_ != CUDA_SUCCESS) {                                              \
            const char *n_ = "?";                                              \
            cuGetErrorName(r_, &n_);                                           \
            printf("FAIL %s %s:%d %s -> %d %s\n", role, __FILE__, __LINE__,    \
                   #call, (int)r_, n_);                                        \
            fflush(stdout);                                                    \
            exit(2);                                                           \
        }                                                                      \
    } while (0)

static const char *role = "?";

static uint32_t pattern(uint32_t seed, size_t i) {
    return (uint32_t)(i * 2654435761u) ^ seed;
}

static void fill(CUdeviceptr p, size_t bytes, uint32_t seed) {
    size_t n = bytes / 4;
    uint32_t *h = malloc(bytes);
    for (size_t i = 0; i < n; i++) h[i] = pattern(seed, i);
    CHECK(cuMemcpyHtoD(p, h, bytes));
    free(h);
}

static void verify(CUdeviceptr p, size_t bytes, uint32_t seed, const char *what) {
    size_t n = bytes / 4;
    uint32_t *h = malloc(bytes);
    CHECK(cuMemcpyDtoH(h, p, bytes));
    for (size_t i = 0; i < n; i++) {
        if (h[i] != pattern(seed, i)) {
            printf("WRONG BYTE %s %s: word %zu is %#x, want %#x\n", role, what, i,
                   h[i], pattern(seed, i));
            fflush(stdout);
            exit(3);
        }
    }
    free(h);
}

static void say(int fd, const char *word) {
    char line[32];
    snprintf(line, sizeof line, "%s\n", word);
    if (write(fd, line, strlen(line)) != (ssize_t)strlen(line)) {
        printf("FAIL %s: write %s: %s\n", role, word, strerror(errno));
        exit(2);
    }
}

static void hear(int fd, const char *word) {
    char line[32];
    size_t k = 0;
    while (k < sizeof line - 1) {
        ssize_t r = read(fd, line + k, 1);
        if (r <= 0) {
            printf("FAIL %s: waiting for %s: %s\n", role, word,
                   r == 0 ? "end of file" : strerror(errno));
            exit(2);
        }
        if (line[k] == '\n') break;
        k++;
    }
    line[k] = 0;
    if (strcmp(line, word) != 0) {
        printf("FAIL %s: heard %s, want %s\n", role, line, word);
        exit(2);
    }
}

static void hex(const CUipcMemHandle *h, char *out) {
    for (int i = 0; i < 64; i++) sprintf(out + 2 * i, "%02x", (unsigned char)h->reserved[i]);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static CUcontext setup(void) {
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    return ctx;
}

#define SHARED_SEED 0x5eed0001u
#define PRIVATE_SEED 0x5eed0002u
#define REPLY_SEED 0x5eed0003u

static int exporter(size_t s_mib, size_t p_mib, const char *self) {
    role = "exporter";
    setup();
    size_t s_bytes = s_mib << 20, p_bytes = p_mib << 20;
    CUdeviceptr s, p;
    CHECK(cuMemAlloc(&s, s_bytes));
    CHECK(cuMemAlloc(&p, p_bytes));
    fill(s, s_bytes, SHARED_SEED);
    fill(p, p_bytes, PRIVATE_SEED);
    CUipcMemHandle h, again;
    CHECK(cuIpcGetMemHandle(&h, s));
    /* "may be called multiple times on an allocation without adverse effects" */
    CHECK(cuIpcGetMemHandle(&again, s));
    if (memcmp(&h, &again, sizeof h) != 0) {
        printf("WRONG exporter: a second cuIpcGetMemHandle gave another handle\n");
        return 4;
    }
    int to_child[2], to_parent[2];
    if (pipe(to_child) || pipe(to_parent)) return 2;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        char rfd[16], wfd[16];
        close(to_child[1]);
        close(to_parent[0]);
        snprintf(rfd, sizeof rfd, "%d", to_child[0]);
        snprintf(wfd, sizeof wfd, "%d", to_parent[1]);
        execl("/proc/self/exe", self, "import", rfd, wfd, (char *)NULL);
        _exit(127);
    }
    close(to_child[0]);
    close(to_parent[1]);
    char line[200];
    hex(&h, line);
    sprintf(line + 128, " %zu\n", s_bytes);
    if (write(to_child[1], line, strlen(line)) != (ssize_t)strlen(line)) return 2;
    hear(to_parent[0], "opened");
    line[128] = 0;
    printf("HANDLE %s\n", line);
    printf("READY\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 2;
    /* Swapped out for another program by now: the shared memory must have stayed. */
    say(to_child[1], "write");
    hear(to_parent[0], "written");
    verify(s, s_bytes, REPLY_SEED, "shared (the importer's bytes)");
    verify(p, p_bytes, PRIVATE_SEED, "private");
    say(to_child[1], "close");
    int st = 0;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        printf("FAIL exporter: the importer exited with status %#x\n", st);
        return 2;
    }
    /* Nobody has it open any more: it may be swapped again (the test makes sure it
     * is), and comes back with every byte. */
    printf("CLOSED\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 2;
    verify(s, s_bytes, REPLY_SEED, "shared, after it was closed");
    verify(p, p_bytes, PRIVATE_SEED, "private, again");
    CHECK(cuMemFree(s));
    CHECK(cuMemFree(p));
    printf("OK\n");
    return 0;
}

/* Every hostile handle must fail, and fast. */
static int hostile(const CUipcMemHandle *good) {
    int wrong = 0;
    CUdeviceptr d = 0;
    CUipcMemHandle bad = *good;
    bad.reserved[40] ^= 0x55; /* the token */
    double t = now_s();
    CUresult r = cuIpcOpenMemHandle(&d, bad, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    printf("wrong token: %d in %.3f s\n", (int)r, now_s() - t);
    if (r == CUDA_SUCCESS) wrong++;
    bad = *good;
    memset(bad.reserved + 8, 0xff, 4); /* a pid that does not exist */
    r = cuIpcOpenMemHandle(&d, bad, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    printf("dead exporter: %d\n", (int)r);
    if (r == CUDA_SUCCESS) wrong++;
    memset(&bad, 0x3c, sizeof bad); /* not the shim's: the driver's business */
    r = cuIpcOpenMemHandle(&d, bad, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    printf("foreign handle: %d\n", (int)r);
    if (r == CUDA_SUCCESS) wrong++;
    r = cuIpcOpenMemHandle(&d, *good, 0x80);
    printf("unknown flag: %d\n", (int)r);
    if (r != CUDA_ERROR_INVALID_VALUE) wrong++;
    r = cuIpcCloseMemHandle(0x1234);
    printf("close of nothing: %d\n", (int)r);
    if (r == CUDA_SUCCESS) wrong++;
    return wrong;
}

static int importer(int rfd, int wfd) {
    role = "importer";
    setup();
    char line[200];
    size_t k = 0;
    while (k < sizeof line - 1) {
        if (read(rfd, line + k, 1) != 1) return 2;
        if (line[k++] == '\n') break;
    }
    line[k] = 0;
    size_t bytes = strtoull(line + 128, 0, 10);
    CUipcMemHandle h;
    for (int i = 0; i < 64; i++) {
        unsigned v;
        sscanf(line + 2 * i, "%2x", &v);
        h.reserved[i] = (char)v;
    }
    if (hostile(&h)) {
        printf("WRONG importer: a hostile handle was opened\n");
        return 4;
    }
    CUdeviceptr s, s2;
    CHECK(cuIpcOpenMemHandle(&s, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    CHECK(cuIpcOpenMemHandle(&s2, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    if (s2 != s) {
        printf("WRONG importer: opened twice at %#llx and %#llx\n",
               (unsigned long long)s, (unsigned long long)s2);
        return 4;
    }
    CHECK(cuIpcCloseMemHandle(s2));
    verify(s, bytes, SHARED_SEED, "shared (the exporter's bytes)");
    printf("importer opened %zu bytes\n", bytes);
    fflush(stdout);
    say(wfd, "opened");
    hear(rfd, "write");
    fill(s, bytes, REPLY_SEED);
    CHECK(cuCtxSynchronize());
    say(wfd, "written");
    hear(rfd, "close");
    CHECK(cuIpcCloseMemHandle(s));
    return 0;
}

static int open_hex(const char *text) {
    role = "open";
    setup();
    CUipcMemHandle h;
    if (strlen(text) != 128) return 2;
    for (int i = 0; i < 64; i++) {
        unsigned v;
        sscanf(text + 2 * i, "%2x", &v);
        h.reserved[i] = (char)v;
    }
    CUdeviceptr d = 0;
    double t = now_s();
    CUresult r = cuIpcOpenMemHandle(&d, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    printf("RESULT %d in %.3f s\n", (int)r, now_s() - t);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 4 && strcmp(argv[1], "export") == 0)
        return exporter(strtoull(argv[2], 0, 10), strtoull(argv[3], 0, 10), argv[0]);
    if (argc == 4 && strcmp(argv[1], "import") == 0)
        return importer(atoi(argv[2]), atoi(argv[3]));
    if (argc == 3 && strcmp(argv[1], "open") == 0) return open_hex(argv[2]);
    fprintf(stderr, "usage: ipc export S_MIB P_MIB | import RFD WFD | open HEX\n");
    return 1;
}
