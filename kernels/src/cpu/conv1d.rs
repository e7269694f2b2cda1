//! Causal depthwise conv1d over time, as the Gated DeltaNet applies to its
//! q|k|v channels (kernel 4, no bias): `out[t, c] = sum_j w[c, j] * x[t - K + 1 + j, c]`.
//! Positions before the start of the sequence read the carried `state`
//! (the last K-1 inputs of the previous call; zeros for a fresh sequence), and
//! the state is overwritten with the last K-1 inputs of this call, so prefill
//! and token-by-token decode give the same outputs.
//!
//! Output is pre-activation; the model applies SiLU after it.

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
    for ti in 0..t {
        let o = &mut out[ti * c..(ti + 1) * c];
        o.fill(0.0);
        for j in 0..k {
            let x = row(ti + j);
            for ch in 0..c {
                o[ch] += weight[ch * k + j] * x[ch];
            }
        }
    }
    // New state: the last K-1 rows of [state; inp].
    let total = hist + t;
    let mut new_state = vec![0.0f32; hist * c];
    for r in 0..hist {
        new_state[r * c..(r + 1) * c].copy_from_slice(row(total - hist + r));
    }
    state.copy_from_slice(&new_state);
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
}
