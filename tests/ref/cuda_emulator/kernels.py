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


# cu:120
def gd_decay(cum, i, j):
    return expf(F(cum[i] - cum[j]))  # cu:121


# ---------------------------------------------------------------- prep (cu:128)
def prep_shared():
    return (
        shared("prep.cum", GD_CHUNK, np.float64),  # cu:132
        shared("prep.bet", GD_CHUNK, np.float32),  # cu:133
        shared("prep.att", GD_CHUNK * GD_CHUNK, np.float32),  # cu:134
        shared("prep.low", GD_CHUNK * GD_CHUNK, np.float32),
        shared("prep.tq", GD_CHUNK * (GD_TILE + 1), np.float32),  # cu:135
        shared("prep.tk", GD_CHUNK * (GD_TILE + 1), np.float32),
    )


def gated_delta_chunk_prep(bx, tid, bdim, gdim, sh, A, U, W, G, KKE, q, k, v, g, beta,
                           chunk_tok0, chunk_len, chunks, nk, nv, dk, dv):
    cum, bet, att, low, tq, tk = sh
    n, h = bx // nv, bx % nv  # cu:136
    if n >= chunks:  # cu:137
        return
    kh = h // (nv // nk)  # cu:138
    t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:139
    if tid < c:
        bet[tid] = beta[(t0 + tid) * nv + h]  # cu:140
    if tid == 0:  # cu:141
        acc = D(0.0)
        for i in range(c):
            acc += D(g[(t0 + i) * nv + h])  # cu:144
            cum[i] = acc  # cu:145
    for e in range(tid, c * c, bdim):  # cu:148
        att[e] = F(0.0)  # cu:149
        low[e] = F(0.0)  # cu:150
    yield "cu152"
    if tid < c:
        G[(t0 + tid) * nv + h] = cum[tid]  # cu:153

    d0 = 0
    while d0 < dk:  # cu:156
        w = min(GD_TILE, dk - d0)  # cu:157
        for e in range(tid, c * GD_TILE, bdim):  # cu:158
            i, d = e // GD_TILE, e % GD_TILE  # cu:159
            at = ((t0 + i) * nk + kh) * dk + d0 + d  # cu:160
            tq[i * (GD_TILE + 1) + d] = q[at] if d < w else F(0.0)  # cu:161
            tk[i * (GD_TILE + 1) + d] = k[at] if d < w else F(0.0)  # cu:162
        yield "cu164"
        for e in range(tid, c * c, bdim):  # cu:165
            i, j = e // c, e % c  # cu:166
            if j > i:  # cu:167
                continue
            a, l = F(0.0), F(0.0)  # cu:168
            for d in range(w):  # cu:169
                kj = tk[j * (GD_TILE + 1) + d]  # cu:170
                a += tq[i * (GD_TILE + 1) + d] * kj  # cu:171
                l += tk[i * (GD_TILE + 1) + d] * kj  # cu:172
            att[e] += a  # cu:174
            low[e] += l  # cu:175
        yield "cu177"
        d0 += GD_TILE

    An = A + (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:182
    for e in range(tid, c * c, bdim):  # cu:183
        i, j = e // c, e % c  # cu:184
        decay = gd_decay(cum, i, j) if j <= i else F(0.0)  # cu:185
        a = att[e] * decay if j <= i else F(0.0)  # cu:186
        kke = low[e] * decay if j < i else F(0.0)  # cu:187
        low[e] = bet[i] * kke  # cu:188
        An[i * GD_CHUNK + j] = a  # cu:189
        if KKE is not None:
            KKE[(n * nv + h) * GD_CHUNK * GD_CHUNK + i * GD_CHUNK + j] = kke  # cu:190
    yield "cu192"

    for col in range(tid, dv + dk, bdim):  # cu:196
        x = [None] * GD_CHUNK  # cu:197 (local array; None = uninitialised)
        for i in range(c):  # cu:198
            row = t0 + i  # cu:199
            if col < dv:  # cu:200
                r = bet[i] * v[(row * nv + h) * dv + col]  # cu:200
            else:
                r = bet[i] * expf(F(cum[i])) * k[(row * nk + kh) * dk + (col - dv)]  # cu:201
            for l in range(i):  # cu:202
                r -= low[i * c + l] * x[l]  # cu:202
            x[i] = r  # cu:203
            if col < dv:
                U[(row * nv + h) * dv + col] = r  # cu:205
            else:
                W[(row * nv + h) * dk + (col - dv)] = r  # cu:207


# ---------------------------------------------------------------- scan (cu:214)
def scan_shared_factory(dk):
    def f():
        return (
            shared("scan.delta", GD_CHUNK * GD_COLS, np.float32),  # cu:219
            shared("scan.cum", GD_CHUNK, np.float64),  # cu:220
            shared("scan.dec", GD_CHUNK, np.float32),  # cu:221
            shared("scan.qk", 2 * dk, np.float32),  # cu:222 dynamic, shared_mem_bytes 2*dk*4
        )
    return f


def gated_delta_chunk_scan(bx, tid, bdim, gdim, sh, out, state, starts, U, A, W, G, q, k, v, g,
                           beta, slots, seq_chunk0, chunk_tok0, chunk_len, seqs, nk, nv, dk, dv):
    delta, cum, dec, qk = sh
    tiles = (dv + GD_COLS - 1) // GD_COLS  # cu:223
    tile, h, s = bx % tiles, (bx // tiles) % nv, bx // tiles // nv  # cu:224
    if s >= seqs:  # cu:225
        return
    kh = h // (nv // nk)  # cu:226
    tx, ty = tid % GD_COLS, tid // GD_COLS  # cu:227
    j = tile * GD_COLS + tx  # cu:228
    live = j < dv  # cu:229
    S = state + (u(slots[s]) * nv + h) * dk * dv  # cu:230
    n = u(seq_chunk0[s])
    while n < u(seq_chunk0[s + 1]):  # cu:231
        new_epoch(tid, sh)
        t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:232
        if starts is not None:  # cu:233
            s0 = starts + (n * nv + h) * dk * dv  # cu:234
            d = ty
            while d < dk and live:  # cu:235
                s0[d * dv + j] = S[d * dv + j]  # cu:235
                d += GD_ROWS
            yield "cu236"
        if c == 1:  # cu:238
            for i in range(tid, dk, bdim):  # cu:240
                qk[i] = q[(t0 * nk + kh) * dk + i]  # cu:241
                qk[dk + i] = k[(t0 * nk + kh) * dk + i]  # cu:242
            yield "cu244"
            if ty == 0 and live:  # cu:245
                at = (t0 * nv + h) * dv + j  # cu:246
                out[at] = gd_column_step(S, qk, expf(g[t0 * nv + h]),  # cu:247
                                         beta[t0 * nv + h], v[at], j, dk, dv)
            yield "cu250"
            n += 1
            continue
        if tid < c:
            cum[tid] = G[(t0 + tid) * nv + h]  # cu:253
        yield "cu254"
        if tid < c:
            dec[tid] = gd_decay(cum, c - 1, tid)  # cu:255
        i = ty
        while i < c and live:  # cu:257
            row = t0 + i  # cu:258
            wi = W + (row * nv + h) * dk  # cu:259
            qi = q + (row * nk + kh) * dk  # cu:260
            ws, qs = F(0.0), F(0.0)  # cu:261
            for d in range(dk):  # cu:262
                sv = S[d * dv + j]  # cu:263
                ws += wi[d] * sv  # cu:264
                qs += qi[d] * sv  # cu:265
            delta[i * GD_COLS + tx] = U[(row * nv + h) * dv + j] - ws  # cu:267
            out[(row * nv + h) * dv + j] = expf(F(cum[i])) * qs  # cu:268
            i += GD_ROWS
        yield "cu270"
        An = A + (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:272
        i = ty
        while i < c and live:  # cu:273
            o = F(0.0)  # cu:274
            for l in range(i + 1):  # cu:275
                o += An[i * GD_CHUNK + l] * delta[l * GD_COLS + tx]  # cu:275
            out[((t0 + i) * nv + h) * dv + j] += o  # cu:276
            i += GD_ROWS
        last = expf(F(cum[c - 1]))  # cu:280
        d = ty
        while d < dk and live:  # cu:281
            acc = F(0.0)  # cu:282
            for i in range(c):  # cu:283
                acc += dec[i] * k[((t0 + i) * nk + kh) * dk + d] * delta[i * GD_COLS + tx]  # cu:284
            S[d * dv + j] = last * S[d * dv + j] + acc  # cu:285
            d += GD_ROWS
        yield "cu287"
        n += 1


# ---------------------------------------------------------------- dscan (cu:320)
def dscan_shared():
    return (
        shared("dscan.dd", GD_CHUNK * GD_COLS, np.float32),  # cu:324
        shared("dscan.cum", GD_CHUNK, np.float64),  # cu:325
        shared("dscan.eg", GD_CHUNK, np.float32),  # cu:326
        shared("dscan.dec", GD_CHUNK, np.float32),
    )


def gated_delta_chunk_dscan(bx, tid, bdim, gdim, sh, ddelta, ds1, dS_all, A, W, G, q, k, dout,
                            seq_chunk0, chunk_tok0, chunk_len, seqs, nk, nv, dk, dv):
    dd, cum, eg, dec = sh
    tiles = (dv + GD_COLS - 1) // GD_COLS  # cu:327
    tile, h, s = bx % tiles, (bx // tiles) % nv, bx // tiles // nv  # cu:328
    if s >= seqs:  # cu:329
        return
    kh = h // (nv // nk)  # cu:330
    tx, ty = tid % GD_COLS, tid // GD_COLS  # cu:331
    j = tile * GD_COLS + tx  # cu:332
    live = j < dv  # cu:333
    sn = dk * dv  # cu:334
    dS = dS_all + (s * nv + h) * sn  # cu:335
    n = u(seq_chunk0[s + 1]) - 1
    while n >= u(seq_chunk0[s]):  # cu:336
        new_epoch(tid, sh)
        t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:337
        if tid < c:
            cum[tid] = G[(t0 + tid) * nv + h]  # cu:338
        yield "cu339"
        if tid < c:  # cu:340
            eg[tid] = expf(F(cum[tid]))  # cu:341
            dec[tid] = gd_decay(cum, c - 1, tid)  # cu:342
        d1 = ds1 + (n * nv + h) * sn  # cu:344
        d = ty
        while d < dk and live:  # cu:345
            d1[d * dv + j] = dS[d * dv + j]  # cu:345
            d += GD_ROWS
        yield "cu346"
        An = A + (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:348
        i = ty
        while i < c and live:  # cu:349
            acc = F(0.0)  # cu:350
            for l in range(i, c):  # cu:351
                acc += An[l * GD_CHUNK + i] * dout[((t0 + l) * nv + h) * dv + j]  # cu:352
            ki = k + ((t0 + i) * nk + kh) * dk  # cu:353
            ks = F(0.0)  # cu:354
            for d in range(dk):
                ks += ki[d] * dS[d * dv + j]  # cu:355
            acc += dec[i] * ks  # cu:356
            dd[i * GD_COLS + tx] = acc  # cu:357
            ddelta[((t0 + i) * nv + h) * dv + j] = acc  # cu:358
            i += GD_ROWS
        yield "cu360"
        last = expf(F(cum[c - 1]))  # cu:362
        d = ty
        while d < dk and live:  # cu:363
            acc = F(0.0)  # cu:364
            for i in range(c):  # cu:365
                row = t0 + i  # cu:366
                acc += (eg[i] * q[(row * nk + kh) * dk + d] * dout[(row * nv + h) * dv + j]  # cu:367
                        - W[(row * nv + h) * dk + d] * dd[i * GD_COLS + tx])  # cu:368
            dS[d * dv + j] = last * dS[d * dv + j] + acc  # cu:370
            d += GD_ROWS
        yield "cu372"
        n -= 1


# ---------------------------------------------------------------- block_sum_f64 (cu:378)
def block_sum_f64(v, red, tid, bdim):
    yield "cu379"
    red[tid] = v  # cu:380
    yield "cu381"
    o = bdim // 2
    while o > 0:  # cu:382
        if tid < o:
            red[tid] += red[tid + o]  # cu:383
        yield "cu384"
        o >>= 1
    total = red[0]  # cu:386
    yield "cu387"
    return total


# ---------------------------------------------------------------- grads (cu:391)
def grads_shared():
    return (
        shared("grads.cum", GD_CHUNK, np.float64),  # cu:398
        shared("grads.dG", GD_CHUNK, np.float64),
        shared("grads.dbl", GD_CHUNK, np.float64),
        shared("grads.eg", GD_CHUNK, np.float32),  # cu:399
        shared("grads.dec", GD_CHUNK, np.float32),
        shared("grads.bet", GD_CHUNK, np.float32),
        shared("grads.P", GD_CHUNK * GD_CHUNK, np.float32),  # cu:400
        shared("grads.D", GD_CHUNK * GD_CHUNK, np.float32),
        shared("grads.red", 256, np.float64),  # cu:401
    )


def gated_delta_chunk_grads(bx, tid, bdim, gdim, sh, dq_v, dk_v, dv_out, dg_out, dbeta_out, delta,
                            dqg, dkd, drv, drk, ddelta, starts, ds1, A, KKE, U, W, G, q, k, v,
                            dout, beta, chunk_tok0, chunk_len, chunks, nk, nv, dk, dv):
    cum, dG, dbl, eg, dec, bet, P, Dm, red = sh
    n, h = bx // nv, bx % nv  # cu:402
    if n >= chunks:  # cu:403
        return
    kh = h // (nv // nk)  # cu:404
    t0, c = u(chunk_tok0[n]), u(chunk_len[n])  # cu:405
    sn = dk * dv  # cu:407
    mat = (n * nv + h) * GD_CHUNK * GD_CHUNK  # cu:408
    S0 = starts + (n * nv + h) * sn  # cu:409
    dS = ds1 + (n * nv + h) * sn  # cu:410
    An = A + mat  # cu:411
    Kn = KKE + mat  # cu:412

    def GD_QK(x, i):  # cu:415
        return x + ((t0 + i) * nk + kh) * dk

    def GD_HK(x, i):  # cu:416
        return x + ((t0 + i) * nv + h) * dk

    def GD_HV(x, i):  # cu:417
        return x + ((t0 + i) * nv + h) * dv

    if tid < c:  # cu:418
        cum[tid] = G[(t0 + tid) * nv + h]  # cu:419
        bet[tid] = beta[(t0 + tid) * nv + h]  # cu:420
    yield "cu422"
    if tid < c:  # cu:423
        eg[tid] = expf(F(cum[tid]))  # cu:424
        dec[tid] = gd_decay(cum, c - 1, tid)  # cu:425
    for e in range(tid, c * dv, bdim):  # cu:428
        i, j = e // dv, e % dv  # cu:429
        wi = GD_HK(W, i)  # cu:430
        acc = F(0.0)
        for d in range(dk):
            acc += wi[d] * S0[d * dv + j]  # cu:432
        GD_HV(delta, i)[j] = GD_HV(U, i)[j] - acc  # cu:433
    yield "cu435"
    for e in range(tid, c * dk, bdim):  # cu:437
        i, d = e // dk, e % dk  # cu:438
        doi = GD_HV(dout, i)  # cu:439
        dli = GD_HV(delta, i)  # cu:440
        ddi = GD_HV(ddelta, i)  # cu:441
        a, b, w = F(0.0), F(0.0), F(0.0)  # cu:442
        for j in range(dv):  # cu:443
            s0 = S0[d * dv + j]  # cu:444
            a += doi[j] * s0  # cu:445
            b += dli[j] * dS[d * dv + j]  # cu:446
            w += ddi[j] * s0  # cu:447
        GD_HK(dqg, i)[d] = a  # cu:449
        GD_HK(dkd, i)[d] = b  # cu:450
        GD_HK(drk, i)[d] = -w  # cu:451
    for e in range(tid, c * dv, bdim):  # cu:453
        GD_HV(drv, e // dv)[e % dv] = GD_HV(ddelta, e // dv)[e % dv]  # cu:453
    for e in range(tid, c * c, bdim):  # cu:455
        i, j = e // c, e % c  # cu:456
        a = F(0.0)  # cu:457
        if j <= i:  # cu:458
            doi = GD_HV(dout, i)  # cu:459
            dlj = GD_HV(delta, j)  # cu:460
            for x in range(dv):
                a += doi[x] * dlj[x]  # cu:461
        P[i * GD_CHUNK + j] = a  # cu:463
    yield "cu465"
    for col in range(tid, dv + dk, bdim):  # cu:468
        base = drv if col < dv else drk  # cu:469
        width, x = (dv, col) if col < dv else (dk, col - dv)  # cu:470
        for i in range(c - 2, -1, -1):  # cu:471
            r = base[((t0 + i) * nv + h) * width + x]  # cu:472
            for l in range(i + 1, c):  # cu:473
                r -= bet[l] * Kn[l * GD_CHUNK + i] * base[((t0 + l) * nv + h) * width + x]  # cu:474
            base[((t0 + i) * nv + h) * width + x] = r  # cu:475
    yield "cu478"
    for e in range(tid, c * c, bdim):  # cu:480
        i, j = e // c, e % c  # cu:481
        a = F(0.0)  # cu:482
        if j < i:  # cu:483
            ri, uj = GD_HV(drv, i), GD_HV(U, j)  # cu:484
            for x in range(dv):
                a += ri[x] * uj[x]  # cu:485
            rk, wj = GD_HK(drk, i), GD_HK(W, j)  # cu:486
            for x in range(dk):
                a += rk[x] * wj[x]  # cu:487
        Dm[i * GD_CHUNK + j] = -a  # cu:489
    yield "cu491"
    if tid < c:  # cu:494
        i = tid
        acc, db = D(0.0), D(0.0)  # cu:496
        for j in range(c):  # cu:497
            if j <= i:
                acc += D(P[i * GD_CHUNK + j]) * An[i * GD_CHUNK + j]  # cu:498
            if j >= i:
                acc -= D(P[j * GD_CHUNK + i]) * An[j * GD_CHUNK + i]  # cu:499
            if j < i:  # cu:500
                xx = D(Dm[i * GD_CHUNK + j]) * Kn[i * GD_CHUNK + j]  # cu:501
                acc += bet[i] * xx  # cu:502
                db += xx  # cu:503
            if j > i:
                acc -= D(bet[j]) * Dm[j * GD_CHUNK + i] * Kn[j * GD_CHUNK + i]  # cu:505
        dG[i] = acc  # cu:507
        dbl[i] = db  # cu:508
    yield "cu510"
    for e in range(tid, c * c, bdim):  # cu:512
        i, j = e // c, e % c  # cu:513
        decay = gd_decay(cum, i, j) if j <= i else F(0.0)  # cu:514
        P[i * GD_CHUNK + j] *= decay  # cu:515
        Dm[i * GD_CHUNK + j] *= decay  # cu:516
    yield "cu518"
    for e in range(tid, c * dk, bdim):  # cu:519
        i, d = e // dk, e % dk  # cu:520
        a = eg[i] * GD_HK(dqg, i)[d]  # cu:521
        for j in range(i + 1):
            a += P[i * GD_CHUNK + j] * GD_QK(k, j)[d]  # cu:522
        GD_HK(dq_v, i)[d] = a  # cu:523
        b = dec[i] * GD_HK(dkd, i)[d] + bet[i] * eg[i] * GD_HK(drk, i)[d]  # cu:524
        for l in range(i, c):
            b += P[l * GD_CHUNK + i] * GD_QK(q, l)[d]  # cu:525
        for j in range(c):  # cu:526
            b += (bet[i] * Dm[i * GD_CHUNK + j] + bet[j] * Dm[j * GD_CHUNK + i]) * GD_QK(k, j)[d]  # cu:527
        GD_HK(dk_v, i)[d] = b  # cu:528
    for e in range(tid, c * dv, bdim):  # cu:530
        i, j = e // dv, e % dv  # cu:531
        GD_HV(dv_out, i)[j] = bet[i] * GD_HV(drv, i)[j]  # cu:532
    last_share = D(0.0)  # cu:535
    if tid < c:  # cu:536
        i = tid
        qi, ki, vi = GD_QK(q, i), GD_QK(k, i), GD_HV(v, i)  # cu:538
        rv, rk = GD_HV(drv, i), GD_HK(drk, i)  # cu:539
        gq, gk = GD_HK(dqg, i), GD_HK(dkd, i)  # cu:540
        k_rk, v_rv, q_gq, k_gk = D(0.0), D(0.0), D(0.0), D(0.0)  # cu:541
        for d in range(dk):  # cu:542
            k_rk += D(ki[d]) * rk[d]  # cu:543
            q_gq += D(qi[d]) * gq[d]  # cu:544
            k_gk += D(ki[d]) * gk[d]  # cu:545
        for j in range(dv):
            v_rv += D(vi[j]) * rv[j]  # cu:547
        dbeta_out[(t0 + i) * nv + h] = F(v_rv + eg[i] * k_rk + dbl[i])  # cu:548
        kd_gk = dec[i] * k_gk  # cu:549
        dG[i] += eg[i] * q_gq - kd_gk + D(bet[i]) * eg[i] * k_rk  # cu:550
        last_share = kd_gk  # cu:551
    part = last_share  # cu:553
    last = expf(F(cum[c - 1]))  # cu:554
    for x in range(tid, sn, bdim):
        part += D(last) * S0[x] * dS[x]  # cu:555
    total = yield from block_sum_f64(part, red, tid, bdim)  # cu:556
    if tid == 0:  # cu:557
        dG[c - 1] += total  # cu:558
        acc = D(0.0)  # cu:559
        for i in range(c - 1, -1, -1):  # cu:560
            acc += dG[i]  # cu:561
            dg_out[(t0 + i) * nv + h] = F(acc)  # cu:562


# ---------------------------------------------------------------- reduce (cu:722)
def gated_delta_backward_reduce(bx, tid, bdim, gdim, sh, dq, dk, dq_v, dk_v, t, nk, nv, dkd):
    if False:
        yield
    n = t * nk * dkd  # cu:725
    x = bx * bdim + tid  # cu:726
    while x < n:
        i = x % dkd  # cu:728
        row = x // dkd  # cu:729
        kh = row % nk  # cu:730
        tt = row // nk  # cu:731
        group = nv // nk  # cu:732
        a, b = F(0.0), F(0.0)  # cu:733
        for uu in range(group):  # cu:734
            at = (tt * nv + kh * group + uu) * dkd + i  # cu:735
            a += dq_v[at]  # cu:736
            b += dk_v[at]  # cu:737
        dq[x] = a  # cu:739
        dk[x] = b  # cu:740
        x += gdim * bdim  # cu:727
