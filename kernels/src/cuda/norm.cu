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

// ---- backward ---------------------------------------------------------
// Row kernels write or accumulate the input gradient from the saved rstd;
// the weight gradients are column sums over rows, taken by
// *_weight_grad kernels with a fixed order (deterministic, no atomics).

// dinp += rstd * dy' - inp * rstd^3 / c * sum(dy' * inp), dy' = dout * (1 + w).
extern "C" __global__ void rmsnorm_backward(float* dinp, const float* dout, const float* inp,
                                            const float* weight, const float* rstd, int n,
                                            int c) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n) return;
    const float* x = inp + (size_t)row * c;
    const float* dy = dout + (size_t)row * c;
    float* dx = dinp + (size_t)row * c;
    float r = rstd[row];
    float dot = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) dot += dy[i] * (1.0f + weight[i]) * x[i];
    dot = block_sum(dot, scratch);
    float k = r * r * r * dot / (float)c;
    for (int i = threadIdx.x; i < c; i += blockDim.x)
        dx[i] += r * dy[i] * (1.0f + weight[i]) - x[i] * k;
}

// dinp and dgate written (the gated output norm of the Gated DeltaNet).
extern "C" __global__ void gated_rmsnorm_backward(float* dinp, float* dgate, const float* dout,
                                                  const float* inp, const float* gate,
                                                  const float* weight, const float* rstd,
                                                  int n, int c) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n) return;
    size_t o = (size_t)row * c;
    const float *x = inp + o, *z = gate + o, *dy = dout + o;
    float r = rstd[row];
    float dot = 0.0f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        float s = sigmoidf(z[i]);
        float silu = z[i] * s;
        float dsilu = s * (1.0f + z[i] * (1.0f - s));
        dgate[o + i] = dy[i] * x[i] * r * weight[i] * dsilu;
        dot += dy[i] * weight[i] * silu * x[i];
    }
    dot = block_sum(dot, scratch);
    float k = r * r * r * dot / (float)c;
    for (int i = threadIdx.x; i < c; i += blockDim.x)
        dinp[o + i] = r * dy[i] * weight[i] * siluf(z[i]) - x[i] * k;
}

// Column sums over n rows, 32 columns per block, blockDim (32, 8): thread
// (tx, ty) sums rows ty, ty + 8, ..., then the 8 partials are added in a
// fixed order. term(row, col) is the kernel's own product.
#define COLUMN_SUM(TERM)                                                        \
    __shared__ float part[8][33];                                               \
    int col = blockIdx.x * 32 + threadIdx.x;                                    \
    float acc = 0.0f;                                                           \
    if (col < c)                                                                \
        for (int row = threadIdx.y; row < n; row += 8) acc += (TERM);           \
    part[threadIdx.y][threadIdx.x] = acc;                                       \
    __syncthreads();                                                            \
    if (threadIdx.y == 0 && col < c) {                                          \
        float s = part[0][threadIdx.x];                                         \
        for (int y = 1; y < 8; y++) s += part[y][threadIdx.x];                  \
        dweight[col] += s;                                                      \
    }

// dweight[c] += sum_rows dout * inp * rstd (the norms with 1 + w).
extern "C" __global__ void rmsnorm_weight_grad(float* dweight, const float* dout,
                                               const float* inp, const float* rstd, int n,
                                               int c) {
    COLUMN_SUM(dout[(size_t)row * c + col] * inp[(size_t)row * c + col] * rstd[row])
}

// dweight[c] += sum_rows dout * inp * rstd * silu(gate).
extern "C" __global__ void gated_rmsnorm_weight_grad(float* dweight, const float* dout,
                                                     const float* inp, const float* gate,
                                                     const float* rstd, int n, int c) {
    COLUMN_SUM(dout[(size_t)row * c + col] * inp[(size_t)row * c + col] * rstd[row] *
               siluf(gate[(size_t)row * c + col]))
}

// dinp = rnorm * dout - inp * rnorm^3 * (inp . dout), written.
extern "C" __global__ void l2norm_backward(float* dinp, const float* dout, const float* inp,
                                           const float* rnorm, int n, int d) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n) return;
    size_t o = (size_t)row * d;
    float r = rnorm[row];
    float dot = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dot += inp[o + i] * dout[o + i];
    dot = block_sum(dot, scratch);
    float k = r * r * r * dot;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dinp[o + i] = r * dout[o + i] - inp[o + i] * k;
}
