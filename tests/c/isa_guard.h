/* Each C test binary runs once per micro-kernel variant (make test loops
 * COMERA_ISA over them).  This guard makes sure the variant asked for is the
 * one that runs, so three runs never silently test the same code, and skips
 * a variant this CPU cannot execute (saying so). */
#ifndef COMERA_TEST_ISA_GUARD_H
#define COMERA_TEST_ISA_GUARD_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/gemm.h"

/* 0: run the tests; 1: skip (exit 0); -1: fail (exit 1). */
static int isa_guard(const char *binary) {
    const char *want = getenv("COMERA_ISA");
    if (!want || !*want || strcmp(want, "auto") == 0) {
        printf("%s: micro-kernel variant %s (automatic)\n", binary, comera_gemm_variant_name());
        return 0;
    }
    if (!comera_gemm_isa_available(want)) {
        printf("%s: SKIPPED COMERA_ISA=%s: this CPU cannot run it (or it is not built)\n",
               binary, want);
        return 1;
    }
    if (strcmp(want, comera_gemm_variant_name()) != 0) {
        printf("%s: FAIL: COMERA_ISA=%s but variant %s runs\n", binary, want,
               comera_gemm_variant_name());
        return -1;
    }
    printf("%s: micro-kernel variant %s (forced)\n", binary, want);
    return 0;
}

#endif
