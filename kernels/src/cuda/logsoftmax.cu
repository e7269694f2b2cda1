// Log-probabilities of chosen tokens and greedy picks over the vocabulary,
// one block per row, in fp32. The distribution is the one sampled from:
// logits * inv_temp (the engine reports and the trainer trains the same
// quantity). CPU reference: kernels/src/cpu/logsoftmax.rs.

// log sum_i exp(x[i] * inv_temp) over one row, every thread of the block
// taking part (max first, then the sum of shifted exponentials).
__device__ float row_logsumexp(const float* x, int vocab, float inv_temp, float* scratch) {
    float m = NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, x[i] * inv_temp);
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += expf(x[i] * inv_temp - m);
    sum = block_sum(sum, scratch);
    return m + logf(sum);
}

// out[r] = log softmax(logits[r] * inv_temp)[targets[r]]
extern "C" __global__ void logprob_gather_forward(float* out, const float* logits,
                                                  const u32* targets, int rows, int vocab,
                                                  float inv_temp) {
    __shared__ float scratch[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (size_t)r * vocab;
    float lse = row_logsumexp(x, vocab, inv_temp, scratch);
    if (threadIdx.x == 0) {
        u32 t = targets[r];
        out[r] = t < (u32)vocab ? x[t] * inv_temp - lse : F32_NAN;
    }
}

// out[r] = argmax_i logits[r, i] with the CPU's rule (its first strictly
// larger scan): the lowest index on ties; a NaN only at index 0, where it starts.
extern "C" __global__ void argmax_forward(u32* out, const float* logits, int rows, int vocab) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (size_t)r * vocab;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = x[i];
        if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { best_v[warp] = bv; best_i[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        int warps = blockDim.x >> 5;
        for (int w = 1; w < warps; w++)
            if (best_v[w] > best_v[0] || (best_v[w] == best_v[0] && best_i[w] < best_i[0])) {
                best_v[0] = best_v[w];
                best_i[0] = best_i[w];
            }
        out[r] = best_i[0] == 0x7fffffff || x[0] != x[0] ? 0u : (u32)best_i[0];
    }
}

// Backward of logprob_gather_forward, written: with p = softmax(logits[r] *
// inv_temp), dlogits[r] = dlp[r] * inv_temp * (onehot(targets[r]) - p). The
// softmax is recomputed from the logits (nothing [rows, vocab] is kept).
extern "C" __global__ void logprob_gather_backward(float* dlogits, const float* dlp,
                                                   const float* logits, const u32* targets,
                                                   int rows, int vocab, float inv_temp) {
    __shared__ float scratch[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (size_t)r * vocab;
    float* d = dlogits + (size_t)r * vocab;
    float lse = row_logsumexp(x, vocab, inv_temp, scratch);
    float g = dlp[r] * inv_temp;
    u32 y = targets[r];
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        d[i] = -g * expf(x[i] * inv_temp - lse) + ((u32)i == y ? g : 0.0f);
}

// One token per row, drawn as the engine's sampler draws it (CPU reference:
// engine/src/sampler.rs, untruncated): with lp = log softmax(logits[r] *
// inv_t[r]), a row with u[r] < 0 takes the argmax of its logits (greedy,
// inv_t 1), any other the first index i with u[r] < sum_{j <= i} exp(lp[j])
// (the inverse CDF in vocabulary order, sums in f64), or the last index of
// positive probability when u reaches the total. token[r] is the pick and
// logprob[r] its lp. The f64 sums run per thread over a contiguous piece of
// the row, then across the pieces, so a pick can differ from the host's
// sequential sum only where u lies within f64 rounding of a boundary.
// blockDim.x at most SAMPLE_THREADS.
#define SAMPLE_THREADS 256

extern "C" __global__ void sample_rows(u32* token, float* logprob, const float* logits,
                                       const float* inv_t, const double* u, int rows, int vocab) {
    __shared__ float scratch[32];
    __shared__ double part[SAMPLE_THREADS];
    __shared__ int last[SAMPLE_THREADS];
    __shared__ int pick;
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (size_t)r * vocab;
    float it = inv_t[r];
    double ur = u[r];
    float lse = row_logsumexp(x, vocab, it, scratch);
    if (ur < 0.0) {
        // Greedy: the lowest index of the largest logit.
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float v = x[i];
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
        float m = block_max(bv, scratch);
        int cand = bv == m ? bi : 0x7fffffff;
        __syncthreads();
        if (threadIdx.x == 0) pick = 0x7fffffff;
        __syncthreads();
        atomicMin(&pick, cand);
        __syncthreads();
        if (threadIdx.x == 0) {
            int t = pick == 0x7fffffff || x[0] != x[0] ? 0 : pick;
            token[r] = (u32)t;
            logprob[r] = x[t] * it - lse;
        }
        return;
    }
    int per = (vocab + blockDim.x - 1) / blockDim.x;
    int lo = threadIdx.x * per, hi = min(lo + per, vocab);
    double s = 0.0;
    int lastpos = -1;
    for (int i = lo; i < hi; i++) {
        double p = exp((double)(x[i] * it - lse));
        if (p > 0.0) lastpos = i;
        s += p;
    }
    part[threadIdx.x] = s;
    last[threadIdx.x] = lastpos;
    __syncthreads();
    if (threadIdx.x == 0) {
        double acc = 0.0;
        int t = -1, fallback = 0;
        for (int w = 0; w < (int)blockDim.x && t < 0; w++) {
            if (last[w] >= 0) fallback = last[w];
            if (ur < acc + part[w]) {
                int a = w * per, b = min(a + per, vocab);
                for (int i = a; i < b; i++) {
                    acc += exp((double)(x[i] * it - lse));
                    if (ur < acc) { t = i; break; }
                }
                // Not crossed (the piece's two sums rounded apart): go on.
            } else {
                acc += part[w];
            }
        }
        if (t < 0) {
            for (int w = 0; w < (int)blockDim.x; w++)
                if (last[w] >= 0) fallback = last[w];
            t = fallback;
        }
        token[r] = (u32)t;
        logprob[r] = x[t] * it - lse;
    }
}

// ---- entropy ------------------------------------------------------------
// The policy's entropy per row, for entropy bonuses: with s = logits[r] *
// inv_temp and lp = log softmax(s), H = -sum_j exp(lp_j) lp_j, sums in f64
// (CPU reference: entropy_forward and entropy_backward in
// kernels/src/cpu/logsoftmax.rs, on the scaled logits).

__device__ double block_sum_f64(double v, double* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = lane < warps ? scratch[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// H of row r, every thread of the block taking part; lse is the row's
// log-sum-exp of the scaled logits.
__device__ double row_entropy(const float* x, int vocab, float inv_temp, float lse,
                              double* scratch) {
    double h = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        double lp = (double)(x[i] * inv_temp) - (double)lse;
        h -= exp(lp) * lp;
    }
    return block_sum_f64(h, scratch);
}

extern "C" __global__ void entropy_forward(float* out, const float* logits, int rows, int vocab,
                                           float inv_temp) {
    __shared__ float scratch[32];
    __shared__ double dscratch[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (size_t)r * vocab;
    float lse = row_logsumexp(x, vocab, inv_temp, scratch);
    double h = row_entropy(x, vocab, inv_temp, lse, dscratch);
    if (threadIdx.x == 0) out[r] = (float)h;
}

// dlogits[r, j] += dent[r] * inv_temp * -p_j (lp_j + H): accumulates onto
// logprob_gather_backward's output (the inv_temp is d s / d logits).
extern "C" __global__ void entropy_backward(float* dlogits, const float* dent, const float* logits,
                                            int rows, int vocab, float inv_temp) {
    __shared__ float scratch[32];
    __shared__ double dscratch[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (size_t)r * vocab;
    float* d = dlogits + (size_t)r * vocab;
    float lse = row_logsumexp(x, vocab, inv_temp, scratch);
    double h = row_entropy(x, vocab, inv_temp, lse, dscratch);
    double g = (double)dent[r] * (double)inv_temp;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        double lp = (double)(x[i] * inv_temp) - (double)lse;
        d[i] += (float)(g * -exp(lp) * (lp + h));
    }
}
