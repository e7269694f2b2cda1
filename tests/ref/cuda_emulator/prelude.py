"""Transcription of kernels/src/cuda/prelude.cuh (tags `# p:NNN` name its
lines) and the CUDA math functions the kernels call, shared by every
kernel transcription here. float is float32, double float64; `yield
("shfl", o, v, label)` is __shfl_xor_sync(0xffffffff, v, o) (simt_warp.py),
a plain `yield "pNN"` is __syncthreads() at prelude line NN. The math
functions are numpy's, correctly rounded or nearly: the device's `expf`,
`rsqrtf` and friends differ in the last bits, which no check here relies
on."""
import numpy as np
from simt import F, D

NEG_INF = F(-np.inf)  # p:6
F32_NAN = F(np.nan)  # p:7

def u(x): return int(x)
def expf(x): return np.exp(F(x))
def logf(x): return np.log(F(x))
def log1pf(x): return np.log1p(F(x))
def fmaxf(a, b): return np.fmax(F(a), F(b))
def rsqrtf(x): return F(1.0 / np.sqrt(D(F(x))))
# fmaf(a, b, c): a * b is exact in float64 and the sum is rounded to float64,
# then to float32 -- a double rounding that a true fused multiply-add does
# not do (it can differ in the last bit in rare cases).
def fmaf(a, b, c): return F(D(F(a)) * D(F(b)) + D(F(c)))

# p:12
def bf16_to_f32(h): return np.uint32(int(h) << 16).view(np.float32)

# p:17
def f32_to_bf16(f):
    u_ = int(np.float32(f).view(np.uint32))
    if (u_ & 0x7fffffff) > 0x7f800000: return np.uint16((u_ >> 16) | 0x40)  # p:19
    return np.uint16(((u_ + 0x7fff + ((u_ >> 16) & 1)) >> 16) & 0xffff)  # p:20-21

def sigmoidf(x): return F(F(1.0) / F(F(1.0) + expf(-F(x))))  # p:24
def siluf(x): return F(F(x) / F(F(1.0) + expf(-F(x))))  # p:25
def softplusf(x): return F(x) if F(x) > F(20.0) else log1pf(expf(x))  # p:27

# p:29
def warp_sum(v):
    o = 16
    while o > 0:
        v = F(v + (yield ("shfl", o, F(v), "warp_sum")))  # p:30
        o >>= 1
    return v

# p:34
def warp_max(v):
    o = 16
    while o > 0:
        v = fmaxf(v, (yield ("shfl", o, F(v), "warp_max")))  # p:35
        o >>= 1
    return v

# p:41
def block_sum(v, scratch, tid, bdim):
    lane, warp = tid & 31, tid >> 5
    v = yield from warp_sum(v)
    yield "p44"
    if lane == 0: scratch[warp] = v  # p:45
    yield "p46"
    warps = bdim >> 5
    v = scratch[lane] if lane < warps else F(0.0)  # p:48
    return (yield from warp_sum(v))

# p:52
def block_max(v, scratch, tid, bdim):
    lane, warp = tid & 31, tid >> 5
    v = yield from warp_max(v)
    yield "p55"
    if lane == 0: scratch[warp] = v  # p:56
    yield "p57"
    warps = bdim >> 5
    v = scratch[lane] if lane < warps else NEG_INF  # p:59
    return (yield from warp_max(v))

# p:66
def row_rsqrt(x, n, div, eps, scratch, tid, bdim):
    ss = F(0.0)
    i = tid
    while i < n:  # p:68
        ss = F(ss + F(x[i] * x[i]))
        i += bdim
    ss = yield from block_sum(ss, scratch, tid, bdim)  # p:69
    return rsqrtf(F(F(ss / F(div)) + F(eps)))  # p:70
