"""Plants one bug in a copy of a transcription (under mut/NAME/, git-ignored)
and runs the check that should catch it, to show that the checks can fail.
usage: python plant.py NAME     (python plant.py: the list)"""
import glob, os, shutil, subprocess, sys

# name: (file, the text as it is, the text with the bug (every occurrence is
# changed), the command to run)
HOST_SMALL = ["-c", "import host; host.run((2, 4, 20, 12), [0, 70, 71, 71, 100], True)"]
BUGS = {
    # gated_delta.cu, chunked (kernels.py, run by host.py)
    "no_barrier_317": ("kernels.py", '        yield "cu317"\n', '', HOST_SMALL),
    "no_barrier_512": ("kernels.py", '    yield "cu512"\n', '', HOST_SMALL),
    "transposed_KKE": ("kernels.py", 'r -= bet[l] * Kn[l * GD_CHUNK + i]', 'r -= bet[l] * Kn[i * GD_CHUNK + l]', HOST_SMALL),
    "solve_skips_next": ("kernels.py", 'for l in range(i + 1, c):  # cu:520', 'for l in range(i + 2, c):  # cu:520', HOST_SMALL),
    "no_live": ("kernels.py", 'while i < c and live:  # cu:304', 'while i < c:  # cu:304', HOST_SMALL),
    # attention.cu (attention_kernels.py, run by attention.py)
    "nobarrier_merge": ("attention_kernels.py", '    yield "cu229"\n', '    if False: yield\n', ["attention.py", "decode40"]),
    "nobarrier_tile": ("attention_kernels.py", '        yield "cu354"\n', '', ["attention.py", "prefill40"]),
    "nobarrier_tile_top": ("attention_kernels.py", '        yield "cu348"\n', '', ["attention.py", "prefill40"]),
    "nobarrier_prefill_merge": ("attention_kernels.py", '            yield "cu367"\n', '', ["attention.py", "prefill_g3"]),
    "shfl_divergent": ("attention_kernels.py", '    return (yield from warp_sum(s))  # cu:135\n', '    return (yield from warp_sum(s)) if lane < 16 else s  # cu:88\n', ["attention.py", "decode40"]),
    "kv_head": ("attention_kernels.py", '            a = at(j0 + e // hd) + g * hd + e % hd  # cu:350\n', '            a = at(j0 + e // hd) + ((g + 1) % n_kv_heads) * hd + e % hd  # cu:350\n', ["attention.py", "prefill40"]),
    "dkv_first_query": ("attention_kernels.py", '    x_begin = (key0 - past if key0 - past > 0 else 0) * group  # cu:623\n', '    x_begin = (key0 - past + 1 if key0 - past + 1 > 0 else 0) * group  # cu:623\n', ["attention.py", "bwd40s"]),
    "dq_nobarrier": ("attention_kernels.py", '        yield "cu585"\n', '', ["attention.py", "bwd40big"]),
    "causal_lt": ("attention_kernels.py", '                if j0 + jj <= last[r]:  # cu:360\n', '                if j0 + jj < last[r]:  # cu:360\n', ["attention.py", "prefill40mha"]),
    "split_order": ("attention_kernels.py", '    for c in range(splits):  # cu:262\n', '    for c in reversed(range(splits)):  # cu:262\n', ["attention.py", "split_paged"]),
    "split_end": ("attention_kernels.py", '        if (j0 + ATTN_KEY_TILE) % ATTN_SPLIT != 0 and j0 + ATTN_KEY_TILE < n_keys: continue  # cu:362\n', '        if (j0 + ATTN_KEY_TILE) % (2 * ATTN_SPLIT) != 0 and j0 + ATTN_KEY_TILE < n_keys: continue  # cu:362\n', ["attention.py", "split_paged"]),
    "split_parity": ("attention_kernels.py", '                frm = run + (folds & 1) * 2 * ATTN_PAIRS + pi  # cu:375\n', '                frm = run + ((folds + 1) & 1) * 2 * ATTN_PAIRS + pi  # cu:375\n', ["attention.py", "split_prefill"]),
    "split_nobarrier": ("attention_kernels.py", '    yield "cu392"\n', '', ["attention.py", "split_prefill"]),
    "decode_run": ("attention_kernels.py", '    hg = hc * hb + r\n', '    hg = hc + r\n', ["attention.py", "decode_g6"]),
    "key_order": ("attention_kernels.py", '        for jj in range(slot, nt, ATTN_WARPS):  # cu:355\n', '        for jj in reversed(range(slot, nt, ATTN_WARPS)):  # cu:221\n', ["attention.py", "paged40"]),
    # conv1d.cu (conv1d.py)
    "conv_no_grid_stride": ("conv1d.py", '        i += gdim * bdim\n', '        break\n', ["conv1d.py"]),
    "conv_history_le": ("conv1d.py", '    return st[r * c + ch] if r < hist else x[(r - hist) * c + ch]  # cu:8\n', '    return st[r * c + ch] if r <= hist else x[(r - hist) * c + ch]  # cu:8\n', ["conv1d.py"]),
    "conv_dweight_sum_barrier": ("prelude.py", '    yield "p46"\n', '', ["conv1d.py"]),
    "conv_dinp_tap_bound": ("conv1d.py", '            if ti >= 0 and ti < t: acc', '            if ti >= 0 and ti <= t: acc', ["conv1d.py"]),
}

if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("\n".join(BUGS)); sys.exit(0)
    name = sys.argv[1]
    f, old, new, cmd = BUGS[name]
    here = os.path.dirname(os.path.abspath(__file__))
    d = os.path.join(here, "mut", name)  # a folder per bug, so that several can run at once
    os.makedirs(d, exist_ok=True)
    for p in glob.glob(os.path.join(here, "*.py")): shutil.copy(p, d)
    src = open(os.path.join(here, f)).read()
    assert old in src, f"{name}: the line to change is not in {f} (the transcription moved)"
    open(os.path.join(d, f), "w").write(src.replace(old, new))
    print(f"# {name}: {f}: {old.strip()!r} -> {new.strip()!r}", flush=True)
    subprocess.run([sys.executable, *cmd], cwd=d)
