"""Line-by-line transcription of kernels/src/cuda/attention.cu and the warp/block
helpers of prelude.cuh. `yield "cuNNN"` = __syncthreads() at line NNN;
`yield ("shfl", o, v, label)` = __shfl_xor_sync(0xffffffff, v, o)."""
import numpy as np
from simt import F, D

NEG_INF = F(-np.inf)
ATTN_MAX_DIM_PER_LANE = 8
ATTN_WARPS = 4
ATTN_PAIR_WARPS = 4
ATTN_PAIRS_PER_WARP = 4
ATTN_PAIRS = ATTN_PAIR_WARPS * ATTN_PAIRS_PER_WARP
ATTN_KEY_TILE = 16
ATTN_BWD_ROWS = 2
ATTN_BWD_BLOCK_ROWS = ATTN_PAIR_WARPS * ATTN_BWD_ROWS

def expf(x): return np.exp(F(x))
def logf(x): return np.log(F(x))
def fmaxf(a, b): return np.fmax(F(a), F(b))
def u(x): return int(x)
# fmaf(a, b, c): a * b is exact in float64 and the sum is rounded to float64,
# then to float32 -- a double rounding that a true fused multiply-add does
# not do (it can differ in the last bit in rare cases).
def fmaf(a, b, c): return F(D(F(a)) * D(F(b)) + D(F(c)))

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

# cu:32
def attn_merge_row(out, sm, sl, sacc, hd, t, nt):
    big = NEG_INF
    for w in range(ATTN_WARPS): big = fmaxf(big, sm[w])  # cu:35
    total = F(0.0)
    for w in range(ATTN_WARPS):
        if sm[w] != NEG_INF: total = fmaf(sl[w], expf(sm[w] - big), total)  # cu:38
    for d in range(t, hd, nt):  # cu:39
        o = F(0.0)
        for w in range(ATTN_WARPS):
            if sm[w] != NEG_INF: o = fmaf(sacc[w * hd + d], expf(sm[w] - big), o)  # cu:42
        out[d] = F(o / total) if total > F(0.0) else F(0.0)  # cu:43

# cu:49
def attn_stash(shared, warp, warps, m, l, acc, hd, tid):
    lane = tid & 31
    if lane == 0:
        shared[warp] = m  # cu:53
        shared[warps + warp] = l  # cu:54
    for i in range(ATTN_MAX_DIM_PER_LANE):
        d = lane + 32 * i
        if d < hd: shared[2 * warps + warp * hd + d] = acc[i]  # cu:58

# cu:63
def attn_load_q(qr, acc, qs, hd, scale, tid):
    lane = tid & 31
    for i in range(ATTN_MAX_DIM_PER_LANE):
        d = lane + 32 * i
        qr[i] = F(qs[d] * scale) if d < hd else F(0.0)  # cu:68
        acc[i] = F(0.0)  # cu:69

# cu:74
def attn_load_row(r, row, hd, tid):
    lane = tid & 31
    for i in range(ATTN_MAX_DIM_PER_LANE):
        d = lane + 32 * i
        r[i] = row[d] if d < hd else F(0.0)  # cu:78

# cu:83
def attn_dot(a, b, hd, tid):
    lane = tid & 31
    s = F(0.0)
    for i in range(ATTN_MAX_DIM_PER_LANE):
        if lane + 32 * i < hd: s = fmaf(a[i], b[i], s)  # cu:87
    return (yield from warp_sum(s))  # cu:88

# cu:93; returns (p, m, l, corr)
def attn_online(s, m, l):
    m_new = fmaxf(m, s)
    corr = F(0.0) if m == NEG_INF else expf(m - m_new)  # cu:95
    p = expf(s - m_new)
    l = fmaf(l, corr, p)  # cu:97
    return p, m_new, l, corr

# cu:104; returns (m, l)
def attn_step(kr, vr, qr, acc, m, l, hd, tid):
    lane = tid & 31
    dot = yield from attn_dot(qr, kr, hd, tid)  # cu:107
    p, m, l, corr = attn_online(dot, m, l)  # cu:107
    for i in range(ATTN_MAX_DIM_PER_LANE):
        if lane + 32 * i < hd: acc[i] = fmaf(p, vr[i], F(acc[i] * corr))  # cu:109
    return m, l

# cu:115
def paged_kv_write(bx, tid, bdim, gdim, sh, k_pool, v_pool, k, v, slot_mapping, tokens, kv_row):
    n = tokens * kv_row
    i = bx * bdim + tid
    while i < n:
        t, c = i // kv_row, i % kv_row
        dst = u(slot_mapping[t]) * kv_row + c  # cu:122
        k_pool[dst] = k[i]  # cu:123
        v_pool[dst] = v[i]  # cu:124
        i += gdim * bdim
    return
    yield

# cu:132
def paged_attention_decode(bx, tid, bdim, gdim, shared, out, q, k_pool, v_pool, block_tables,
                           context_lens, seqs, n_heads, n_kv_heads, hd, block_size, max_blocks, scale):
    s, h = bx // n_heads, bx % n_heads
    if s >= seqs: return
    kvh = h // (n_heads // n_kv_heads)
    warp = tid >> 5
    qr = [F(0)] * 8; acc = [F(0)] * 8; kr = [F(0)] * 8; vr = [F(0)] * 8
    attn_load_q(qr, acc, q + (s * n_heads + h) * hd, hd, scale, tid)  # cu:144
    m, l = NEG_INF, F(0.0)
    n = u(context_lens[s])  # cu:146
    row = n_kv_heads * hd
    j = warp
    while j < n:  # cu:148
        blk = u(block_tables[s * max_blocks + j // block_size])  # cu:149
        base = (blk * block_size + j % block_size) * row + kvh * hd  # cu:150
        attn_load_row(kr, k_pool + base, hd, tid)  # cu:151
        attn_load_row(vr, v_pool + base, hd, tid)  # cu:152
        m, l = yield from attn_step(kr, vr, qr, acc, m, l, hd, tid)  # cu:153
        j += ATTN_WARPS
    attn_stash(shared, warp, ATTN_WARPS, m, l, acc, hd, tid)  # cu:155
    yield "cu156"
    attn_merge_row(out + (s * n_heads + h) * hd, shared + 0, shared + ATTN_WARPS,  # cu:157
                   shared + 2 * ATTN_WARPS, hd, tid, bdim)

# cu:185; `at(j)` is AttnPackedRows / AttnPagedRows::at
def attn_prefill_tile(out, q, k, v, at, q_first, past, n_new, pair0, g, n_heads, n_kv_heads, hd,
                      scale, shared, tid, bdim):
    warp = tid >> 5
    slot, pw = warp % ATTN_WARPS, warp // ATTN_WARPS
    group = n_heads // n_kv_heads
    pairs = n_new * group
    R = ATTN_PAIRS_PER_WARP
    qr = [[F(0)] * 8 for _ in range(R)]; acc = [[F(0)] * 8 for _ in range(R)]
    m = [NEG_INF] * R; l = [F(0)] * R; last = [0] * R
    for r in range(R):  # cu:198
        x = pair0 + pw * R + r
        i, h = x // group, g * group + x % group
        last[r] = past + i if x < pairs else -1  # cu:201
        attn_load_q(qr[r], acc[r], q + ((q_first + (i if x < pairs else 0)) * n_heads + h) * hd, hd, scale, tid)  # cu:202
        m[r] = NEG_INF; l[r] = F(0.0)
    x_end = pair0 + ATTN_PAIRS if pair0 + ATTN_PAIRS < pairs else pairs  # cu:207
    n_keys = past + (x_end - 1) // group + 1  # cu:208
    sk = shared + 0
    sv = shared + ATTN_KEY_TILE * hd  # cu:210
    kr = [F(0)] * 8; vr = [F(0)] * 8
    for j0 in range(0, n_keys, ATTN_KEY_TILE):  # cu:212
        nt = n_keys - j0 if n_keys - j0 < ATTN_KEY_TILE else ATTN_KEY_TILE
        yield "cu214"
        for e in range(tid, nt * hd, bdim):  # cu:215
            a = at(j0 + e // hd) + g * hd + e % hd  # cu:216
            sk[e] = k[a]  # cu:217
            sv[e] = v[a]  # cu:218
        yield "cu220"
        for jj in range(slot, nt, ATTN_WARPS):  # cu:221
            attn_load_row(kr, sk + jj * hd, hd, tid)  # cu:222
            attn_load_row(vr, sv + jj * hd, hd, tid)  # cu:223
            for r in range(R):
                if j0 + jj <= last[r]:  # cu:226
                    m[r], l[r] = yield from attn_step(kr, vr, qr[r], acc[r], m[r], l[r], hd, tid)  # cu:226
    warps = ATTN_WARPS * ATTN_PAIR_WARPS
    t = tid - pw * ATTN_WARPS * 32  # cu:231
    for r in range(R):  # cu:233
        yield "cu234"
        attn_stash(shared, warp, warps, m[r], l[r], acc[r], hd, tid)  # cu:235
        yield "cu236"
        x = pair0 + pw * R + r
        if x < pairs:  # cu:238
            i, h = x // group, g * group + x % group
            w0 = pw * ATTN_WARPS
            attn_merge_row(out + ((q_first + i) * n_heads + h) * hd, shared + w0,  # cu:241
                           shared + warps + w0, shared + 2 * warps + w0 * hd, hd, t,
                           ATTN_WARPS * 32)

# cu:254
def varlen_attention_prefill(bx, tid, bdim, gdim, shared, out, q, k, v, cu_seqlens, tiles,
                             n_heads, n_kv_heads, hd, scale):
    tile, g = bx // n_kv_heads, bx % n_kv_heads
    s, pair0 = u(tiles[2 * tile]), u(tiles[2 * tile + 1])  # cu:259
    first = u(cu_seqlens[s])  # cu:260
    n_new = u(cu_seqlens[s + 1]) - u(cu_seqlens[s])  # cu:261
    row = n_kv_heads * hd  # cu:262
    at = lambda j: (first + j) * row  # cu:167
    yield from attn_prefill_tile(out, q, k, v, at, first, 0, n_new, pair0,  # cu:263
                                 g, n_heads, n_kv_heads, hd, scale, shared, tid, bdim)

# cu:273
def paged_attention_prefill(bx, tid, bdim, gdim, shared, out, q, k_pool, v_pool, block_tables,
                            pasts, cu_seqlens, tiles, n_heads, n_kv_heads, hd, block_size,
                            max_blocks, scale):
    tile, g = bx // n_kv_heads, bx % n_kv_heads
    s, pair0 = u(tiles[2 * tile]), u(tiles[2 * tile + 1])  # cu:279
    n_new = u(cu_seqlens[s + 1]) - u(cu_seqlens[s])  # cu:280
    table = block_tables + s * max_blocks  # cu:281
    row = n_kv_heads * hd
    at = lambda j: (u(table[j // block_size]) * block_size + j % block_size) * row  # cu:173
    yield from attn_prefill_tile(out, q, k_pool, v_pool, at, u(cu_seqlens[s]), u(pasts[s]), n_new,  # cu:282
                                 pair0, g, n_heads, n_kv_heads, hd, scale, shared, tid, bdim)

# ---- backward

# cu:306
def attn_sum_slots(out, shared, pw, hd, mul, tid):
    t = tid - pw * ATTN_WARPS * 32
    for d in range(t, hd, ATTN_WARPS * 32):  # cu:309
        o = F(0.0)
        for w in range(ATTN_WARPS): o = F(o + shared[(pw * ATTN_WARPS + w) * hd + d])  # cu:311
        out[d] = F(mul * o)  # cu:312

# cu:318
def attn_stage_kv(sk, sv, k, v, j0, nt, kstride, g, hd, tid, bdim):
    yield "cu321"
    for e in range(tid, nt * hd, bdim):  # cu:322
        a = (j0 + e // hd) * kstride + g * hd + e % hd  # cu:323
        sk[e] = k[a]  # cu:324
        sv[e] = v[a]  # cu:325
    yield "cu327"

# cu:333
def attention_backward_dq(bx, tid, bdim, gdim, shared, dq, lse_out, dd_out, dout, q, k, v,
                          nq, nk, heads, kv_heads, hd, scale):
    R, warps = ATTN_BWD_ROWS, ATTN_WARPS * ATTN_PAIR_WARPS
    lane, warp = tid & 31, tid >> 5
    slot, pw = warp % ATTN_WARPS, warp // ATTN_WARPS
    g, pair0 = bx % kv_heads, bx // kv_heads * ATTN_BWD_BLOCK_ROWS  # cu:341
    group, pairs, past = heads // kv_heads, nq * heads // kv_heads, nk - nq
    qr = [[F(0)] * 8 for _ in range(R)]; dor = [[F(0)] * 8 for _ in range(R)]
    acc = [[F(0)] * 8 for _ in range(R)]
    m = [NEG_INF] * R; l = [F(0)] * R; dsum = [F(0)] * R; lse = [F(0)] * R; Dv = [F(0)] * R
    last = [0] * R; row = [0] * R
    for r in range(R):  # cu:349
        x = pair0 + pw * R + r
        i, h = (x // group if x < pairs else 0), g * group + x % group
        last[r] = past + i if x < pairs else -1  # cu:352
        row[r] = (i * heads + h) * hd
        attn_load_q(qr[r], acc[r], q + row[r], hd, scale, tid)  # cu:354
        attn_load_row(dor[r], dout + row[r], hd, tid)  # cu:355
        m[r] = NEG_INF; l[r] = F(0.0); dsum[r] = F(0.0)
    x_end = pair0 + ATTN_BWD_BLOCK_ROWS if pair0 + ATTN_BWD_BLOCK_ROWS < pairs else pairs
    n_keys = past + (x_end - 1) // group + 1  # cu:361
    kstride = kv_heads * hd
    sk = shared + 0; sv = shared + ATTN_KEY_TILE * hd  # cu:364
    kr = [F(0)] * 8; vr = [F(0)] * 8
    for j0 in range(0, n_keys, ATTN_KEY_TILE):  # cu:367
        nt = n_keys - j0 if n_keys - j0 < ATTN_KEY_TILE else ATTN_KEY_TILE
        yield from attn_stage_kv(sk, sv, k, v, j0, nt, kstride, g, hd, tid, bdim)  # cu:369
        for jj in range(slot, nt, ATTN_WARPS):
            attn_load_row(kr, sk + jj * hd, hd, tid)  # cu:371
            attn_load_row(vr, sv + jj * hd, hd, tid)  # cu:372
            for r in range(R):
                if j0 + jj <= last[r]:  # cu:375
                    s_ = yield from attn_dot(qr[r], kr, hd, tid)  # cu:376
                    dov = yield from attn_dot(dor[r], vr, hd, tid)  # cu:376
                    p, m[r], l[r], corr = attn_online(s_, m[r], l[r])  # cu:377
                    dsum[r] = fmaf(p, dov, F(dsum[r] * corr))  # cu:378
    yield "cu383"
    if lane == 0:
        for r in range(R):
            shared[warp * R + r] = m[r]  # cu:386
            shared[(warps + warp) * R + r] = l[r]  # cu:387
            shared[(2 * warps + warp) * R + r] = dsum[r]  # cu:388
    yield "cu390"
    for r in range(R):  # cu:392
        big, tl, ts = NEG_INF, F(0.0), F(0.0)
        for w in range(ATTN_WARPS):
            big = fmaxf(big, shared[(pw * ATTN_WARPS + w) * R + r])  # cu:395
        for w in range(ATTN_WARPS):
            a = (pw * ATTN_WARPS + w) * R + r
            if shared[a] == NEG_INF: continue  # cu:398
            e = expf(shared[a] - big)  # cu:399
            tl = fmaf(shared[warps * R + a], e, tl)  # cu:400
            ts = fmaf(shared[2 * warps * R + a], e, ts)  # cu:401
        lse[r] = F(0.0) if last[r] < 0 else F(big + logf(tl))  # cu:403
        Dv[r] = F(0.0) if last[r] < 0 else F(ts / tl)  # cu:404
    for j0 in range(0, n_keys, ATTN_KEY_TILE):  # cu:407
        nt = n_keys - j0 if n_keys - j0 < ATTN_KEY_TILE else ATTN_KEY_TILE
        yield from attn_stage_kv(sk, sv, k, v, j0, nt, kstride, g, hd, tid, bdim)  # cu:409
        for jj in range(slot, nt, ATTN_WARPS):
            attn_load_row(kr, sk + jj * hd, hd, tid)  # cu:411
            attn_load_row(vr, sv + jj * hd, hd, tid)  # cu:412
            for r in range(R):
                if j0 + jj <= last[r]:  # cu:415
                    sc = yield from attn_dot(qr[r], kr, hd, tid)  # cu:416
                    p = expf(sc - lse[r])  # cu:416
                    dv_ = yield from attn_dot(dor[r], vr, hd, tid)  # cu:417
                    ds = F(p * F(dv_ - Dv[r]))  # cu:417
                    for i in range(ATTN_MAX_DIM_PER_LANE):
                        if lane + 32 * i < hd: acc[r][i] = fmaf(ds, kr[i], acc[r][i])  # cu:419
    for r in range(R):  # cu:424
        yield "cu425"
        for i in range(ATTN_MAX_DIM_PER_LANE):
            if lane + 32 * i < hd: shared[warp * hd + lane + 32 * i] = acc[r][i]  # cu:427
        yield "cu428"
        if last[r] >= 0:  # cu:429
            attn_sum_slots(dq + row[r], shared, pw, hd, scale, tid)  # cu:430
            if slot == 0 and lane == 0:
                lse_out[row[r] // hd] = lse[r]  # cu:432
                dd_out[row[r] // hd] = Dv[r]  # cu:433

# cu:442
def attention_backward_dkv(bx, tid, bdim, gdim, shared, dk, dv, dout, q, k, v, lse, dd,
                           nq, nk, heads, kv_heads, hd, scale):
    R, warps = ATTN_BWD_ROWS, ATTN_WARPS * ATTN_PAIR_WARPS
    lane, warp = tid & 31, tid >> 5
    slot, pw = warp % ATTN_WARPS, warp // ATTN_WARPS
    g, key0 = bx % kv_heads, bx // kv_heads * ATTN_BWD_BLOCK_ROWS  # cu:450
    group, pairs, past = heads // kv_heads, nq * heads // kv_heads, nk - nq
    kr = [[F(0)] * 8 for _ in range(R)]; vr = [[F(0)] * 8 for _ in range(R)]
    adk = [[F(0)] * 8 for _ in range(R)]; adv = [[F(0)] * 8 for _ in range(R)]
    key = [0] * R
    for r in range(R):  # cu:456
        j = key0 + pw * R + r
        key[r] = j if j < nk else nk  # cu:458
        a = ((j if j < nk else 0) * kv_heads + g) * hd
        attn_load_row(kr[r], k + a, hd, tid)  # cu:460
        attn_load_row(vr[r], v + a, hd, tid)  # cu:461
    x_begin = (key0 - past if key0 - past > 0 else 0) * group  # cu:466
    sq = shared + 0
    sdo = sq + ATTN_KEY_TILE * hd
    slse = sdo + ATTN_KEY_TILE * hd
    sdd = slse + ATTN_KEY_TILE  # cu:470
    qr = [F(0)] * 8; dor = [F(0)] * 8
    for x0 in range(x_begin, pairs, ATTN_KEY_TILE):  # cu:472
        nt = pairs - x0 if pairs - x0 < ATTN_KEY_TILE else ATTN_KEY_TILE
        yield "cu474"
        for e in range(tid, nt * hd, bdim):  # cu:475
            x = x0 + e // hd
            a = ((x // group) * heads + g * group + x % group) * hd + e % hd  # cu:477
            sq[e] = F(q[a] * scale)  # cu:478
            sdo[e] = dout[a]  # cu:479
        for e in range(tid, nt, bdim):  # cu:481
            x = x0 + e
            a = (x // group) * heads + g * group + x % group  # cu:483
            slse[e] = lse[a]  # cu:484
            sdd[e] = dd[a]  # cu:485
        yield "cu487"
        for xx in range(slot, nt, ATTN_WARPS):  # cu:488
            pos = past + (x0 + xx) // group
            attn_load_row(qr, sq + xx * hd, hd, tid)  # cu:490
            attn_load_row(dor, sdo + xx * hd, hd, tid)  # cu:491
            for r in range(R):
                if key[r] <= pos:  # cu:494
                    sc = yield from attn_dot(qr, kr[r], hd, tid)  # cu:495
                    p = expf(sc - slse[xx])  # cu:495
                    dv_ = yield from attn_dot(dor, vr[r], hd, tid)  # cu:496
                    ds = F(p * F(dv_ - sdd[xx]))  # cu:496
                    for i in range(ATTN_MAX_DIM_PER_LANE):
                        if lane + 32 * i < hd:
                            adk[r][i] = fmaf(ds, qr[i], adk[r][i])  # cu:499
                            adv[r][i] = fmaf(p, dor[i], adv[r][i])  # cu:500
    for r in range(R):  # cu:506
        yield "cu507"
        for i in range(ATTN_MAX_DIM_PER_LANE):
            if lane + 32 * i < hd:
                shared[warp * hd + lane + 32 * i] = adk[r][i]  # cu:510
                shared[(warps + warp) * hd + lane + 32 * i] = adv[r][i]  # cu:511
        yield "cu513"
        if key[r] < nk:  # cu:514
            a = (key[r] * kv_heads + g) * hd
            attn_sum_slots(dk + a, shared, pw, hd, F(1.0), tid)  # cu:516
            attn_sum_slots(dv + a, shared + warps * hd, pw, hd, F(1.0), tid)  # cu:517
