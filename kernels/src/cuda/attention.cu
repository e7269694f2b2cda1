// Causal grouped-query attention, softmax in fp32, for decode over a paged
// K/V cache and for variable-length prefill over contiguous K/V. Query head
// h reads K/V head h / (n_heads / n_kv_heads); head_dim at most 256. The
// sigmoid output gate is applied by the caller (sigmoid_gate_forward), as
// on the CPU (kernels/src/cpu/attention.rs, the reference).
//
// One block per (query token, head), a few warps; warp w takes keys w,
// w + warps, ... with an online softmax (running max m, sum l, and the
// weighted value sum in registers: lane i holds dims i, i + 32, ...), and
// the warps' partial results are merged through shared memory at the end.

#define ATTN_MAX_DIM_PER_LANE 8  // head_dim <= 256

// Merges the warps' (m, l, acc) and writes out[0..hd). `shared` holds
// warps * (hd + 2) floats (dynamic shared memory).
__device__ void attn_merge_and_store(float* out, float m, float l, const float* acc, int hd,
                                     float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* sm = shared;
    float* sl = shared + warps;
    float* sacc = shared + 2 * warps;
    if (lane == 0) { sm[warp] = m; sl[warp] = l; }
    for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++) {
        int d = lane + 32 * i;
        if (d < hd) sacc[warp * hd + d] = acc[i];
    }
    __syncthreads();
    float big = NEG_INF;
    for (int w = 0; w < warps; w++) big = fmaxf(big, sm[w]);
    float total = 0.0f;
    for (int w = 0; w < warps; w++) total += sm[w] == NEG_INF ? 0.0f : sl[w] * expf(sm[w] - big);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < warps; w++)
            if (sm[w] != NEG_INF) o += sacc[w * hd + d] * expf(sm[w] - big);
        out[d] = total > 0.0f ? o / total : 0.0f;
    }
}

// The lane's share of the (scaled) query; the value accumulator zeroed.
__device__ __forceinline__ void attn_load_q(float* qr, float* acc, const float* qs, int hd,
                                            float scale) {
    int lane = threadIdx.x & 31;
    for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++) {
        int d = lane + 32 * i;
        qr[i] = d < hd ? qs[d] * scale : 0.0f;
        acc[i] = 0.0f;
    }
}

// One key: score it against the lane's share of q, fold it into (m, l, acc).
__device__ __forceinline__ void attn_step(const float* krow, const float* vrow, const float* qr,
                                          float* acc, float& m, float& l, int hd) {
    int lane = threadIdx.x & 31;
    float dot = 0.0f;
    for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++) {
        int d = lane + 32 * i;
        if (d < hd) dot += qr[i] * krow[d];
    }
    dot = warp_sum(dot);
    float m_new = fmaxf(m, dot);
    float corr = m == NEG_INF ? 0.0f : expf(m - m_new);
    float p = expf(dot - m_new);
    l = l * corr + p;
    for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++) {
        int d = lane + 32 * i;
        if (d < hd) acc[i] = acc[i] * corr + p * vrow[d];
    }
    m = m_new;
}

// Writes the new tokens' K/V rows into the paged pools: token t goes to
// pool row slot_mapping[t] (= block * block_size + offset). kv_row =
// n_kv_heads * head_dim. One thread per element.
extern "C" __global__ void paged_kv_write(float* k_pool, float* v_pool, const float* k,
                                          const float* v, const u32* slot_mapping, int tokens,
                                          int kv_row) {
    long long n = (long long)tokens * kv_row;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = i / kv_row, c = i % kv_row;
        size_t dst = (size_t)slot_mapping[t] * kv_row + c;
        k_pool[dst] = k[i];
        v_pool[dst] = v[i];
    }
}

// Decode: one query token per sequence s, attending its context_lens[s] keys
// (the current token's K/V already written) found through
// block_tables[s, max_blocks]. q, out: [seqs, n_heads, hd].
extern "C" __global__ void paged_attention_decode(float* out, const float* q, const float* k_pool,
                                                  const float* v_pool, const u32* block_tables,
                                                  const u32* context_lens, int seqs, int n_heads,
                                                  int n_kv_heads, int hd, int block_size,
                                                  int max_blocks, float scale) {
    extern __shared__ float shared[];
    int s = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    if (s >= seqs) return;
    int kvh = h / (n_heads / n_kv_heads);
    int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float qr[ATTN_MAX_DIM_PER_LANE], acc[ATTN_MAX_DIM_PER_LANE];
    attn_load_q(qr, acc, q + ((size_t)s * n_heads + h) * hd, hd, scale);
    float m = NEG_INF, l = 0.0f;
    int n = (int)context_lens[s];
    int row = n_kv_heads * hd;
    for (int j = warp; j < n; j += warps) {
        u32 blk = block_tables[(size_t)s * max_blocks + j / block_size];
        size_t base = ((size_t)blk * block_size + j % block_size) * row + (size_t)kvh * hd;
        attn_step(k_pool + base, v_pool + base, qr, acc, m, l, hd);
    }
    attn_merge_and_store(out + ((size_t)s * n_heads + h) * hd, m, l, acc, hd, shared);
}

// Variable-length causal prefill over packed sequences: sequence s owns
// tokens cu_seqlens[s] .. cu_seqlens[s + 1] of q [T, n_heads, hd] and of k,
// v [T, n_kv_heads, hd]; token i of a sequence attends its tokens 0..=i.
// token_seq[t] names the sequence of packed token t.
extern "C" __global__ void varlen_attention_prefill(float* out, const float* q, const float* k,
                                                    const float* v, const u32* cu_seqlens,
                                                    const u32* token_seq, int tokens, int n_heads,
                                                    int n_kv_heads, int hd, float scale) {
    extern __shared__ float shared[];
    int t = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    if (t >= tokens) return;
    int kvh = h / (n_heads / n_kv_heads);
    int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int start = (int)cu_seqlens[token_seq[t]];
    float qr[ATTN_MAX_DIM_PER_LANE], acc[ATTN_MAX_DIM_PER_LANE];
    attn_load_q(qr, acc, q + ((size_t)t * n_heads + h) * hd, hd, scale);
    float m = NEG_INF, l = 0.0f;
    int row = n_kv_heads * hd;
    for (int j = start + warp; j <= t; j += warps) {
        size_t base = (size_t)j * row + (size_t)kvh * hd;
        attn_step(k + base, v + base, qr, acc, m, l, hd);
    }
    attn_merge_and_store(out + ((size_t)t * n_heads + h) * hd, m, l, acc, hd, shared);
}

// ---- backward -----------------------------------------------------------
// Causal GQA attention backward for one sequence (nq queries, the last nq
// of nk positions), the probabilities recomputed from q and k as
// FlashAttention's backward does (CPU reference: attention_backward in
// kernels/src/cpu/attention.rs). With s_j = scale q . k_j, p = softmax(s),
// D = do . o = sum_j p_j (do . v_j):
//   ds_j = p_j (do . v_j - D);  dq = scale sum_j ds_j k_j;
//   dk_j = scale sum_i ds_ij q_i;  dv_j = sum_i p_ij do_i.
// attention_backward_dq: one block per (query, head), 256 threads (thread
// d owns dim d of dq), keys in tiles of ATTN_BWD_TILE; it also writes the
// row's log-sum-exp and D for attention_backward_dkv: one block per (key,
// KV head), the (query, head) pairs that see the key in tiles. Every sum
// runs in a fixed order (no atomics).
#define ATTN_BWD_TILE 64

__device__ __forceinline__ float dot_hd(const float* a, const float* b, int hd) {
    float s = 0.0f;
    for (int d = 0; d < hd; d++) s += a[d] * b[d];
    return s;
}

extern "C" __global__ void attention_backward_dq(float* dq, float* lse_out, float* dd_out,
                                                 const float* dout, const float* q,
                                                 const float* k, const float* v, int nq, int nk,
                                                 int heads, int kv_heads, int hd, float scale) {
    extern __shared__ float sh[];
    float* sq = sh;
    float* sdo = sq + hd;
    float* sds = sdo + hd;
    __shared__ float scratch[32];
    int i = blockIdx.x / heads, h = blockIdx.x % heads;
    if (i >= nq) return;
    int g = h / (heads / kv_heads);
    size_t row = ((size_t)i * heads + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        sq[d] = q[row + d];
        sdo[d] = dout[row + d];
    }
    __syncthreads();
    int live = nk - nq + i + 1;
    const size_t kstride = (size_t)kv_heads * hd;
    const float* kg = k + (size_t)g * hd;
    const float* vg = v + (size_t)g * hd;
    float m = NEG_INF;
    for (int j = threadIdx.x; j < live; j += blockDim.x)
        m = fmaxf(m, scale * dot_hd(sq, kg + j * kstride, hd));
    m = block_max(m, scratch);
    float l = 0.0f;
    for (int j = threadIdx.x; j < live; j += blockDim.x)
        l += expf(scale * dot_hd(sq, kg + j * kstride, hd) - m);
    l = block_sum(l, scratch);
    float lse = m + logf(l);
    float dpart = 0.0f;
    for (int j = threadIdx.x; j < live; j += blockDim.x) {
        float p = expf(scale * dot_hd(sq, kg + j * kstride, hd) - lse);
        dpart += p * dot_hd(sdo, vg + j * kstride, hd);
    }
    float D = block_sum(dpart, scratch);
    float acc = 0.0f;
    for (int j0 = 0; j0 < live; j0 += ATTN_BWD_TILE) {
        int n = live - j0 < ATTN_BWD_TILE ? live - j0 : ATTN_BWD_TILE;
        if (threadIdx.x < ATTN_BWD_TILE) {
            float ds = 0.0f;
            if ((int)threadIdx.x < n) {
                int j = j0 + threadIdx.x;
                float p = expf(scale * dot_hd(sq, kg + j * kstride, hd) - lse);
                ds = p * (dot_hd(sdo, vg + j * kstride, hd) - D);
            }
            sds[threadIdx.x] = ds;
        }
        __syncthreads();
        if ((int)threadIdx.x < hd)
            for (int u = 0; u < n; u++) acc += sds[u] * kg[(j0 + u) * kstride + threadIdx.x];
        __syncthreads();
    }
    if ((int)threadIdx.x < hd) dq[row + threadIdx.x] = scale * acc;
    if (threadIdx.x == 0) {
        lse_out[(size_t)i * heads + h] = lse;
        dd_out[(size_t)i * heads + h] = D;
    }
}

extern "C" __global__ void attention_backward_dkv(float* dk, float* dv, const float* dout,
                                                  const float* q, const float* k, const float* v,
                                                  const float* lse, const float* dd, int nq,
                                                  int nk, int heads, int kv_heads, int hd,
                                                  float scale) {
    extern __shared__ float sh[];
    float* sk = sh;
    float* sv = sk + hd;
    float* sp = sv + hd;
    float* sds = sp + ATTN_BWD_TILE;
    int j = blockIdx.x / kv_heads, g = blockIdx.x % kv_heads;
    if (j >= nk) return;
    int group = heads / kv_heads;
    size_t krow = ((size_t)j * kv_heads + g) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        sk[d] = k[krow + d];
        sv[d] = v[krow + d];
    }
    __syncthreads();
    // Query i sees key j when j <= nk - nq + i.
    int i0 = j - (nk - nq);
    if (i0 < 0) i0 = 0;
    int total = (nq - i0) * group;
    float adk = 0.0f, adv = 0.0f;
    for (int x0 = 0; x0 < total; x0 += ATTN_BWD_TILE) {
        int n = total - x0 < ATTN_BWD_TILE ? total - x0 : ATTN_BWD_TILE;
        if (threadIdx.x < ATTN_BWD_TILE) {
            float p = 0.0f, ds = 0.0f;
            if ((int)threadIdx.x < n) {
                int x = x0 + threadIdx.x;
                int i = i0 + x / group, h = g * group + x % group;
                size_t row = ((size_t)i * heads + h) * hd;
                p = expf(scale * dot_hd(q + row, sk, hd) - lse[(size_t)i * heads + h]);
                ds = p * (dot_hd(dout + row, sv, hd) - dd[(size_t)i * heads + h]);
            }
            sp[threadIdx.x] = p;
            sds[threadIdx.x] = ds;
        }
        __syncthreads();
        if ((int)threadIdx.x < hd)
            for (int u = 0; u < n; u++) {
                int x = x0 + u;
                int i = i0 + x / group, h = g * group + x % group;
                size_t row = ((size_t)i * heads + h) * hd;
                adv += sp[u] * dout[row + threadIdx.x];
                adk += sds[u] * q[row + threadIdx.x];
            }
        __syncthreads();
    }
    if ((int)threadIdx.x < hd) {
        dk[krow + threadIdx.x] = scale * adk;
        dv[krow + threadIdx.x] = adv;
    }
}
