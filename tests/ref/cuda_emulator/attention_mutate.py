"""Plants one bug in a copy of attention_kernels.py (under mut/) and runs a case, to show the checks catch it.
usage: python attention_mutate.py NAME"""
import os, shutil, subprocess, sys
M = {
 "nobarrier_merge": ('    yield "cu156"\n', '    if False: yield\n', "decode40"),
 "nobarrier_tile": ('        yield "cu220"\n', '', "prefill40"),
 "nobarrier_tile_top": ('        yield "cu214"\n', '', "prefill40"),
 "nobarrier_prefill_merge": ('        yield "cu234"\n', '', "prefill_g3"),
 "shfl_divergent": ('    return (yield from warp_sum(s))  # cu:88\n', '    return (yield from warp_sum(s)) if lane < 16 else s  # cu:88\n', "decode40"),
 "kv_head": ('            a = at(j0 + e // hd) + g * hd + e % hd  # cu:216\n', '            a = at(j0 + e // hd) + ((g + 1) % n_kv_heads) * hd + e % hd  # cu:216\n', "prefill40"),
 "dkv_first_query": ('    x_begin = (key0 - past if key0 - past > 0 else 0) * group  # cu:466\n', '    x_begin = (key0 - past + 1 if key0 - past + 1 > 0 else 0) * group  # cu:466\n', "bwd40s"),
 "dq_nobarrier": ('        yield "cu428"\n', '', "bwd40big"),
 "causal_lt": ('                if j0 + jj <= last[r]:  # cu:226\n', '                if j0 + jj < last[r]:  # cu:226\n', "prefill40mha"),
 "split_order": ('    for c in range(splits):  # cu:245\n', '    for c in reversed(range(splits)):  # cu:245\n', "split_paged"),
 "split_end": ('        if (j0 + ATTN_KEY_TILE) % ATTN_SPLIT != 0 and j0 + ATTN_KEY_TILE < n_keys: continue  # cu:342\n', '        if (j0 + ATTN_KEY_TILE) % (2 * ATTN_SPLIT) != 0 and j0 + ATTN_KEY_TILE < n_keys: continue  # cu:342\n', "split_paged"),
 "split_parity": ('                frm = run + (folds & 1) * 2 * ATTN_PAIRS + pi  # cu:355\n', '                frm = run + ((folds + 1) & 1) * 2 * ATTN_PAIRS + pi  # cu:355\n', "split_prefill"),
 "split_nobarrier": ('    yield "cu372"\n', '', "split_prefill"),
 "decode_run": ('    hg = hc * hb + r\n', '    hg = hc + r\n', "decode_g6"),
 "key_order": ('        for jj in range(slot, nt, ATTN_WARPS):  # cu:221\n', '        for jj in reversed(range(slot, nt, ATTN_WARPS)):  # cu:221\n', "paged40"),
}
name = sys.argv[1]
old, new, case = M[name]
d = os.path.join("mut", name)  # one folder per bug, so that several can run at once
os.makedirs(d, exist_ok=True)
for f in ("simt.py", "simt_warp.py", "attention.py"): shutil.copy(f, os.path.join(d, f))
src = open("attention_kernels.py").read(); assert old in src, name
open(os.path.join(d, "attention_kernels.py"), "w").write(src.replace(old, new, 1))
subprocess.run([sys.executable, "attention.py", case], cwd=d)
