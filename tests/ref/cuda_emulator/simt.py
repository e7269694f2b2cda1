"""A tiny SIMT emulator: blocks run one after another; within a block every
thread is a Python generator that yields at each __syncthreads(); a phase
(the code between two barriers) runs thread 0..blockDim-1 in order.

Memory is wrapped (Buf / Ptr) so that every access is bounds-checked and,
when tracking is on, checked for
  * two threads of a block writing one location in one phase,
  * a thread reading a location another thread of the block writes in the
    same phase (either order),
  * a read of shared memory never written in this block,
  * two blocks of one launch writing / reading-and-writing one global location.
Issues are keyed by (kernel, kind, buffer) and carry the Python line (with
its `# cu:NNN` tag) of the first few occurrences.
"""
import linecache
import os
import re
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
F = np.float32
D = np.float64


class Tracker:
    def __init__(self):
        self.on = True
        self.issues = {}
        self.kernel = None
        self.block = 0
        self.tid = 0
        self.pw = {}
        self.pr = {}
        self.kw = {}
        self.kr = {}
        self.global_cross = True

    def start_kernel(self, name):
        self.kernel = name
        self.kw = {}
        self.kr = {}

    def start_phase(self):
        self.pw = {}
        self.pr = {}

    def where(self):
        f = sys._getframe(2)
        out = []
        while f is not None and len(out) < 3:
            fn = f.f_code.co_filename
            if not os.path.basename(fn).startswith("simt") and os.path.dirname(os.path.abspath(fn)) == HERE:
                src = linecache.getline(fn, f.f_lineno)
                m = re.search(r"# ([a-z]+):(\d+)", src)
                out.append(f"{f.f_code.co_name}:py{f.f_lineno}" + (f"/{m.group(1)}{m.group(2)}" if m else ""))
            f = f.f_back
        return " <- ".join(out)

    def issue(self, kind, buf, idx, other):
        key = (self.kernel, kind, buf.name)
        ent = self.issues.setdefault(key, [0, []])
        ent[0] += 1
        if len(ent[1]) < 3:
            ent[1].append(
                f"block {self.block} tid {self.tid} idx {idx} other {other} at {self.where()}"
            )

    def report(self):
        if not self.issues:
            return "no issues"
        lines = []
        for (k, kind, name), (n, ex) in self.issues.items():
            lines.append(f"{k}: {kind} on {name}: {n} times")
            for e in ex:
                lines.append("    " + e)
        return "\n".join(lines)


T = Tracker()


class Ptr:
    __slots__ = ("b", "o")

    def __init__(self, b, o):
        self.b = b
        self.o = o

    def __getitem__(self, i):
        return self.b[self.o + i]

    def __setitem__(self, i, v):
        self.b[self.o + i] = v

    def __add__(self, n):
        return Ptr(self.b, self.o + n)


class Buf:
    _ids = 0

    def __init__(self, name, arr, shared=False):
        self.name = name
        self.a = arr.reshape(-1)
        self.n = self.a.size
        self.shared = shared
        Buf._ids += 1
        self.id = Buf._ids
        self.init = {}
        self.epoch = 0

    def __add__(self, n):
        return Ptr(self, n)

    def __getitem__(self, i):
        if i < 0 or i >= self.n:
            raise IndexError(f"{T.kernel}: read {self.name}[{i}] out of [0, {self.n}) at {T.where()}")
        if T.on:
            key = (self.id, i)
            w = T.pw.get(key)
            if w is not None and w != T.tid:
                T.issue("read of a location another thread wrote in this phase", self, i, w)
            r = T.pr.get(key)
            if r is None:
                T.pr[key] = T.tid
            elif r != T.tid:
                T.pr[key] = -1
            if self.shared:
                ep = self.init.get(i)
                if ep is None:
                    T.issue("read of uninitialised shared memory", self, i, None)
                elif ep < self.epoch:
                    T.issue("read of shared memory written in an earlier chunk iteration only", self, i, ep)
            elif T.global_cross:
                kw = T.kw.get(key)
                if kw is not None and kw != T.block:
                    T.issue("cross-block read of a location another block wrote", self, i, kw)
                kr = T.kr.get(key)
                if kr is None:
                    T.kr[key] = T.block
                elif kr != T.block:
                    T.kr[key] = -1
        return self.a[i]

    def __setitem__(self, i, v):
        if i < 0 or i >= self.n:
            raise IndexError(f"{T.kernel}: write {self.name}[{i}] out of [0, {self.n}) at {T.where()}")
        if T.on:
            key = (self.id, i)
            w = T.pw.get(key)
            if w is not None and w != T.tid:
                T.issue("two threads write one location in a phase", self, i, w)
            r = T.pr.get(key)
            if r is not None and r != T.tid:
                T.issue("write of a location another thread read in this phase", self, i, r)
            T.pw[key] = T.tid
            if self.shared:
                self.init[i] = self.epoch
            elif T.global_cross:
                kw = T.kw.get(key)
                if kw is not None and kw != T.block:
                    T.issue("two blocks write one global location", self, i, kw)
                kr = T.kr.get(key)
                if kr is not None and kr != T.block:
                    T.issue("cross-block write of a location another block read", self, i, kr)
                T.kw[key] = T.block
        self.a[i] = v


def shared(name, n, dtype):
    return Buf(name, np.full(n, np.nan, dtype=dtype), shared=True)


def launch(name, grid, block, kernel, make_shared, *args):
    """Run kernel(bx, tid, bdim, gdim, sh, *args) (a generator per thread)."""
    T.start_kernel(name)
    for b in range(grid):
        T.block = b
        sh = make_shared() if make_shared else None
        gens = [kernel(b, t, block, grid, sh, *args) for t in range(block)]
        live = [True] * block
        phase = 0
        while True:
            T.start_phase()
            labels = {}
            for t in range(block):
                if not live[t]:
                    continue
                T.tid = t
                try:
                    labels[t] = next(gens[t])
                except StopIteration:
                    live[t] = False
            if not labels:
                break
            if len(labels) != block:
                T.issue(
                    f"barrier reached by {len(labels)} of {block} threads (phase {phase})",
                    Buf("-", np.zeros(1)),
                    None,
                    sorted(set(labels.values())),
                )
            if len(set(labels.values())) > 1:
                T.issue(
                    f"threads wait at different barriers (phase {phase})",
                    Buf("-", np.zeros(1)),
                    None,
                    sorted(set(labels.values())),
                )
            phase += 1


def new_epoch(tid, bufs):
    """At the top of a per-chunk loop (thread 0 runs first in the phase):
    later reads of shared entries not rewritten since are flagged."""
    if tid == 0:
        for b in bufs:
            b.epoch += 1
