//! Test-only finite-difference gradient checks shared by the backward tests
//! of every op. The scalar checked is `L = sum(out * probe)` in f64 for a
//! random `probe`, so `probe` is the upstream gradient handed to the backward
//! and every input element is perturbed by central differences.

use rand::{rngs::StdRng, Rng, SeedableRng};

/// Uniform random values in `[-scale, scale)`.
pub fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `sum(a * b)` in f64.
pub fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Compares `analytic[i]` with the central difference of `loss` in `x[i]`
/// for every element; returns the largest error relative to
/// `max(1, |numeric|)`. Panics naming the element when it exceeds `tol`.
pub fn check(
    name: &str,
    x: &mut [f32],
    analytic: &[f32],
    mut loss: impl FnMut(&[f32]) -> f64,
    eps: f32,
    tol: f64,
) -> f64 {
    assert_eq!(x.len(), analytic.len(), "{name}: gradient length");
    let mut worst = 0.0f64;
    for i in 0..x.len() {
        let orig = x[i];
        x[i] = orig + eps;
        let lp = loss(x);
        x[i] = orig - eps;
        let lm = loss(x);
        x[i] = orig;
        let numeric = (lp - lm) / (2.0 * eps as f64);
        let err = (numeric - analytic[i] as f64).abs() / numeric.abs().max(1.0);
        assert!(
            err <= tol,
            "{name}[{i}]: analytic {} vs numeric {numeric} (err {err:.2e})",
            analytic[i]
        );
        worst = worst.max(err);
    }
    println!("{name}: worst finite-difference error {worst:.1e}");
    worst
}
