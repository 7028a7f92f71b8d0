// The `std` kernel library, CUDA side (docs/guest-abi.md, section 6). gemm_f32 runs through
// cuBLAS instead (faster); the host dispatches it. Every kernel uses a grid-stride loop over a
// linear thread index, so it is correct for any n >= 0 and any launch shape, including the usual
// one-thread-per-element shape with the grid rounded up.

#define TW_TID() \
    (((long long)blockIdx.z * gridDim.y * gridDim.x + (long long)blockIdx.y * gridDim.x + blockIdx.x) \
         * ((long long)blockDim.x * blockDim.y * blockDim.z) \
     + ((long long)threadIdx.z * blockDim.y * blockDim.x + (long long)threadIdx.y * blockDim.x + threadIdx.x))
#define TW_NTHREADS() \
    ((long long)gridDim.x * gridDim.y * gridDim.z * blockDim.x * blockDim.y * blockDim.z)

extern "C" __global__ void vector_add_f32(const float* a, const float* b, float* out, int n) {
    for (long long i = TW_TID(); i < n; i += TW_NTHREADS()) out[i] = a[i] + b[i];
}

extern "C" __global__ void saxpy_f32(float alpha, const float* x, float* y, int n) {
    for (long long i = TW_TID(); i < n; i += TW_NTHREADS()) y[i] = alpha * x[i] + y[i];
}

extern "C" __global__ void scale_f32(float* x, float alpha, int n) {
    for (long long i = TW_TID(); i < n; i += TW_NTHREADS()) x[i] = alpha * x[i];
}

extern "C" __global__ void relu_f32(const float* x, float* out, int n) {
    for (long long i = TW_TID(); i < n; i += TW_NTHREADS()) out[i] = fmaxf(x[i], 0.0f);
}

extern "C" __global__ void sum_f32(const float* x, float* out, int n) {
    __shared__ float partial[1024];
    const int t = threadIdx.z * blockDim.y * blockDim.x + threadIdx.y * blockDim.x + threadIdx.x;
    const int nt = blockDim.x * blockDim.y * blockDim.z;
    float acc = 0.0f;
    for (long long i = TW_TID(); i < n; i += TW_NTHREADS()) acc += x[i];
    partial[t] = acc;
    __syncthreads();
    // tree reduction that is correct for any block size, not only powers of two
    for (int stride = 1; stride < nt; stride *= 2) {
        if (t % (2 * stride) == 0 && t + stride < nt) partial[t] += partial[t + stride];
        __syncthreads();
    }
    if (t == 0 && partial[0] != 0.0f) atomicAdd(out, partial[0]);
}

// One thread per row (grid-stride over rows): numerically stable (max subtracted first).
extern "C" __global__ void softmax_rows_f32(const float* x, float* out, int rows, int cols) {
    for (long long r = TW_TID(); r < rows; r += TW_NTHREADS()) {
        const float* row = x + r * (long long)cols;
        float* dst = out + r * (long long)cols;
        float m = __int_as_float(0xff800000);  // -inf (NVRTC has no <cmath>)
        for (int c = 0; c < cols; ++c) m = fmaxf(m, row[c]);
        float s = 0.0f;
        for (int c = 0; c < cols; ++c) { float e = __expf(row[c] - m); dst[c] = e; s += e; }
        const float inv = 1.0f / s;
        for (int c = 0; c < cols; ++c) dst[c] *= inv;
    }
}
