"""Plants one bug in a copy of attention_kernels.py (under mut/) and runs a case, to show the checks catch it.
usage: python attention_mutate.py NAME"""
import os, shutil, subprocess, sys
M = {
 "nobarrier_merge": ('    yield "cu27"\n', '    if False: yield\n', "prefill40mha"),
 "shfl_divergent": ('    dot = yield from warp_sum(dot)  # cu:60\n', '    if lane < 16: dot = yield from warp_sum(dot)  # cu:60\n', "decode40"),
 "gqa_index": ('    kvh = h // (n_heads // n_kv_heads)\n    warp, warps = tid >> 5, bdim >> 5\n    start', '    kvh = h % n_kv_heads\n    warp, warps = tid >> 5, bdim >> 5\n    start', "prefill40"),
 "dkv_i0": ('    i0 = j - (nk - nq)\n', '    i0 = j - (nk - nq) + 1\n', "bwd40s"),
 "dq_nobarrier2": ('        yield "cu211"\n', '', "bwd40big"),
 "causal_lt": ('    while j <= t:  # cu:131\n', '    while j < t:  # cu:131\n', "prefill40mha"),
}
name = sys.argv[1]
old, new, case = M[name]
os.makedirs("mut", exist_ok=True)
for f in ("simt.py", "simt_warp.py", "attention.py"): shutil.copy(f, "mut/" + f)
src = open("attention_kernels.py").read(); assert old in src, name
open("mut/attention_kernels.py", "w").write(src.replace(old, new, 1))
subprocess.run([sys.executable, "attention.py", case], cwd="mut")
