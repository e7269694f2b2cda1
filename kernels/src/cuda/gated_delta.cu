// The gated delta rule for decode: one token per sequence, fp32 state
// addressed by slot (state[slot, nv, dk, dv]). One block per (sequence,
// value head, tile of GD_REC_COLS columns); a thread owns a column of S (dk
// x dv), so every access S[i, j] is coalesced across the warp. Per the recurrence
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

// Decode and the recurrent prefill hold thread j's column of S in
// registers (at most GD_MAX_DK rows): read once, every token stepped, then
// written back once, where gd_column_step reads and writes global memory
// twice per token. gd_column_step_reg is gd_column_step's arithmetic
// statement for statement (so the chunked scan's one-token chunks, on
// gd_column_step, keep decode's bits); only where S lives differs.
#define GD_MAX_DK 128
#define GD_REC_COLS 32  // columns (threads) per block of decode and the recurrent prefill

__device__ __forceinline__ float gd_column_step_reg(float* s, const float* qk, float decay,
                                                    float b, float v_j, int dk) {
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < GD_MAX_DK; i++)
        if (i < dk) {
            float x = s[i] * decay;
            s[i] = x;
            kv += x * qk[dk + i];
        }
    float delta = b * (v_j - kv);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < GD_MAX_DK; i++)
        if (i < dk) {
            float x = s[i] + qk[dk + i] * delta;
            s[i] = x;
            o += x * qk[i];
        }
    return o;
}

// Column j of S (dk x dv, row stride dv) to registers and back.
__device__ __forceinline__ void gd_column_load(float* s, const float* S, int j, int dk, int dv) {
#pragma unroll
    for (int i = 0; i < GD_MAX_DK; i++)
        if (i < dk) s[i] = S[(size_t)i * dv + j];
}
__device__ __forceinline__ void gd_column_store(float* S, const float* s, int j, int dk, int dv) {
#pragma unroll
    for (int i = 0; i < GD_MAX_DK; i++)
        if (i < dk) S[(size_t)i * dv + j] = s[i];
}

// Tokens t0 .. t1 of one sequence through the recurrence of value head h
// (key head kh) on the state S, thread i owning column j0 + i (a block takes
// GD_REC_COLS columns: the columns never mix, so a head's columns run in
// parallel blocks). q, k [T, nk, dk], v, out [T, nv, dv], g, beta [T, nv];
// qk: 2 * dk floats of shared memory.
__device__ void gd_recurrent(float* out, float* S, const float* q, const float* k,
                             const float* v, const float* g, const float* beta, int t0, int t1,
                             int nk, int nv, int kh, int h, int j0, int dk, int dv, float* qk) {
    int j = j0 + threadIdx.x;
    bool live = j < dv;
    float col[GD_MAX_DK];
    if (live) gd_column_load(col, S, j, dk, dv);
    for (int t = t0; t < t1; t++) {
        const float* qs = q + ((size_t)t * nk + kh) * dk;
        const float* ks = k + ((size_t)t * nk + kh) * dk;
        __syncthreads();
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qk[i] = qs[i];
            qk[dk + i] = ks[i];
        }
        __syncthreads();
        if (live) {
            size_t at = ((size_t)t * nv + h) * dv + j;
            out[at] = gd_column_step_reg(col, qk, expf(g[(size_t)t * nv + h]),
                                         beta[(size_t)t * nv + h], v[at], dk);
        }
    }
    if (live) gd_column_store(S, col, j, dk, dv);
}

// Decode: token s of each array is sequence s's one new token. Block b:
// column tile b % tiles of head (b / tiles) % nv of sequence b / tiles / nv.
extern "C" __global__ void __launch_bounds__(GD_REC_COLS)
    gated_delta_decode(float* out, float* state, const float* q, const float* k, const float* v,
                       const float* g, const float* beta, const u32* slots, int seqs, int nk,
                       int nv, int dk, int dv) {
    extern __shared__ float qk[];
    int tiles = (dv + GD_REC_COLS - 1) / GD_REC_COLS;
    int tile = blockIdx.x % tiles, h = (blockIdx.x / tiles) % nv, s = blockIdx.x / tiles / nv;
    if (s >= seqs) return;
    float* S = state + ((size_t)slots[s] * nv + h) * dk * dv;
    gd_recurrent(out, S, q, k, v, g, beta, s, s + 1, nk, nv, h / (nv / nk), h,
                 tile * GD_REC_COLS, dk, dv, qk);
}

// Prefill, token by token over packed sequences (the recurrent form; the
// chunked WY form is below): sequence s owns tokens
// cu_seqlens[s] .. cu_seqlens[s + 1] and the state at slots[s]. One block
// per (sequence, value head, column tile), as in decode, with a token axis.
extern "C" __global__ void __launch_bounds__(GD_REC_COLS)
    gated_delta_prefill(float* out, float* state, const float* q, const float* k, const float* v,
                        const float* g, const float* beta, const u32* slots,
                        const u32* cu_seqlens, int seqs, int nk, int nv, int dk, int dv) {
    extern __shared__ float qk[];
    int tiles = (dv + GD_REC_COLS - 1) / GD_REC_COLS;
    int tile = blockIdx.x % tiles, h = (blockIdx.x / tiles) % nv, s = blockIdx.x / tiles / nv;
    if (s >= seqs) return;
    float* S = state + ((size_t)slots[s] * nv + h) * dk * dv;
    gd_recurrent(out, S, q, k, v, g, beta, (int)cu_seqlens[s], (int)cu_seqlens[s + 1], nk, nv,
                 h / (nv / nk), h, tile * GD_REC_COLS, dk, dv, qk);
}

// ---- chunked prefill (the WY form) -----------------------------------------
#define GD_CHUNK 64
// The same function as gated_delta_prefill up to rounding, GD_CHUNK tokens
// at a time: the algebra of kernels/src/cpu/gated_delta.rs's header, whose
// gated_delta_chunked_forward is this pair's CPU reference. Chunk n covers
// tokens chunk_tok0[n] .. + chunk_len[n] (at most GD_CHUNK) of one
// sequence; sequence s owns chunks seq_chunk0[s] .. seq_chunk0[s + 1], in
// order. With G_i the cumulative log decay within a chunk:
//   gated_delta_chunk_prep, one block per (chunk, value head), touches no
//     state, so every chunk of every sequence runs at once: G; the masked
//     attention A_ij = (q_i . k_j) e^(G_i - G_j), j <= i (to global, row
//     stride GD_CHUNK); L_ij = beta_i (k_i . k_j) e^(G_i - G_j), j < i (in
//     shared memory); and the unit lower triangular solve
//     (I + L) [U | W] = [diag(beta) V | diag(beta e^G) K], a thread per column.
//   gated_delta_chunk_scan, one block per (sequence, value head, GD_COLS
//     value columns), walks the sequence's chunks in order:
//     Delta = U - W S0;  O = diag(e^G) Q S0 + A Delta;
//     S = e^(G_last) S0 + (diag(e^(G_last - G)) K)^T Delta.
//     The columns of S never mix, so a block owns GD_COLS of them (a warp
//     reads a row of S coalesced); its GD_ROWS warps split the chunk's rows
//     (Delta, O) and then the rows of S. q/W/A/k reads are warp broadcasts.
//     A chunk of one token (a decode-sized segment, or a prefill's last)
//     takes the recurrent step instead, with decode's arithmetic, so a
//     token computed alone has the same bits in either form.
// Every exponent is a difference G_i - G_j with i >= j, or G_i alone: <= 0.
// G is summed and kept in f64 (gd_decay): a difference of two f32 running
// sums would carry their rounding, about |G_i| 2^-24, into every decay.
// Shared memory is static and under 48 KiB for any dk, dv (dk is tiled).
// The prep also writes, where KKE is not null (the backward's),
// KKE_ij = (k_i . k_j) e^(G_i - G_j) for j < i, so L = diag(beta) KKE.
// e^(G_i - G_j) from the f64 cumulative log decays.
__device__ __forceinline__ float gd_decay(const double* cum, int i, int j) {
    return expf((float)(cum[i] - cum[j]));
}

#define GD_TILE 16
#define GD_COLS 32
#define GD_ROWS 8

extern "C" __global__ void gated_delta_chunk_prep(
    float* A, float* U, float* W, double* G, float* KKE, const float* q, const float* k,
    const float* v, const float* g, const float* beta, const u32* chunk_tok0,
    const u32* chunk_len, int chunks, int nk, int nv, int dk, int dv) {
    __shared__ double cum[GD_CHUNK];
    __shared__ float bet[GD_CHUNK];
    __shared__ float att[GD_CHUNK * GD_CHUNK], low[GD_CHUNK * GD_CHUNK];
    __shared__ float tq[GD_CHUNK * (GD_TILE + 1)], tk[GD_CHUNK * (GD_TILE + 1)];
    int n = blockIdx.x / nv, h = blockIdx.x % nv;
    if (n >= chunks) return;
    int kh = h / (nv / nk);
    int t0 = (int)chunk_tok0[n], c = (int)chunk_len[n];
    if ((int)threadIdx.x < c) bet[threadIdx.x] = beta[(size_t)(t0 + threadIdx.x) * nv + h];
    if (threadIdx.x == 0) {
        double acc = 0.0;
        for (int i = 0; i < c; i++) {
            acc += (double)g[(size_t)(t0 + i) * nv + h];
            cum[i] = acc;
        }
    }
    for (int e = threadIdx.x; e < c * c; e += blockDim.x) {
        att[e] = 0.0f;
        low[e] = 0.0f;
    }
    __syncthreads();
    if ((int)threadIdx.x < c) G[(size_t)(t0 + threadIdx.x) * nv + h] = cum[threadIdx.x];

    // [Q; K] K^T, lower triangle, over dk in tiles of GD_TILE.
    for (int d0 = 0; d0 < dk; d0 += GD_TILE) {
        int w = min(GD_TILE, dk - d0);
        for (int e = threadIdx.x; e < c * GD_TILE; e += blockDim.x) {
            int i = e / GD_TILE, d = e % GD_TILE;
            size_t at = ((size_t)(t0 + i) * nk + kh) * dk + d0 + d;
            tq[i * (GD_TILE + 1) + d] = d < w ? q[at] : 0.0f;
            tk[i * (GD_TILE + 1) + d] = d < w ? k[at] : 0.0f;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < c * c; e += blockDim.x) {
            int i = e / c, j = e % c;
            if (j > i) continue;
            float a = 0.0f, l = 0.0f;
            for (int d = 0; d < w; d++) {
                float kj = tk[j * (GD_TILE + 1) + d];
                a += tq[i * (GD_TILE + 1) + d] * kj;
                l += tk[i * (GD_TILE + 1) + d] * kj;
            }
            att[e] += a;
            low[e] += l;
        }
        __syncthreads();
    }

    // The decay mask; zero above the diagonal (those exponents are positive
    // and never evaluated).
    float* An = A + ((size_t)n * nv + h) * GD_CHUNK * GD_CHUNK;
    for (int e = threadIdx.x; e < c * c; e += blockDim.x) {
        int i = e / c, j = e % c;
        float decay = j <= i ? gd_decay(cum, i, j) : 0.0f;
        float a = j <= i ? att[e] * decay : 0.0f;
        float kke = j < i ? low[e] * decay : 0.0f;
        low[e] = bet[i] * kke;
        An[i * GD_CHUNK + j] = a;
        if (KKE) KKE[((size_t)n * nv + h) * GD_CHUNK * GD_CHUNK + i * GD_CHUNK + j] = kke;
    }
    __syncthreads();

    // (I + L) X = rhs by forward substitution, one column of [U | W] per
    // thread; x_i -= sum_{l < i} L_il x_l.
    for (int col = threadIdx.x; col < dv + dk; col += blockDim.x) {
        float x[GD_CHUNK];
        for (int i = 0; i < c; i++) {
            size_t row = (size_t)(t0 + i);
            float r = col < dv ? bet[i] * v[(row * nv + h) * dv + col]
                               : bet[i] * expf((float)cum[i]) * k[(row * nk + kh) * dk + (col - dv)];
            for (int l = 0; l < i; l++) r -= low[i * c + l] * x[l];
            x[i] = r;
            if (col < dv)
                U[(row * nv + h) * dv + col] = r;
            else
                W[(row * nv + h) * dk + (col - dv)] = r;
        }
    }
}

// starts, where not null (the backward's), receives the state entering
// every chunk: [chunks, nv, dk, dv].
extern "C" __global__ void gated_delta_chunk_scan(
    float* out, float* state, float* starts, const float* U, const float* A, const float* W,
    const double* G, const float* q, const float* k, const float* v, const float* g,
    const float* beta, const u32* slots, const u32* seq_chunk0, const u32* chunk_tok0,
    const u32* chunk_len, int seqs, int nk, int nv, int dk, int dv) {
    __shared__ float delta[GD_CHUNK * GD_COLS];
    __shared__ double cum[GD_CHUNK];
    __shared__ float dec[GD_CHUNK];
    extern __shared__ float qk[];  // 2 * dk: a one-token chunk's q and k
    int tiles = (dv + GD_COLS - 1) / GD_COLS;
    int tile = blockIdx.x % tiles, h = (blockIdx.x / tiles) % nv, s = blockIdx.x / tiles / nv;
    if (s >= seqs) return;
    int kh = h / (nv / nk);
    int tx = threadIdx.x % GD_COLS, ty = threadIdx.x / GD_COLS;
    int j = tile * GD_COLS + tx;
    bool live = j < dv;
    float* S = state + ((size_t)slots[s] * nv + h) * dk * dv;
    for (u32 n = seq_chunk0[s]; n < seq_chunk0[s + 1]; n++) {
        int t0 = (int)chunk_tok0[n], c = (int)chunk_len[n];
        if (starts) {
            float* s0 = starts + ((size_t)n * nv + h) * dk * dv;
            for (int d = ty; d < dk && live; d += GD_ROWS) s0[(size_t)d * dv + j] = S[(size_t)d * dv + j];
            __syncthreads();
        }
        if (c == 1) {
            // One token: the recurrent step itself, the bits of decode.
            for (int i = threadIdx.x; i < dk; i += blockDim.x) {
                qk[i] = q[((size_t)t0 * nk + kh) * dk + i];
                qk[dk + i] = k[((size_t)t0 * nk + kh) * dk + i];
            }
            __syncthreads();
            if (ty == 0 && live) {
                size_t at = ((size_t)t0 * nv + h) * dv + j;
                out[at] = gd_column_step(S, qk, expf(g[(size_t)t0 * nv + h]),
                                         beta[(size_t)t0 * nv + h], v[at], j, dk, dv);
            }
            __syncthreads();
            continue;
        }
        if ((int)threadIdx.x < c) cum[threadIdx.x] = G[(size_t)(t0 + threadIdx.x) * nv + h];
        __syncthreads();
        if ((int)threadIdx.x < c) dec[threadIdx.x] = gd_decay(cum, c - 1, threadIdx.x);
        // Delta = U - W S0 and O = diag(e^G) Q S0, rows i = ty (mod GD_ROWS).
        for (int i = ty; i < c && live; i += GD_ROWS) {
            size_t row = (size_t)(t0 + i);
            const float* wi = W + (row * nv + h) * dk;
            const float* qi = q + (row * nk + kh) * dk;
            float ws = 0.0f, qs = 0.0f;
            for (int d = 0; d < dk; d++) {
                float sv = S[(size_t)d * dv + j];
                ws += wi[d] * sv;
                qs += qi[d] * sv;
            }
            delta[i * GD_COLS + tx] = U[(row * nv + h) * dv + j] - ws;
            out[(row * nv + h) * dv + j] = expf((float)cum[i]) * qs;
        }
        __syncthreads();
        // O += A Delta (causal, the diagonal included), the same rows.
        const float* An = A + ((size_t)n * nv + h) * GD_CHUNK * GD_CHUNK;
        for (int i = ty; i < c && live; i += GD_ROWS) {
            float o = 0.0f;
            for (int l = 0; l <= i; l++) o += An[i * GD_CHUNK + l] * delta[l * GD_COLS + tx];
            out[((size_t)(t0 + i) * nv + h) * dv + j] += o;
        }
        // S = e^(G_last) S0 + sum_i e^(G_last - G_i) k_i delta_i^T, rows of S
        // d = ty (mod GD_ROWS); every read of S0 above is behind the barrier.
        float last = expf((float)cum[c - 1]);
        for (int d = ty; d < dk && live; d += GD_ROWS) {
            float acc = 0.0f;
            for (int i = 0; i < c; i++)
                acc += dec[i] * k[((size_t)(t0 + i) * nk + kh) * dk + d] * delta[i * GD_COLS + tx];
            S[(size_t)d * dv + j] = last * S[(size_t)d * dv + j] + acc;
        }
        __syncthreads();
    }
}

// ---- chunked backward (the WY form) ----------------------------------------
// The gradient of the chunked forward over packed sequences, three passes
// after the forward's own two (gated_delta_chunk_prep with KKE, then
// gated_delta_chunk_scan with starts, from each sequence's initial state):
// the algebra of kernels/src/cpu/gated_delta.rs's head_backward_chunked,
// its CPU reference, with Qg = diag(e^G) Q and Kd = diag(e^(G_last - G)) K.
//   gated_delta_chunk_dscan, one block per (sequence, value head, GD_COLS
//     value columns), walks the chunks in reverse carrying dS, the gradient
//     of the state leaving the chunk (zero after the last): it saves dS
//     (ds1, [chunks, nv, dk, dv]), then
//       dDelta = A^T dO + Kd dS   (ddelta, [T, nv, dv]),
//       dS    <- e^G_last dS + Qg^T dO - W^T dDelta.
//     Columns of dS never mix, as in the forward's scan.
//   gated_delta_chunk_grads, one block per (chunk, value head), touches no
//     state but its chunk's: Delta = U - W S0; dA = dO Delta^T (j <= i);
//     dQg = dO S0^T; dKd = Delta dS^T; [dRv | dRk] = (I + L)^-T [dDelta |
//     -dDelta S0^T] by back substitution, a thread per column; dL = -(dRv
//     U^T + dRk W^T) (j < i); then with P = dA . E and D = dL . E:
//       dq = diag(e^G) dQg + P K,   dv = diag(beta) dRv,
//       dk = P^T Q + diag(e^(G_last - G)) dKd + diag(beta e^G) dRk
//            + (diag(beta) D + (diag(beta) D)^T) K,
//       dbeta_i = v_i . dRv_i + e^G_i k_i . dRk_i + sum_j D_ij (k_i . k_j),
//     and dG_i, the gradient of the cumulative decay (the rows minus the
//     columns of dA . A and dL . L, plus Qg_i . dQg_i - Kd_i . dKd_i +
//     beta_i e^G_i k_i . dRk_i, and at the last token e^G_last <S0, dS> +
//     sum_i Kd_i . dKd_i), in f64, summed from the chunk's end into dg.
//     dq and dk are per value head ([T, nv, dk]) for
//     gated_delta_backward_reduce. Scratch rows [T, nv, d]: delta, dqg,
//     dkd, drv, drk.
extern "C" __global__ void gated_delta_chunk_dscan(
    float* ddelta, float* ds1, float* dS_all, const float* A, const float* W, const double* G,
    const float* q, const float* k, const float* dout, const u32* seq_chunk0,
    const u32* chunk_tok0, const u32* chunk_len, int seqs, int nk, int nv, int dk, int dv) {
    __shared__ float dd[GD_CHUNK * GD_COLS];
    __shared__ double cum[GD_CHUNK];
    __shared__ float eg[GD_CHUNK], dec[GD_CHUNK];
    int tiles = (dv + GD_COLS - 1) / GD_COLS;
    int tile = blockIdx.x % tiles, h = (blockIdx.x / tiles) % nv, s = blockIdx.x / tiles / nv;
    if (s >= seqs) return;
    int kh = h / (nv / nk);
    int tx = threadIdx.x % GD_COLS, ty = threadIdx.x / GD_COLS;
    int j = tile * GD_COLS + tx;
    bool live = j < dv;
    size_t sn = (size_t)dk * dv;
    float* dS = dS_all + ((size_t)s * nv + h) * sn;
    for (int n = (int)seq_chunk0[s + 1] - 1; n >= (int)seq_chunk0[s]; n--) {
        int t0 = (int)chunk_tok0[n], c = (int)chunk_len[n];
        if ((int)threadIdx.x < c) cum[threadIdx.x] = G[(size_t)(t0 + threadIdx.x) * nv + h];
        __syncthreads();
        if ((int)threadIdx.x < c) {
            eg[threadIdx.x] = expf((float)cum[threadIdx.x]);
            dec[threadIdx.x] = gd_decay(cum, c - 1, threadIdx.x);
        }
        float* d1 = ds1 + ((size_t)n * nv + h) * sn;
        for (int d = ty; d < dk && live; d += GD_ROWS) d1[(size_t)d * dv + j] = dS[(size_t)d * dv + j];
        __syncthreads();
        // dDelta_i = sum_{l >= i} A_li dO_l + e^(G_last - G_i) dS^T k_i.
        const float* An = A + ((size_t)n * nv + h) * GD_CHUNK * GD_CHUNK;
        for (int i = ty; i < c && live; i += GD_ROWS) {
            float acc = 0.0f;
            for (int l = i; l < c; l++)
                acc += An[l * GD_CHUNK + i] * dout[((size_t)(t0 + l) * nv + h) * dv + j];
            const float* ki = k + ((size_t)(t0 + i) * nk + kh) * dk;
            float ks = 0.0f;
            for (int d = 0; d < dk; d++) ks += ki[d] * dS[(size_t)d * dv + j];
            acc += dec[i] * ks;
            dd[i * GD_COLS + tx] = acc;
            ddelta[((size_t)(t0 + i) * nv + h) * dv + j] = acc;
        }
        __syncthreads();
        // dS <- e^G_last dS + sum_i (e^G_i q_i dO_i^T - w_i dDelta_i^T).
        float last = expf((float)cum[c - 1]);
        for (int d = ty; d < dk && live; d += GD_ROWS) {
            float acc = 0.0f;
            for (int i = 0; i < c; i++) {
                size_t row = (size_t)(t0 + i);
                acc += eg[i] * q[(row * nk + kh) * dk + d] * dout[(row * nv + h) * dv + j] -
                       W[(row * nv + h) * dk + d] * dd[i * GD_COLS + tx];
            }
            dS[(size_t)d * dv + j] = last * dS[(size_t)d * dv + j] + acc;
        }
        __syncthreads();
    }
}

// Sum over a block of GD_CHUNK_THREADS (a power of two) threads in f64;
// every thread gets the total. red holds blockDim.x doubles.
__device__ double block_sum_f64(double v, double* red) {
    __syncthreads();
    red[threadIdx.x] = v;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    double total = red[0];
    __syncthreads();
    return total;
}

extern "C" __global__ void gated_delta_chunk_grads(
    float* dq_v, float* dk_v, float* dv_out, float* dg_out, float* dbeta_out, float* delta,
    float* dqg, float* dkd, float* drv, float* drk, const float* ddelta, const float* starts,
    const float* ds1, const float* A, const float* KKE, const float* U, const float* W,
    const double* G, const float* q, const float* k, const float* v, const float* dout,
    const float* beta, const u32* chunk_tok0, const u32* chunk_len, int chunks, int nk, int nv,
    int dk, int dv) {
    __shared__ double cum[GD_CHUNK], dG[GD_CHUNK], dbl[GD_CHUNK];
    __shared__ float eg[GD_CHUNK], dec[GD_CHUNK], bet[GD_CHUNK];
    __shared__ float P[GD_CHUNK * GD_CHUNK], D[GD_CHUNK * GD_CHUNK];
    __shared__ double red[256];
    int n = blockIdx.x / nv, h = blockIdx.x % nv;
    if (n >= chunks) return;
    int kh = h / (nv / nk);
    int t0 = (int)chunk_tok0[n], c = (int)chunk_len[n];
    int tid = threadIdx.x;
    size_t sn = (size_t)dk * dv;
    size_t mat = ((size_t)n * nv + h) * GD_CHUNK * GD_CHUNK;
    const float* S0 = starts + ((size_t)n * nv + h) * sn;
    const float* dS = ds1 + ((size_t)n * nv + h) * sn;
    const float* An = A + mat;
    const float* Kn = KKE + mat;
    // Rows of token t0 + i: key-width rows of q, k ([T, nk, dk]) and of the
    // per-value-head buffers ([T, nv, dk]); value-width rows ([T, nv, dv]).
#define GD_QK(x, i) ((x) + ((size_t)(t0 + (i)) * nk + kh) * dk)
#define GD_HK(x, i) ((x) + ((size_t)(t0 + (i)) * nv + h) * dk)
#define GD_HV(x, i) ((x) + ((size_t)(t0 + (i)) * nv + h) * dv)
    if (tid < c) {
        cum[tid] = G[(size_t)(t0 + tid) * nv + h];
        bet[tid] = beta[(size_t)(t0 + tid) * nv + h];
    }
    __syncthreads();
    if (tid < c) {
        eg[tid] = expf((float)cum[tid]);
        dec[tid] = gd_decay(cum, c - 1, tid);
    }
    // Delta = U - W S0.
    for (int e = tid; e < c * dv; e += blockDim.x) {
        int i = e / dv, j = e % dv;
        const float* wi = GD_HK(W, i);
        float acc = 0.0f;
        for (int d = 0; d < dk; d++) acc += wi[d] * S0[(size_t)d * dv + j];
        GD_HV(delta, i)[j] = GD_HV(U, i)[j] - acc;
    }
    __syncthreads();
    // dQg = dO S0^T, dKd = Delta dS^T, dRk (before the solve) = -dDelta S0^T.
    for (int e = tid; e < c * dk; e += blockDim.x) {
        int i = e / dk, d = e % dk;
        const float* doi = GD_HV(dout, i);
        const float* dli = GD_HV(delta, i);
        const float* ddi = GD_HV(ddelta, i);
        float a = 0.0f, b = 0.0f, w = 0.0f;
        for (int j = 0; j < dv; j++) {
            float s0 = S0[(size_t)d * dv + j];
            a += doi[j] * s0;
            b += dli[j] * dS[(size_t)d * dv + j];
            w += ddi[j] * s0;
        }
        GD_HK(dqg, i)[d] = a;
        GD_HK(dkd, i)[d] = b;
        GD_HK(drk, i)[d] = -w;
    }
    for (int e = tid; e < c * dv; e += blockDim.x) GD_HV(drv, e / dv)[e % dv] = GD_HV(ddelta, e / dv)[e % dv];
    // dA = dO Delta^T on and below the diagonal (kept in P for now).
    for (int e = tid; e < c * c; e += blockDim.x) {
        int i = e / c, j = e % c;
        float a = 0.0f;
        if (j <= i) {
            const float* doi = GD_HV(dout, i);
            const float* dlj = GD_HV(delta, j);
            for (int x = 0; x < dv; x++) a += doi[x] * dlj[x];
        }
        P[i * GD_CHUNK + j] = a;
    }
    __syncthreads();
    // [dRv | dRk] = (I + L)^-T [dDelta | dW]: x_i -= sum_{l > i} L_li x_l,
    // one column per thread, from the last row up.
    for (int col = tid; col < dv + dk; col += blockDim.x) {
        float* base = col < dv ? drv : drk;
        int width = col < dv ? dv : dk, x = col < dv ? col : col - dv;
        for (int i = c - 2; i >= 0; i--) {
            float r = base[((size_t)(t0 + i) * nv + h) * width + x];
            for (int l = i + 1; l < c; l++)
                r -= bet[l] * Kn[l * GD_CHUNK + i] * base[((size_t)(t0 + l) * nv + h) * width + x];
            base[((size_t)(t0 + i) * nv + h) * width + x] = r;
        }
    }
    __syncthreads();
    // dL = -(dRv U^T + dRk W^T) below the diagonal (in D for now).
    for (int e = tid; e < c * c; e += blockDim.x) {
        int i = e / c, j = e % c;
        float a = 0.0f;
        if (j < i) {
            const float *ri = GD_HV(drv, i), *uj = GD_HV(U, j);
            for (int x = 0; x < dv; x++) a += ri[x] * uj[x];
            const float *rk = GD_HK(drk, i), *wj = GD_HK(W, j);
            for (int x = 0; x < dk; x++) a += rk[x] * wj[x];
        }
        D[i * GD_CHUNK + j] = -a;
    }
    __syncthreads();
    // dG's rows minus columns of dA . A and dL . L (L = diag(beta) KKE),
    // and dbeta's share sum_j dL_ij KKE_ij.
    if (tid < c) {
        int i = tid;
        double acc = 0.0, db = 0.0;
        for (int j = 0; j < c; j++) {
            if (j <= i) acc += (double)P[i * GD_CHUNK + j] * An[i * GD_CHUNK + j];
            if (j >= i) acc -= (double)P[j * GD_CHUNK + i] * An[j * GD_CHUNK + i];
            if (j < i) {
                double x = (double)D[i * GD_CHUNK + j] * Kn[i * GD_CHUNK + j];
                acc += bet[i] * x;
                db += x;
            }
            if (j > i) acc -= (double)bet[j] * D[j * GD_CHUNK + i] * Kn[j * GD_CHUNK + i];
        }
        dG[i] = acc;
        dbl[i] = db;
    }
    __syncthreads();
    // P = dA . E, D = dL . E.
    for (int e = tid; e < c * c; e += blockDim.x) {
        int i = e / c, j = e % c;
        float decay = j <= i ? gd_decay(cum, i, j) : 0.0f;
        P[i * GD_CHUNK + j] *= decay;
        D[i * GD_CHUNK + j] *= decay;
    }
    __syncthreads();
    for (int e = tid; e < c * dk; e += blockDim.x) {
        int i = e / dk, d = e % dk;
        float a = eg[i] * GD_HK(dqg, i)[d];
        for (int j = 0; j <= i; j++) a += P[i * GD_CHUNK + j] * GD_QK(k, j)[d];
        GD_HK(dq_v, i)[d] = a;
        float b = dec[i] * GD_HK(dkd, i)[d] + bet[i] * eg[i] * GD_HK(drk, i)[d];
        for (int l = i; l < c; l++) b += P[l * GD_CHUNK + i] * GD_QK(q, l)[d];
        for (int j = 0; j < c; j++)
            b += (bet[i] * D[i * GD_CHUNK + j] + bet[j] * D[j * GD_CHUNK + i]) * GD_QK(k, j)[d];
        GD_HK(dk_v, i)[d] = b;
    }
    for (int e = tid; e < c * dv; e += blockDim.x) {
        int i = e / dv, j = e % dv;
        GD_HV(dv_out, i)[j] = bet[i] * GD_HV(drv, i)[j];
    }
    // The per-token scalars, a thread per token.
    double last_share = 0.0;
    if (tid < c) {
        int i = tid;
        const float *qi = GD_QK(q, i), *ki = GD_QK(k, i), *vi = GD_HV(v, i);
        const float *rv = GD_HV(drv, i), *rk = GD_HK(drk, i);
        const float *gq = GD_HK(dqg, i), *gk = GD_HK(dkd, i);
        double k_rk = 0.0, v_rv = 0.0, q_gq = 0.0, k_gk = 0.0;
        for (int d = 0; d < dk; d++) {
            k_rk += (double)ki[d] * rk[d];
            q_gq += (double)qi[d] * gq[d];
            k_gk += (double)ki[d] * gk[d];
        }
        for (int j = 0; j < dv; j++) v_rv += (double)vi[j] * rv[j];
        dbeta_out[(size_t)(t0 + i) * nv + h] = (float)(v_rv + eg[i] * k_rk + dbl[i]);
        double kd_gk = dec[i] * k_gk;
        dG[i] += eg[i] * q_gq - kd_gk + (double)bet[i] * eg[i] * k_rk;
        last_share = kd_gk;
    }
    double part = last_share;
    float last = expf((float)cum[c - 1]);
    for (size_t x = tid; x < sn; x += blockDim.x) part += (double)last * S0[x] * dS[x];
    double total = block_sum_f64(part, red);
    if (tid == 0) {
        dG[c - 1] += total;
        double acc = 0.0;
        for (int i = c - 1; i >= 0; i--) {
            acc += dG[i];
            dg_out[(size_t)(t0 + i) * nv + h] = (float)acc;
        }
    }
#undef GD_QK
#undef GD_HK
#undef GD_HV
}

// ---- backward -----------------------------------------------------------
// The recurrence's backward for one sequence of t tokens from state0, one
// block per value head, by re-computation (fp32 throughout, as the CPU
// reference kernels/src/cpu/gated_delta.rs computes it):
//   1. forward from state0, keeping the state at every chunk start
//      (ckpt[c], chunk = GD_CHUNK tokens);
//   2. chunks in reverse: replay the chunk from its checkpoint keeping
//      every state (st[0..len]) and v - S_a^T k (res), then walk its tokens
//      backwards carrying dS, the gradient of the state.
// Per token, with S_a = e^g S_prev, delta = beta (v - S_a^T k),
// S = S_a + k delta^T, o = S^T q:
//   dS += q do^T;  ddelta = dS^T k;  dv = beta ddelta;
//   dbeta = ddelta . (v - S_a^T k);  dkv = -beta ddelta;
//   dq = S do;  dk = dS delta + S_a dkv;
//   dS_a = dS + k dkv^T;  dg = sum(S_a * dS_a);  dS_prev = e^g dS_a.
// Phases alternate between a thread per column j (dv) and per row i (dk).
// dq and dk are written per value head ([t, nv, dk]); gd_backward_reduce
// adds a key head's value heads in order. Scratch per head: ckpt
// [chunks, dk, dv], st [GD_CHUNK + 1, dk, dv], dS [dk, dv], res
// [GD_CHUNK, dv]. Shared: q, k, do, delta, dkv and two partial sums.
extern "C" __global__ void gated_delta_backward(
    float* dq_v, float* dk_v, float* dv_out, float* dg_out, float* dbeta_out, float* dstate0,
    float* ckpt, float* st, float* dS_all, float* res_all, const float* dout, const float* state0,
    const float* q, const float* k, const float* v, const float* g, const float* beta, int t,
    int nk, int nv, int dk, int dv) {
    extern __shared__ float sh[];
    float* sq = sh;            // dk
    float* sk = sq + dk;       // dk
    float* sdo = sk + dk;      // dv
    float* sdelta = sdo + dv;  // dv
    float* sdkv = sdelta + dv; // dv
    __shared__ float scratch[32];
    int h = blockIdx.x;
    if (h >= nv) return;
    int kh = h / (nv / nk);
    size_t sn = (size_t)dk * dv;
    int chunks = (t + GD_CHUNK - 1) / GD_CHUNK;
    float* ck = ckpt + (size_t)h * chunks * sn;
    float* sts = st + (size_t)h * (GD_CHUNK + 1) * sn;
    float* dS = dS_all + (size_t)h * sn;
    float* res = res_all + (size_t)h * GD_CHUNK * dv;
    const float* s0 = state0 + (size_t)h * sn;

    // 1. Checkpoints: ck[c] is the state before token c * GD_CHUNK.
    for (size_t x = threadIdx.x; x < sn; x += blockDim.x) {
        ck[x] = s0[x];
        dS[x] = 0.0f;
    }
    __syncthreads();
    for (int c = 0; c + 1 < chunks; c++) {
        float* S = ck + (size_t)(c + 1) * sn;
        for (size_t x = threadIdx.x; x < sn; x += blockDim.x) S[x] = ck[(size_t)c * sn + x];
        __syncthreads();
        for (int tt = c * GD_CHUNK; tt < (c + 1) * GD_CHUNK; tt++) {
            for (int i = threadIdx.x; i < dk; i += blockDim.x) {
                sq[i] = q[((size_t)tt * nk + kh) * dk + i];
                sk[i] = k[((size_t)tt * nk + kh) * dk + i];
            }
            __syncthreads();
            float decay = expf(g[(size_t)tt * nv + h]), b = beta[(size_t)tt * nv + h];
            for (int j = threadIdx.x; j < dv; j += blockDim.x)
                gd_column_step(S, sq, decay, b, v[((size_t)tt * nv + h) * dv + j], j, dk, dv);
            __syncthreads();
        }
    }

    // 2. Chunks in reverse.
    for (int c = chunks - 1; c >= 0; c--) {
        int t0 = c * GD_CHUNK;
        int len = t - t0 < GD_CHUNK ? t - t0 : GD_CHUNK;
        for (size_t x = threadIdx.x; x < sn; x += blockDim.x) sts[x] = ck[(size_t)c * sn + x];
        __syncthreads();
        // Replay: st[u + 1] is the state after token t0 + u; res[u] = v - S_a^T k.
        for (int u = 0; u < len; u++) {
            int tt = t0 + u;
            for (int i = threadIdx.x; i < dk; i += blockDim.x) sk[i] = k[((size_t)tt * nk + kh) * dk + i];
            __syncthreads();
            float decay = expf(g[(size_t)tt * nv + h]), b = beta[(size_t)tt * nv + h];
            const float* P = sts + (size_t)u * sn;
            float* S = sts + (size_t)(u + 1) * sn;
            for (int j = threadIdx.x; j < dv; j += blockDim.x) {
                float kv = 0.0f;
                for (int i = 0; i < dk; i++) kv += P[(size_t)i * dv + j] * decay * sk[i];
                float r = v[((size_t)tt * nv + h) * dv + j] - kv;
                res[(size_t)u * dv + j] = r;
                float delta = b * r;
                for (int i = 0; i < dk; i++)
                    S[(size_t)i * dv + j] = P[(size_t)i * dv + j] * decay + sk[i] * delta;
            }
            __syncthreads();
        }
        for (int u = len - 1; u >= 0; u--) {
            int tt = t0 + u;
            float decay = expf(g[(size_t)tt * nv + h]), b = beta[(size_t)tt * nv + h];
            const float* P = sts + (size_t)u * sn;        // state before the token
            const float* S = sts + (size_t)(u + 1) * sn;  // state after it
            for (int i = threadIdx.x; i < dk; i += blockDim.x) {
                sq[i] = q[((size_t)tt * nk + kh) * dk + i];
                sk[i] = k[((size_t)tt * nk + kh) * dk + i];
            }
            for (int j = threadIdx.x; j < dv; j += blockDim.x)
                sdo[j] = dout[((size_t)tt * nv + h) * dv + j];
            __syncthreads();
            // Columns: dS += q do^T, then ddelta, dv, dbeta's share, dkv.
            float pb = 0.0f;
            for (int j = threadIdx.x; j < dv; j += blockDim.x) {
                float dd = 0.0f;
                for (int i = 0; i < dk; i++) {
                    float x = dS[(size_t)i * dv + j] + sq[i] * sdo[j];
                    dS[(size_t)i * dv + j] = x;
                    dd += x * sk[i];
                }
                float r = res[(size_t)u * dv + j];
                dv_out[((size_t)tt * nv + h) * dv + j] = b * dd;
                pb += dd * r;
                sdelta[j] = b * r;
                sdkv[j] = -b * dd;
            }
            pb = block_sum(pb, scratch);
            if (threadIdx.x == 0) dbeta_out[(size_t)tt * nv + h] = pb;
            __syncthreads();
            // Rows: dq = S do, dk = dS delta + S_a dkv.
            for (int i = threadIdx.x; i < dk; i += blockDim.x) {
                float a = 0.0f, bk = 0.0f;
                for (int j = 0; j < dv; j++) {
                    a += S[(size_t)i * dv + j] * sdo[j];
                    bk += dS[(size_t)i * dv + j] * sdelta[j] + P[(size_t)i * dv + j] * decay * sdkv[j];
                }
                dq_v[((size_t)tt * nv + h) * dk + i] = a;
                dk_v[((size_t)tt * nv + h) * dk + i] = bk;
            }
            __syncthreads();
            // Columns: dS_a = dS + k dkv^T; dg's share; dS_prev = e^g dS_a.
            float pg = 0.0f;
            for (int j = threadIdx.x; j < dv; j += blockDim.x) {
                for (int i = 0; i < dk; i++) {
                    float x = dS[(size_t)i * dv + j] + sk[i] * sdkv[j];
                    pg += P[(size_t)i * dv + j] * decay * x;
                    dS[(size_t)i * dv + j] = x * decay;
                }
            }
            pg = block_sum(pg, scratch);
            if (threadIdx.x == 0) dg_out[(size_t)tt * nv + h] = pg;
            __syncthreads();
        }
    }
    if (dstate0)
        for (size_t x = threadIdx.x; x < sn; x += blockDim.x) dstate0[(size_t)h * sn + x] = dS[x];
}

// dq[t, kh] = sum over the value heads h of key head kh, in order, of
// dq_v[t, h] (and the same for dk). One thread per (token, key head, i).
extern "C" __global__ void gated_delta_backward_reduce(float* dq, float* dk, const float* dq_v,
                                                       const float* dk_v, int t, int nk, int nv,
                                                       int dkd) {
    long long n = (long long)t * nk * dkd;
    for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n;
         x += (long long)gridDim.x * blockDim.x) {
        int i = (int)(x % dkd);
        long long row = x / dkd;
        int kh = (int)(row % nk);
        long long tt = row / nk;
        int group = nv / nk;
        float a = 0.0f, b = 0.0f;
        for (int u = 0; u < group; u++) {
            size_t at = ((size_t)tt * nv + kh * group + u) * dkd + i;
            a += dq_v[at];
            b += dk_v[at];
        }
        dq[x] = a;
        dk[x] = b;
    }
}
