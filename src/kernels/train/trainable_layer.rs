//! The whole multi-head self-attention layer, forward and backward, on f32 slices: the
//! fused Q/K/V projection, the attention reading the heads in place, `W_O`, and their
//! gradients. It runs inside one candle op (`crate::attention::ops::layer_op`), so that a training step
//! makes a handful of large buffers (kept from step to step) instead of one per candle op.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::attend::mask_plan::MaskPlan;
use crate::kernels::attend::on_tensors::{packed_attention_into, PackedHeads};
use crate::kernels::gemm::matrix::{matmul, MatMut, MatRef, Threads};
use crate::kernels::gemm::projection::linear_into;
use crate::kernels::scratch::TrainingBuffer;
use crate::kernels::train::sdpa_backward::{packed_attention_backward, PackedGrad};

/// Sizes of the layer. Its parameters arrive as three flat vectors (see [`Params`]): `W_qkv`,
/// `(qkv_cols, hidden)` row-major (`(out, in)`) or, with `qkv_t`, `(hidden, qkv_cols)`
/// (GPT-2's `Conv1D`); `W_O`, `(out, heads * v_head_dim)` row-major or its transpose with
/// `o_t`; the biases: the `qkv_cols` Q/K/V biases then the `out` output biases (zeros where
/// the checkpoint has no bias).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LayerShape {
    pub batch: usize,
    pub seq: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub v_head_dim: usize,
    /// Output width of `W_O`; `None` without an output projection.
    pub out: Option<usize>,
    pub scale: f64,
    /// `W_qkv` stored as `(hidden, qkv_cols)`.
    pub qkv_t: bool,
    /// `W_O` stored as `(heads * v_head_dim, out)`.
    pub o_t: bool,
}

impl LayerShape {
    /// Columns of the fused projection: `q | k | v`.
    pub fn qkv_cols(&self) -> usize {
        self.heads * self.head_dim + self.kv_heads * (self.head_dim + self.v_head_dim)
    }
    /// Width of the merged context.
    pub fn ctx_cols(&self) -> usize {
        self.heads * self.v_head_dim
    }
    /// Width of the layer's output.
    pub fn out_cols(&self) -> usize {
        self.out.unwrap_or(self.ctx_cols())
    }
    /// Elements of `W_qkv`.
    pub fn qkv_weight_len(&self) -> usize {
        self.qkv_cols() * self.hidden
    }
    /// Elements of `W_O` (0 without an output projection).
    pub fn w_o_len(&self) -> usize {
        self.out.map_or(0, |o| o * self.ctx_cols())
    }
    /// Elements of the biases: Q/K/V, then output.
    pub fn bias_len(&self) -> usize {
        self.qkv_cols() + self.out.unwrap_or(0)
    }
    /// `W_qkv` as a `(qkv_cols, hidden)` view.
    fn w_qkv<'a>(&self, w: &'a [f32]) -> Result<MatRef<'a>> {
        let (c, d) = (self.qkv_cols(), self.hidden);
        Ok(if self.qkv_t {
            MatRef::row_major(w, d, c)?.t()
        } else {
            MatRef::row_major(w, c, d)?
        })
    }
    /// `W_O` as an `(out, heads * v_head_dim)` view.
    fn w_o<'a>(&self, w: &'a [f32], out: usize) -> Result<MatRef<'a>> {
        let hv = self.ctx_cols();
        Ok(if self.o_t {
            MatRef::row_major(w, hv, out)?.t()
        } else {
            MatRef::row_major(w, out, hv)?
        })
    }
    fn rows(&self) -> usize {
        self.batch * self.seq
    }
    /// The heads of Q, K and V in the projection rows `qkv`.
    fn heads_of<'a>(&self, qkv: &'a [f32]) -> (PackedHeads<'a>, PackedHeads<'a>, PackedHeads<'a>) {
        let at = |col0, heads, width| PackedHeads {
            data: qkv,
            offset: 0,
            seq: self.seq,
            cols: self.qkv_cols(),
            col0,
            heads,
            width,
        };
        let q_cols = self.heads * self.head_dim;
        (
            at(0, self.heads, self.head_dim),
            at(q_cols, self.kv_heads, self.head_dim),
            at(
                q_cols + self.kv_heads * self.head_dim,
                self.kv_heads,
                self.v_head_dim,
            ),
        )
    }
    fn check(&self, x: &[f32], p: &Params) -> Result<()> {
        if x.len() != self.rows() * self.hidden
            || p.w_qkv.len() != self.qkv_weight_len()
            || p.w_o.len() != self.w_o_len()
            || p.biases.len() != self.bias_len()
        {
            return Err(Error::Kernel(format!(
                "layer of {self:?}: x {} (want {}), W_qkv {} (want {}), W_O {} (want {}), \
                 biases {} (want {})",
                x.len(),
                self.rows() * self.hidden,
                p.w_qkv.len(),
                self.qkv_weight_len(),
                p.w_o.len(),
                self.w_o_len(),
                p.biases.len(),
                self.bias_len()
            )));
        }
        Ok(())
    }
}

/// The layer's parameters, flat (layouts in [`LayerShape`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Params<'a> {
    pub w_qkv: &'a [f32],
    /// Empty without an output projection.
    pub w_o: &'a [f32],
    /// Q/K/V biases, then output biases.
    pub biases: &'a [f32],
}

/// Where the backward writes the gradients of `x` and `W_qkv` (flat, in their layouts;
/// every element is overwritten).
#[derive(Debug)]
pub(crate) struct GradsInto<'a> {
    pub x: &'a mut [f32],
    pub w_qkv: &'a mut [f32],
}

/// The other gradients, flat, in the layouts of their inputs.
#[derive(Debug)]
pub(crate) struct OtherGrads {
    /// Empty without an output projection.
    pub w_o: Vec<f32>,
    pub biases: Vec<f32>,
}

/// What the forward keeps for the backward: the projection rows `(batch * seq, q | k | v)`,
/// the merged context `(batch * seq, heads * v_head_dim)` and the attention's log-sum-exps.
#[derive(Debug)]
pub(crate) struct Saved {
    qkv: TrainingBuffer,
    ctx: TrainingBuffer,
    /// Each query row's log-sum-exp, `(batch, heads, seq)`.
    lse: TrainingBuffer,
}

fn threads() -> Threads {
    Threads::Pool(rayon::current_num_threads())
}

/// The layer's output `(batch * seq, out)` for `x` `(batch * seq, hidden)`, and what the
/// backward needs.
pub(crate) fn forward(
    s: &LayerShape,
    x: &[f32],
    p: Params,
    mask: &MaskPlan,
) -> Result<(Vec<f32>, Saved)> {
    s.check(x, &p)?;
    let (n, c) = (s.rows(), s.qkv_cols());
    let xm = MatRef::row_major(x, n, s.hidden)?;
    let w_qkv = s.w_qkv(p.w_qkv)?; // (q+k+v, hidden)
    let mut qkv = TrainingBuffer::new(n * c);
    linear_into(&mut qkv, xm, w_qkv.t(), Some(&p.biases[..c]))?; // (n, q+k+v)
    let mut ctx = TrainingBuffer::new(n * s.ctx_cols());
    let mut lse = TrainingBuffer::new(n * s.heads);
    let heads = s.heads_of(&qkv);
    packed_attention_into(s.batch, heads, mask, s.scale, &mut ctx, Some(&mut lse))?; // (n, h*vhd)
    let out = match s.out {
        Some(o) => {
            let w_o = s.w_o(p.w_o, o)?; // (out, h*vhd)
            let mut y = vec![0f32; n * o];
            let cm = MatRef::row_major(&ctx, n, s.ctx_cols())?;
            let b_o = &p.biases[c..];
            linear_into(&mut y, cm, w_o.t(), Some(b_o))?; // (n, out)
            y
        }
        None => ctx.to_vec(),
    };
    Ok((out, Saved { qkv, ctx, lse }))
}

/// The gradients of the layer given the gradient `d_out` `(batch * seq, out)` of its output:
/// those of `x` and `W_qkv` into `into`, the others returned.
pub(crate) fn backward(
    s: &LayerShape,
    x: &[f32],
    p: Params,
    saved: &Saved,
    d_out: &[f32],
    mask: &MaskPlan,
    into: GradsInto<'_>,
) -> Result<OtherGrads> {
    s.check(x, &p)?;
    if into.x.len() != x.len() || into.w_qkv.len() != s.qkv_weight_len() {
        return Err(Error::Kernel(format!(
            "gradient buffers of {} and {} for x {} and W_qkv {}",
            into.x.len(),
            into.w_qkv.len(),
            x.len(),
            s.qkv_weight_len()
        )));
    }
    let GradsInto {
        x: dx,
        w_qkv: dw_qkv,
    } = into;
    let (n, c, hv) = (s.rows(), s.qkv_cols(), s.ctx_cols());
    if d_out.len() != n * s.out_cols() {
        return Err(Error::Kernel(format!(
            "output gradient of {} for ({n}, {})",
            d_out.len(),
            s.out_cols()
        )));
    }
    let mut dw_o = vec![0f32; s.w_o_len()];
    let mut d_biases = vec![0f32; s.bias_len()];
    let (db_qkv, db_o) = d_biases.split_at_mut(c);
    // Through W_O: dW_O = dY^T ctx, db_O = colsum(dY), d_ctx = dY W_O.
    let mut d_ctx_buf;
    let d_ctx: &[f32] = match s.out {
        Some(o) => {
            let dy = MatRef::row_major(d_out, n, o)?;
            let cm = MatRef::row_major(&saved.ctx, n, hv)?;
            if s.o_t {
                let mut dst = MatMut::new(&mut dw_o, 0, hv, o, o)?; // (h*vhd, out)
                matmul(&mut dst, cm.t(), dy, false, 1.0, threads())?;
            } else {
                let mut dst = MatMut::new(&mut dw_o, 0, o, hv, hv)?; // (out, h*vhd)
                matmul(&mut dst, dy.t(), cm, false, 1.0, threads())?;
            }
            column_sums(d_out, o, db_o);
            let w_o = s.w_o(p.w_o, o)?;
            d_ctx_buf = TrainingBuffer::new(n * hv);
            matmul(
                &mut MatMut::new(&mut d_ctx_buf, 0, n, hv, hv)?,
                dy,
                w_o,
                false,
                1.0,
                threads(),
            )?; // (n, h*vhd)
            &d_ctx_buf
        }
        None => d_out,
    };
    // Through the attention, into the projection's layout.
    let mut d_qkv = TrainingBuffer::new(n * c);
    let at = |col0| PackedGrad { cols: c, col0 };
    let q_cols = s.heads * s.head_dim;
    packed_attention_backward(
        s.batch,
        s.heads_of(&saved.qkv),
        &saved.ctx,
        d_ctx,
        (mask, s.scale, Some(&saved.lse)),
        (&mut d_qkv, at(0)),
        None,
        (at(q_cols), at(q_cols + s.kv_heads * s.head_dim)),
    )?;
    // Through the projection: dW = dQKV^T x, db = colsum(dQKV), dx = dQKV W.
    let dq = MatRef::row_major(&d_qkv, n, c)?;
    let xm = MatRef::row_major(x, n, s.hidden)?;
    if s.qkv_t {
        let mut dst = MatMut::new(dw_qkv, 0, s.hidden, c, c)?; // (hidden, q+k+v)
        matmul(&mut dst, xm.t(), dq, false, 1.0, threads())?;
    } else {
        let mut dst = MatMut::new(dw_qkv, 0, c, s.hidden, s.hidden)?; // (q+k+v, hidden)
        matmul(&mut dst, dq.t(), xm, false, 1.0, threads())?;
    }
    column_sums(&d_qkv, c, db_qkv);
    let w_qkv = s.w_qkv(p.w_qkv)?;
    matmul(
        &mut MatMut::new(dx, 0, n, s.hidden, s.hidden)?,
        dq,
        w_qkv,
        false,
        1.0,
        threads(),
    )?; // (n, hidden)
    Ok(OtherGrads {
        w_o: dw_o,
        biases: d_biases,
    })
}

/// `dst[j] = sum_i m[i * cols + j]` for a row-major matrix with `cols` columns.
fn column_sums(m: &[f32], cols: usize, dst: &mut [f32]) {
    const BLOCK: usize = 64;
    dst.par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(blk, out)| {
            out.fill(0.0);
            let (j0, w) = (blk * BLOCK, out.len());
            for row in m.chunks_exact(cols) {
                for (o, v) in out.iter_mut().zip(&row[j0..j0 + w]) {
                    *o += v;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_sums_add_every_row() {
        let m: Vec<f32> = (0..3 * 70).map(|i| i as f32).collect();
        let mut s = vec![f32::NAN; 70];
        column_sums(&m, 70, &mut s);
        for (j, v) in s.iter().enumerate() {
            assert_eq!(*v, (j + (70 + j) + (140 + j)) as f32);
        }
    }
}
