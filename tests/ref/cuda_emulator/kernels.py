"""Line-by-line transcription of kernels/src/cuda/gated_delta.cu (the chunked
backward's kernels). Each thread is a generator; `yield "cuNNN"` is the
__syncthreads() at line NNN. float is np.float32 (F), double np.float64 (D);
every double is kept as np.float64 so that float (op) double promotes to
double as in C. `# cu:NNN` tags the source line a statement transcribes.
"""
import numpy as np

from simt import D, F, new_epoch, shared

GD_CHUNK = 64
GD_TILE = 16
GD_COLS = 32
GD_ROWS = 8


def expf(x):
    return np.exp(F(x))


def u(x):  # a u32 read
    return int(x)


# cu:13
def gd_column_step(S, qk, decay, b, v_j, j, dk, dv):
    kv = F(0.0)  # cu:15
    for i in range(dk):  # cu:16
        x = S[i * dv + j] * decay  # cu:17
        S[i * dv + j] = x  # cu:18
        kv += x * qk[dk + i]  # cu:19
    delta = b * (v_j - kv)  # cu:21
    o = F(0.0)
    for i in range(dk):  # cu:23
        x = S[i * dv + j] + qk[dk + i] * delta  # cu:24
        S[i * dv + j] = x  # cu:25
        o += x * qk[i]  # cu:26
    return o


# cu:162
def gd_decay(cum, i, j):
    return expf(F(cum[i] - cum[j]))  # cu:163


# ---------------------------------------------------------------- prep (cu:170)
def prep_shared():
    return (
        shared("prep.cum", GD_CHUNK, np.float64),  # cu:174
        shared("prep.bet", GD_CHUNK, np.float32),  # cu:175
        shared("prep.att", GD_CHUNK * GD_CHUNK, np.float32),  # cu:176
        shared("prep.low", GD_CHUNK * GD_CHUNK, np.float32),
        shared("prep.tq", GD_CHUNK * (GD_TILE + 1), np.float32),  # cu:177
        shared("prep.tk", GD_CHUNK * (GD_TILE + 1), np.float32),
    )


def gated_delta_chunk_prep(bx, tid, bdim, gdim, sh, A, U, W, G, KKE, q, k, v, g, beta,
                           chunk_tok0, chunk_len, chunks, nk, nv, dk, dv):
    cum, bet, att, low, tq, tk = sh
    n, h = bx // nv, bx % nv  # cu:178
    if n >= chunks:  # cu:179
        return
    kh = h // (nv // nk)  # cu:180
    t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:181
    if tid < c:
        bet[tid] = beta[(t0 + tid) * nv + h]  # cu:182
    if tid == 0:  # cu:183
        acc = D(0.0)
        for i in range(c):
            acc += D(g[(t0 + i) * nv + h])  # cu:186
            cum[i] = acc  # cu:187
    for e in range(tid, c * c, bdim):  # cu:190
        att[e] = F(0.0)  # cu:191
        low[e] = F(0.0)  # cu:192
    yield "cu194"
    if tid < c:
        G[(t0 + tid) * nv + h] = cum[tid]  # cu:195

    d0 = 0
    while d0 < dk:  # cu:198
        w = min(GD_TILE, dk - d0)  # cu:199
        for e in range(tid, c * GD_TILE, bdim):  # cu:200
            i, d = e // GD_TILE, e % GD_TILE  # cu:201
            at = ((t0 + i) * nk + kh) * dk + d0 + d  # cu:202
            tq[i * (GD_TILE + 1) + d] = q[at] if d < w else F(0.0)  # cu:203
            tk[i * (GD_TILE + 1) + d] = k[at] if d < w else F(0.0)  # cu:204
        yield "cu206"
        for e in range(tid, c * c, bdim):  # cu:207
            i, j = e // c, e % c  # cu:208
            if j > i:  # cu:209
                continue
            a, l = F(0.0), F(0.0)  # cu:210
            for d in range(w):  # cu:211
                kj = tk[j * (GD_TILE + 1) + d]  # cu:212
                a += tq[i * (GD_TILE + 1) + d] * kj  # cu:213
                l += tk[i * (GD_TILE + 1) + d] * kj  # cu:214
            att[e] += a  # cu:216
            low[e] += l  # cu:217
        yield "cu219"
        d0 += GD_TILE

    An = A + (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:224
    for e in range(tid, c * c, bdim):  # cu:225
        i, j = e // c, e % c  # cu:226
        decay = gd_decay(cum, i, j) if j <= i else F(0.0)  # cu:227
        a = att[e] * decay if j <= i else F(0.0)  # cu:228
        kke = low[e] * decay if j < i else F(0.0)  # cu:229
        low[e] = bet[i] * kke  # cu:230
        An[i * GD_CHUNK + j] = a  # cu:231
        if KKE is not None:
            KKE[(n * nv + h) * GD_CHUNK * GD_CHUNK + i * GD_CHUNK + j] = kke  # cu:232
    yield "cu234"

    for col in range(tid, dv + dk, bdim):  # cu:238
        x = [None] * GD_CHUNK  # cu:239 (local array; None = uninitialised)
        for i in range(c):  # cu:240
            row = t0 + i  # cu:241
            if col < dv:  # cu:242
                r = bet[i] * v[(row * nv + h) * dv + col]  # cu:242
            else:
                r = bet[i] * expf(F(cum[i])) * k[(row * nk + kh) * dk + (col - dv)]  # cu:243
            for l in range(i):  # cu:244
                r -= low[i * c + l] * x[l]  # cu:244
            x[i] = r  # cu:245
            if col < dv:
                U[(row * nv + h) * dv + col] = r  # cu:247
            else:
                W[(row * nv + h) * dk + (col - dv)] = r  # cu:249


# ---------------------------------------------------------------- scan (cu:256)
def scan_shared_factory(dk):
    def f():
        return (
            shared("scan.delta", GD_CHUNK * GD_COLS, np.float32),  # cu:261
            shared("scan.cum", GD_CHUNK, np.float64),  # cu:262
            shared("scan.dec", GD_CHUNK, np.float32),  # cu:263
            shared("scan.qk", 2 * dk, np.float32),  # cu:264 dynamic, shared_mem_bytes 2*dk*4
        )
    return f


def gated_delta_chunk_scan(bx, tid, bdim, gdim, sh, out, state, starts, U, A, W, G, q, k, v, g,
                           beta, slots, seq_chunk0, chunk_tok0, chunk_len, seqs, nk, nv, dk, dv):
    delta, cum, dec, qk = sh
    tiles = (dv + GD_COLS - 1) // GD_COLS  # cu:265
    tile, h, s = bx % tiles, (bx // tiles) % nv, bx // tiles // nv  # cu:266
    if s >= seqs:  # cu:267
        return
    kh = h // (nv // nk)  # cu:268
    tx, ty = tid % GD_COLS, tid // GD_COLS  # cu:269
    j = tile * GD_COLS + tx  # cu:270
    live = j < dv  # cu:271
    S = state + (u(slots[s]) * nv + h) * dk * dv  # cu:272
    n = u(seq_chunk0[s])
    while n < u(seq_chunk0[s + 1]):  # cu:273
        new_epoch(tid, sh)
        t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:274
        if starts is not None:  # cu:275
            s0 = starts + (n * nv + h) * dk * dv  # cu:276
            d = ty
            while d < dk and live:  # cu:277
                s0[d * dv + j] = S[d * dv + j]  # cu:277
                d += GD_ROWS
            yield "cu278"
        if c == 1:  # cu:280
            for i in range(tid, dk, bdim):  # cu:282
                qk[i] = q[(t0 * nk + kh) * dk + i]  # cu:283
                qk[dk + i] = k[(t0 * nk + kh) * dk + i]  # cu:284
            yield "cu286"
            if ty == 0 and live:  # cu:287
                at = (t0 * nv + h) * dv + j  # cu:288
                out[at] = gd_column_step(S, qk, expf(g[t0 * nv + h]),  # cu:289
                                         beta[t0 * nv + h], v[at], j, dk, dv)
            yield "cu292"
            n += 1
            continue
        if tid < c:
            cum[tid] = G[(t0 + tid) * nv + h]  # cu:295
        yield "cu296"
        if tid < c:
            dec[tid] = gd_decay(cum, c - 1, tid)  # cu:297
        i = ty
        while i < c and live:  # cu:299
            row = t0 + i  # cu:300
            wi = W + (row * nv + h) * dk  # cu:301
            qi = q + (row * nk + kh) * dk  # cu:302
            ws, qs = F(0.0), F(0.0)  # cu:303
            for d in range(dk):  # cu:304
                sv = S[d * dv + j]  # cu:305
                ws += wi[d] * sv  # cu:306
                qs += qi[d] * sv  # cu:307
            delta[i * GD_COLS + tx] = U[(row * nv + h) * dv + j] - ws  # cu:309
            out[(row * nv + h) * dv + j] = expf(F(cum[i])) * qs  # cu:310
            i += GD_ROWS
        yield "cu312"
        An = A + (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:314
        i = ty
        while i < c and live:  # cu:315
            o = F(0.0)  # cu:316
            for l in range(i + 1):  # cu:317
                o += An[i * GD_CHUNK + l] * delta[l * GD_COLS + tx]  # cu:317
            out[((t0 + i) * nv + h) * dv + j] += o  # cu:318
            i += GD_ROWS
        last = expf(F(cum[c - 1]))  # cu:322
        d = ty
        while d < dk and live:  # cu:323
            acc = F(0.0)  # cu:324
            for i in range(c):  # cu:325
                acc += dec[i] * k[((t0 + i) * nk + kh) * dk + d] * delta[i * GD_COLS + tx]  # cu:326
            S[d * dv + j] = last * S[d * dv + j] + acc  # cu:327
            d += GD_ROWS
        yield "cu329"
        n += 1


# ---------------------------------------------------------------- dscan (cu:362)
def dscan_shared():
    return (
        shared("dscan.dd", GD_CHUNK * GD_COLS, np.float32),  # cu:366
        shared("dscan.cum", GD_CHUNK, np.float64),  # cu:367
        shared("dscan.eg", GD_CHUNK, np.float32),  # cu:368
        shared("dscan.dec", GD_CHUNK, np.float32),
    )


def gated_delta_chunk_dscan(bx, tid, bdim, gdim, sh, ddelta, ds1, dS_all, A, W, G, q, k, dout,
                            seq_chunk0, chunk_tok0, chunk_len, seqs, nk, nv, dk, dv):
    dd, cum, eg, dec = sh
    tiles = (dv + GD_COLS - 1) // GD_COLS  # cu:369
    tile, h, s = bx % tiles, (bx // tiles) % nv, bx // tiles // nv  # cu:370
    if s >= seqs:  # cu:371
        return
    kh = h // (nv // nk)  # cu:372
    tx, ty = tid % GD_COLS, tid // GD_COLS  # cu:373
    j = tile * GD_COLS + tx  # cu:374
    live = j < dv  # cu:375
    sn = dk * dv  # cu:376
    dS = dS_all + (s * nv + h) * sn  # cu:377
    n = u(seq_chunk0[s + 1]) - 1
    while n >= u(seq_chunk0[s]):  # cu:378
        new_epoch(tid, sh)
        t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:379
        if tid < c:
            cum[tid] = G[(t0 + tid) * nv + h]  # cu:380
        yield "cu381"
        if tid < c:  # cu:382
            eg[tid] = expf(F(cum[tid]))  # cu:383
            dec[tid] = gd_decay(cum, c - 1, tid)  # cu:384
        d1 = ds1 + (n * nv + h) * sn  # cu:386
        d = ty
        while d < dk and live:  # cu:387
            d1[d * dv + j] = dS[d * dv + j]  # cu:387
            d += GD_ROWS
        yield "cu388"
        An = A + (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:390
        i = ty
        while i < c and live:  # cu:391
            acc = F(0.0)  # cu:392
            for l in range(i, c):  # cu:393
                acc += An[l * GD_CHUNK + i] * dout[((t0 + l) * nv + h) * dv + j]  # cu:394
            ki = k + ((t0 + i) * nk + kh) * dk  # cu:395
            ks = F(0.0)  # cu:396
            for d in range(dk):
                ks += ki[d] * dS[d * dv + j]  # cu:397
            acc += dec[i] * ks  # cu:398
            dd[i * GD_COLS + tx] = acc  # cu:399
            ddelta[((t0 + i) * nv + h) * dv + j] = acc  # cu:400
            i += GD_ROWS
        yield "cu402"
        last = expf(F(cum[c - 1]))  # cu:404
        d = ty
        while d < dk and live:  # cu:405
            acc = F(0.0)  # cu:406
            for i in range(c):  # cu:407
                row = t0 + i  # cu:408
                acc += (eg[i] * q[(row * nk + kh) * dk + d] * dout[(row * nv + h) * dv + j]  # cu:409
                        - W[(row * nv + h) * dk + d] * dd[i * GD_COLS + tx])  # cu:410
            dS[d * dv + j] = last * dS[d * dv + j] + acc  # cu:412
            d += GD_ROWS
        yield "cu414"
        n -= 1


# ---------------------------------------------------------------- block_sum_f64 (cu:420)
def block_sum_f64(v, red, tid, bdim):
    yield "cu421"
    red[tid] = v  # cu:422
    yield "cu423"
    o = bdim // 2
    while o > 0:  # cu:424
        if tid < o:
            red[tid] += red[tid + o]  # cu:425
        yield "cu426"
        o >>= 1
    total = red[0]  # cu:428
    yield "cu429"
    return total


# ---------------------------------------------------------------- grads (cu:433)
def grads_shared():
    return (
        shared("grads.cum", GD_CHUNK, np.float64),  # cu:440
        shared("grads.dG", GD_CHUNK, np.float64),
        shared("grads.dbl", GD_CHUNK, np.float64),
        shared("grads.eg", GD_CHUNK, np.float32),  # cu:441
        shared("grads.dec", GD_CHUNK, np.float32),
        shared("grads.bet", GD_CHUNK, np.float32),
        shared("grads.P", GD_CHUNK * GD_CHUNK, np.float32),  # cu:442
        shared("grads.D", GD_CHUNK * GD_CHUNK, np.float32),
        shared("grads.red", 256, np.float64),  # cu:443
    )


def gated_delta_chunk_grads(bx, tid, bdim, gdim, sh, dq_v, dk_v, dv_out, dg_out, dbeta_out, delta,
                            dqg, dkd, drv, drk, ddelta, starts, ds1, A, KKE, U, W, G, q, k, v,
                            dout, beta, chunk_tok0, chunk_len, chunks, nk, nv, dk, dv):
    cum, dG, dbl, eg, dec, bet, P, Dm, red = sh
    n, h = bx // nv, bx % nv  # cu:444
    if n >= chunks:  # cu:445
        return
    kh = h // (nv // nk)  # cu:446
    t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:447
    sn = dk * dv  # cu:449
    mat = (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:450
    S0 = starts + (n * nv + h) * sn  # cu:451
    dS = ds1 + (n * nv + h) * sn  # cu:452
    An = A + mat  # cu:453
    Kn = KKE + mat  # cu:454

    def GD_QK(x, i):  # cu:457
        return x + ((t0 + i) * nk + kh) * dk

    def GD_HK(x, i):  # cu:458
        return x + ((t0 + i) * nv + h) * dk

    def GD_HV(x, i):  # cu:459
        return x + ((t0 + i) * nv + h) * dv

    if tid < c:  # cu:460
        cum[tid] = G[(t0 + tid) * nv + h]  # cu:461
        bet[tid] = beta[(t0 + tid) * nv + h]  # cu:462
    yield "cu464"
    if tid < c:  # cu:465
        eg[tid] = expf(F(cum[tid]))  # cu:466
        dec[tid] = gd_decay(cum, c - 1, tid)  # cu:467
    for e in range(tid, c * dv, bdim):  # cu:470
        i, j = e // dv, e % dv  # cu:471
        wi = GD_HK(W, i)  # cu:472
        acc = F(0.0)
        for d in range(dk):
            acc += wi[d] * S0[d * dv + j]  # cu:474
        GD_HV(delta, i)[j] = GD_HV(U, i)[j] - acc  # cu:475
    yield "cu477"
    for e in range(tid, c * dk, bdim):  # cu:479
        i, d = e // dk, e % dk  # cu:480
        doi = GD_HV(dout, i)  # cu:481
        dli = GD_HV(delta, i)  # cu:482
        ddi = GD_HV(ddelta, i)  # cu:483
        a, b, w = F(0.0), F(0.0), F(0.0)  # cu:484
        for j in range(dv):  # cu:485
            s0 = S0[d * dv + j]  # cu:486
            a += doi[j] * s0  # cu:487
            b += dli[j] * dS[d * dv + j]  # cu:488
            w += ddi[j] * s0  # cu:489
        GD_HK(dqg, i)[d] = a  # cu:491
        GD_HK(dkd, i)[d] = b  # cu:492
        GD_HK(drk, i)[d] = -w  # cu:493
    for e in range(tid, c * dv, bdim):  # cu:495
        GD_HV(drv, e // dv)[e % dv] = GD_HV(ddelta, e // dv)[e % dv]  # cu:495
    for e in range(tid, c * c, bdim):  # cu:497
        i, j = e // c, e % c  # cu:498
        a = F(0.0)  # cu:499
        if j <= i:  # cu:500
            doi = GD_HV(dout, i)  # cu:501
            dlj = GD_HV(delta, j)  # cu:502
            for x in range(dv):
                a += doi[x] * dlj[x]  # cu:503
        P[i * GD_CHUNK + j] = a  # cu:505
    yield "cu507"
    for col in range(tid, dv + dk, bdim):  # cu:510
        base = drv if col < dv else drk  # cu:511
        width, x = (dv, col) if col < dv else (dk, col - dv)  # cu:512
        for i in range(c - 2, -1, -1):  # cu:513
            r = base[((t0 + i) * nv + h) * width + x]  # cu:514
            for l in range(i + 1, c):  # cu:515
                r -= bet[l] * Kn[l * GD_CHUNK + i] * base[((t0 + l) * nv + h) * width + x]  # cu:516
            base[((t0 + i) * nv + h) * width + x] = r  # cu:517
    yield "cu520"
    for e in range(tid, c * c, bdim):  # cu:522
        i, j = e // c, e % c  # cu:523
        a = F(0.0)  # cu:524
        if j < i:  # cu:525
            ri, uj = GD_HV(drv, i), GD_HV(U, j)  # cu:526
            for x in range(dv):
                a += ri[x] * uj[x]  # cu:527
            rk, wj = GD_HK(drk, i), GD_HK(W, j)  # cu:528
            for x in range(dk):
                a += rk[x] * wj[x]  # cu:529
        Dm[i * GD_CHUNK + j] = -a  # cu:531
    yield "cu533"
    if tid < c:  # cu:536
        i = tid
        acc, db = D(0.0), D(0.0)  # cu:538
        for j in range(c):  # cu:539
            if j <= i:
                acc += D(P[i * GD_CHUNK + j]) * An[i * GD_CHUNK + j]  # cu:540
            if j >= i:
                acc -= D(P[j * GD_CHUNK + i]) * An[j * GD_CHUNK + i]  # cu:541
            if j < i:  # cu:542
                xx = D(Dm[i * GD_CHUNK + j]) * Kn[i * GD_CHUNK + j]  # cu:543
                acc += bet[i] * xx  # cu:544
                db += xx  # cu:545
            if j > i:
                acc -= D(bet[j]) * Dm[j * GD_CHUNK + i] * Kn[j * GD_CHUNK + i]  # cu:547
        dG[i] = acc  # cu:549
        dbl[i] = db  # cu:550
    yield "cu552"
    for e in range(tid, c * c, bdim):  # cu:554
        i, j = e // c, e % c  # cu:555
        decay = gd_decay(cum, i, j) if j <= i else F(0.0)  # cu:556
        P[i * GD_CHUNK + j] *= decay  # cu:557
        Dm[i * GD_CHUNK + j] *= decay  # cu:558
    yield "cu560"
    for e in range(tid, c * dk, bdim):  # cu:561
        i, d = e // dk, e % dk  # cu:562
        a = eg[i] * GD_HK(dqg, i)[d]  # cu:563
        for j in range(i + 1):
            a += P[i * GD_CHUNK + j] * GD_QK(k, j)[d]  # cu:564
        GD_HK(dq_v, i)[d] = a  # cu:565
        b = dec[i] * GD_HK(dkd, i)[d] + bet[i] * eg[i] * GD_HK(drk, i)[d]  # cu:566
        for l in range(i, c):
            b += P[l * GD_CHUNK + i] * GD_QK(q, l)[d]  # cu:567
        for j in range(c):  # cu:568
            b += (bet[i] * Dm[i * GD_CHUNK + j] + bet[j] * Dm[j * GD_CHUNK + i]) * GD_QK(k, j)[d]  # cu:569
        GD_HK(dk_v, i)[d] = b  # cu:570
    for e in range(tid, c * dv, bdim):  # cu:572
        i, j = e // dv, e % dv  # cu:573
        GD_HV(dv_out, i)[j] = bet[i] * GD_HV(drv, i)[j]  # cu:574
    last_share = D(0.0)  # cu:577
    if tid < c:  # cu:578
        i = tid
        qi, ki, vi = GD_QK(q, i), GD_QK(k, i), GD_HV(v, i)  # cu:580
        rv, rk = GD_HV(drv, i), GD_HK(drk, i)  # cu:581
        gq, gk = GD_HK(dqg, i), GD_HK(dkd, i)  # cu:582
        k_rk, v_rv, q_gq, k_gk = D(0.0), D(0.0), D(0.0), D(0.0)  # cu:583
        for d in range(dk):  # cu:584
            k_rk += D(ki[d]) * rk[d]  # cu:585
            q_gq += D(qi[d]) * gq[d]  # cu:586
            k_gk += D(ki[d]) * gk[d]  # cu:587
        for j in range(dv):
            v_rv += D(vi[j]) * rv[j]  # cu:589
        dbeta_out[(t0 + i) * nv + h] = F(v_rv + eg[i] * k_rk + dbl[i])  # cu:590
        kd_gk = dec[i] * k_gk  # cu:591
        dG[i] += eg[i] * q_gq - kd_gk + D(bet[i]) * eg[i] * k_rk  # cu:592
        last_share = kd_gk  # cu:593
    part = last_share  # cu:595
    last = expf(F(cum[c - 1]))  # cu:596
    for x in range(tid, sn, bdim):
        part += D(last) * S0[x] * dS[x]  # cu:597
    total = yield from block_sum_f64(part, red, tid, bdim)  # cu:598
    if tid == 0:  # cu:599
        dG[c - 1] += total  # cu:600
        acc = D(0.0)  # cu:601
        for i in range(c - 1, -1, -1):  # cu:602
            acc += dG[i]  # cu:603
            dg_out[(t0 + i) * nv + h] = F(acc)  # cu:604


# ---------------------------------------------------------------- reduce (cu:764)
def gated_delta_backward_reduce(bx, tid, bdim, gdim, sh, dq, dk, dq_v, dk_v, t, nk, nv, dkd):
    if False:
        yield
    n = t * nk * dkd  # cu:767
    x = bx * bdim + tid  # cu:768
    while x < n:
        i = x % dkd  # cu:770
        row = x // dkd  # cu:771
        kh = row % nk  # cu:772
        tt = row // nk  # cu:773
        group = nv // nk  # cu:774
        a, b = F(0.0), F(0.0)  # cu:775
        for uu in range(group):  # cu:776
            at = (tt * nv + kh * group + uu) * dkd + i  # cu:777
            a += dq_v[at]  # cu:778
            b += dk_v[at]  # cu:779
        dq[x] = a  # cu:781
        dk[x] = b  # cu:782
        x += gdim * bdim  # cu:769
