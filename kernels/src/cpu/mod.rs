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
