// Causal depthwise conv1d, one decode token per sequence, state addressed
// by slot: for sequence s (state slot slots[s]), with K-1 past inputs in
// state[slot, K-1, c]: out[s, c] = sum_j w[c, j] * x_j where x_0..x_{K-2}
// are the state rows and x_{K-1} = inp[s, c]; then the state shifts by one
// row and keeps inp. Pre-activation (SiLU is applied after). One thread per
// (sequence, channel). CPU reference: kernels/src/cpu/conv1d.rs.
extern "C" __global__ void conv1d_update(float* out, float* state, const float* inp,
                                         const float* weight, const u32* slots, int seqs,
                                         int c, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= seqs * c) return;
    int s = i / c, ch = i % c;
    float* st = state + (size_t)slots[s] * (k - 1) * c;
    const float* w = weight + (size_t)ch * k;
    float x = inp[i];
    float acc = 0.0f;
    for (int j = 0; j < k - 1; j++) acc += w[j] * st[(size_t)j * c + ch];
    acc += w[k - 1] * x;
    for (int j = 0; j + 1 < k - 1; j++) st[(size_t)j * c + ch] = st[(size_t)(j + 1) * c + ch];
    if (k > 1) st[(size_t)(k - 2) * c + ch] = x;
    out[i] = acc;
}
