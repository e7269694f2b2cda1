// Threads stride over the grid (the launcher caps it at 65,535 blocks), so
// "one thread per (row, channel)" below names each thread's unit of work.

// The prefill kernels read a virtual input [state (K-1 rows); inp]: row r,
// channel ch of it.
__device__ __forceinline__ float conv_row(const float* st, const float* x, int r, int hist, int c,
                                          int ch) {
    return r < hist ? st[(size_t)r * c + ch] : x[(size_t)(r - hist) * c + ch];
}

// Output row ti, channel ch: sum_j w[j] * row(ti + j), w the channel's K taps.
__device__ __forceinline__ float conv_taps(const float* st, const float* x, const float* w,
                                           int ti, int k, int c, int ch) {
    float acc = 0.0f;
    for (int j = 0; j < k; j++) acc += w[j] * conv_row(st, x, ti + j, k - 1, c, ch);
    return acc;
}

// st <- the last K-1 rows of [st; x] (x of t rows), channel ch (K at most 8).
__device__ __forceinline__ void conv_advance(float* st, const float* x, int t, int hist, int c,
                                             int ch) {
    float keep[7];
    for (int j = 0; j < hist; j++) keep[j] = conv_row(st, x, t + j, hist, c, ch);
    for (int j = 0; j < hist; j++) st[(size_t)j * c + ch] = keep[j];
}

// Causal depthwise conv1d, one decode token per sequence, state addressed
// by slot: for sequence s (state slot slots[s]), with K-1 past inputs in
// state[slot, K-1, c]: out[s, c] = sum_j w[c, j] * x_j where x_0..x_{K-2}
// are the state rows and x_{K-1} = inp[s, c]; then the state shifts by one
// row and keeps inp. Pre-activation (SiLU is applied after). One thread per
// (sequence, channel). CPU reference: kernels/src/cpu/conv1d.rs.
extern "C" __global__ void conv1d_update(float* out, float* state, const float* inp,
                                         const float* weight, const u32* slots, int seqs,
                                         int c, int k) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)seqs * c;
         i += (long long)gridDim.x * blockDim.x) {
        int s = (int)(i / c), ch = (int)(i % c);
        float* st = state + (size_t)slots[s] * (k - 1) * c;
        const float* w = weight + (size_t)ch * k;
        float x = inp[i];
        float acc = 0.0f;
        for (int j = 0; j < k - 1; j++) acc += w[j] * st[(size_t)j * c + ch];
        acc += w[k - 1] * x;
        for (int j = 0; j + 1 < k - 1; j++)
            st[(size_t)j * c + ch] = st[(size_t)(j + 1) * c + ch];
        if (k > 1) st[(size_t)(k - 2) * c + ch] = x;
        out[i] = acc;
    }
}

// Prefill of one sequence: out[t, c] = sum_j w[c, j] * v[ti + j, c] over the
// virtual input v = [state (K-1 rows); inp (t rows)]. One thread per
// (token, channel). The state is then advanced by conv1d_state_advance.
extern "C" __global__ void conv1d_forward(float* out, const float* state, const float* inp,
                                          const float* weight, int t, int c, int k) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)t * c;
         i += (long long)gridDim.x * blockDim.x) {
        int ti = (int)(i / c), ch = (int)(i % c);
        out[i] = conv_taps(state, inp, weight + (size_t)ch * k, ti, k, c, ch);
    }
}

// state <- the last K-1 rows of [state; inp], one thread per channel (K at
// most 8).
extern "C" __global__ void conv1d_state_advance(float* state, const float* inp, int t, int c,
                                                int k) {
    if (k < 2) return;
    for (int ch = blockIdx.x * blockDim.x + threadIdx.x; ch < c; ch += gridDim.x * blockDim.x)
        conv_advance(state, inp, t, k - 1, c, ch);
}

// Prefill of packed sequences, each continuing the conv history in its
// state slot: row i belongs to sequence s = token_seq[i], whose rows start
// at cu_seqlens[s]; its output reads the virtual input [state[slots[s]]
// (K-1 rows); the sequence's rows] as conv1d_forward does for one. One
// thread per (row, channel); the states advance after, in
// conv1d_varlen_state_advance.
extern "C" __global__ void conv1d_varlen_forward(float* out, const float* state,
                                                 const float* inp, const float* weight,
                                                 const u32* slots, const u32* cu_seqlens,
                                                 const u32* token_seq, int t, int c, int k) {
    int hist = k - 1;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)t * c;
         i += (long long)gridDim.x * blockDim.x) {
        int row = (int)(i / c), ch = (int)(i % c);
        int s = (int)token_seq[row];
        int start = (int)cu_seqlens[s];
        int ti = row - start;
        const float* st = state + (size_t)slots[s] * hist * c;
        out[i] = conv_taps(st, inp + (size_t)start * c, weight + (size_t)ch * k, ti, k, c, ch);
    }
}

// Each sequence's state slot <- the last K-1 rows of [state; its rows], one
// thread per (sequence, channel) (K at most 8).
extern "C" __global__ void conv1d_varlen_state_advance(float* state, const float* inp,
                                                       const u32* slots,
                                                       const u32* cu_seqlens, int seqs, int c,
                                                       int k) {
    if (k < 2) return;
    int hist = k - 1;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)seqs * c;
         i += (long long)gridDim.x * blockDim.x) {
        int s = (int)(i / c), ch = (int)(i % c);
        int start = (int)cu_seqlens[s], t = (int)cu_seqlens[s + 1] - start;
        float* st = state + (size_t)slots[s] * hist * c;
        conv_advance(st, inp + (size_t)start * c, t, hist, c, ch);
    }
}

// Backward, input side: the gradient of the virtual input row r is
// dv[r, c] = sum_j w[c, j] * dout[r - j, c] over 0 <= r - j < t. Rows
// r >= K-1 go to dinp (written), rows below to dstate0 (written, when not
// null). One thread per (row, channel).
extern "C" __global__ void conv1d_backward_input(float* dinp, float* dstate0, const float* dout,
                                                 const float* weight, int t, int c, int k) {
    int hist = k - 1;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
         i < (long long)(t + hist) * c; i += (long long)gridDim.x * blockDim.x) {
        int r = (int)(i / c), ch = (int)(i % c);
        const float* w = weight + (size_t)ch * k;
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            int ti = r - j;
            if (ti >= 0 && ti < t) acc += w[j] * dout[(size_t)ti * c + ch];
        }
        if (r >= hist) dinp[(size_t)(r - hist) * c + ch] = acc;
        else if (dstate0) dstate0[(size_t)r * c + ch] = acc;
    }
}

// Backward, weight side: dweight[c, j] += sum_ti dout[ti, c] * v[ti + j, c],
// one block per channel, a block sum per tap (fixed order).
extern "C" __global__ void conv1d_backward_weight(float* dweight, const float* dout,
                                                  const float* state0, const float* inp, int t,
                                                  int c, int k) {
    __shared__ float scratch[32];
    int ch = blockIdx.x;
    if (ch >= c) return;
    int hist = k - 1;
    for (int j = 0; j < k; j++) {
        float acc = 0.0f;
        for (int ti = threadIdx.x; ti < t; ti += blockDim.x)
            acc += dout[(size_t)ti * c + ch] * conv_row(state0, inp, ti + j, hist, c, ch);
        acc = block_sum(acc, scratch);
        if (threadIdx.x == 0) dweight[(size_t)ch * k + j] += acc;
    }
}
