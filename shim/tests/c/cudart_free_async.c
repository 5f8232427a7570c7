/* cudaFreeAsync under Kiwi frees in its own stream's order only (NVIDIA's CUDA
 * runtime; what PyTorch's cudaMallocAsync backend does).
 *
 * A non-blocking stream `s` allocates 64 MiB with cudaMallocAsync, fills it and
 * copies a slice out; then a second thread starts a copy of OTHER_MIB MiB of pinned
 * input into the GPU on a blocking stream `other` (about a quarter of a second at the
 * test's copy rate; that thread may wait in Kiwi's queue bound, the main thread does
 * not submit meanwhile), and while `other` is busy the main thread frees the 64 MiB
 * with cudaFreeAsync on `s`. The free must not wait for `other`: right after it
 * returns, `other` is still busy (cudaStreamQuery says cudaErrorNotReady). Every byte
 * of both streams' work is checked. Prints "free_ms <ms> other_ms <ms>" per round,
 * then "OK"; exits 2 on a failed call, 3 on a wrong byte, 4 when the free waited.
 *
 * Built with -DPER_THREAD (cudart_free_async_ptsz.c) it also frees on the per-thread
 * stream (stream 0, the runtime calls cuMemFreeAsync_ptsz) while a blocking stream
 * is being captured: the free must wait for the per-thread stream, not the legacy
 * one (which a capture on a blocking stream forbids), and the capture survives.
 *
 * Then (both builds) a cudaMallocAsync / cudaFreeAsync on `s` while a blocking
 * stream captures in GLOBAL mode: the capture survives the shim's wait for `s`. */
#include "../../../sim/core/tests/c/cudart_common.h"

#include <pthread.h>
#include <time.h>
#include <unistd.h>

#define MIB (1u << 20)
#define ROUNDS 3 /* with OTHER_MIB > 0 */

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

struct other_job {
    cudaStream_t stream;
    unsigned char *dst, *src;
    size_t n;
};

static void *submit_other(void *arg) {
    struct other_job *j = arg;
    CHECK(cudaMemcpyAsync(j->dst, j->src, j->n, cudaMemcpyHostToDevice, j->stream));
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: cudart_free_async OTHER_MIB\n");
        return 1;
    }
    /* OTHER_MIB 0: no rounds (the per-thread part only). */
    size_t other_n = strtoull(argv[1], NULL, 10) * MIB;
    int rounds = other_n ? ROUNDS : 0;
    if (other_n < MIB)
        other_n = MIB;
    size_t n = 64 * MIB;
    cudaStream_t s, other;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK(cudaStreamCreate(&other));
    unsigned char *x = NULL, *src = NULL, *h = NULL;
    CHECK(cudaMalloc((void **)&x, other_n));
    CHECK(cudaMallocHost((void **)&src, other_n));
    CHECK(cudaMallocHost((void **)&h, other_n));

    for (int r = 0; r < rounds; r++) {
        fill_pattern(src, other_n, 10 + r);
        unsigned char *p = NULL;
        CHECK(cudaMallocAsync((void **)&p, n, s));
        CHECK(cudaMemsetAsync(p, 0x30 + r, n, s));
        CHECK(cudaMemsetAsync(p + n / 2, 0x60 + r, MIB, s));
        CHECK(cudaMemcpyAsync(h, p + n / 2 - MIB, 2 * MIB, cudaMemcpyDeviceToHost, s));
        double t0 = now_ms();
        struct other_job job = {other, x, src, other_n};
        pthread_t t;
        ASSERT(pthread_create(&t, NULL, submit_other, &job) == 0);
        /* The other stream is busy: its copy was submitted and takes ~250 ms. */
        int waited = 0;
        while (cudaStreamQuery(other) != cudaErrorNotReady && waited++ < 1000)
            usleep(1000);
        ASSERT(cudaStreamQuery(other) == cudaErrorNotReady);
        double f0 = now_ms();
        CHECK(cudaFreeAsync(p, s));
        double f1 = now_ms();
        cudaError_t busy = cudaStreamQuery(other);
        CHECK(cudaStreamSynchronize(s));
        ASSERT(check_value(h, MIB, 0x30 + r) == MIB);
        ASSERT(check_value(h + MIB, MIB, 0x60 + r) == MIB);
        ASSERT(pthread_join(t, NULL) == 0);
        CHECK(cudaStreamSynchronize(other));
        double t1 = now_ms();
        printf("free_ms %.1f other_ms %.1f\n", f1 - f0, t1 - t0);
        fflush(stdout);
        if (busy != cudaErrorNotReady) {
            fprintf(stderr, "FAIL round %d: the free waited for the other stream (%.1f ms)\n", r,
                    f1 - f0);
            return 4;
        }
        CHECK(cudaMemcpy(h, x, other_n, cudaMemcpyDeviceToHost));
        size_t bad = check_pattern(h, other_n, 10 + r);
        if (bad != other_n) {
            fprintf(stderr, "FAIL round %d other byte %zu\n", r, bad);
            return 3;
        }
    }

#ifdef PER_THREAD
    /* Stream 0 is this thread's per-thread stream. A blocking stream captures
     * (relaxed: allocation is allowed) meanwhile. */
    cudaStream_t c;
    CHECK(cudaStreamCreate(&c));
    CHECK(cudaMemset(x, 0, MIB)); /* holds the GPU: warmed up before capturing */
    CHECK(cudaStreamBeginCapture(c, cudaStreamCaptureModeRelaxed));
    CHECK(cudaMemsetAsync(x, 0x11, MIB, c));
    unsigned char *q = NULL;
    CHECK(cudaMallocAsync((void **)&q, n, 0));
    CHECK(cudaMemsetAsync(q, 0x5C, n, 0));
    CHECK(cudaMemcpyAsync(h, q + n - MIB, MIB, cudaMemcpyDeviceToHost, 0));
    CHECK(cudaFreeAsync(q, 0));
    CHECK(cudaStreamSynchronize(0));
    ASSERT(check_value(h, MIB, 0x5C) == MIB);
    cudaGraph_t g = NULL;
    CHECK(cudaStreamEndCapture(c, &g));
    ASSERT(g != NULL);
    cudaGraphExec_t ge;
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    CHECK(cudaGraphLaunch(ge, c));
    CHECK(cudaStreamSynchronize(c));
    CHECK(cudaMemcpy(h, x, MIB, cudaMemcpyDeviceToHost));
    ASSERT(check_value(h, MIB, 0x11) == MIB);
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaStreamDestroy(c));
    puts("per-thread OK");
#endif

    /* A stream-ordered allocation and free on a stream that does not capture while
     * a blocking stream captures in the default GLOBAL mode: stream-ordered calls,
     * which the simulator allows (the driver's answer is not measured), and the
     * shim's wait for the free's stream (a potentially unsafe call, refused and
     * invalidating in GLOBAL mode) must not invalidate the capture. */
    {
        cudaStream_t g_s;
        CHECK(cudaStreamCreate(&g_s));
        CHECK(cudaMemset(x, 0, MIB));
        CHECK(cudaStreamBeginCapture(g_s, cudaStreamCaptureModeGlobal));
        CHECK(cudaMemsetAsync(x, 0x22, MIB, g_s));
        unsigned char *q = NULL;
        CHECK(cudaMallocAsync((void **)&q, n, s));
        CHECK(cudaMemsetAsync(q, 0x5D, n, s));
        CHECK(cudaFreeAsync(q, s));
        CHECK(cudaMemsetAsync(x + MIB / 2, 0x33, MIB / 2, g_s));
        cudaGraph_t g = NULL;
        CHECK(cudaStreamEndCapture(g_s, &g));
        ASSERT(g != NULL);
        cudaGraphExec_t ge;
        CHECK(cudaGraphInstantiate(&ge, g, 0));
        CHECK(cudaGraphLaunch(ge, g_s));
        CHECK(cudaStreamSynchronize(g_s));
        CHECK(cudaMemcpy(h, x, MIB, cudaMemcpyDeviceToHost));
        ASSERT(check_value(h, MIB / 2, 0x22) == MIB / 2);
        ASSERT(check_value(h + MIB / 2, MIB / 2, 0x33) == MIB / 2);
        CHECK(cudaGraphExecDestroy(ge));
        CHECK(cudaGraphDestroy(g));
        CHECK(cudaStreamDestroy(g_s));
        puts("global capture OK");
    }

    CHECK(cudaStreamDestroy(s));
    CHECK(cudaStreamDestroy(other));
    CHECK(cudaFree(x));
    CHECK(cudaFreeHost(src));
    CHECK(cudaFreeHost(h));
    CHECK(cudaGetLastError());
    puts("OK");
    return 0;
}
