// The AdamW step on the device, element-wise, in the order of the CPU
// reference (kernels/src/cpu/adamw.rs): decay, moments, update. The step's
// scalars come from the host (AdamWStep, computed in f64 once). The master
// weights stay fp32; when `out_bf16` is not null the updated weight is also
// written there, rounded to bf16 (the copy the engine reads), in the same
// pass.
extern "C" __global__ void adamw_update(float* param, float* exp_avg, float* exp_avg_sq,
                                        bf16_t* out_bf16, const float* grad, long long n,
                                        float decay, float step_size, float b1w, float beta2,
                                        float b2w, float bc2_sqrt, float eps) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float p = param[i] * decay;
        float g = grad[i];
        float m = exp_avg[i];
        m += b1w * (g - m);
        float v = exp_avg_sq[i] * beta2 + b2w * g * g;
        float denom = sqrtf(v) / bc2_sqrt + eps;
        p -= step_size * (m / denom);
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if (out_bf16) out_bf16[i] = f32_to_bf16(p);
    }
}

// Multiplies every element by `s` (gradient clipping by the global norm).
extern "C" __global__ void scale_f32(float* x, long long n, float s) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] *= s;
}

// Partial sums of squares for the global norm: block b writes
// partial[b] = sum over its grid-stride elements of x^2 (in f32; the host
// adds the partials in f64 in order).
extern "C" __global__ void sum_squares_partial(float* partial, const float* x, long long n) {
    __shared__ float scratch[32];
    float acc = 0.0f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        acc += x[i] * x[i];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}
