// Shared by every arcticd CUDA module: prepended to each .cu source before
// NVRTC compiles it (NVRTC ships no CUDA headers, so nothing is #included).
// bf16 travels as its raw 16 bits; every computation is in fp32.

// No math.h under NVRTC: the two special values by their bits.
#define NEG_INF __int_as_float(0xff800000)
#define F32_NAN __int_as_float(0x7fc00000)

typedef unsigned short bf16_t;
typedef unsigned int u32;

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round to nearest even, NaN kept quiet (as half::bf16::from_f32 on the host).
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u32 round = 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)((u + round) >> 16);
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf(float x) { return x / (1.0f + expf(-x)); }
// log(1 + e^x), with the linear tail torch's softplus uses (threshold 20).
__device__ __forceinline__ float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the total. `scratch` holds 32 floats of shared memory.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// rsqrt(sum(x[0..n)^2) / div + eps) over one row, every thread of the block
// taking part; every thread gets the result. div = n for RMSNorm, 1 for
// the L2 norm.
__device__ float row_rsqrt(const float* x, int n, float div, float eps, float* scratch) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, scratch);
    return rsqrtf(ss / div + eps);
}
