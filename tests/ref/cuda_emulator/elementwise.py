"""Transcription of the elementwise, copy, RoPE, embedding and optimizer
kernels: kernels/src/cuda/activation.cu (tags `# act:NNN`), rope.cu
(`# rope:NNN`), embedding.cu (`# emb:NNN`) and optim.cu (`# opt:NNN`), each
tag naming the line of that file it transcribes (as of the commit that
added this file), with the launch each gets from device.rs /
device/backward.rs (`elems`, `rows`, `per_item`, `sum_squares`' grid),
checked against float64 references written from the math (the CPU
references in kernels/src/cpu/*.rs for the semantics).

`float` is float32 (F), every operation rounded to float32 as the kernel
does; fused multiply-adds the compiler may contract are not modelled (no
exact check here depends on one: the exact checks are copies, bf16
conversions and the embedding backward's plain adds). `elems` caps a grid
at 65,535 blocks of 256 threads; the cases cap it at 1 to 3 blocks so that
every thread walks several elements (the grid-stride loops), and outputs
start as NaN (or, where a kernel must leave elements alone, as known values
that must stay). No kernel here uses atomics. prelude.cuh's helpers come
from prelude.py.

Usage: python elementwise.py [group ...]   (groups: act gating copy rope emb
bf16 adamw sumsq; all by default)"""
import sys, time
import numpy as np
from simt import T, Buf, F, D, launch, shared
from simt_warp import launch as launch_warp
from report import buf, nan_buf, say, check, run_groups
from prelude import (u, expf, sigmoidf, siluf, softplusf, bf16_to_f32, f32_to_bf16, block_sum,
                     row_rsqrt)

def sqrtf(x): return F(np.sqrt(F(x)))
def powf(a, b): return F(np.power(F(a), F(b)))
def cosf(x): return F(np.cos(F(x)))
def sinf(x): return F(np.sin(F(x)))

# ---- activation.cu ---------------------------------------------------------

# act:5
def silu_mul_forward(bx, tid, bdim, gdim, sh, out, gate, up, n):
    i = bx * bdim + tid  # act:7
    while i < n:  # act:7
        out[i] = F(siluf(gate[i]) * up[i])  # act:9
        i += gdim * bdim  # act:8
    return
    yield

# act:13
def sigmoid_gate_forward(bx, tid, bdim, gdim, sh, x, gate, n):
    i = bx * bdim + tid  # act:14
    while i < n:  # act:14
        x[i] = F(x[i] * sigmoidf(gate[i]))  # act:16
        i += gdim * bdim  # act:15
    return
    yield

# act:20
def silu_forward(bx, tid, bdim, gdim, sh, x, n):
    i = bx * bdim + tid  # act:21
    while i < n:  # act:21
        x[i] = siluf(x[i])  # act:23
        i += gdim * bdim  # act:22
    return
    yield

# act:28
def gated_delta_gating_forward(bx, tid, bdim, gdim, sh, g, beta, a, b, a_log, dt_bias, t, nv):
    n = t * nv  # act:31
    i = bx * bdim + tid  # act:32
    while i < n:  # act:32
        h = i % nv  # act:34
        g[i] = F(-expf(a_log[h]) * softplusf(F(a[i] + dt_bias[h])))  # act:35
        beta[i] = sigmoidf(b[i])  # act:36
        i += gdim * bdim  # act:33
    return
    yield

# act:42
def silu_gradf(x):
    s = sigmoidf(x)  # act:43
    return F(s * F(F(1.0) + F(x * F(F(1.0) - s))))  # act:44

# act:48
def silu_backward(bx, tid, bdim, gdim, sh, dinp, dout, inp, n):
    i = bx * bdim + tid  # act:50
    while i < n:  # act:50
        dinp[i] = F(dout[i] * silu_gradf(inp[i]))  # act:52
        i += gdim * bdim  # act:51
    return
    yield

# act:56
def silu_mul_backward(bx, tid, bdim, gdim, sh, dgate, dup, dout, gate, up, n):
    i = bx * bdim + tid  # act:58
    while i < n:  # act:58
        dgate[i] = F(F(dout[i] * up[i]) * silu_gradf(gate[i]))  # act:60
        dup[i] = F(dout[i] * siluf(gate[i]))  # act:61
        i += gdim * bdim  # act:59
    return
    yield

# act:67
def sigmoid_gate_backward(bx, tid, bdim, gdim, sh, dx, dgate, dout, x, gate, n):
    i = bx * bdim + tid  # act:69
    while i < n:  # act:69
        s = sigmoidf(gate[i])  # act:71
        dx[i] = F(dout[i] * s)  # act:72
        dgate[i] = F(F(F(dout[i] * x[i]) * s) * F(F(1.0) - s))  # act:73
        i += gdim * bdim  # act:70
    return
    yield

# act:79
def gated_delta_gating_backward(bx, tid, bdim, gdim, sh, da, db, dg, dbeta, beta, a, a_log,
                                dt_bias, t, nv):
    n = t * nv  # act:83
    i = bx * bdim + tid  # act:84
    while i < n:  # act:84
        h = i % nv  # act:86
        be = beta[i]  # act:87
        db[i] = F(F(dbeta[i] * be) * F(F(1.0) - be))  # act:88
        x = F(a[i] + dt_bias[h])  # act:89
        sp_grad = F(1.0) if x > F(20.0) else sigmoidf(x)  # act:90
        da[i] = F(F(dg[i] * -expf(a_log[h])) * sp_grad)  # act:91
        i += gdim * bdim  # act:85
    return
    yield

# act:97; sh is the static scratch[32] (act:98)
def gated_delta_gating_param_grad(bx, tid, bdim, gdim, sh, da_log, ddt_bias, dg, g, da, t, nv):
    scratch = sh  # act:100
    h = bx  # act:101
    if h >= nv: return  # act:102
    s1, s2 = F(0.0), F(0.0)  # act:103
    ti = tid  # act:104
    while ti < t:  # act:104
        i = ti * nv + h  # act:105
        s1 = F(s1 + F(dg[i] * g[i]))  # act:106
        s2 = F(s2 + da[i])  # act:107
        ti += bdim  # act:104
    s1 = yield from block_sum(s1, scratch, tid, bdim)  # act:109
    s2 = yield from block_sum(s2, scratch, tid, bdim)  # act:110
    if tid == 0:  # act:111
        da_log[h] = F(da_log[h] + s1)  # act:112
        ddt_bias[h] = F(ddt_bias[h] + s2)  # act:113

# act:118
def add_assign(bx, tid, bdim, gdim, sh, x, y, n):
    i = bx * bdim + tid  # act:119
    while i < n:  # act:119
        x[i] = F(x[i] + y[i])  # act:121
        i += gdim * bdim  # act:120
    return
    yield

# act:127
def copy_block(bx, tid, bdim, gdim, sh, out, inp, in_width, row0, col0, rows, cols):
    n = rows * cols  # act:130
    i = bx * bdim + tid  # act:131
    while i < n:  # act:131
        r = i // cols; c = i - r * cols  # act:133
        out[i] = inp[(row0 + r) * in_width + col0 + c]  # act:134
        i += gdim * bdim  # act:132
    return
    yield

# act:140
def copy_within(bx, tid, bdim, gdim, sh, buf, src, dst, n):
    i = bx * bdim + tid  # act:141
    while i < n:  # act:141
        buf[dst + i] = buf[src + i]  # act:143
        i += gdim * bdim  # act:142
    return
    yield

# act:147
def zero_range(bx, tid, bdim, gdim, sh, buf, off, n):
    i = bx * bdim + tid  # act:148
    while i < n:  # act:148
        buf[off + i] = F(0.0)  # act:150
        i += gdim * bdim  # act:149
    return
    yield

# act:155
def gather_rows(bx, tid, bdim, gdim, sh, out, inp, rows, n, width):
    total = n * width  # act:157
    i = bx * bdim + tid  # act:158
    while i < total:  # act:158
        r = i // width; c = i - r * width  # act:160
        out[i] = inp[u(rows[r]) * width + c]  # act:161
        i += gdim * bdim  # act:159
    return
    yield

# act:168
def copy_into(bx, tid, bdim, gdim, sh, out, inp, out_width, row0, col0, rows, cols):
    n = rows * cols  # act:171
    i = bx * bdim + tid  # act:172
    while i < n:  # act:172
        r = i // cols; c = i - r * cols  # act:174
        out[(row0 + r) * out_width + col0 + c] = inp[i]  # act:175
        i += gdim * bdim  # act:173
    return
    yield

# act:181
def scatter_rows(bx, tid, bdim, gdim, sh, out, inp, rows, n, width):
    total = n * width  # act:183
    i = bx * bdim + tid  # act:184
    while i < total:  # act:184
        r = i // width; c = i - r * width  # act:186
        out[u(rows[r]) * width + c] = inp[i]  # act:187
        i += gdim * bdim  # act:185
    return
    yield

# ---- rope.cu ---------------------------------------------------------------

# rope:9; returns (c, sn)
def rope_angle(pos, i, rot_dim, theta):
    inv_freq = F(F(1.0) / powf(theta, F(F(2 * i) / F(rot_dim))))  # rope:11
    angle = F(pos * inv_freq)  # rope:12
    return cosf(angle), sinf(angle)  # rope:13-14

# rope:17; sh is the static scratch[32] (rope:21)
def qk_norm_rope_forward(bx, tid, bdim, gdim, sh, x, rstd, weight, positions, n, heads, head_dim,
                         rot_dim, theta, eps):
    scratch = sh  # rope:21
    row = bx  # rope:22
    if row >= n * heads: return  # rope:23
    t = row // heads  # rope:24
    h = x + row * head_dim  # rope:25
    s = yield from row_rsqrt(h, head_dim, F(head_dim), eps, scratch, tid, bdim)  # rope:26
    for i in range(tid, head_dim, bdim): h[i] = F(F(h[i] * s) * F(F(1.0) + weight[i]))  # rope:27
    if tid == 0: rstd[row] = s  # rope:28
    yield "rope29"
    half = rot_dim // 2  # rope:30
    pos = F(u(positions[t]))  # rope:31
    for i in range(tid, half, bdim):  # rope:32
        c, sn = rope_angle(pos, i, rot_dim, theta)  # rope:34
        a = h[i]; b = h[i + half]  # rope:35
        h[i] = F(F(a * c) - F(b * sn))  # rope:36
        h[i + half] = F(F(b * c) + F(a * sn))  # rope:37

# rope:46; sh is (scratch[32], dy[512]) (rope:51-52)
def qk_norm_rope_backward(bx, tid, bdim, gdim, sh, dinp, dnormed, dout, inp, weight, rstd,
                          positions, n, heads, head_dim, rot_dim, theta):
    scratch, dy = sh  # rope:51-52
    row = bx  # rope:53
    if row >= n * heads: return  # rope:54
    t = row // heads  # rope:55
    o = row * head_dim  # rope:56
    for i in range(tid, head_dim, bdim): dy[i] = dout[o + i]  # rope:57
    yield "rope58"
    half = rot_dim // 2  # rope:59
    pos = F(u(positions[t]))  # rope:60
    for i in range(tid, half, bdim):  # rope:61
        c, sn = rope_angle(pos, i, rot_dim, theta)  # rope:63
        a = dy[i]; b = dy[i + half]  # rope:64
        dy[i] = F(F(a * c) + F(b * sn))  # rope:65
        dy[i + half] = F(F(b * c) - F(a * sn))  # rope:66
    yield "rope68"
    x = inp + o  # rope:69
    r = rstd[row]  # rope:70
    dot = F(0.0)  # rope:71
    for i in range(tid, head_dim, bdim):  # rope:72
        dnormed[o + i] = dy[i]  # rope:73
        dot = F(dot + F(F(dy[i] * F(F(1.0) + weight[i])) * x[i]))  # rope:74
    dot = yield from block_sum(dot, scratch, tid, bdim)  # rope:76
    k = F(F(F(F(r * r) * r) * dot) / F(head_dim))  # rope:77
    for i in range(tid, head_dim, bdim):  # rope:78
        dinp[o + i] = F(F(F(r * dy[i]) * F(F(1.0) + weight[i])) - F(x[i] * k))  # rope:79

# ---- embedding.cu ----------------------------------------------------------

# emb:5
def embedding_forward_f32(bx, tid, bdim, gdim, sh, out, ids, table, n, c, vocab):
    t = bx  # emb:7
    if t >= n: return  # emb:8
    id_ = u(ids[t])  # emb:9
    y = out + t * c  # emb:10
    for i in range(tid, c, bdim):  # emb:11
        y[i] = table[id_ * c + i] if id_ < vocab else F(0.0)  # emb:12
    return
    yield

# emb:15
def embedding_forward_bf16(bx, tid, bdim, gdim, sh, out, ids, table, n, c, vocab):
    t = bx  # emb:17
    if t >= n: return  # emb:18
    id_ = u(ids[t])  # emb:19
    y = out + t * c  # emb:20
    for i in range(tid, c, bdim):  # emb:21
        y[i] = bf16_to_f32(table[id_ * c + i]) if id_ < vocab else F(0.0)  # emb:22
    return
    yield

# emb:26
def f32_to_bf16_copy(bx, tid, bdim, gdim, sh, out, inp, n):
    i = bx * bdim + tid  # emb:27
    while i < n:  # emb:27
        out[i] = f32_to_bf16(inp[i])  # emb:29
        i += gdim * bdim  # emb:28
    return
    yield

# emb:37
def embedding_backward(bx, tid, bdim, gdim, sh, dtable, dout, ids_sorted, starts, order, distinct, c):
    uu = bx  # emb:40
    if uu >= distinct: return  # emb:41
    row = dtable + u(ids_sorted[uu]) * c  # emb:42
    a, b = u(starts[uu]), u(starts[uu + 1])  # emb:43
    for i in range(tid, c, bdim):  # emb:44
        acc = row[i]  # emb:45
        for k in range(a, b): acc = F(acc + dout[u(order[k]) * c + i])  # emb:46
        row[i] = acc  # emb:47
    return
    yield

# ---- optim.cu --------------------------------------------------------------

# opt:7; out_bf16 None is the kernel's null pointer
def adamw_update(bx, tid, bdim, gdim, sh, param, exp_avg, exp_avg_sq, out_bf16, grad, n, decay,
                 step_size, b1w, beta2, b2w, bc2_sqrt, eps):
    i = bx * bdim + tid  # opt:11
    while i < n:  # opt:11
        p = F(param[i] * decay)  # opt:13
        g = grad[i]  # opt:14
        m = exp_avg[i]  # opt:15
        m = F(m + F(b1w * F(g - m)))  # opt:16
        v = F(F(exp_avg_sq[i] * beta2) + F(F(b2w * g) * g))  # opt:17
        denom = F(F(sqrtf(v) / bc2_sqrt) + eps)  # opt:18
        p = F(p - F(step_size * F(m / denom)))  # opt:19
        param[i] = p  # opt:20
        exp_avg[i] = m  # opt:21
        exp_avg_sq[i] = v  # opt:22
        if out_bf16 is not None: out_bf16[i] = f32_to_bf16(p)  # opt:23
        i += gdim * bdim  # opt:12
    return
    yield

# opt:28
def scale_f32(bx, tid, bdim, gdim, sh, x, n, s):
    i = bx * bdim + tid  # opt:29
    while i < n:  # opt:29
        x[i] = F(x[i] * s)  # opt:31
        i += gdim * bdim  # opt:30
    return
    yield

# opt:37; sh is the static scratch[32] (opt:38)
def sum_squares_partial(bx, tid, bdim, gdim, sh, partial, x, n):
    scratch = sh  # opt:38
    acc = F(0.0)  # opt:39
    i = bx * bdim + tid  # opt:40
    while i < n:  # opt:40
        acc = F(acc + F(x[i] * x[i]))  # opt:42
        i += gdim * bdim  # opt:41
    acc = yield from block_sum(acc, scratch, tid, bdim)  # opt:43
    if tid == 0: partial[bx] = acc  # opt:44

# ---- the launchers (device.rs, device/backward.rs) -------------------------

ELEM_THREADS = ROW_THREADS = REDUCE_THREADS = 256  # device.rs, device/backward.rs

def elems(n, cap):
    """device.rs `elems`: n.div_ceil(256).clamp(1, 65_535) blocks; the cap
    (65,535 on the device) is a parameter here."""
    return max(1, min(-(-n // ELEM_THREADS), cap))

def scratch32():
    return shared("scratch", 32, np.float32)

def run_elems(name, kern, n, cap, *args):
    """The launchers of the grid-stride kernels (device.rs
    `silu_mul_forward`, `sigmoid_gate_forward`, `silu_forward`,
    `add_assign`, `copy_within`, `zero_range`, `gather_rows`,
    `scatter_rows`, `copy_block`, `copy_into`, `f32_to_bf16`,
    `gated_delta_gating_forward`; backward.rs `silu_backward`,
    `silu_mul_backward`, `sigmoid_gate_backward`, `adamw_update`, `scale`):
    nothing when there is nothing to do, else `elems(n)`."""
    if n == 0: return
    launch(name, elems(n, cap), ELEM_THREADS, kern, None, *args)

def host_gated_delta_gating_backward(da, db, da_log, ddt_bias, dg, dbeta, g, beta, a, a_log,
                                     dt_bias, n, nv, cap):
    """backward.rs `gated_delta_gating_backward`: elems(n), then per_item(nv)."""
    assert nv > 0 and n % nv == 0
    if n == 0: return
    t = n // nv
    launch("gated_delta_gating_backward", elems(n, cap), ELEM_THREADS, gated_delta_gating_backward,
           None, da, db, dg, dbeta, beta, a, a_log, dt_bias, t, nv)
    launch_warp("gated_delta_gating_param_grad", nv, REDUCE_THREADS, gated_delta_gating_param_grad,
                scratch32, da_log, ddt_bias, dg, g, da, t, nv)

def host_qk_norm_rope(x, rstd, weight, positions, n, heads, head_dim, rot_dim, theta, eps):
    """device.rs `qk_norm_rope_forward`: rows(n * heads), static shared memory only."""
    assert rot_dim <= head_dim and rot_dim % 2 == 0
    if n == 0 or heads == 0 or head_dim == 0: return
    launch_warp("qk_norm_rope_forward", n * heads, ROW_THREADS, qk_norm_rope_forward, scratch32,
                x, rstd, weight, positions, n, heads, head_dim, rot_dim, theta, eps)

def host_qk_norm_rope_backward(dinp, dout, inp, weight, rstd, positions, n, heads, head_dim,
                               rot_dim, theta):
    """backward.rs `qk_norm_rope_backward`: rows(n * heads) into a zeroed
    `dnormed` (returned; the launcher then runs norm.cu's
    rmsnorm_weight_grad over it, not covered here)."""
    rows_n = n * heads
    if head_dim > 512 or rot_dim > head_dim or rot_dim % 2:
        raise ValueError("qk_norm_rope_backward: shape")
    dnormed = Buf("dnormed", np.zeros(rows_n * head_dim, np.float32))
    if rows_n == 0 or head_dim == 0: return dnormed
    launch_warp("qk_norm_rope_backward", rows_n, ROW_THREADS, qk_norm_rope_backward,
                lambda: (scratch32(), shared("dy", 512, np.float32)), dinp, dnormed, dout, inp,
                weight, rstd, positions, n, heads, head_dim, rot_dim, theta)
    return dnormed

def host_embedding(kernel, out, ids, table, vocab, c):
    """device.rs `embedding`: ids checked on the host, rows(n)."""
    n = len(ids)
    for t, i in enumerate(ids):
        if i >= vocab: raise IndexError(f"token id {i} at position {t} is not below {vocab}")
    if n == 0 or c == 0: return
    launch(kernel.__name__, n, ROW_THREADS, kernel, None, out, buf("ids", ids, np.uint32), table,
           n, c, vocab)

def segments(ids):
    """backward.rs `segments`: distinct ids in increasing order, their starts
    in `order` (plus the end), token positions grouped by id, stably."""
    order = sorted(range(len(ids)), key=lambda t: ids[t])
    srt, starts = [], []
    for k, t in enumerate(order):
        if not srt or srt[-1] != ids[t]:
            srt.append(ids[t]); starts.append(k)
    starts.append(len(order))
    return srt, starts, order

def host_embedding_backward(dtable, dout, ids, vocab, c):
    """backward.rs `embedding_backward`: rows(distinct)."""
    n = len(ids)
    for t, i in enumerate(ids):
        if i >= vocab: raise IndexError(f"token id {i} at position {t} is not below {vocab}")
    if n == 0 or c == 0: return
    srt, starts, order = segments(ids)
    launch("embedding_backward", len(srt), ROW_THREADS, embedding_backward, None, dtable, dout,
           buf("ids_sorted", srt, np.uint32), buf("starts", starts, np.uint32),
           buf("order", order, np.uint32), len(srt), c)

def adamw_step(lr, beta1, beta2, eps, wd, step):
    """cpu/adamw.rs `AdamWStep::new`: the step's scalars in f64, then f32
    (decay, step_size, b1w, beta2, b2w, bc2_sqrt, eps)."""
    bc1 = 1.0 - beta1 ** step
    bc2_sqrt = np.sqrt(1.0 - beta2 ** step)
    return (F(1.0 - lr * wd), F(lr / bc1), F(1.0 - beta1), F(beta2), F(1.0 - beta2), F(bc2_sqrt),
            F(eps))

def host_sum_squares(x, n, cap):
    """backward.rs `sum_squares`: min(elems(n), 1024) blocks of 256 into
    zeroed partials, added in f64 in block order."""
    if n == 0: return 0.0, np.zeros(0, np.float32)
    blocks = min(elems(n, cap), 1024)
    partial = Buf("partial", np.zeros(blocks, np.float32))
    launch_warp("sum_squares_partial", blocks, REDUCE_THREADS, sum_squares_partial, scratch32,
                partial, x, n)
    return float(sum(float(p) for p in partial.a)), partial.a.copy()

# ---- checks ------------------------------------------------------------------

TOL = 1e-6      # pointwise float32 against float64, relative to max |ref|
TOL_SUM = 1e-5  # reductions (param grads, sums of squares, the norm's backward)

def exact(case, name, got, want):
    """Bit for bit (NaN payloads included)."""
    got, want = np.asarray(got), np.asarray(want)
    w = {4: np.uint32, 2: np.uint16}[want.dtype.itemsize]
    bad = int(np.count_nonzero(got.view(w).reshape(-1) != want.view(w).reshape(-1)))
    say(f"{case}: {name}: exact, {bad} of {want.size} elements differ {'ok' if bad == 0 else 'BUG'}")

def sig64(x): return 1.0 / (1.0 + np.exp(-x))
def silu64(x): return x * sig64(x)
def softplus64(x): return np.logaddexp(0.0, x)

def f32(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)

# ---- activation cases ------------------------------------------------------

def case_act(name, n, cap, seed=0):
    """The pointwise forward and backward kernels over n elements, the grid
    capped at `cap` blocks; in-place ones from known values."""
    rng = np.random.default_rng(seed)
    gate, up, dout = f32(rng, n, scale=3.0), f32(rng, n), f32(rng, n)
    x = f32(rng, n)
    if n > 4: gate[:4] = [30.0, -30.0, 0.0, -90.0]  # saturated sigmoid, exp underflow
    g64, u64, d64, x64 = (v.astype(D) for v in (gate, up, dout, x))
    out = nan_buf("out", n)
    run_elems("silu_mul_forward", silu_mul_forward, n, cap, out, buf("gate", gate), buf("up", up), n)
    check(name, "silu_mul_forward", out.a, silu64(g64) * u64)
    xb = buf("x", x)
    run_elems("sigmoid_gate_forward", sigmoid_gate_forward, n, cap, xb, buf("gate", gate), n)
    check(name, "sigmoid_gate_forward (in place)", xb.a, x64 * sig64(g64))
    xb = buf("x", gate)
    run_elems("silu_forward", silu_forward, n, cap, xb, n)
    check(name, "silu_forward (in place)", xb.a, silu64(g64))
    sg = sig64(g64)
    dsilu = sg * (1.0 + g64 * (1.0 - sg))
    dinp = nan_buf("dinp", n)
    run_elems("silu_backward", silu_backward, n, cap, dinp, buf("dout", dout), buf("inp", gate), n)
    check(name, "silu_backward", dinp.a, d64 * dsilu)
    dg, du = nan_buf("dgate", n), nan_buf("dup", n)
    run_elems("silu_mul_backward", silu_mul_backward, n, cap, dg, du, buf("dout", dout),
              buf("gate", gate), buf("up", up), n)
    check(name, "silu_mul_backward dgate", dg.a, d64 * u64 * dsilu)
    check(name, "silu_mul_backward dup", du.a, d64 * silu64(g64))
    dx, dz = nan_buf("dx", n), nan_buf("dgate", n)
    run_elems("sigmoid_gate_backward", sigmoid_gate_backward, n, cap, dx, dz, buf("dout", dout),
              buf("x", x), buf("gate", gate), n)
    check(name, "sigmoid_gate_backward dx", dx.a, d64 * sg)
    check(name, "sigmoid_gate_backward dgate", dz.a, d64 * x64 * sg * (1.0 - sg))
    x0 = f32(rng, n, scale=5.0)
    xb = buf("x", x0)
    run_elems("add_assign", add_assign, n, cap, xb, buf("y", x), n)
    check(name, "add_assign (onto non-zero x)", xb.a, x0.astype(D) + x64, TOL, x0)
    xb = buf("x", x0)
    run_elems("scale_f32", scale_f32, n, cap, xb, n, F(0.37))
    check(name, "scale_f32", xb.a, x0.astype(D) * float(F(0.37)))

def case_gating(name, t, nv, cap, seed=1):
    """Gated DeltaNet gating forward, then its backward from the saved g,
    beta and a (trainer order), da_log/ddt_bias accumulated onto non-zero
    values; a + dt_bias above 20 in places (softplus' linear tail)."""
    rng = np.random.default_rng(seed)
    n = t * nv
    a, b = f32(rng, t, nv, scale=4.0), f32(rng, t, nv, scale=3.0)
    if n > 6: a.reshape(-1)[[1, 4]] = [40.0, 25.0]; a.reshape(-1)[5] = -40.0
    a_log, dt_bias = f32(rng, nv, scale=0.5), f32(rng, nv)
    g, beta = nan_buf("g", n), nan_buf("beta", n)
    if nv == 0 or n % nv: raise ValueError
    if n:
        run_elems("gated_delta_gating_forward", gated_delta_gating_forward, n, cap, g, beta,
                  buf("a", a), buf("b", b), buf("a_log", a_log), buf("dt_bias", dt_bias), t, nv)
    A, B, AL, DT = a.astype(D), b.astype(D), a_log.astype(D), dt_bias.astype(D)
    check(name, "g", g.a, (-np.exp(AL) * softplus64(A + DT)).reshape(-1))
    check(name, "beta", beta.a, sig64(B).reshape(-1))
    dg, dbeta = f32(rng, t, nv), f32(rng, t, nv)
    dal0, ddt0 = f32(rng, nv), f32(rng, nv)
    da, db = nan_buf("da", n), nan_buf("db", n)
    dal, ddt = buf("da_log", dal0), buf("ddt_bias", ddt0)
    host_gated_delta_gating_backward(da, db, dal, ddt, buf("dg", dg), buf("dbeta", dbeta),
                                     buf("g", g.a), buf("beta", beta.a), buf("a", a),
                                     buf("a_log", a_log), buf("dt_bias", dt_bias), n, nv, cap)
    G, BE, DG = g.a.astype(D).reshape(t, nv), beta.a.astype(D).reshape(t, nv), dg.astype(D)
    da_ref = DG * -np.exp(AL) * sig64(A + DT)
    check(name, "db", db.a, (dbeta.astype(D) * BE * (1.0 - BE)).reshape(-1))
    check(name, "da", da.a, da_ref.reshape(-1))
    check(name, "da_log (+= sum_t dg g)", dal.a, dal0.astype(D) + (DG * G).sum(0), TOL_SUM, dal0)
    check(name, "ddt_bias (+= sum_t da)", ddt.a, ddt0.astype(D) + da_ref.sum(0), TOL_SUM, ddt0)

# ---- copy cases (exact) ------------------------------------------------------

def case_copy(name, cap, seed=2):
    rng = np.random.default_rng(seed)
    # copy_block: a column range of rows, and whole rows (col0 0, cols = width)
    for (w, h, r0, c0, rows, cols) in [(50, 30, 3, 7, 13, 29), (37, 40, 5, 0, 21, 37), (9, 4, 3, 8, 1, 1),
                                       (20, 10, 2, 3, 0, 5)]:
        inp = f32(rng, h * w)
        out = nan_buf("out", rows * cols)
        assert c0 + cols <= w and (r0 + rows) * w <= inp.size
        if rows and cols:
            run_elems("copy_block", copy_block, rows * cols, cap, out, buf("inp", inp), w, r0, c0,
                      rows, cols)
        want = inp.reshape(h, w)[r0:r0 + rows, c0:c0 + cols].reshape(-1)
        exact(name, f"copy_block {rows}x{cols} at ({r0},{c0}) of width {w}", out.a, want)
        # copy_into: the inverse, into a matrix whose other elements must stay
        dst = f32(rng, h * w)
        dst.reshape(h, w)[r0:r0 + rows, c0:c0 + cols] = np.nan
        ob = buf("out", dst)
        if rows and cols:
            run_elems("copy_into", copy_into, rows * cols, cap, ob, buf("inp", want), w, r0, c0,
                      rows, cols)
        w2 = dst.copy()
        w2.reshape(h, w)[r0:r0 + rows, c0:c0 + cols] = want.reshape(rows, cols)
        exact(name, f"copy_into {rows}x{cols} at ({r0},{c0}), the rest untouched", ob.a, w2)
    # copy_within: non-overlapping ranges either way, one element, none
    for (size, src, dst, n) in [(2000, 1100, 37, 777), (2000, 5, 1300, 700), (10, 9, 0, 1), (10, 2, 5, 0)]:
        a0 = f32(rng, size)
        a0[dst:dst + n] = np.nan
        assert max(src, dst) + n <= size and not (src < dst + n and dst < src + n and n > 0)
        b = buf("buf", a0)
        run_elems("copy_within", copy_within, n, cap, b, src, dst, n)
        want = a0.copy(); want[dst:dst + n] = a0[src:src + n]
        exact(name, f"copy_within {n} from {src} to {dst} of {size}", b.a, want)
    # zero_range
    for (size, off, n) in [(1500, 123, 1001), (7, 6, 1), (7, 3, 0)]:
        a0 = f32(rng, size)
        a0[off:off + n] = np.nan
        b = buf("buf", a0)
        run_elems("zero_range", zero_range, n, cap, b, off, n)
        want = a0.copy(); want[off:off + n] = 0.0
        exact(name, f"zero_range {n} at {off} of {size}", b.a, want)
    # gather_rows (rows may repeat), scatter_rows (distinct, the others untouched)
    for (held, width, rows) in [(20, 29, [int(r) for r in rng.integers(0, 20, 37)]), (3, 1, [2]),
                                (40, 300, [39, 0, 17]), (5, 7, [])]:
        inp = f32(rng, held * width)
        out = nan_buf("out", len(rows) * width)
        if rows and width:
            run_elems("gather_rows", gather_rows, len(rows) * width, cap, out, buf("inp", inp),
                      buf("rows", rows, np.uint32), len(rows), width)
        want = inp.reshape(held, width)[rows].reshape(-1)
        exact(name, f"gather_rows {len(rows)} rows of {width}", out.a, want)
    for (held, width, n) in [(40, 33, 17), (3, 1, 1), (5, 300, 3), (4, 6, 0)]:
        rows = [int(r) for r in rng.permutation(held)[:n]]
        inp = f32(rng, n * width)
        o0 = f32(rng, held * width)
        o0.reshape(held, width)[rows] = np.nan
        ob = buf("out", o0)
        if rows and width:
            run_elems("scatter_rows", scatter_rows, n * width, cap, ob, buf("inp", inp),
                      buf("rows", rows, np.uint32), n, width)
        want = o0.copy(); want.reshape(held, width)[rows] = inp.reshape(n, width)
        exact(name, f"scatter_rows {n} rows of {width} into {held}, the rest untouched", ob.a, want)

# ---- rope cases --------------------------------------------------------------

def rope_f32_angles(positions, rot_dim, theta):
    """rope.rs: inv_freq[i] = 1 / theta^(2i / rot_dim) and angle = pos *
    inv_freq, both in f32 (the kernels' documented contract, rope_inv_freq);
    cos and sin are then taken in float64."""
    half = rot_dim // 2
    inv = np.array([np.float32(1.0) / np.power(np.float32(theta), np.float32(2 * i) / np.float32(rot_dim))
                    for i in range(half)], np.float32)
    return (np.asarray(positions, np.float32)[:, None] * inv[None, :]).astype(D)  # [n, half], f32 products

def ref_qk_norm_rope(x, w, positions, rot_dim, theta, eps):
    """x [n, heads, hd] float64: rms-normalised with weight 1 + w, then the
    first rot_dim channels rotated pairing i with i + rot_dim/2."""
    hd = x.shape[2]
    r = 1.0 / np.sqrt((x * x).mean(2) + eps)  # [n, heads]
    y = x * r[:, :, None] * (1.0 + w)
    half = rot_dim // 2
    ang = rope_f32_angles(positions, rot_dim, theta)[:, None, :]
    c, s = np.cos(ang), np.sin(ang)
    a, b = y[:, :, :half].copy(), y[:, :, half:rot_dim].copy()
    y[:, :, :half] = a * c - b * s
    y[:, :, half:rot_dim] = b * c + a * s
    return y, r

def ref_qk_norm_rope_backward(dout, x, w, positions, rot_dim, theta, eps):
    """The transpose of the rotation (by the opposite angle), then the
    RMSNorm's Jacobian transposed: returns (dnormed, dinp)."""
    hd = x.shape[2]
    half = rot_dim // 2
    ang = rope_f32_angles(positions, rot_dim, theta)[:, None, :]
    c, s = np.cos(ang), np.sin(ang)
    dn = dout.copy()
    a, b = dout[:, :, :half], dout[:, :, half:rot_dim]
    dn[:, :, :half] = a * c + b * s
    dn[:, :, half:rot_dim] = b * c - a * s
    r = 1.0 / np.sqrt((x * x).mean(2) + eps)[:, :, None]
    dyw = dn * (1.0 + w)
    dinp = r * dyw - x * r ** 3 * (dyw * x).sum(2, keepdims=True) / hd
    return dn, dinp

def refcheck_rope(rng):
    """The float64 backward reference against central differences of the
    float64 forward (one token, two heads)."""
    hd, rot, th, eps = 10, 6, 1000.0, 1e-6
    x = rng.standard_normal((1, 2, hd)); w = 0.1 * rng.standard_normal(hd)
    dout = rng.standard_normal((1, 2, hd))
    _, dinp = ref_qk_norm_rope_backward(dout, x, w, [5], rot, th, eps)
    fd = np.zeros_like(x); h = 1e-6
    for hh in range(2):
        for j in range(hd):
            xp, xm = x.copy(), x.copy()
            xp[0, hh, j] += h; xm[0, hh, j] -= h
            fp = (ref_qk_norm_rope(xp, w, [5], rot, th, eps)[0] * dout).sum()
            fm = (ref_qk_norm_rope(xm, w, [5], rot, th, eps)[0] * dout).sum()
            fd[0, hh, j] = (fp - fm) / (2 * h)
    r = np.max(np.abs(fd - dinp)) / np.max(np.abs(dinp))
    say(f"rope reference: backward vs central differences of the forward: {r:.1e} {'ok' if r < 1e-6 else 'BUG'}")

def case_rope(name, positions, heads, hd, rot, backward=True, theta=10_000_000.0, eps=1e-6, seed=3):
    rng = np.random.default_rng(seed)
    n = len(positions)
    x = f32(rng, n, heads, hd, scale=2.0)
    w = f32(rng, hd, scale=0.2)
    xb, rstd = buf("x", x), nan_buf("rstd", n * heads)
    pb, wb = buf("positions", positions, np.uint32), buf("weight", w)
    host_qk_norm_rope(xb, rstd, wb, pb, n, heads, hd, rot, F(theta), F(eps))
    y, r = ref_qk_norm_rope(x.astype(D), w.astype(D), positions, rot, theta, eps)
    check(name, "forward out", xb.a, y.reshape(-1))
    check(name, "forward rstd", rstd.a, r.reshape(-1))
    if not backward: return
    dout = f32(rng, n, heads, hd)
    dinp = nan_buf("dinp", n * heads * hd)
    dn = host_qk_norm_rope_backward(dinp, buf("dout", dout), buf("inp", x), wb, rstd, pb, n, heads,
                                    hd, rot, F(theta))
    dn_ref, dinp_ref = ref_qk_norm_rope_backward(dout.astype(D), x.astype(D), w.astype(D), positions,
                                                 rot, theta, eps)
    check(name, "backward dnormed", dn.a, dn_ref.reshape(-1))
    check(name, "backward dinp", dinp.a, dinp_ref.reshape(-1), TOL_SUM)

# ---- embedding cases -------------------------------------------------------

def case_emb(name, ids, vocab, c, seed=4):
    rng = np.random.default_rng(seed)
    n = len(ids)
    table = f32(rng, vocab * c)
    out = nan_buf("out", n * c)
    host_embedding(embedding_forward_f32, out, ids, buf("table", table), vocab, c)
    exact(name, "embedding_forward_f32", out.a, table.reshape(vocab, c)[ids].reshape(-1))
    tb = rng.integers(0, 1 << 16, vocab * c).astype(np.uint16)
    tb[:6] = [0x7fc0, 0xff80, 0x0001, 0x8000, 0x7f80, 0xffff][:min(6, tb.size)]  # NaN, -inf, subnormal, -0, inf
    out = nan_buf("out", n * c)
    host_embedding(embedding_forward_bf16, out, ids, buf("table", tb, np.uint16), vocab, c)
    want = (tb.reshape(vocab, c)[ids].astype(np.uint32) << 16).view(np.float32).reshape(-1)
    exact(name, "embedding_forward_bf16 (widened bits)", out.a, want)
    # backward: repeated ids, onto a non-zero dtable; the rows of absent ids untouched
    d0 = f32(rng, vocab * c, scale=3.0)
    dout = f32(rng, n * c)
    dt = buf("dtable", d0)
    host_embedding_backward(dt, buf("dout", dout), ids, vocab, c)
    ref = d0.astype(D).reshape(vocab, c).copy()
    seq = d0.reshape(vocab, c).copy()  # cpu/embedding.rs: token by token in position order, f32
    for t, i in enumerate(ids):
        ref[i] += dout.reshape(n, c)[t]
        seq[i] = (seq[i] + dout.reshape(n, c)[t]).astype(np.float32)
    check(name, "embedding_backward (+=, repeated ids)", dt.a, ref.reshape(-1), TOL, d0)
    exact(name, "embedding_backward == CPU order (position order per id), untouched rows kept", dt.a,
          seq.reshape(-1))

def case_emb_guard(name):
    """An id out of range: the host rejects it (as the CPU); the kernel run
    directly writes zeros for it."""
    try:
        host_embedding(embedding_forward_f32, nan_buf("out", 4), [0, 3], buf("table", np.ones(6)), 3, 2)
        say(f"{name}: host check of an id >= vocab: not rejected BUG")
    except IndexError:
        say(f"{name}: host check of an id >= vocab: rejected ok")
    out = nan_buf("out", 6)
    launch("embedding_forward_f32", 3, ROW_THREADS, embedding_forward_f32, None, out,
           buf("ids", [1, 3, 7], np.uint32), buf("table", np.arange(6)), 3, 2, 3)
    exact(name, "kernel with ids 1, 3 (= vocab), 7: zeros for the last two", out.a,
          np.array([2, 3, 0, 0, 0, 0], np.float32))

# ---- bf16 conversion ---------------------------------------------------------

def bf16_ref(bits):
    """Round to nearest, ties to even, from the values (independent of the
    bit trick): the two bf16 neighbours by truncation, the nearer one, the
    even one on a tie, 2^128 standing for the overflow to inf; NaN keeps
    its sign and top payload, made quiet (as half::bf16::from_f32)."""
    out = []
    for b in bits:
        b = int(b)
        s, mag = b >> 31, b & 0x7fffffff
        if mag > 0x7f800000: out.append((b >> 16) | 0x40); continue
        if mag == 0x7f800000: out.append(b >> 16); continue
        v = float(np.uint32(mag).view(np.float32))
        lo = mag >> 16
        lo_v = float(np.uint32(lo << 16).view(np.float32))
        hi_v = 2.0 ** 128 if lo + 1 == 0x7f80 else float(np.uint32((lo + 1) << 16).view(np.float32))
        dl, dh = v - lo_v, hi_v - v
        r = lo if dl < dh else lo + 1 if dh < dl else (lo if lo % 2 == 0 else lo + 1)
        out.append((s << 15) | r)
    return np.array(out, np.uint16)

def case_bf16(name, cap, seed=5):
    rng = np.random.default_rng(seed)
    special = [0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0xffa00001,
               0x7f7fffff, 0x7f7f7fff, 0x7f7f8000, 0x7f7e8000, 0x00000001, 0x00008000, 0x00018000,
               0x00017fff, 0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001, 0x3fffffff, 0xbf818000,
               0xbf808000, 0x807fffff, 0x00800000]
    rnd = rng.integers(0, 1 << 32, 700, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 1 << 16, 100).astype(np.uint32) << 16) | 0x8000
    normals = f32(rng, 200, scale=100.0).view(np.uint32)
    bits = np.concatenate([np.array(special, np.uint32), rnd, ties, normals])
    n = bits.size
    out = Buf("out", np.full(n, 0xdead, np.uint16))
    run_elems("f32_to_bf16_copy", f32_to_bf16_copy, n, cap, out, Buf("inp", bits.view(np.float32).copy()), n)
    exact(name, f"f32_to_bf16_copy of {n} values (ties, NaNs, overflow, subnormals)", out.a, bf16_ref(bits))

# ---- AdamW -------------------------------------------------------------------

def case_adamw(name, n, steps, cap, with_bf16, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, wd=0.1, seed=6):
    """`steps` steps of adamw_update against torch's AdamW in float64
    (decoupled decay, bias-corrected moments) from the same start; the
    kernel's bf16 copy (when asked) the exact rounding of its f32 weight."""
    rng = np.random.default_rng(seed)
    p0 = f32(rng, n)
    P, M, V = p0.astype(D), np.zeros(n), np.zeros(n)
    pb, mb, vb = buf("param", p0), buf("exp_avg", np.zeros(n)), buf("exp_avg_sq", np.zeros(n))
    ob = Buf("out_bf16", np.full(n, 0xdead, np.uint16)) if with_bf16 else None
    for step in range(1, steps + 1):
        g = f32(rng, n, scale=0.1 * step)
        if n > 3: g[0] = 0.0; g[2] = 1e-30 * step  # a zero gradient, a tiny one
        run_elems("adamw_update", adamw_update, n, cap, pb, mb, vb, ob, buf("grad", g), n,
                  *adamw_step(lr, b1, b2, eps, wd, step))
        G = g.astype(D)
        P *= 1.0 - lr * wd
        M = b1 * M + (1.0 - b1) * G
        V = b2 * V + (1.0 - b2) * G * G
        P -= lr * (M / (1.0 - b1 ** step)) / (np.sqrt(V / (1.0 - b2 ** step)) + eps)
    check(name, f"param after {steps} steps", pb.a, P)
    check(name, f"param change p - p0 after {steps} steps", pb.a.astype(D) - p0, P - p0, 1e-4)
    check(name, "exp_avg", mb.a, M)
    check(name, "exp_avg_sq", vb.a, V)
    if with_bf16:
        exact(name, "out_bf16 = bf16(param), round to nearest even", ob.a, bf16_ref(pb.a.view(np.uint32)))

def case_sumsq(name, n, cap, seed=7):
    rng = np.random.default_rng(seed)
    x = f32(rng, n, scale=3.0)
    total, partial = host_sum_squares(buf("x", x), n, cap)
    X = x.astype(D)
    ref = float((X * X).sum())
    check(name, f"sum_squares of {n} ({len(partial)} blocks)", np.array([total]), np.array([ref]), TOL_SUM)
    if n:
        blocks, stride = len(partial), len(partial) * REDUCE_THREADS
        want = np.bincount(np.arange(n) % stride // REDUCE_THREADS, X * X, minlength=blocks)
        check(name, "partial[b] = its grid-stride elements' sum", partial, want, TOL_SUM)

# ---- the cases ---------------------------------------------------------------

def group_act():
    case_act("act n5000 grid<=3", 5000, 3)
    case_act("act n1000 grid<=3", 1000, 3)
    case_act("act n777 grid 1", 777, 1)
    case_act("act n1 grid 1", 1, 1)
    case_act("act n0 (the launchers return)", 0, 1)

def group_gating():
    case_gating("gating t333 nv3 grid<=2", 333, 3, 2)
    case_gating("gating t7 nv5 grid 1", 7, 5, 1)
    case_gating("gating t1 nv1", 1, 1, 1)

def group_copy():
    case_copy("copy grid<=2", 2)
    case_copy("copy grid 1", 1, seed=12)

def group_rope():
    refcheck_rope(np.random.default_rng(9))
    case_rope("rope n3 heads2 hd256 rot64 (partial)", [0, 1, 4097], 2, 256, 64)
    case_rope("rope n5 heads4 hd256 rot64 (Qwen3.5's shape)", [0, 17, 18, 900, 65535], 4, 256, 64)
    case_rope("rope n2 heads3 hd33 rot20 (odd head)", [7, 262143], 3, 33, 20)
    case_rope("rope n1 heads2 hd300 rot300 (norm loop strides)", [123], 2, 300, 300)
    case_rope("rope n2 heads1 hd8 rot0 (norm only)", [3, 9], 1, 8, 0)
    case_rope("rope n2 heads1 hd512 rot512 (backward's limit)", [5, 1000], 1, 512, 512, theta=10000.0)
    case_rope("rope n1 heads1 hd600 rot540 forward (rotation loop strides)", [77], 1, 600, 540,
              backward=False)
    case_rope("rope n0 (the launchers return)", [], 2, 16, 8)

def group_emb():
    case_emb("emb n9 vocab6 c300 (repeated ids)", [3, 1, 3, 0, 3, 5, 1, 3, 2], 6, 300)
    case_emb("emb n5 vocab10 c7", [9, 9, 9, 9, 9], 10, 7)
    case_emb("emb n1 vocab1 c1", [0], 1, 1)
    case_emb("emb n0 vocab4 c3", [], 4, 3)
    case_emb_guard("emb ids out of range")

def group_bf16():
    case_bf16("bf16 grid<=3", 3)

def group_adamw():
    case_adamw("adamw n1000 5 steps grid<=2 bf16", 1000, 5, 2, True)
    case_adamw("adamw n300 20 steps grid 1 no bf16, no decay", 300, 20, 1, False, lr=3e-3, wd=0.0)
    case_adamw("adamw n1 2 steps", 1, 2, 1, True)

def group_sumsq():
    case_sumsq("sumsq n1000 grid<=3", 1000, 3)
    case_sumsq("sumsq n3000 grid<=2", 3000, 2)
    case_sumsq("sumsq n1", 1, 3)
    case_sumsq("sumsq n0", 0, 3)

GROUPS = {"act": group_act, "gating": group_gating, "copy": group_copy, "rope": group_rope,
          "emb": group_emb, "bf16": group_bf16, "adamw": group_adamw, "sumsq": group_sumsq}

if __name__ == "__main__":
    run_groups(GROUPS, sys.argv[1:])
