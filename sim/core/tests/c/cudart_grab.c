/* TensorFlow's memory pattern on NVIDIA's CUDA runtime: open the context, ask
 * cudaMemGetInfo how much is free, take all of it but MARGIN_MIB in one cudaMalloc,
 * then ROUNDS times write one 1 MiB slice of it per 64 MiB (cudaMemset) and read
 * those slices back, with CPU_MS pauses; at the end every byte is checked. Usage:
 *   cudart_grab MARGIN_MIB ROUNDS CPU_MS
 * MARGIN_MIB written pN takes N% of the GPU's total instead (one allocation of
 * 90% of the GPU, as a program alone on it may make). Prints "pid <pid>", "free <bytes> total <bytes>" (what it was told), "took
 * <bytes>", a line per round, then "OK". With KIWI_TEST_GATE set it prints "READY"
 * once its context is open and waits for a line on stdin before asking for free
 * memory (a start gate: a test opens two contexts before either asks). Exits 2 on
 * a failed call, 3 on a wrong byte. */
#include "cudart_common.h"

#include <unistd.h>

#define SLICE (1u << 20)
#define STRIDE (64u << 20)

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: cudart_grab MARGIN_MIB ROUNDS CPU_MS\n");
        return 1;
    }
    int percent = argv[1][0] == 'p' ? atoi(argv[1] + 1) : 0;
    size_t margin = percent ? 0 : strtoull(argv[1], NULL, 10) << 20;
    int rounds = atoi(argv[2]);
    int cpu_ms = atoi(argv[3]);
    ASSERT(rounds >= 1 && rounds < 250);
    printf("pid %d\n", (int)getpid());
    fflush(stdout);
    CHECK(cudaSetDevice(0));
    CHECK(cudaFree(NULL)); /* the context, as frameworks open it */
    if (getenv("KIWI_TEST_GATE")) {
        char line[16];
        puts("READY");
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin))
            return 1;
    }
    size_t free_b = 0, total_b = 0;
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    printf("free %zu total %zu\n", free_b, total_b);
    size_t n;
    if (percent) {
        n = total_b / 100 * (size_t)percent / STRIDE * STRIDE;
    } else {
        ASSERT(free_b > margin + STRIDE);
        n = (free_b - margin) / STRIDE * STRIDE;
    }
    unsigned char *d = NULL;
    CHECK(cudaMalloc((void **)&d, n));
    printf("took %zu\n", n);
    fflush(stdout);
    size_t slices = n / STRIDE;
    unsigned char *h = malloc(SLICE);
    ASSERT(h != NULL);
    for (int r = 0; r < rounds; r++) {
        for (size_t s = 0; s < slices; s++)
            CHECK(cudaMemset(d + s * STRIDE + (size_t)(r % 64) * SLICE, (r + (int)s) & 0xff, SLICE));
        for (size_t s = 0; s < slices; s++) {
            CHECK(cudaMemcpy(h, d + s * STRIDE + (size_t)(r % 64) * SLICE, SLICE, cudaMemcpyDeviceToHost));
            ASSERT(check_value(h, SLICE, (unsigned char)((r + (int)s) & 0xff)) == SLICE);
        }
        printf("round %d\n", r);
        fflush(stdout);
        sleep_ms(cpu_ms);
    }
    /* Every slice written holds its last round's value. */
    for (size_t s = 0; s < slices; s++)
        for (int k = 0; k < 64 && k < rounds; k++) {
            int last = k + (rounds - 1 - k) / 64 * 64;
            CHECK(cudaMemcpy(h, d + s * STRIDE + (size_t)k * SLICE, SLICE, cudaMemcpyDeviceToHost));
            ASSERT(check_value(h, SLICE, (unsigned char)((last + (int)s) & 0xff)) == SLICE);
        }
    CHECK(cudaFree(d));
    free(h);
    puts("OK");
    return 0;
}
