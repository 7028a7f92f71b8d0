/* Example GPU guest: compiles its own CUDA kernel at run time and runs it.
 * stdin: n float32 values; stdout: each value squared plus 1. Needs a GPU worker
 * (a CPU worker answers module_load with TW_UNAVAILABLE, reported as exit code 3).
 */
#include <stdio.h>
#include <stdlib.h>
#include "tensorwasm.h"

static const char SRC[] =
    "extern \"C\" __global__ void square_plus_one(const float* x, float* y, int n) {\n"
    "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "    if (i < n) y[i] = x[i] * x[i] + 1.0f;\n"
    "}\n";

int main(void) {
    static float buf[1 << 18];
    size_t n = fread(buf, sizeof(float), sizeof buf / sizeof buf[0], stdin);
    if (n == 0) return 0;
    int32_t mod = tw_module_load(SRC, sizeof SRC - 1, TW_FORMAT_CUDA);
    if (mod == TW_UNAVAILABLE) { fprintf(stderr, "no GPU on this worker\n"); return 3; }
    if (mod < 0) { char m[1024] = {0}; tw_last_error(m, sizeof m - 1); fprintf(stderr, "module_load: %s\n", m); return 1; }
    int32_t fn = tw_function_get_str(mod, "square_plus_one");
    int32_t X = tw_buffer_alloc((int64_t)n * 4), Y = tw_buffer_alloc((int64_t)n * 4);
    if (fn < 0 || X < 0 || Y < 0) return 2;
    tw_buffer_write(X, 0, buf, (int32_t)(n * 4));
    tw_args a;
    tw_args_init(&a);
    tw_arg_buffer(&a, X, 0);
    tw_arg_buffer(&a, Y, 0);
    tw_arg_i32(&a, (int32_t)n);
    if (tw_launch_args(fn, tw_blocks_for((int64_t)n, 128), 1, 1, 128, 1, 1, 0, &a) < 0) return 4;
    if (tw_synchronize() < 0) return 5;
    tw_buffer_read(Y, 0, buf, (int32_t)(n * 4));
    fwrite(buf, sizeof(float), n, stdout);
    return 0;
}
