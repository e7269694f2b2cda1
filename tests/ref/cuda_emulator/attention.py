"""Launch sequences of device.rs / device/backward.rs for the attention kernels,
float64 references, comparison. Usage: python attention.py [case ...]"""
import sys, time
import numpy as np
from simt import T, Buf, shared, F, D
from simt_warp import launch
import attention_kernels as K

ATTN_WARPS = 4
RES = []

def buf(name, a, dt=np.float32):
    return Buf(name, np.array(a, dtype=dt).copy())

def out_buf(name, n):
    return Buf(name, np.full(n, np.nan, dtype=np.float32))

def cmp(case, name, got, ref):
    got = np.asarray(got, dtype=np.float64).reshape(ref.shape)
    den = np.max(np.abs(ref)) if ref.size else 0.0
    if np.isnan(got).any():
        r = float("nan")
    else:
        r = np.max(np.abs(got - ref)) / den if den > 0 else np.max(np.abs(got - ref), initial=0.0)
    flag = "BUG" if not (r <= 1e-4) else "ok"
    line = f"{case}: {name}: max|diff|/max|ref| = {r:.3e} {flag}"
    print(line, flush=True); RES.append(line)

# device.rs: prefill_tiles, attention_prefill_launch (512 threads)
TILE_THREADS = K.ATTN_WARPS * K.ATTN_PAIR_WARPS * 32

def prefill_tiles(cu_seqlens, n_heads, n_kv_heads):
    group = n_heads // n_kv_heads
    tiles = []
    for s in range(len(cu_seqlens) - 1):
        for pair0 in range(0, (cu_seqlens[s + 1] - cu_seqlens[s]) * group, K.ATTN_PAIRS):
            tiles += [s, pair0]
    return tiles, len(tiles) // 2 * n_kv_heads

# device.rs's test prefill_tiles_cover_every_pair_once
assert prefill_tiles([0, 6, 6, 7], 6, 2) == ([0, 0, 0, 16, 2, 0], 6)
assert prefill_tiles([0, 0], 4, 1) == ([], 0)
assert prefill_tiles([0, 2], 32, 1) == ([0, 0, 0, 16, 0, 32, 0, 48], 4)

def attention_prefill_shared(hd):
    floats = max(2 * K.ATTN_KEY_TILE * hd, K.ATTN_WARPS * K.ATTN_PAIR_WARPS * (hd + 2)) + 4 * K.ATTN_PAIRS
    return lambda: shared("prefill.dyn", floats, np.float32)

# device.rs: decode_splits and paged_attention_decode's launches (a block per
# split, then attention_split_merge where a context has several)
def decode_splits(ctx):
    return max(1, -(-max(ctx, default=0) // K.ATTN_SPLIT))

assert K.ATTN_SPLIT == 512  # device.rs's test decode_splits_follow_...
assert decode_splits([]) == 1 and decode_splits([0, 1, 512]) == 1
assert decode_splits([513, 3]) == 2 and decode_splits([7, 32768]) == 64

def run_decode(out, q, kpb, vpb, flat, ctx, seqs, nh, nkv, hd, bs, max_blocks, scale):
    splits = decode_splits(ctx)
    part = Buf("part", np.full(seqs * nh * splits * (hd + 2) if splits > 1 else 1, np.nan, np.float32))
    lens = buf("context_lens", ctx, np.uint32)
    # decode_launch: blocks per (sequence, KV head, run of hb heads, split)
    group = nh // nkv
    hb = min(group, K.ATTN_DECODE_HEADS)
    launch("paged_attention_decode", seqs * nkv * -(-group // hb) * splits, hb * ATTN_WARPS * 32,
           K.paged_attention_decode, lambda: shared("decode.dyn", hb * ATTN_WARPS * (hd + 2), np.float32),
           out, part, buf("q", q), kpb, vpb, buf("block_tables", flat, np.uint32),
           lens, seqs, nh, nkv, hd, bs, max_blocks, splits, scale)
    if splits > 1:
        launch("attention_split_merge", seqs * nh, ATTN_WARPS * 32, K.attention_split_merge, None,
               out, part, lens, seqs, nh, hd, splits)
    return splits

def run_prefill(q, k, v, cu, nh, nkv, hd, scale):
    t = cu[-1]
    out = out_buf("out", t * nh * hd)
    if t == 0: return out.a.copy()  # the launcher returns before launching
    tiles, blocks = prefill_tiles(cu, nh, nkv)
    launch("varlen_attention_prefill", blocks, TILE_THREADS, K.varlen_attention_prefill,
           attention_prefill_shared(hd), out, buf("q", q), buf("k", k), buf("v", v),
           buf("cu_seqlens", cu, np.uint32), buf("tiles", tiles, np.uint32), nh, nkv, hd, scale)
    return out.a.copy()

def ref_attn(qs, ks, vs, nh, nkv, scale):
    # qs [n, nh, hd], ks/vs [nk, nkv, hd]; query i at position nk - n + i
    n, nk = qs.shape[0], ks.shape[0]
    out = np.zeros_like(qs, dtype=np.float64)
    grp = nh // nkv
    for i in range(n):
        pos = nk - n + i
        for h in range(nh):
            g = h // grp
            s = scale * ks[:pos + 1, g] @ qs[i, h]
            p = np.exp(s - s.max()); p /= p.sum()
            out[i, h] = p @ vs[:pos + 1, g]
    return out

def token_seq(cu):
    r = []
    for s in range(len(cu) - 1): r += [s] * (cu[s + 1] - cu[s])
    return r

def case_prefill(name, lens, nh, nkv, hd, seed=0):
    rng = np.random.default_rng(seed)
    cu = [0]
    for x in lens: cu.append(cu[-1] + x)
    t = cu[-1]
    q = rng.standard_normal((t, nh, hd)).astype(np.float32)
    k = rng.standard_normal((t, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((t, nkv, hd)).astype(np.float32)
    scale = F(1.0 / np.sqrt(hd))
    t0 = time.time()
    out = run_prefill(q, k, v, cu, nh, nkv, hd, scale)
    ref = np.zeros((t, nh, hd))
    for s in range(len(lens)):
        a, b = cu[s], cu[s + 1]
        if b > a:
            ref[a:b] = ref_attn(q[a:b].astype(D), k[a:b].astype(D), v[a:b].astype(D), nh, nkv, float(scale))
    cmp(name, "out", out, ref)
    print(f"  ({time.time()-t0:.1f}s)")

def case_decode(name, ctx, nh, nkv, hd, bs=16, seed=1):
    rng = np.random.default_rng(seed)
    seqs = len(ctx)
    need = [(n + bs - 1) // bs for n in ctx]
    pool_blocks = sum(need) + 3
    perm = list(rng.permutation(pool_blocks))
    tables = []
    for s in range(seqs):
        # pad some rows with one extra (unused) block to exercise max_blocks
        tables.append([int(perm.pop()) for _ in range(need[s] + (1 if s == 0 else 0))])
    row = nkv * hd
    kp = rng.standard_normal(pool_blocks * bs * row).astype(np.float32)
    vp = rng.standard_normal(pool_blocks * bs * row).astype(np.float32)
    # current token K/V written through paged_kv_write (slot of position ctx-1)
    slots = [tables[s][(ctx[s] - 1) // bs] * bs + (ctx[s] - 1) % bs for s in range(seqs) if ctx[s] > 0]
    knew = rng.standard_normal((len(slots), row)).astype(np.float32)
    vnew = rng.standard_normal((len(slots), row)).astype(np.float32)
    kpb, vpb = buf("k_pool", kp), buf("v_pool", vp)
    ntot = len(slots) * row
    grid = max(1, min(65535, (ntot + 255) // 256))
    launch("paged_kv_write", grid, 256, K.paged_kv_write, None, kpb, vpb, buf("k", knew), buf("v", vnew),
           buf("slot_mapping", slots, np.uint32), len(slots), row)
    kp2, vp2 = kp.copy(), vp.copy()
    for r, sl in enumerate(slots):
        kp2[sl * row:(sl + 1) * row] = knew[r]; vp2[sl * row:(sl + 1) * row] = vnew[r]
    cmp(name, "paged_kv_write k_pool", kpb.a, kp2.astype(D)); cmp(name, "paged_kv_write v_pool", vpb.a, vp2.astype(D))
    max_blocks = max(1, max(len(t) for t in tables))
    flat = np.zeros(seqs * max_blocks, dtype=np.uint32)
    for s, tb in enumerate(tables): flat[s * max_blocks:s * max_blocks + len(tb)] = tb
    q = rng.standard_normal((seqs, nh, hd)).astype(np.float32)
    scale = F(1.0 / np.sqrt(hd))
    out = out_buf("out", seqs * nh * hd)
    t0 = time.time()
    run_decode(out, q, kpb, vpb, flat, ctx, seqs, nh, nkv, hd, bs, max_blocks, scale)
    ref = np.zeros((seqs, nh, hd))
    kpool = kp2.reshape(pool_blocks, bs, nkv, hd).astype(D); vpool = vp2.reshape(pool_blocks, bs, nkv, hd).astype(D)
    for s in range(seqs):
        n = ctx[s]
        if n == 0: continue
        ks = np.concatenate([kpool[b] for b in tables[s]])[:n]
        vs = np.concatenate([vpool[b] for b in tables[s]])[:n]
        ref[s:s + 1] = ref_attn(q[s:s + 1].astype(D), ks, vs, nh, nkv, float(scale))
    cmp(name, "out", out.a, ref)
    print(f"  ({time.time()-t0:.1f}s)")

def bits(case, name, got, want):
    same = np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    nd = int(np.sum(np.asarray(got, np.float32) != np.asarray(want, np.float32)))
    line = f"{case}: {name}: {'bit-identical' if same else f'{nd} elements differ BUG'}"
    print(line, flush=True); RES.append(line)

def case_paged_prefill(name, spec, nh, nkv, hd, bs=8, seed=3):
    """spec: (past, new) per sequence. The new tokens through
    paged_attention_prefill over a shuffled pool, against the float64
    reference, and bit for bit against the fresh prefill of whole
    sequences and against decode of each new token over its context."""
    rng = np.random.default_rng(seed)
    lens = [p + n for p, n in spec]
    cu_full = [0]
    for n in lens: cu_full.append(cu_full[-1] + n)
    t_full = cu_full[-1]
    q = rng.standard_normal((t_full, nh, hd)).astype(np.float32)
    k = rng.standard_normal((t_full, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((t_full, nkv, hd)).astype(np.float32)
    scale = F(1.0 / np.sqrt(hd))
    row = nkv * hd
    need = [(n + bs - 1) // bs for n in lens]
    pool_blocks = sum(need) + 2
    perm = [int(x) for x in rng.permutation(pool_blocks)]
    tables = [[perm.pop() for _ in range(need[s])] for s in range(len(spec))]
    kp = rng.standard_normal(pool_blocks * bs * row).astype(np.float32)
    vp = rng.standard_normal(pool_blocks * bs * row).astype(np.float32)
    for s, n in enumerate(lens):
        for j in range(n):
            slot = tables[s][j // bs] * bs + j % bs
            kp[slot * row:(slot + 1) * row] = k[cu_full[s] + j].reshape(-1)
            vp[slot * row:(slot + 1) * row] = v[cu_full[s] + j].reshape(-1)
    max_blocks = max(1, max(len(t) for t in tables))
    flat = np.zeros(len(spec) * max_blocks, dtype=np.uint32)
    for s, tb in enumerate(tables): flat[s * max_blocks:s * max_blocks + len(tb)] = tb
    cu_new, new_rows = [0], []
    for s, (past, n) in enumerate(spec):
        cu_new.append(cu_new[-1] + n)
        new_rows += list(range(cu_full[s] + past, cu_full[s] + past + n))
    qn = q[new_rows] if new_rows else np.zeros((0, nh, hd), np.float32)
    t_new = cu_new[-1]
    tiles, blocks = prefill_tiles(cu_new, nh, nkv)
    out = out_buf("out", t_new * nh * hd)
    kpb, vpb = buf("k_pool", kp), buf("v_pool", vp)
    t0 = time.time()
    launch("paged_attention_prefill", blocks, TILE_THREADS, K.paged_attention_prefill,
           attention_prefill_shared(hd), out, buf("q", qn), kpb, vpb, buf("block_tables", flat, np.uint32),
           buf("pasts", [p for p, _ in spec], np.uint32), buf("cu_seqlens", cu_new, np.uint32),
           buf("tiles", tiles, np.uint32), nh, nkv, hd, bs, max_blocks, scale)
    ref = np.zeros((t_new, nh, hd))
    for s, (past, n) in enumerate(spec):
        a = cu_full[s]
        if n:
            full = ref_attn(q[a:a + past + n].astype(D), k[a:a + past + n].astype(D), v[a:a + past + n].astype(D), nh, nkv, float(scale))
            ref[cu_new[s]:cu_new[s + 1]] = full[past:]
    cmp(name, "paged prefill out", out.a, ref)
    # The fresh prefill of the whole sequences: the new rows' bits.
    fresh = run_prefill(q, k, v, cu_full, nh, nkv, hd, scale).reshape(t_full, nh, hd)
    bits(name, "paged prefill == fresh prefill", out.a.reshape(t_new, nh, hd), fresh[new_rows])
    # Decode of each new token over its own context: the same bits.
    ctx, dtables = [], []
    for s, (past, n) in enumerate(spec):
        for i in range(n):
            ctx.append(past + i + 1); dtables.append(tables[s])
    if ctx:
        mb = max(1, max(len(t) for t in dtables))
        dflat = np.zeros(len(ctx) * mb, dtype=np.uint32)
        for r, tb in enumerate(dtables): dflat[r * mb:r * mb + len(tb)] = tb
        dout = out_buf("out", len(ctx) * nh * hd)
        run_decode(dout, qn, kpb, vpb, dflat, ctx, len(ctx), nh, nkv, hd, bs, mb, scale)
        bits(name, "decode == paged prefill", dout.a, out.a)
    print(f"  ({time.time()-t0:.1f}s)")

def ref_backward(q, k, v, do, nh, nkv, scale):
    nq, nk = q.shape[0], k.shape[0]
    grp = nh // nkv
    dq = np.zeros_like(q); dk = np.zeros_like(k); dv = np.zeros_like(v)
    for i in range(nq):
        pos = nk - nq + i
        for h in range(nh):
            g = h // grp
            s = scale * k[:pos + 1, g] @ q[i, h]
            p = np.exp(s - s.max()); p /= p.sum()
            o = p @ v[:pos + 1, g]
            dp = v[:pos + 1, g] @ do[i, h]
            ds = p * (dp - do[i, h] @ o)
            dq[i, h] = scale * ds @ k[:pos + 1, g]
            dk[:pos + 1, g] += scale * np.outer(ds, q[i, h])
            dv[:pos + 1, g] += np.outer(p, do[i, h])
    return dq, dk, dv

def case_backward(name, nq, nk, nh, nkv, hd, seed=2):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((nq, nh, hd)).astype(np.float32)
    k = rng.standard_normal((nk, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((nk, nkv, hd)).astype(np.float32)
    do = rng.standard_normal((nq, nh, hd)).astype(np.float32)
    scale = F(1.0 / np.sqrt(hd))
    # device/backward.rs: attention_backward's launches
    KT, warps, rows = K.ATTN_KEY_TILE, K.ATTN_WARPS * K.ATTN_PAIR_WARPS, K.ATTN_BWD_BLOCK_ROWS
    dq, dk, dv = out_buf("dq", nq * nh * hd), out_buf("dk", nk * nkv * hd), out_buf("dv", nk * nkv * hd)
    lse, dd = out_buf("lse", nq * nh), out_buf("dd", nq * nh)
    bq, bk, bv, bdo = buf("q", q), buf("k", k), buf("v", v), buf("dout", do)
    t0 = time.time()
    if nq > 0:
        floats = max(2 * KT * hd, warps * hd, 3 * warps * K.ATTN_BWD_ROWS)
        launch("attention_backward_dq", -(-nq * (nh // nkv) // rows) * nkv, TILE_THREADS,
               K.attention_backward_dq, lambda: shared("dq.dyn", floats, np.float32),
               dq, lse, dd, bdo, bq, bk, bv, nq, nk, nh, nkv, hd, scale)
    floats = max(2 * KT * (hd + 1), 2 * warps * hd)
    launch("attention_backward_dkv", -(-nk // rows) * nkv, TILE_THREADS, K.attention_backward_dkv,
           lambda: shared("dkv.dyn", floats, np.float32),
           dk, dv, bdo, bq, bk, bv, lse, dd, nq, nk, nh, nkv, hd, scale)
    rq, rk, rv = ref_backward(q.astype(D), k.astype(D), v.astype(D), do.astype(D), nh, nkv, float(scale))
    if nq > 0: cmp(name, "dq", dq.a, rq)
    cmp(name, "dk", dk.a, rk); cmp(name, "dv", dv.a, rv)
    print(f"  ({time.time()-t0:.1f}s)")

def case_kvwrite_stride():
    # the kernel's grid-stride loop with fewer threads than elements (grid 2 of 256)
    rng = np.random.default_rng(5)
    tokens, row, pool_rows = 7, 200, 20
    slots = list(rng.permutation(pool_rows)[:tokens])
    kp = rng.standard_normal(pool_rows * row).astype(np.float32); vp = rng.standard_normal(pool_rows * row).astype(np.float32)
    kn = rng.standard_normal(tokens * row).astype(np.float32); vn = rng.standard_normal(tokens * row).astype(np.float32)
    kb, vb = buf("k_pool", kp), buf("v_pool", vp)
    launch("paged_kv_write", 2, 256, K.paged_kv_write, None, kb, vb, buf("k", kn), buf("v", vn), buf("slot_mapping", slots, np.uint32), tokens, row)
    for r, s in enumerate(slots):
        kp[s*row:(s+1)*row] = kn[r*row:(r+1)*row]; vp[s*row:(s+1)*row] = vn[r*row:(r+1)*row]
    cmp("paged_kv_write grid-stride (grid 2x256, 1400 elems)", "k_pool", kb.a, kp.astype(D))
    cmp("paged_kv_write grid-stride (grid 2x256, 1400 elems)", "v_pool", vb.a, vp.astype(D))

def split(n, case):
    """Runs `case` with splits of n keys (the kernels' ATTN_SPLIT is 512;
    the same code over short contexts)."""
    def run():
        K.ATTN_SPLIT = n
        try: case()
        finally: K.ATTN_SPLIT = 512
    return run

CASES = {
    "prefill40": lambda: case_prefill("prefill hd40 GQA4/2 lens[70,1,0,5]", [70, 1, 0, 5], 4, 2, 40),
    "prefill256": lambda: case_prefill("prefill hd256 GQA4/2 lens[9,1,0,5]", [9, 1, 0, 5], 4, 2, 256),
    "prefill40mha": lambda: case_prefill("prefill hd40 MHA2/2 lens[3,0,4]", [3, 0, 4], 2, 2, 40),
    "decode40": lambda: case_decode("decode hd40 GQA4/2 ctx[1,17,40]", [1, 17, 40], 4, 2, 40),
    "decode256": lambda: case_decode("decode hd256 GQA4/2 ctx[1,17,40,0]", [1, 17, 40, 0], 4, 2, 256),
    "bwd40s": lambda: case_backward("backward hd40 GQA4/2 nq5 nk37", 5, 37, 4, 2, 40),
    "bwd40eq": lambda: case_backward("backward hd40 GQA4/2 nq=nk=20", 20, 20, 4, 2, 40),
    "bwd40big": lambda: case_backward("backward hd40 GQA2/1 nq70 nk70 (>64: 2 tiles each)", 70, 70, 2, 1, 40),
    "bwd256s": lambda: case_backward("backward hd256 GQA4/2 nq5 nk12", 5, 12, 4, 2, 256),
    "bwd256eq": lambda: case_backward("backward hd256 GQA4/2 nq=nk=6", 6, 6, 4, 2, 256),
    "prefill256big": lambda: case_prefill("prefill hd256 GQA4/2 lens[70,1,0,5]", [70, 1, 0, 5], 4, 2, 256),
    "prefill_hd1_g4": lambda: case_prefill("prefill hd1 GQA8/2 lens[5,33]", [5, 33], 8, 2, 1),
    "prefill_hd33_g4": lambda: case_prefill("prefill hd33 GQA8/2 lens[0,6,2]", [0, 6, 2], 8, 2, 33),
    "decode_g4": lambda: case_decode("decode hd72 GQA8/2 ctx[16,33,1,64] bs16", [16, 33, 1, 64], 8, 2, 72),
    "decode_bs5": lambda: case_decode("decode hd40 GQA4/1 ctx[7,11] bs5", [7, 11], 4, 1, 40, bs=5),
    "kvwrite_stride": lambda: case_kvwrite_stride(),
    "bwd256big": lambda: case_backward("backward hd256 GQA4/2 nq5 nk37", 5, 37, 4, 2, 256),
    "bwd256eqbig": lambda: case_backward("backward hd256 GQA4/2 nq=nk=37", 37, 37, 4, 2, 256),
    "bwd_g4_tiles": lambda: case_backward("backward hd33 GQA8/2 nq20 nk70 (dkv total up to 80: 2 tiles)", 20, 70, 8, 2, 33),
    "bwd0": lambda: case_backward("backward hd40 nq0 nk3", 0, 3, 2, 1, 40),
    "paged40": lambda: case_paged_prefill("paged prefill hd40 GQA4/2 (past,new)[(0,5),(20,17),(3,1),(0,0)] bs8",
                                          [(0, 5), (20, 17), (3, 1), (0, 0)], 4, 2, 40),
    "paged40_g4": lambda: case_paged_prefill("paged prefill hd40 GQA8/2 (past,new)[(20,17),(0,5),(3,1),(0,0)] bs5",
                                             [(20, 17), (0, 5), (3, 1), (0, 0)], 8, 2, 40, bs=5),
    "paged33_g4": lambda: case_paged_prefill("paged prefill hd33 GQA8/2 (past,new)[(18,6),(0,3)] bs5",
                                             [(18, 6), (0, 3)], 8, 2, 33, bs=5),
    "paged256": lambda: case_paged_prefill("paged prefill hd256 GQA4/2 (past,new)[(17,3),(2,2)] bs8",
                                           [(17, 3), (2, 2)], 4, 2, 256),
    "paged_mha": lambda: case_paged_prefill("paged prefill hd40 MHA2/2 (past,new)[(33,2)] bs8", [(33, 2)], 2, 2, 40),
    "prefill_g32": lambda: case_prefill("prefill hd8 GQA32/1 lens[3] (a tile per 16 heads)", [3], 32, 1, 8),
    "prefill_g3": lambda: case_prefill("prefill hd24 GQA6/2 lens[7,18] (group 3: a query's heads split across tiles)", [7, 18], 6, 2, 24),
    "paged_g3": lambda: case_paged_prefill("paged prefill hd24 GQA6/2 (past,new)[(5,7),(0,2)] bs5", [(5, 7), (0, 2)], 6, 2, 24, bs=5),
    "paged_g32": lambda: case_paged_prefill("paged prefill hd8 GQA32/1 (past,new)[(4,2)] bs8", [(4, 2)], 32, 1, 8),
    # Group 6: runs of 4 and 2 query heads per decode block (warps of the
    # short run idle).
    "decode_g6": lambda: case_paged_prefill("paged prefill + decode hd24 GQA12/2 (past,new)[(9,4)] bs8",
                                            [(9, 4)], 12, 2, 24),
    # Splits of 16 and 32 keys: contexts of one to five splits, split ends
    # inside and at the end of a sequence's keys.
    "split_decode": split(32, lambda: case_decode("split32 decode hd40 GQA4/2 ctx[1,33,96,0,64,70] bs16",
                                                  [1, 33, 96, 0, 64, 70], 4, 2, 40)),
    "split_prefill": split(16, lambda: case_prefill("split16 prefill hd24 GQA6/2 lens[70,1,0,33]",
                                                    [70, 1, 0, 33], 6, 2, 24)),
    "split_paged": split(32, lambda: case_paged_prefill(
        "split32 paged prefill hd40 GQA4/2 (past,new)[(40,30),(0,70),(64,1),(31,2)] bs8",
        [(40, 30), (0, 70), (64, 1), (31, 2)], 4, 2, 40)),
    "split_paged256": split(16, lambda: case_paged_prefill(
        "split16 paged prefill hd256 GQA4/2 (past,new)[(20,14),(0,3)] bs8", [(20, 14), (0, 3)], 4, 2, 256)),
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES)
    for n in names:
        CASES[n]()
        print(T.report(), flush=True)
        T.issues.clear()
