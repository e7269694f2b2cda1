"""The launch sequence of CudaDevice::gated_delta_chunked_backward
(kernels/src/cuda/device/backward.rs) and gated_delta_chunks / ChunkPlan
(kernels/src/cuda/device.rs) over the emulated kernels, a float64 reference
gradient, and the comparison."""
import sys
import time

import numpy as np

import kernels as K
from simt import T, Buf, launch

GD_CHUNK, GD_COLS, GD_CHUNK_THREADS, ELEM_THREADS = 64, 32, 256, 256


def div_ceil(a, b):
    return (a + b - 1) // b


def chunk_plan(cu, chunk):
    tok0, ln, first = [], [], [0]
    for a, b in zip(cu[:-1], cu[1:]):
        for t0 in range(a, b, chunk):
            tok0.append(t0)
            ln.append(min(b - t0, chunk))
        first.append(len(tok0))
    return tok0, ln, first


def zeros(name, n, dt=np.float32):
    return Buf(name, np.zeros(n, dt))


def u32(name, xs):
    return Buf(name, np.array(xs, dtype=np.uint32))


def elems(n):
    return min(max(div_ceil(n, ELEM_THREADS), 1), 65535), ELEM_THREADS


def gated_delta_chunks(out, state, keep, q, k, v, g, beta, slots, plan, ints, dims):
    seqs, nv, dk, dv = len(slots.a), dims[1], dims[2], dims[3]
    tok0, ln, first = plan
    t = (tok0[-1] + ln[-1]) if tok0 else 0
    chunks = len(tok0)
    p = dict(
        a=zeros("A", chunks * nv * GD_CHUNK * GD_CHUNK),
        u=zeros("U", t * nv * dv),
        w=zeros("W", t * nv * dk),
        cum=zeros("G", t * nv, np.float64),
        tok0=u32("tok0", tok0),
        len=u32("len", ln),
        first=u32("first", first),
    )
    n = chunks
    kke, starts = keep if keep is not None else (None, None)
    launch("prep", chunks * nv, GD_CHUNK_THREADS, K.gated_delta_chunk_prep, K.prep_shared,
           p["a"], p["u"], p["w"], p["cum"], kke, q, k, v, g, beta, p["tok0"], p["len"],
           n, ints[1], ints[2], ints[3], ints[4])
    launch("scan", seqs * nv * div_ceil(dv, GD_COLS), GD_CHUNK_THREADS, K.gated_delta_chunk_scan,
           K.scan_shared_factory(dk),
           out, state, starts, p["u"], p["a"], p["w"], p["cum"], q, k, v, g, beta, slots,
           p["first"], p["tok0"], p["len"], ints[0], ints[1], ints[2], ints[3], ints[4])
    return p


def chunked_backward(dq, dk, dv, dg, dbeta, dout, state0, q, k, v, g, beta, cu, dims):
    nk, nv, kd, vd = dims
    seqs = len(cu) - 1
    sn = nv * kd * vd
    state = Buf("state", state0.a.copy()) if state0 is not None else zeros("state", seqs * sn)
    slots = u32("slots", list(range(seqs)))
    out = zeros("out", len(dout.a))
    t = cu[-1]
    ints = [seqs, nk, nv, kd, vd]
    plan = chunk_plan(cu, GD_CHUNK)
    chunks = len(plan[0])
    kke = zeros("KKE", chunks * nv * GD_CHUNK * GD_CHUNK)
    starts = zeros("starts", chunks * sn)
    p = gated_delta_chunks(out, state, (kke, starts), q, k, v, g, beta, slots, plan, ints, dims)
    ddelta = zeros("ddelta", t * nv * vd)
    ds1 = zeros("ds1", chunks * sn)
    ds_all = zeros("ds_all", seqs * sn)
    launch("dscan", seqs * nv * div_ceil(vd, GD_COLS), GD_CHUNK_THREADS,
           K.gated_delta_chunk_dscan, K.dscan_shared,
           ddelta, ds1, ds_all, p["a"], p["w"], p["cum"], q, k, dout, p["first"], p["tok0"],
           p["len"], ints[0], ints[1], ints[2], ints[3], ints[4])
    delta, drv = zeros("delta", t * nv * vd), zeros("drv", t * nv * vd)
    dqg, dkd = zeros("dqg", t * nv * kd), zeros("dkd", t * nv * kd)
    drk = zeros("drk", t * nv * kd)
    dq_v, dk_v = zeros("dq_v", t * nv * kd), zeros("dk_v", t * nv * kd)
    n = chunks
    launch("grads", chunks * nv, GD_CHUNK_THREADS, K.gated_delta_chunk_grads, K.grads_shared,
           dq_v, dk_v, dv, dg, dbeta, delta, dqg, dkd, drv, drk, ddelta, starts, ds1,
           p["a"], kke, p["u"], p["w"], p["cum"], q, k, v, dout, beta, p["tok0"], p["len"],
           n, ints[1], ints[2], ints[3], ints[4])
    gb, bb = elems(t * nk * kd)
    launch("reduce", gb, bb, K.gated_delta_backward_reduce, None, dq, dk, dq_v, dk_v, t,
           ints[1], ints[2], ints[3])
    return out, state


# ------------------------------------------------------------------ reference
def reference(q, k, v, g, beta, dout, state0, cu, dims, dstate0=None):
    """float64 forward and manual backward of the recurrence, per sequence
    and value head. Arrays: q, k [T, nk, dk]; v, dout [T, nv, dv];
    g, beta [T, nv]; state0 [seqs, nv, dk, dv] or None. `dstate0`, an
    array [seqs, nv, dk, dv] if given, receives the initial state's
    gradient."""
    nk, nv, dk, dv = dims
    r = nv // nk
    Tn = cu[-1]
    out = np.zeros((Tn, nv, dv))
    dq = np.zeros((Tn, nk, dk))
    dkk = np.zeros((Tn, nk, dk))
    dvv = np.zeros((Tn, nv, dv))
    dg = np.zeros((Tn, nv))
    db = np.zeros((Tn, nv))
    final = np.zeros((len(cu) - 1, nv, dk, dv))
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        for h in range(nv):
            kh = h // r
            S = np.zeros((dk, dv)) if state0 is None else state0[s, h].astype(np.float64).copy()
            states = []  # (S_prev, S_a, res, delta, S)
            for t in range(a, b):
                e = np.exp(g[t, h])
                Sa = e * S
                kt, qt = k[t, kh], q[t, kh]
                res = v[t, h] - Sa.T @ kt
                delta = beta[t, h] * res
                Sn = Sa + np.outer(kt, delta)
                out[t, h] = Sn.T @ qt
                states.append((S, Sa, res, delta, Sn))
                S = Sn
            final[s, h] = S
            dS = np.zeros((dk, dv))
            for t in range(b - 1, a - 1, -1):
                S_prev, Sa, res, delta, Sn = states[t - a]
                kt, qt, do = k[t, kh], q[t, kh], dout[t, h]
                dS = dS + np.outer(qt, do)
                dq[t, kh] += Sn @ do
                ddelta = dS.T @ kt
                dkk[t, kh] += dS @ delta
                dSa = dS.copy()
                db[t, h] = ddelta @ res
                dres = beta[t, h] * ddelta
                dvv[t, h] = dres
                dSa -= np.outer(kt, dres)
                dkk[t, kh] += -Sa @ dres
                dg[t, h] = np.sum(Sa * dSa)
                dS = np.exp(g[t, h]) * dSa
            if dstate0 is not None:
                dstate0[s, h] = dS
    return out, final, dq, dkk, dvv, dg, db


G_RANGE = 0.7


def make_inputs(seed, dims, cu):
    nk, nv, dk, dv = dims
    rng = np.random.default_rng(seed)
    Tn = cu[-1]
    seqs = len(cu) - 1

    def unit(x):
        n = np.maximum(np.sqrt((x * x).sum(-1, keepdims=True)), 1e-6)
        return x / n

    q = (unit(rng.uniform(-1, 1, (Tn, nk, dk)).astype(np.float32)) / np.float32(np.sqrt(dk))).astype(np.float32)
    k = unit(rng.uniform(-1, 1, (Tn, nk, dk)).astype(np.float32)).astype(np.float32)
    v = rng.uniform(-1, 1, (Tn, nv, dv)).astype(np.float32)
    g = (-rng.uniform(0, G_RANGE, (Tn, nv))).astype(np.float32)
    beta = rng.uniform(0, 1, (Tn, nv)).astype(np.float32)
    dout = rng.uniform(-1, 1, (Tn, nv, dv)).astype(np.float32)
    state0 = rng.uniform(-0.3, 0.3, (seqs, nv, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, dout, state0


def err(name, got, want):
    got = np.asarray(got, np.float64).reshape(want.shape)
    if not np.all(np.isfinite(got)):
        return f"{name:6s} NON-FINITE entries: {np.sum(~np.isfinite(got))} of {got.size}"
    d = got - want
    mx = np.abs(d).max() / max(np.abs(want).max(), 1e-300)
    l2 = np.linalg.norm(d) / max(np.linalg.norm(want), 1e-300)
    flag = "  <-- BUG?" if max(mx, l2) > 1e-4 else ""
    return f"{name:6s} max|diff|/max|ref| {mx:.3e}   rel L2 {l2:.3e}   (max|ref| {np.abs(want).max():.3e}){flag}"


def run(dims, cu, with_state, seed=1, track=True):
    nk, nv, dk, dv = dims
    q, k, v, g, beta, dout, state0 = make_inputs(seed, dims, cu)
    Tn = cu[-1]
    T.on = track
    T.issues = {}
    bufs = dict(
        q=Buf("q", q.copy()), k=Buf("k", k.copy()), v=Buf("v", v.copy()), g=Buf("g", g.copy()),
        beta=Buf("beta", beta.copy()), dout=Buf("dout", dout.copy()),
    )
    s0 = Buf("state0", state0.copy()) if with_state else None
    nan = lambda name, n: Buf(name, np.full(n, np.nan, np.float32))  # noqa: E731
    dq, dk_, dv_ = nan("dq", Tn * nk * dk), nan("dk", Tn * nk * dk), nan("dv", Tn * nv * dv)
    dg, db = nan("dg", Tn * nv), nan("dbeta", Tn * nv)
    t0 = time.time()
    out, state = chunked_backward(dq, dk_, dv_, dg, db, bufs["dout"], s0, bufs["q"], bufs["k"],
                                  bufs["v"], bufs["g"], bufs["beta"], cu, dims)
    el = time.time() - t0
    # inputs untouched?
    for nme, arr in [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("dout", dout)]:
        assert np.array_equal(bufs[nme].a.reshape(arr.shape), arr), f"input {nme} modified"
    if s0 is not None:
        assert np.array_equal(s0.a.reshape(state0.shape), state0), "state0 modified"
    ro, rfinal, rdq, rdk, rdv, rdg, rdb = reference(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), g.astype(np.float64),
        beta.astype(np.float64), dout.astype(np.float64), state0 if with_state else None, cu, dims)
    if with_state:
        rw = reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), g.astype(np.float64),
                       beta.astype(np.float64), dout.astype(np.float64), None, cu, dims)
        infl = [np.linalg.norm(a - b) / np.linalg.norm(a) for a, b in zip((rdq, rdk, rdv, rdg, rdb), rw[2:])]
        print("   state0's share of the reference gradients (rel L2 of ref(state0) - ref(0)): "
              + ", ".join(f"{n} {x:.2e}" for n, x in zip(("dq", "dk", "dv", "dg", "dbeta"), infl)))
    print(f"== dims (nk, nv, dk, dv) = {dims}, cu_seqlens = {cu}, state0 = {'given' if with_state else 'None'}"
          f"  [{el:.0f} s, tracking {'on' if track else 'off'}]")
    print("   (forward) " + err("out", out.a, ro))
    print("   (forward) " + err("state", state.a, rfinal))
    for nme, got, want in [("dq", dq.a, rdq), ("dk", dk_.a, rdk), ("dv", dv_.a, rdv),
                           ("dg", dg.a, rdg), ("dbeta", db.a, rdb)]:
        print("   " + err(nme, got, want))
    print("   race/uninit/barrier check: " + T.report().replace("\n", "\n   "))
    sys.stdout.flush()


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "small"
    track = "--notrack" not in sys.argv
    if which == "small":
        for ws in (True, False):
            run((2, 4, 20, 12), [0, 70, 71, 71, 100], ws, track=track)
    elif which == "big":
        for ws in (True, False):
            run((2, 4, 48, 40), [0, 150, 151, 151, 216], ws, track=track)
    elif which in ("weak", "strong"):
        G_RANGE = 0.05 if which == "weak" else 3.0
        print(f"g = -uniform(0, {G_RANGE})")
        for ws in (True, False):
            run((2, 4, 20, 36), [0, 70, 71, 71, 100], ws, seed=5, track=track)
    elif which == "odd":
        for ws in (True, False):
            run((1, 2, 33, 33), [0, 1, 65, 130, 131], ws, seed=7, track=track)
