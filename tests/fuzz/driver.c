/* Plain driver for the fuzz target (no libFuzzer needed; gcc + ASan/UBSan).
 *
 *   fuzz_kernels FILE...     runs the target once per file (reproduce a
 *                            crash or replay a corpus)
 *   fuzz_kernels             runs COMERA_FUZZ_ITERS (default 20000) inputs
 *                            from a deterministic generator seeded with
 *                            COMERA_FUZZ_SEED (default 1), stopping early
 *                            after COMERA_FUZZ_SECONDS (default 60)
 *
 * Inputs are random byte strings of random length, half of them mutations
 * (a few bytes changed or cut) of the previous input, so nearby cases of an
 * interesting input get explored too.  On failure the target aborts; the
 * driver writes the input being run to fuzz-crash.bin first (set
 * COMERA_FUZZ_CRASH to change the name) so it can be replayed. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fuzz_alloc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint64_t rng;
static uint64_t next(void) { /* splitmix64 */
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static long env_long(const char *name, long dflt) {
    const char *s = getenv(name);
    return s && *s ? strtol(s, NULL, 10) : dflt;
}

static void save_input(const uint8_t *buf, size_t n) {
    const char *name = getenv("COMERA_FUZZ_CRASH");
    FILE *f = fopen(name && *name ? name : "fuzz-crash.bin", "wb");
    if (!f) return;
    fwrite(buf, 1, n, f);
    fclose(f);
}

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fuzz_kernels: cannot open %s\n", path);
        return 1;
    }
    static uint8_t buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    LLVMFuzzerTestOneInput(buf, n);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1) {
        int bad = 0;
        for (int i = 1; i < argc; i++) bad |= run_file(argv[i]);
        printf("fuzz_kernels: ran %d file(s)\n", argc - 1);
        return bad;
    }
    long iters = env_long("COMERA_FUZZ_ITERS", 20000);
    long seconds = env_long("COMERA_FUZZ_SECONDS", 60);
    rng = (uint64_t)env_long("COMERA_FUZZ_SEED", 1);
    enum { MAXLEN = 4096 };
    static uint8_t buf[MAXLEN];
    size_t len = 0;
    time_t start = time(NULL);
    long i;
    for (i = 0; i < iters; i++) {
        if (i % 256 == 0 && seconds > 0 && time(NULL) - start >= seconds) break;
        if (i == 0 || next() % 2) { /* fresh input */
            len = (size_t)(next() % MAXLEN);
            for (size_t k = 0; k < len; k++) buf[k] = (uint8_t)next();
        } else { /* mutate the previous one */
            int edits = 1 + (int)(next() % 4);
            for (int e = 0; e < edits && len > 0; e++) buf[next() % len] = (uint8_t)next();
            if (next() % 8 == 0 && len > 0) len = (size_t)(next() % len);
        }
        save_input(buf, len);
        LLVMFuzzerTestOneInput(buf, len);
    }
    printf("fuzz_kernels: %ld inputs in %lds, no failure (linear: %ld rejected, %ld run; "
           "embedding: %ld rejected, %ld run; gate_prox: %ld)\n",
           i, (long)(time(NULL) - start), comera_fuzz_stats[0], comera_fuzz_stats[1],
           comera_fuzz_stats[2], comera_fuzz_stats[3], comera_fuzz_stats[4]);
    remove(getenv("COMERA_FUZZ_CRASH") && *getenv("COMERA_FUZZ_CRASH") ? getenv("COMERA_FUZZ_CRASH")
                                                                       : "fuzz-crash.bin");
    return 0;
}
