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
    int n = t * nv;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int h = i % nv;
        g[i] = -expf(a_log[h]) * softplusf(a[i] + dt_bias[h]);
        beta[i] = sigmoidf(b[i]);
    }
}
