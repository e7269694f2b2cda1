// A batch-invariant matrix product for the engine's deterministic mode:
// out[n, oc] (+)= inp[n, c] @ w[oc, c]^T with every output summed over k
// in order 0, 1, ..., c - 1 (fmaf into one fp32 accumulator), however many
// rows share the launch and wherever a row falls in its tile. So a row
// gets the same bits decoded alone, in a batch of 32 or in a prefill, as
// on the CPU; cuBLAS picks its kernel (and its order of sums) by shape.
// Inputs f32 or bf16 (raw bits), output f32 or bf16 (rounded once from
// the fp32 sum); an added output (`add`) is f32: out + sum.
//
// A block computes a MM_TILE x MM_TILE tile of out with 256 threads, each
// 4 x 4 outputs (rows tr + 16 i, columns tc + 16 j), the operands staged
// in shared memory MM_K columns of k at a time. Rows past n are skipped,
// so a decode step costs what its rows need.

#define MM_TILE 64
#define MM_K 16
#define MM_THREADS 256

__device__ __forceinline__ float mm_load(const void* p, size_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const bf16_t*)p)[i]) : ((const float*)p)[i];
}

extern "C" __global__ void __launch_bounds__(MM_THREADS)
    matmul_invariant(void* out, const void* inp, const void* w, int n, int c, int oc,
                     int in_bf16, int w_bf16, int out_bf16, int add) {
    __shared__ float sa[MM_K][MM_TILE + 1];
    __shared__ float sb[MM_K][MM_TILE + 1];
    int row0 = blockIdx.y * MM_TILE, col0 = blockIdx.x * MM_TILE;
    int tr = threadIdx.x / 16, tc = threadIdx.x % 16;
    float acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < c; k0 += MM_K) {
        int kn = c - k0 < MM_K ? c - k0 : MM_K;
        for (int e = threadIdx.x; e < MM_TILE * MM_K; e += MM_THREADS) {
            int r = e / MM_K, kk = e % MM_K;
            bool in_k = kk < kn;
            sa[kk][r] = in_k && row0 + r < n ? mm_load(inp, (size_t)(row0 + r) * c + k0 + kk, in_bf16)
                                             : 0.0f;
            sb[kk][r] = in_k && col0 + r < oc ? mm_load(w, (size_t)(col0 + r) * c + k0 + kk, w_bf16)
                                              : 0.0f;
        }
        __syncthreads();
        for (int kk = 0; kk < kn; kk++) {
            float b[4];
            for (int j = 0; j < 4; j++) b[j] = sb[kk][tc + 16 * j];
            for (int i = 0; i < 4; i++) {
                if (row0 + tr + 16 * i >= n) break;
                float a = sa[kk][tr + 16 * i];
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a, b[j], acc[i][j]);
            }
        }
        __syncthreads();
    }
    for (int i = 0; i < 4; i++) {
        int r = row0 + tr + 16 * i;
        if (r >= n) break;
        for (int j = 0; j < 4; j++) {
            int col = col0 + tc + 16 * j;
            if (col >= oc) continue;
            size_t at = (size_t)r * oc + col;
            if (out_bf16)
                ((bf16_t*)out)[at] = f32_to_bf16(acc[i][j]);
            else if (add)
                ((float*)out)[at] = ((float*)out)[at] + acc[i][j];
            else
                ((float*)out)[at] = acc[i][j];
        }
    }
}
