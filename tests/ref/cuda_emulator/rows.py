"""Transcription of the row kernels: kernels/src/cuda/norm.cu (tags `#
norm:NNN`: rmsnorm_forward, add_rmsnorm_forward, gated_rmsnorm_forward,
l2norm_forward, rmsnorm_backward, gated_rmsnorm_backward, the COLUMN_SUM
macro of rmsnorm_weight_grad and gated_rmsnorm_weight_grad, l2norm_backward)
and kernels/src/cuda/logsoftmax.cu (tags `# ls:NNN`: row_logsumexp,
logprob_gather_forward, argmax_forward, logprob_gather_backward, sample_rows,
block_sum_f64, row_entropy, entropy_forward, entropy_backward), each tag
naming the line of that file it transcribes (as of the commit that added
this file), with the launch each gets from device.rs / device/backward.rs
(`rows(n)`: a block of 256 per row; `columns(c)`: c/32 blocks of (32, 8);
`sample_rows`' draws), checked against float64 references written from the
math (kernels/src/cpu/rmsnorm.rs, l2norm.rs, logsoftmax.rs and
engine/src/sampler.rs for the semantics).

`float` is float32 (F), `double` float64 (D), every operation rounded as
the kernel does; fused multiply-adds the compiler may contract are not
modelled, nor the last bits of the device's expf / rsqrtf / exp.
prelude.cuh's helpers come from prelude.py.

What the runner (simt_warp.py) lacks, emulated here:
  * COLUMN_SUM's block is (32, 8): linearized to 256 threads with
    threadIdx.x = tid % 32, threadIdx.y = tid // 32 (CUDA's own numbering,
    so a warp is one threadIdx.y).
  * argmax_forward shuffles an int and block_sum_f64 a double: the runner
    hands the value through unchanged (it only makes a NaN float where a
    source lane is missing, which it reports anyway), so the same `yield
    ("shfl", ...)` serves.
  * sample_rows' atomicMin on the shared int `pick` (its greedy branch) is
    done on the underlying numpy array, outside the tracker (an atomic is
    no race); the barriers around it are the kernel's, and the plain read
    of `pick` after them is tracked.
  * int shared arrays (best_i, last, pick) are Bufs made here (simt.shared
    fills with NaN, which an int array cannot hold), filled with a junk
    value and tracked like any shared memory.
Outputs start as NaN (u32 outputs as 0xDEADBEEF), so an element never
written shows; accumulated outputs (+=) start at known non-zero values.

Every check is max |diff| / max |ref| against 1e-6, or exact (tokens, the
bits of a log-prob against logprob_gather_forward's). Two denominators are
floored, each named in its line: an output added onto `old` values is
measured against max(|ref|, |old|); a norm's dinp against the size of the
two terms it is the difference of (|r dy'|: at c = 1 dinp is ~eps and all
cancellation); a log-softmax output against |lse| * |d ref / d lse| as well
(`lse_floor`), because the kernels (and the CPU references) take the row's
log-sum-exp in float32, whose rounding alone moves, e.g., the entropy of a
peaked row (1/T 20, lse ~ 180) by 3e-5 of H; such lines print the plain
ratio too.

Usage: python rows.py [group ...]   (groups: ref norm wgrad lsm argmax
sample entropy; all by default)"""
import sys, time
import numpy as np
from simt import T, Buf, F, D, launch, shared
from simt_warp import launch as launch_warp
from prelude import u, expf, logf, fmaxf, rsqrtf, sigmoidf, siluf, block_sum, block_max, row_rsqrt
from prelude import NEG_INF, F32_NAN
from report import buf, nan_buf, say, check, run_groups

np.seterr(all="ignore")  # the kernels' -inf and NaN arithmetic is deliberate here

INT_MAX = 0x7fffffff
U32_JUNK = 0xDEADBEEF

def ishared(name, n):
    """An int __shared__ array (see the docstring): tracked, junk-filled."""
    return Buf(name, np.full(n, -123456789, np.int64), shared=True)

def atomic_min(b, i, v):
    """atomicMin(&b[i], v) on shared memory: on the numpy array, untracked."""
    if v < b.a[i]: b.a[i] = v

# ---- norm.cu -----------------------------------------------------------------

# norm:5; sh is the static scratch[32] (norm:7)
def rmsnorm_forward(bx, tid, bdim, gdim, sh, out, rstd, inp, weight, n, c, eps):
    scratch = sh  # norm:7
    row = bx  # norm:8
    if row >= n: return  # norm:9
    x = inp + row * c  # norm:10
    y = out + row * c  # norm:11
    s = yield from row_rsqrt(x, c, F(c), eps, scratch, tid, bdim)  # norm:12
    i = tid  # norm:13
    while i < c:  # norm:13
        y[i] = F(F(x[i] * s) * F(F(1.0) + weight[i]))  # norm:13
        i += bdim  # norm:13
    if tid == 0: rstd[row] = s  # norm:14

# norm:19
def add_rmsnorm_forward(bx, tid, bdim, gdim, sh, out, rstd, res, inp, weight, n, c, eps):
    scratch = sh  # norm:22
    row = bx  # norm:23
    if row >= n: return  # norm:24
    r = res + row * c  # norm:25
    x = inp + row * c  # norm:26
    y = out + row * c  # norm:27
    ss = F(0.0)  # norm:28
    i = tid  # norm:29
    while i < c:  # norm:29
        v = F(r[i] + x[i])  # norm:30
        r[i] = v  # norm:31
        ss = F(ss + F(v * v))  # norm:32
        i += bdim  # norm:29
    ss = yield from block_sum(ss, scratch, tid, bdim)  # norm:34
    s = rsqrtf(F(F(ss / F(c)) + F(eps)))  # norm:35
    i = tid  # norm:36
    while i < c:  # norm:36
        y[i] = F(F(r[i] * s) * F(F(1.0) + weight[i]))  # norm:36
        i += bdim  # norm:36
    if tid == 0: rstd[row] = s  # norm:37

# norm:42
def gated_rmsnorm_forward(bx, tid, bdim, gdim, sh, out, rstd, inp, gate, weight, n, c, eps):
    scratch = sh  # norm:45
    row = bx  # norm:46
    if row >= n: return  # norm:47
    x = inp + row * c  # norm:48
    z = gate + row * c  # norm:49
    y = out + row * c  # norm:50
    s = yield from row_rsqrt(x, c, F(c), eps, scratch, tid, bdim)  # norm:51
    i = tid  # norm:52
    while i < c:  # norm:52
        y[i] = F(F(F(x[i] * s) * weight[i]) * siluf(z[i]))  # norm:52
        i += bdim  # norm:52
    if tid == 0: rstd[row] = s  # norm:53

# norm:57
def l2norm_forward(bx, tid, bdim, gdim, sh, out, rnorm, inp, n, d, eps, scale):
    scratch = sh  # norm:59
    row = bx  # norm:60
    if row >= n: return  # norm:61
    x = inp + row * d  # norm:62
    y = out + row * d  # norm:63
    s = yield from row_rsqrt(x, d, F(1.0), eps, scratch, tid, bdim)  # norm:64
    i = tid  # norm:65
    while i < d:  # norm:65
        y[i] = F(F(x[i] * s) * scale)  # norm:65
        i += bdim  # norm:65
    if tid == 0: rnorm[row] = s  # norm:66

# norm:75
def rmsnorm_backward(bx, tid, bdim, gdim, sh, dinp, dout, inp, weight, rstd, n, c):
    scratch = sh  # norm:78
    row = bx  # norm:79
    if row >= n: return  # norm:80
    x = inp + row * c  # norm:81
    dy = dout + row * c  # norm:82
    dx = dinp + row * c  # norm:83
    r = rstd[row]  # norm:84
    dot = F(0.0)  # norm:85
    i = tid  # norm:86
    while i < c:  # norm:86
        dot = F(dot + F(F(dy[i] * F(F(1.0) + weight[i])) * x[i]))  # norm:86
        i += bdim  # norm:86
    dot = yield from block_sum(dot, scratch, tid, bdim)  # norm:87
    k = F(F(F(F(r * r) * r) * dot) / F(c))  # norm:88
    i = tid  # norm:89
    while i < c:  # norm:89
        dx[i] = F(dx[i] + F(F(F(r * dy[i]) * F(F(1.0) + weight[i])) - F(x[i] * k)))  # norm:90
        i += bdim  # norm:89

# norm:94
def gated_rmsnorm_backward(bx, tid, bdim, gdim, sh, dinp, dgate, dout, inp, gate, weight, rstd, n, c):
    scratch = sh  # norm:98
    row = bx  # norm:99
    if row >= n: return  # norm:100
    o = row * c  # norm:101
    x, z, dy = inp + o, gate + o, dout + o  # norm:102
    r = rstd[row]  # norm:103
    dot = F(0.0)  # norm:104
    i = tid  # norm:105
    while i < c:  # norm:105
        s = sigmoidf(z[i])  # norm:106
        silu = F(z[i] * s)  # norm:107
        dsilu = F(s * F(F(1.0) + F(z[i] * F(F(1.0) - s))))  # norm:108
        dgate[o + i] = F(F(F(F(dy[i] * x[i]) * r) * weight[i]) * dsilu)  # norm:109
        dot = F(dot + F(F(F(dy[i] * weight[i]) * silu) * x[i]))  # norm:110
        i += bdim  # norm:105
    dot = yield from block_sum(dot, scratch, tid, bdim)  # norm:112
    k = F(F(F(F(r * r) * r) * dot) / F(c))  # norm:113
    i = tid  # norm:114
    while i < c:  # norm:114
        dinp[o + i] = F(F(F(F(r * dy[i]) * weight[i]) * siluf(z[i])) - F(x[i] * k))  # norm:115
        i += bdim  # norm:114

# norm:121: COLUMN_SUM(TERM), the block (32, 8) linearized: threadIdx.x =
# tid % 32, threadIdx.y = tid // 32; sh is part[8][33] as 8 * 33 floats.
def column_sum(tid, bx, sh, dweight, term, n, c):
    tx, ty = tid % 32, tid // 32  # norm:123-126 (threadIdx.x, threadIdx.y of the (32, 8) block)
    part = sh  # norm:122
    col = bx * 32 + tx  # norm:123
    acc = F(0.0)  # norm:124
    if col < c:  # norm:125
        row = ty  # norm:126
        while row < n:  # norm:126
            acc = F(acc + term(row, col))  # norm:126
            row += 8  # norm:126
    part[ty * 33 + tx] = acc  # norm:127
    yield "norm128"
    if ty == 0 and col < c:  # norm:129
        s = part[0 * 33 + tx]  # norm:130
        for y in range(1, 8): s = F(s + part[y * 33 + tx])  # norm:131
        dweight[col] = F(dweight[col] + s)  # norm:132

# norm:136
def rmsnorm_weight_grad(bx, tid, bdim, gdim, sh, dweight, dout, inp, rstd, n, c):
    def term(row, col):
        return F(F(dout[row * c + col] * inp[row * c + col]) * rstd[row])  # norm:139
    yield from column_sum(tid, bx, sh, dweight, term, n, c)  # norm:139

# norm:143
def gated_rmsnorm_weight_grad(bx, tid, bdim, gdim, sh, dweight, dout, inp, gate, rstd, n, c):
    def term(row, col):
        return F(F(F(dout[row * c + col] * inp[row * c + col]) * rstd[row]) *
                 siluf(gate[row * c + col]))  # norm:146-147
    yield from column_sum(tid, bx, sh, dweight, term, n, c)  # norm:146

# norm:151
def l2norm_backward(bx, tid, bdim, gdim, sh, dinp, dout, inp, rnorm, n, d):
    scratch = sh  # norm:153
    row = bx  # norm:154
    if row >= n: return  # norm:155
    o = row * d  # norm:156
    r = rnorm[row]  # norm:157
    dot = F(0.0)  # norm:158
    i = tid  # norm:159
    while i < d:  # norm:159
        dot = F(dot + F(inp[o + i] * dout[o + i]))  # norm:159
        i += bdim  # norm:159
    dot = yield from block_sum(dot, scratch, tid, bdim)  # norm:160
    k = F(F(F(r * r) * r) * dot)  # norm:161
    i = tid  # norm:162
    while i < d:  # norm:162
        dinp[o + i] = F(F(r * dout[o + i]) - F(inp[o + i] * k))  # norm:162
        i += bdim  # norm:162

# ---- logsoftmax.cu -----------------------------------------------------------

# ls:8
def row_logsumexp(x, vocab, inv_temp, scratch, tid, bdim):
    m = NEG_INF  # ls:9
    i = tid  # ls:10
    while i < vocab:  # ls:10
        m = fmaxf(m, F(x[i] * inv_temp))  # ls:10
        i += bdim  # ls:10
    m = yield from block_max(m, scratch, tid, bdim)  # ls:11
    sum_ = F(0.0)  # ls:12
    i = tid  # ls:13
    while i < vocab:  # ls:13
        sum_ = F(sum_ + expf(F(F(x[i] * inv_temp) - m)))  # ls:13
        i += bdim  # ls:13
    sum_ = yield from block_sum(sum_, scratch, tid, bdim)  # ls:14
    return F(m + logf(sum_))  # ls:15

# ls:19
def logprob_gather_forward(bx, tid, bdim, gdim, sh, out, logits, targets, rows, vocab, inv_temp):
    scratch = sh  # ls:22
    r = bx  # ls:23
    if r >= rows: return  # ls:24
    x = logits + r * vocab  # ls:25
    lse = yield from row_logsumexp(x, vocab, inv_temp, scratch, tid, bdim)  # ls:26
    if tid == 0:  # ls:27
        t = targets[r]  # ls:28
        out[r] = F(F(x[t] * inv_temp) - lse) if t < u(vocab) else F32_NAN  # ls:29

# ls:35; sh = (best_v[32] float, best_i[32] int)
def argmax_forward(bx, tid, bdim, gdim, sh, out, logits, rows, vocab):
    best_v, best_i = sh  # ls:36-37
    r = bx  # ls:38
    if r >= rows: return  # ls:39
    x = logits + r * vocab  # ls:40
    bv = NEG_INF  # ls:41
    bi = INT_MAX  # ls:42
    i = tid  # ls:43
    while i < vocab:  # ls:43
        v = x[i]  # ls:44
        if v > bv or (v == bv and i < bi): bv = v; bi = i  # ls:45
        i += bdim  # ls:43
    o = 16  # ls:47
    while o > 0:  # ls:47
        ov = yield ("shfl", o, bv, "argmax_v")  # ls:48
        oi = yield ("shfl", o, bi, "argmax_i")  # ls:49
        if ov > bv or (ov == bv and oi < bi): bv = ov; bi = oi  # ls:50
        o >>= 1  # ls:47
    lane, warp = tid & 31, tid >> 5  # ls:52
    if lane == 0: best_v[warp] = bv; best_i[warp] = bi  # ls:53
    yield "ls54"
    if tid == 0:  # ls:55
        warps = bdim >> 5  # ls:56
        for w in range(1, warps):  # ls:57
            if best_v[w] > best_v[0] or (best_v[w] == best_v[0] and best_i[w] < best_i[0]):  # ls:58
                best_v[0] = best_v[w]  # ls:59
                best_i[0] = best_i[w]  # ls:60
        out[r] = 0 if best_i[0] == INT_MAX or x[0] != x[0] else best_i[0]  # ls:62

# ls:69
def logprob_gather_backward(bx, tid, bdim, gdim, sh, dlogits, dlp, logits, targets, rows, vocab,
                            inv_temp):
    scratch = sh  # ls:72
    r = bx  # ls:73
    if r >= rows: return  # ls:74
    x = logits + r * vocab  # ls:75
    d = dlogits + r * vocab  # ls:76
    lse = yield from row_logsumexp(x, vocab, inv_temp, scratch, tid, bdim)  # ls:77
    g = F(dlp[r] * inv_temp)  # ls:78
    y = targets[r]  # ls:79
    i = tid  # ls:80
    while i < vocab:  # ls:80
        d[i] = F(F(-g * expf(F(F(x[i] * inv_temp) - lse))) + (g if u(i) == y else F(0.0)))  # ls:81
        i += bdim  # ls:80

SAMPLE_THREADS = 256  # ls:94

# ls:96; sh = (scratch[32] float, part[256] double, last[256] int, pick int)
def sample_rows(bx, tid, bdim, gdim, sh, token, logprob, logits, inv_t, u_, rows, vocab):
    scratch, part, last, pick = sh  # ls:98-101
    r = bx  # ls:102
    if r >= rows: return  # ls:103
    x = logits + r * vocab  # ls:104
    it = inv_t[r]  # ls:105
    ur = u_[r]  # ls:106
    lse = yield from row_logsumexp(x, vocab, it, scratch, tid, bdim)  # ls:107
    if ur < 0.0:  # ls:108
        bv = NEG_INF  # ls:110
        bi = INT_MAX  # ls:111
        i = tid  # ls:112
        while i < vocab:  # ls:112
            v = x[i]  # ls:113
            if v > bv or (v == bv and i < bi): bv = v; bi = i  # ls:114
            i += bdim  # ls:112
        m = yield from block_max(bv, scratch, tid, bdim)  # ls:116
        cand = bi if bv == m else INT_MAX  # ls:117
        yield "ls118"
        if tid == 0: pick[0] = INT_MAX  # ls:119
        yield "ls120"
        atomic_min(pick, 0, cand)  # ls:121
        yield "ls122"
        if tid == 0:  # ls:123
            t = 0 if pick[0] == INT_MAX or x[0] != x[0] else int(pick[0])  # ls:124
            token[r] = t & 0xffffffff  # ls:125
            logprob[r] = F(F(x[t] * it) - lse)  # ls:126
        return  # ls:128
    per = (vocab + bdim - 1) // bdim  # ls:130
    lo = tid * per; hi = min(lo + per, vocab)  # ls:131
    s = D(0.0)  # ls:132
    lastpos = -1  # ls:133
    for i in range(lo, hi):  # ls:134
        p = np.exp(D(F(F(x[i] * it) - lse)))  # ls:135
        if p > 0.0: lastpos = i  # ls:136
        s = D(s + p)  # ls:137
    part[tid] = s  # ls:139
    last[tid] = lastpos  # ls:140
    yield "ls141"
    if tid == 0:  # ls:142
        acc = D(0.0)  # ls:143
        t, fallback = -1, 0  # ls:144
        w = 0  # ls:145
        while w < bdim and t < 0:  # ls:145
            if last[w] >= 0: fallback = int(last[w])  # ls:146
            if ur < D(acc + part[w]):  # ls:147
                a = w * per; b = min(a + per, vocab)  # ls:148
                for i in range(a, b):  # ls:149
                    acc = D(acc + np.exp(D(F(F(x[i] * it) - lse))))  # ls:150
                    if ur < acc: t = i; break  # ls:151
            else:  # ls:154
                acc = D(acc + part[w])  # ls:155
            w += 1  # ls:145
        if t < 0:  # ls:158
            for w in range(bdim):  # ls:159
                if last[w] >= 0: fallback = int(last[w])  # ls:160
            t = fallback  # ls:161
        token[r] = t & 0xffffffff  # ls:163
        logprob[r] = F(F(x[t] * it) - lse)  # ls:164

# ls:174
def block_sum_f64(v, scratch, tid, bdim):
    lane, warp = tid & 31, tid >> 5  # ls:175
    o = 16  # ls:176
    while o > 0:  # ls:176
        v = D(v + (yield ("shfl", o, D(v), "block_sum_f64.a")))  # ls:176
        o >>= 1  # ls:176
    yield "ls177"
    if lane == 0: scratch[warp] = v  # ls:178
    yield "ls179"
    warps = bdim >> 5  # ls:180
    v = scratch[lane] if lane < warps else D(0.0)  # ls:181
    o = 16  # ls:182
    while o > 0:  # ls:182
        v = D(v + (yield ("shfl", o, D(v), "block_sum_f64.b")))  # ls:182
        o >>= 1  # ls:182
    return v  # ls:183

# ls:188
def row_entropy(x, vocab, inv_temp, lse, scratch, tid, bdim):
    h = D(0.0)  # ls:190
    i = tid  # ls:191
    while i < vocab:  # ls:191
        lp = D(D(F(x[i] * inv_temp)) - D(lse))  # ls:192
        h = D(h - D(np.exp(lp) * lp))  # ls:193
        i += bdim  # ls:191
    return (yield from block_sum_f64(h, scratch, tid, bdim))  # ls:195

# ls:198; sh = (scratch[32] float, dscratch[32] double)
def entropy_forward(bx, tid, bdim, gdim, sh, out, logits, rows, vocab, inv_temp):
    scratch, dscratch = sh  # ls:200-201
    r = bx  # ls:202
    if r >= rows: return  # ls:203
    x = logits + r * vocab  # ls:204
    lse = yield from row_logsumexp(x, vocab, inv_temp, scratch, tid, bdim)  # ls:205
    h = yield from row_entropy(x, vocab, inv_temp, lse, dscratch, tid, bdim)  # ls:206
    if tid == 0: out[r] = F(h)  # ls:207

# ls:212
def entropy_backward(bx, tid, bdim, gdim, sh, dlogits, dent, logits, rows, vocab, inv_temp):
    scratch, dscratch = sh  # ls:214-215
    r = bx  # ls:216
    if r >= rows: return  # ls:217
    x = logits + r * vocab  # ls:218
    d = dlogits + r * vocab  # ls:219
    lse = yield from row_logsumexp(x, vocab, inv_temp, scratch, tid, bdim)  # ls:220
    h = yield from row_entropy(x, vocab, inv_temp, lse, dscratch, tid, bdim)  # ls:221
    g = D(D(dent[r]) * D(inv_temp))  # ls:222
    i = tid  # ls:223
    while i < vocab:  # ls:223
        lp = D(D(F(x[i] * inv_temp)) - D(lse))  # ls:224
        d[i] = F(d[i] + F(D(D(g * -np.exp(lp)) * D(lp + h))))  # ls:225
        i += bdim  # ls:223

# ---- the launchers (device.rs, device/backward.rs) ---------------------------

ROW_THREADS = 256  # device.rs ROW_THREADS: rows(n) = n blocks of (256, 1, 1), no dynamic shared memory

def columns(c):
    """backward.rs `columns`: c.div_ceil(32) blocks of (32, 8, 1), linearized to 256."""
    return -(-c // 32), 32 * 8

def scratch32(): return shared("scratch", 32, np.float32)
def part_8x33(): return shared("part", 8 * 33, np.float32)

def host_rmsnorm_forward(out, rstd, inp, weight, n, c, eps):
    """device.rs `rmsnorm_forward`: returns on n == 0 or c == 0, else rows(n)."""
    if n == 0 or c == 0: return
    launch_warp("rmsnorm_forward", n, ROW_THREADS, rmsnorm_forward, scratch32, out, rstd, inp,
                weight, n, c, F(eps))

def host_add_rmsnorm_forward(out, rstd, res, inp, weight, n, c, eps):
    """device.rs `add_rmsnorm_forward`: rows(n)."""
    if n == 0 or c == 0: return
    launch_warp("add_rmsnorm_forward", n, ROW_THREADS, add_rmsnorm_forward, scratch32, out, rstd,
                res, inp, weight, n, c, F(eps))

def host_gated_rmsnorm_forward(out, rstd, inp, gate, weight, n, c, eps):
    """device.rs `gated_rmsnorm_forward`: rows(n)."""
    if n == 0 or c == 0: return
    launch_warp("gated_rmsnorm_forward", n, ROW_THREADS, gated_rmsnorm_forward, scratch32, out,
                rstd, inp, gate, weight, n, c, F(eps))

def host_l2norm_forward(out, rnorm, inp, n, d, eps, scale):
    """device.rs `l2norm_forward`: rows(n)."""
    if n == 0 or d == 0: return
    launch_warp("l2norm_forward", n, ROW_THREADS, l2norm_forward, scratch32, out, rnorm, inp, n, d,
                F(eps), F(scale))

def host_rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, n, c):
    """backward.rs `rmsnorm_backward`: rows(n), then columns(c)."""
    if n == 0 or c == 0: return
    launch_warp("rmsnorm_backward", n, ROW_THREADS, rmsnorm_backward, scratch32, dinp, dout, inp,
                weight, rstd, n, c)
    g, b = columns(c)
    launch("rmsnorm_weight_grad", g, b, rmsnorm_weight_grad, part_8x33, dweight, dout, inp, rstd, n, c)

def host_gated_rmsnorm_backward(dinp, dgate, dweight, dout, inp, gate, weight, rstd, n, c):
    """backward.rs `gated_rmsnorm_backward`: rows(n), then columns(c)."""
    if n == 0 or c == 0: return
    launch_warp("gated_rmsnorm_backward", n, ROW_THREADS, gated_rmsnorm_backward, scratch32, dinp,
                dgate, dout, inp, gate, weight, rstd, n, c)
    g, b = columns(c)
    launch("gated_rmsnorm_weight_grad", g, b, gated_rmsnorm_weight_grad, part_8x33, dweight, dout,
           inp, gate, rstd, n, c)

def host_l2norm_backward(dinp, dout, inp, rnorm, n, d):
    """backward.rs `l2norm_backward`: rows(n)."""
    if n == 0 or d == 0: return
    launch_warp("l2norm_backward", n, ROW_THREADS, l2norm_backward, scratch32, dinp, dout, inp,
                rnorm, n, d)

def host_logprob_gather_forward(out, logits, targets, vocab, inv_temp):
    """device.rs `logprob_gather_forward`: n = targets.len(); returns on n
    == 0 only (vocab 0 still launches), rows(n); targets are not checked."""
    n = targets.n
    if n == 0: return
    launch_warp("logprob_gather_forward", n, ROW_THREADS, logprob_gather_forward, scratch32, out,
                logits, targets, n, vocab, F(inv_temp))

def host_argmax_forward(out, logits, vocab):
    """device.rs `argmax_forward`: n = out.len(), rows(n)."""
    n = out.n
    if n == 0: return
    launch_warp("argmax_forward", n, ROW_THREADS, argmax_forward,
                lambda: (shared("best_v", 32, np.float32), ishared("best_i", 32)), out, logits, n, vocab)

def host_logprob_gather_backward(dlogits, dlp, logits, targets, vocab, inv_temp):
    """backward.rs `logprob_gather_backward`: returns on n == 0 or vocab == 0, rows(n)."""
    n = targets.n
    if n == 0 or vocab == 0: return
    launch_warp("logprob_gather_backward", n, ROW_THREADS, logprob_gather_backward, scratch32,
                dlogits, dlp, logits, targets, n, vocab, F(inv_temp))

def entropy_shared(): return (scratch32(), shared("dscratch", 32, np.float64))

def host_entropy_forward(out, logits, vocab, inv_temp):
    """backward.rs `entropy_forward`: n = out.len(); returns on n == 0 or vocab == 0, rows(n)."""
    n = out.n
    if n == 0 or vocab == 0: return
    launch_warp("entropy_forward", n, ROW_THREADS, entropy_forward, entropy_shared, out, logits, n,
                vocab, F(inv_temp))

def host_entropy_backward(dlogits, dent, logits, vocab, inv_temp):
    """backward.rs `entropy_backward`: n = dent.len(), rows(n)."""
    n = dent.n
    if n == 0 or vocab == 0: return
    launch_warp("entropy_backward", n, ROW_THREADS, entropy_backward, entropy_shared, dlogits, dent,
                logits, n, vocab, F(inv_temp))

def sample_shared():
    return (scratch32(), shared("part", SAMPLE_THREADS, np.float64), ishared("last", SAMPLE_THREADS),
            ishared("pick", 1))

def launch_sample_rows(logits, inv_t, u_, n, vocab):
    """The kernel as `sample_rows` launches it (rows(n), 256 <= SAMPLE_THREADS),
    into outputs that start as junk; returns (tokens, logprobs)."""
    assert ROW_THREADS <= SAMPLE_THREADS
    tok = Buf("token", np.full(n, U32_JUNK, np.uint32))
    lp = Buf("logprob", np.full(n, np.nan, np.float32))
    launch_warp("sample_rows", n, ROW_THREADS, sample_rows, sample_shared, tok, lp, logits,
                buf("inv_t", inv_t), buf("u", u_, np.float64), n, vocab)
    return tok.a.copy(), lp.a.copy()

def host_sample_rows(logits, draws, vocab):
    """device.rs `sample_rows`: a draw None is greedy, sent as (1.0, -1.0);
    1/T finite > 0 and u in [0, 1) required, vocab 0 refused. (The
    launcher's outputs start as zeros; here as junk, so a missing write
    shows.)"""
    n = len(draws)
    if n == 0: return [], []
    if vocab == 0: raise ValueError("sample_rows: an empty vocabulary")
    inv_t, us = [], []
    for r, d in enumerate(draws):
        it, ur = d if d is not None else (1.0, -1.0)
        it = F(it)
        if not (np.isfinite(it) and it > 0.0) or (d is not None and not (0.0 <= ur < 1.0)):
            raise ValueError(f"sample_rows: row {r} draws with 1/T = {it}, u = {ur}")
        inv_t.append(it); us.append(ur)
    return launch_sample_rows(logits, inv_t, us, n, vocab)

# ---- checks ------------------------------------------------------------------

TOL = 1e-6  # every output against float64, relative to max |ref| (or the floors named in each line)
LSE_WHAT = "|lse dref/dlse|"

def same(case, name, got, want):
    """Equal element for element (ints), or bit for bit (floats)."""
    got, want = np.asarray(got), np.asarray(want)
    if want.dtype.kind == "f":
        got, want = got.astype(np.float32).view(np.uint32), want.astype(np.float32).view(np.uint32)
    bad = int(np.count_nonzero(got.reshape(-1).astype(np.int64) != want.reshape(-1).astype(np.int64)))
    extra = "" if bad == 0 else f" (got {got.reshape(-1)[:8].tolist()}, want {want.reshape(-1)[:8].tolist()})"
    say(f"{case}: {name}: exact, {bad} of {want.size} differ{extra} {'ok' if bad == 0 else 'BUG'}")

def f32(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)

# ---- float64 references --------------------------------------------------------

def sig64(x): return 1.0 / (1.0 + np.exp(-x))
def silu64(x): return x * sig64(x)

def ref_rms(x, eps):
    return 1.0 / np.sqrt((x * x).mean(1) + eps)

def ref_rmsnorm_backward(dy, x, w, eps):
    """y = x r (1 + w), r = (mean x^2 + eps)^-1/2: dx = r dy' - x r^3 / c
    sum(dy' x), dy' = dy (1 + w); dw = sum_rows dy x r."""
    c = x.shape[1]
    r = ref_rms(x, eps)[:, None]
    a = dy * (1.0 + w)
    return r * a - x * r ** 3 / c * (a * x).sum(1, keepdims=True), (dy * x * r).sum(0)

def ref_gated_backward(dy, x, z, w, eps):
    """y = x r w silu(z): dx as above with dy' = dy w silu(z); dz = dy x r w
    silu'(z); dw = sum_rows dy x r silu(z)."""
    c = x.shape[1]
    r = ref_rms(x, eps)[:, None]
    sg = sig64(z)
    a = dy * w * silu64(z)
    dx = r * a - x * r ** 3 / c * (a * x).sum(1, keepdims=True)
    dz = dy * x * r * w * sg * (1.0 + z * (1.0 - sg))
    return dx, dz, (dy * x * r * silu64(z)).sum(0)

def ref_l2_backward(dy, x, eps):
    """y = x s, s = (sum x^2 + eps)^-1/2: dx = s dy - x s^3 (x . dy)."""
    s = 1.0 / np.sqrt((x * x).sum(1, keepdims=True) + eps)
    return s * dy - x * s ** 3 * (x * dy).sum(1, keepdims=True)

def scaled(x, it):
    """The kernels' s = x * inv_temp, a float32 product, in float64."""
    return (x.astype(np.float32) * np.float32(it)).astype(D)

def ref_lse(s):
    m = np.max(s, axis=-1, keepdims=True)
    return m + np.log(np.exp(s - m).sum(-1, keepdims=True))

def ref_logsoftmax(s):
    return s - ref_lse(s)

def lse_floor(s, dref_dlse):
    """max over rows of |lse| * max_j |d ref / d lse|: what a relative error
    of 1 in the row's log-sum-exp moves the output by. The kernels take lse
    in float32 (as the CPU references do), so every log-softmax output
    carries an error of about ulp(lse) times that derivative, however
    exactly the rest is summed (see the README: at 1/T 20 the entropy's
    error is 3e-5 of H)."""
    l = np.abs(ref_lse(s)).reshape(s.shape[0], -1)
    dd = np.abs(dref_dlse).reshape(s.shape[0], -1)
    v = l.max(1) * dd.max(1)
    v = v[np.isfinite(v)]
    return float(v.max(initial=0.0))

def ref_entropy(s):
    lp = ref_logsoftmax(s)
    return -(np.exp(lp) * lp).sum(-1)

def ref_entropy_backward(s):
    """dH/ds_j = -p_j (lp_j + H)."""
    lp = ref_logsoftmax(s)
    return -np.exp(lp) * (lp + ref_entropy(s)[..., None])

def ref_argmax(row):
    """cpu/logsoftmax.rs `argmax`, the kernels' rule: the scan from 0 keeping
    the first strictly larger value (the lowest index on ties; a NaN only at
    index 0, which nothing compares larger than)."""
    best = 0
    for i, v in enumerate(row):
        if v > row[best]: best = i
    return best

def ref_sample(s, ur):
    """engine/src/sampler.rs `draw` without truncation, on exact
    probabilities: the first i with u < sum_{j <= i} p_j (sequential f64
    sums), else the last i with p_i > 0; with the distance of u to the
    nearest boundary of its pick (the kernel's f32 log-sum-exp moves the
    boundaries by ~1e-7)."""
    p = np.exp(ref_logsoftmax(s))
    cum = np.cumsum(p)
    hit = np.flatnonzero(ur < cum)
    if len(hit):
        i = int(hit[0])
        lo = cum[i - 1] if i > 0 and cum[i - 1] > 0 else -np.inf  # 0: the zero-probability head, exact
        return i, min(ur - lo, cum[i] - ur)
    return int(np.flatnonzero(p > 0)[-1]), ur - cum[-1]

# ---- reference checks (the float64 backwards against central differences) ----

def fd(f, x, h=1e-6):
    g = np.zeros_like(x)
    for j in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[j] += h; xm[j] -= h
        g[j] = (f(xp) - f(xm)) / (2 * h)
    return g

def refcheck(name, got, want, tol=1e-7):
    r = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    say(f"reference: {name} vs central differences: {r:.1e} (tol {tol:g}) {'ok' if r <= tol else 'BUG'}")

def group_ref():
    rng = np.random.default_rng(11)
    n, c, eps = 3, 6, 1e-6
    x, z, dy = rng.standard_normal((n, c)), rng.standard_normal((n, c)), rng.standard_normal((n, c))
    w = 0.3 * rng.standard_normal(c)
    dx, dw = ref_rmsnorm_backward(dy, x, w, eps)
    refcheck("rmsnorm dinp", dx, fd(lambda v: (v * ref_rms(v, eps)[:, None] * (1 + w) * dy).sum(), x))
    refcheck("rmsnorm dweight", dw, fd(lambda v: (x * ref_rms(x, eps)[:, None] * (1 + v) * dy).sum(), w))
    gy = lambda xx, zz, ww: (xx * ref_rms(xx, eps)[:, None] * ww * silu64(zz) * dy).sum()
    dx, dz, dw = ref_gated_backward(dy, x, z, w, eps)
    refcheck("gated dinp", dx, fd(lambda v: gy(v, z, w), x))
    refcheck("gated dgate", dz, fd(lambda v: gy(x, v, w), z))
    refcheck("gated dweight", dw, fd(lambda v: gy(x, z, v), w))
    l2 = lambda v: (v / np.sqrt((v * v).sum(1, keepdims=True) + eps) * dy).sum()
    refcheck("l2norm dinp", ref_l2_backward(dy, x, eps), fd(l2, x))
    # the gather's and the entropy's backward through s = x * inv_temp
    it, y, g = 0.7, np.array([2, 0, 5]), rng.standard_normal(n)
    lp = lambda v: (ref_logsoftmax(v * it)[np.arange(n), y] * g).sum()
    oh = np.zeros((n, c)); oh[np.arange(n), y] = 1.0
    refcheck("logprob_gather dlogits", g[:, None] * it * (oh - np.exp(ref_logsoftmax(x * it))), fd(lp, x))
    ent = lambda v: (ref_entropy(v * it) * g).sum()
    refcheck("entropy dlogits", g[:, None] * it * ref_entropy_backward(x * it), fd(ent, x))

# ---- norm cases ----------------------------------------------------------------

def case_norm(name, n, c, eps=1e-6, zero_row=False, seed=0):
    """The four forwards from the same rows; then the backwards from the
    kernels' saved rstd / rnorm (trainer order: forward, then backward),
    dinp and dweight of rmsnorm accumulated onto non-zero values."""
    rng = np.random.default_rng(seed)
    x = f32(rng, n, c, scale=2.0)
    if zero_row: x[n // 2] = 0.0
    z, w = f32(rng, n, c, scale=3.0), f32(rng, c, scale=0.3)
    res0 = f32(rng, n, c)
    X, Z, W = x.astype(D), z.astype(D), w.astype(D)
    R = ref_rms(X, eps)
    out, rstd = nan_buf("out", n * c), nan_buf("rstd", n)
    host_rmsnorm_forward(out, rstd, buf("inp", x), buf("weight", w), n, c, eps)
    check(name, "rmsnorm_forward out", out.a, (X * R[:, None] * (1 + W)).reshape(-1))
    check(name, "rmsnorm_forward rstd", rstd.a, R)
    rstd_k = rstd.a.copy()
    out, rs, res = nan_buf("out", n * c), nan_buf("rstd", n), buf("res", res0)
    host_add_rmsnorm_forward(out, rs, res, buf("inp", x), buf("weight", w), n, c, eps)
    S = res0.astype(D) + X
    check(name, "add_rmsnorm_forward res (+= inp)", res.a, S.reshape(-1))
    RS = ref_rms(S, eps)
    check(name, "add_rmsnorm_forward out", out.a, (S * RS[:, None] * (1 + W)).reshape(-1))
    check(name, "add_rmsnorm_forward rstd", rs.a, RS)
    out, rs = nan_buf("out", n * c), nan_buf("rstd", n)
    host_gated_rmsnorm_forward(out, rs, buf("inp", x), buf("gate", z), buf("weight", w), n, c, eps)
    check(name, "gated_rmsnorm_forward out", out.a, (X * R[:, None] * W * silu64(Z)).reshape(-1))
    check(name, "gated_rmsnorm_forward rstd", rs.a, R)
    out, rn = nan_buf("out", n * c), nan_buf("rnorm", n)
    host_l2norm_forward(out, rn, buf("inp", x), n, c, eps, 0.37)
    RN = 1.0 / np.sqrt((X * X).sum(1) + eps)
    check(name, "l2norm_forward out (scale 0.37)", out.a, (X * RN[:, None] * float(F(0.37))).reshape(-1))
    check(name, "l2norm_forward rnorm", rn.a, RN)
    rnorm_k = rn.a.copy()
    # backwards
    dy = f32(rng, n, c)
    DY = dy.astype(D)
    dinp0, dw0 = f32(rng, n, c, scale=0.5), f32(rng, c, scale=float(n))
    dinp, dwb = buf("dinp", dinp0), buf("dweight", dw0)
    host_rmsnorm_backward(dinp, dwb, buf("dout", dy), buf("inp", x), buf("weight", w), buf("rstd", rstd_k), n, c)
    dx, dw = ref_rmsnorm_backward(DY, X, W, eps)
    check(name, "rmsnorm_backward dinp (+=)", dinp.a, (dinp0 + dx).reshape(-1), TOL, dinp0)
    check(name, "rmsnorm_weight_grad dweight (+=)", dwb.a, dw0 + dw, TOL, dw0)
    dinp, dgate, dwb = nan_buf("dinp", n * c), nan_buf("dgate", n * c), buf("dweight", dw0)
    host_gated_rmsnorm_backward(dinp, dgate, dwb, buf("dout", dy), buf("inp", x), buf("gate", z),
                                buf("weight", w), buf("rstd", rstd_k), n, c)
    dx, dz, dw = ref_gated_backward(DY, X, Z, W, eps)
    t1 = np.max(np.abs(R[:, None] * DY * W * silu64(Z)))
    check(name, "gated_rmsnorm_backward dinp", dinp.a, dx.reshape(-1), TOL, floor=t1, floor_what="|r dy'|")
    check(name, "gated_rmsnorm_backward dgate", dgate.a, dz.reshape(-1), TOL)
    check(name, "gated_rmsnorm_weight_grad dweight (+=)", dwb.a, dw0 + dw, TOL, dw0)
    dinp = nan_buf("dinp", n * c)
    host_l2norm_backward(dinp, buf("dout", dy), buf("inp", x), buf("rnorm", rnorm_k), n, c)
    t1 = np.max(np.abs(RN[:, None] * DY))
    check(name, "l2norm_backward dinp", dinp.a, ref_l2_backward(DY, X, eps).reshape(-1), TOL,
          floor=t1, floor_what="|r dy|")

def case_wgrad(name, n, c, seed=1):
    """The column sums alone over many rows (each thread row ty walks rows
    ty, ty + 8, ...), onto non-zero dweight."""
    rng = np.random.default_rng(seed)
    dy, x, z = f32(rng, n, c), f32(rng, n, c), f32(rng, n, c, scale=3.0)
    r = (1.0 + rng.random(n)).astype(np.float32)
    dw0 = f32(rng, c, scale=float(n))
    DY, X, Z, R = dy.astype(D), x.astype(D), z.astype(D), r.astype(D)[:, None]
    g, b = columns(c)
    dwb = buf("dweight", dw0)
    launch("rmsnorm_weight_grad", g, b, rmsnorm_weight_grad, part_8x33, dwb, buf("dout", dy),
           buf("inp", x), buf("rstd", r), n, c)
    check(name, f"rmsnorm_weight_grad ({g} blocks of (32, 8)) +=", dwb.a, dw0 + (DY * X * R).sum(0), TOL, dw0)
    dwb = buf("dweight", dw0)
    launch("gated_rmsnorm_weight_grad", g, b, gated_rmsnorm_weight_grad, part_8x33, dwb,
           buf("dout", dy), buf("inp", x), buf("gate", z), buf("rstd", r), n, c)
    check(name, "gated_rmsnorm_weight_grad +=", dwb.a, dw0 + (DY * X * R * silu64(Z)).sum(0), TOL, dw0)

def group_norm():
    case_norm("norm n3 c1", 3, 1)
    case_norm("norm n2 c31", 2, 31)
    case_norm("norm n11 c33 (a zero row)", 11, 33, zero_row=True)
    case_norm("norm n3 c256", 3, 256)
    case_norm("norm n3 c300", 3, 300)
    case_norm("norm n2 c1000 eps 1e-2", 2, 1000, eps=1e-2)
    case_norm("norm n7 c1000", 7, 1000)
    case_norm("norm n19 c64", 19, 64)

def group_wgrad():
    case_wgrad("wgrad n19 c33", 19, 33)
    case_wgrad("wgrad n3 c70", 3, 70)
    case_wgrad("wgrad n1 c1", 1, 1)
    case_wgrad("wgrad n40 c8", 40, 8)
    case_wgrad("wgrad n21 c300", 21, 300)

# ---- log-softmax cases -----------------------------------------------------------

def logits_rows(rng, n, vocab, scale=3.0):
    return f32(rng, n, vocab, scale=scale)

def case_lsm(name, vocab, targets, inv_temp, seed=2, special=None):
    """logprob_gather forward (an out-of-range target: NaN) and backward
    (written; dlogits of a row with an out-of-range target has no one-hot)."""
    rng = np.random.default_rng(seed)
    n = len(targets)
    x = logits_rows(rng, n, vocab)
    if special: special(x)
    s = scaled(x, inv_temp)
    lp = ref_logsoftmax(s)
    out = nan_buf("out", n)
    tb = buf("targets", targets, np.uint32)
    host_logprob_gather_forward(out, buf("logits", x), tb, vocab, inv_temp)
    want = np.array([lp[r, t] if t < vocab else np.nan for r, t in enumerate(targets)])
    check(name, f"logprob_gather_forward (1/T {inv_temp:g})", out.a, want, TOL,
          floor=lse_floor(s, np.ones(n)), floor_what="|lse|")
    dlp = f32(rng, n)
    d = nan_buf("dlogits", n * vocab)
    host_logprob_gather_backward(d, buf("dlp", dlp), buf("logits", x), tb, vocab, inv_temp)
    oh = np.zeros((n, vocab))
    for r, t in enumerate(targets):
        if t < vocab: oh[r, t] = 1.0
    gi = dlp.astype(D)[:, None] * float(F(inv_temp))
    ref = gi * (oh - np.exp(lp))
    check(name, "logprob_gather_backward dlogits (written)", d.a, ref.reshape(-1), TOL,
          floor=lse_floor(s, gi * np.exp(lp)), floor_what=LSE_WHAT)

def group_lsm():
    case_lsm("lsm vocab1", 1, [0, 0, 5], 1.0)
    case_lsm("lsm vocab7", 7, [6, 0, 3, 7], 1.0)
    case_lsm("lsm vocab257", 257, [256, 0, 100], 0.5)
    case_lsm("lsm vocab3001", 3001, [1234, 3000, 3001, 0, 77], 1.0 / 0.7)
    def masked(x): x[0, :5] = -np.inf; x[1, 100:] = -np.inf
    case_lsm("lsm vocab300 -inf logits", 300, [7, 3], 2.0, special=masked)
    # vocab 0 (the forward's launcher does not return on it): lse = -inf, every target out of range
    out = nan_buf("out", 2)
    host_logprob_gather_forward(out, Buf("logits", np.zeros(0, np.float32)), buf("t", [0, 1], np.uint32), 0, 1.0)
    check("lsm vocab0", "logprob_gather_forward -> NaN", out.a, np.array([np.nan, np.nan]))

def case_argmax(name, rows):
    vocab = len(rows[0])
    x = np.array(rows, np.float32)
    out = Buf("out", np.full(len(rows), U32_JUNK, np.uint32))
    host_argmax_forward(out, buf("logits", x), vocab)
    same(name, "argmax_forward (lowest index on ties, NaN never chosen)", out.a, [ref_argmax(r) for r in x])
    return out.a.copy()

def group_argmax():
    rng = np.random.default_rng(3)
    nan, inf = np.nan, np.inf
    case_argmax("argmax vocab1", [[5.0], [nan], [-inf]])
    case_argmax("argmax vocab7", [[1, 3, 3, 2, 3, 0, 1], [nan, 1, 4, nan, 4, 2, 4], [nan] * 7,
                                 [-inf] * 7, [2, 2, 2, 2, 2, 2, 2], [0, -1, inf, 5, inf, nan, 1]])
    def ties(v, at, val, others=None):
        r = (rng.integers(0, 4, v) * 0.5).astype(np.float32) if others is None else others
        for i in at: r[i] = val
        return r
    v = 257
    rows = [ties(v, [200, 3, 129], 9.0), ties(v, [256, 40], 9.0), ties(v, [31, 32, 63, 64], 7.0),
            ties(v, [255, 0], 7.0), ties(v, [], 0, np.full(v, np.nan, np.float32)), ties(v, [20, 5], 9.0)]
    rows[4][[17, 250]] = [-3.0, -3.0]
    case_argmax("argmax vocab257 (ties across lanes and warps, NaNs)", rows)
    v = 3001
    rows = [ties(v, [2999, 1500, 2000], 9.0), ties(v, [3000], 9.0), ties(v, [7 * 256 + 5, 5, 256 + 5], 8.0)]
    rows[0][[0, 1, 2]] = np.nan
    case_argmax("argmax vocab3001", rows)
    case_argmax("argmax vocab4 (a NaN at 0 stays, as on the CPU)", [[nan, 1.0, 3.0, 3.0]])

# ---- sampling cases -----------------------------------------------------------------

MARGIN = 1e-5  # least distance of a case's u to a CDF boundary (the kernel's f32 lse moves them ~1e-7)

def case_sample(name, x, draws, extra_u=()):
    """Rows of x sampled with draws[r] (None greedy, else (1/T, u)), against
    the inverse CDF on exact probabilities; the picks' log-probs against
    float64 and bit for bit against logprob_gather_forward (greedy:
    argmax_forward at 1/T 1). extra_u: (row, u) run through the kernel
    directly with u outside the launcher's [0, 1), for the fallback."""
    n, vocab = x.shape
    tok, lp = host_sample_rows(buf("logits", x), draws, vocab)
    want_t, want_lp, margins, lses = [], [], [], []
    for r, d in enumerate(draws):
        it, ur = d if d is not None else (1.0, -1.0)
        s = scaled(x[r], it)
        if d is None:
            t = ref_argmax(x[r])
        else:
            t, mg = ref_sample(s, ur)
            margins.append(mg)
            if mg < MARGIN: raise ValueError(f"{name}: row {r}: u = {ur} within {mg:.1e} of a boundary")
        want_t.append(t)
        want_lp.append(ref_logsoftmax(s)[t])
        lses.append(abs(float(ref_lse(s)[0])))
    mg = f", u at least {min(margins):.1e} from a boundary" if margins else ""
    same(name, f"sample_rows tokens ({sum(d is None for d in draws)} greedy{mg})", tok, want_t)
    check(name, "sample_rows logprobs", lp, np.array(want_lp), TOL,
          floor=max([v for v in lses if np.isfinite(v)], default=0.0), floor_what="|lse|")
    # the same bits as logprob_gather_forward of the pick at the row's 1/T
    gl = np.full(n, np.nan, np.float32)
    for r, d in enumerate(draws):
        it = d[0] if d is not None else 1.0
        o = nan_buf("out", 1)
        host_logprob_gather_forward(o, buf("logits", x[r]), buf("t", [tok[r]], np.uint32), vocab, it)
        gl[r] = o.a[0]
    same(name, "sample_rows logprob == logprob_gather_forward of its token", lp, gl)
    greedy = [r for r, d in enumerate(draws) if d is None]
    if greedy:
        o = Buf("out", np.full(len(greedy), U32_JUNK, np.uint32))
        host_argmax_forward(o, buf("logits", x[greedy]), vocab)
        same(name, "greedy tokens == argmax_forward", tok[greedy], o.a)
    for r, ur in extra_u:
        it = draws[r][0] if draws[r] is not None else 1.0
        t, l = launch_sample_rows(buf("logits", x[r]), [F(it)], [ur], 1, vocab)
        want, _ = ref_sample(scaled(x[r], it), ur)
        same(name, f"u = {ur} (>= the total; kernel launched directly): last index of positive p",
             t, [want])

def case_sample_not_crossed(name, vocab, seed=6):
    """ls:147-153: u below acc + part[w] (the piece's sum taken from 0) but
    not below the sum taken on from acc, element by element (the two
    rounded apart): the kernel must go on to the next piece and pick its
    first index. The row's lp_i = F(F(x_i / T) - lse), the values the
    kernel exponentiates, are read from logprob_gather_forward (whose bits
    sample_rows' log-probs are checked to have), one row per target, and
    the f64 sums are then taken in the kernel's order to find such a u."""
    rng = np.random.default_rng(seed)
    x = logits_rows(rng, 1, vocab)
    out = nan_buf("out", vocab)
    host_logprob_gather_forward(out, buf("logits", np.repeat(x, vocab, 0)),
                                buf("t", np.arange(vocab), np.uint32), vocab, 1.0)
    p = [np.exp(D(v)) for v in out.a]
    per = -(-vocab // ROW_THREADS)
    acc, found = D(0.0), None
    for w in range(ROW_THREADS):
        a, b = w * per, min(w * per + per, vocab)
        if a >= b: break
        part = D(0.0)
        for i in range(a, b): part = D(part + p[i])
        seq = acc
        for i in range(a, b): seq = D(seq + p[i])
        if D(acc + part) > seq and b < vocab and found is None: found = (w, seq, b)
        acc = D(acc + part)
    if found is None:
        say(f"{name}: no piece whose two sums round apart (seed) BUG"); return
    w, ur, first_next = found
    t, _ = launch_sample_rows(buf("logits", x), [F(1.0)], [float(ur)], 1, vocab)
    host, _ = ref_sample(x[0].astype(D), float(ur))
    same(name, f"u = {float(ur)!r} (piece {w}'s sums round apart): the next piece's first index "
         f"(the host's sequential rule, exact p: {host})", t, [first_next])

def group_sample():
    rng = np.random.default_rng(4)
    # vocab 1: always 0
    x = logits_rows(rng, 3, 1)
    case_sample("sample vocab1", x, [None, (1.0, 0.0), (2.0, 0.999)], extra_u=[(1, 1.5)])
    # vocab 7: greedy with ties and a NaN, u 0, tiny, middle, near 1, temperatures
    x = logits_rows(rng, 6, 7)
    x[0] = [1, 4, 2, 4, 4, 0, 1]; x[1] = [np.nan, 3, 5, 5, -np.inf, 1, 2]
    x[3, :2] = -np.inf  # zero probability at the head: u = 0 must skip it
    case_sample("sample vocab7", x, [None, None, (1.0, 0.5), (1.0, 0.0), (0.5, 1e-12), (10.0, 0.9)],
                extra_u=[(3, 1.001)])
    # vocab 257: a piece per thread plus one (per 2), -inf tail, every temperature
    x = logits_rows(rng, 7, 257)
    x[2, 200:] = -np.inf
    x[5, 3] = x[5, 250] = 20.0
    x[6, 0] = -np.inf  # u = 0: index 1, not 0 (both in thread 0's piece)
    case_sample("sample vocab257", x, [(1.0, 0.3), (1.0 / 0.7, 0.77), (1.0, 0.9995), (2.0, 0.05),
                                       (0.25, 0.6), None, (1.0, 0.0)], extra_u=[(2, 1.5)])
    # vocab 3001: 12 per thread, the last thread's piece short (3001 = 250 * 12 + 1)
    x = logits_rows(rng, 5, 3001)
    x[4, 2990:] = -np.inf
    case_sample("sample vocab3001", x, [(1.0, 0.123), (1.0 / 0.7, 0.5), (1.0, 0.9), None, (1.0, 0.99)],
                extra_u=[(4, 1.25)])
    case_sample_not_crossed("sample vocab257 not crossed", 257)
    # the launcher's refusals
    for d in [(1.0, 1.0), (0.0, 0.5), (float("inf"), 0.5), (1.0, -0.5)]:
        try:
            host_sample_rows(buf("logits", np.zeros(3)), [d], 3)
            say(f"sample launcher: draw {d} not refused BUG")
        except ValueError:
            say(f"sample launcher: draw {d} refused ok")

# ---- entropy cases ----------------------------------------------------------------

def case_entropy(name, vocab, n, inv_temp, seed=5, scale=3.0):
    rng = np.random.default_rng(seed)
    x = logits_rows(rng, n, vocab, scale)
    s = scaled(x, inv_temp)
    out = nan_buf("out", n)
    host_entropy_forward(out, buf("logits", x), vocab, inv_temp)
    H = ref_entropy(s)
    check(name, f"entropy_forward (1/T {inv_temp:g})", out.a, H, TOL, floor=lse_floor(s, 1.0 - H),
          floor_what=LSE_WHAT)
    dent = f32(rng, n)
    d0 = f32(rng, n, vocab, scale=0.05)
    d = buf("dlogits", d0)
    host_entropy_backward(d, buf("dent", dent), buf("logits", x), vocab, inv_temp)
    gi = dent.astype(D)[:, None] * float(F(inv_temp))
    ref = gi * ref_entropy_backward(s)
    p, lp = np.exp(ref_logsoftmax(s)), ref_logsoftmax(s)
    check(name, "entropy_backward dlogits (+=, onto non-zero)", d.a, (d0 + ref).reshape(-1), TOL, d0,
          floor=lse_floor(s, gi * p * (lp + 2.0 * H[:, None])), floor_what=LSE_WHAT)

def group_entropy():
    case_entropy("entropy vocab1", 1, 2, 1.0)
    case_entropy("entropy vocab7", 7, 3, 1.0)
    case_entropy("entropy vocab257", 257, 3, 0.5)
    case_entropy("entropy vocab3001", 3001, 5, 1.0 / 0.7)
    case_entropy("entropy vocab300 peaked (1/T 20)", 300, 2, 20.0)
    # a -inf logit: exp(-inf) * -inf is NaN in the kernel, as in cpu/logsoftmax.rs (noted, not checked)
    x = np.array([[0.0, 1.0, -np.inf, 2.0]], np.float32)
    o = nan_buf("out", 1)
    host_entropy_forward(o, buf("logits", x), 4, 1.0)
    print(f"entropy note: row [0, 1, -inf, 2]: kernel {float(o.a[0])}, the limit {ref_entropy(np.array([0, 1, 2.0])):.6f}")

GROUPS = {"ref": group_ref, "norm": group_norm, "wgrad": group_wgrad, "lsm": group_lsm,
          "argmax": group_argmax, "sample": group_sample, "entropy": group_entropy}

if __name__ == "__main__":
    run_groups(GROUPS, sys.argv[1:])
