//! Causal depthwise conv1d over time, as the Gated DeltaNet applies to its
//! q|k|v channels (kernel 4, no bias): `out[t, c] = sum_j w[c, j] * x[t - K + 1 + j, c]`.
//! Positions before the start of the sequence read the carried `state`
//! (the last K-1 inputs of the previous call; zeros for a fresh sequence), and
//! the state is overwritten with the last K-1 inputs of this call, so prefill
//! and token-by-token decode give the same outputs.
//!
//! Output is pre-activation; the model applies SiLU after it. The backward
//! writes `dinp` (and the initial-state gradient) and accumulates `dweight`.

use crate::{Error, Result};

/// `out[t, c]`, `state[K-1, c]` (read then written), `inp[t, c]`, `weight[c, K]`.
pub fn conv1d_forward(
    out: &mut [f32],
    state: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    t: usize,
    c: usize,
    k: usize,
) -> Result<()> {
    if k == 0
        || out.len() != t * c
        || inp.len() != t * c
        || weight.len() != c * k
        || state.len() != (k - 1) * c
    {
        return Err(Error::Shape(format!(
            "conv1d: out {} inp {} weight {} state {} for t={t} c={c} k={k}",
            out.len(),
            inp.len(),
            weight.len(),
            state.len()
        )));
    }
    let hist = k - 1;
    // Row r of the virtual input: r < hist reads the state, else inp[r - hist].
    let row = |r: usize| -> &[f32] {
        if r < hist {
            &state[r * c..(r + 1) * c]
        } else {
            &inp[(r - hist) * c..(r - hist + 1) * c]
        }
    };
    // From the AVX-512 copy where there is one (the same arithmetic).
    super::widest(|| conv_rows(out, &row, weight, t, c, k));
    // New state: the last K-1 rows of [state; inp], shifted in place.
    if t < hist {
        state.copy_within(t * c.., 0);
        state[(hist - t) * c..].copy_from_slice(inp);
    } else {
        state.copy_from_slice(&inp[(t - hist) * c..]);
    }
    Ok(())
}

/// The convolution's output rows; `row(r)` is row `r` of `[state; inp]`.
#[inline(always)]
fn conv_rows<'a>(
    out: &mut [f32],
    row: &impl Fn(usize) -> &'a [f32],
    weight: &[f32],
    t: usize,
    c: usize,
    k: usize,
) {
    for ti in 0..t {
        let o = &mut out[ti * c..(ti + 1) * c];
        if k == 4 {
            // Qwen3.5's kernel width: all four taps of a channel at once, so
            // the loop runs over channels and vectorises (the same sums, in
            // the same order, as the general loop below).
            let (x0, x1, x2, x3) = (row(ti), row(ti + 1), row(ti + 2), row(ti + 3));
            for (ch, (o, w)) in o.iter_mut().zip(weight.chunks_exact(4)).enumerate() {
                *o = (((0.0 + w[0] * x0[ch]) + w[1] * x1[ch]) + w[2] * x2[ch]) + w[3] * x3[ch];
            }
            continue;
        }
        o.fill(0.0);
        for j in 0..k {
            let x = row(ti + j);
            for ch in 0..c {
                o[ch] += weight[ch * k + j] * x[ch];
            }
        }
    }
}

/// Backward of [`conv1d_forward`] for one call that started from `state0`
/// (the state before the forward; zeros for a fresh sequence).
/// `dinp[t, c]` is written (`=`); `dweight[c, K]` accumulates; `dstate0`,
/// when given, is written with the gradient of the initial state.
#[allow(clippy::too_many_arguments)]
pub fn conv1d_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dstate0: Option<&mut [f32]>,
    dout: &[f32],
    state0: &[f32],
    inp: &[f32],
    weight: &[f32],
    t: usize,
    c: usize,
    k: usize,
) -> Result<()> {
    if k == 0
        || dout.len() != t * c
        || dinp.len() != t * c
        || inp.len() != t * c
        || weight.len() != c * k
        || dweight.len() != c * k
        || state0.len() != (k - 1) * c
        || dstate0.as_ref().is_some_and(|d| d.len() != (k - 1) * c)
    {
        return Err(Error::Shape(format!(
            "conv1d_backward: dout {} dinp {} inp {} weight {} dweight {} state0 {} for t={t} c={c} k={k}",
            dout.len(),
            dinp.len(),
            inp.len(),
            weight.len(),
            dweight.len(),
            state0.len()
        )));
    }
    let hist = k - 1;
    // Gradient of the virtual input [state0; inp], rows hist + t.
    let mut dvirt = vec![0.0f32; (hist + t) * c];
    for ti in 0..t {
        let g = &dout[ti * c..(ti + 1) * c];
        for j in 0..k {
            let r = ti + j;
            let x = if r < hist {
                &state0[r * c..(r + 1) * c]
            } else {
                &inp[(r - hist) * c..(r - hist + 1) * c]
            };
            let dx = &mut dvirt[r * c..(r + 1) * c];
            for ch in 0..c {
                dx[ch] += weight[ch * k + j] * g[ch];
                dweight[ch * k + j] += g[ch] * x[ch];
            }
        }
    }
    dinp.copy_from_slice(&dvirt[hist * c..]);
    if let Some(ds) = dstate0 {
        ds.copy_from_slice(&dvirt[..hist * c]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_and_carries_state() {
        let (c, k) = (2, 3);
        let weight = [0.5, -1.0, 2.0, 1.0, 0.25, -0.5];
        let inp: Vec<f32> = (0..10).map(|i| i as f32 * 0.3 - 1.0).collect(); // t=5
        let mut state = vec![0.0; (k - 1) * c];
        let mut full = vec![0.0; 10];
        conv1d_forward(&mut full, &mut state, &inp, &weight, 5, c, k).unwrap();
        // naive
        for t in 0..5 {
            for ch in 0..c {
                let mut s = 0.0;
                for j in 0..k {
                    let src = t as isize - (k as isize - 1) + j as isize;
                    if src >= 0 {
                        s += weight[ch * k + j] * inp[src as usize * c + ch];
                    }
                }
                assert!((full[t * c + ch] - s).abs() < 1e-6);
            }
        }
        let final_state = state.clone();
        // token by token with carried state gives the same
        let mut st = vec![0.0; (k - 1) * c];
        for t in 0..5 {
            let mut o = vec![0.0; c];
            conv1d_forward(&mut o, &mut st, &inp[t * c..(t + 1) * c], &weight, 1, c, k).unwrap();
            assert_eq!(o, full[t * c..(t + 1) * c]);
        }
        assert_eq!(st, final_state);
        assert!(conv1d_forward(&mut full, &mut st, &inp, &weight, 4, c, k).is_err());
    }

    /// The width-4 path gives the general loop's bits, prefill and decode.
    #[test]
    fn width_four_matches_the_general_loop() {
        use crate::cpu::gradcheck::{rand_vec, rng};
        let (t, c, k) = (5, 37, 4);
        let mut r = rng(7);
        let (inp, weight, state0) = (
            rand_vec(&mut r, t * c, 1.0),
            rand_vec(&mut r, c * k, 1.0),
            rand_vec(&mut r, (k - 1) * c, 1.0),
        );
        let mut want = vec![0.0f32; t * c];
        for ti in 0..t {
            for j in 0..k {
                for ch in 0..c {
                    let r = ti + j;
                    let x = if r < k - 1 {
                        state0[r * c + ch]
                    } else {
                        inp[(r - (k - 1)) * c + ch]
                    };
                    want[ti * c + ch] += weight[ch * k + j] * x;
                }
            }
        }
        let mut out = vec![0.0f32; t * c];
        let mut state = state0.clone();
        conv1d_forward(&mut out, &mut state, &inp, &weight, t, c, k).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&out), bits(&want));
        // Token by token from the same state.
        let mut state = state0;
        for ti in 0..t {
            let mut o = vec![0.0f32; c];
            conv1d_forward(
                &mut o,
                &mut state,
                &inp[ti * c..(ti + 1) * c],
                &weight,
                1,
                c,
                k,
            )
            .unwrap();
            assert_eq!(bits(&o), bits(&want[ti * c..(ti + 1) * c]), "token {ti}");
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        use crate::cpu::gradcheck::{check as fd, dot64, rand_vec, rng};
        let mut r = rng(31);
        let (t, c, k) = (6, 3, 4);
        let mut inp = rand_vec(&mut r, t * c, 1.0);
        let mut w = rand_vec(&mut r, c * k, 1.0);
        let mut s0 = rand_vec(&mut r, (k - 1) * c, 1.0);
        let probe = rand_vec(&mut r, t * c, 1.0);
        let (mut di, mut ds) = (vec![7.0; t * c], vec![7.0; (k - 1) * c]);
        let mut dw = vec![0.5; c * k];
        conv1d_backward(
            &mut di,
            &mut dw,
            Some(&mut ds),
            &probe,
            &s0,
            &inp,
            &w,
            t,
            c,
            k,
        )
        .unwrap();
        dw.iter_mut().for_each(|g| *g -= 0.5);
        let loss = |i: &[f32], w: &[f32], s: &[f32]| {
            let mut out = vec![0.0; t * c];
            let mut st = s.to_vec();
            conv1d_forward(&mut out, &mut st, i, w, t, c, k).unwrap();
            dot64(&out, &probe)
        };
        let (i0, w0, s00) = (inp.clone(), w.clone(), s0.clone());
        fd("dinp", &mut inp, &di, |x| loss(x, &w0, &s00), 1e-2, 1e-3);
        fd("dweight", &mut w, &dw, |x| loss(&i0, x, &s00), 1e-2, 1e-3);
        fd("dstate0", &mut s0, &ds, |x| loss(&i0, &w0, x), 1e-2, 1e-3);
    }
}
