//! CPU reference kernels. Each op lives in its own file with its backward
//! (when the trainer needs one) beside the forward. Conventions, after llm.c:
//! arguments are (outputs, saved-for-backward, inputs, sizes); activations are
//! row-major `[tokens, channels]`; everything computes in f32.

pub mod gated_delta;
