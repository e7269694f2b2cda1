"""Transcription of gated_delta.cu's `gated_delta_backward` (the one-block-
per-value-head sequential backward by re-computation: checkpoints every
GD_CHUNK tokens, each chunk replayed keeping every state, its tokens walked
backwards carrying dS) with its launch, CudaDevice::gated_delta_backward
(device/backward.rs: scratch, block and shared sizes, then
`gated_delta_backward_reduce` from kernels.py; dstate0 zeroed at t = 0).
The launcher takes one sequence; a packed batch is one call per sequence.
Checked against host.py's float64 reference backward (dq, dk, dv, dg, dbeta
and dstate0) and, in the `gqa` and `mha` groups, against the emulated
chunked backward (host.chunked_backward) on the same inputs.
`# cu:NNN` tags name gated_delta.cu's lines; `yield "cuNNN"` is the
__syncthreads() at line NNN (block_sum's barriers are prelude.py's).
usage: python sequential.py [GROUP ...]   (groups: see GROUPS)"""
import sys

import numpy as np

import host
import kernels as K
from prelude import block_sum
from report import check, run_groups
from simt import T, Buf, F, new_epoch, shared
from simt_warp import launch

GD_CHUNK = K.GD_CHUNK
expf = K.expf


# ---------------------------------------------------------------- kernel (cu:637)
def gated_delta_backward(bx, tid, bdim, gdim, shm, dq_v, dk_v, dv_out, dg_out, dbeta_out, dstate0,
                         ckpt, st, dS_all, res_all, dout, state0, q, k, v, g, beta, t, nk, nv, dk,
                         dv):
    sh, scratch = shm  # cu:642 (dynamic), cu:648 (static scratch[32])
    sq = sh + 0  # cu:643
    sk = sq + dk  # cu:644
    sdo = sk + dk  # cu:645
    sdelta = sdo + dv  # cu:646
    sdkv = sdelta + dv  # cu:647
    h = bx  # cu:649
    if h >= nv:  # cu:650
        return
    kh = h // (nv // nk)  # cu:651
    sn = dk * dv  # cu:652
    chunks = (t + GD_CHUNK - 1) // GD_CHUNK  # cu:653
    ck = ckpt + h * chunks * sn  # cu:654
    sts = st + h * (GD_CHUNK + 1) * sn  # cu:655
    dS = dS_all + h * sn  # cu:656
    res = res_all + h * GD_CHUNK * dv  # cu:657
    s0 = state0 + h * sn  # cu:658

    # 1. Checkpoints: ck[c] is the state before token c * GD_CHUNK.
    for x in range(tid, sn, bdim):  # cu:661
        ck[x] = s0[x]  # cu:662
        dS[x] = F(0.0)  # cu:663
    yield "cu665"
    for c in range(chunks - 1):  # cu:666
        S = ck + (c + 1) * sn  # cu:667
        for x in range(tid, sn, bdim):
            S[x] = ck[c * sn + x]  # cu:668
        yield "cu669"
        for tt in range(c * GD_CHUNK, (c + 1) * GD_CHUNK):  # cu:670
            new_epoch(tid, [sh])
            for i in range(tid, dk, bdim):  # cu:671
                sq[i] = q[(tt * nk + kh) * dk + i]  # cu:672
                sk[i] = k[(tt * nk + kh) * dk + i]  # cu:673
            yield "cu675"
            decay, b = expf(g[tt * nv + h]), beta[tt * nv + h]  # cu:676
            for j in range(tid, dv, bdim):  # cu:677
                K.gd_column_step(S, sq, decay, b, v[(tt * nv + h) * dv + j], j, dk, dv)  # cu:678
            yield "cu679"

    # 2. Chunks in reverse.
    for c in range(chunks - 1, -1, -1):  # cu:684
        t0 = c * GD_CHUNK  # cu:685
        ln = t - t0 if t - t0 < GD_CHUNK else GD_CHUNK  # cu:686 (len)
        for x in range(tid, sn, bdim):
            sts[x] = ck[c * sn + x]  # cu:687
        yield "cu688"
        # Replay: st[u + 1] is the state after token t0 + u; res[u] = v - S_a^T k.
        for uu in range(ln):  # cu:690
            new_epoch(tid, [sh])
            tt = t0 + uu  # cu:691
            for i in range(tid, dk, bdim):
                sk[i] = k[(tt * nk + kh) * dk + i]  # cu:692
            yield "cu693"
            decay, b = expf(g[tt * nv + h]), beta[tt * nv + h]  # cu:694
            P = sts + uu * sn  # cu:695
            S = sts + (uu + 1) * sn  # cu:696
            for j in range(tid, dv, bdim):  # cu:697
                kv = F(0.0)  # cu:698
                for i in range(dk):
                    kv += P[i * dv + j] * decay * sk[i]  # cu:699
                r = v[(tt * nv + h) * dv + j] - kv  # cu:700
                res[uu * dv + j] = r  # cu:701
                delta = b * r  # cu:702
                for i in range(dk):  # cu:703
                    S[i * dv + j] = P[i * dv + j] * decay + sk[i] * delta  # cu:704
            yield "cu706"
        for uu in range(ln - 1, -1, -1):  # cu:708
            new_epoch(tid, [sh])
            tt = t0 + uu  # cu:709
            decay, b = expf(g[tt * nv + h]), beta[tt * nv + h]  # cu:710
            P = sts + uu * sn  # cu:711
            S = sts + (uu + 1) * sn  # cu:712
            for i in range(tid, dk, bdim):  # cu:713
                sq[i] = q[(tt * nk + kh) * dk + i]  # cu:714
                sk[i] = k[(tt * nk + kh) * dk + i]  # cu:715
            for j in range(tid, dv, bdim):  # cu:717
                sdo[j] = dout[(tt * nv + h) * dv + j]  # cu:718
            yield "cu719"
            # Columns: dS += q do^T, then ddelta, dv, dbeta's share, dkv.
            pb = F(0.0)  # cu:721
            for j in range(tid, dv, bdim):  # cu:722
                dd = F(0.0)  # cu:723
                for i in range(dk):  # cu:724
                    x = dS[i * dv + j] + sq[i] * sdo[j]  # cu:725
                    dS[i * dv + j] = x  # cu:726
                    dd += x * sk[i]  # cu:727
                r = res[uu * dv + j]  # cu:729
                dv_out[(tt * nv + h) * dv + j] = b * dd  # cu:730
                pb += dd * r  # cu:731
                sdelta[j] = b * r  # cu:732
                sdkv[j] = -b * dd  # cu:733
            pb = yield from block_sum(pb, scratch, tid, bdim)  # cu:735
            if tid == 0:
                dbeta_out[tt * nv + h] = pb  # cu:736
            yield "cu737"
            # Rows: dq = S do, dk = dS delta + S_a dkv.
            for i in range(tid, dk, bdim):  # cu:739
                a, bk = F(0.0), F(0.0)  # cu:740
                for j in range(dv):  # cu:741
                    a += S[i * dv + j] * sdo[j]  # cu:742
                    bk += dS[i * dv + j] * sdelta[j] + P[i * dv + j] * decay * sdkv[j]  # cu:743
                dq_v[(tt * nv + h) * dk + i] = a  # cu:745
                dk_v[(tt * nv + h) * dk + i] = bk  # cu:746
            yield "cu748"
            # Columns: dS_a = dS + k dkv^T; dg's share; dS_prev = e^g dS_a.
            pg = F(0.0)  # cu:750
            for j in range(tid, dv, bdim):  # cu:751
                for i in range(dk):  # cu:752
                    x = dS[i * dv + j] + sk[i] * sdkv[j]  # cu:753
                    pg += P[i * dv + j] * decay * x  # cu:754
                    dS[i * dv + j] = x * decay  # cu:755
            pg = yield from block_sum(pg, scratch, tid, bdim)  # cu:758
            if tid == 0:
                dg_out[tt * nv + h] = pg  # cu:759
            yield "cu760"
    if dstate0 is not None:  # cu:763
        for x in range(tid, sn, bdim):
            dstate0[h * sn + x] = dS[x]  # cu:764


# ---------------------------------------------------------------- launcher
def next_multiple_of(x, m):
    return -(-x // m) * m


def nan(name, n):
    return Buf(name, np.full(n, np.nan, np.float32))


def gated_delta_backward_launch(dq, dk, dv, dg, dbeta, dstate0, dout, state0, q, k, v, g, beta,
                                dims, max_threads=1024):
    """CudaDevice::gated_delta_backward (device/backward.rs) for one sequence:
    dims = (t, nk, nv, dk, dv). Its scratch (`self.zeros`) starts as NaN here,
    so that a read of scratch the kernel did not write shows. `max_threads`
    is the launcher's `.min(1024)` cap on the block, a parameter so that
    heads wider than the block are modelled at small widths."""
    t, nk, nv, kd, vd = dims
    if nk == 0 or nv % nk or kd == 0 or vd == 0:
        raise ValueError(f"gated_delta_backward: {dims}")
    sn = kd * vd
    for name, b, n in [("dq", dq, t * nk * kd), ("dk", dk, t * nk * kd), ("dv", dv, t * nv * vd),
                       ("dg", dg, t * nv), ("dbeta", dbeta, t * nv), ("dout", dout, t * nv * vd),
                       ("state0", state0, nv * sn), ("q", q, t * nk * kd), ("k", k, t * nk * kd),
                       ("v", v, t * nv * vd), ("g", g, t * nv), ("beta", beta, t * nv)]:
        if b.n != n:
            raise ValueError(f"gated_delta_backward: {name} has {b.n}, not {n}")
    if dstate0 is not None and dstate0.n != nv * sn:
        raise ValueError("gated_delta_backward: dstate0")
    if t == 0:
        if dstate0 is not None:  # self.stream.memset_zeros(ds)
            dstate0.a[:] = 0
        return
    chunks = -(-t // GD_CHUNK)
    ckpt = nan("ckpt", nv * chunks * sn)
    st = nan("st", nv * (GD_CHUNK + 1) * sn)
    ds_all = nan("ds_all", nv * sn)
    res = nan("res", nv * GD_CHUNK * vd)
    dq_v, dk_v = nan("dq_v", t * nv * kd), nan("dk_v", t * nv * kd)
    block = min(next_multiple_of(max(kd, vd), 32), max_threads)
    smem = (2 * kd + 3 * vd) * 4  # shared_mem_bytes
    launch("gated_delta_backward", nv, block, gated_delta_backward,
           lambda: (shared("sh", smem // 4, np.float32), shared("scratch", 32, np.float32)),
           dq_v, dk_v, dv, dg, dbeta, dstate0, ckpt, st, ds_all, res, dout, state0, q, k, v, g,
           beta, t, nk, nv, kd, vd)
    launch("gated_delta_backward_reduce", *host.elems(t * nk * kd), K.gated_delta_backward_reduce,
           None, dq, dk, dq_v, dk_v, t, nk, nv, kd)


# ---------------------------------------------------------------- the checks
TOL = 2e-6


def run_packed(dims, cu, ins, with_state, want_ds0, max_threads=1024, empty_ds0=7.0):
    """One launcher call per sequence of cu over the packed inputs; returns
    the packed gradients (float32 arrays) and dstate0 [seqs, nv, dk, dv]
    (None if not asked for). A sequence of 0 tokens gets a dstate0 buffer
    holding `empty_ds0` (the launcher zeroes it)."""
    nk, nv, kd, vd = dims
    q, k, v, g, beta, dout, state0 = ins
    Tn, seqs = cu[-1], len(cu) - 1
    out = dict(dq=np.full((Tn, nk, kd), np.nan, np.float32), dk=np.full((Tn, nk, kd), np.nan, np.float32),
               dv=np.full((Tn, nv, vd), np.nan, np.float32), dg=np.full((Tn, nv), np.nan, np.float32),
               dbeta=np.full((Tn, nv), np.nan, np.float32))
    ds0 = np.full((seqs, nv, kd, vd), np.nan, np.float32) if want_ds0 else None
    for s in range(seqs):
        a, b = cu[s], cu[s + 1]
        t = b - a
        bufs = [Buf(n, x[a:b].copy()) for n, x in (("dout", dout), ("q", q), ("k", k), ("v", v),
                                                   ("g", g), ("beta", beta))]
        s0 = state0[s] if with_state else np.zeros((nv, kd, vd), np.float32)
        s0b = Buf("state0", s0.copy())
        gr = [nan(n, x[a:b].size) for n, x in out.items()]
        dsb = None
        if want_ds0:
            dsb = nan("dstate0", nv * kd * vd) if t else \
                Buf("dstate0", np.full(nv * kd * vd, empty_ds0, np.float32))
        gated_delta_backward_launch(*gr, dsb, bufs[0], s0b, *bufs[1:], (t, nk, nv, kd, vd),
                                    max_threads=max_threads)
        for (n, x), gb in zip(out.items(), gr):
            x[a:b] = gb.a.reshape(x[a:b].shape)
        if want_ds0:
            ds0[s] = dsb.a.reshape(nv, kd, vd)
        for n, bb, x in [("dout", bufs[0], dout), ("q", bufs[1], q), ("k", bufs[2], k),
                         ("v", bufs[3], v), ("g", bufs[4], g), ("beta", bufs[5], beta)]:
            assert np.array_equal(bb.a, x[a:b].reshape(-1)), f"input {n} modified"
        assert np.array_equal(s0b.a, s0.reshape(-1)), "state0 modified"
    return out, ds0


def case(name, dims, cu, with_state=True, want_ds0=True, seed=1, g_range=0.7, max_threads=1024,
         chunked=False):
    """The sequential backward (one call per sequence) against float64, and
    with `chunked` against the emulated chunked backward too."""
    host.G_RANGE = g_range
    ins = host.make_inputs(seed, dims, cu)
    q, k, v, g, beta, dout, state0 = ins
    got, ds0 = run_packed(dims, cu, ins, with_state, want_ds0, max_threads)
    f64 = [x.astype(np.float64) for x in (q, k, v, g, beta, dout)]
    ref_ds0 = np.zeros((len(cu) - 1,) + state0.shape[1:])
    r = host.reference(*f64, state0 if with_state else None, cu, dims, dstate0=ref_ds0)
    refs = dict(dq=r[2], dk=r[3], dv=r[4], dg=r[5], dbeta=r[6])
    label = f"{name} {dims} cu={cu} state0={'given' if with_state else 'zero'}"
    for n in refs:
        check(label, n, got[n], refs[n], TOL)
    if want_ds0:
        check(label, "dstate0", ds0, ref_ds0, TOL)
    if chunked:
        T.on = False  # the chunked kernels' own checks run in host.py
        Tn, (nk, nv, kd, vd) = cu[-1], dims
        bufs = {n: Buf(n, x.copy()) for n, x in zip(("q", "k", "v", "g", "beta", "dout"), ins)}
        cg = dict(dq=nan("dq", Tn * nk * kd), dk=nan("dk", Tn * nk * kd), dv=nan("dv", Tn * nv * vd),
                  dg=nan("dg", Tn * nv), dbeta=nan("dbeta", Tn * nv))
        host.chunked_backward(*cg.values(), bufs["dout"], Buf("state0", state0.copy()) if with_state else None,
                              bufs["q"], bufs["k"], bufs["v"], bufs["g"], bufs["beta"], cu, dims)
        T.on = True
        for n in refs:
            check(label + " vs chunked", n, got[n], cg[n].a.astype(np.float64).reshape(refs[n].shape), TOL)


# GQA 2/4 with dk 20 > dv 12 over sequences of 70 (a checkpoint, then a
# partial chunk), 1, 0 and 29 tokens; with an initial state also against
# the emulated chunked backward.
def group_gqa():
    case("gqa", (2, 4, 20, 12), [0, 70, 71, 71, 100], chunked=True)
    case("gqa", (2, 4, 20, 12), [0, 70, 71, 71, 100], with_state=False, want_ds0=False)


# dk = dv = 33 (a block of 64: a second, nearly idle warp in block_sum);
# sequences of 1, 64 (exactly a chunk) and 66 (a chunk and two tokens).
def group_odd():
    case("odd", (1, 2, 33, 33), [0, 1, 65, 131], seed=7)


# dk 24 < dv 40 (block 64), group 3 (nv 3, nk 1), short sequences; and the
# same widths with the block capped at 32 threads (the launcher's 1024 cap
# lowered: every strided loop of the kernel takes two turns, as at heads
# wider than 1024).
def group_wide():
    case("wide", (1, 3, 24, 40), [0, 5, 5, 8], seed=3)
    case("wide block<=32", (1, 3, 24, 40), [0, 5, 5, 8], seed=3, max_threads=32)


# Weak (g in -(0, 0.05)) decays over 130 tokens (three chunks: the second
# checkpoint built from the first) and 2, and strong ones (g in -(0, 3)).
def group_decay():
    case("weak", (1, 2, 16, 24), [0, 130, 132], seed=5, g_range=0.05)
    case("strong", (1, 2, 16, 24), [0, 67, 69], seed=5, g_range=3.0, with_state=False)


# MHA (nk = nv = 2) against the emulated chunked backward on the same
# inputs too (the two GPU backward forms agreeing, not only each with
# float64).
def group_mha():
    case("mha", (2, 2, 12, 20), [0, 66, 66, 69], seed=9, chunked=True)


# dstate0 for a sequence of no tokens starting as NaN or Inf: zeroed. (The
# launcher scaled it by 0, x * 0, which keeps a NaN and turns an Inf into
# one; this group found it.)
def group_empty_nan():
    dims, cu = (1, 1, 4, 4), [0, 0]
    ins = host.make_inputs(1, dims, cu)
    for start in (np.nan, np.inf):
        _, ds0 = run_packed(dims, cu, ins, True, True, empty_ds0=start)
        check(f"empty_nan t=0, dstate0 starting as {start}", "dstate0", ds0, np.zeros(ds0.shape), TOL)


GROUPS = {"gqa": group_gqa, "odd": group_odd, "wide": group_wide, "decay": group_decay,
          "mha": group_mha, "empty_nan": group_empty_nan}

if __name__ == "__main__":
    run_groups(GROUPS, sys.argv[1:] or list(GROUPS))
