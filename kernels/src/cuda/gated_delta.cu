// The gated delta rule for decode: one token per sequence, fp32 state
// addressed by slot (state[slot, nv, dk, dv]). One block per (sequence,
// value head); thread j owns column j of S (dk x dv), so every access
// S[i, j] is coalesced across the warp. Per the recurrence
// (kernels/src/cpu/gated_delta.rs, the reference):
//   S = exp(g) S;  delta = beta (v - S^T k);  S = S + k delta^T;  o = S^T q.
// q, k: [seqs, nk, dk] (q already L2-normalized and scaled); v, out:
// [seqs, nv, dv]; g, beta: [seqs, nv]. Value head h reads key head
// h / (nv / nk). k and q are staged in shared memory (dynamic, 2 * dk floats).
// One token of the recurrence for column j of S (dk x dv, row stride dv):
// decay, delta against the decayed state, rank-one update, output. q and k
// are in shared memory (qk[0..dk) and qk[dk..2dk)); returns o_j.
__device__ __forceinline__ float gd_column_step(float* S, const float* qk, float decay, float b,
                                                float v_j, int j, int dk, int dv) {
    float kv = 0.0f;
    for (int i = 0; i < dk; i++) {
        float x = S[(size_t)i * dv + j] * decay;
        S[(size_t)i * dv + j] = x;
        kv += x * qk[dk + i];
    }
    float delta = b * (v_j - kv);
    float o = 0.0f;
    for (int i = 0; i < dk; i++) {
        float x = S[(size_t)i * dv + j] + qk[dk + i] * delta;
        S[(size_t)i * dv + j] = x;
        o += x * qk[i];
    }
    return o;
}

extern "C" __global__ void gated_delta_decode(float* out, float* state, const float* q,
                                              const float* k, const float* v, const float* g,
                                              const float* beta, const u32* slots, int seqs,
                                              int nk, int nv, int dk, int dv) {
    extern __shared__ float qk[];
    int s = blockIdx.x / nv, h = blockIdx.x % nv;
    if (s >= seqs) return;
    int kh = h / (nv / nk);
    const float* qs = q + ((size_t)s * nk + kh) * dk;
    const float* ks = k + ((size_t)s * nk + kh) * dk;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        qk[i] = qs[i];
        qk[dk + i] = ks[i];
    }
    __syncthreads();
    float decay = expf(g[s * nv + h]);
    float b = beta[s * nv + h];
    float* S = state + ((size_t)slots[s] * nv + h) * dk * dv;
    for (int j = threadIdx.x; j < dv; j += blockDim.x) {
        size_t at = ((size_t)s * nv + h) * dv + j;
        out[at] = gd_column_step(S, qk, decay, b, v[at], j, dk, dv);
    }
}

// Prefill, token by token over packed sequences (the recurrent form; the
// chunked WY form is the faster path still to come): sequence s owns tokens
// cu_seqlens[s] .. cu_seqlens[s + 1] and the state at slots[s]. One block
// per (sequence, value head), thread j owns column j of S, as in decode.
// Layouts as in decode with a token axis: q, k [T, nk, dk], v, out
// [T, nv, dv], g, beta [T, nv].
extern "C" __global__ void gated_delta_prefill(float* out, float* state, const float* q,
                                               const float* k, const float* v, const float* g,
                                               const float* beta, const u32* slots,
                                               const u32* cu_seqlens, int seqs, int nk, int nv,
                                               int dk, int dv) {
    extern __shared__ float qk[];
    int s = blockIdx.x / nv, h = blockIdx.x % nv;
    if (s >= seqs) return;
    int kh = h / (nv / nk);
    float* S = state + ((size_t)slots[s] * nv + h) * dk * dv;
    for (int t = (int)cu_seqlens[s]; t < (int)cu_seqlens[s + 1]; t++) {
        const float* qs = q + ((size_t)t * nk + kh) * dk;
        const float* ks = k + ((size_t)t * nk + kh) * dk;
        __syncthreads();
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qk[i] = qs[i];
            qk[dk + i] = ks[i];
        }
        __syncthreads();
        float decay = expf(g[(size_t)t * nv + h]);
        float b = beta[(size_t)t * nv + h];
        for (int j = threadIdx.x; j < dv; j += blockDim.x) {
            size_t at = ((size_t)t * nv + h) * dv + j;
            out[at] = gd_column_step(S, qk, decay, b, v[at], j, dk, dv);
        }
    }
}
