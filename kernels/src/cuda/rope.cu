// Per-head RMSNorm (q_norm / k_norm, weight as 1 + w) followed by partial
// rotate-half RoPE on the first rot_dim channels, in place on
// x[n, heads, head_dim]. One block per (token, head), blockDim.x a multiple
// of 32 and >= head_dim / 2. Angles in fp32 as the CPU reference computes
// them: inv_freq[i] = theta^(-2i / rot_dim), angle = position * inv_freq.
// CPU references: kernels/src/cpu/rmsnorm.rs, rope.rs.
extern "C" __global__ void qk_norm_rope_forward(float* x, float* rstd, const float* weight,
                                                const u32* positions, int n, int heads,
                                                int head_dim, int rot_dim, float theta,
                                                float eps) {
    __shared__ float scratch[32];
    int row = blockIdx.x;
    if (row >= n * heads) return;
    int t = row / heads;
    float* h = x + (size_t)row * head_dim;
    float s = row_rsqrt(h, head_dim, (float)head_dim, eps, scratch);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) h[i] = h[i] * s * (1.0f + weight[i]);
    if (threadIdx.x == 0) rstd[row] = s;
    __syncthreads();
    int half = rot_dim / 2;
    float pos = (float)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)rot_dim);
        float angle = pos * inv_freq;
        float c = cosf(angle), sn = sinf(angle);
        float a = h[i], b = h[i + half];
        h[i] = a * c - b * sn;
        h[i + half] = b * c + a * sn;
    }
}
