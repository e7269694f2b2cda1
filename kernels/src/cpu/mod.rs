//! CPU reference kernels. Each op lives in its own file with its backward
//! (when the trainer needs one) beside the forward. Conventions, after llm.c:
//! arguments are (outputs, saved-for-backward, inputs, sizes); activations are
//! row-major `[tokens, channels]`; everything computes in f32. Forwards
//! overwrite their outputs; backwards (as they land) accumulate into
//! parameter gradients and the residual stream and overwrite the rest.

pub mod activation;
pub mod attention;
pub mod conv1d;
pub mod embedding;
pub mod gated_delta;
#[cfg(test)]
mod gradcheck;
pub mod l2norm;
pub mod logsoftmax;
pub mod matmul;
pub mod rmsnorm;
pub mod rope;
pub mod sgemm;

/// Runs `f` from a copy compiled for AVX-512 where the CPU has it (the crate
/// itself is built for baseline x86-64), so pointwise loops inlined into it
/// run sixteen lanes wide. Only the instructions change, never the order of
/// the arithmetic, so the bits are the same either way.
#[inline(always)]
pub(crate) fn widest<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked just above.
        return unsafe { avx512(f) };
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}
