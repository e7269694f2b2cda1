//! Pointwise activations: SiLU, SiLU-and-multiply (the MLP's
//! `silu(gate) * up`), and the sigmoid output gate of full attention.
//! Their backwards have no parameters and write (`=`) every gradient.

use crate::{Error, Result};

/// `x sigmoid(x)`; the exponential is [`exp_poly`], so loops over it
/// vectorise.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_poly(-x))
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_poly(-x))
}

/// `softplus(x) = log(1 + exp(x))`, with PyTorch's threshold of 20 (linear above).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `e^x` for softmax, SiLU and sigmoid arguments (exact for `x < 88`; larger
/// arguments give `e^88`, which those uses absorb), within about
/// 2 ulp of the true value, written so a loop over it vectorises (libm's
/// `expf` is a scalar call). Range reduction `x = n ln2 + r`, `|r| <= ln2 / 2`,
/// with `n` rounded by the 1.5 * 2^23 trick (whose low mantissa bits are then
/// `n` itself), `ln2` split in two so `r` is exact; `e^r` by its Taylor series
/// to degree 7 (truncation error below 1e-8 relative on that interval); and
/// `2^n` built in the exponent bits. Arguments below -87 flush to 0, where
/// `expf` would return a subnormal or 0 anyway.
#[inline(always)]
pub(crate) fn exp_poly(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = LN2_HI + LN2_LO with LN2_HI exact in few bits, so n * LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let n_int = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        p * scale
    }
}

/// In place `x = silu(x)`.
pub fn silu_forward(x: &mut [f32]) {
    super::widest(|| {
        for v in x.iter_mut() {
            *v = silu(*v);
        }
    })
}

/// `out[n, h] = silu(gate[n, h]) * up[n, h]`: the MLP's activation.
pub fn silu_mul_forward(
    out: &mut [f32],
    gate: &[f32],
    up: &[f32],
    n: usize,
    h: usize,
) -> Result<()> {
    if out.len() != n * h || gate.len() != n * h || up.len() != n * h {
        return Err(Error::Shape(format!(
            "silu_mul: out {} / gate {} / up {} for {n} rows of {h}",
            out.len(),
            gate.len(),
            up.len()
        )));
    }
    super::widest(|| {
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu(*g) * u;
        }
    });
    Ok(())
}

/// In place `x *= sigmoid(gate)`.
pub fn sigmoid_gate_forward(x: &mut [f32], gate: &[f32]) -> Result<()> {
    if x.len() != gate.len() {
        return Err(Error::Shape(format!(
            "sigmoid_gate: x {} vs gate {}",
            x.len(),
            gate.len()
        )));
    }
    super::widest(|| {
        for (v, g) in x.iter_mut().zip(gate) {
            *v *= sigmoid(*g);
        }
    });
    Ok(())
}

/// `silu'(x) = s (1 + x (1 - s))`, `s = sigmoid(x)`.
#[inline]
pub fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// `softplus'(x) = sigmoid(x)`, and exactly 1 above PyTorch's threshold of 20
/// (where the forward is linear).
#[inline]
pub fn softplus_grad(x: f32) -> f32 {
    if x > 20.0 {
        1.0
    } else {
        sigmoid(x)
    }
}

/// Backward of [`silu_forward`] from the pre-activation input:
/// `dinp = dout * silu'(inp)` (written).
pub fn silu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32]) -> Result<()> {
    if dinp.len() != dout.len() || inp.len() != dout.len() {
        return Err(Error::Shape(format!(
            "silu_backward: dinp {} / dout {} / inp {}",
            dinp.len(),
            dout.len(),
            inp.len()
        )));
    }
    for ((d, g), x) in dinp.iter_mut().zip(dout).zip(inp) {
        *d = g * silu_grad(*x);
    }
    Ok(())
}

/// Backward of [`silu_mul_forward`]: `dgate = dout * up * silu'(gate)`,
/// `dup = dout * silu(gate)` (both written).
pub fn silu_mul_backward(
    dgate: &mut [f32],
    dup: &mut [f32],
    dout: &[f32],
    gate: &[f32],
    up: &[f32],
) -> Result<()> {
    let n = dout.len();
    if dgate.len() != n || dup.len() != n || gate.len() != n || up.len() != n {
        return Err(Error::Shape(format!(
            "silu_mul_backward: dgate {} dup {} dout {n} gate {} up {}",
            dgate.len(),
            dup.len(),
            gate.len(),
            up.len()
        )));
    }
    for i in 0..n {
        dgate[i] = dout[i] * up[i] * silu_grad(gate[i]);
        dup[i] = dout[i] * silu(gate[i]);
    }
    Ok(())
}

/// Backward of [`sigmoid_gate_forward`] given `x` before gating:
/// `dx = dout * sigmoid(gate)`, `dgate = dout * x * s (1 - s)` (both written).
pub fn sigmoid_gate_backward(
    dx: &mut [f32],
    dgate: &mut [f32],
    dout: &[f32],
    x: &[f32],
    gate: &[f32],
) -> Result<()> {
    let n = dout.len();
    if dx.len() != n || dgate.len() != n || x.len() != n || gate.len() != n {
        return Err(Error::Shape(format!(
            "sigmoid_gate_backward: dx {} dgate {} dout {n} x {} gate {}",
            dx.len(),
            dgate.len(),
            x.len(),
            gate.len()
        )));
    }
    for i in 0..n {
        let s = sigmoid(gate[i]);
        dx[i] = dout[i] * s;
        dgate[i] = dout[i] * x[i] * s * (1.0 - s);
    }
    Ok(())
}

/// Backward of the Gated DeltaNet gating over `[t, nv]` (`g = -exp(a_log[h])
/// * softplus(a + dt_bias[h])`, `beta = sigmoid(b)`) from the saved `g`,
/// `beta` and pre-activation `a`: `da` and `db` are written; `da_log` and
/// `ddt_bias` accumulate, token by token in order.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_gating_backward(
    da: &mut [f32],
    db: &mut [f32],
    da_log: &mut [f32],
    ddt_bias: &mut [f32],
    dg: &[f32],
    dbeta: &[f32],
    g: &[f32],
    beta: &[f32],
    a: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
) -> Result<()> {
    let (n, nv) = (dg.len(), a_log.len());
    if [
        da.len(),
        db.len(),
        dbeta.len(),
        g.len(),
        beta.len(),
        a.len(),
    ]
    .iter()
    .any(|&l| l != n)
        || [da_log.len(), ddt_bias.len(), dt_bias.len()]
            .iter()
            .any(|&l| l != nv)
        || (nv == 0 && n > 0)
        || (nv > 0 && n % nv != 0)
    {
        return Err(Error::Shape(format!(
            "gated_delta_gating_backward: dg {n} for {nv} heads, da {} db {} dbeta {} g {} beta {} a {} da_log {} ddt_bias {} dt_bias {}",
            da.len(), db.len(), dbeta.len(), g.len(), beta.len(), a.len(), da_log.len(), ddt_bias.len(), dt_bias.len()
        )));
    }
    for i in 0..n {
        let h = i % nv;
        let be = beta[i];
        db[i] = dbeta[i] * be * (1.0 - be);
        da_log[h] += dg[i] * g[i];
        da[i] = dg[i] * -a_log[h].exp() * softplus_grad(a[i] + dt_bias[h]);
        ddt_bias[h] += da[i];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_poly_is_close_to_exp() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -100.0 + i as f32 * (188.0 / 200_000.0);
            let want = (x as f64).exp();
            let got = exp_poly(x) as f64;
            if x < -87.0 {
                assert_eq!(got, 0.0, "{x}");
            } else {
                worst = worst.max((got - want).abs() / want);
            }
        }
        assert!(worst < 4e-7, "max relative error {worst:e}");
        assert_eq!(exp_poly(0.0), 1.0);
    }

    #[test]
    fn silu_mul_and_gate() {
        let mut out = [0.0; 2];
        silu_mul_forward(&mut out, &[1.0, -2.0], &[3.0, 4.0], 1, 2).unwrap();
        assert!((out[0] - 3.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
        assert!((out[1] - 4.0 * -2.0 / (1.0 + 2.0f32.exp())).abs() < 1e-6);
        let mut x = [2.0, 2.0];
        sigmoid_gate_forward(&mut x, &[0.0, 100.0]).unwrap();
        assert_eq!(x, [1.0, 2.0]);
        assert!((softplus(0.0) - 2.0f32.ln()).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
    }

    #[test]
    fn backwards_match_finite_differences() {
        use crate::cpu::gradcheck::{check as fd, dot64, rand_vec, rng};
        let mut r = rng(21);
        let n = 13;
        let mut a = rand_vec(&mut r, n, 4.0);
        let mut b = rand_vec(&mut r, n, 2.0);
        let probe = rand_vec(&mut r, n, 1.0);
        // silu
        let mut d = vec![0.0; n];
        silu_backward(&mut d, &probe, &a).unwrap();
        fd(
            "silu",
            &mut a.clone(),
            &d,
            |x| {
                let mut y = x.to_vec();
                silu_forward(&mut y);
                dot64(&y, &probe)
            },
            1e-2,
            1e-3,
        );
        // silu_mul
        let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
        silu_mul_backward(&mut dg, &mut du, &probe, &a, &b).unwrap();
        let sm = |g: &[f32], u: &[f32]| {
            let mut y = vec![0.0; n];
            silu_mul_forward(&mut y, g, u, 1, n).unwrap();
            dot64(&y, &probe)
        };
        let (a0, b0) = (a.clone(), b.clone());
        fd("silu_mul.gate", &mut a, &dg, |x| sm(x, &b0), 1e-2, 1e-3);
        fd("silu_mul.up", &mut b, &du, |x| sm(&a0, x), 1e-2, 1e-3);
        // sigmoid gate
        let (mut dx, mut dz) = (vec![0.0; n], vec![0.0; n]);
        sigmoid_gate_backward(&mut dx, &mut dz, &probe, &b, &a).unwrap();
        let sg = |x: &[f32], z: &[f32]| {
            let mut y = x.to_vec();
            sigmoid_gate_forward(&mut y, z).unwrap();
            dot64(&y, &probe)
        };
        fd("sigmoid_gate.x", &mut b, &dx, |x| sg(x, &a0), 1e-2, 1e-3);
        fd("sigmoid_gate.gate", &mut a, &dz, |z| sg(&b0, z), 1e-2, 1e-3);
        // softplus
        for x in [-3.0f32, 0.0, 2.5, 19.0, 25.0] {
            let num = (softplus(x + 1e-2) - softplus(x - 1e-2)) / 2e-2;
            assert!((num - softplus_grad(x)).abs() < 1e-3, "{x}");
        }
    }
}
