"""What the check scripts share: the checks' log (RES, say), the buffers
they start from, the comparison against float64 (check), and the run of
named groups of cases (run_groups). A failed check's line ends in BUG;
check.py and plant.py read the logs that way."""
import sys, time
import numpy as np
from simt import T, Buf

RES = []

def buf(name, a, dt=np.float32):
    return Buf(name, np.array(a, dtype=dt).copy())

def nan_buf(name, n):
    return Buf(name, np.full(n, np.nan, np.float32))

def say(line):
    print(line, flush=True); RES.append(line)

def check(case, name, got, ref, tol=1e-6, old=None, floor=0.0, floor_what=None):
    """max |diff| / max |ref| (NaN where ref is NaN required, anywhere else
    a failure); for an output accumulated onto `old` values, over max(|ref|,
    |old|); `floor` bounds the denominator from below (`floor_what` names
    it: |lse| |d ref / d lse| for the log-softmax kernels, the scale of the
    two terms a norm's dinp cancels)."""
    got = np.asarray(got, np.float64).reshape(ref.shape)
    nan = np.isnan(ref)
    den = max(np.max(np.abs(ref[~nan]), initial=0.0), floor, 1e-30)
    if old is not None and ref.size: den = max(den, np.max(np.abs(old)))
    if np.isnan(got[~nan]).any() or not np.isnan(got[nan]).all():
        r = float("nan")
    else:
        r = float(np.max(np.abs(got[~nan] - ref[~nan]), initial=0.0) / den)
    what = "max|diff|/max(|ref|" + (",|old|" if old is not None else "") + \
        (f",{floor_what or f'{floor:g}'}" if floor else "") + ")"
    what = what.replace("max(|ref|)", "max|ref|")
    nn = f", {int(nan.sum())} NaN as required" if nan.any() else ""
    if floor and not np.isnan(r):  # the plain ratio too, for the record
        plain = np.max(np.abs(got[~nan] - ref[~nan]), initial=0.0) / max(np.max(np.abs(ref[~nan]), initial=0.0), 1e-30)
        nn += f"; max|diff|/max|ref| {plain:.1e}"
    say(f"{case}: {name}: {what} = {r:.3e} (tol {tol:g}{nn}) {'ok' if r <= tol else 'BUG'}")

def run_groups(groups, names):
    """Runs the named groups (all by default) and prints the count of
    failed checks and the tracker's report; an access out of bounds ends
    its group as a failed check."""
    t0 = time.time()
    for gname in names or list(groups):
        t1 = time.time()
        try:
            groups[gname]()
        except IndexError as e:  # simt's bounds check
            say(f"{gname}: out of bounds: {e} BUG")
        print(f"  [{gname}: {time.time() - t1:.1f}s]", flush=True)
    bugs = sum(1 for l in RES if l.endswith("BUG"))
    print(f"{len(RES)} checks, {bugs} failed, {time.time() - t0:.1f}s", flush=True)
    print(T.report(), flush=True)
