/* A CUDA graph captured while this program holds the GPU and another waits, then
 * replayed across turns, on NVIDIA's CUDA runtime (what torch.cuda.graph does).
 *
 * Allocates MIB MiB and fills it (holding the GPU from then on), then captures on a
 * blocking stream, in the default (global) mode: a copy of pinned input into the
 * buffer, OPS memsets of 4 KiB slices (each its own value), a device-to-device copy of
 * the input and a copy of that back to pinned output. Halfway through the capture it
 * prints "capturing" and sleeps PAUSE_MS (a notebook's Python between two captured
 * calls: the other program's request and the drop come now). The graph is then
 * launched REPLAYS times, each time on new input and with a CPU pause, and every
 * byte of the output checked; at the end every byte of the buffer.
 * Usage: cudart_capture MIB OPS REPLAYS PAUSE_MS
 * Prints "capturing", "captured", a line per replay, then "OK"; exits 2 on a failed
 * call, 3 on a wrong byte. */
#include "../../../sim/core/tests/c/cudart_common.h"

#include <unistd.h>

#define IO (4u << 20)
#define SLICE 4096u

static unsigned char slice_value(size_t i) { return (unsigned char)(i * 13 + 7); }

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: cudart_capture MIB OPS REPLAYS PAUSE_MS\n");
        return 1;
    }
    size_t n = strtoull(argv[1], NULL, 10) << 20;
    size_t ops = strtoull(argv[2], NULL, 10);
    int replays = atoi(argv[3]);
    int pause_ms = atoi(argv[4]);
    size_t off_in = 0, off_copy = IO, off_ops = 2 * (size_t)IO;
    size_t off_rest = off_ops + ops * SLICE;
    ASSERT(ops >= 2 && replays >= 1 && pause_ms >= 0 && off_rest < n);

    unsigned char *a = NULL, *in = NULL, *outp = NULL;
    CHECK(cudaMalloc((void **)&a, n));
    CHECK(cudaMallocHost((void **)&in, IO));
    CHECK(cudaMallocHost((void **)&outp, IO));
    unsigned char *h = malloc(n);
    ASSERT(h != NULL);
    fill_pattern(h, n, 1);
    CHECK(cudaMemcpy(a, h, n, cudaMemcpyHostToDevice));

    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemcpyAsync(a + off_in, in, IO, cudaMemcpyHostToDevice, s));
    for (size_t i = 0; i < ops; i++) {
        if (i == ops / 2) {
            puts("capturing");
            fflush(stdout);
            usleep(pause_ms * 1000);
        }
        CHECK(cudaMemsetAsync(a + off_ops + i * SLICE, slice_value(i), SLICE, s));
    }
    CHECK(cudaMemcpyAsync(a + off_copy, a + off_in, IO, cudaMemcpyDeviceToDevice, s));
    CHECK(cudaMemcpyAsync(outp, a + off_copy, IO, cudaMemcpyDeviceToHost, s));
    enum cudaStreamCaptureStatus st;
    CHECK(cudaStreamIsCapturing(s, &st));
    ASSERT(st == cudaStreamCaptureStatusActive);
    cudaGraph_t g = NULL;
    CHECK(cudaStreamEndCapture(s, &g));
    ASSERT(g != NULL);
    puts("captured");
    fflush(stdout);

    cudaGraphExec_t ge;
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int r = 0; r < replays; r++) {
        fill_pattern(in, IO, 100 + r);
        memset(outp, 0, IO);
        CHECK(cudaGraphLaunch(ge, s));
        CHECK(cudaStreamSynchronize(s));
        size_t bad = check_pattern(outp, IO, 100 + r);
        if (bad != IO) {
            fprintf(stderr, "FAIL replay %d output byte %zu\n", r, bad);
            return 3;
        }
        printf("replay %d\n", r);
        fflush(stdout);
        usleep(pause_ms * 100);
    }

    /* Every byte: the input and its copy from the last replay, each slice its
     * value, the rest as filled before the capture. */
    CHECK(cudaMemcpy(h, a, n, cudaMemcpyDeviceToHost));
    ASSERT(check_pattern(h + off_in, IO, 100 + replays - 1) == IO);
    ASSERT(check_pattern(h + off_copy, IO, 100 + replays - 1) == IO);
    for (size_t i = 0; i < ops; i++)
        if (check_value(h + off_ops + i * SLICE, SLICE, slice_value(i)) != SLICE) {
            fprintf(stderr, "FAIL slice %zu\n", i);
            return 3;
        }
    for (size_t i = off_rest; i < n; i++)
        if (h[i] != pattern_byte(i, 1)) {
            fprintf(stderr, "FAIL byte %zu\n", i);
            return 3;
        }

    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(a));
    CHECK(cudaFreeHost(in));
    CHECK(cudaFreeHost(outp));
    free(h);
    CHECK(cudaGetLastError());
    puts("OK");
    return 0;
}
