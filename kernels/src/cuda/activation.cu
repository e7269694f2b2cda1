// Elementwise ops, grid-stride loops. CPU references:
// kernels/src/cpu/activation.rs.

// out = silu(gate) * up
extern "C" __global__ void silu_mul_forward(float* out, const float* gate, const float* up,
                                            long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = siluf(gate[i]) * up[i];
}

// x *= sigmoid(gate), in place (full attention's output gate).
extern "C" __global__ void sigmoid_gate_forward(float* x, const float* gate, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] *= sigmoidf(gate[i]);
}

// In place SiLU (after the causal conv).
extern "C" __global__ void silu_forward(float* x, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] = siluf(x[i]);
}

// Gated DeltaNet gating over [t, nv]: g = -exp(a_log[h]) * softplus(a + dt_bias[h]),
// beta = sigmoid(b).
extern "C" __global__ void gated_delta_gating_forward(float* g, float* beta, const float* a,
                                                      const float* b, const float* a_log,
                                                      const float* dt_bias, int t, int nv) {
    long long n = (long long)t * nv;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int h = (int)(i % nv);
        g[i] = -expf(a_log[h]) * softplusf(a[i] + dt_bias[h]);
        beta[i] = sigmoidf(b[i]);
    }
}

// ---- backward ---------------------------------------------------------

__device__ __forceinline__ float silu_gradf(float x) {
    float s = sigmoidf(x);
    return s * (1.0f + x * (1.0f - s));
}

// dinp = dout * silu'(inp), written.
extern "C" __global__ void silu_backward(float* dinp, const float* dout, const float* inp,
                                         long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dinp[i] = dout[i] * silu_gradf(inp[i]);
}

// dgate = dout * up * silu'(gate), dup = dout * silu(gate), written.
extern "C" __global__ void silu_mul_backward(float* dgate, float* dup, const float* dout,
                                             const float* gate, const float* up, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dgate[i] = dout[i] * up[i] * silu_gradf(gate[i]);
        dup[i] = dout[i] * siluf(gate[i]);
    }
}

// dx = dout * sigmoid(gate), dgate = dout * x * s * (1 - s), written (x is
// the output before gating).
extern "C" __global__ void sigmoid_gate_backward(float* dx, float* dgate, const float* dout,
                                                 const float* x, const float* gate, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float s = sigmoidf(gate[i]);
        dx[i] = dout[i] * s;
        dgate[i] = dout[i] * x[i] * s * (1.0f - s);
    }
}

// The gating's input gradients over [t, nv], written:
// db = dbeta * beta * (1 - beta), da = dg * -exp(a_log[h]) * softplus'(a + dt_bias[h]).
extern "C" __global__ void gated_delta_gating_backward(float* da, float* db, const float* dg,
                                                       const float* dbeta, const float* beta,
                                                       const float* a, const float* a_log,
                                                       const float* dt_bias, int t, int nv) {
    long long n = (long long)t * nv;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int h = (int)(i % nv);
        float be = beta[i];
        db[i] = dbeta[i] * be * (1.0f - be);
        float x = a[i] + dt_bias[h];
        float sp_grad = x > 20.0f ? 1.0f : sigmoidf(x);
        da[i] = dg[i] * -expf(a_log[h]) * sp_grad;
    }
}

// The per-head parameter gradients, one block per head, accumulated:
// da_log[h] += sum_t dg * g, ddt_bias[h] += sum_t da (a block sum: fixed order).
extern "C" __global__ void gated_delta_gating_param_grad(float* da_log, float* ddt_bias,
                                                         const float* dg, const float* g,
                                                         const float* da, int t, int nv) {
    __shared__ float scratch[32];
    int h = blockIdx.x;
    if (h >= nv) return;
    float s1 = 0.0f, s2 = 0.0f;
    for (int ti = threadIdx.x; ti < t; ti += blockDim.x) {
        size_t i = (size_t)ti * nv + h;
        s1 += dg[i] * g[i];
        s2 += da[i];
    }
    s1 = block_sum(s1, scratch);
    s2 = block_sum(s2, scratch);
    if (threadIdx.x == 0) {
        da_log[h] += s1;
        ddt_bias[h] += s2;
    }
}

// x += y (a residual add).
extern "C" __global__ void add_assign(float* x, const float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

// out[r, c] = inp[row0 + r, col0 + c] for r < rows, c < cols, inp rows of
// in_width: a block of a row-major matrix (a column range of every row, as
// the q/k/v split; or a range of rows).
extern "C" __global__ void copy_block(float* out, const float* inp, long long in_width,
                                      long long row0, long long col0, long long rows,
                                      long long cols) {
    long long n = rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / cols, c = i - r * cols;
        out[i] = inp[(row0 + r) * in_width + col0 + c];
    }
}

// buf[dst + i] = buf[src + i] for i < n, ranges that do not overlap (one
// state slot or K/V block of a pool into another).
extern "C" __global__ void copy_within(float* buf, long long src, long long dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        buf[dst + i] = buf[src + i];
}

// buf[off + i] = 0 for i < n (a state slot handed to a fresh sequence).
extern "C" __global__ void zero_range(float* buf, long long off, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        buf[off + i] = 0.0f;
}

// out[i, c] = inp[rows[i], c] for i < n, c < width: chosen rows of a
// matrix, gathered (the rows a step samples from).
extern "C" __global__ void gather_rows(float* out, const float* inp, const u32* rows,
                                       long long n, long long width) {
    long long total = n * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / width, c = i - r * width;
        out[i] = inp[(long long)rows[r] * width + c];
    }
}

// out[(row0 + r) * out_width + col0 + c] = inp[r * cols + c]: a block
// written into a larger row-major matrix (columns joined side by side, or
// one sequence's rows put back in a packed batch); copy_block's inverse.
extern "C" __global__ void copy_into(float* out, const float* inp, long long out_width,
                                     long long row0, long long col0, long long rows,
                                     long long cols) {
    long long n = rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / cols, c = i - r * cols;
        out[(row0 + r) * out_width + col0 + c] = inp[i];
    }
}

// out[rows[i], c] = inp[i, c] for i < n, c < width: gather_rows' inverse
// (rows distinct; the others of out untouched).
extern "C" __global__ void scatter_rows(float* out, const float* inp, const u32* rows,
                                        long long n, long long width) {
    long long total = n * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / width, c = i - r * width;
        out[(long long)rows[r] * width + c] = inp[i];
    }
}
