"""Extends simt.py with warp shuffles: a thread yields ("shfl", offset, value, label)
at __shfl_xor_sync(0xffffffff, value, offset); the 32 lanes of its warp must all be
at the same shuffle (checked), then each lane gets lane^offset's value.
A plain (non-tuple) yield is __syncthreads()."""
import numpy as np
from simt import T, Buf, shared, F, D

def _iss(kind, other):
    T.issue(kind, Buf("-", np.zeros(1)), None, other)

def launch(name, grid, block, kernel, make_shared, *args):
    T.start_kernel(name)
    for b in range(grid):
        T.block = b
        sh = make_shared() if make_shared else None
        gens = [kernel(b, t, block, grid, sh, *args) for t in range(block)]
        live = [True] * block
        phase = 0
        while True:
            T.start_phase()
            at_bar = {}
            for w in range(0, block, 32):
                lanes = [t for t in range(w, min(w + 32, block)) if live[t]]
                pend = {t: None for t in lanes}
                while pend:
                    shf = {}
                    for t in list(pend):
                        T.tid = t
                        try:
                            y = gens[t].send(pend[t])
                        except StopIteration:
                            live[t] = False
                            del pend[t]
                            continue
                        if isinstance(y, tuple) and y[0] == "shfl":
                            shf[t] = y
                        else:
                            at_bar[t] = y
                            del pend[t]
                    if not shf:
                        break
                    if len(shf) != 32:
                        _iss(f"full-mask shuffle reached by {len(shf)} of 32 lanes (warp {w//32}, phase {phase})", sorted(set(y[3] for y in shf.values())))
                    labs = set((y[1], y[3]) for y in shf.values())
                    if len(labs) > 1:
                        _iss("lanes at different shuffles", sorted(labs))
                    pend = {}
                    for t, y in shf.items():
                        src = w + ((t - w) ^ y[1])
                        if src in shf:
                            pend[t] = shf[src][2]
                        else:
                            pend[t] = F(np.nan)
            if not at_bar:
                break
            if len(at_bar) != block:
                _iss(f"barrier reached by {len(at_bar)} of {block} threads (phase {phase})", sorted(set(at_bar.values())))
            if len(set(at_bar.values())) > 1:
                _iss(f"threads wait at different barriers (phase {phase})", sorted(set(at_bar.values())))
            phase += 1
