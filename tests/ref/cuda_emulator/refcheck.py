# Finite-difference check of host.reference (float64) on a tiny case,
# the initial state's gradient (dstate0) included.
import numpy as np
from host import reference, make_inputs
dims = (1, 2, 3, 2); cu = [0, 4, 5, 7]
q, k, v, g, beta, dout, s0 = [x.astype(np.float64) for x in make_inputs(3, dims, cu)]
def loss(q, k, v, g, beta, s0):
    return np.sum(reference(q, k, v, g, beta, dout, s0, cu, dims)[0] * dout)
ds0 = np.zeros_like(s0)
_, _, dq, dk, dv, dg, db = reference(q, k, v, g, beta, dout, s0, cu, dims, dstate0=ds0)
args = [q, k, v, g, beta, s0]; grads = [dq, dk, dv, dg, db, ds0]
for ai, (name, gr) in enumerate(zip("q k v g beta state0".split(), grads)):
    num = np.zeros_like(args[ai]); eps = 1e-6
    for idx in np.ndindex(args[ai].shape):
        a = [x.copy() for x in args]; a[ai][idx] += eps; lp = loss(*a)
        a[ai][idx] -= 2 * eps; lm = loss(*a)
        num[idx] = (lp - lm) / (2 * eps)
    print(name, np.abs(num - gr).max() / np.abs(gr).max())
