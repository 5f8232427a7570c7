/* The driver's checkpoint API (cuCheckpointProcess*) on the simulator: a parent
 * locks, checkpoints, restores and unlocks a child by pid, and every transition the
 * driver refuses is refused. Run with argument "off" under KIWI_SIM_CHECKPOINT=0:
 * a driver without the API refuses every call with CUDA_ERROR_NOT_SUPPORTED.
 * Costs are read from KIWI_SIM_CHECKPOINT_MS/_GBPS and KIWI_SIM_RESTORE_MS/_GBPS.
 * Prints "OK" and exits 0 on success. */
#include "driver_check.h"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BYTES ((size_t)64 << 20)

static const char ptx[] = ".version 7.0\n.target sm_52\n.address_size 64\n"
                          ".visible .entry kiwi_spin() { ret; }\n";

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static double env_or(const char *name, double dflt) {
    const char *v = getenv(name);
    return v && *v ? atof(v) : dflt;
}

static void put(int fd, const void *p, size_t n) { ASSERT(write(fd, p, n) == (ssize_t)n); }
static void get(int fd, void *p, size_t n) { ASSERT(read(fd, p, n) == (ssize_t)n); }

/* The child: a CUDA process with a context, a module and 64 MiB of known bytes,
 * doing what the parent's one-letter commands say. */
static void child(int in, int out) {
    CHECK(cuInit(0));
    CUcontext ctx;
    CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CHECK(cuCtxSetCurrent(ctx));
    CUdeviceptr d, managed = 0;
    CHECK(cuMemAlloc(&d, BYTES));
    CHECK(cuMemsetD32(d, 0x5a5a5a5a, BYTES / 4));
    CUmodule mod;
    CUfunction spin;
    CHECK(cuModuleLoadData(&mod, ptx));
    CHECK(cuModuleGetFunction(&spin, mod, "kiwi_spin"));
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    unsigned int *host = malloc(BYTES);
    ASSERT(host);
    put(out, "r", 1);
    for (;;) {
        char c;
        get(in, &c, 1);
        if (c == 'b') { /* a call made while locked returns after the unlock */
            CHECK(cuMemcpyDtoH(host, d, BYTES));
            double t = now_ms();
            for (size_t i = 0; i < BYTES / 4; i++)
                ASSERT(host[i] == 0x5a5a5a5a);
            put(out, &t, sizeof t);
        } else if (c == 's') { /* 600 ms of work in flight */
            unsigned long long ns = 600ull * 1000 * 1000;
            void *args[] = {&ns};
            CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
            put(out, "k", 1);
        } else if (c == 'm') {
            CHECK(cuMemAllocManaged(&managed, 2 << 20, CU_MEM_ATTACH_GLOBAL));
            put(out, "k", 1);
        } else if (c == 'f') {
            CHECK(cuMemFree(managed));
            put(out, "k", 1);
        } else if (c == 'i') {
            CUipcMemHandle h;
            CHECK(cuIpcGetMemHandle(&h, d));
            put(out, "k", 1);
        } else {
            exit(0);
        }
    }
}

static CUprocessState state_of(pid_t pid) {
    CUprocessState st = CU_PROCESS_STATE_FAILED;
    CHECK(cuCheckpointProcessGetState(pid, &st));
    return st;
}

static size_t free_bytes(void) {
    size_t f, t;
    CHECK(cuMemGetInfo(&f, &t));
    return f;
}

static void ask(int to, int from, char c) {
    char k;
    put(to, &c, 1);
    get(from, &k, 1);
    ASSERT(k == 'k');
}

int main(int argc, char **argv) {
    int off = argc > 1 && strcmp(argv[1], "off") == 0;
    int p2c[2], c2p[2];
    ASSERT(pipe(p2c) == 0 && pipe(c2p) == 0);
    pid_t plain = fork(); /* a process without CUDA */
    if (plain == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* a failing parent takes its children */
        pause();
        exit(0);
    }
    pid_t kid = fork();
    if (kid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        child(p2c[0], c2p[1]);
        exit(0);
    }
    char r;
    get(c2p[0], &r, 1);
    ASSERT(r == 'r');

    /* The caller needs cuInit, as for every driver call. */
    CUprocessState st;
    EXPECT(cuCheckpointProcessGetState(kid, &st), CUDA_ERROR_NOT_INITIALIZED);
    CHECK(cuInit(0));
    if (off) {
        EXPECT(cuCheckpointProcessGetState(kid, &st), CUDA_ERROR_NOT_SUPPORTED);
        EXPECT(cuCheckpointProcessLock(kid, NULL), CUDA_ERROR_NOT_SUPPORTED);
        put(p2c[1], "q", 1);
        ASSERT(waitpid(kid, NULL, 0) == kid);
        kill(plain, SIGKILL);
        printf("OK\n");
        return 0;
    }
    CUcontext ctx;
    CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CHECK(cuCtxSetCurrent(ctx));

    /* Pids without CUDA state, bad arguments. */
    EXPECT(cuCheckpointProcessGetState(plain, &st), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuCheckpointProcessLock(plain, NULL), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuCheckpointProcessGetState(-1, &st), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuCheckpointProcessGetState(kid, NULL), CUDA_ERROR_INVALID_VALUE);
    CUcheckpointLockArgs bad;
    memset(&bad, 0, sizeof bad);
    bad.reserved0 = 1;
    EXPECT(cuCheckpointProcessLock(kid, &bad), CUDA_ERROR_INVALID_VALUE);
    CUcheckpointCheckpointArgs badc;
    memset(&badc, 0, sizeof badc);
    badc.reserved[7] = 1;
    EXPECT(cuCheckpointProcessCheckpoint(kid, &badc), CUDA_ERROR_INVALID_VALUE);

    /* The restore thread is a thread of the child. */
    int tid = 0;
    CHECK(cuCheckpointProcessGetRestoreThreadId(kid, &tid));
    char task[64];
    snprintf(task, sizeof task, "/proc/%d/task/%d", kid, tid);
    struct stat sb;
    ASSERT(tid > 0 && tid != kid && stat(task, &sb) == 0);

    /* Transitions from RUNNING other than a lock are refused. */
    ASSERT(state_of(kid) == CU_PROCESS_STATE_RUNNING);
    EXPECT(cuCheckpointProcessCheckpoint(kid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT(cuCheckpointProcessRestore(kid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT(cuCheckpointProcessUnlock(kid, NULL), CUDA_ERROR_ILLEGAL_STATE);

    /* A lock waits for submitted work: with a timeout shorter than the work it
     * fails and leaves the process RUNNING; without one it waits. */
    double asked = now_ms(); /* the kernel cannot end before asked + 600 ms */
    ask(p2c[1], c2p[0], 's');
    CUcheckpointLockArgs la;
    memset(&la, 0, sizeof la);
    la.timeoutMs = 100;
    double t0 = now_ms();
    EXPECT(cuCheckpointProcessLock(kid, &la), CUDA_ERROR_NOT_READY);
    ASSERT(now_ms() - t0 >= 99);
    ASSERT(state_of(kid) == CU_PROCESS_STATE_RUNNING);
    CHECK(cuCheckpointProcessLock(kid, NULL));
    ASSERT(now_ms() >= asked + 599); /* it waited for the whole kernel */
    ASSERT(state_of(kid) == CU_PROCESS_STATE_LOCKED);
    EXPECT(cuCheckpointProcessLock(kid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT(cuCheckpointProcessRestore(kid, NULL), CUDA_ERROR_ILLEGAL_STATE);

    /* A call made while locked blocks... */
    put(p2c[1], "b", 1);
    struct pollfd pf = {c2p[0], POLLIN, 0};
    ASSERT(poll(&pf, 1, 200) == 0);

    /* ...through a checkpoint, which gives the GPU everything the child held:
     * context, module and allocation. */
    size_t before = free_bytes();
    size_t ctx_mem = (size_t)env_or("KIWI_SIM_CONTEXT_MEMORY", 300 << 20);
    size_t mod_mem = (size_t)env_or("KIWI_SIM_MODULE_MEMORY", 2 << 20);
    size_t held = ctx_mem + mod_mem + BYTES;
    t0 = now_ms();
    CHECK(cuCheckpointProcessCheckpoint(kid, NULL));
    double took = now_ms() - t0;
    double want = env_or("KIWI_SIM_CHECKPOINT_MS", 156) +
                  held / (env_or("KIWI_SIM_CHECKPOINT_GBPS", 3.1) * 1e6);
    if (!(took >= want - 2)) {
        fprintf(stderr, "FAIL checkpoint took %.1f ms, modelled %.1f\n", took, want);
        exit(1);
    }
    size_t after = free_bytes();
    if (after - before != held) {
        fprintf(stderr, "FAIL checkpoint freed %zu, the child held %zu\n", after - before, held);
        exit(1);
    }
    ASSERT(state_of(kid) == CU_PROCESS_STATE_CHECKPOINTED);
    EXPECT(cuCheckpointProcessCheckpoint(kid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT(cuCheckpointProcessUnlock(kid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT(cuCheckpointProcessLock(kid, NULL), CUDA_ERROR_ILLEGAL_STATE);

    /* A restore needs the room back: refused while another takes it. */
    CUdeviceptr hog;
    CHECK(cuMemAlloc(&hog, after - held / 2));
    EXPECT(cuCheckpointProcessRestore(kid, NULL), CUDA_ERROR_OUT_OF_MEMORY);
    ASSERT(state_of(kid) == CU_PROCESS_STATE_CHECKPOINTED);
    CHECK(cuMemFree(hog));
    ASSERT(free_bytes() == after);
    t0 = now_ms();
    CHECK(cuCheckpointProcessRestore(kid, NULL));
    took = now_ms() - t0;
    want = env_or("KIWI_SIM_RESTORE_MS", 171) + held / (env_or("KIWI_SIM_RESTORE_GBPS", 5.5) * 1e6);
    if (!(took >= want - 2)) {
        fprintf(stderr, "FAIL restore took %.1f ms, modelled %.1f\n", took, want);
        exit(1);
    }
    ASSERT(free_bytes() == before);
    ASSERT(state_of(kid) == CU_PROCESS_STATE_LOCKED);
    ASSERT(poll(&pf, 1, 0) == 0); /* still blocked */

    /* The unlock lets the blocked call finish, every byte right. */
    double unlocked = now_ms();
    CHECK(cuCheckpointProcessUnlock(kid, NULL));
    double returned;
    get(c2p[0], &returned, sizeof returned);
    ASSERT(returned >= unlocked);
    ASSERT(state_of(kid) == CU_PROCESS_STATE_RUNNING);

    /* Managed memory and CUDA IPC cannot be checkpointed: the process stays LOCKED. */
    ask(p2c[1], c2p[0], 'm');
    CHECK(cuCheckpointProcessLock(kid, NULL));
    EXPECT(cuCheckpointProcessCheckpoint(kid, NULL), CUDA_ERROR_NOT_SUPPORTED);
    ASSERT(state_of(kid) == CU_PROCESS_STATE_LOCKED);
    CHECK(cuCheckpointProcessUnlock(kid, NULL));
    ask(p2c[1], c2p[0], 'f');
    CHECK(cuCheckpointProcessLock(kid, NULL));
    CHECK(cuCheckpointProcessCheckpoint(kid, NULL));
    CHECK(cuCheckpointProcessRestore(kid, NULL));
    CHECK(cuCheckpointProcessUnlock(kid, NULL));
    ask(p2c[1], c2p[0], 'i');
    CHECK(cuCheckpointProcessLock(kid, NULL));
    EXPECT(cuCheckpointProcessCheckpoint(kid, NULL), CUDA_ERROR_NOT_SUPPORTED);
    CHECK(cuCheckpointProcessUnlock(kid, NULL));

    put(p2c[1], "q", 1);
    int status = 0;
    ASSERT(waitpid(kid, &status, 0) == kid);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    /* A process that exited has no CUDA state. */
    EXPECT(cuCheckpointProcessGetState(kid, &st), CUDA_ERROR_INVALID_VALUE);
    kill(plain, SIGKILL);
    waitpid(plain, NULL, 0);
    printf("OK\n");
    return 0;
}
