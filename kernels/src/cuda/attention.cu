// Causal grouped-query attention, softmax in fp32, for decode over a paged
// K/V cache and for prefill, fresh over contiguous K/V or after a past over
// the paged cache. Query head h reads K/V head h / (n_heads / n_kv_heads);
// head_dim at most 256. The sigmoid output gate is applied by the caller
// (sigmoid_gate_forward), as on the CPU (kernels/src/cpu/attention.rs, the
// reference).
//
// Every query runs the same arithmetic in the same order, whichever kernel
// computes it. Its keys fall into splits of ATTN_SPLIT (keys 0 ..
// ATTN_SPLIT - 1, then the next ATTN_SPLIT, ...). In a split, ATTN_WARPS
// "slots", slot w folding the split's keys w, w + ATTN_WARPS, ... in
// increasing order into an online softmax (running max m, sum l, and the
// weighted value sum: lane i holds dims i, i + 32, ...), then the slots
// merged in order into the split's state; the splits' states are folded in
// order into the running state (attn_fold), which is normalized at the
// end. So a token's output has the same bits prefilled fresh, prefilled
// after a cached past or decoded, which is what makes a prefix hit equal a
// cold run; a context of one split gives the bits of the slots' merge
// alone (the fold from nothing scales by e^0 = 1). Fused multiply-adds are
// written out (fmaf) where a product meets a sum, so that equality does
// not rest on the compiler contracting two kernels alike.
//
// Decode: one block per (sequence, KV head, split) and up to
// ATTN_DECODE_HEADS of the KV head's query heads, a warp per (slot, head),
// so the heads of a group read each key and value row together (once from
// memory); a context of several splits leaves each split's state for
// attention_split_merge, which folds them (flash-decoding: a long context
// at a small batch spreads over the GPU). Prefill: a block per tile of
// ATTN_PAIRS (query, head) pairs of one sequence and KV head, the keys
// staged through shared memory once for all of them, the splits folded
// into the output rows at each split's end.

#define ATTN_MAX_DIM_PER_LANE 8  // head_dim <= 256
#define ATTN_WARPS 4             // slots; a multiple of it divides ATTN_KEY_TILE
#define ATTN_PAIR_WARPS 4        // prefill: warps per slot
#define ATTN_PAIRS_PER_WARP 4    // prefill: (query, head) pairs a warp holds
#define ATTN_PAIRS (ATTN_PAIR_WARPS * ATTN_PAIRS_PER_WARP)
#define ATTN_TILE_THREADS (ATTN_WARPS * ATTN_PAIR_WARPS * 32)
#define ATTN_KEY_TILE 16         // prefill: keys per shared-memory tile
#define ATTN_SPLIT 512           // keys per split; a multiple of ATTN_KEY_TILE
#define ATTN_DECODE_HEADS 4      // decode: query heads per block

// The factors that fold a split's state (max m) into the running state
// (max M) of the splits before it: a for the earlier splits' sums, b for
// the split's. `first`: no split before it (the running sums are not
// read, which leaves the split's own sums scaled by b = e^0 = 1).
struct AttnFold {
    float a, b, m;
    bool first;
};
__device__ __forceinline__ AttnFold attn_fold_factors(float M, float m) {
    AttnFold f;
    f.first = M == NEG_INF;
    f.m = fmaxf(M, m);
    f.a = f.first ? 0.0f : expf(M - f.m);
    f.b = expf(m - f.m);
    return f;
}
__device__ __forceinline__ float attn_fold(float running, float split, AttnFold f) {
    return f.first ? split * f.b : fmaf(running, f.a, split * f.b);
}

// Folds the split whose ATTN_WARPS slot states are sm, sl: [ATTN_WARPS],
// sacc: [ATTN_WARPS, hd] into the running state M, L and acc[0..hd) (a
// query's output row); threads t, t + nt, ... take the dims, each thread
// keeping its own copy of M and L. A split with no key of this query
// (every slot empty) changes nothing. The state of a split, as decode's
// splits leave it for attention_split_merge: max `big`, sum `total`, value
// sums `o`.
__device__ void attn_fold_slots(float* acc, float& M, float& L, const float* sm, const float* sl,
                                const float* sacc, int hd, int t, int nt) {
    float big = NEG_INF;
    for (int w = 0; w < ATTN_WARPS; w++) big = fmaxf(big, sm[w]);
    if (big == NEG_INF) return;
    float total = 0.0f;
    for (int w = 0; w < ATTN_WARPS; w++)
        if (sm[w] != NEG_INF) total = fmaf(sl[w], expf(sm[w] - big), total);
    AttnFold f = attn_fold_factors(M, big);
    for (int d = t; d < hd; d += nt) {
        float o = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (sm[w] != NEG_INF) o = fmaf(sacc[w * hd + d], expf(sm[w] - big), o);
        acc[d] = attn_fold(acc[d], o, f);
    }
    L = attn_fold(L, total, f);
    M = f.m;
}

// The output from the running state: acc / L (zero with no key at all).
__device__ __forceinline__ void attn_finish(float* acc, float L, int hd, int t, int nt) {
    for (int d = t; d < hd; d += nt) acc[d] = L > 0.0f ? acc[d] / L : 0.0f;
}

// Stores a warp's state at its place `warp` of the merge buffer: sm
// [warps], sl [warps], sacc [warps, hd] from `shared`.
__device__ __forceinline__ void attn_stash(float* shared, int warp, int warps, float m, float l,
                                           const float* acc, int hd) {
    int lane = threadIdx.x & 31;
    if (lane == 0) {
        shared[warp] = m;
        shared[warps + warp] = l;
    }
    for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++) {
        int d = lane + 32 * i;
        if (d < hd) shared[2 * warps + warp * hd + d] = acc[i];
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

// The lane's share of a K or V row.
__device__ __forceinline__ void attn_load_row(float* r, const float* row, int hd) {
    int lane = threadIdx.x & 31;
    for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++) {
        int d = lane + 32 * i;
        r[i] = d < hd ? row[d] : 0.0f;
    }
}

// a . b over the lanes' shares, every lane of the warp taking part.
__device__ __forceinline__ float attn_dot(const float* a, const float* b, int hd) {
    int lane = threadIdx.x & 31;
    float s = 0.0f;
    for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++)
        if (lane + 32 * i < hd) s = fmaf(a[i], b[i], s);
    return warp_sum(s);
}

// Folds score s into the online softmax's running max m and sum l:
// returns e^(s - m_new), with corr = e^(m - m_new) the earlier terms' rescale.
__device__ __forceinline__ float attn_online(float s, float& m, float& l, float& corr) {
    float m_new = fmaxf(m, s);
    corr = m == NEG_INF ? 0.0f : expf(m - m_new);
    float p = expf(s - m_new);
    l = fmaf(l, corr, p);
    m = m_new;
    return p;
}

// One key (the lane's share kr, vr): score it against the lane's share of
// q, fold it into (m, l, acc). Every lane of the warp takes part.
__device__ __forceinline__ void attn_step(const float* kr, const float* vr, const float* qr,
                                          float* acc, float& m, float& l, int hd) {
    int lane = threadIdx.x & 31;
    float corr, p = attn_online(attn_dot(qr, kr, hd), m, l, corr);
    for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++)
        if (lane + 32 * i < hd) acc[i] = fmaf(p, vr[i], acc[i] * corr);
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

// A context's splits (at least one, for an empty context too).
__device__ __forceinline__ int attn_splits(int n) {
    return n > ATTN_SPLIT ? (n + ATTN_SPLIT - 1) / ATTN_SPLIT : 1;
}

// Decode: one query token per sequence s, attending its context_lens[s] keys
// (the current token's K/V already written) found through
// block_tables[s, max_blocks]. q, out: [seqs, n_heads, hd]. Block b takes
// split b % n_splits (n_splits: the longest context's) of KV head g of
// sequence s and query heads g * group + hc * hb + r, r < hb, where
// (s, g, hc) = b / n_splits and hb = min(group, ATTN_DECODE_HEADS) (hc
// counts the group's runs of hb heads); warp w is slot w % ATTN_WARPS of
// head r = w / ATTN_WARPS. A context of one split is written to out; of
// more, split c of query (s, h) leaves its state in part[((s * n_heads +
// h) * n_splits + c) * (hd + 2) ..]: its max, its sum, then its value sums
// (attention_split_merge folds them). hb * ATTN_WARPS warps; shared: hb *
// ATTN_WARPS * (hd + 2) floats.
extern "C" __global__ void paged_attention_decode(float* out, float* part, const float* q,
                                                  const float* k_pool, const float* v_pool,
                                                  const u32* block_tables,
                                                  const u32* context_lens, int seqs, int n_heads,
                                                  int n_kv_heads, int hd, int block_size,
                                                  int max_blocks, int n_splits, float scale) {
    extern __shared__ float shared[];
    int group = n_heads / n_kv_heads;
    int hb = group < ATTN_DECODE_HEADS ? group : ATTN_DECODE_HEADS;
    int runs = (group + hb - 1) / hb;
    int b = blockIdx.x / n_splits, c = blockIdx.x % n_splits;
    int s = b / (n_kv_heads * runs), g = b / runs % n_kv_heads, hc = b % runs;
    if (s >= seqs) return;
    int n = (int)context_lens[s];
    int splits = attn_splits(n);
    if (c >= splits) return;
    int warp = threadIdx.x >> 5;
    int slot = warp % ATTN_WARPS, r = warp / ATTN_WARPS;
    int hg = hc * hb + r;                      // the head within the group
    bool on = hg < group;                      // a run of the group may be short
    int p = s * n_heads + g * group + (on ? hg : 0);  // (sequence, head)
    float qr[ATTN_MAX_DIM_PER_LANE], acc[ATTN_MAX_DIM_PER_LANE];
    float kr[ATTN_MAX_DIM_PER_LANE], vr[ATTN_MAX_DIM_PER_LANE];
    attn_load_q(qr, acc, q + (size_t)p * hd, hd, scale);
    float m = NEG_INF, l = 0.0f;
    int end = n < (c + 1) * ATTN_SPLIT ? n : (c + 1) * ATTN_SPLIT;
    int row = n_kv_heads * hd;
    for (int j = c * ATTN_SPLIT + slot; on && j < end; j += ATTN_WARPS) {
        u32 blk = block_tables[(size_t)s * max_blocks + j / block_size];
        size_t base = ((size_t)blk * block_size + j % block_size) * row + (size_t)g * hd;
        attn_load_row(kr, k_pool + base, hd);
        attn_load_row(vr, v_pool + base, hd);
        attn_step(kr, vr, qr, acc, m, l, hd);
    }
    // Head r's slots at its own place of the merge buffer.
    float* mine = shared + (size_t)r * ATTN_WARPS * (hd + 2);
    attn_stash(mine, slot, ATTN_WARPS, m, l, acc, hd);
    __syncthreads();
    if (!on) return;
    int t = threadIdx.x - r * ATTN_WARPS * 32;
    float M = NEG_INF, L = 0.0f;
    if (splits == 1) {
        float* o = out + (size_t)p * hd;
        attn_fold_slots(o, M, L, mine, mine + ATTN_WARPS, mine + 2 * ATTN_WARPS, hd, t,
                        ATTN_WARPS * 32);
        attn_finish(o, L, hd, t, ATTN_WARPS * 32);
        return;
    }
    // The split's own state: folded from nothing, its max, sum and sums.
    float* st = part + ((size_t)p * n_splits + c) * (hd + 2);
    attn_fold_slots(st + 2, M, L, mine, mine + ATTN_WARPS, mine + 2 * ATTN_WARPS, hd, t,
                    ATTN_WARPS * 32);
    if (t == 0) {
        st[0] = M;
        st[1] = L;
    }
}

// The rest of decode for contexts of several splits: a block per
// (sequence, head) p folds its splits' states from part, in order, into
// out [seqs, n_heads, hd] (threads over the dims) and normalizes.
extern "C" __global__ void attention_split_merge(float* out, const float* part,
                                                 const u32* context_lens, int seqs, int n_heads,
                                                 int hd, int n_splits) {
    int p = blockIdx.x, s = p / n_heads;
    if (s >= seqs) return;
    int splits = attn_splits((int)context_lens[s]);
    if (splits == 1) return;
    float* o = out + (size_t)p * hd;
    float M = NEG_INF, L = 0.0f;
    for (int c = 0; c < splits; c++) {
        const float* st = part + ((size_t)p * n_splits + c) * (hd + 2);
        if (st[0] == NEG_INF) continue;
        AttnFold f = attn_fold_factors(M, st[0]);
        for (int d = threadIdx.x; d < hd; d += blockDim.x)
            o[d] = attn_fold(o[d], st[2 + d], f);
        L = attn_fold(L, st[1], f);
        M = f.m;
    }
    attn_finish(o, L, hd, threadIdx.x, blockDim.x);
}

// Where key j (0-based in its sequence) of KV head 0 starts: contiguous
// rows from the sequence's first packed token, or paged through the
// sequence's block table.
struct AttnPackedRows {
    size_t first;
    int row;
    __device__ size_t at(int j) const { return (first + (size_t)j) * row; }
};
struct AttnPagedRows {
    const u32* table;
    int block_size, row;
    __device__ size_t at(int j) const {
        return ((size_t)table[j / block_size] * block_size + j % block_size) * row;
    }
};

// One prefill tile: pairs pair0 .. pair0 + ATTN_PAIRS of a sequence's new
// tokens (pair x: new token x / group, head g * group + x % group) over KV
// head g, the sequence's new tokens q/out rows q_first.., after `past`
// earlier keys (new token i attends keys 0 ..= past + i). Warp w is slot w
// % ATTN_WARPS of pairs pair0 + (w / ATTN_WARPS) * ATTN_PAIRS_PER_WARP + r.
// At the end of each split (and of the keys) the slots of every pair are
// folded into its output row, which holds the running value sums until
// the last fold normalizes them; the running max and sum of each pair's
// splits so far sit in shared memory after the tiles (two copies, read
// from one and written to the other by split parity). shared:
// attn_prefill_tile_floats(hd) + 4 * ATTN_PAIRS floats. At 128 registers
// ptxas (CUDA 13.0, sm_90) spills 44 bytes: the output rows' addresses,
// stored before the key loop and loaded after the last barrier, never in
// the loop (nvdisasm).
__device__ __forceinline__ int attn_prefill_tile_floats(int hd) {
    int tiles = 2 * ATTN_KEY_TILE * hd, merge = ATTN_WARPS * ATTN_PAIR_WARPS * (hd + 2);
    return tiles > merge ? tiles : merge;
}
template <typename Rows>
__device__ void attn_prefill_tile(float* out, const float* q, const float* k, const float* v,
                                  Rows rows, size_t q_first, int past, int n_new, int pair0, int g,
                                  int n_heads, int n_kv_heads, int hd, float scale,
                                  float* shared) {
    int warp = threadIdx.x >> 5;
    int slot = warp % ATTN_WARPS, pw = warp / ATTN_WARPS;
    int group = n_heads / n_kv_heads;
    int pairs = n_new * group;
    float qr[ATTN_PAIRS_PER_WARP][ATTN_MAX_DIM_PER_LANE];
    float acc[ATTN_PAIRS_PER_WARP][ATTN_MAX_DIM_PER_LANE];
    float m[ATTN_PAIRS_PER_WARP], l[ATTN_PAIRS_PER_WARP];
    int last[ATTN_PAIRS_PER_WARP];  // the pair's last key, -1 for no pair
    const int warps = ATTN_WARPS * ATTN_PAIR_WARPS;
    int t = threadIdx.x - pw * ATTN_WARPS * 32;
    // run[parity * 2 * ATTN_PAIRS + {0: max, ATTN_PAIRS: sum} + pair]:
    // the running state of the splits folded so far.
    float* run = shared + attn_prefill_tile_floats(hd);
#pragma unroll
    for (int r = 0; r < ATTN_PAIRS_PER_WARP; r++) {
        int x = pair0 + pw * ATTN_PAIRS_PER_WARP + r;
        int i = x / group, h = g * group + x % group;
        last[r] = x < pairs ? past + i : -1;
        attn_load_q(qr[r], acc[r], q + ((q_first + (x < pairs ? i : 0)) * n_heads + h) * hd, hd,
                    scale);
        m[r] = NEG_INF;
        l[r] = 0.0f;
        if (t == 0) {
            run[pw * ATTN_PAIRS_PER_WARP + r] = NEG_INF;
            run[ATTN_PAIRS + pw * ATTN_PAIRS_PER_WARP + r] = 0.0f;
        }
    }
    int folds = 0;
    int x_end = pair0 + ATTN_PAIRS < pairs ? pair0 + ATTN_PAIRS : pairs;
    int n_keys = past + (x_end - 1) / group + 1;
    float* sk = shared;
    float* sv = shared + ATTN_KEY_TILE * hd;
    float kr[ATTN_MAX_DIM_PER_LANE], vr[ATTN_MAX_DIM_PER_LANE];
    for (int j0 = 0; j0 < n_keys; j0 += ATTN_KEY_TILE) {
        int nt = n_keys - j0 < ATTN_KEY_TILE ? n_keys - j0 : ATTN_KEY_TILE;
        __syncthreads();  // the last tile is consumed
        for (int e = threadIdx.x; e < nt * hd; e += blockDim.x) {
            size_t at = rows.at(j0 + e / hd) + (size_t)g * hd + e % hd;
            sk[e] = k[at];
            sv[e] = v[at];
        }
        __syncthreads();
        for (int jj = slot; jj < nt; jj += ATTN_WARPS) {
            attn_load_row(kr, sk + jj * hd, hd);
            attn_load_row(vr, sv + jj * hd, hd);
#pragma unroll
            for (int r = 0; r < ATTN_PAIRS_PER_WARP; r++)
                if (j0 + jj <= last[r]) attn_step(kr, vr, qr[r], acc[r], m[r], l[r], hd);
        }
        if ((j0 + ATTN_KEY_TILE) % ATTN_SPLIT != 0 && j0 + ATTN_KEY_TILE < n_keys) continue;
        // A split ends: fold, one pair per warp at a time, in the key
        // tiles' memory; the slots start the next split empty.
#pragma unroll
        for (int r = 0; r < ATTN_PAIRS_PER_WARP; r++) {
            __syncthreads();
            attn_stash(shared, warp, warps, m[r], l[r], acc[r], hd);
            __syncthreads();
            int x = pair0 + pw * ATTN_PAIRS_PER_WARP + r;
            if (x < pairs) {
                int i = x / group, h = g * group + x % group;
                int w0 = pw * ATTN_WARPS;
                int pi = pw * ATTN_PAIRS_PER_WARP + r;
                const float* from = run + (folds & 1) * 2 * ATTN_PAIRS + pi;
                float M = from[0], L = from[ATTN_PAIRS];
                attn_fold_slots(out + ((q_first + i) * n_heads + h) * hd, M, L, shared + w0,
                                shared + warps + w0, shared + 2 * warps + (size_t)w0 * hd, hd, t,
                                ATTN_WARPS * 32);
                float* to = run + ((folds + 1) & 1) * 2 * ATTN_PAIRS + pi;
                if (t == 0) {
                    to[0] = M;
                    to[ATTN_PAIRS] = L;
                }
            }
            m[r] = NEG_INF;
            l[r] = 0.0f;
            for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++) acc[r][i] = 0.0f;
        }
        folds++;
    }
    __syncthreads();  // the last fold's sums are written
#pragma unroll
    for (int r = 0; r < ATTN_PAIRS_PER_WARP; r++) {
        int x = pair0 + pw * ATTN_PAIRS_PER_WARP + r;
        if (x < pairs) {
            int i = x / group, h = g * group + x % group;
            float L = run[(folds & 1) * 2 * ATTN_PAIRS + ATTN_PAIRS + pw * ATTN_PAIRS_PER_WARP +
                          r];
            attn_finish(out + ((q_first + i) * n_heads + h) * hd, L, hd, t, ATTN_WARPS * 32);
        }
    }
}

// Fresh prefill over packed sequences: sequence s owns tokens cu_seqlens[s]
// .. cu_seqlens[s + 1] of q [T, n_heads, hd] and of k, v [T, n_kv_heads,
// hd]; token i of a sequence attends its tokens 0..=i. Block b is tile
// b / n_kv_heads (tiles[2 * tile] = its sequence, tiles[2 * tile + 1] its
// first pair) over KV head b % n_kv_heads.
extern "C" __global__ void __launch_bounds__(ATTN_TILE_THREADS)
    varlen_attention_prefill(float* out, const float* q, const float* k, const float* v,
                             const u32* cu_seqlens, const u32* tiles, int n_heads, int n_kv_heads,
                             int hd, float scale) {
    extern __shared__ float shared[];
    int tile = blockIdx.x / n_kv_heads, g = blockIdx.x % n_kv_heads;
    int s = (int)tiles[2 * tile], pair0 = (int)tiles[2 * tile + 1];
    size_t first = cu_seqlens[s];
    int n_new = (int)(cu_seqlens[s + 1] - cu_seqlens[s]);
    AttnPackedRows rows = {first, n_kv_heads * hd};
    attn_prefill_tile(out, q, k, v, rows, first, 0, n_new, pair0, g, n_heads, n_kv_heads, hd,
                      scale, shared);
}

// Prefill after a past, over the paged pools (the new tokens' K/V already
// written): sequence s's new tokens are rows cu_seqlens[s] .. cu_seqlens[s
// + 1] of q and out [T, n_heads, hd], after pasts[s] cached keys, its keys
// found through block_tables[s, max_blocks]. Tiles as in
// varlen_attention_prefill.
extern "C" __global__ void __launch_bounds__(ATTN_TILE_THREADS)
    paged_attention_prefill(float* out, const float* q, const float* k_pool, const float* v_pool,
                            const u32* block_tables, const u32* pasts, const u32* cu_seqlens,
                            const u32* tiles, int n_heads, int n_kv_heads, int hd,
                            int block_size, int max_blocks, float scale) {
    extern __shared__ float shared[];
    int tile = blockIdx.x / n_kv_heads, g = blockIdx.x % n_kv_heads;
    int s = (int)tiles[2 * tile], pair0 = (int)tiles[2 * tile + 1];
    int n_new = (int)(cu_seqlens[s + 1] - cu_seqlens[s]);
    AttnPagedRows rows = {block_tables + (size_t)s * max_blocks, block_size, n_kv_heads * hd};
    attn_prefill_tile(out, q, k_pool, v_pool, rows, cu_seqlens[s], (int)pasts[s], n_new, pair0,
                      g, n_heads, n_kv_heads, hd, scale, shared);
}

// ---- backward -----------------------------------------------------------
// Causal GQA attention backward for one sequence (nq queries, the last nq
// of nk positions), FlashAttention's way (CPU reference: attention_backward
// in kernels/src/cpu/attention.rs): the probabilities recomputed from q and
// k and the row's log-sum-exp, which attention_backward_dq finds in a first
// pass over the keys, with D = do . o = sum_j p_j (do . v_j), and saves for
// attention_backward_dkv. With s_j = scale q . k_j, p = softmax(s):
//   ds_j = p_j (do . v_j - D);  dq = scale sum_j ds_j k_j;
//   dk_j = scale sum_i ds_ij q_i;  dv_j = sum_i p_ij do_i.
// Both kernels tile as the prefill does: ATTN_WARPS slots, ATTN_PAIR_WARPS
// warps per slot each holding ATTN_BWD_ROWS rows in registers ((query,
// head) pairs for dq, keys for dk/dv), the other side staged through shared
// memory in tiles of ATTN_KEY_TILE, slot w taking every ATTN_WARPS-th of
// them; the slots' partial sums are added in slot order. Every sum runs in
// a fixed order (no atomics).
#define ATTN_BWD_ROWS 2
#define ATTN_BWD_BLOCK_ROWS (ATTN_PAIR_WARPS * ATTN_BWD_ROWS)

// Adds the slots' rows (stashed at `shared`, [warps, hd]) of warp group pw
// in slot order, times `mul`, into out[0..hd).
__device__ __forceinline__ void attn_sum_slots(float* out, const float* shared, int pw, int hd,
                                               float mul) {
    int t = threadIdx.x - pw * ATTN_WARPS * 32;
    for (int d = t; d < hd; d += ATTN_WARPS * 32) {
        float o = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++) o += shared[(pw * ATTN_WARPS + w) * hd + d];
        out[d] = mul * o;
    }
}

// Stages rows [j0, j0 + nt) of K and V (kv head g, row stride kstride) in
// shared memory, after the last tile is consumed.
__device__ __forceinline__ void attn_stage_kv(float* sk, float* sv, const float* k,
                                              const float* v, int j0, int nt, size_t kstride,
                                              int g, int hd) {
    __syncthreads();
    for (int e = threadIdx.x; e < nt * hd; e += blockDim.x) {
        size_t at = (size_t)(j0 + e / hd) * kstride + (size_t)g * hd + e % hd;
        sk[e] = k[at];
        sv[e] = v[at];
    }
    __syncthreads();
}

// Block b: pairs (b / kv_heads) * ATTN_BWD_BLOCK_ROWS.. over KV head b %
// kv_heads (pair x: query x / group, head g * group + x % group). Shared:
// max(2 * ATTN_KEY_TILE * hd, warps * hd, 3 * warps * ATTN_BWD_ROWS) floats.
extern "C" __global__ void __launch_bounds__(ATTN_TILE_THREADS)
    attention_backward_dq(float* dq, float* lse_out, float* dd_out, const float* dout,
                          const float* q, const float* k, const float* v, int nq, int nk,
                          int heads, int kv_heads, int hd, float scale) {
    extern __shared__ float shared[];
    const int R = ATTN_BWD_ROWS, warps = ATTN_WARPS * ATTN_PAIR_WARPS;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int slot = warp % ATTN_WARPS, pw = warp / ATTN_WARPS;
    int g = blockIdx.x % kv_heads, pair0 = blockIdx.x / kv_heads * ATTN_BWD_BLOCK_ROWS;
    int group = heads / kv_heads, pairs = nq * group, past = nk - nq;
    float qr[R][ATTN_MAX_DIM_PER_LANE], dor[R][ATTN_MAX_DIM_PER_LANE];
    float acc[R][ATTN_MAX_DIM_PER_LANE];
    float m[R], l[R], dsum[R], lse[R], D[R];
    int last[R];  // the pair's last key, -1 for no pair
    size_t row[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        int x = pair0 + pw * R + r;
        int i = x < pairs ? x / group : 0, h = g * group + x % group;
        last[r] = x < pairs ? past + i : -1;
        row[r] = ((size_t)i * heads + h) * hd;
        attn_load_q(qr[r], acc[r], q + row[r], hd, scale);
        attn_load_row(dor[r], dout + row[r], hd);
        m[r] = NEG_INF;
        l[r] = 0.0f;
        dsum[r] = 0.0f;
    }
    int x_end = pair0 + ATTN_BWD_BLOCK_ROWS < pairs ? pair0 + ATTN_BWD_BLOCK_ROWS : pairs;
    int n_keys = past + (x_end - 1) / group + 1;
    const size_t kstride = (size_t)kv_heads * hd;
    float* sk = shared;
    float* sv = shared + ATTN_KEY_TILE * hd;
    float kr[ATTN_MAX_DIM_PER_LANE], vr[ATTN_MAX_DIM_PER_LANE];
    // Pass 1: the online softmax's (m, l) and sum_j e^(s_j - m) (do . v_j).
    for (int j0 = 0; j0 < n_keys; j0 += ATTN_KEY_TILE) {
        int nt = n_keys - j0 < ATTN_KEY_TILE ? n_keys - j0 : ATTN_KEY_TILE;
        attn_stage_kv(sk, sv, k, v, j0, nt, kstride, g, hd);
        for (int jj = slot; jj < nt; jj += ATTN_WARPS) {
            attn_load_row(kr, sk + jj * hd, hd);
            attn_load_row(vr, sv + jj * hd, hd);
#pragma unroll
            for (int r = 0; r < R; r++)
                if (j0 + jj <= last[r]) {
                    float s = attn_dot(qr[r], kr, hd), dov = attn_dot(dor[r], vr, hd);
                    float corr, p = attn_online(s, m[r], l[r], corr);
                    dsum[r] = fmaf(p, dov, dsum[r] * corr);
                }
        }
    }
    // The slots merged: lse and D of each pair.
    __syncthreads();
    if (lane == 0)
        for (int r = 0; r < R; r++) {
            shared[warp * R + r] = m[r];
            shared[(warps + warp) * R + r] = l[r];
            shared[(2 * warps + warp) * R + r] = dsum[r];
        }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; r++) {
        float big = NEG_INF, tl = 0.0f, ts = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            big = fmaxf(big, shared[(pw * ATTN_WARPS + w) * R + r]);
        for (int w = 0; w < ATTN_WARPS; w++) {
            int at = (pw * ATTN_WARPS + w) * R + r;
            if (shared[at] == NEG_INF) continue;
            float e = expf(shared[at] - big);
            tl = fmaf(shared[warps * R + at], e, tl);
            ts = fmaf(shared[2 * warps * R + at], e, ts);
        }
        lse[r] = last[r] < 0 ? 0.0f : big + logf(tl);
        D[r] = last[r] < 0 ? 0.0f : ts / tl;
    }
    // Pass 2: dq = scale sum_j ds_j k_j.
    for (int j0 = 0; j0 < n_keys; j0 += ATTN_KEY_TILE) {
        int nt = n_keys - j0 < ATTN_KEY_TILE ? n_keys - j0 : ATTN_KEY_TILE;
        attn_stage_kv(sk, sv, k, v, j0, nt, kstride, g, hd);
        for (int jj = slot; jj < nt; jj += ATTN_WARPS) {
            attn_load_row(kr, sk + jj * hd, hd);
            attn_load_row(vr, sv + jj * hd, hd);
#pragma unroll
            for (int r = 0; r < R; r++)
                if (j0 + jj <= last[r]) {
                    float p = expf(attn_dot(qr[r], kr, hd) - lse[r]);
                    float ds = p * (attn_dot(dor[r], vr, hd) - D[r]);
                    for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++)
                        if (lane + 32 * i < hd) acc[r][i] = fmaf(ds, kr[i], acc[r][i]);
                }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        __syncthreads();
        for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++)
            if (lane + 32 * i < hd) shared[warp * hd + lane + 32 * i] = acc[r][i];
        __syncthreads();
        if (last[r] >= 0) {
            attn_sum_slots(dq + row[r], shared, pw, hd, scale);
            if (slot == 0 && lane == 0) {
                lse_out[row[r] / hd] = lse[r];
                dd_out[row[r] / hd] = D[r];
            }
        }
    }
}

// Block b: keys (b / kv_heads) * ATTN_BWD_BLOCK_ROWS.. of KV head b %
// kv_heads; the (query, head) pairs that see them staged (q scaled, do,
// lse, D). Shared: max(2 * ATTN_KEY_TILE * (hd + 1), 2 * warps * hd) floats.
extern "C" __global__ void __launch_bounds__(ATTN_TILE_THREADS)
    attention_backward_dkv(float* dk, float* dv, const float* dout, const float* q,
                           const float* k, const float* v, const float* lse, const float* dd,
                           int nq, int nk, int heads, int kv_heads, int hd, float scale) {
    extern __shared__ float shared[];
    const int R = ATTN_BWD_ROWS, warps = ATTN_WARPS * ATTN_PAIR_WARPS;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int slot = warp % ATTN_WARPS, pw = warp / ATTN_WARPS;
    int g = blockIdx.x % kv_heads, key0 = blockIdx.x / kv_heads * ATTN_BWD_BLOCK_ROWS;
    int group = heads / kv_heads, pairs = nq * group, past = nk - nq;
    float kr[R][ATTN_MAX_DIM_PER_LANE], vr[R][ATTN_MAX_DIM_PER_LANE];
    float adk[R][ATTN_MAX_DIM_PER_LANE], adv[R][ATTN_MAX_DIM_PER_LANE];
    int key[R];  // the key's index, nk for no key
#pragma unroll
    for (int r = 0; r < R; r++) {
        int j = key0 + pw * R + r;
        key[r] = j < nk ? j : nk;
        size_t at = ((size_t)(j < nk ? j : 0) * kv_heads + g) * hd;
        attn_load_row(kr[r], k + at, hd);
        attn_load_row(vr[r], v + at, hd);
        for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++) adk[r][i] = adv[r][i] = 0.0f;
    }
    // Query i sees key j when j <= past + i: the block's first key is seen
    // from query key0 - past on.
    int x_begin = (key0 - past > 0 ? key0 - past : 0) * group;
    float* sq = shared;
    float* sdo = sq + ATTN_KEY_TILE * hd;
    float* slse = sdo + ATTN_KEY_TILE * hd;
    float* sdd = slse + ATTN_KEY_TILE;
    float qr[ATTN_MAX_DIM_PER_LANE], dor[ATTN_MAX_DIM_PER_LANE];
    for (int x0 = x_begin; x0 < pairs; x0 += ATTN_KEY_TILE) {
        int nt = pairs - x0 < ATTN_KEY_TILE ? pairs - x0 : ATTN_KEY_TILE;
        __syncthreads();  // the last tile is consumed
        for (int e = threadIdx.x; e < nt * hd; e += blockDim.x) {
            int x = x0 + e / hd;
            size_t at = ((size_t)(x / group) * heads + g * group + x % group) * hd + e % hd;
            sq[e] = q[at] * scale;
            sdo[e] = dout[at];
        }
        for (int e = threadIdx.x; e < nt; e += blockDim.x) {
            int x = x0 + e;
            size_t at = (size_t)(x / group) * heads + g * group + x % group;
            slse[e] = lse[at];
            sdd[e] = dd[at];
        }
        __syncthreads();
        for (int xx = slot; xx < nt; xx += ATTN_WARPS) {
            int pos = past + (x0 + xx) / group;
            attn_load_row(qr, sq + xx * hd, hd);
            attn_load_row(dor, sdo + xx * hd, hd);
#pragma unroll
            for (int r = 0; r < R; r++)
                if (key[r] <= pos) {
                    float p = expf(attn_dot(qr, kr[r], hd) - slse[xx]);
                    float ds = p * (attn_dot(dor, vr[r], hd) - sdd[xx]);
                    for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++)
                        if (lane + 32 * i < hd) {
                            adk[r][i] = fmaf(ds, qr[i], adk[r][i]);
                            adv[r][i] = fmaf(p, dor[i], adv[r][i]);
                        }
                }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        __syncthreads();
        for (int i = 0; i < ATTN_MAX_DIM_PER_LANE; i++)
            if (lane + 32 * i < hd) {
                shared[warp * hd + lane + 32 * i] = adk[r][i];
                shared[(warps + warp) * hd + lane + 32 * i] = adv[r][i];
            }
        __syncthreads();
        if (key[r] < nk) {
            size_t at = ((size_t)key[r] * kv_heads + g) * hd;
            attn_sum_slots(dk + at, shared, pw, hd, 1.0f);
            attn_sum_slots(dv + at, shared + warps * hd, pw, hd, 1.0f);
        }
    }
}
