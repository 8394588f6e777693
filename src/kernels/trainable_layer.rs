//! The whole multi-head self-attention layer, forward and backward, on f32 slices: the
//! fused Q/K/V projection, the attention reading the heads in place, `W_O`, and their
//! gradients. It runs inside one candle op (`crate::layer_op`), so that a training step
//! makes a handful of large buffers (kept from step to step) instead of one per candle op.

use rayon::prelude::*;

use super::matrix::{matmul, MatMut, MatRef, Threads};
use super::projection::linear_into;
use super::scratch::TrainingBuffer;
use super::sdpa::{packed_attention_backward, packed_attention_into, PackedGrad, PackedHeads};
use crate::error::{Error, Result};
use crate::mask::AttentionMask;

/// Sizes of the layer. Its weights arrive as one flat vector: `W_qkv` `(qkv_cols, hidden)`
/// then `W_O` `(out, heads * v_head_dim)`, both row-major `(out, in)`; its biases as
/// `qkv_cols` then `out` values (zeros where the checkpoint has none).
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
    /// Elements of the flat weight vector.
    pub fn weight_len(&self) -> usize {
        self.qkv_cols() * self.hidden + self.out.map_or(0, |o| o * self.ctx_cols())
    }
    /// Elements of the flat bias vector.
    pub fn bias_len(&self) -> usize {
        self.qkv_cols() + self.out.unwrap_or(0)
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
    fn check(&self, x: &[f32], w: &[f32], b: &[f32]) -> Result<()> {
        if x.len() != self.rows() * self.hidden
            || w.len() != self.weight_len()
            || b.len() != self.bias_len()
        {
            return Err(Error::Kernel(format!(
                "layer of {self:?}: x {} (want {}), weights {} (want {}), biases {} (want {})",
                x.len(),
                self.rows() * self.hidden,
                w.len(),
                self.weight_len(),
                b.len(),
                self.bias_len()
            )));
        }
        Ok(())
    }
}

/// What the forward keeps for the backward: the projection rows `(batch * seq, q | k | v)`
/// and the merged context `(batch * seq, heads * v_head_dim)`.
#[derive(Debug)]
pub(crate) struct Saved {
    qkv: TrainingBuffer,
    ctx: TrainingBuffer,
}

fn threads() -> Threads {
    Threads::Pool(rayon::current_num_threads())
}

/// The layer's output `(batch * seq, out)` for `x` `(batch * seq, hidden)`, and what the
/// backward needs.
pub(crate) fn forward(
    s: &LayerShape,
    x: &[f32],
    w: &[f32],
    b: &[f32],
    mask: Option<&AttentionMask>,
) -> Result<(Vec<f32>, Saved)> {
    s.check(x, w, b)?;
    let (n, c) = (s.rows(), s.qkv_cols());
    let xm = MatRef::row_major(x, n, s.hidden)?;
    let w_qkv = MatRef::row_major(&w[..c * s.hidden], c, s.hidden)?; // (q+k+v, hidden)
    let mut qkv = TrainingBuffer::new(n * c);
    linear_into(&mut qkv, xm, w_qkv.t(), Some(&b[..c]))?; // (n, q+k+v)
    let mut ctx = TrainingBuffer::new(n * s.ctx_cols());
    packed_attention_into(s.batch, s.heads_of(&qkv), mask, s.scale, &mut ctx)?; // (n, h*vhd)
    let out = match s.out {
        Some(o) => {
            let w_o = MatRef::row_major(&w[c * s.hidden..], o, s.ctx_cols())?; // (out, h*vhd)
            let mut y = vec![0f32; n * o];
            let cm = MatRef::row_major(&ctx, n, s.ctx_cols())?;
            linear_into(&mut y, cm, w_o.t(), Some(&b[c..]))?; // (n, out)
            y
        }
        None => ctx.to_vec(),
    };
    Ok((out, Saved { qkv, ctx }))
}

/// Gradients `(dx, dw, db)` of the layer (flat, in the layouts of `x`, `w` and `b`) given
/// the gradient `d_out` `(batch * seq, out)` of its output.
pub(crate) fn backward(
    s: &LayerShape,
    x: &[f32],
    w: &[f32],
    b: &[f32],
    saved: &Saved,
    d_out: &[f32],
    mask: Option<&AttentionMask>,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    s.check(x, w, b)?;
    let (n, c, hv) = (s.rows(), s.qkv_cols(), s.ctx_cols());
    if d_out.len() != n * s.out_cols() {
        return Err(Error::Kernel(format!(
            "output gradient of {} for ({n}, {})",
            d_out.len(),
            s.out_cols()
        )));
    }
    let mut dw = vec![0f32; s.weight_len()];
    let mut db = vec![0f32; s.bias_len()];
    let (dw_qkv, dw_o) = dw.split_at_mut(c * s.hidden);
    let (db_qkv, db_o) = db.split_at_mut(c);
    // Through W_O: dW_O = dY^T ctx, db_O = colsum(dY), d_ctx = dY W_O.
    let mut d_ctx_buf;
    let d_ctx: &[f32] = match s.out {
        Some(o) => {
            let dy = MatRef::row_major(d_out, n, o)?;
            let cm = MatRef::row_major(&saved.ctx, n, hv)?;
            matmul(
                &mut MatMut::new(dw_o, 0, o, hv, hv)?,
                dy.t(),
                cm,
                false,
                1.0,
                threads(),
            )?; // (out, h*vhd)
            column_sums(d_out, o, db_o);
            let w_o = MatRef::row_major(&w[c * s.hidden..], o, hv)?;
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
        mask,
        s.scale,
        (&mut d_qkv, at(0)),
        None,
        (at(q_cols), at(q_cols + s.kv_heads * s.head_dim)),
    )?;
    // Through the projection: dW = dQKV^T x, db = colsum(dQKV), dx = dQKV W.
    let dq = MatRef::row_major(&d_qkv, n, c)?;
    let xm = MatRef::row_major(x, n, s.hidden)?;
    matmul(
        &mut MatMut::new(dw_qkv, 0, c, s.hidden, s.hidden)?,
        dq.t(),
        xm,
        false,
        1.0,
        threads(),
    )?; // (q+k+v, hidden)
    column_sums(&d_qkv, c, db_qkv);
    let mut dx = vec![0f32; n * s.hidden];
    let w_qkv = MatRef::row_major(&w[..c * s.hidden], c, s.hidden)?;
    matmul(
        &mut MatMut::new(&mut dx, 0, n, s.hidden, s.hidden)?,
        dq,
        w_qkv,
        false,
        1.0,
        threads(),
    )?; // (n, hidden)
    Ok((dx, dw, db))
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
