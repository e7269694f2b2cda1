"""Line-by-line transcription of kernels/src/cuda/attention.cu and the warp/block
helpers of prelude.cuh. `yield "cuNNN"` = __syncthreads() at line NNN;
`yield ("shfl", o, v, label)` = __shfl_xor_sync(0xffffffff, v, o)."""
import numpy as np
from simt import F, D
from prelude import (NEG_INF, u, expf, logf, fmaxf, fmaf, warp_sum, warp_max, block_sum,
                     block_max)

ATTN_MAX_DIM_PER_LANE = 8
ATTN_WARPS = 4
ATTN_PAIR_WARPS = 4
ATTN_PAIRS_PER_WARP = 4
ATTN_PAIRS = ATTN_PAIR_WARPS * ATTN_PAIRS_PER_WARP
ATTN_KEY_TILE = 16
# cu:40. attention.py's cases set it smaller (a multiple of ATTN_KEY_TILE) to
# run several splits over short contexts; the arithmetic is the same.
ATTN_SPLIT = 512
ATTN_DECODE_HEADS = 4  # cu:41
ATTN_BWD_ROWS = 2
ATTN_BWD_BLOCK_ROWS = ATTN_PAIR_WARPS * ATTN_BWD_ROWS

# cu:51; returns (first, a, b, m)
def attn_fold_factors(M, m):
    first = M == NEG_INF  # cu:53
    mm = fmaxf(M, m)  # cu:54
    a = F(0.0) if first else expf(M - mm)  # cu:55
    b = expf(m - mm)  # cu:56
    return first, a, b, mm

# cu:59
def attn_fold(running, split, f):
    first, a, b, _ = f
    return F(split * b) if first else fmaf(running, a, F(split * b))  # cu:60

# cu:70; returns (M, L)
def attn_fold_slots(acc, M, L, sm, sl, sacc, hd, t, nt):
    big = NEG_INF
    for w in range(ATTN_WARPS): big = fmaxf(big, sm[w])  # cu:73
    if big == NEG_INF: return M, L  # cu:74
    total = F(0.0)
    for w in range(ATTN_WARPS):
        if sm[w] != NEG_INF: total = fmaf(sl[w], expf(sm[w] - big), total)  # cu:77
    f = attn_fold_factors(M, big)  # cu:78
    for d in range(t, hd, nt):  # cu:79
        o = F(0.0)
        for w in range(ATTN_WARPS):
            if sm[w] != NEG_INF: o = fmaf(sacc[w * hd + d], expf(sm[w] - big), o)  # cu:82
        acc[d] = attn_fold(acc[d], o, f)  # cu:83
    L = attn_fold(L, total, f)  # cu:85
    return f[3], L  # cu:86

# cu:90
def attn_finish(acc, L, hd, t, nt):
    for d in range(t, hd, nt):
        acc[d] = F(acc[d] / L) if L > F(0.0) else F(0.0)  # cu:91

# cu:96
def attn_stash(shared, warp, warps, m, l, acc, hd, tid):
    lane = tid & 31
    if lane == 0:
        shared[warp] = m  # cu:100
        shared[warps + warp] = l  # cu:101
    for i in range(ATTN_MAX_DIM_PER_LANE):
        d = lane + 32 * i
        if d < hd: shared[2 * warps + warp * hd + d] = acc[i]  # cu:105

# cu:110
def attn_load_q(qr, acc, qs, hd, scale, tid):
    lane = tid & 31
    for i in range(ATTN_MAX_DIM_PER_LANE):
        d = lane + 32 * i
        qr[i] = F(qs[d] * scale) if d < hd else F(0.0)  # cu:115
        acc[i] = F(0.0)  # cu:116

# cu:121
def attn_load_row(r, row, hd, tid):
    lane = tid & 31
    for i in range(ATTN_MAX_DIM_PER_LANE):
        d = lane + 32 * i
        r[i] = row[d] if d < hd else F(0.0)  # cu:125

# cu:130
def attn_dot(a, b, hd, tid):
    lane = tid & 31
    s = F(0.0)
    for i in range(ATTN_MAX_DIM_PER_LANE):
        if lane + 32 * i < hd: s = fmaf(a[i], b[i], s)  # cu:134
    return (yield from warp_sum(s))  # cu:135

# cu:140; returns (p, m, l, corr)
def attn_online(s, m, l):
    m_new = fmaxf(m, s)
    corr = F(0.0) if m == NEG_INF else expf(m - m_new)  # cu:142
    p = expf(s - m_new)
    l = fmaf(l, corr, p)  # cu:144
    return p, m_new, l, corr

# cu:151; returns (m, l)
def attn_step(kr, vr, qr, acc, m, l, hd, tid):
    lane = tid & 31
    dot = yield from attn_dot(qr, kr, hd, tid)  # cu:154
    p, m, l, corr = attn_online(dot, m, l)  # cu:154
    for i in range(ATTN_MAX_DIM_PER_LANE):
        if lane + 32 * i < hd: acc[i] = fmaf(p, vr[i], F(acc[i] * corr))  # cu:156
    return m, l

# cu:162
def paged_kv_write(bx, tid, bdim, gdim, sh, k_pool, v_pool, k, v, slot_mapping, tokens, kv_row):
    n = tokens * kv_row
    i = bx * bdim + tid
    while i < n:
        t, c = i // kv_row, i % kv_row
        dst = u(slot_mapping[t]) * kv_row + c  # cu:169
        k_pool[dst] = k[i]  # cu:170
        v_pool[dst] = v[i]  # cu:171
        i += gdim * bdim
    return
    yield

# cu:176
def attn_splits(n):
    return (n + ATTN_SPLIT - 1) // ATTN_SPLIT if n > ATTN_SPLIT else 1  # cu:177

# cu:192
def paged_attention_decode(bx, tid, bdim, gdim, shared, out, part, q, k_pool, v_pool, block_tables,
                           context_lens, seqs, n_heads, n_kv_heads, hd, block_size, max_blocks,
                           n_splits, scale):
    group = n_heads // n_kv_heads
    hb = group if group < ATTN_DECODE_HEADS else ATTN_DECODE_HEADS  # cu:200
    runs = (group + hb - 1) // hb
    b, c = bx // n_splits, bx % n_splits  # cu:202
    s, g, hc = b // (n_kv_heads * runs), b // runs % n_kv_heads, b % runs  # cu:203
    if s >= seqs: return
    n = u(context_lens[s])  # cu:205
    splits = attn_splits(n)
    if c >= splits: return  # cu:207
    warp = tid >> 5
    slot, r = warp % ATTN_WARPS, warp // ATTN_WARPS  # cu:209
    hg = hc * hb + r
    on = hg < group  # cu:211
    p = s * n_heads + g * group + (hg if on else 0)  # cu:212
    qr = [F(0)] * 8; acc = [F(0)] * 8; kr = [F(0)] * 8; vr = [F(0)] * 8
    attn_load_q(qr, acc, q + p * hd, hd, scale, tid)  # cu:215
    m, l = NEG_INF, F(0.0)
    end = n if n < (c + 1) * ATTN_SPLIT else (c + 1) * ATTN_SPLIT  # cu:217
    row = n_kv_heads * hd
    j = c * ATTN_SPLIT + slot
    while on and j < end:  # cu:219
        blk = u(block_tables[s * max_blocks + j // block_size])  # cu:220
        base = (blk * block_size + j % block_size) * row + g * hd  # cu:221
        attn_load_row(kr, k_pool + base, hd, tid)  # cu:222
        attn_load_row(vr, v_pool + base, hd, tid)  # cu:223
        m, l = yield from attn_step(kr, vr, qr, acc, m, l, hd, tid)  # cu:224
        j += ATTN_WARPS
    mine = shared + r * ATTN_WARPS * (hd + 2)  # cu:227
    attn_stash(mine, slot, ATTN_WARPS, m, l, acc, hd, tid)  # cu:228
    yield "cu229"
    if not on: return  # cu:230
    t = tid - r * ATTN_WARPS * 32  # cu:231
    M, L = NEG_INF, F(0.0)
    if splits == 1:  # cu:233
        o = out + p * hd
        M, L = attn_fold_slots(o, M, L, mine, mine + ATTN_WARPS, mine + 2 * ATTN_WARPS, hd, t,  # cu:235
                               ATTN_WARPS * 32)
        attn_finish(o, L, hd, t, ATTN_WARPS * 32)  # cu:237
        return
    st = part + (p * n_splits + c) * (hd + 2)  # cu:241
    M, L = attn_fold_slots(st + 2, M, L, mine, mine + ATTN_WARPS, mine + 2 * ATTN_WARPS, hd, t,  # cu:242
                           ATTN_WARPS * 32)
    if t == 0:
        st[0] = M  # cu:245
        st[1] = L  # cu:246

# cu:253
def attention_split_merge(bx, tid, bdim, gdim, shared, out, part, context_lens, seqs, n_heads, hd,
                          n_splits):
    p, s = bx, bx // n_heads
    if s >= seqs: return
    splits = attn_splits(u(context_lens[s]))  # cu:258
    if splits == 1: return
    o = out + p * hd
    M, L = NEG_INF, F(0.0)
    for c in range(splits):  # cu:262
        st = part + (p * n_splits + c) * (hd + 2)  # cu:263
        if st[0] == NEG_INF: continue  # cu:264
        f = attn_fold_factors(M, st[0])  # cu:265
        for d in range(tid, hd, bdim):  # cu:266
            o[d] = attn_fold(o[d], st[2 + d], f)  # cu:267
        L = attn_fold(L, st[1], f)  # cu:268
        M = f[3]
    attn_finish(o, L, hd, tid, bdim)  # cu:271
    return
    yield

# cu:304
def attn_prefill_tile_floats(hd):
    tiles, merge = 2 * ATTN_KEY_TILE * hd, ATTN_WARPS * ATTN_PAIR_WARPS * (hd + 2)  # cu:305
    return tiles if tiles > merge else merge

# cu:309; `at(j)` is AttnPackedRows / AttnPagedRows::at
def attn_prefill_tile(out, q, k, v, at, q_first, past, n_new, pair0, g, n_heads, n_kv_heads, hd,
                      scale, shared, tid, bdim):
    warp = tid >> 5
    slot, pw = warp % ATTN_WARPS, warp // ATTN_WARPS
    group = n_heads // n_kv_heads
    pairs = n_new * group
    R = ATTN_PAIRS_PER_WARP
    qr = [[F(0)] * 8 for _ in range(R)]; acc = [[F(0)] * 8 for _ in range(R)]
    m = [NEG_INF] * R; l = [F(0)] * R; last = [0] * R
    warps = ATTN_WARPS * ATTN_PAIR_WARPS
    t = tid - pw * ATTN_WARPS * 32  # cu:322
    run = shared + attn_prefill_tile_floats(hd)  # cu:325
    for r in range(R):  # cu:327
        x = pair0 + pw * R + r
        i, h = x // group, g * group + x % group
        last[r] = past + i if x < pairs else -1  # cu:330
        attn_load_q(qr[r], acc[r], q + ((q_first + (i if x < pairs else 0)) * n_heads + h) * hd, hd, scale, tid)  # cu:331
        m[r] = NEG_INF; l[r] = F(0.0)
        if t == 0:
            run[pw * R + r] = NEG_INF  # cu:336
            run[ATTN_PAIRS + pw * R + r] = F(0.0)  # cu:337
    folds = 0
    x_end = pair0 + ATTN_PAIRS if pair0 + ATTN_PAIRS < pairs else pairs  # cu:341
    n_keys = past + (x_end - 1) // group + 1  # cu:342
    sk = shared + 0
    sv = shared + ATTN_KEY_TILE * hd  # cu:344
    kr = [F(0)] * 8; vr = [F(0)] * 8
    for j0 in range(0, n_keys, ATTN_KEY_TILE):  # cu:346
        nt = n_keys - j0 if n_keys - j0 < ATTN_KEY_TILE else ATTN_KEY_TILE
        yield "cu348"
        for e in range(tid, nt * hd, bdim):  # cu:349
            a = at(j0 + e // hd) + g * hd + e % hd  # cu:350
            sk[e] = k[a]  # cu:351
            sv[e] = v[a]  # cu:352
        yield "cu354"
        for jj in range(slot, nt, ATTN_WARPS):  # cu:355
            attn_load_row(kr, sk + jj * hd, hd, tid)  # cu:356
            attn_load_row(vr, sv + jj * hd, hd, tid)  # cu:357
            for r in range(R):
                if j0 + jj <= last[r]:  # cu:360
                    m[r], l[r] = yield from attn_step(kr, vr, qr[r], acc[r], m[r], l[r], hd, tid)  # cu:360
        if (j0 + ATTN_KEY_TILE) % ATTN_SPLIT != 0 and j0 + ATTN_KEY_TILE < n_keys: continue  # cu:362
        for r in range(R):  # cu:366
            yield "cu367"
            attn_stash(shared, warp, warps, m[r], l[r], acc[r], hd, tid)  # cu:368
            yield "cu369"
            x = pair0 + pw * R + r
            if x < pairs:  # cu:371
                i, h = x // group, g * group + x % group
                w0 = pw * ATTN_WARPS
                pi = pw * R + r
                frm = run + (folds & 1) * 2 * ATTN_PAIRS + pi  # cu:375
                M, L = frm[0], frm[ATTN_PAIRS]  # cu:376
                M, L = attn_fold_slots(out + ((q_first + i) * n_heads + h) * hd, M, L, shared + w0,  # cu:377
                                       shared + warps + w0, shared + 2 * warps + w0 * hd, hd, t,
                                       ATTN_WARPS * 32)
                to = run + ((folds + 1) & 1) * 2 * ATTN_PAIRS + pi  # cu:380
                if t == 0:
                    to[0] = M  # cu:382
                    to[ATTN_PAIRS] = L  # cu:383
            m[r] = NEG_INF; l[r] = F(0.0)  # cu:386
            for i in range(ATTN_MAX_DIM_PER_LANE): acc[r][i] = F(0.0)  # cu:388
        folds += 1
    yield "cu392"
    for r in range(R):  # cu:394
        x = pair0 + pw * R + r
        if x < pairs:  # cu:396
            i, h = x // group, g * group + x % group
            L = run[(folds & 1) * 2 * ATTN_PAIRS + ATTN_PAIRS + pw * R + r]  # cu:398
            attn_finish(out + ((q_first + i) * n_heads + h) * hd, L, hd, t, ATTN_WARPS * 32)  # cu:400

# cu:411
def varlen_attention_prefill(bx, tid, bdim, gdim, shared, out, q, k, v, cu_seqlens, tiles,
                             n_heads, n_kv_heads, hd, scale):
    tile, g = bx // n_kv_heads, bx % n_kv_heads
    s, pair0 = u(tiles[2 * tile]), u(tiles[2 * tile + 1])  # cu:416
    first = u(cu_seqlens[s])  # cu:417
    n_new = u(cu_seqlens[s + 1]) - u(cu_seqlens[s])  # cu:418
    row = n_kv_heads * hd  # cu:419
    at = lambda j: (first + j) * row  # cu:280
    yield from attn_prefill_tile(out, q, k, v, at, first, 0, n_new, pair0,  # cu:420
                                 g, n_heads, n_kv_heads, hd, scale, shared, tid, bdim)

# cu:430
def paged_attention_prefill(bx, tid, bdim, gdim, shared, out, q, k_pool, v_pool, block_tables,
                            pasts, cu_seqlens, tiles, n_heads, n_kv_heads, hd, block_size,
                            max_blocks, scale):
    tile, g = bx // n_kv_heads, bx % n_kv_heads
    s, pair0 = u(tiles[2 * tile]), u(tiles[2 * tile + 1])  # cu:436
    n_new = u(cu_seqlens[s + 1]) - u(cu_seqlens[s])  # cu:437
    table = block_tables + s * max_blocks  # cu:438
    row = n_kv_heads * hd
    at = lambda j: (u(table[j // block_size]) * block_size + j % block_size) * row  # cu:286
    yield from attn_prefill_tile(out, q, k_pool, v_pool, at, u(cu_seqlens[s]), u(pasts[s]), n_new,  # cu:439
                                 pair0, g, n_heads, n_kv_heads, hd, scale, shared, tid, bdim)

# ---- backward

# cu:463
def attn_sum_slots(out, shared, pw, hd, mul, tid):
    t = tid - pw * ATTN_WARPS * 32
    for d in range(t, hd, ATTN_WARPS * 32):  # cu:466
        o = F(0.0)
        for w in range(ATTN_WARPS): o = F(o + shared[(pw * ATTN_WARPS + w) * hd + d])  # cu:468
        out[d] = F(mul * o)  # cu:469

# cu:475
def attn_stage_kv(sk, sv, k, v, j0, nt, kstride, g, hd, tid, bdim):
    yield "cu478"
    for e in range(tid, nt * hd, bdim):  # cu:479
        a = (j0 + e // hd) * kstride + g * hd + e % hd  # cu:480
        sk[e] = k[a]  # cu:481
        sv[e] = v[a]  # cu:482
    yield "cu484"

# cu:490
def attention_backward_dq(bx, tid, bdim, gdim, shared, dq, lse_out, dd_out, dout, q, k, v,
                          nq, nk, heads, kv_heads, hd, scale):
    R, warps = ATTN_BWD_ROWS, ATTN_WARPS * ATTN_PAIR_WARPS
    lane, warp = tid & 31, tid >> 5
    slot, pw = warp % ATTN_WARPS, warp // ATTN_WARPS
    g, pair0 = bx % kv_heads, bx // kv_heads * ATTN_BWD_BLOCK_ROWS  # cu:498
    group, pairs, past = heads // kv_heads, nq * heads // kv_heads, nk - nq
    qr = [[F(0)] * 8 for _ in range(R)]; dor = [[F(0)] * 8 for _ in range(R)]
    acc = [[F(0)] * 8 for _ in range(R)]
    m = [NEG_INF] * R; l = [F(0)] * R; dsum = [F(0)] * R; lse = [F(0)] * R; Dv = [F(0)] * R
    last = [0] * R; row = [0] * R
    for r in range(R):  # cu:506
        x = pair0 + pw * R + r
        i, h = (x // group if x < pairs else 0), g * group + x % group
        last[r] = past + i if x < pairs else -1  # cu:509
        row[r] = (i * heads + h) * hd
        attn_load_q(qr[r], acc[r], q + row[r], hd, scale, tid)  # cu:511
        attn_load_row(dor[r], dout + row[r], hd, tid)  # cu:512
        m[r] = NEG_INF; l[r] = F(0.0); dsum[r] = F(0.0)
    x_end = pair0 + ATTN_BWD_BLOCK_ROWS if pair0 + ATTN_BWD_BLOCK_ROWS < pairs else pairs
    n_keys = past + (x_end - 1) // group + 1  # cu:518
    kstride = kv_heads * hd
    sk = shared + 0; sv = shared + ATTN_KEY_TILE * hd  # cu:521
    kr = [F(0)] * 8; vr = [F(0)] * 8
    for j0 in range(0, n_keys, ATTN_KEY_TILE):  # cu:524
        nt = n_keys - j0 if n_keys - j0 < ATTN_KEY_TILE else ATTN_KEY_TILE
        yield from attn_stage_kv(sk, sv, k, v, j0, nt, kstride, g, hd, tid, bdim)  # cu:526
        for jj in range(slot, nt, ATTN_WARPS):
            attn_load_row(kr, sk + jj * hd, hd, tid)  # cu:528
            attn_load_row(vr, sv + jj * hd, hd, tid)  # cu:529
            for r in range(R):
                if j0 + jj <= last[r]:  # cu:532
                    s_ = yield from attn_dot(qr[r], kr, hd, tid)  # cu:533
                    dov = yield from attn_dot(dor[r], vr, hd, tid)  # cu:533
                    p, m[r], l[r], corr = attn_online(s_, m[r], l[r])  # cu:534
                    dsum[r] = fmaf(p, dov, F(dsum[r] * corr))  # cu:535
    yield "cu540"
    if lane == 0:
        for r in range(R):
            shared[warp * R + r] = m[r]  # cu:543
            shared[(warps + warp) * R + r] = l[r]  # cu:544
            shared[(2 * warps + warp) * R + r] = dsum[r]  # cu:545
    yield "cu547"
    for r in range(R):  # cu:549
        big, tl, ts = NEG_INF, F(0.0), F(0.0)
        for w in range(ATTN_WARPS):
            big = fmaxf(big, shared[(pw * ATTN_WARPS + w) * R + r])  # cu:552
        for w in range(ATTN_WARPS):
            a = (pw * ATTN_WARPS + w) * R + r
            if shared[a] == NEG_INF: continue  # cu:555
            e = expf(shared[a] - big)  # cu:556
            tl = fmaf(shared[warps * R + a], e, tl)  # cu:557
            ts = fmaf(shared[2 * warps * R + a], e, ts)  # cu:558
        lse[r] = F(0.0) if last[r] < 0 else F(big + logf(tl))  # cu:560
        Dv[r] = F(0.0) if last[r] < 0 else F(ts / tl)  # cu:561
    for j0 in range(0, n_keys, ATTN_KEY_TILE):  # cu:564
        nt = n_keys - j0 if n_keys - j0 < ATTN_KEY_TILE else ATTN_KEY_TILE
        yield from attn_stage_kv(sk, sv, k, v, j0, nt, kstride, g, hd, tid, bdim)  # cu:566
        for jj in range(slot, nt, ATTN_WARPS):
            attn_load_row(kr, sk + jj * hd, hd, tid)  # cu:568
            attn_load_row(vr, sv + jj * hd, hd, tid)  # cu:569
            for r in range(R):
                if j0 + jj <= last[r]:  # cu:572
                    sc = yield from attn_dot(qr[r], kr, hd, tid)  # cu:573
                    p = expf(sc - lse[r])  # cu:573
                    dv_ = yield from attn_dot(dor[r], vr, hd, tid)  # cu:574
                    ds = F(p * F(dv_ - Dv[r]))  # cu:574
                    for i in range(ATTN_MAX_DIM_PER_LANE):
                        if lane + 32 * i < hd: acc[r][i] = fmaf(ds, kr[i], acc[r][i])  # cu:576
    for r in range(R):  # cu:581
        yield "cu582"
        for i in range(ATTN_MAX_DIM_PER_LANE):
            if lane + 32 * i < hd: shared[warp * hd + lane + 32 * i] = acc[r][i]  # cu:584
        yield "cu585"
        if last[r] >= 0:  # cu:586
            attn_sum_slots(dq + row[r], shared, pw, hd, scale, tid)  # cu:587
            if slot == 0 and lane == 0:
                lse_out[row[r] // hd] = lse[r]  # cu:589
                dd_out[row[r] // hd] = Dv[r]  # cu:590

# cu:599
def attention_backward_dkv(bx, tid, bdim, gdim, shared, dk, dv, dout, q, k, v, lse, dd,
                           nq, nk, heads, kv_heads, hd, scale):
    R, warps = ATTN_BWD_ROWS, ATTN_WARPS * ATTN_PAIR_WARPS
    lane, warp = tid & 31, tid >> 5
    slot, pw = warp % ATTN_WARPS, warp // ATTN_WARPS
    g, key0 = bx % kv_heads, bx // kv_heads * ATTN_BWD_BLOCK_ROWS  # cu:607
    group, pairs, past = heads // kv_heads, nq * heads // kv_heads, nk - nq
    kr = [[F(0)] * 8 for _ in range(R)]; vr = [[F(0)] * 8 for _ in range(R)]
    adk = [[F(0)] * 8 for _ in range(R)]; adv = [[F(0)] * 8 for _ in range(R)]
    key = [0] * R
    for r in range(R):  # cu:613
        j = key0 + pw * R + r
        key[r] = j if j < nk else nk  # cu:615
        a = ((j if j < nk else 0) * kv_heads + g) * hd
        attn_load_row(kr[r], k + a, hd, tid)  # cu:617
        attn_load_row(vr[r], v + a, hd, tid)  # cu:618
    x_begin = (key0 - past if key0 - past > 0 else 0) * group  # cu:623
    sq = shared + 0
    sdo = sq + ATTN_KEY_TILE * hd
    slse = sdo + ATTN_KEY_TILE * hd
    sdd = slse + ATTN_KEY_TILE  # cu:627
    qr = [F(0)] * 8; dor = [F(0)] * 8
    for x0 in range(x_begin, pairs, ATTN_KEY_TILE):  # cu:629
        nt = pairs - x0 if pairs - x0 < ATTN_KEY_TILE else ATTN_KEY_TILE
        yield "cu631"
        for e in range(tid, nt * hd, bdim):  # cu:632
            x = x0 + e // hd
            a = ((x // group) * heads + g * group + x % group) * hd + e % hd  # cu:634
            sq[e] = F(q[a] * scale)  # cu:635
            sdo[e] = dout[a]  # cu:636
        for e in range(tid, nt, bdim):  # cu:638
            x = x0 + e
            a = (x // group) * heads + g * group + x % group  # cu:640
            slse[e] = lse[a]  # cu:641
            sdd[e] = dd[a]  # cu:642
        yield "cu644"
        for xx in range(slot, nt, ATTN_WARPS):  # cu:645
            pos = past + (x0 + xx) // group
            attn_load_row(qr, sq + xx * hd, hd, tid)  # cu:647
            attn_load_row(dor, sdo + xx * hd, hd, tid)  # cu:648
            for r in range(R):
                if key[r] <= pos:  # cu:651
                    sc = yield from attn_dot(qr, kr[r], hd, tid)  # cu:652
                    p = expf(sc - slse[xx])  # cu:652
                    dv_ = yield from attn_dot(dor, vr[r], hd, tid)  # cu:653
                    ds = F(p * F(dv_ - sdd[xx]))  # cu:653
                    for i in range(ATTN_MAX_DIM_PER_LANE):
                        if lane + 32 * i < hd:
                            adk[r][i] = fmaf(ds, qr[i], adk[r][i])  # cu:656
                            adv[r][i] = fmaf(p, dor[i], adv[r][i])  # cu:657
    for r in range(R):  # cu:663
        yield "cu664"
        for i in range(ATTN_MAX_DIM_PER_LANE):
            if lane + 32 * i < hd:
                shared[warp * hd + lane + 32 * i] = adk[r][i]  # cu:667
                shared[(warps + warp) * hd + lane + 32 * i] = adv[r][i]  # cu:668
        yield "cu670"
        if key[r] < nk:  # cu:671
            a = (key[r] * kv_heads + g) * hd
            attn_sum_slots(dk + a, shared, pw, hd, F(1.0), tid)  # cu:673
            attn_sum_slots(dv + a, shared + warps * hd, pw, hd, F(1.0), tid)  # cu:674
