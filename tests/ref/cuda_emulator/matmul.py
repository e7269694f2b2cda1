"""Transcription of kernels/src/cuda/matmul.cu (`matmul_invariant`, the
engine's batch-invariant product) and its launch (device/gemm.rs), run
against a float64 product, with a check that a row's bits do not depend on
the rows launched with it. Usage: python matmul.py"""
import numpy as np
from simt import T, Buf, F, D, launch
from prelude import fmaf, bf16_to_f32, f32_to_bf16

MM_TILE, MM_K, MM_THREADS = 64, 16, 256

# cu:19
def mm_load(p, i, bf16):
    return bf16_to_f32(p[i]) if bf16 else p[i]  # cu:20

# cu:23; blockIdx.x = bx % gx, blockIdx.y = bx // gx (the 2-D grid, linearized)
def matmul_invariant(bx, tid, bdim, gdim, sh, out, inp, w, n, c, oc, in_bf16, w_bf16, out_bf16,
                     add, gx):
    sa, sb = sh  # [MM_K][MM_TILE + 1] each, flattened
    L = MM_TILE + 1
    row0, col0 = (bx // gx) * MM_TILE, (bx % gx) * MM_TILE  # cu:28
    tr, tc = tid // 16, tid % 16
    acc = [[F(0.0)] * 4 for _ in range(4)]
    for k0 in range(0, c, MM_K):  # cu:33
        kn = c - k0 if c - k0 < MM_K else MM_K
        for e in range(tid, MM_TILE * MM_K, MM_THREADS):  # cu:35
            r, kk = e // MM_K, e % MM_K
            in_k = kk < kn
            sa[kk * L + r] = mm_load(inp, (row0 + r) * c + k0 + kk, in_bf16) if in_k and row0 + r < n else F(0.0)  # cu:38
            sb[kk * L + r] = mm_load(w, (col0 + r) * c + k0 + kk, w_bf16) if in_k and col0 + r < oc else F(0.0)  # cu:40
        yield "cu43"
        for kk in range(kn):  # cu:44
            b = [sb[kk * L + tc + 16 * j] for j in range(4)]  # cu:46
            for i in range(4):
                if row0 + tr + 16 * i >= n: break  # cu:48
                a = sa[kk * L + tr + 16 * i]
                for j in range(4): acc[i][j] = fmaf(a, b[j], acc[i][j])  # cu:50
        yield "cu53"
    for i in range(4):  # cu:55
        r = row0 + tr + 16 * i
        if r >= n: break
        for j in range(4):
            col = col0 + tc + 16 * j
            if col >= oc: continue
            at = r * oc + col  # cu:61
            if out_bf16: out[at] = f32_to_bf16(acc[i][j])
            elif add: out[at] = F(out[at] + acc[i][j])  # cu:65
            else: out[at] = acc[i][j]

def run(inp, w, n, c, oc, in_bf16=False, w_bf16=False, out_bf16=False, add=None):
    gx, gy = -(-oc // MM_TILE), -(-n // MM_TILE)
    ib = Buf("inp", np.array([f32_to_bf16(x) for x in inp], np.uint16) if in_bf16 else inp.astype(np.float32).copy())
    wb = Buf("w", np.array([f32_to_bf16(x) for x in w], np.uint16) if w_bf16 else w.astype(np.float32).copy())
    if out_bf16: ob = Buf("out", np.zeros(n * oc, np.uint16))
    elif add is not None: ob = Buf("out", add.astype(np.float32).copy())
    else: ob = Buf("out", np.full(n * oc, np.nan, np.float32))
    from simt import shared
    launch("matmul_invariant", gx * gy, MM_THREADS, matmul_invariant,
           lambda: (shared("sa", MM_K * (MM_TILE + 1), np.float32), shared("sb", MM_K * (MM_TILE + 1), np.float32)),
           ob, ib, wb, n, c, oc, int(in_bf16), int(w_bf16), int(out_bf16), int(add is not None), gx)
    if out_bf16: return np.array([bf16_to_f32(x) for x in ob.a], np.float32)
    return ob.a.copy()

def rnd(x, bf): return np.array([bf16_to_f32(f32_to_bf16(v)) for v in x], np.float32) if bf else x

def main():
    rng = np.random.default_rng(0)
    worst, bad = 0.0, []
    for (n, c, oc, ib, wb) in [(1, 7, 5, False, False), (70, 40, 70, False, False), (3, 33, 65, True, True),
                               (70, 17, 3, False, True)]:
        inp = rng.standard_normal(n * c).astype(np.float32)
        w = (0.1 * rng.standard_normal(oc * c)).astype(np.float32)
        got = run(inp, w, n, c, oc, ib, wb)
        ref = rnd(inp, ib).astype(D).reshape(n, c) @ rnd(w, wb).astype(D).reshape(oc, c).T
        r = np.max(np.abs(got.reshape(n, oc) - ref)) / np.max(np.abs(ref))
        worst = max(worst, r)
        print(f"n{n} c{c} oc{oc} in_bf16 {ib} w_bf16 {wb}: max|diff|/max|ref| = {r:.3e}", flush=True)
        # The same rows alone or in a smaller launch: the same bits.
        for first, m in [(0, 1), (n // 2, min(5, n - n // 2)), (n - 1, 1)]:
            part = run(inp[first * c:(first + m) * c], w, m, c, oc, ib, wb)
            same = np.array_equal(part, got[first * oc:(first + m) * oc])
            print(f"  rows {first}..{first + m} alone: {'bit-identical' if same else 'DIFFER BUG'}", flush=True)
            if not same: bad.append((n, first))
    # out += the product, and bf16 out.
    n, c, oc = 5, 20, 9
    inp = rng.standard_normal(n * c).astype(np.float32); w = rng.standard_normal(oc * c).astype(np.float32)
    base = rng.standard_normal(n * oc).astype(np.float32)
    prod = run(inp, w, n, c, oc)
    added = run(inp, w, n, c, oc, add=base)
    print("add: out + sum exact:", np.array_equal(added, (base + prod).astype(np.float32)))
    outb = run(inp, w, n, c, oc, out_bf16=True)
    print("bf16 out: the f32 result rounded once:", np.array_equal(outb, rnd(prod, True)))
    print(T.report())
    print("worst", f"{worst:.3e}", "BUG" if worst > 1e-5 or bad else "ok")

if __name__ == "__main__":
    main()
