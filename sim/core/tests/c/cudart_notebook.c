/* A notebook on NVIDIA's CUDA runtime: allocates MIB MiB in 64 MiB chunks, fills
 * every chunk with its own pattern, then ROUNDS times runs a GPU burst (in each
 * chunk, a memset of that round's 1 MiB slice and a device-to-device copy of the
 * chunk's first MiB over its last, then a copy of the round's slice back to host
 * memory, checked) and a CPU phase of CPU_MS. At the end every byte of every chunk
 * is copied back and compared with the model. Usage:
 *   cudart_notebook MIB ROUNDS CPU_MS
 * Prints "pid <pid>", a line per round, then "OK". Exits 2 on a failed call (its
 * name printed), 3 on a wrong byte. With KIWI_TEST_GATE set it prints "READY" once
 * its memory is filled and waits for a line on stdin before its rounds (a start
 * gate: a test makes two of them overlap). With KIWI_TEST_MANAGED set its chunks
 * are managed memory (cudaMallocManaged). */
#include "cudart_common.h"

#include <unistd.h>

#define CHUNK (64u << 20)
#define SLICE (1u << 20)

/* Offset of the first wrong byte of chunk c (its contents in h) after `rounds`
 * rounds, or CHUNK: slices below `rounds` hold their round's value, the tail a
 * copy of the head (slice 0), the rest the chunk's pattern. */
static size_t check_chunk(const unsigned char *h, unsigned c, int rounds) {
    for (size_t at = 0; at < CHUNK; at += SLICE) {
        int r = (int)(at / SLICE);
        size_t bad;
        if (rounds > 0 && at == CHUNK - SLICE)
            bad = check_value(h + at, SLICE, (unsigned char)(c * 7 + 1));
        else if (r < rounds)
            bad = check_value(h + at, SLICE, (unsigned char)(c * 7 + r + 1));
        else {
            bad = SLICE;
            for (size_t i = 0; i < SLICE; i++)
                if (h[at + i] != pattern_byte(at + i, c)) {
                    bad = i;
                    break;
                }
        }
        if (bad != SLICE)
            return at + bad;
    }
    return CHUNK;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: cudart_notebook MIB ROUNDS CPU_MS\n");
        return 1;
    }
    size_t mib = strtoull(argv[1], NULL, 10);
    int rounds = atoi(argv[2]);
    int cpu_ms = atoi(argv[3]);
    unsigned chunks = (unsigned)((mib << 20) / CHUNK);
    int managed = getenv("KIWI_TEST_MANAGED") != NULL;
    ASSERT(chunks >= 1 && rounds >= 0 && rounds < 63);
    printf("pid %d\n", (int)getpid());
    fflush(stdout);

    unsigned char **d = calloc(chunks, sizeof *d);
    unsigned char *h = NULL;
    CHECK(cudaMallocHost((void **)&h, CHUNK));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (unsigned c = 0; c < chunks; c++) {
        if (managed)
            CHECK(cudaMallocManaged((void **)&d[c], CHUNK, cudaMemAttachGlobal));
        else
            CHECK(cudaMalloc((void **)&d[c], CHUNK));
        fill_pattern(h, CHUNK, c);
        CHECK(cudaMemcpy(d[c], h, CHUNK, cudaMemcpyHostToDevice));
    }
    if (getenv("KIWI_TEST_GATE")) {
        char line[16];
        puts("READY");
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin))
            return 1;
    }
    for (int r = 0; r < rounds; r++) {
        for (unsigned c = 0; c < chunks; c++) {
            CHECK(cudaMemsetAsync(d[c] + (size_t)r * SLICE, c * 7 + r + 1, SLICE, s));
            /* The head (slice 0) is final after round 0; the tail follows it. */
            CHECK(cudaMemcpyAsync(d[c] + CHUNK - SLICE, d[c], SLICE, cudaMemcpyDeviceToDevice, s));
        }
        for (unsigned c = 0; c < chunks; c++)
            CHECK(cudaMemcpyAsync(h + (size_t)c * 4096, d[c] + (size_t)r * SLICE, 4096,
                                  cudaMemcpyDeviceToHost, s));
        CHECK(cudaStreamSynchronize(s));
        for (unsigned c = 0; c < chunks; c++)
            ASSERT(check_value(h + (size_t)c * 4096, 4096, (unsigned char)(c * 7 + r + 1)) == 4096);
        printf("round %d\n", r);
        fflush(stdout);
        sleep_ms(cpu_ms);
    }
    for (unsigned c = 0; c < chunks; c++) {
        CHECK(cudaMemcpy(h, d[c], CHUNK, cudaMemcpyDeviceToHost));
        size_t bad = check_chunk(h, c, rounds);
        if (bad != CHUNK) {
            fprintf(stderr, "FAIL chunk %u byte %zu is %u\n", c, bad, h[bad]);
            return 3;
        }
        CHECK(cudaFree(d[c]));
    }
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFreeHost(h));
    free(d);
    puts("OK");
    return 0;
}
