/* Stream capture and graphs through NVIDIA's CUDA runtime: memset and memcpy work
 * (host to device from pinned memory, device to device, device to host) captured
 * on a non-blocking stream does not run at capture; the instantiated graph is then
 * launched LAUNCHES times, each time on new input, and every byte is checked.
 * Usage: cudart_graph MIB LAUNCHES. Prints "OK"; exits 2 on a failed call, 3 on a
 * wrong value. */
#include "cudart_common.h"

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: cudart_graph MIB LAUNCHES\n");
        return 1;
    }
    size_t n = strtoull(argv[1], NULL, 10) << 20;
    int launches = atoi(argv[2]);
    ASSERT(n >= 8192 && launches >= 1);

    unsigned char *a = NULL, *b = NULL, *in = NULL, *outp = NULL;
    CHECK(cudaMalloc((void **)&a, n));
    CHECK(cudaMalloc((void **)&b, n));
    CHECK(cudaMallocHost((void **)&in, n));
    CHECK(cudaMallocHost((void **)&outp, n));
    CHECK(cudaMemset(a, 0x77, n));
    CHECK(cudaMemset(b, 0x77, n));
    memset(outp, 0x66, n);
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    enum cudaStreamCaptureStatus st;
    unsigned long long id = 0;
    CHECK(cudaStreamIsCapturing(s, &st));
    ASSERT(st == cudaStreamCaptureStatusNone);
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaStreamIsCapturing(s, &st));
    ASSERT(st == cudaStreamCaptureStatusActive);
    CHECK(cudaStreamGetCaptureInfo(s, &st, &id, NULL, NULL, NULL));
    ASSERT(st == cudaStreamCaptureStatusActive && id != 0);
    CHECK(cudaMemsetAsync(a, 0, n, s));
    CHECK(cudaMemcpyAsync(a, in, n, cudaMemcpyHostToDevice, s));
    CHECK(cudaMemsetAsync(a, 0x5A, 4096, s));
    CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s));
    CHECK(cudaMemsetAsync(b + n - 4096, 0xA5, 4096, s));
    CHECK(cudaMemcpyAsync(outp, b, n, cudaMemcpyDeviceToHost, s));
    cudaGraph_t g = NULL;
    CHECK(cudaStreamEndCapture(s, &g));
    ASSERT(g != NULL);
    CHECK(cudaStreamIsCapturing(s, &st));
    ASSERT(st == cudaStreamCaptureStatusNone);

    /* Captured, not run: device and host memory are as they were. */
    CHECK(cudaStreamSynchronize(s));
    ASSERT(check_value(outp, n, 0x66) == n);
    unsigned char *h = malloc(n);
    ASSERT(h != NULL);
    CHECK(cudaMemcpy(h, a, n, cudaMemcpyDeviceToHost));
    ASSERT(check_value(h, n, 0x77) == n);

    cudaGraphExec_t ge;
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < launches; i++) {
        fill_pattern(in, n, 100 + i);
        CHECK(cudaGraphLaunch(ge, s));
        CHECK(cudaStreamSynchronize(s));
        ASSERT(check_value(outp, 4096, 0x5A) == 4096);
        ASSERT(check_value(outp + n - 4096, 4096, 0xA5) == 4096);
        for (size_t j = 4096; j < n - 4096; j++)
            if (outp[j] != pattern_byte(j, 100 + i)) {
                fprintf(stderr, "FAIL launch %d byte %zu\n", i, j);
                return 3;
            }
    }
    /* Launches queue in stream order: the last one's input wins. */
    for (int i = 0; i < 3; i++)
        CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemcpy(h, b, n, cudaMemcpyDeviceToHost));
    ASSERT(memcmp(h, outp, n) == 0);

    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    CHECK(cudaFreeHost(in));
    CHECK(cudaFreeHost(outp));
    free(h);
    CHECK(cudaGetLastError());
    puts("OK");
    return 0;
}
