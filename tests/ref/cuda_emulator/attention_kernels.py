"""Line-by-line transcription of kernels/src/cuda/attention.cu and the warp/block
helpers of prelude.cuh. `yield "cuNNN"` = __syncthreads() at line NNN;
`yield ("shfl", o, v, label)` = __shfl_xor_sync(0xffffffff, v, o)."""
import numpy as np
from simt import F, D

NEG_INF = F(-np.inf)
ATTN_MAX_DIM_PER_LANE = 8
ATTN_BWD_TILE = 64

def expf(x): return np.exp(F(x))
def logf(x): return np.log(F(x))
def fmaxf(a, b): return np.fmax(F(a), F(b))
def u(x): return int(x)

# prelude.cuh:29
def warp_sum(v):
    o = 16
    while o > 0:
        v = F(v + (yield ("shfl", o, F(v), "warp_sum")))  # p:30
        o >>= 1
    return v

# prelude.cuh:34
def warp_max(v):
    o = 16
    while o > 0:
        v = fmaxf(v, (yield ("shfl", o, F(v), "warp_max")))  # p:35
        o >>= 1
    return v

# prelude.cuh:41
def block_sum(v, scratch, tid, bdim):
    lane, warp = tid & 31, tid >> 5
    v = yield from warp_sum(v)
    yield "p44"
    if lane == 0: scratch[warp] = v
    yield "p46"
    warps = bdim >> 5
    v = scratch[lane] if lane < warps else F(0.0)
    return (yield from warp_sum(v))

def block_max(v, scratch, tid, bdim):
    lane, warp = tid & 31, tid >> 5
    v = yield from warp_max(v)
    yield "p55"
    if lane == 0: scratch[warp] = v
    yield "p57"
    warps = bdim >> 5
    v = scratch[lane] if lane < warps else NEG_INF
    return (yield from warp_max(v))

# cu:16
def attn_merge_and_store(out, m, l, acc, hd, shared, tid, bdim):
    lane, warp, warps = tid & 31, tid >> 5, bdim >> 5  # cu:18
    sm = shared + 0  # cu:19
    sl = shared + warps  # cu:20
    sacc = shared + 2 * warps  # cu:21
    if lane == 0:
        sm[warp] = m; sl[warp] = l  # cu:22
    for i in range(ATTN_MAX_DIM_PER_LANE):  # cu:23
        d = lane + 32 * i
        if d < hd: sacc[warp * hd + d] = acc[i]  # cu:25
    yield "cu27"
    big = NEG_INF
    for w in range(warps): big = fmaxf(big, sm[w])  # cu:29
    total = F(0.0)
    for w in range(warps):  # cu:31
        total = F(total + (F(0.0) if sm[w] == NEG_INF else F(sl[w] * expf(sm[w] - big))))
    for d in range(tid, hd, bdim):  # cu:32
        o = F(0.0)
        for w in range(warps):
            if sm[w] != NEG_INF: o = F(o + F(sacc[w * hd + d] * expf(sm[w] - big)))  # cu:35
        out[d] = F(o / total) if total > F(0.0) else F(0.0)  # cu:36

# cu:41
def attn_load_q(qr, acc, qs, hd, scale, tid):
    lane = tid & 31
    for i in range(ATTN_MAX_DIM_PER_LANE):
        d = lane + 32 * i
        qr[i] = F(qs[d] * scale) if d < hd else F(0.0)  # cu:46
        acc[i] = F(0.0)

# cu:52
def attn_step(krow, vrow, qr, acc, m, l, hd, tid):
    lane = tid & 31
    dot = F(0.0)
    for i in range(ATTN_MAX_DIM_PER_LANE):
        d = lane + 32 * i
        if d < hd: dot = F(dot + F(qr[i] * krow[d]))  # cu:58
    dot = yield from warp_sum(dot)  # cu:60
    m_new = fmaxf(m, dot)
    corr = F(0.0) if m == NEG_INF else expf(m - m_new)
    p = expf(dot - m_new)
    l = F(F(l * corr) + p)
    for i in range(ATTN_MAX_DIM_PER_LANE):
        d = lane + 32 * i
        if d < hd: acc[i] = F(F(acc[i] * corr) + F(p * vrow[d]))  # cu:67
    m = m_new
    return m, l

# cu:75
def paged_kv_write(bx, tid, bdim, gdim, sh, k_pool, v_pool, k, v, slot_mapping, tokens, kv_row):
    n = tokens * kv_row
    i = bx * bdim + tid
    while i < n:
        t, c = i // kv_row, i % kv_row
        dst = u(slot_mapping[t]) * kv_row + c  # cu:82
        k_pool[dst] = k[i]
        v_pool[dst] = v[i]
        i += gdim * bdim
    return
    yield

# cu:91
def paged_attention_decode(bx, tid, bdim, gdim, shared, out, q, k_pool, v_pool, block_tables,
                           context_lens, seqs, n_heads, n_kv_heads, hd, block_size, max_blocks, scale):
    s, h = bx // n_heads, bx % n_heads
    if s >= seqs: return
    kvh = h // (n_heads // n_kv_heads)
    warp, warps = tid >> 5, bdim >> 5
    qr = [F(0)] * 8; acc = [F(0)] * 8
    attn_load_q(qr, acc, q + (s * n_heads + h) * hd, hd, scale, tid)
    m, l = NEG_INF, F(0.0)
    n = u(context_lens[s])
    row = n_kv_heads * hd
    j = warp
    while j < n:  # cu:105
        blk = u(block_tables[s * max_blocks + j // block_size])
        base = (blk * block_size + j % block_size) * row + kvh * hd
        m, l = yield from attn_step(k_pool + base, v_pool + base, qr, acc, m, l, hd, tid)
        j += warps
    yield from attn_merge_and_store(out + (s * n_heads + h) * hd, m, l, acc, hd, shared, tid, bdim)

# cu:117
def varlen_attention_prefill(bx, tid, bdim, gdim, shared, out, q, k, v, cu_seqlens, token_seq,
                             tokens, n_heads, n_kv_heads, hd, scale):
    t, h = bx // n_heads, bx % n_heads
    if t >= tokens: return
    kvh = h // (n_heads // n_kv_heads)
    warp, warps = tid >> 5, bdim >> 5
    start = u(cu_seqlens[u(token_seq[t])])
    qr = [F(0)] * 8; acc = [F(0)] * 8
    attn_load_q(qr, acc, q + (t * n_heads + h) * hd, hd, scale, tid)
    m, l = NEG_INF, F(0.0)
    row = n_kv_heads * hd
    j = start + warp
    while j <= t:  # cu:131
        base = j * row + kvh * hd
        m, l = yield from attn_step(k + base, v + base, qr, acc, m, l, hd, tid)
        j += warps
    yield from attn_merge_and_store(out + (t * n_heads + h) * hd, m, l, acc, hd, shared, tid, bdim)

def dot_hd(a, b, hd):
    s = F(0.0)
    for d in range(hd): s = F(s + F(a[d] * b[d]))
    return s

# cu:158
def attention_backward_dq(bx, tid, bdim, gdim, shs, dq, lse_out, dd_out, dout, q, k, v,
                          nq, nk, heads, kv_heads, hd, scale):
    sh, scratch = shs
    sq = sh + 0; sdo = sq + hd; sds = sdo + hd
    i, h = bx // heads, bx % heads
    if i >= nq: return
    g = h // (heads // kv_heads)
    row = (i * heads + h) * hd
    for d in range(tid, hd, bdim):
        sq[d] = q[row + d]; sdo[d] = dout[row + d]
    yield "cu174"
    live = nk - nq + i + 1
    kstride = kv_heads * hd
    kg = k + g * hd; vg = v + g * hd
    m = NEG_INF
    for j in range(tid, live, bdim):
        m = fmaxf(m, F(scale * dot_hd(sq, kg + j * kstride, hd)))
    m = yield from block_max(m, scratch, tid, bdim)
    l = F(0.0)
    for j in range(tid, live, bdim):
        l = F(l + expf(F(scale * dot_hd(sq, kg + j * kstride, hd)) - m))
    l = yield from block_sum(l, scratch, tid, bdim)
    lse = F(m + logf(l))
    dpart = F(0.0)
    for j in range(tid, live, bdim):
        p = expf(F(scale * dot_hd(sq, kg + j * kstride, hd)) - lse)
        dpart = F(dpart + F(p * dot_hd(sdo, vg + j * kstride, hd)))
    Dv = yield from block_sum(dpart, scratch, tid, bdim)
    acc = F(0.0)
    for j0 in range(0, live, ATTN_BWD_TILE):
        n = live - j0 if live - j0 < ATTN_BWD_TILE else ATTN_BWD_TILE
        if tid < ATTN_BWD_TILE:
            ds = F(0.0)
            if tid < n:
                j = j0 + tid
                p = expf(F(scale * dot_hd(sq, kg + j * kstride, hd)) - lse)
                ds = F(p * F(dot_hd(sdo, vg + j * kstride, hd) - Dv))
            sds[tid] = ds
        yield "cu208"
        if tid < hd:
            for uu in range(n): acc = F(acc + F(sds[uu] * kg[(j0 + uu) * kstride + tid]))
        yield "cu211"
    if tid < hd: dq[row + tid] = F(scale * acc)
    if tid == 0:
        lse_out[i * heads + h] = lse
        dd_out[i * heads + h] = Dv

# cu:220
def attention_backward_dkv(bx, tid, bdim, gdim, sh, dk, dv, dout, q, k, v, lse, dd,
                           nq, nk, heads, kv_heads, hd, scale):
    sk = sh + 0; sv = sk + hd; sp = sv + hd; sds = sp + ATTN_BWD_TILE
    j, g = bx // kv_heads, bx % kv_heads
    if j >= nk: return
    group = heads // kv_heads
    krow = (j * kv_heads + g) * hd
    for d in range(tid, hd, bdim):
        sk[d] = k[krow + d]; sv[d] = v[krow + d]
    yield "cu236"
    i0 = j - (nk - nq)
    if i0 < 0: i0 = 0
    total = (nq - i0) * group
    adk = F(0.0); adv = F(0.0)
    for x0 in range(0, total, ATTN_BWD_TILE):
        n = total - x0 if total - x0 < ATTN_BWD_TILE else ATTN_BWD_TILE
        if tid < ATTN_BWD_TILE:
            p = F(0.0); ds = F(0.0)
            if tid < n:
                x = x0 + tid
                i, h = i0 + x // group, g * group + x % group
                row = (i * heads + h) * hd
                p = expf(F(scale * dot_hd(q + row, sk, hd)) - lse[i * heads + h])
                ds = F(p * F(dot_hd(dout + row, sv, hd) - dd[i * heads + h]))
            sp[tid] = p; sds[tid] = ds
        yield "cu258"
        if tid < hd:
            for uu in range(n):
                x = x0 + uu
                i, h = i0 + x // group, g * group + x % group
                row = (i * heads + h) * hd
                adv = F(adv + F(sp[uu] * dout[row + tid]))
                adk = F(adk + F(sds[uu] * q[row + tid]))
        yield "cu268"
    if tid < hd:
        dk[krow + tid] = F(scale * adk)
        dv[krow + tid] = adv
