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


# cu:167
def gd_decay(cum, i, j):
    return expf(F(cum[i] - cum[j]))  # cu:168


# ---------------------------------------------------------------- prep (cu:175)
def prep_shared():
    return (
        shared("prep.cum", GD_CHUNK, np.float64),  # cu:179
        shared("prep.bet", GD_CHUNK, np.float32),  # cu:180
        shared("prep.att", GD_CHUNK * GD_CHUNK, np.float32),  # cu:181
        shared("prep.low", GD_CHUNK * GD_CHUNK, np.float32),
        shared("prep.tq", GD_CHUNK * (GD_TILE + 1), np.float32),  # cu:182
        shared("prep.tk", GD_CHUNK * (GD_TILE + 1), np.float32),
    )


def gated_delta_chunk_prep(bx, tid, bdim, gdim, sh, A, U, W, G, KKE, q, k, v, g, beta,
                           chunk_tok0, chunk_len, chunks, nk, nv, dk, dv):
    cum, bet, att, low, tq, tk = sh
    n, h = bx // nv, bx % nv  # cu:183
    if n >= chunks:  # cu:184
        return
    kh = h // (nv // nk)  # cu:185
    t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:186
    if tid < c:
        bet[tid] = beta[(t0 + tid) * nv + h]  # cu:187
    if tid == 0:  # cu:188
        acc = D(0.0)
        for i in range(c):
            acc += D(g[(t0 + i) * nv + h])  # cu:191
            cum[i] = acc  # cu:192
    for e in range(tid, c * c, bdim):  # cu:195
        att[e] = F(0.0)  # cu:196
        low[e] = F(0.0)  # cu:197
    yield "cu199"
    if tid < c:
        G[(t0 + tid) * nv + h] = cum[tid]  # cu:200

    d0 = 0
    while d0 < dk:  # cu:203
        w = min(GD_TILE, dk - d0)  # cu:204
        for e in range(tid, c * GD_TILE, bdim):  # cu:205
            i, d = e // GD_TILE, e % GD_TILE  # cu:206
            at = ((t0 + i) * nk + kh) * dk + d0 + d  # cu:207
            tq[i * (GD_TILE + 1) + d] = q[at] if d < w else F(0.0)  # cu:208
            tk[i * (GD_TILE + 1) + d] = k[at] if d < w else F(0.0)  # cu:209
        yield "cu211"
        for e in range(tid, c * c, bdim):  # cu:212
            i, j = e // c, e % c  # cu:213
            if j > i:  # cu:214
                continue
            a, l = F(0.0), F(0.0)  # cu:215
            for d in range(w):  # cu:216
                kj = tk[j * (GD_TILE + 1) + d]  # cu:217
                a += tq[i * (GD_TILE + 1) + d] * kj  # cu:218
                l += tk[i * (GD_TILE + 1) + d] * kj  # cu:219
            att[e] += a  # cu:221
            low[e] += l  # cu:222
        yield "cu224"
        d0 += GD_TILE

    An = A + (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:229
    for e in range(tid, c * c, bdim):  # cu:230
        i, j = e // c, e % c  # cu:231
        decay = gd_decay(cum, i, j) if j <= i else F(0.0)  # cu:232
        a = att[e] * decay if j <= i else F(0.0)  # cu:233
        kke = low[e] * decay if j < i else F(0.0)  # cu:234
        low[e] = bet[i] * kke  # cu:235
        An[i * GD_CHUNK + j] = a  # cu:236
        if KKE is not None:
            KKE[(n * nv + h) * GD_CHUNK * GD_CHUNK + i * GD_CHUNK + j] = kke  # cu:237
    yield "cu239"

    for col in range(tid, dv + dk, bdim):  # cu:243
        x = [None] * GD_CHUNK  # cu:244 (local array; None = uninitialised)
        for i in range(c):  # cu:245
            row = t0 + i  # cu:246
            if col < dv:  # cu:247
                r = bet[i] * v[(row * nv + h) * dv + col]  # cu:247
            else:
                r = bet[i] * expf(F(cum[i])) * k[(row * nk + kh) * dk + (col - dv)]  # cu:248
            for l in range(i):  # cu:249
                r -= low[i * c + l] * x[l]  # cu:249
            x[i] = r  # cu:250
            if col < dv:
                U[(row * nv + h) * dv + col] = r  # cu:252
            else:
                W[(row * nv + h) * dk + (col - dv)] = r  # cu:254


# ---------------------------------------------------------------- scan (cu:261)
def scan_shared_factory(dk):
    def f():
        return (
            shared("scan.delta", GD_CHUNK * GD_COLS, np.float32),  # cu:266
            shared("scan.cum", GD_CHUNK, np.float64),  # cu:267
            shared("scan.dec", GD_CHUNK, np.float32),  # cu:268
            shared("scan.qk", 2 * dk, np.float32),  # cu:269 dynamic, shared_mem_bytes 2*dk*4
        )
    return f


def gated_delta_chunk_scan(bx, tid, bdim, gdim, sh, out, state, starts, U, A, W, G, q, k, v, g,
                           beta, slots, seq_chunk0, chunk_tok0, chunk_len, seqs, nk, nv, dk, dv):
    delta, cum, dec, qk = sh
    tiles = (dv + GD_COLS - 1) // GD_COLS  # cu:270
    tile, h, s = bx % tiles, (bx // tiles) % nv, bx // tiles // nv  # cu:271
    if s >= seqs:  # cu:272
        return
    kh = h // (nv // nk)  # cu:273
    tx, ty = tid % GD_COLS, tid // GD_COLS  # cu:274
    j = tile * GD_COLS + tx  # cu:275
    live = j < dv  # cu:276
    S = state + (u(slots[s]) * nv + h) * dk * dv  # cu:277
    n = u(seq_chunk0[s])
    while n < u(seq_chunk0[s + 1]):  # cu:278
        new_epoch(tid, sh)
        t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:279
        if starts is not None:  # cu:280
            s0 = starts + (n * nv + h) * dk * dv  # cu:281
            d = ty
            while d < dk and live:  # cu:282
                s0[d * dv + j] = S[d * dv + j]  # cu:282
                d += GD_ROWS
            yield "cu283"
        if c == 1:  # cu:285
            for i in range(tid, dk, bdim):  # cu:287
                qk[i] = q[(t0 * nk + kh) * dk + i]  # cu:288
                qk[dk + i] = k[(t0 * nk + kh) * dk + i]  # cu:289
            yield "cu291"
            if ty == 0 and live:  # cu:292
                at = (t0 * nv + h) * dv + j  # cu:293
                out[at] = gd_column_step(S, qk, expf(g[t0 * nv + h]),  # cu:294
                                         beta[t0 * nv + h], v[at], j, dk, dv)
            yield "cu297"
            n += 1
            continue
        if tid < c:
            cum[tid] = G[(t0 + tid) * nv + h]  # cu:300
        yield "cu301"
        if tid < c:
            dec[tid] = gd_decay(cum, c - 1, tid)  # cu:302
        i = ty
        while i < c and live:  # cu:304
            row = t0 + i  # cu:305
            wi = W + (row * nv + h) * dk  # cu:306
            qi = q + (row * nk + kh) * dk  # cu:307
            ws, qs = F(0.0), F(0.0)  # cu:308
            for d in range(dk):  # cu:309
                sv = S[d * dv + j]  # cu:310
                ws += wi[d] * sv  # cu:311
                qs += qi[d] * sv  # cu:312
            delta[i * GD_COLS + tx] = U[(row * nv + h) * dv + j] - ws  # cu:314
            out[(row * nv + h) * dv + j] = expf(F(cum[i])) * qs  # cu:315
            i += GD_ROWS
        yield "cu317"
        An = A + (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:319
        i = ty
        while i < c and live:  # cu:320
            o = F(0.0)  # cu:321
            for l in range(i + 1):  # cu:322
                o += An[i * GD_CHUNK + l] * delta[l * GD_COLS + tx]  # cu:322
            out[((t0 + i) * nv + h) * dv + j] += o  # cu:323
            i += GD_ROWS
        last = expf(F(cum[c - 1]))  # cu:327
        d = ty
        while d < dk and live:  # cu:328
            acc = F(0.0)  # cu:329
            for i in range(c):  # cu:330
                acc += dec[i] * k[((t0 + i) * nk + kh) * dk + d] * delta[i * GD_COLS + tx]  # cu:331
            S[d * dv + j] = last * S[d * dv + j] + acc  # cu:332
            d += GD_ROWS
        yield "cu334"
        n += 1


# ---------------------------------------------------------------- dscan (cu:367)
def dscan_shared():
    return (
        shared("dscan.dd", GD_CHUNK * GD_COLS, np.float32),  # cu:371
        shared("dscan.cum", GD_CHUNK, np.float64),  # cu:372
        shared("dscan.eg", GD_CHUNK, np.float32),  # cu:373
        shared("dscan.dec", GD_CHUNK, np.float32),
    )


def gated_delta_chunk_dscan(bx, tid, bdim, gdim, sh, ddelta, ds1, dS_all, A, W, G, q, k, dout,
                            seq_chunk0, chunk_tok0, chunk_len, seqs, nk, nv, dk, dv):
    dd, cum, eg, dec = sh
    tiles = (dv + GD_COLS - 1) // GD_COLS  # cu:374
    tile, h, s = bx % tiles, (bx // tiles) % nv, bx // tiles // nv  # cu:375
    if s >= seqs:  # cu:376
        return
    kh = h // (nv // nk)  # cu:377
    tx, ty = tid % GD_COLS, tid // GD_COLS  # cu:378
    j = tile * GD_COLS + tx  # cu:379
    live = j < dv  # cu:380
    sn = dk * dv  # cu:381
    dS = dS_all + (s * nv + h) * sn  # cu:382
    n = u(seq_chunk0[s + 1]) - 1
    while n >= u(seq_chunk0[s]):  # cu:383
        new_epoch(tid, sh)
        t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:384
        if tid < c:
            cum[tid] = G[(t0 + tid) * nv + h]  # cu:385
        yield "cu386"
        if tid < c:  # cu:387
            eg[tid] = expf(F(cum[tid]))  # cu:388
            dec[tid] = gd_decay(cum, c - 1, tid)  # cu:389
        d1 = ds1 + (n * nv + h) * sn  # cu:391
        d = ty
        while d < dk and live:  # cu:392
            d1[d * dv + j] = dS[d * dv + j]  # cu:392
            d += GD_ROWS
        yield "cu393"
        An = A + (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:395
        i = ty
        while i < c and live:  # cu:396
            acc = F(0.0)  # cu:397
            for l in range(i, c):  # cu:398
                acc += An[l * GD_CHUNK + i] * dout[((t0 + l) * nv + h) * dv + j]  # cu:399
            ki = k + ((t0 + i) * nk + kh) * dk  # cu:400
            ks = F(0.0)  # cu:401
            for d in range(dk):
                ks += ki[d] * dS[d * dv + j]  # cu:402
            acc += dec[i] * ks  # cu:403
            dd[i * GD_COLS + tx] = acc  # cu:404
            ddelta[((t0 + i) * nv + h) * dv + j] = acc  # cu:405
            i += GD_ROWS
        yield "cu407"
        last = expf(F(cum[c - 1]))  # cu:409
        d = ty
        while d < dk and live:  # cu:410
            acc = F(0.0)  # cu:411
            for i in range(c):  # cu:412
                row = t0 + i  # cu:413
                acc += (eg[i] * q[(row * nk + kh) * dk + d] * dout[(row * nv + h) * dv + j]  # cu:414
                        - W[(row * nv + h) * dk + d] * dd[i * GD_COLS + tx])  # cu:415
            dS[d * dv + j] = last * dS[d * dv + j] + acc  # cu:417
            d += GD_ROWS
        yield "cu419"
        n -= 1


# ---------------------------------------------------------------- block_sum_f64 (cu:425)
def block_sum_f64(v, red, tid, bdim):
    yield "cu426"
    red[tid] = v  # cu:427
    yield "cu428"
    o = bdim // 2
    while o > 0:  # cu:429
        if tid < o:
            red[tid] += red[tid + o]  # cu:430
        yield "cu431"
        o >>= 1
    total = red[0]  # cu:433
    yield "cu434"
    return total


# ---------------------------------------------------------------- grads (cu:438)
def grads_shared():
    return (
        shared("grads.cum", GD_CHUNK, np.float64),  # cu:445
        shared("grads.dG", GD_CHUNK, np.float64),
        shared("grads.dbl", GD_CHUNK, np.float64),
        shared("grads.eg", GD_CHUNK, np.float32),  # cu:446
        shared("grads.dec", GD_CHUNK, np.float32),
        shared("grads.bet", GD_CHUNK, np.float32),
        shared("grads.P", GD_CHUNK * GD_CHUNK, np.float32),  # cu:447
        shared("grads.D", GD_CHUNK * GD_CHUNK, np.float32),
        shared("grads.red", 256, np.float64),  # cu:448
    )


def gated_delta_chunk_grads(bx, tid, bdim, gdim, sh, dq_v, dk_v, dv_out, dg_out, dbeta_out, delta,
                            dqg, dkd, drv, drk, ddelta, starts, ds1, A, KKE, U, W, G, q, k, v,
                            dout, beta, chunk_tok0, chunk_len, chunks, nk, nv, dk, dv):
    cum, dG, dbl, eg, dec, bet, P, Dm, red = sh
    n, h = bx // nv, bx % nv  # cu:449
    if n >= chunks:  # cu:450
        return
    kh = h // (nv // nk)  # cu:451
    t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:452
    sn = dk * dv  # cu:454
    mat = (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:455
    S0 = starts + (n * nv + h) * sn  # cu:456
    dS = ds1 + (n * nv + h) * sn  # cu:457
    An = A + mat  # cu:458
    Kn = KKE + mat  # cu:459

    def GD_QK(x, i):  # cu:462
        return x + ((t0 + i) * nk + kh) * dk

    def GD_HK(x, i):  # cu:463
        return x + ((t0 + i) * nv + h) * dk

    def GD_HV(x, i):  # cu:464
        return x + ((t0 + i) * nv + h) * dv

    if tid < c:  # cu:465
        cum[tid] = G[(t0 + tid) * nv + h]  # cu:466
        bet[tid] = beta[(t0 + tid) * nv + h]  # cu:467
    yield "cu469"
    if tid < c:  # cu:470
        eg[tid] = expf(F(cum[tid]))  # cu:471
        dec[tid] = gd_decay(cum, c - 1, tid)  # cu:472
    for e in range(tid, c * dv, bdim):  # cu:475
        i, j = e // dv, e % dv  # cu:476
        wi = GD_HK(W, i)  # cu:477
        acc = F(0.0)
        for d in range(dk):
            acc += wi[d] * S0[d * dv + j]  # cu:479
        GD_HV(delta, i)[j] = GD_HV(U, i)[j] - acc  # cu:480
    yield "cu482"
    for e in range(tid, c * dk, bdim):  # cu:484
        i, d = e // dk, e % dk  # cu:485
        doi = GD_HV(dout, i)  # cu:486
        dli = GD_HV(delta, i)  # cu:487
        ddi = GD_HV(ddelta, i)  # cu:488
        a, b, w = F(0.0), F(0.0), F(0.0)  # cu:489
        for j in range(dv):  # cu:490
            s0 = S0[d * dv + j]  # cu:491
            a += doi[j] * s0  # cu:492
            b += dli[j] * dS[d * dv + j]  # cu:493
            w += ddi[j] * s0  # cu:494
        GD_HK(dqg, i)[d] = a  # cu:496
        GD_HK(dkd, i)[d] = b  # cu:497
        GD_HK(drk, i)[d] = -w  # cu:498
    for e in range(tid, c * dv, bdim):  # cu:500
        GD_HV(drv, e // dv)[e % dv] = GD_HV(ddelta, e // dv)[e % dv]  # cu:500
    for e in range(tid, c * c, bdim):  # cu:502
        i, j = e // c, e % c  # cu:503
        a = F(0.0)  # cu:504
        if j <= i:  # cu:505
            doi = GD_HV(dout, i)  # cu:506
            dlj = GD_HV(delta, j)  # cu:507
            for x in range(dv):
                a += doi[x] * dlj[x]  # cu:508
        P[i * GD_CHUNK + j] = a  # cu:510
    yield "cu512"
    for col in range(tid, dv + dk, bdim):  # cu:515
        base = drv if col < dv else drk  # cu:516
        width, x = (dv, col) if col < dv else (dk, col - dv)  # cu:517
        for i in range(c - 2, -1, -1):  # cu:518
            r = base[((t0 + i) * nv + h) * width + x]  # cu:519
            for l in range(i + 1, c):  # cu:520
                r -= bet[l] * Kn[l * GD_CHUNK + i] * base[((t0 + l) * nv + h) * width + x]  # cu:521
            base[((t0 + i) * nv + h) * width + x] = r  # cu:522
    yield "cu525"
    for e in range(tid, c * c, bdim):  # cu:527
        i, j = e // c, e % c  # cu:528
        a = F(0.0)  # cu:529
        if j < i:  # cu:530
            ri, uj = GD_HV(drv, i), GD_HV(U, j)  # cu:531
            for x in range(dv):
                a += ri[x] * uj[x]  # cu:532
            rk, wj = GD_HK(drk, i), GD_HK(W, j)  # cu:533
            for x in range(dk):
                a += rk[x] * wj[x]  # cu:534
        Dm[i * GD_CHUNK + j] = -a  # cu:536
    yield "cu538"
    if tid < c:  # cu:541
        i = tid
        acc, db = D(0.0), D(0.0)  # cu:543
        for j in range(c):  # cu:544
            if j <= i:
                acc += D(P[i * GD_CHUNK + j]) * An[i * GD_CHUNK + j]  # cu:545
            if j >= i:
                acc -= D(P[j * GD_CHUNK + i]) * An[j * GD_CHUNK + i]  # cu:546
            if j < i:  # cu:547
                xx = D(Dm[i * GD_CHUNK + j]) * Kn[i * GD_CHUNK + j]  # cu:548
                acc += bet[i] * xx  # cu:549
                db += xx  # cu:550
            if j > i:
                acc -= D(bet[j]) * Dm[j * GD_CHUNK + i] * Kn[j * GD_CHUNK + i]  # cu:552
        dG[i] = acc  # cu:554
        dbl[i] = db  # cu:555
    yield "cu557"
    for e in range(tid, c * c, bdim):  # cu:559
        i, j = e // c, e % c  # cu:560
        decay = gd_decay(cum, i, j) if j <= i else F(0.0)  # cu:561
        P[i * GD_CHUNK + j] *= decay  # cu:562
        Dm[i * GD_CHUNK + j] *= decay  # cu:563
    yield "cu565"
    for e in range(tid, c * dk, bdim):  # cu:566
        i, d = e // dk, e % dk  # cu:567
        a = eg[i] * GD_HK(dqg, i)[d]  # cu:568
        for j in range(i + 1):
            a += P[i * GD_CHUNK + j] * GD_QK(k, j)[d]  # cu:569
        GD_HK(dq_v, i)[d] = a  # cu:570
        b = dec[i] * GD_HK(dkd, i)[d] + bet[i] * eg[i] * GD_HK(drk, i)[d]  # cu:571
        for l in range(i, c):
            b += P[l * GD_CHUNK + i] * GD_QK(q, l)[d]  # cu:572
        for j in range(c):  # cu:573
            b += (bet[i] * Dm[i * GD_CHUNK + j] + bet[j] * Dm[j * GD_CHUNK + i]) * GD_QK(k, j)[d]  # cu:574
        GD_HK(dk_v, i)[d] = b  # cu:575
    for e in range(tid, c * dv, bdim):  # cu:577
        i, j = e // dv, e % dv  # cu:578
        GD_HV(dv_out, i)[j] = bet[i] * GD_HV(drv, i)[j]  # cu:579
    last_share = D(0.0)  # cu:582
    if tid < c:  # cu:583
        i = tid
        qi, ki, vi = GD_QK(q, i), GD_QK(k, i), GD_HV(v, i)  # cu:585
        rv, rk = GD_HV(drv, i), GD_HK(drk, i)  # cu:586
        gq, gk = GD_HK(dqg, i), GD_HK(dkd, i)  # cu:587
        k_rk, v_rv, q_gq, k_gk = D(0.0), D(0.0), D(0.0), D(0.0)  # cu:588
        for d in range(dk):  # cu:589
            k_rk += D(ki[d]) * rk[d]  # cu:590
            q_gq += D(qi[d]) * gq[d]  # cu:591
            k_gk += D(ki[d]) * gk[d]  # cu:592
        for j in range(dv):
            v_rv += D(vi[j]) * rv[j]  # cu:594
        dbeta_out[(t0 + i) * nv + h] = F(v_rv + eg[i] * k_rk + dbl[i])  # cu:595
        kd_gk = dec[i] * k_gk  # cu:596
        dG[i] += eg[i] * q_gq - kd_gk + D(bet[i]) * eg[i] * k_rk  # cu:597
        last_share = kd_gk  # cu:598
    part = last_share  # cu:600
    last = expf(F(cum[c - 1]))  # cu:601
    for x in range(tid, sn, bdim):
        part += D(last) * S0[x] * dS[x]  # cu:602
    total = yield from block_sum_f64(part, red, tid, bdim)  # cu:603
    if tid == 0:  # cu:604
        dG[c - 1] += total  # cu:605
        acc = D(0.0)  # cu:606
        for i in range(c - 1, -1, -1):  # cu:607
            acc += dG[i]  # cu:608
            dg_out[(t0 + i) * nv + h] = F(acc)  # cu:609


# ---------------------------------------------------------------- reduce (cu:769)
def gated_delta_backward_reduce(bx, tid, bdim, gdim, sh, dq, dk, dq_v, dk_v, t, nk, nv, dkd):
    if False:
        yield
    n = t * nk * dkd  # cu:772
    x = bx * bdim + tid  # cu:773
    while x < n:
        i = x % dkd  # cu:775
        row = x // dkd  # cu:776
        kh = row % nk  # cu:777
        tt = row // nk  # cu:778
        group = nv // nk  # cu:779
        a, b = F(0.0), F(0.0)  # cu:780
        for uu in range(group):  # cu:781
            at = (tt * nv + kh * group + uu) * dkd + i  # cu:782
            a += dq_v[at]  # cu:783
            b += dk_v[at]  # cu:784
        dq[x] = a  # cu:786
        dk[x] = b  # cu:787
        x += gdim * bdim  # cu:774
