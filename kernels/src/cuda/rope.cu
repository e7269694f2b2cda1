// Per-head RMSNorm (q_norm / k_norm, weight as 1 + w) followed by partial
// rotate-half RoPE on the first rot_dim channels, in place on
// x[n, heads, head_dim]. One block per (token, head), blockDim.x a multiple
// of 32 (the loops stride over the channels). Angles in fp32 as the CPU computes
// them: inv_freq[i] = theta^(-2i / rot_dim), angle = position * inv_freq.
// CPU references: kernels/src/cpu/rmsnorm.rs, rope.rs.
// cos and sin of token position `pos` at pair i of the rotated channels:
// angle = pos * theta^(-2i / rot_dim), in fp32 as the CPU computes it.
__device__ __forceinline__ void rope_angle(float pos, int i, int rot_dim, float theta, float* c,
                                           float* sn) {
    float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)rot_dim);
    float angle = pos * inv_freq;
    *c = cosf(angle);
    *sn = sinf(angle);
}

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
        float c, sn;
        rope_angle(pos, i, rot_dim, theta, &c, &sn);
        float a = h[i], b = h[i + half];
        h[i] = a * c - b * sn;
        h[i + half] = b * c + a * sn;
    }
}

// Backward of qk_norm_rope_forward for x[n, heads, head_dim], one block per
// (token, head): the rotation by the opposite angle takes dout to dnormed
// (the gradient at the norm's output, written: the weight gradient is
// rmsnorm_weight_grad over it), then the RMSNorm backward from the saved
// rstd and the pre-norm input writes dinp. head_dim at most 512.
extern "C" __global__ void qk_norm_rope_backward(float* dinp, float* dnormed, const float* dout,
                                                 const float* inp, const float* weight,
                                                 const float* rstd, const u32* positions,
                                                 int n, int heads, int head_dim, int rot_dim,
                                                 float theta) {
    __shared__ float scratch[32];
    __shared__ float dy[512];
    int row = blockIdx.x;
    if (row >= n * heads) return;
    int t = row / heads;
    size_t o = (size_t)row * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) dy[i] = dout[o + i];
    __syncthreads();
    int half = rot_dim / 2;
    float pos = (float)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float c, sn;
        rope_angle(pos, i, rot_dim, theta, &c, &sn);
        float a = dy[i], b = dy[i + half];
        dy[i] = a * c + b * sn;
        dy[i + half] = b * c - a * sn;
    }
    __syncthreads();
    const float* x = inp + o;
    float r = rstd[row];
    float dot = 0.0f;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        dnormed[o + i] = dy[i];
        dot += dy[i] * (1.0f + weight[i]) * x[i];
    }
    dot = block_sum(dot, scratch);
    float k = r * r * r * dot / (float)head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x)
        dinp[o + i] = r * dy[i] * (1.0f + weight[i]) - x[i] * k;
}
