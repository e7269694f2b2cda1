"""Transcription of gated_delta.cu's decode and recurrent prefill (the
state's column in registers: gd_column_step_reg, gd_recurrent) with their
launch (device.rs), run against a float64 recurrence, and bit checks:
decode token by token == the prefill in one call == gd_column_step (the
global-memory step of the chunked scan's one-token chunks) applied token by
token. Usage: python recurrent.py"""
import numpy as np
from simt import T, Buf, F, D, launch, shared
import kernels as K

GD_MAX_DK = 128

# cu:40 (registers are a Python list)
def gd_column_step_reg(s, qk, decay, b, v_j, dk):
    kv = F(0.0)
    for i in range(GD_MAX_DK):  # cu:44
        if i < dk:
            x = F(s[i] * decay)  # cu:46
            s[i] = x
            kv = F(kv + F(x * qk[dk + i]))  # cu:48
    delta = F(b * F(v_j - kv))  # cu:50
    o = F(0.0)
    for i in range(GD_MAX_DK):  # cu:53
        if i < dk:
            x = F(s[i] + F(qk[dk + i] * delta))  # cu:55
            s[i] = x
            o = F(o + F(x * qk[i]))  # cu:57
    return o

# cu:79
def gd_recurrent(out, S, q, k, v, g, beta, t0, t1, nk, nv, kh, h, j0, dk, dv, qk, tid, bdim):
    j = j0 + tid  # cu:82
    live = j < dv  # cu:83
    col = [F(0.0)] * GD_MAX_DK
    if live:
        for i in range(dk): col[i] = S[i * dv + j]  # cu:66
    for t in range(t0, t1):  # cu:86
        qs = q + (t * nk + kh) * dk
        ks = k + (t * nk + kh) * dk
        yield "cu89"
        for i in range(tid, dk, bdim):  # cu:90
            qk[i] = qs[i]
            qk[dk + i] = ks[i]
        yield "cu94"
        if live:
            at = (t * nv + h) * dv + j  # cu:96
            out[at] = gd_column_step_reg(col, qk, K.expf(g[t * nv + h]), beta[t * nv + h], v[at], dk)
    if live:
        for i in range(dk): S[i * dv + j] = col[i]  # cu:71

GD_REC_COLS = 32

# cu:106
def gated_delta_decode(bx, tid, bdim, gdim, qk, out, state, q, k, v, g, beta, slots, seqs, nk, nv, dk, dv):
    tiles = -(-dv // GD_REC_COLS)
    tile, h, s = bx % tiles, (bx // tiles) % nv, bx // tiles // nv  # cu:112
    if s >= seqs: return
    S = state + (K.u(slots[s]) * nv + h) * dk * dv  # cu:114
    yield from gd_recurrent(out, S, q, k, v, g, beta, s, s + 1, nk, nv, h // (nv // nk), h,
                            tile * GD_REC_COLS, dk, dv, qk, tid, bdim)

# cu:123
def gated_delta_prefill(bx, tid, bdim, gdim, qk, out, state, q, k, v, g, beta, slots, cu, seqs, nk, nv, dk, dv):
    tiles = -(-dv // GD_REC_COLS)
    tile, h, s = bx % tiles, (bx // tiles) % nv, bx // tiles // nv  # cu:129
    if s >= seqs: return
    S = state + (K.u(slots[s]) * nv + h) * dk * dv  # cu:131
    yield from gd_recurrent(out, S, q, k, v, g, beta, K.u(cu[s]), K.u(cu[s + 1]), nk, nv,
                            h // (nv // nk), h, tile * GD_REC_COLS, dk, dv, qk, tid, bdim)

# device.rs: recurrent_launch
def grid(heads, dv): return heads * -(-dv // GD_REC_COLS)

def case(name, lens, nk, nv, dk, dv, seed=0):
    rng = np.random.default_rng(seed)
    cu = [0]
    for n in lens: cu.append(cu[-1] + n)
    t, seqs = cu[-1], len(lens)
    q = (0.2 * rng.standard_normal((t, nk, dk))).astype(np.float32)
    k = (0.2 * rng.standard_normal((t, nk, dk))).astype(np.float32)
    v = rng.standard_normal((t, nv, dv)).astype(np.float32)
    g = (-rng.uniform(0, 2, (t, nv))).astype(np.float32)
    beta = rng.uniform(0, 1, (t, nv)).astype(np.float32)
    slots = list(rng.permutation(seqs + 1)[:seqs])
    state0 = (0.3 * rng.standard_normal((seqs + 1, nv, dk, dv))).astype(np.float32)
    ins = lambda: [Buf(n_, a.copy()) for n_, a in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))]
    # The prefill in one call.
    out_p, st_p = Buf("out", np.full(t * nv * dv, np.nan, np.float32)), Buf("state", state0.copy())
    launch("gated_delta_prefill", grid(seqs * nv, dv), GD_REC_COLS, gated_delta_prefill,
           lambda: shared("qk", 2 * dk, np.float32), out_p, st_p, *ins(),
           Buf("slots", np.array(slots, np.uint32)), Buf("cu", np.array(cu, np.uint32)), seqs, nk, nv, dk, dv)
    # Decode: every sequence's i-th token in the i-th step.
    out_d, st_d = np.full(t * nv * dv, np.nan, np.float32), Buf("state", state0.copy())
    for i in range(max(lens)):
        live = [s for s in range(seqs) if lens[s] > i]
        rows = [cu[s] + i for s in live]
        o = Buf("out", np.full(len(rows) * nv * dv, np.nan, np.float32))
        launch("gated_delta_decode", grid(len(rows) * nv, dv), GD_REC_COLS, gated_delta_decode,
               lambda: shared("qk", 2 * dk, np.float32), o, st_d,
               Buf("q", q[rows].copy()), Buf("k", k[rows].copy()), Buf("v", v[rows].copy()),
               Buf("g", g[rows].copy()), Buf("beta", beta[rows].copy()),
               Buf("slots", np.array([slots[s] for s in live], np.uint32)), len(rows), nk, nv, dk, dv)
        for r, row in enumerate(rows):
            out_d[row * nv * dv:(row + 1) * nv * dv] = o.a[r * nv * dv:(r + 1) * nv * dv]
    # gd_column_step (global memory) token by token, and float64.
    st_g = state0.copy().reshape(-1)
    out_g = np.zeros(t * nv * dv, np.float32)
    out_r = np.zeros((t, nv, dv))
    st_r = state0.astype(D).copy()
    T.on = False
    for s in range(seqs):
        for tt in range(cu[s], cu[s + 1]):
            for h in range(nv):
                kh = h // (nv // nk)
                qk = np.concatenate([q[tt, kh], k[tt, kh]]).astype(np.float32)
                Sg = Buf("S", st_g[(slots[s] * nv + h) * dk * dv:(slots[s] * nv + h + 1) * dk * dv])
                for j in range(dv):
                    out_g[(tt * nv + h) * dv + j] = K.gd_column_step(Sg, qk, K.expf(g[tt, h]), beta[tt, h], v[tt, h, j], j, dk, dv)
                S = st_r[slots[s], h] * np.exp(D(g[tt, h]))
                delta = D(beta[tt, h]) * (v[tt, h].astype(D) - S.T @ k[tt, kh].astype(D))
                S = S + np.outer(k[tt, kh].astype(D), delta)
                st_r[slots[s], h] = S
                out_r[tt, h] = S.T @ q[tt, kh].astype(D)
    T.on = True
    rel = np.max(np.abs(out_p.a - out_r.reshape(-1))) / np.max(np.abs(out_r))
    srel = np.max(np.abs(st_p.a - st_r.reshape(-1))) / np.max(np.abs(st_r))
    print(f"{name}: prefill vs float64: out {rel:.3e}, state {srel:.3e}", "ok" if max(rel, srel) < 1e-5 else "BUG")
    for what, a, b in [("decode == prefill (out)", out_d, out_p.a), ("decode == prefill (state)", st_d.a, st_p.a),
                       ("gd_column_step == prefill (out)", out_g, out_p.a),
                       ("gd_column_step == prefill (state)", st_g, st_p.a)]:
        print(f"  {what}: {'bit-identical' if np.array_equal(a, b) else 'DIFFER BUG'}")
    print(T.report(), flush=True)
    T.issues.clear()

if __name__ == "__main__":
    case("GQA 2/4, dk 24, dv 40, lens [5, 1, 0, 3]", [5, 1, 0, 3], 2, 4, 24, 40)
    case("dk 128, dv 33 (the register limit; two column tiles, one partial), lens [2, 3]", [2, 3], 1, 2, 128, 33, seed=1)
    case("dk 16, dv 70 (three column tiles), lens [4]", [4], 1, 1, 16, 70, seed=2)
