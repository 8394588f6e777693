//! The attention backward on candle tensors and on packed projection buffers: the tile
//! kernel of [`crate::kernels::train::backward`] with its gradients written in the layout
//! of the inputs (heads of a fused Q/K/V projection scattered back into its columns).

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::kernels::attend::mask_plan::MaskPlan;
use crate::kernels::attend::on_tensors::{
    f32_rows, tensor_operand, with_packed_problem, with_problem, PackedHeads,
};
use crate::kernels::attend::problem::Operand;
use crate::kernels::cpu_tensor::CpuF32;
use crate::kernels::train::backward;

/// Gradients `(dq, dk, dv)` of the attention of `q`, `k`, `v` (f32 on the CPU) whose output
/// was `o`, given `d_o` and, when the forward kept them, the rows' log-sum-exps.
///
/// # Shapes
/// - `q`: `(batch, heads, seq_q, d_k)`, `k`: `(batch, kv_heads, seq_k, d_k)`,
///   `v`: `(batch, kv_heads, seq_k, d_v)`, `o` and `d_o`: `(batch, heads, seq_q, d_v)`
/// - returns tensors of the shapes of `q`, `k` and `v`
pub(crate) fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (o, d_o, lse): (&Tensor, &Tensor, Option<&[f32]>),
    mask: &MaskPlan,
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, h, sq, dk) = q.dims4()?;
    let (_, kvh, sk, _) = k.dims4()?;
    let (_, _, _, dv) = v.dims4()?;
    let rows = |t: &Tensor| f32_rows(t);
    let (q, k, v, o, d_o) = (rows(q)?, rows(k)?, rows(v)?, rows(o)?, rows(d_o)?);
    let (qs, ks, vs, os, dos) = (
        CpuF32::new(&q, "q")?,
        CpuF32::new(&k, "k")?,
        CpuF32::new(&v, "v")?,
        CpuF32::new(&o, "o")?,
        CpuF32::new(&d_o, "d_o")?,
    );
    let operands = (
        tensor_operand(&qs, "q")?,
        tensor_operand(&ks, "k")?,
        tensor_operand(&vs, "v")?,
    );
    let (o, d_o) = (tensor_operand(&os, "o")?, tensor_operand(&dos, "d_o")?);
    let (gq, gk, gv) = with_problem(operands, (b, h, kvh, sq, sk, dk, dv), mask, scale, |p| {
        backward::attention_backward(p, o, d_o, lse)
    })?;
    Ok((
        Tensor::from_slice(&gq, (b, h, sq, dk), &Device::Cpu)?, // (b, h, sq, dk)
        Tensor::from_slice(&gk, (b, kvh, sk, dk), &Device::Cpu)?, // (b, kvh, sk, dk)
        Tensor::from_slice(&gv, (b, kvh, sk, dv), &Device::Cpu)?, // (b, kvh, sk, dv)
    ))
}

/// Where one gradient goes: columns `col0..col0 + heads * width` of a `(batch * seq, cols)`
/// row-major buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackedGrad {
    pub cols: usize,
    pub col0: usize,
}

/// Gradients of [`packed_attention_into`] given the context `o` and its gradient `d_o` (both
/// `(batch * seq_q, heads * d_v)` rows) and, when the forward kept them, the rows'
/// log-sum-exps, written into `dst` buffers in the packed layout of
/// the inputs: `dst.0` receives dQ, `dst.1` dK and dV (the same buffer for self-attention,
/// where `dq_at`, `dk_at` and `dv_at` pick the columns).
#[allow(clippy::too_many_arguments)]
pub(crate) fn packed_attention_backward(
    batch: usize,
    qkv: (PackedHeads<'_>, PackedHeads<'_>, PackedHeads<'_>),
    o: &[f32],
    d_o: &[f32],
    (mask, scale, lse): (&MaskPlan, f64, Option<&[f32]>),
    (dq_buf, dq_at): (&mut [f32], PackedGrad),
    kv_dst: Option<&mut [f32]>,
    (dk_at, dv_at): (PackedGrad, PackedGrad),
) -> Result<()> {
    let (q, k, v) = qkv;
    let (sq, sk) = (q.seq, k.seq);
    let (gq, gk, gv) = with_packed_problem(batch, qkv, mask, scale, |p| {
        let (h, dv) = (p.heads, p.dv);
        let ctx_rows = |data| Operand {
            data,
            offset: 0,
            sb: sq * h * dv,
            sh: dv,
            sr: h * dv,
        };
        backward::attention_backward(p, ctx_rows(o), ctx_rows(d_o), lse)
    })?;
    scatter_heads(&gq, dq_buf, batch, sq, q.heads, q.width, dq_at)?;
    let kv_buf = match kv_dst {
        Some(buf) => buf,
        None => dq_buf,
    };
    scatter_heads(&gk, kv_buf, batch, sk, k.heads, k.width, dk_at)?;
    scatter_heads(&gv, kv_buf, batch, sk, v.heads, v.width, dv_at)
}

/// Copies contiguous `(batch, heads, seq, width)` values into columns of packed rows.
fn scatter_heads(
    src: &[f32],
    dst: &mut [f32],
    batch: usize,
    seq: usize,
    heads: usize,
    width: usize,
    at: PackedGrad,
) -> Result<()> {
    use rayon::prelude::*;
    if at.col0 + heads * width > at.cols
        || dst.len() != batch * seq * at.cols
        || src.len() != batch * heads * seq * width
    {
        return Err(Error::Kernel(format!(
            "gradient of {heads} x {width} columns from {} does not fit rows of {} ({} values for {batch} x {seq})",
            at.col0,
            at.cols,
            dst.len()
        )));
    }
    if at.cols == 0 {
        return Ok(());
    }
    dst.par_chunks_mut(at.cols)
        .enumerate()
        .for_each(|(row, dst_row)| {
            let (b, i) = (row / seq, row % seq);
            for hh in 0..heads {
                let s = ((b * heads + hh) * seq + i) * width;
                let d = at.col0 + hh * width;
                dst_row[d..d + width].copy_from_slice(&src[s..s + width]);
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attend::on_tensors::packed_attention_into;
    use crate::kernels::attend::tests::values;

    /// dQ, dK and dV in the projection's columns for self-attention (one buffer) or
    /// cross-attention (dQ apart), run in a pool of `threads`.
    fn gradients(threads: usize, cross: bool) -> Result<(Vec<f32>, Vec<f32>)> {
        // One (batch, kv head) group and keys over three 256-key tiles: with more threads
        // its keys are cut into chunks whose dQ partials are added into strided rows.
        let (b, h, kvh, t, d) = (1, 2, 1, 600, 8);
        let c = h * d + 2 * kvh * d;
        let qkv = values(b * t * c, 1);
        let o = values(b * t * h * d, 2);
        let d_o = values(b * t * h * d, 3);
        let at = |col0, heads| PackedHeads {
            data: &qkv,
            offset: 0,
            seq: t,
            cols: c,
            col0,
            heads,
            width: d,
        };
        let heads = (at(0, h), at(h * d, kvh), at(h * d + kvh * d, kvh));
        let mut lse = vec![0f32; b * h * t];
        let mut ctx = vec![0f32; b * t * h * d];
        packed_attention_into(
            b,
            heads,
            &MaskPlan::default(),
            0.3,
            &mut ctx,
            Some(&mut lse),
        )?;
        // Garbage where the gradients go: the backward must overwrite it.
        let mut dq = vec![f32::NAN; b * t * c];
        let mut kv = vec![f32::NAN; b * t * c];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| Error::Kernel(e.to_string()))?;
        let grad = |col0| PackedGrad { cols: c, col0 };
        pool.install(|| {
            packed_attention_backward(
                b,
                heads,
                &o,
                &d_o,
                (&MaskPlan::default(), 0.3, Some(&lse)),
                (&mut dq, grad(0)),
                if cross { Some(&mut kv) } else { None },
                (grad(h * d), grad(h * d + kvh * d)),
            )
        })?;
        Ok((dq, kv))
    }

    #[test]
    fn packed_gradients_with_key_chunks_equal_one_chunk() -> Result<()> {
        for cross in [false, true] {
            let (one_q, one_kv) = gradients(1, cross)?;
            let (many_q, many_kv) = gradients(3, cross)?;
            let d = 8;
            for (i, (a, b)) in one_q.iter().zip(&many_q).enumerate() {
                let written = !cross || i % 32 < 2 * d;
                if written {
                    assert!(a.is_finite(), "cross {cross}: element {i} not written");
                    assert!((a - b).abs() <= 1e-5, "cross {cross}: {i}: {a} vs {b}");
                } else {
                    assert!(a.is_nan() && b.is_nan(), "cross {cross}: {i} written");
                }
            }
            if cross {
                for (i, (a, b)) in one_kv.iter().zip(&many_kv).enumerate() {
                    if i % 32 >= 2 * d {
                        assert!(a.is_finite() && (a - b).abs() <= 1e-5, "kv {i}: {a} vs {b}");
                    } else {
                        assert!(a.is_nan(), "kv {i} written");
                    }
                }
            }
        }
        Ok(())
    }
}
