"""Transcription of kernels/src/cuda/conv1d.cu (tags `# cu:NNN` name its
lines): the engine's kernels, conv1d_varlen_forward and
conv1d_varlen_state_advance for prefill of packed sequences in state
slots and conv1d_update for decode, with their launch (device.rs:
`conv1d_varlen_forward`'s token_seq and `elems`), and the trainer's,
conv1d_forward, conv1d_state_advance, conv1d_backward_input and
conv1d_backward_weight (device/backward.rs: `conv1d_forward`,
`conv1d_backward`), against a float64 causal depthwise conv over [state;
inputs] and its gradients. `elems` caps a grid at 65,535 blocks; the cases
cap it at 1 to 3 blocks so that every thread walks several elements (the
grid-stride loops). Usage: python conv1d.py"""
import numpy as np
from simt import T, Buf, F, D, launch, shared
from prelude import u, block_sum
from simt_warp import launch as launch_warp
from report import buf, check, say

# cu:6
def conv_row(st, x, r, hist, c, ch):
    return st[r * c + ch] if r < hist else x[(r - hist) * c + ch]  # cu:8

# cu:12
def conv_taps(st, x, w, ti, k, c, ch):
    acc = F(0.0)  # cu:14
    for j in range(k): acc = F(acc + F(w[j] * conv_row(st, x, ti + j, k - 1, c, ch)))  # cu:15
    return acc

# cu:20
def conv_advance(st, x, t, hist, c, ch):
    keep = [F(0)] * 7  # cu:22
    for j in range(hist): keep[j] = conv_row(st, x, t + j, hist, c, ch)  # cu:23
    for j in range(hist): st[j * c + ch] = keep[j]  # cu:24

# cu:33
def conv1d_update(bx, tid, bdim, gdim, sh, out, state, inp, weight, slots, seqs, c, k):
    i = bx * bdim + tid
    while i < seqs * c:  # cu:36
        s, ch = i // c, i % c  # cu:38
        st = state + u(slots[s]) * (k - 1) * c  # cu:39
        w = weight + ch * k  # cu:40
        x = inp[i]  # cu:41
        acc = F(0.0)
        for j in range(k - 1): acc = F(acc + F(w[j] * st[j * c + ch]))  # cu:43
        acc = F(acc + F(w[k - 1] * x))  # cu:44
        for j in range(k - 2): st[j * c + ch] = st[(j + 1) * c + ch]  # cu:45-46
        if k > 1: st[(k - 2) * c + ch] = x  # cu:47
        out[i] = acc  # cu:48
        i += gdim * bdim
    return
    yield

# cu:55
def conv1d_forward(bx, tid, bdim, gdim, sh, out, state, inp, weight, t, c, k):
    i = bx * bdim + tid
    while i < t * c:  # cu:57
        ti, ch = i // c, i % c  # cu:59
        out[i] = conv_taps(state, inp, weight + ch * k, ti, k, c, ch)  # cu:60
        i += gdim * bdim
    return
    yield

# cu:66
def conv1d_state_advance(bx, tid, bdim, gdim, sh, state, inp, t, c, k):
    if k < 2: return  # cu:68
    ch = bx * bdim + tid
    while ch < c:  # cu:69
        conv_advance(state, inp, t, k - 1, c, ch)  # cu:70
        ch += gdim * bdim
    return
    yield

# cu:79
def conv1d_varlen_forward(bx, tid, bdim, gdim, sh, out, state, inp, weight, slots, cu_seqlens,
                          token_seq, t, c, k):
    hist = k - 1  # cu:83
    i = bx * bdim + tid
    while i < t * c:  # cu:84
        row, ch = i // c, i % c  # cu:86
        s = u(token_seq[row])  # cu:87
        start = u(cu_seqlens[s])  # cu:88
        ti = row - start  # cu:89
        st = state + u(slots[s]) * hist * c  # cu:90
        out[i] = conv_taps(st, inp + start * c, weight + ch * k, ti, k, c, ch)  # cu:91
        i += gdim * bdim
    return
    yield

# cu:97
def conv1d_varlen_state_advance(bx, tid, bdim, gdim, sh, state, inp, slots, cu_seqlens, seqs, c, k):
    if k < 2: return  # cu:101
    hist = k - 1
    i = bx * bdim + tid
    while i < seqs * c:  # cu:103
        s, ch = i // c, i % c  # cu:105
        start, t = u(cu_seqlens[s]), u(cu_seqlens[s + 1]) - u(cu_seqlens[s])  # cu:106
        st = state + u(slots[s]) * hist * c  # cu:107
        conv_advance(st, inp + start * c, t, hist, c, ch)  # cu:108
        i += gdim * bdim
    return
    yield

# cu:116; dstate0 None is the kernel's null pointer
def conv1d_backward_input(bx, tid, bdim, gdim, sh, dinp, dstate0, dout, weight, t, c, k):
    hist = k - 1  # cu:118
    i = bx * bdim + tid
    while i < (t + hist) * c:  # cu:119-120
        r, ch = i // c, i % c  # cu:121
        w = weight + ch * k  # cu:122
        acc = F(0.0)
        for j in range(k):  # cu:124
            ti = r - j  # cu:125
            if ti >= 0 and ti < t: acc = F(acc + F(w[j] * dout[ti * c + ch]))  # cu:126
        if r >= hist: dinp[(r - hist) * c + ch] = acc  # cu:128
        elif dstate0 is not None: dstate0[r * c + ch] = acc  # cu:129
        i += gdim * bdim
    return
    yield

# cu:135
def conv1d_backward_weight(bx, tid, bdim, gdim, sh, dweight, dout, state0, inp, t, c, k):
    scratch = sh  # cu:138
    ch = bx  # cu:139
    if ch >= c: return  # cu:140
    hist = k - 1
    for j in range(k):  # cu:142
        acc = F(0.0)
        ti = tid
        while ti < t:  # cu:144
            acc = F(acc + F(dout[ti * c + ch] * conv_row(state0, inp, ti + j, hist, c, ch)))  # cu:145
            ti += bdim
        acc = yield from block_sum(acc, scratch, tid, bdim)  # cu:146
        if tid == 0: dweight[ch * k + j] += acc  # cu:147

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
    say(f"{name}: update == varlen of one token: {'bit-identical' if same else 'BUG'}")

def case_train(name, t, c, k, cap, with_dstate0=True, seed=2):
    """The trainer's conv (device/backward.rs `conv1d_forward` then
    `conv1d_backward`): one sequence after a state of K-1 rows, its state
    advanced, then the gradients of the virtual input [state0; inp] and the
    weights (accumulated onto what dweight held) against float64."""
    rng = np.random.default_rng(seed)
    hist = k - 1
    state0 = rng.standard_normal(hist * c).astype(np.float32)
    x = rng.standard_normal((t, c)).astype(np.float32)
    w = rng.standard_normal(c * k).astype(np.float32)
    dout = rng.standard_normal((t, c)).astype(np.float32)
    dw0 = rng.standard_normal(c * k).astype(np.float32)
    v = np.concatenate([state0.reshape(hist, c), x]).astype(D)
    wk = w.reshape(c, k).astype(D)
    ref = np.stack([(wk.T * v[ti:ti + k]).sum(0) for ti in range(t)]) if t else np.zeros((0, c))
    dv = np.zeros((t + hist, c))
    dwr = dw0.reshape(c, k).astype(D).copy()
    for ti in range(t):
        dv[ti:ti + k] += wk.T * dout[ti].astype(D)
        dwr += (v[ti:ti + k] * dout[ti].astype(D)).T
    out = Buf("out", np.full(t * c, np.nan, np.float32))
    sb, xb, wb = buf("state", state0), buf("inp", x), buf("weight", w)
    launch("conv1d_forward", elems(t * c, cap), 256, conv1d_forward, None, out, sb, xb, wb, t, c, k)
    launch("conv1d_state_advance", elems(c, cap), 256, conv1d_state_advance, None, sb, xb, t, c, k)
    check(name, "out", out.a, ref)
    check(name, "state advanced", sb.a, v[len(v) - hist:].reshape(-1), 0.0)
    dinp = Buf("dinp", np.full(t * c, np.nan, np.float32))
    ds = Buf("dstate0", np.full(hist * c, np.nan, np.float32)) if with_dstate0 else None
    dwb = buf("dweight", dw0)
    dob = buf("dout", dout)
    launch("conv1d_backward_input", elems((t + hist) * c, cap), 256, conv1d_backward_input, None,
           dinp, ds, dob, wb, t, c, k)
    if t > 0:
        launch_warp("conv1d_backward_weight", c, 256, conv1d_backward_weight,
                    lambda: shared("scratch", 32, np.float32), dwb, dob, buf("state0", state0),
                    xb, t, c, k)
    check(name, "dinp", dinp.a, dv[hist:])
    if ds is not None: check(name, "dstate0", ds.a, dv[:hist])
    check(name, "dweight (added onto its old values)", dwb.a, dwr.reshape(-1))

if __name__ == "__main__":
    # Lengths with an empty sequence, a one-token one and one shorter than
    # the history; shuffled slots; grids of 1 to 3 blocks.
    case_varlen("varlen c29 k4 lens[5,1,0,2,9] grid<=2", [5, 1, 0, 2, 9], [3, 0, 4, 1, 2], 29, 4, 2)
    case_varlen("varlen c70 k4 lens[12,3] grid 1", [12, 3], [1, 0], 70, 4, 1)
    case_varlen("varlen c33 k2 lens[4,0,6] grid<=3", [4, 0, 6], [0, 2, 1], 33, 2, 3)
    case_varlen("varlen c40 k8 lens[3,10] grid<=2 (k-1 > a sequence)", [3, 10], [1, 0], 40, 8, 2)
    case_update_equals_varlen("decode c29 k4 grid 1", 29, 4, 1)
    case_update_equals_varlen("decode c300 k4 grid<=2", 300, 4, 2)
    # The trainer's: more tokens than a block's threads (the weight sums'
    # strided loop), a sequence shorter than the history, one token, none.
    case_train("train t300 c5 k4 grid<=2", 300, 5, 4, 2)
    case_train("train t2 c37 k4 grid 1 (t < k-1)", 2, 37, 4, 1)
    case_train("train t9 c29 k8 grid<=3, no dstate0", 9, 29, 8, 3, with_dstate0=False)
    case_train("train t1 c70 k2 grid 1", 1, 70, 2, 1)
    case_train("train t0 c6 k4 grid 1", 0, 6, 4, 1)
    print(T.report(), flush=True)
