/* Example GPU guest: adds two float32 vectors with the platform's std library.
 * stdin: a then b, each n float32 values (so the body has 8*n bytes); stdout: a + b (4*n bytes).
 * Runs on GPU workers (CUDA) and CPU workers (NumPy) alike.
 */
#include <stdio.h>
#include <stdlib.h>
#include "tensorwasm.h"

static int fail(const char *what, int32_t code) {
    char msg[1024];
    int32_t n = tw_last_error(msg, sizeof msg - 1);
    msg[n < 0 ? 0 : (n < (int32_t)sizeof msg - 1 ? n : (int32_t)sizeof msg - 1)] = 0;
    fprintf(stderr, "%s failed (%d): %s\n", what, code, msg);
    return 1;
}

int main(void) {
    size_t cap = 1 << 20, len = 0;
    unsigned char *in = malloc(cap);
    size_t got;
    while ((got = fread(in + len, 1, cap - len, stdin)) > 0) {
        len += got;
        if (len == cap) in = realloc(in, cap *= 2);
    }
    int32_t n = (int32_t)(len / 8);
    if (n == 0) return 0;
    int64_t bytes = (int64_t)n * 4;

    int32_t A = tw_buffer_alloc(bytes), B = tw_buffer_alloc(bytes), C = tw_buffer_alloc(bytes);
    if (A < 0) return fail("buffer_alloc", A);
    if (B < 0) return fail("buffer_alloc", B);
    if (C < 0) return fail("buffer_alloc", C);
    int32_t rc;
    if ((rc = tw_buffer_write(A, 0, in, (int32_t)bytes)) < 0) return fail("buffer_write", rc);
    if ((rc = tw_buffer_write(B, 0, in + bytes, (int32_t)bytes)) < 0) return fail("buffer_write", rc);

    int32_t std = tw_module_get_str("std");
    if (std < 0) return fail("module_get", std);
    int32_t fn = tw_function_get_str(std, "vector_add_f32");
    if (fn < 0) return fail("function_get", fn);

    tw_args args;
    tw_args_init(&args);
    tw_arg_buffer(&args, A, 0);
    tw_arg_buffer(&args, B, 0);
    tw_arg_buffer(&args, C, 0);
    tw_arg_i32(&args, n);
    if ((rc = tw_launch_args(fn, tw_blocks_for(n, 256), 1, 1, 256, 1, 1, 0, &args)) < 0) return fail("launch", rc);
    if ((rc = tw_buffer_read(C, 0, in, (int32_t)bytes)) < 0) return fail("buffer_read", rc);
    fwrite(in, 1, (size_t)bytes, stdout);
    return 0;
}
