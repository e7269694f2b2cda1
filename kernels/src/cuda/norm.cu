// Row norms, one block per row (blockDim.x a multiple of 32). CPU
// references: kernels/src/cpu/rmsnorm.rs and l2norm.rs.

// out[n, c] = inp * rstd * (1 + weight); rstd[n] saved for the backward.
extern "C" __global__ void rmsnorm_forward(float* out, float* rstd, const float* inp,
                                           const float* weight, int n, int c, float eps) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n) return;
    const float* x = inp + (size_t)row * c;
    float* y = out + (size_t)row * c;
    float s = row_rsqrt(x, c, (float)c, eps, scratch);
    for (int i = threadIdx.x; i < c; i += blockDim.x) y[i] = x[i] * s * (1.0f + weight[i]);
    if (threadIdx.x == 0) rstd[row] = s;
}

// The residual add fused in front of the norm: res[n, c] += inp, then
// out = rmsnorm(res). Saves one pass over the residual stream per layer.
extern "C" __global__ void add_rmsnorm_forward(float* out, float* rstd, float* res,
                                               const float* inp, const float* weight,
                                               int n, int c, float eps) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n) return;
    float* r = res + (size_t)row * c;
    const float* x = inp + (size_t)row * c;
    float* y = out + (size_t)row * c;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        float v = r[i] + x[i];
        r[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    float s = rsqrtf(ss / (float)c + eps);
    for (int i = threadIdx.x; i < c; i += blockDim.x) y[i] = r[i] * s * (1.0f + weight[i]);
    if (threadIdx.x == 0) rstd[row] = s;
}

// out[n, c] = inp * rstd * weight * silu(gate) (the Gated DeltaNet output
// norm: plain weight, starts at 1).
extern "C" __global__ void gated_rmsnorm_forward(float* out, float* rstd, const float* inp,
                                                 const float* gate, const float* weight,
                                                 int n, int c, float eps) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n) return;
    const float* x = inp + (size_t)row * c;
    const float* z = gate + (size_t)row * c;
    float* y = out + (size_t)row * c;
    float s = row_rsqrt(x, c, (float)c, eps, scratch);
    for (int i = threadIdx.x; i < c; i += blockDim.x) y[i] = x[i] * s * weight[i] * siluf(z[i]);
    if (threadIdx.x == 0) rstd[row] = s;
}

// out[n, d] = inp * rsqrt(sum inp^2 + eps) * scale; rnorm[n] saved.
extern "C" __global__ void l2norm_forward(float* out, float* rnorm, const float* inp, int n,
                                          int d, float eps, float scale) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n) return;
    const float* x = inp + (size_t)row * d;
    float* y = out + (size_t)row * d;
    float s = row_rsqrt(x, d, 1.0f, eps, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) y[i] = x[i] * s * scale;
    if (threadIdx.x == 0) rnorm[row] = s;
}
