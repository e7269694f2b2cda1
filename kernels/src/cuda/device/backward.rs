//! The backward ops and the optimizer step on the device, each beside its
//! CPU reference's name and argument order (outputs, saved, inputs, sizes)
//! and with its accumulate-or-write contract: parameter gradients
//! accumulate, input gradients are written unless the reference adds into
//! the residual stream. Reductions over rows or tokens (weight gradients,
//! the embedding's repeated ids) are taken in a fixed order, never by
//! atomics, so a step is deterministic on one device.
//!
//! The GPU tests at the bottom compare each op with its CPU reference at
//! odd shapes, like the forwards'.

use super::{
    chunk_launch, elems, int, rows, shape, ChunkPlan, CudaDevice, ATTN_BWD_ROWS, ATTN_KEY_TILE,
    ATTN_PAIR_WARPS, ATTN_WARPS, GD_CHUNK, GD_COLS, NULL,
};
use crate::cpu::adamw::AdamWStep;
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Threads per block of the per-channel and per-head reductions.
const REDUCE_THREADS: u32 = 256;

/// Column sums over rows: 32 columns per block, 8 row lanes.
pub(super) fn columns(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(32) as u32, 1, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `REDUCE_THREADS` per item.
pub(super) fn per_item(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (REDUCE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The recurrent gated-delta backward: a block per value head, a thread
/// per row of the wider side of its state, q, k and three value rows
/// staged in shared memory.
pub(super) fn recurrent_backward_launch(nv: usize, kd: usize, vd: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (nv as u32, 1, 1),
        block_dim: (kd.max(vd).next_multiple_of(32).min(1024) as u32, 1, 1),
        shared_mem_bytes: ((2 * kd + 3 * vd) * 4) as u32,
    }
}

/// Attention's backward blocks, tiled as the prefill (attention.cu): the
/// warps of `ATTN_PAIR_WARPS` slots, and the shared memory of the key
/// tiles or of the warps' rows, whichever is larger.
fn attention_backward_launch(blocks: usize, floats: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: ((ATTN_WARPS * ATTN_PAIR_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: (floats * 4) as u32,
    }
}

/// dq's blocks: key tiles, each warp's `hd` floats, or its rows' three
/// running values.
pub(super) fn attention_dq_launch(blocks: usize, hd: usize) -> LaunchConfig {
    let warps = ATTN_WARPS * ATTN_PAIR_WARPS;
    let floats = (2 * ATTN_KEY_TILE * hd)
        .max(warps * hd)
        .max(3 * warps * ATTN_BWD_ROWS);
    attention_backward_launch(blocks, floats)
}

/// dk/dv's blocks: key tiles with a column of padding, or each warp's two
/// rows of `hd`.
pub(super) fn attention_dkv_launch(blocks: usize, hd: usize) -> LaunchConfig {
    let warps = ATTN_WARPS * ATTN_PAIR_WARPS;
    attention_backward_launch(blocks, (2 * ATTN_KEY_TILE * (hd + 1)).max(2 * warps * hd))
}

impl CudaDevice {
    /// Backward of [`Self::rmsnorm_forward`] from the saved `rstd`: `dinp`
    /// and `dweight` accumulate (as `cpu::rmsnorm::rmsnorm_backward`).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(
        &self,
        dinp: &mut CudaSlice<f32>,
        dweight: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        let op = "rmsnorm_backward";
        shape(
            op,
            &[
                ("dinp", dinp.len(), n * c),
                ("dweight", dweight.len(), c),
                ("dout", dout.len(), n * c),
                ("inp", inp.len(), n * c),
                ("weight", weight.len(), c),
                ("rstd", rstd.len(), n),
            ],
        )?;
        if n == 0 || c == 0 {
            return Ok(());
        }
        let (ni, ci) = (int(op, "n", n)?, int(op, "c", c)?);
        launch!(self, "rmsnorm_backward", rows(n); dinp, dout, inp, weight, rstd, &ni, &ci);
        launch!(self, "rmsnorm_weight_grad", columns(c); dweight, dout, inp, rstd, &ni, &ci);
        Ok(())
    }

    /// Backward of [`Self::gated_rmsnorm_forward`]: `dinp` and `dgate`
    /// written, `dweight` accumulates.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_rmsnorm_backward(
        &self,
        dinp: &mut CudaSlice<f32>,
        dgate: &mut CudaSlice<f32>,
        dweight: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        let op = "gated_rmsnorm_backward";
        shape(
            op,
            &[
                ("dinp", dinp.len(), n * c),
                ("dgate", dgate.len(), n * c),
                ("dweight", dweight.len(), c),
                ("dout", dout.len(), n * c),
                ("inp", inp.len(), n * c),
                ("gate", gate.len(), n * c),
                ("weight", weight.len(), c),
                ("rstd", rstd.len(), n),
            ],
        )?;
        if n == 0 || c == 0 {
            return Ok(());
        }
        let (ni, ci) = (int(op, "n", n)?, int(op, "c", c)?);
        launch!(self, "gated_rmsnorm_backward", rows(n); dinp, dgate, dout, inp, gate, weight, rstd, &ni, &ci);
        launch!(self, "gated_rmsnorm_weight_grad", columns(c); dweight, dout, inp, gate, rstd, &ni, &ci);
        Ok(())
    }

    /// Backward of [`Self::l2norm_forward`] (at scale 1) from the saved
    /// `rnorm`: `dinp` written.
    pub fn l2norm_backward(
        &self,
        dinp: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        rnorm: &CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> Result<()> {
        let op = "l2norm_backward";
        shape(
            op,
            &[
                ("dinp", dinp.len(), n * d),
                ("dout", dout.len(), n * d),
                ("inp", inp.len(), n * d),
                ("rnorm", rnorm.len(), n),
            ],
        )?;
        if n == 0 || d == 0 {
            return Ok(());
        }
        let (ni, di) = (int(op, "n", n)?, int(op, "d", d)?);
        launch!(self, "l2norm_backward", rows(n); dinp, dout, inp, rnorm, &ni, &di);
        Ok(())
    }

    /// `dinp = dout * silu'(inp)`, written.
    pub fn silu_backward(
        &self,
        dinp: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        inp: &CudaSlice<f32>,
    ) -> Result<()> {
        let n = dinp.len();
        shape(
            "silu_backward",
            &[("dout", dout.len(), n), ("inp", inp.len(), n)],
        )?;
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        launch!(self, "silu_backward", elems(n); dinp, dout, inp, &nl);
        Ok(())
    }

    /// `dgate = dout * up * silu'(gate)`, `dup = dout * silu(gate)`, written.
    pub fn silu_mul_backward(
        &self,
        dgate: &mut CudaSlice<f32>,
        dup: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
    ) -> Result<()> {
        let n = dout.len();
        shape(
            "silu_mul_backward",
            &[
                ("dgate", dgate.len(), n),
                ("dup", dup.len(), n),
                ("gate", gate.len(), n),
                ("up", up.len(), n),
            ],
        )?;
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        launch!(self, "silu_mul_backward", elems(n); dgate, dup, dout, gate, up, &nl);
        Ok(())
    }

    /// `dx = dout * sigmoid(gate)`, `dgate = dout * x * s (1 - s)`, written
    /// (`x` before gating).
    pub fn sigmoid_gate_backward(
        &self,
        dx: &mut CudaSlice<f32>,
        dgate: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
    ) -> Result<()> {
        let n = dout.len();
        shape(
            "sigmoid_gate_backward",
            &[
                ("dx", dx.len(), n),
                ("dgate", dgate.len(), n),
                ("x", x.len(), n),
                ("gate", gate.len(), n),
            ],
        )?;
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        launch!(self, "sigmoid_gate_backward", elems(n); dx, dgate, dout, x, gate, &nl);
        Ok(())
    }

    /// Backward of [`Self::gated_delta_gating_forward`] from the saved `g`,
    /// `beta` and `a`: `da`, `db` written, `da_log`, `ddt_bias` accumulate
    /// (as `cpu::activation::gated_delta_gating_backward`).
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_gating_backward(
        &self,
        da: &mut CudaSlice<f32>,
        db: &mut CudaSlice<f32>,
        da_log: &mut CudaSlice<f32>,
        ddt_bias: &mut CudaSlice<f32>,
        dg: &CudaSlice<f32>,
        dbeta: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        a: &CudaSlice<f32>,
        a_log: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
    ) -> Result<()> {
        let op = "gated_delta_gating_backward";
        let (n, nv) = (dg.len(), a_log.len());
        if nv == 0 || !n.is_multiple_of(nv) {
            return Err(Error::Shape(format!(
                "{op}: {n} values are not rows of {nv} heads"
            )));
        }
        shape(
            op,
            &[
                ("da", da.len(), n),
                ("db", db.len(), n),
                ("dbeta", dbeta.len(), n),
                ("g", g.len(), n),
                ("beta", beta.len(), n),
                ("a", a.len(), n),
                ("da_log", da_log.len(), nv),
                ("ddt_bias", ddt_bias.len(), nv),
                ("dt_bias", dt_bias.len(), nv),
            ],
        )?;
        if n == 0 {
            return Ok(());
        }
        let (ti, hi) = (int(op, "t", n / nv)?, int(op, "nv", nv)?);
        launch!(self, op, elems(n); &mut *da, db, dg, dbeta, beta, a, a_log, dt_bias, &ti, &hi);
        launch!(self, "gated_delta_gating_param_grad", per_item(nv); da_log, ddt_bias, dg, g, &*da, &ti, &hi);
        Ok(())
    }

    /// Backward of [`Self::embedding_forward`]: `dtable[ids[t]] += dout[t]`
    /// (accumulates). Each id's tokens are added in position order, as on
    /// the CPU, so repeated ids sum the same way every time.
    pub fn embedding_backward(
        &self,
        dtable: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        ids: &[u32],
        vocab: usize,
        c: usize,
    ) -> Result<()> {
        let op = "embedding_backward";
        let n = ids.len();
        shape(
            op,
            &[
                ("dout", dout.len(), n * c),
                ("dtable", dtable.len(), vocab * c),
            ],
        )?;
        if let Some((t, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(Error::Index(format!(
                "token id {id} at position {t} is not below the vocabulary size {vocab}"
            )));
        }
        if n == 0 || c == 0 {
            return Ok(());
        }
        let (sorted, starts, order) = segments(ids);
        let distinct = sorted.len();
        let (ds, dst, dord) = (
            self.upload(&sorted)?,
            self.upload(&starts)?,
            self.upload(&order)?,
        );
        let (ui, ci) = (int(op, "distinct", distinct)?, int(op, "c", c)?);
        launch!(self, op, rows(distinct); dtable, dout, &ds, &dst, &dord, &ui, &ci);
        Ok(())
    }

    /// Backward of [`Self::qk_norm_rope_forward`] on `x[tokens, heads,
    /// head_dim]`: from `dout`, the gradient of the rotated output, and the
    /// saved pre-norm `inp` and `rstd`, `dinp` is written and `dweight`
    /// accumulates (as `cpu::rope::rope_backward` then
    /// `cpu::rmsnorm::rmsnorm_backward`). head_dim at most 512.
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope_backward(
        &self,
        dinp: &mut CudaSlice<f32>,
        dweight: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        positions: &CudaSlice<u32>,
        heads: usize,
        head_dim: usize,
        rot_dim: usize,
        theta: f32,
    ) -> Result<()> {
        let op = "qk_norm_rope_backward";
        let n = positions.len();
        let rows_n = n * heads;
        if head_dim > 512 || rot_dim > head_dim || !rot_dim.is_multiple_of(2) {
            return Err(Error::Shape(format!(
                "{op}: head_dim {head_dim} (at most 512), rot_dim {rot_dim} (even, at most head_dim)"
            )));
        }
        shape(
            op,
            &[
                ("dinp", dinp.len(), rows_n * head_dim),
                ("dweight", dweight.len(), head_dim),
                ("dout", dout.len(), rows_n * head_dim),
                ("inp", inp.len(), rows_n * head_dim),
                ("weight", weight.len(), head_dim),
                ("rstd", rstd.len(), rows_n),
            ],
        )?;
        if rows_n == 0 || head_dim == 0 {
            return Ok(());
        }
        let mut dnormed = self.zeros::<f32>(rows_n * head_dim)?;
        let ints = [n, heads, head_dim, rot_dim]
            .iter()
            .map(|&v| int(op, "size", v))
            .collect::<Result<Vec<i32>>>()?;
        launch!(self, op, rows(rows_n); dinp, &mut dnormed, dout, inp, weight, rstd, positions,
            &ints[0], &ints[1], &ints[2], &ints[3], &theta);
        let (ri, hi) = (int(op, "rows", rows_n)?, ints[2]);
        launch!(self, "rmsnorm_weight_grad", columns(head_dim); dweight, &dnormed, inp, rstd, &ri, &hi);
        Ok(())
    }

    /// Backward of [`Self::logprob_gather_forward`]: `dlogits[r] = dlp[r] *
    /// inv_temp * (onehot(targets[r]) - softmax(logits[r] * inv_temp))`,
    /// written; the softmax is recomputed.
    pub fn logprob_gather_backward(
        &self,
        dlogits: &mut CudaSlice<f32>,
        dlp: &CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        targets: &CudaSlice<u32>,
        vocab: usize,
        inv_temp: f32,
    ) -> Result<()> {
        let op = "logprob_gather_backward";
        let n = targets.len();
        shape(
            op,
            &[
                ("dlogits", dlogits.len(), n * vocab),
                ("dlp", dlp.len(), n),
                ("logits", logits.len(), n * vocab),
            ],
        )?;
        if n == 0 || vocab == 0 {
            return Ok(());
        }
        let (ni, vi) = (int(op, "rows", n)?, int(op, "vocab", vocab)?);
        launch!(self, op, rows(n); dlogits, dlp, logits, targets, &ni, &vi, &inv_temp);
        Ok(())
    }

    /// `out[r]`: the entropy of `softmax(logits[r] * inv_temp)`, sums in
    /// f64 (as `cpu::logsoftmax::entropy_forward` on the scaled logits).
    pub fn entropy_forward(
        &self,
        out: &mut CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        vocab: usize,
        inv_temp: f32,
    ) -> Result<()> {
        let op = "entropy_forward";
        let n = out.len();
        shape(op, &[("logits", logits.len(), n * vocab)])?;
        if n == 0 || vocab == 0 {
            return Ok(());
        }
        let (ni, vi) = (int(op, "rows", n)?, int(op, "vocab", vocab)?);
        launch!(self, op, rows(n); out, logits, &ni, &vi, &inv_temp);
        Ok(())
    }

    /// Backward of [`Self::entropy_forward`] for `dent` per row,
    /// accumulated (`+=`) onto `dlogits` (after
    /// [`Self::logprob_gather_backward`]), the chain rule's `inv_temp`
    /// included.
    pub fn entropy_backward(
        &self,
        dlogits: &mut CudaSlice<f32>,
        dent: &CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        vocab: usize,
        inv_temp: f32,
    ) -> Result<()> {
        let op = "entropy_backward";
        let n = dent.len();
        shape(
            op,
            &[
                ("dlogits", dlogits.len(), n * vocab),
                ("logits", logits.len(), n * vocab),
            ],
        )?;
        if n == 0 || vocab == 0 {
            return Ok(());
        }
        let (ni, vi) = (int(op, "rows", n)?, int(op, "vocab", vocab)?);
        launch!(self, op, rows(n); dlogits, dent, logits, &ni, &vi, &inv_temp);
        Ok(())
    }

    /// The causal conv over one sequence of `t` tokens from `state[k - 1,
    /// c]` (read, then advanced to the last `k - 1` inputs):
    /// `out, inp [t, c]`, `weight[c, k]`, pre-activation (as
    /// `cpu::conv1d::conv1d_forward`). `k` at most 8.
    #[allow(clippy::too_many_arguments)]
    pub fn conv1d_forward(
        &self,
        out: &mut CudaSlice<f32>,
        state: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        t: usize,
        c: usize,
        k: usize,
    ) -> Result<()> {
        let op = "conv1d_forward";
        if k == 0 || k > 8 {
            return Err(Error::Shape(format!("{op}: kernel width {k} (1 to 8)")));
        }
        shape(
            op,
            &[
                ("out", out.len(), t * c),
                ("state", state.len(), (k - 1) * c),
                ("inp", inp.len(), t * c),
                ("weight", weight.len(), c * k),
            ],
        )?;
        if t == 0 || c == 0 {
            return Ok(());
        }
        let (ti, ci, ki) = (int(op, "t", t)?, int(op, "c", c)?, int(op, "k", k)?);
        launch!(self, op, elems(t * c); out, &*state, inp, weight, &ti, &ci, &ki);
        launch!(self, "conv1d_state_advance", elems(c); state, inp, &ti, &ci, &ki);
        Ok(())
    }

    /// Backward of [`Self::conv1d_forward`] for a call that started from
    /// `state0`: `dinp` written, `dweight` accumulates, `dstate0` (when
    /// given) written (as `cpu::conv1d::conv1d_backward`).
    #[allow(clippy::too_many_arguments)]
    pub fn conv1d_backward(
        &self,
        dinp: &mut CudaSlice<f32>,
        dweight: &mut CudaSlice<f32>,
        dstate0: Option<&mut CudaSlice<f32>>,
        dout: &CudaSlice<f32>,
        state0: &CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        t: usize,
        c: usize,
        k: usize,
    ) -> Result<()> {
        let op = "conv1d_backward";
        if k == 0 {
            return Err(Error::Shape(format!("{op}: kernel width 0")));
        }
        shape(
            op,
            &[
                ("dinp", dinp.len(), t * c),
                ("dweight", dweight.len(), c * k),
                ("dout", dout.len(), t * c),
                ("state0", state0.len(), (k - 1) * c),
                ("inp", inp.len(), t * c),
                ("weight", weight.len(), c * k),
            ],
        )?;
        if let Some(ds) = &dstate0 {
            shape(op, &[("dstate0", ds.len(), (k - 1) * c)])?;
        }
        if c == 0 {
            return Ok(());
        }
        let (ti, ci, ki) = (int(op, "t", t)?, int(op, "c", c)?, int(op, "k", k)?);
        let virt = (t + k - 1) * c;
        match dstate0 {
            Some(ds) => {
                launch!(self, "conv1d_backward_input", elems(virt); dinp, ds, dout, weight, &ti, &ci, &ki)
            }
            None => {
                launch!(self, "conv1d_backward_input", elems(virt); dinp, &NULL, dout, weight, &ti, &ci, &ki)
            }
        }
        if t > 0 {
            launch!(self, "conv1d_backward_weight", per_item(c); dweight, dout, state0, inp, &ti, &ci, &ki);
        }
        Ok(())
    }

    /// Backward of the gated delta rule over one sequence of `t` tokens
    /// that started from `state0 [nv, dk, dv]` (as
    /// `cpu::gated_delta::gated_delta_backward`, the recurrent form by
    /// re-computation from states kept every 64 tokens): every gradient is
    /// written; `dq`, `dk [t, nk, dk]` sum the value heads of a key head.
    /// Layouts as the forward's. One block per value head walks every
    /// token: the baseline of [`Self::gated_delta_chunked_backward`],
    /// which the trainer uses.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_backward(
        &self,
        dq: &mut CudaSlice<f32>,
        dk: &mut CudaSlice<f32>,
        dv: &mut CudaSlice<f32>,
        dg: &mut CudaSlice<f32>,
        dbeta: &mut CudaSlice<f32>,
        dstate0: Option<&mut CudaSlice<f32>>,
        dout: &CudaSlice<f32>,
        state0: &CudaSlice<f32>,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        dims: crate::cpu::gated_delta::GatedDeltaDims,
    ) -> Result<()> {
        let op = "gated_delta_backward";
        let crate::cpu::gated_delta::GatedDeltaDims {
            t,
            nk,
            nv,
            dk: kd,
            dv: vd,
        } = dims;
        if nk == 0 || !nv.is_multiple_of(nk) || kd == 0 || vd == 0 {
            return Err(Error::Shape(format!("{op}: {dims:?}")));
        }
        let sn = kd * vd;
        shape(
            op,
            &[
                ("dq", dq.len(), t * nk * kd),
                ("dk", dk.len(), t * nk * kd),
                ("dv", dv.len(), t * nv * vd),
                ("dg", dg.len(), t * nv),
                ("dbeta", dbeta.len(), t * nv),
                ("dout", dout.len(), t * nv * vd),
                ("state0", state0.len(), nv * sn),
                ("q", q.len(), t * nk * kd),
                ("k", k.len(), t * nk * kd),
                ("v", v.len(), t * nv * vd),
                ("g", g.len(), t * nv),
                ("beta", beta.len(), t * nv),
            ],
        )?;
        if let Some(ds) = &dstate0 {
            shape(op, &[("dstate0", ds.len(), nv * sn)])?;
        }
        if t == 0 {
            // Zeroed, not scaled by 0: a NaN or Inf already in the buffer
            // would survive `x * 0` (the CPU writes zeros).
            if let Some(ds) = dstate0 {
                self.stream.memset_zeros(ds)?;
            }
            return Ok(());
        }
        const CHUNK: usize = 64;
        let chunks = t.div_ceil(CHUNK);
        let mut ckpt = self.zeros::<f32>(nv * chunks * sn)?;
        let mut st = self.zeros::<f32>(nv * (CHUNK + 1) * sn)?;
        let mut ds_all = self.zeros::<f32>(nv * sn)?;
        let mut res = self.zeros::<f32>(nv * CHUNK * vd)?;
        let mut dq_v = self.zeros::<f32>(t * nv * kd)?;
        let mut dk_v = self.zeros::<f32>(t * nv * kd)?;
        let ints = [t, nk, nv, kd, vd]
            .iter()
            .map(|&x| int(op, "size", x))
            .collect::<Result<Vec<i32>>>()?;
        let cfg = recurrent_backward_launch(nv, kd, vd);
        match dstate0 {
            Some(ds) => launch!(self, op, cfg; &mut dq_v, &mut dk_v, dv, dg, dbeta, ds,
                &mut ckpt, &mut st, &mut ds_all, &mut res, dout, state0, q, k, v, g, beta,
                &ints[0], &ints[1], &ints[2], &ints[3], &ints[4]),
            None => launch!(self, op, cfg; &mut dq_v, &mut dk_v, dv, dg, dbeta, &NULL,
                &mut ckpt, &mut st, &mut ds_all, &mut res, dout, state0, q, k, v, g, beta,
                &ints[0], &ints[1], &ints[2], &ints[3], &ints[4]),
        }
        launch!(self, "gated_delta_backward_reduce", elems(t * nk * kd); dq, dk, &dq_v, &dk_v,
            &ints[0], &ints[1], &ints[2], &ints[3]);
        Ok(())
    }

    /// Backward of the gated delta rule over packed sequences (`cu_seqlens`
    /// from 0 to T) in the chunked (WY) form, each sequence from its
    /// initial state in `state0 [seqs, nv, dk, dv]` (`None`: zero, as in
    /// training). The gradient of the same function as
    /// [`Self::gated_delta_backward`], with every sequence and chunk in one
    /// set of launches: the chunked forward again (keeping each chunk's
    /// entering state), a reverse scan of the state's gradient a chunk at a
    /// time, and the per-chunk gradients for every chunk at once (CPU
    /// reference: `cpu::gated_delta::gated_delta_chunked_backward_from_checkpoints`).
    /// Every gradient is written; `dq`, `dk [T, nk, dk]` sum the value heads
    /// of a key head. Scratch: `cpu::gated_delta::chunked_backward_scratch_floats`
    /// (about `T * nv * (5 dv + 6 dk)` floats plus `2 * nv * dk * dv + 2 *
    /// nv * GD_CHUNK^2` per chunk).
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_chunked_backward(
        &self,
        dq: &mut CudaSlice<f32>,
        dk: &mut CudaSlice<f32>,
        dv: &mut CudaSlice<f32>,
        dg: &mut CudaSlice<f32>,
        dbeta: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        state0: Option<&CudaSlice<f32>>,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        cu_seqlens: &[u32],
        dims: (usize, usize, usize, usize),
    ) -> Result<()> {
        let op = "gated_delta_chunked_backward";
        let (nk, nv, kd, vd) = dims;
        let seqs = cu_seqlens.len().saturating_sub(1);
        let sn = nv * kd * vd;
        super::check_cu_seqlens(op, cu_seqlens, seqs)?;
        let t = cu_seqlens.last().copied().unwrap_or(0) as usize;
        shape(
            op,
            &[
                ("dq", dq.len(), t * nk * kd),
                ("dk", dk.len(), t * nk * kd),
                ("dv", dv.len(), t * nv * vd),
                ("dg", dg.len(), t * nv),
                ("dbeta", dbeta.len(), t * nv),
                ("dout", dout.len(), t * nv * vd),
            ],
        )?;
        if kd == 0 || vd == 0 || nk == 0 {
            return Err(Error::Shape(format!("{op}: {dims:?}")));
        }
        if t == 0 {
            // Nothing to differentiate (and nothing to allocate).
            return Ok(());
        }
        let mut state = match state0 {
            Some(s) => {
                shape(op, &[("state0", s.len(), seqs * sn)])?;
                self.stream.clone_dtod(s)?
            }
            None => self.zeros::<f32>(seqs * sn)?,
        };
        let slots = self.index(&(0..seqs as u32).collect::<Vec<u32>>())?;
        let mut out = self.zeros::<f32>(dout.len())?;
        let Some(ints) =
            super::check_prefill(op, &out, &state, q, k, v, g, beta, &slots, cu_seqlens, dims)?
        else {
            return Ok(());
        };
        let plan = ChunkPlan::new(cu_seqlens, GD_CHUNK);
        let chunks = plan.tok0.len();
        let mut kke = self.zeros::<f32>(chunks * nv * GD_CHUNK * GD_CHUNK)?;
        let mut starts = self.zeros::<f32>(chunks * sn)?;
        let p = self.gated_delta_chunks(
            &mut out,
            &mut state,
            Some((&mut kke, &mut starts)),
            q,
            k,
            v,
            g,
            beta,
            &slots,
            &plan,
            &ints,
            dims,
        )?;
        let mut ddelta = self.zeros::<f32>(t * nv * vd)?;
        let mut ds1 = self.zeros::<f32>(chunks * sn)?;
        let mut ds_all = self.zeros::<f32>(seqs * sn)?;
        let dscan = chunk_launch(seqs * nv * vd.div_ceil(GD_COLS));
        launch!(self, "gated_delta_chunk_dscan", dscan; &mut ddelta, &mut ds1, &mut ds_all,
            &p.a, &p.w, &p.cum, q, k, dout, &*p.first, &*p.tok0, &*p.len,
            &ints[0], &ints[1], &ints[2], &ints[3], &ints[4]);
        let (mut delta, mut drv) = (
            self.zeros::<f32>(t * nv * vd)?,
            self.zeros::<f32>(t * nv * vd)?,
        );
        let (mut dqg, mut dkd) = (
            self.zeros::<f32>(t * nv * kd)?,
            self.zeros::<f32>(t * nv * kd)?,
        );
        let mut drk = self.zeros::<f32>(t * nv * kd)?;
        let (mut dq_v, mut dk_v) = (
            self.zeros::<f32>(t * nv * kd)?,
            self.zeros::<f32>(t * nv * kd)?,
        );
        let n = int(op, "chunks", chunks)?;
        let grads = chunk_launch(chunks * nv);
        launch!(self, "gated_delta_chunk_grads", grads; &mut dq_v, &mut dk_v, dv, dg, dbeta,
            &mut delta, &mut dqg, &mut dkd, &mut drv, &mut drk, &ddelta, &starts, &ds1,
            &p.a, &kke, &p.u, &p.w, &p.cum, q, k, v, dout, beta, &*p.tok0, &*p.len,
            &n, &ints[1], &ints[2], &ints[3], &ints[4]);
        let ti = int(op, "tokens", t)?;
        launch!(self, "gated_delta_backward_reduce", elems(t * nk * kd); dq, dk, &dq_v, &dk_v,
            &ti, &ints[1], &ints[2], &ints[3]);
        Ok(())
    }

    /// Backward of causal grouped-query attention for one sequence (`q,
    /// dout [nq, heads, hd]`, `k, v [nk, kv_heads, hd]`, query i at
    /// position `nk - nq + i`), as `cpu::attention::attention_backward`:
    /// the probabilities recomputed, `dq`, `dk`, `dv` written. head_dim at
    /// most 256.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        dq: &mut CudaSlice<f32>,
        dk: &mut CudaSlice<f32>,
        dv: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        dims: crate::cpu::attention::AttnDims,
        scale: f32,
    ) -> Result<()> {
        let op = "attention_backward";
        let crate::cpu::attention::AttnDims {
            nq,
            nk,
            n_heads,
            n_kv_heads,
            head_dim: hd,
        } = dims;
        super::check_heads(op, n_heads, n_kv_heads, hd)?;
        if nq > nk {
            return Err(Error::Shape(format!("{op}: {nq} queries over {nk} keys")));
        }
        shape(
            op,
            &[
                ("dq", dq.len(), nq * n_heads * hd),
                ("dk", dk.len(), nk * n_kv_heads * hd),
                ("dv", dv.len(), nk * n_kv_heads * hd),
                ("dout", dout.len(), nq * n_heads * hd),
                ("q", q.len(), nq * n_heads * hd),
                ("k", k.len(), nk * n_kv_heads * hd),
                ("v", v.len(), nk * n_kv_heads * hd),
            ],
        )?;
        if nk == 0 {
            return Ok(());
        }
        let (mut lse, mut dd) = (
            self.zeros::<f32>(nq * n_heads)?,
            self.zeros::<f32>(nq * n_heads)?,
        );
        let ints = [nq, nk, n_heads, n_kv_heads, hd]
            .iter()
            .map(|&x| int(op, "size", x))
            .collect::<Result<Vec<i32>>>()?;
        // Rows (pairs, or keys) a block holds (attention.cu).
        let rows = ATTN_PAIR_WARPS * ATTN_BWD_ROWS;
        if nq > 0 {
            let blocks = (nq * (n_heads / n_kv_heads)).div_ceil(rows) * n_kv_heads;
            launch!(self, "attention_backward_dq", attention_dq_launch(blocks, hd);
                dq, &mut lse, &mut dd, dout, q, k, v,
                &ints[0], &ints[1], &ints[2], &ints[3], &ints[4], &scale);
        }
        launch!(self, "attention_backward_dkv", attention_dkv_launch(nk.div_ceil(rows) * n_kv_heads, hd);
            dk, dv, dout, q, k, v, &lse, &dd,
            &ints[0], &ints[1], &ints[2], &ints[3], &ints[4], &scale);
        Ok(())
    }

    /// One AdamW step on one tensor, in place (as
    /// `cpu::adamw::adamw_update`), with the updated weight also written
    /// as bf16 to `out_bf16` when given: the engine's copy, in the same pass.
    pub fn adamw_update(
        &self,
        param: &mut CudaSlice<f32>,
        exp_avg: &mut CudaSlice<f32>,
        exp_avg_sq: &mut CudaSlice<f32>,
        out_bf16: Option<&mut CudaSlice<u16>>,
        grad: &CudaSlice<f32>,
        s: &AdamWStep,
    ) -> Result<()> {
        let op = "adamw_update";
        let n = param.len();
        shape(
            op,
            &[
                ("exp_avg", exp_avg.len(), n),
                ("exp_avg_sq", exp_avg_sq.len(), n),
                ("grad", grad.len(), n),
            ],
        )?;
        if let Some(o) = &out_bf16 {
            shape(op, &[("out_bf16", o.len(), n)])?;
        }
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        let sc = [
            s.decay,
            s.step_size,
            s.b1w,
            s.beta2,
            s.b2w,
            s.bc2_sqrt,
            s.eps,
        ];
        match out_bf16 {
            Some(o) => launch!(self, op, elems(n); param, exp_avg, exp_avg_sq, o, grad, &nl,
                &sc[0], &sc[1], &sc[2], &sc[3], &sc[4], &sc[5], &sc[6]),
            None => launch!(self, op, elems(n); param, exp_avg, exp_avg_sq, &NULL, grad, &nl,
                &sc[0], &sc[1], &sc[2], &sc[3], &sc[4], &sc[5], &sc[6]),
        }
        Ok(())
    }

    /// `x *= s`, in place (clipping by the global norm).
    pub fn scale(&self, x: &mut CudaSlice<f32>, s: f32) -> Result<()> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        launch!(self, "scale_f32", elems(n); x, &nl, &s);
        Ok(())
    }

    /// `sum x^2`: f32 partial sums per block on the device, added in f64
    /// in block order here (a fixed order, so the same bits every time).
    pub fn sum_squares(&self, x: &CudaSlice<f32>) -> Result<f64> {
        let n = x.len();
        if n == 0 {
            return Ok(0.0);
        }
        let launch = per_item(elems(n).grid_dim.0.min(1024) as usize);
        let mut partial = self.zeros::<f32>(launch.grid_dim.0 as usize)?;
        let nl = n as i64;
        launch!(self, "sum_squares_partial", launch; &mut partial, x, &nl);
        Ok(self.download(&partial)?.iter().map(|&p| p as f64).sum())
    }
}

/// The distinct ids in increasing order, each one's start in `order`
/// (plus the end), and the token positions grouped by id, each group in
/// position order (a stable counting of the ids).
fn segments(ids: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut order: Vec<u32> = (0..ids.len() as u32).collect();
    order.sort_by_key(|&t| ids[t as usize]);
    let (mut sorted, mut starts) = (Vec::new(), Vec::new());
    for (k, &t) in order.iter().enumerate() {
        let id = ids[t as usize];
        if sorted.last() != Some(&id) {
            sorted.push(id);
            starts.push(k as u32);
        }
    }
    starts.push(order.len() as u32);
    (sorted, starts, order)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{close, gpu, rand_vec};
    use super::*;
    use crate::cpu;
    use rand::{Rng, SeedableRng};

    #[test]
    fn segments_group_ids_in_position_order() {
        let (sorted, starts, order) = segments(&[5, 2, 5, 0, 2, 5]);
        assert_eq!(sorted, vec![0, 2, 5]);
        assert_eq!(starts, vec![0, 1, 3, 6]);
        assert_eq!(order, vec![3, 1, 4, 0, 2, 5]);
        let (s, st, o) = segments(&[]);
        assert!(s.is_empty() && o.is_empty());
        assert_eq!(st, vec![0]);
    }

    #[test]
    fn norm_backwards_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let up = |x: &[f32]| d.upload(x).unwrap();
        for (n, c) in [(1, 7), (37, 129), (3, 1000)] {
            let x = rand_vec(&mut rng, n * c, 2.0);
            let z = rand_vec(&mut rng, n * c, 2.0);
            let w = rand_vec(&mut rng, c, 0.5);
            let dy = rand_vec(&mut rng, n * c, 1.0);
            let res = rand_vec(&mut rng, n * c, 1.0);
            let (mut y, mut r) = (vec![0.0; n * c], vec![0.0; n]);
            cpu::rmsnorm::rmsnorm_forward(&mut y, &mut r, &x, &w, n, c, 1e-6).unwrap();
            // dinp accumulates into the residual stream, dweight into its sum.
            let (mut dx, mut dw) = (res.clone(), w.clone());
            cpu::rmsnorm::rmsnorm_backward(&mut dx, &mut dw, &dy, &x, &w, &r, n, c).unwrap();
            let (mut gx, mut gw) = (up(&res), up(&w));
            d.rmsnorm_backward(&mut gx, &mut gw, &up(&dy), &up(&x), &up(&w), &up(&r), n, c)
                .unwrap();
            close("rmsnorm dinp", &d.download(&gx).unwrap(), &dx, 1e-5);
            close("rmsnorm dweight", &d.download(&gw).unwrap(), &dw, 1e-4);

            cpu::rmsnorm::gated_rmsnorm_forward(&mut y, &mut r, &x, &z, &w, n, c, 1e-6).unwrap();
            let (mut dx, mut dz, mut dw) = (vec![0.0; n * c], vec![0.0; n * c], w.clone());
            cpu::rmsnorm::gated_rmsnorm_backward(
                &mut dx, &mut dz, &mut dw, &dy, &x, &z, &w, &r, n, c,
            )
            .unwrap();
            let (mut gx, mut gz, mut gw) =
                (d.zeros(n * c).unwrap(), d.zeros(n * c).unwrap(), up(&w));
            d.gated_rmsnorm_backward(
                &mut gx,
                &mut gz,
                &mut gw,
                &up(&dy),
                &up(&x),
                &up(&z),
                &up(&w),
                &up(&r),
                n,
                c,
            )
            .unwrap();
            close("gated dinp", &d.download(&gx).unwrap(), &dx, 1e-5);
            close("gated dgate", &d.download(&gz).unwrap(), &dz, 1e-5);
            close("gated dweight", &d.download(&gw).unwrap(), &dw, 1e-4);

            let (mut yn, mut rn) = (vec![0.0; n * c], vec![0.0; n]);
            cpu::l2norm::l2norm_forward(&mut yn, &mut rn, &x, n, c, 1e-6).unwrap();
            let mut dx = vec![0.0; n * c];
            cpu::l2norm::l2norm_backward(&mut dx, &dy, &x, &rn, n, c).unwrap();
            let mut gx = d.zeros(n * c).unwrap();
            d.l2norm_backward(&mut gx, &up(&dy), &up(&x), &up(&rn), n, c)
                .unwrap();
            close("l2norm dinp", &d.download(&gx).unwrap(), &dx, 1e-5);
        }
    }

    #[test]
    fn activation_and_gating_backwards_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let up = |x: &[f32]| d.upload(x).unwrap();
        let n = 1001;
        let (dy, gate, u) = (
            rand_vec(&mut rng, n, 1.0),
            rand_vec(&mut rng, n, 8.0),
            rand_vec(&mut rng, n, 2.0),
        );
        let mut want = vec![0.0; n];
        cpu::activation::silu_backward(&mut want, &dy, &gate).unwrap();
        let mut g = d.zeros(n).unwrap();
        d.silu_backward(&mut g, &up(&dy), &up(&gate)).unwrap();
        close("silu", &d.download(&g).unwrap(), &want, 1e-5);

        let (mut wg, mut wu) = (vec![0.0; n], vec![0.0; n]);
        cpu::activation::silu_mul_backward(&mut wg, &mut wu, &dy, &gate, &u).unwrap();
        let (mut gg, mut gu) = (d.zeros(n).unwrap(), d.zeros(n).unwrap());
        d.silu_mul_backward(&mut gg, &mut gu, &up(&dy), &up(&gate), &up(&u))
            .unwrap();
        close("silu_mul dgate", &d.download(&gg).unwrap(), &wg, 1e-5);
        close("silu_mul dup", &d.download(&gu).unwrap(), &wu, 1e-5);

        cpu::activation::sigmoid_gate_backward(&mut wg, &mut wu, &dy, &u, &gate).unwrap();
        d.sigmoid_gate_backward(&mut gg, &mut gu, &up(&dy), &up(&u), &up(&gate))
            .unwrap();
        close("sigmoid dx", &d.download(&gg).unwrap(), &wg, 1e-5);
        close("sigmoid dgate", &d.download(&gu).unwrap(), &wu, 1e-5);

        // Gating over [t, nv], with pre-activations past softplus's threshold.
        let (t, nv) = (333, 6);
        let a = rand_vec(&mut rng, t * nv, 30.0);
        let (a_log, dt_bias) = (rand_vec(&mut rng, nv, 1.0), rand_vec(&mut rng, nv, 1.0));
        let beta: Vec<f32> = rand_vec(&mut rng, t * nv, 5.0)
            .iter()
            .map(|&x| cpu::activation::sigmoid(x))
            .collect();
        let g: Vec<f32> = (0..t * nv)
            .map(|i| -a_log[i % nv].exp() * cpu::activation::softplus(a[i] + dt_bias[i % nv]))
            .collect();
        let (dg, dbeta) = (
            rand_vec(&mut rng, t * nv, 1.0),
            rand_vec(&mut rng, t * nv, 1.0),
        );
        let (mut da, mut db) = (vec![0.0; t * nv], vec![0.0; t * nv]);
        let (mut dal, mut ddt) = (vec![0.5; nv], vec![-0.25; nv]);
        cpu::activation::gated_delta_gating_backward(
            &mut da, &mut db, &mut dal, &mut ddt, &dg, &dbeta, &g, &beta, &a, &a_log, &dt_bias,
        )
        .unwrap();
        let (mut gda, mut gdb) = (d.zeros(t * nv).unwrap(), d.zeros(t * nv).unwrap());
        let (mut gal, mut gdt) = (up(&[0.5; 6]), up(&[-0.25; 6]));
        d.gated_delta_gating_backward(
            &mut gda,
            &mut gdb,
            &mut gal,
            &mut gdt,
            &up(&dg),
            &up(&dbeta),
            &up(&g),
            &up(&beta),
            &up(&a),
            &up(&a_log),
            &up(&dt_bias),
        )
        .unwrap();
        close("gating da", &d.download(&gda).unwrap(), &da, 1e-5);
        close("gating db", &d.download(&gdb).unwrap(), &db, 1e-5);
        // Sums over 333 tokens in another order: relative to their size.
        close("gating da_log", &d.download(&gal).unwrap(), &dal, 1e-4);
        close("gating ddt_bias", &d.download(&gdt).unwrap(), &ddt, 1e-4);
    }

    #[test]
    fn embedding_rope_and_logprob_backwards_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        let up = |x: &[f32]| d.upload(x).unwrap();
        // Repeated ids: summed in position order, the CPU's, bit for bit.
        let (vocab, c) = (40, 37);
        let ids = [3u32, 39, 3, 0, 3, 17, 39];
        let dy = rand_vec(&mut rng, ids.len() * c, 1.0);
        let table0 = rand_vec(&mut rng, vocab * c, 1.0);
        let mut want = table0.clone();
        cpu::embedding::embedding_backward(&mut want, &dy, &ids, vocab, c).unwrap();
        let mut gt = up(&table0);
        d.embedding_backward(&mut gt, &up(&dy), &ids, vocab, c)
            .unwrap();
        close("embedding", &d.download(&gt).unwrap(), &want, 0.0);
        assert!(d
            .embedding_backward(&mut gt, &up(&dy), &[40; 7], vocab, c)
            .is_err());

        // q/k norm + partial RoPE backward = RoPE backward, then RMSNorm's.
        let (heads, hd, rot, theta) = (3, 80, 20, 1e7f32);
        let positions = [0u32, 7, 40_000, 5];
        let rows_n = positions.len() * heads;
        let x = rand_vec(&mut rng, rows_n * hd, 2.0);
        let w = rand_vec(&mut rng, hd, 0.5);
        let dout = rand_vec(&mut rng, rows_n * hd, 1.0);
        let (mut y, mut r) = (vec![0.0; rows_n * hd], vec![0.0; rows_n]);
        cpu::rmsnorm::rmsnorm_forward(&mut y, &mut r, &x, &w, rows_n, hd, 1e-6).unwrap();
        let mut dn = dout.clone();
        cpu::rope::rope_backward(&mut dn, &positions, heads, hd, rot, theta).unwrap();
        let (mut dx, mut dw) = (vec![0.0; rows_n * hd], vec![0.0; hd]);
        cpu::rmsnorm::rmsnorm_backward(&mut dx, &mut dw, &dn, &x, &w, &r, rows_n, hd).unwrap();
        let (mut gx, mut gw) = (d.zeros(rows_n * hd).unwrap(), d.zeros(hd).unwrap());
        d.qk_norm_rope_backward(
            &mut gx,
            &mut gw,
            &up(&dout),
            &up(&x),
            &up(&w),
            &up(&r),
            &d.upload(&positions).unwrap(),
            heads,
            hd,
            rot,
            theta,
        )
        .unwrap();
        close("qk_norm_rope dinp", &d.download(&gx).unwrap(), &dx, 1e-4);
        close("qk_norm_rope dweight", &d.download(&gw).unwrap(), &dw, 1e-4);

        // The log-prob backward, at temperature 1 and 0.7 (the CPU's on
        // scaled logits, times the chain rule's 1 / T).
        let (n, v) = (3, 4097);
        let logits = rand_vec(&mut rng, n * v, 10.0);
        let targets: Vec<u32> = (0..n).map(|_| rng.gen_range(0..v as u32)).collect();
        let dlp = rand_vec(&mut rng, n, 1.0);
        for inv_t in [1.0f32, 1.0 / 0.7] {
            let scaled: Vec<f32> = logits.iter().map(|x| x * inv_t).collect();
            let mut want = vec![0.0; n * v];
            cpu::logsoftmax::logprob_gather_backward(&mut want, &dlp, &scaled, &targets, n, v)
                .unwrap();
            want.iter_mut().for_each(|x| *x *= inv_t);
            let mut gl = d.zeros(n * v).unwrap();
            d.logprob_gather_backward(
                &mut gl,
                &up(&dlp),
                &up(&logits),
                &d.upload(&targets).unwrap(),
                v,
                inv_t,
            )
            .unwrap();
            close("logprob backward", &d.download(&gl).unwrap(), &want, 1e-5);

            // The entropy and its backward, added onto the log-prob's.
            let mut want_h = vec![0.0; n];
            cpu::logsoftmax::entropy_forward(&mut want_h, &scaled, n, v).unwrap();
            let mut h = d.zeros(n).unwrap();
            d.entropy_forward(&mut h, &up(&logits), v, inv_t).unwrap();
            close("entropy", &d.download(&h).unwrap(), &want_h, 1e-5);
            let dent = rand_vec(&mut rng, n, 1.0);
            let mut want_d = vec![0.0; n * v];
            cpu::logsoftmax::logprob_gather_backward(&mut want_d, &dlp, &scaled, &targets, n, v)
                .unwrap();
            cpu::logsoftmax::entropy_backward(&mut want_d, &dent, &scaled, n, v).unwrap();
            want_d.iter_mut().for_each(|x| *x *= inv_t);
            d.entropy_backward(&mut gl, &up(&dent), &up(&logits), v, inv_t)
                .unwrap();
            close("entropy backward", &d.download(&gl).unwrap(), &want_d, 1e-5);
        }
    }

    #[test]
    fn conv1d_forward_and_backward_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(14);
        let up = |x: &[f32]| d.upload(x).unwrap();
        for (t, c, k) in [(1, 5, 4), (2, 33, 4), (97, 130, 4), (9, 7, 3)] {
            let inp = rand_vec(&mut rng, t * c, 1.0);
            let w = rand_vec(&mut rng, c * k, 1.0);
            let state0 = rand_vec(&mut rng, (k - 1) * c, 1.0);
            let (mut out, mut st) = (vec![0.0; t * c], state0.clone());
            cpu::conv1d::conv1d_forward(&mut out, &mut st, &inp, &w, t, c, k).unwrap();
            let (mut go, mut gs) = (d.zeros(t * c).unwrap(), up(&state0));
            d.conv1d_forward(&mut go, &mut gs, &up(&inp), &up(&w), t, c, k)
                .unwrap();
            close("conv1d out", &d.download(&go).unwrap(), &out, 1e-5);
            close("conv1d state", &d.download(&gs).unwrap(), &st, 0.0);

            let dout = rand_vec(&mut rng, t * c, 1.0);
            let w0 = rand_vec(&mut rng, c * k, 0.1);
            let (mut dx, mut dw, mut ds) = (vec![0.0; t * c], w0.clone(), vec![0.0; (k - 1) * c]);
            cpu::conv1d::conv1d_backward(
                &mut dx,
                &mut dw,
                Some(&mut ds),
                &dout,
                &state0,
                &inp,
                &w,
                t,
                c,
                k,
            )
            .unwrap();
            let (mut gx, mut gw, mut gds) = (
                d.zeros(t * c).unwrap(),
                up(&w0),
                d.zeros((k - 1) * c).unwrap(),
            );
            d.conv1d_backward(
                &mut gx,
                &mut gw,
                Some(&mut gds),
                &up(&dout),
                &up(&state0),
                &up(&inp),
                &up(&w),
                t,
                c,
                k,
            )
            .unwrap();
            close("conv1d dinp", &d.download(&gx).unwrap(), &dx, 1e-5);
            close("conv1d dweight", &d.download(&gw).unwrap(), &dw, 1e-4);
            close("conv1d dstate0", &d.download(&gds).unwrap(), &ds, 1e-5);
        }
    }

    #[test]
    fn gated_delta_backward_matches_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(16);
        let up = |x: &[f32]| d.upload(x).unwrap();
        // Over one chunk boundary and not, GQA, odd head sizes.
        for (t, nk, nv, dk, dv) in [(5, 1, 1, 8, 8), (130, 2, 4, 32, 24), (64, 1, 2, 128, 128)] {
            let dims = cpu::gated_delta::GatedDeltaDims { t, nk, nv, dk, dv };
            let unit = |v: Vec<f32>| -> Vec<f32> {
                v.chunks(dk)
                    .flat_map(|r| {
                        let n = r.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                        r.iter().map(move |x| x / n).collect::<Vec<_>>()
                    })
                    .collect()
            };
            let q = unit(rand_vec(&mut rng, t * nk * dk, 1.0));
            let k = unit(rand_vec(&mut rng, t * nk * dk, 1.0));
            let v = rand_vec(&mut rng, t * nv * dv, 1.0);
            let g: Vec<f32> = (0..t * nv).map(|_| -rng.gen_range(0.0..0.5f32)).collect();
            let beta: Vec<f32> = (0..t * nv).map(|_| rng.gen_range(0.1..0.9f32)).collect();
            let state0 = rand_vec(&mut rng, nv * dk * dv, 0.5);
            let dout = rand_vec(&mut rng, t * nv * dv, 1.0);
            let (mut dq, mut dkk, mut dvv) = (
                vec![0.0; t * nk * dk],
                vec![0.0; t * nk * dk],
                vec![0.0; t * nv * dv],
            );
            let (mut dg, mut db, mut ds) = (
                vec![0.0; t * nv],
                vec![0.0; t * nv],
                vec![0.0; nv * dk * dv],
            );
            cpu::gated_delta::gated_delta_backward(
                &mut dq,
                &mut dkk,
                &mut dvv,
                &mut dg,
                &mut db,
                Some(&mut ds),
                &dout,
                &state0,
                &q,
                &k,
                &v,
                &g,
                &beta,
                dims,
            )
            .unwrap();
            let mut gq = d.zeros(t * nk * dk).unwrap();
            let mut gk = d.zeros(t * nk * dk).unwrap();
            let mut gv = d.zeros(t * nv * dv).unwrap();
            let (mut gg, mut gb) = (d.zeros(t * nv).unwrap(), d.zeros(t * nv).unwrap());
            let mut gs = d.zeros(nv * dk * dv).unwrap();
            d.gated_delta_backward(
                &mut gq,
                &mut gk,
                &mut gv,
                &mut gg,
                &mut gb,
                Some(&mut gs),
                &up(&dout),
                &up(&state0),
                &up(&q),
                &up(&k),
                &up(&v),
                &up(&g),
                &up(&beta),
                dims,
            )
            .unwrap();
            // Long fp32 sums in another order: relative to each size.
            close("gd dq", &d.download(&gq).unwrap(), &dq, 1e-3);
            close("gd dk", &d.download(&gk).unwrap(), &dkk, 1e-3);
            close("gd dv", &d.download(&gv).unwrap(), &dvv, 1e-3);
            close("gd dg", &d.download(&gg).unwrap(), &dg, 1e-3);
            close("gd dbeta", &d.download(&gb).unwrap(), &db, 1e-3);
            close("gd dstate0", &d.download(&gs).unwrap(), &ds, 1e-3);
        }
    }

    /// The chunked backward over packed sequences against the CPU's chunked
    /// backward per sequence (1e-4 relative: sums in other orders), with GQA,
    /// widths off the kernels' tiles (dk 48, dv 40 over column tiles of 32),
    /// sequences of 150 (the last chunk partial), 1, 0 and 65 tokens (a
    /// chunk, then a chunk of one), each from its own state; and with no
    /// initial state, the zero state's gradients.
    #[test]
    fn gated_delta_chunked_backward_matches_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(22);
        let up = |x: &[f32]| d.upload(x).unwrap();
        let (nk, nv, dk, dv) = (2, 4, 48, 40);
        let cu = [0u32, 150, 151, 151, 216];
        let t = 216;
        let unit = |v: Vec<f32>| -> Vec<f32> {
            v.chunks(dk)
                .flat_map(|r| {
                    let n = r.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                    r.iter().map(move |x| x / n).collect::<Vec<_>>()
                })
                .collect()
        };
        let q: Vec<f32> = unit(rand_vec(&mut rng, t * nk * dk, 1.0))
            .iter()
            .map(|x| x / (dk as f32).sqrt())
            .collect();
        let k = unit(rand_vec(&mut rng, t * nk * dk, 1.0));
        let v = rand_vec(&mut rng, t * nv * dv, 1.0);
        let g: Vec<f32> = (0..t * nv).map(|_| -rng.gen_range(0.0..0.7f32)).collect();
        let beta: Vec<f32> = (0..t * nv).map(|_| rng.gen_range(0.0..1.0f32)).collect();
        let dout = rand_vec(&mut rng, t * nv * dv, 1.0);
        let per = nv * dk * dv;
        let init = rand_vec(&mut rng, 4 * per, 0.3);
        for with_state in [true, false] {
            let mut want: [Vec<f32>; 5] = [
                vec![0.0; t * nk * dk],
                vec![0.0; t * nk * dk],
                vec![0.0; t * nv * dv],
                vec![0.0; t * nv],
                vec![0.0; t * nv],
            ];
            for s in 0..4 {
                let (a, b) = (cu[s] as usize, cu[s + 1] as usize);
                if a == b {
                    continue;
                }
                let n = b - a;
                let dims = cpu::gated_delta::GatedDeltaDims {
                    t: n,
                    nk,
                    nv,
                    dk,
                    dv,
                };
                let state0 = if with_state {
                    init[s * per..(s + 1) * per].to_vec()
                } else {
                    vec![0.0; per]
                };
                let rows = |x: &[f32], w: usize| x[a * w..b * w].to_vec();
                let (sq, sk, sv) = (rows(&q, nk * dk), rows(&k, nk * dk), rows(&v, nv * dv));
                let (sg, sb, sd) = (rows(&g, nv), rows(&beta, nv), rows(&dout, nv * dv));
                let mut cps = vec![0.0; n.div_ceil(cpu::gated_delta::CHECKPOINT_EVERY) * per];
                let (mut out, mut st) = (vec![0.0; n * nv * dv], state0);
                cpu::gated_delta::gated_delta_recurrent_forward_checkpointed(
                    &mut out, &mut st, &sq, &sk, &sv, &sg, &sb, dims, &mut cps,
                )
                .unwrap();
                let mut part: [Vec<f32>; 5] = [
                    vec![0.0; n * nk * dk],
                    vec![0.0; n * nk * dk],
                    vec![0.0; n * nv * dv],
                    vec![0.0; n * nv],
                    vec![0.0; n * nv],
                ];
                let [pq, pk, pv, pg, pb] = &mut part;
                cpu::gated_delta::gated_delta_chunked_backward_from_checkpoints(
                    pq, pk, pv, pg, pb, None, None, &sd, &cps, &sq, &sk, &sv, &sg, &sb, dims,
                )
                .unwrap();
                for ((w, p), width) in
                    want.iter_mut()
                        .zip(&part)
                        .zip([nk * dk, nk * dk, nv * dv, nv, nv])
                {
                    w[a * width..b * width].copy_from_slice(p);
                }
            }
            let mut got: [CudaSlice<f32>; 5] = [
                d.zeros(t * nk * dk).unwrap(),
                d.zeros(t * nk * dk).unwrap(),
                d.zeros(t * nv * dv).unwrap(),
                d.zeros(t * nv).unwrap(),
                d.zeros(t * nv).unwrap(),
            ];
            let state0 = up(&init);
            let [gq, gk, gv, gg, gb] = &mut got;
            d.gated_delta_chunked_backward(
                gq,
                gk,
                gv,
                gg,
                gb,
                &up(&dout),
                with_state.then_some(&state0),
                &up(&q),
                &up(&k),
                &up(&v),
                &up(&g),
                &up(&beta),
                &cu,
                (nk, nv, dk, dv),
            )
            .unwrap();
            for (name, (gt, w)) in ["dq", "dk", "dv", "dg", "dbeta"]
                .iter()
                .zip(got.iter().zip(&want))
            {
                close(
                    &format!("chunked gd {name} (state {with_state})"),
                    &d.download(gt).unwrap(),
                    w,
                    1e-4,
                );
            }
        }
    }

    #[test]
    fn attention_backward_matches_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        let up = |x: &[f32]| d.upload(x).unwrap();
        // Prefill (nq = nk) past a tile, a suffix of queries, GQA, head
        // dims up to 256.
        for (nq, nk, nh, nkv, hd) in [
            (1, 1, 1, 1, 8),
            (70, 70, 4, 2, 40),
            (5, 131, 8, 2, 256),
            (20, 37, 6, 3, 33),
        ] {
            let dims = cpu::attention::AttnDims {
                nq,
                nk,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
            };
            let scale = 1.0 / (hd as f32).sqrt();
            let q = rand_vec(&mut rng, nq * nh * hd, 1.0);
            let k = rand_vec(&mut rng, nk * nkv * hd, 1.0);
            let v = rand_vec(&mut rng, nk * nkv * hd, 1.0);
            let dout = rand_vec(&mut rng, nq * nh * hd, 1.0);
            let (mut dq, mut dk, mut dv) =
                (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
            cpu::attention::attention_backward(
                &mut dq, &mut dk, &mut dv, &dout, &q, &k, &v, dims, scale,
            )
            .unwrap();
            let (mut gq, mut gk, mut gv) = (
                d.zeros(q.len()).unwrap(),
                d.zeros(k.len()).unwrap(),
                d.zeros(v.len()).unwrap(),
            );
            d.attention_backward(
                &mut gq,
                &mut gk,
                &mut gv,
                &up(&dout),
                &up(&q),
                &up(&k),
                &up(&v),
                dims,
                scale,
            )
            .unwrap();
            close("attention dq", &d.download(&gq).unwrap(), &dq, 1e-4);
            close("attention dk", &d.download(&gk).unwrap(), &dk, 1e-4);
            close("attention dv", &d.download(&gv).unwrap(), &dv, 1e-4);
        }
    }

    #[test]
    fn adamw_and_the_global_norm_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(15);
        let n = 10_007;
        let mut p = rand_vec(&mut rng, n, 1.0);
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let (mut gp, mut gm, mut gv) = (
            d.upload(&p).unwrap(),
            d.zeros(n).unwrap(),
            d.zeros(n).unwrap(),
        );
        let mut bits = d.zeros::<u16>(n).unwrap();
        for step in 1..=3u64 {
            let g = rand_vec(&mut rng, n, 0.1);
            let s = AdamWStep::new(1e-3, 0.9, 0.999, 1e-8, 0.01, step);
            cpu::adamw::adamw_update(&mut p, &mut m, &mut v, &g, &s).unwrap();
            let gg = d.upload(&g).unwrap();
            d.adamw_update(&mut gp, &mut gm, &mut gv, Some(&mut bits), &gg, &s)
                .unwrap();
        }
        close("adamw param", &d.download(&gp).unwrap(), &p, 1e-6);
        close("adamw exp_avg", &d.download(&gm).unwrap(), &m, 1e-6);
        close("adamw exp_avg_sq", &d.download(&gv).unwrap(), &v, 1e-6);
        // The bf16 copy is the rounded master, as half rounds it.
        let master = d.download(&gp).unwrap();
        let want: Vec<u16> = master
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        assert_eq!(d.download(&bits).unwrap(), want);

        let want: f64 = p.iter().map(|&x| x as f64 * x as f64).sum();
        let got = d.sum_squares(&d.upload(&p).unwrap()).unwrap();
        assert!((got - want).abs() <= 1e-5 * want, "{got} vs {want}");
        let mut x = d.upload(&p).unwrap();
        d.scale(&mut x, 0.5).unwrap();
        let half_p: Vec<f32> = p.iter().map(|x| x * 0.5).collect();
        close("scale", &d.download(&x).unwrap(), &half_p, 0.0);
    }
}
