"""Transcription of the conv kernels the engine's CUDA path runs
(kernels/src/cuda/conv1d.cu: conv1d_varlen_forward and
conv1d_varlen_state_advance for prefill of packed sequences in state
slots, conv1d_update for decode) with their launch (device.rs:
`conv1d_varlen_forward`'s token_seq and `elems`), against a float64
reference of the causal depthwise conv over [state; inputs]. `elems` caps
a grid at 65,535 blocks; the cases cap it at 1 to 3 blocks so that every
thread walks several elements (the grid-stride loops). Usage:
python conv1d.py"""
import numpy as np
from simt import T, Buf, F, D, launch

def u(x): return int(x)

# cu:71
def conv1d_varlen_forward(bx, tid, bdim, gdim, sh, out, state, inp, weight, slots, cu_seqlens,
                          token_seq, t, c, k):
    hist = k - 1
    i = bx * bdim + tid
    while i < t * c:  # cu:76
        row, ch = i // c, i % c
        s = u(token_seq[row])  # cu:79
        start = u(cu_seqlens[s])  # cu:80
        ti = row - start
        st = state + u(slots[s]) * hist * c  # cu:82
        x = inp + start * c  # cu:83
        w = weight + ch * k  # cu:84
        acc = F(0.0)
        for j in range(k):  # cu:86
            r = ti + j
            v = st[r * c + ch] if r < hist else x[(r - hist) * c + ch]  # cu:88
            acc = F(acc + F(w[j] * v))  # cu:89
        out[i] = acc  # cu:91
        i += gdim * bdim
    return
    yield

# cu:97
def conv1d_varlen_state_advance(bx, tid, bdim, gdim, sh, state, inp, slots, cu_seqlens, seqs, c, k):
    if k < 2: return  # cu:101
    hist = k - 1
    i = bx * bdim + tid
    while i < seqs * c:  # cu:103
        s, ch = i // c, i % c
        start, t = u(cu_seqlens[s]), u(cu_seqlens[s + 1]) - u(cu_seqlens[s])  # cu:106
        st = state + u(slots[s]) * hist * c  # cu:107
        x = inp + start * c  # cu:108
        keep = [F(0)] * 7
        for j in range(hist):
            r = t + j
            keep[j] = st[r * c + ch] if r < hist else x[(r - hist) * c + ch]  # cu:112
        for j in range(hist): st[j * c + ch] = keep[j]  # cu:114
        i += gdim * bdim
    return
    yield

# cu:10
def conv1d_update(bx, tid, bdim, gdim, sh, out, state, inp, weight, slots, seqs, c, k):
    i = bx * bdim + tid
    while i < seqs * c:  # cu:13
        s, ch = i // c, i % c
        st = state + u(slots[s]) * (k - 1) * c  # cu:16
        w = weight + ch * k  # cu:17
        x = inp[i]  # cu:18
        acc = F(0.0)
        for j in range(k - 1): acc = F(acc + F(w[j] * st[j * c + ch]))  # cu:20
        acc = F(acc + F(w[k - 1] * x))  # cu:21
        for j in range(k - 2): st[j * c + ch] = st[(j + 1) * c + ch]  # cu:23
        if k > 1: st[(k - 2) * c + ch] = x  # cu:24
        out[i] = acc  # cu:25
        i += gdim * bdim
    return
    yield

# device.rs: token_seq, elems (the block cap a parameter here)
def token_seq(cu):
    r = []
    for s in range(len(cu) - 1): r += [s] * (cu[s + 1] - cu[s])
    return r

def elems(n, cap):
    return max(1, min(-(-n // 256), cap))

def reference(states, slots, cu, x, w, c, k):
    """Outputs and the slots' new states, float64, sequence by sequence."""
    out = np.zeros((cu[-1], c))
    new = {s: st.copy() for s, st in states.items()}
    for s, slot in enumerate(slots):
        a, b = cu[s], cu[s + 1]
        v = np.concatenate([states[slot].reshape(k - 1, c), x[a:b]]).astype(D)
        for t in range(b - a):
            out[a + t] = (w.reshape(c, k).T * v[t:t + k]).sum(0)
        new[slot] = v[len(v) - (k - 1):].reshape(-1)
    return out, new

def buf(name, a, dt=np.float32):
    return Buf(name, np.array(a, dtype=dt).copy())

RES = []

def check(case, name, got, ref, tol=1e-6):
    got = np.asarray(got, np.float64).reshape(ref.shape)
    den = max(np.max(np.abs(ref)), 1e-30) if ref.size else 1.0
    r = float("nan") if np.isnan(got).any() else float(np.max(np.abs(got - ref), initial=0.0) / den)
    line = f"{case}: {name}: max|diff|/max|ref| = {r:.3e} {'ok' if r <= tol else 'BUG'}"
    print(line, flush=True); RES.append(line)

def case_varlen(name, lens, slots, c, k, cap, seed=0):
    rng = np.random.default_rng(seed)
    cu = [0]
    for n in lens: cu.append(cu[-1] + n)
    t, seqs, hist = cu[-1], len(lens), k - 1
    n_slots = max(slots) + 2
    state = rng.standard_normal(n_slots * hist * c).astype(np.float32)
    x = rng.standard_normal((t, c)).astype(np.float32)
    w = rng.standard_normal(c * k).astype(np.float32)
    states = {s: state[s * hist * c:(s + 1) * hist * c].astype(D) for s in range(n_slots)}
    ref, new = reference(states, slots, cu, x.astype(D), w.astype(D), c, k)
    out = Buf("out", np.full(t * c, np.nan, np.float32))
    sb, xb = buf("state", state), buf("inp", x)
    args = (buf("slots", slots, np.uint32), buf("cu_seqlens", cu, np.uint32))
    if t and c:
        launch("conv1d_varlen_forward", elems(t * c, cap), 256, conv1d_varlen_forward, None, out,
               sb, xb, buf("weight", w), *args, buf("token_seq", token_seq(cu), np.uint32), t, c, k)
        launch("conv1d_varlen_state_advance", elems(seqs * c, cap), 256,
               conv1d_varlen_state_advance, None, sb, xb, *args, seqs, c, k)
    check(name, "out", out.a, ref)
    want = state.astype(D).copy()
    for s, st in new.items(): want[s * hist * c:(s + 1) * hist * c] = st
    check(name, "state (other slots untouched)", sb.a, want, 0.0)
    return state, x, w, out.a.copy(), sb.a.copy()

def case_update_equals_varlen(name, c, k, cap, seed=1):
    """Decode: conv1d_update of one token per sequence has the bits of
    conv1d_varlen_forward over sequences of one token, states alike."""
    rng = np.random.default_rng(seed)
    slots, hist = [2, 0, 3], k - 1
    state = rng.standard_normal(5 * hist * c).astype(np.float32)
    x = rng.standard_normal((3, c)).astype(np.float32)
    w = rng.standard_normal(c * k).astype(np.float32)
    out = Buf("out", np.full(3 * c, np.nan, np.float32))
    sb = buf("state", state)
    launch("conv1d_update", elems(3 * c, cap), 256, conv1d_update, None, out, sb, buf("inp", x),
           buf("weight", w), buf("slots", slots, np.uint32), 3, c, k)
    out2 = Buf("out", np.full(3 * c, np.nan, np.float32))
    sb2, xb, cu = buf("state", state), buf("inp", x), [0, 1, 2, 3]
    args = (buf("slots", slots, np.uint32), buf("cu_seqlens", cu, np.uint32))
    launch("conv1d_varlen_forward", elems(3 * c, cap), 256, conv1d_varlen_forward, None, out2, sb2,
           xb, buf("weight", w), *args, buf("token_seq", token_seq(cu), np.uint32), 3, c, k)
    launch("conv1d_varlen_state_advance", elems(3 * c, cap), 256, conv1d_varlen_state_advance,
           None, sb2, xb, *args, 3, c, k)
    same = np.array_equal(out.a, out2.a) and np.array_equal(sb.a, sb2.a)
    line = f"{name}: update == varlen of one token: {'bit-identical' if same else 'BUG'}"
    print(line, flush=True); RES.append(line)

if __name__ == "__main__":
    # Lengths with an empty sequence, a one-token one and one shorter than
    # the history; shuffled slots; grids of 1 to 3 blocks.
    case_varlen("varlen c29 k4 lens[5,1,0,2,9] grid<=2", [5, 1, 0, 2, 9], [3, 0, 4, 1, 2], 29, 4, 2)
    case_varlen("varlen c70 k4 lens[12,3] grid 1", [12, 3], [1, 0], 70, 4, 1)
    case_varlen("varlen c33 k2 lens[4,0,6] grid<=3", [4, 0, 6], [0, 2, 1], 33, 2, 3)
    case_varlen("varlen c40 k8 lens[3,10] grid<=2 (k-1 > a sequence)", [3, 10], [1, 0], 40, 8, 2)
    case_update_equals_varlen("decode c29 k4 grid 1", 29, 4, 1)
    case_update_equals_varlen("decode c300 k4 grid<=2", 300, 4, 2)
    print(T.report(), flush=True)
