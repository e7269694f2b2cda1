"""Plants one bug in a copy of the transcriptions (under mut/NAME/,
git-ignored), runs the check that should catch it, and says what caught
it: the checks that fail (lines ending in BUG), the simt tracker's issues
(races, uninitialised shared reads, barrier or shuffle divergence: every
check script ends with the tracker's report, "no issues" when clean), or
an access out of bounds. Exit status 1 if a bug is not caught.
usage: python plant.py [NAME ...]   (all by default; -l lists)"""
import glob, os, re, shutil, subprocess, sys, time

# name: (file, [(text, text with the bug[, True if a regex])], command).
# Every occurrence of each text is replaced; each must occur.
HOST_SMALL = ["-c", "import host; host.run((2, 4, 20, 12), [0, 70, 71, 71, 100], True)"]
BUGS = {
    # gated_delta.cu, chunked (kernels.py, run by host.py)
    "no_barrier_317": ("kernels.py", [('        yield "cu317"\n', '')], HOST_SMALL),
    "no_barrier_512": ("kernels.py", [('    yield "cu512"\n', '')], HOST_SMALL),
    "transposed_KKE": ("kernels.py", [('r -= bet[l] * Kn[l * GD_CHUNK + i]', 'r -= bet[l] * Kn[i * GD_CHUNK + l]')], HOST_SMALL),
    "solve_skips_next": ("kernels.py", [('for l in range(i + 1, c):  # cu:520', 'for l in range(i + 2, c):  # cu:520')], HOST_SMALL),
    "no_live": ("kernels.py", [('while i < c and live:  # cu:304', 'while i < c:  # cu:304')], HOST_SMALL),
    # gated_delta.cu, sequential backward (sequential.py)
    "seq_no_barrier_748": ("sequential.py", [('            yield "cu748"\n', '')], ["sequential.py", "wide"]),
    "seq_dq_transposed": ("sequential.py", [('a += S[i * dv + j] * sdo[j]  # cu:742', 'a += S[j * dk + i] * sdo[j]  # cu:742')], ["sequential.py", "wide"]),
    "seq_ckpt_one_more": ("sequential.py", [('for c in range(chunks - 1):  # cu:666', 'for c in range(chunks):  # cu:666')], ["sequential.py", "decay"]),
    "seq_dS_no_decay": ("sequential.py", [('dS[i * dv + j] = x * decay  # cu:755', 'dS[i * dv + j] = x  # cu:755')], ["sequential.py", "wide"]),
    "seq_q_not_staged": ("sequential.py", [('                sq[i] = q[(tt * nk + kh) * dk + i]  # cu:714\n', '')], ["sequential.py", "decay"]),
    # attention.cu (attention_kernels.py, run by attention.py)
    "nobarrier_merge": ("attention_kernels.py", [('    yield "cu229"\n', '    if False: yield\n')], ["attention.py", "decode40"]),
    "nobarrier_tile": ("attention_kernels.py", [('        yield "cu354"\n', '')], ["attention.py", "prefill40"]),
    "nobarrier_tile_top": ("attention_kernels.py", [('        yield "cu348"\n', '')], ["attention.py", "prefill40"]),
    "nobarrier_prefill_merge": ("attention_kernels.py", [('            yield "cu367"\n', '')], ["attention.py", "prefill_g3"]),
    "shfl_divergent": ("attention_kernels.py", [('    return (yield from warp_sum(s))  # cu:135\n', '    return (yield from warp_sum(s)) if lane < 16 else s  # cu:88\n')], ["attention.py", "decode40"]),
    "kv_head": ("attention_kernels.py", [('            a = at(j0 + e // hd) + g * hd + e % hd  # cu:350\n', '            a = at(j0 + e // hd) + ((g + 1) % n_kv_heads) * hd + e % hd  # cu:350\n')], ["attention.py", "prefill40"]),
    "dkv_first_query": ("attention_kernels.py", [('    x_begin = (key0 - past if key0 - past > 0 else 0) * group  # cu:623\n', '    x_begin = (key0 - past + 1 if key0 - past + 1 > 0 else 0) * group  # cu:623\n')], ["attention.py", "bwd40s"]),
    "dq_nobarrier": ("attention_kernels.py", [('        yield "cu585"\n', '')], ["attention.py", "bwd40big"]),
    "causal_lt": ("attention_kernels.py", [('                if j0 + jj <= last[r]:  # cu:360\n', '                if j0 + jj < last[r]:  # cu:360\n')], ["attention.py", "prefill40mha"]),
    "split_order": ("attention_kernels.py", [('    for c in range(splits):  # cu:262\n', '    for c in reversed(range(splits)):  # cu:262\n')], ["attention.py", "split_paged"]),
    "split_end": ("attention_kernels.py", [('        if (j0 + ATTN_KEY_TILE) % ATTN_SPLIT != 0 and j0 + ATTN_KEY_TILE < n_keys: continue  # cu:362\n', '        if (j0 + ATTN_KEY_TILE) % (2 * ATTN_SPLIT) != 0 and j0 + ATTN_KEY_TILE < n_keys: continue  # cu:362\n')], ["attention.py", "split_paged"]),
    "split_parity": ("attention_kernels.py", [('                frm = run + (folds & 1) * 2 * ATTN_PAIRS + pi  # cu:375\n', '                frm = run + ((folds + 1) & 1) * 2 * ATTN_PAIRS + pi  # cu:375\n')], ["attention.py", "split_prefill"]),
    "split_nobarrier": ("attention_kernels.py", [('    yield "cu392"\n', '')], ["attention.py", "split_prefill"]),
    "decode_run": ("attention_kernels.py", [('    hg = hc * hb + r\n', '    hg = hc + r\n')], ["attention.py", "decode_g6"]),
    "key_order": ("attention_kernels.py", [('        for jj in range(slot, nt, ATTN_WARPS):  # cu:355\n', '        for jj in reversed(range(slot, nt, ATTN_WARPS)):  # cu:221\n')], ["attention.py", "paged40"]),
    # conv1d.cu (conv1d.py)
    "conv_no_grid_stride": ("conv1d.py", [('        i += gdim * bdim\n', '        break\n')], ["conv1d.py"]),
    "conv_history_le": ("conv1d.py", [('    return st[r * c + ch] if r < hist else x[(r - hist) * c + ch]  # cu:8\n', '    return st[r * c + ch] if r <= hist else x[(r - hist) * c + ch]  # cu:8\n')], ["conv1d.py"]),
    "conv_dweight_sum_barrier": ("prelude.py", [('    yield "p46"\n', '')], ["conv1d.py"]),
    "conv_dinp_tap_bound": ("conv1d.py", [('            if ti >= 0 and ti < t: acc', '            if ti >= 0 and ti <= t: acc')], ["conv1d.py"]),
    # ---- activation.cu, rope.cu, embedding.cu, optim.cu (elementwise.py)
    # every grid-stride step a `break`: a capped grid leaves elements unwritten
    "grid_stride_break": ("elementwise.py",
        [(r"i \+= gdim \* bdim  # (act|emb|opt):\d+", "break", True)],
        ["elementwise.py", "act", "gating", "copy", "bf16", "adamw", "sumsq"]),
    # the rotate-half partner of channel i taken as the interleaved pair (2i, 2i+1)
    "rope_interleaved_pairs": ("elementwise.py",
        [("        a = h[i]; b = h[i + half]  # rope:35\n"
          "        h[i] = F(F(a * c) - F(b * sn))  # rope:36\n"
          "        h[i + half] = F(F(b * c) + F(a * sn))  # rope:37\n",
          "        a = h[2 * i]; b = h[2 * i + 1]  # rope:35\n"
          "        h[2 * i] = F(F(a * c) - F(b * sn))  # rope:36\n"
          "        h[2 * i + 1] = F(F(b * c) + F(a * sn))  # rope:37\n", False)],
        ["elementwise.py", "rope"]),
    # the backward rotating by +angle (the forward's rotation, not its transpose)
    "rope_backward_sign": ("elementwise.py",
        [("dy[i] = F(F(a * c) + F(b * sn))  # rope:65", "dy[i] = F(F(a * c) - F(b * sn))  # rope:65", False),
         ("dy[i + half] = F(F(b * c) - F(a * sn))  # rope:66", "dy[i + half] = F(F(b * c) + F(a * sn))  # rope:66", False)],
        ["elementwise.py", "rope"]),
    # the barrier between the norm's writes and the rotation's reads dropped
    "rope_no_barrier_29": ("elementwise.py", [('    yield "rope29"\n', "", False)], ["elementwise.py", "rope"]),
    # AdamW's second-moment bias correction dropped in the kernel
    "adamw_no_bc2": ("elementwise.py",
        [("denom = F(F(sqrtf(v) / bc2_sqrt) + eps)  # opt:18", "denom = F(sqrtf(v) + eps)  # opt:18", False)],
        ["elementwise.py", "adamw"]),
    # AdamW's first-moment bias correction dropped on the host (AdamWStep)
    "adamw_no_bc1": ("elementwise.py", [("F(lr / bc1)", "F(lr)", False)], ["elementwise.py", "adamw"]),
    # gather_rows reading the next entry's row
    "gather_wrong_row": ("elementwise.py",
        [("out[i] = inp[u(rows[r]) * width + c]  # act:161", "out[i] = inp[u(rows[(r + 1) % n]) * width + c]  # act:161", False)],
        ["elementwise.py", "copy"]),
    # scatter_rows writing to the next entry's row (still distinct rows)
    "scatter_wrong_row": ("elementwise.py",
        [("out[u(rows[r]) * width + c] = inp[i]  # act:187", "out[u(rows[(r + 1) % n]) * width + c] = inp[i]  # act:187", False)],
        ["elementwise.py", "copy"]),
    # the head of element i of [t, nv] taken as i / t
    "gating_head_index": ("elementwise.py", [("h = i % nv  # act:34", "h = i // t  # act:34", False)],
        ["elementwise.py", "gating"]),
    # embedding_backward adding an id's tokens in reverse position order
    "emb_backward_reversed": ("elementwise.py",
        [("for k in range(a, b): acc", "for k in reversed(range(a, b)): acc", False)], ["elementwise.py", "emb"]),
    # the embedding's guard against an id out of range dropped
    "emb_no_guard": ("elementwise.py",
        [("y[i] = table[id_ * c + i] if id_ < vocab else F(0.0)  # emb:12", "y[i] = table[id_ * c + i]  # emb:12", False)],
        ["elementwise.py", "emb"]),
    # block_sum's second barrier dropped (sum_squares_partial's reduction)
    "sumsq_no_barrier": ("prelude.py", [('    yield "p46"\n', "", False)], ["elementwise.py", "sumsq"]),
    # block_sum's first barrier dropped: only two block sums in a row (the
    # param grads) need it
    "param_grad_back_to_back": ("prelude.py", [('    yield "p44"\n', "", False)], ["elementwise.py", "gating", "sumsq"]),
    # f32 -> bf16 rounding ties away from zero instead of to even
    "bf16_ties_away": ("prelude.py",
        [("((u_ + 0x7fff + ((u_ >> 16) & 1)) >> 16)", "((u_ + 0x8000) >> 16)", False)], ["elementwise.py", "bf16", "adamw"]),
    # ---- norm.cu, logsoftmax.cu (rows.py)
    # sample_rows: the barrier between the pieces' sums and thread 0's walk dropped
    "rows_sample_no_barrier_141": ("rows.py", [('    yield "ls141"\n', '')], ["rows.py", "sample"]),
    # block_sum's first barrier dropped: row_logsumexp's block_max then block_sum share scratch
    "rows_lse_no_barrier_p44": ("prelude.py", [('    yield "p44"\n', '')], ["rows.py", "lsm"]),
    # block_sum_f64's second barrier dropped (the entropy's double sum)
    "rows_entropy_no_barrier_179": ("rows.py", [('    yield "ls179"\n', '')], ["rows.py", "entropy"]),
    # the greedy branch reading `pick` before the other threads' atomicMin
    "rows_greedy_no_barrier_122": ("rows.py", [('        yield "ls122"\n', '')], ["rows.py", "sample"]),
    # COLUMN_SUM adding 7 of its 8 row partials
    "rows_colsum_7_partials": ("rows.py", [("for y in range(1, 8): s = F(s + part[y * 33 + tx])  # norm:131",
                                    "for y in range(1, 7): s = F(s + part[y * 33 + tx])  # norm:131")],
                               ["rows.py", "wgrad"]),
    # COLUMN_SUM's row loop one past the end (`<=` for `<`)
    "rows_colsum_row_le": ("rows.py", [("while row < n:  # norm:126", "while row <= n:  # norm:126")], ["rows.py", "wgrad"]),
    # rmsnorm_forward's output loop one past the end
    "rows_rmsnorm_loop_le": ("rows.py", [("    while i < c:  # norm:13\n", "    while i <= c:  # norm:13\n")], ["rows.py", "norm"]),
    # argmax's shuffle reduction keeping the highest index on ties
    "rows_argmax_ties_inverted": ("rows.py", [("(ov == bv and oi < bi): bv = ov; bi = oi  # ls:50",
                                       "(ov == bv and oi > bi): bv = ov; bi = oi  # ls:50")], ["rows.py", "argmax"]),
    # the sampler's fallback: the last index of the last piece, positive probability or not
    "rows_sample_fallback_any": ("rows.py", [("if last[w] >= 0: fallback = int(last[w])  # ls:146",
                                      "fallback = min(w * per + per, vocab) - 1  # ls:146"),
                                     ("if last[w] >= 0: fallback = int(last[w])  # ls:160",
                                      "fallback = min(w * per + per, vocab) - 1  # ls:160")], ["rows.py", "sample"]),
    # the inverse CDF with `<=` (a zero-probability entry can be drawn at u = 0)
    "rows_sample_le": ("rows.py", [("if ur < acc: t = i; break  # ls:151", "if ur <= acc: t = i; break  # ls:151")],
                       ["rows.py", "sample"]),
    # entropy_backward's row offset lost
    "rows_entropy_bwd_row_offset": ("rows.py", [("d = dlogits + r * vocab  # ls:219", "d = dlogits + r  # ls:219")],
                                    ["rows.py", "entropy"]),
    # rmsnorm_backward writing dinp instead of adding to it
    "rows_rmsnorm_bwd_written": ("rows.py", [("dx[i] = F(dx[i] + F(", "dx[i] = F(F(0.0) + F(")], ["rows.py", "norm"]),
    # add_rmsnorm_forward not storing the residual
    "rows_add_rmsnorm_no_store": ("rows.py", [("        r[i] = v  # norm:31\n", "")], ["rows.py", "norm"]),
    # argmax without the CPU's rule for a NaN at index 0
    "rows_argmax_nan0": ("rows.py", [(" or x[0] != x[0] else best_i[0]  # ls:62", " else best_i[0]  # ls:62")],
                         ["rows.py", "argmax"]),
}

def run(name):
    f, reps, cmd = BUGS[name]
    here = os.path.dirname(os.path.abspath(__file__))
    d = os.path.join(here, "mut", name)  # a folder per bug, so that several can run at once
    os.makedirs(d, exist_ok=True)
    for p in glob.glob(os.path.join(here, "*.py")): shutil.copy(p, d)
    src = open(os.path.join(here, f)).read()
    for rep in reps:
        old, new, rx = rep if len(rep) == 3 else (*rep, False)
        n = len(re.findall(old, src)) if rx else src.count(old)
        assert n > 0, f"{name}: {old!r} is not in {f} (the transcription moved)"
        src = re.sub(old, new, src) if rx else src.replace(old, new)
        print(f"# {name}: {f}: {old.strip()!r} -> {new.strip()!r} ({n}x)", flush=True)
    open(os.path.join(d, f), "w").write(src)
    t0 = time.time()
    p = subprocess.run([sys.executable, *cmd], cwd=d, capture_output=True, text=True)
    out = p.stdout.splitlines()
    bugs = [l for l in out if re.search(r"BUG\??$", l.rstrip())]
    clean = any(l.rstrip().endswith("no issues") for l in out)
    bounds = [l for l in p.stderr.splitlines() if "IndexError" in l and "out of [0," in l]
    issues = [] if clean or p.returncode else [l for l in out if re.search(r": \d+ times$", l)]
    for l in bugs[:6]: print("  " + l.strip())
    if len(bugs) > 6: print(f"  ... {len(bugs) - 6} more BUG lines")
    for l in issues[:6]: print("  tracker: " + l.strip())
    for l in bounds[:1]: print("  bounds: " + l.strip())
    if p.returncode and not bounds: print("  crashed:\n" + p.stderr[-1500:])
    caught = bool(bugs or issues or bounds) and (p.returncode == 0 or bool(bounds))
    print(f"  => {name}: {'CAUGHT' if caught else 'NOT CAUGHT'} ({len(bugs)} failing checks, "
          f"{len(issues)} tracker issues{', out of bounds' if bounds else ''}, "
          f"{time.time() - t0:.1f}s)\n", flush=True)
    return caught

if __name__ == "__main__":
    if sys.argv[1:] == ["-l"]:
        print("\n".join(BUGS)); sys.exit(0)
    names = sys.argv[1:] or list(BUGS)
    res = {n: run(n) for n in names}
    print(f"{sum(res.values())} of {len(res)} planted bugs caught" +
          "".join(f"; NOT caught: {n}" for n, c in res.items() if not c))
    sys.exit(0 if all(res.values()) else 1)
