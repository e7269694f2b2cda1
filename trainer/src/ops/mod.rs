//! Backward ops that will move into `arcticd_kernels::cpu` beside their
//! forwards (attention, gated delta rule) once the kernels there settle.
//! Same conventions as the kernels: (outputs, saved, inputs, sizes), f32.

pub mod attention;
pub mod gated_delta;

#[cfg(test)]
pub(crate) mod testutil {
    //! Central-difference gradient checks for the op tests: the scalar is
    //! `sum(out * probe)` in f64, `probe` being the upstream gradient.
    use rand::{rngs::StdRng, Rng};

    pub fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
    }

    /// Every element of `x` perturbed by `eps`; error relative to
    /// `max(1, |numeric|)` must stay within `tol`. Returns the worst error.
    pub fn fd_check(
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
        worst
    }
}
