// Token embedding lookup, one block per token. An id out of range writes
// zeros (the host checks ids before launch; this only keeps memory safe).
// CPU reference: kernels/src/cpu/embedding.rs.

extern "C" __global__ void embedding_forward_f32(float* out, const u32* ids, const float* table,
                                                 int n, int c, int vocab) {
    int t = blockIdx.x;
    if (t >= n) return;
    u32 id = ids[t];
    float* y = out + (size_t)t * c;
    for (int i = threadIdx.x; i < c; i += blockDim.x)
        y[i] = id < (u32)vocab ? table[(size_t)id * c + i] : 0.0f;
}

extern "C" __global__ void embedding_forward_bf16(float* out, const u32* ids,
                                                  const bf16_t* table, int n, int c, int vocab) {
    int t = blockIdx.x;
    if (t >= n) return;
    u32 id = ids[t];
    float* y = out + (size_t)t * c;
    for (int i = threadIdx.x; i < c; i += blockDim.x)
        y[i] = id < (u32)vocab ? bf16_to_f32(table[(size_t)id * c + i]) : 0.0f;
}

// Weights travel to the device as bf16; the trainer's masters stay fp32.
extern "C" __global__ void f32_to_bf16_copy(bf16_t* out, const float* inp, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(inp[i]);
}

// Backward of the lookup, deterministic: the host sorts the token
// positions by id (stable, so each id's tokens stay in position order) and
// passes, per distinct id u, ids_sorted[u] and its tokens
// order[starts[u] .. starts[u + 1]]. One block per distinct id adds its
// tokens' gradients in that order: dtable[id] += sum dout[t] (accumulates).
extern "C" __global__ void embedding_backward(float* dtable, const float* dout,
                                              const u32* ids_sorted, const u32* starts,
                                              const u32* order, int distinct, int c) {
    int u = blockIdx.x;
    if (u >= distinct) return;
    float* row = dtable + (size_t)ids_sorted[u] * c;
    u32 a = starts[u], b = starts[u + 1];
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        float acc = row[i];
        for (u32 k = a; k < b; k++) acc += dout[(size_t)order[k] * c + i];
        row[i] = acc;
    }
}
