//! CPU reference kernels. Each op lives in its own file with its backward
//! (when the trainer needs one) beside the forward. Conventions, after llm.c:
//! arguments are (outputs, saved-for-backward, inputs, sizes); activations are
//! row-major `[tokens, channels]`; everything computes in f32. Forwards
//! overwrite their outputs; backwards (as they land) accumulate into
//! parameter gradients and the residual stream and overwrite the rest.

pub mod activation;
pub mod adamw;
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

/// Asks for the cache line holding `p`: a hint, so it never faults, reads
/// nothing the program sees and changes no value (`p` may point anywhere).
#[inline(always)]
pub fn prefetch_line(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and cannot fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// [`prefetch_line`] over `rows` rows of `width` floats, `stride` floats
/// apart, from `p`: for data a coming call will stream from memory.
#[inline(always)]
pub fn prefetch_rows(p: *const f32, rows: usize, stride: usize, width: usize) {
    for r in 0..rows {
        for off in (0..width).step_by(16) {
            prefetch_line(p.wrapping_add(r * stride + off));
        }
    }
}
