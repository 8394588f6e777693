//! The CPU kernels behind [`crate::scaled_dot_product_attention`]: Q, K and V read in place
//! (any strides with a contiguous last dimension, so a `transpose(1, 2)` view costs nothing),
//! f16 / bf16 computed in f32.

use candle_core::{DType, Device, Layout, Tensor};

use super::cpu_tensor::CpuF32;
use super::mask_plan::MaskPlan;
use super::matrix::SharedOut;
use super::problem::{Operand, OutOperand, Problem};
use super::{run, WeightsMode};
use crate::error::{Error, Result};
use crate::mask::AttentionMask;

/// `t` in f32 with a contiguous last dimension (a no-op for most inputs).
fn f32_rows(t: &Tensor) -> Result<Tensor> {
    let t = t.to_dtype(DType::F32)?;
    let (_, _, _, d) = t.dims4()?;
    let stride = t.layout().stride();
    Ok(if stride[3] != 1 && d > 1 {
        t.contiguous()?
    } else {
        t
    })
}

/// Sizes of one call: `(batch, heads, kv_heads, seq_q, seq_k, d_k, d_v)`.
type Sizes = (usize, usize, usize, usize, usize, usize, usize);

/// Builds the [`Problem`] of `q`, `k`, `v` under `mask` (its plan borrowed for the call),
/// checks it and hands it to `f`.
fn with_problem<R>(
    (q, k, v): (Operand<'_>, Operand<'_>, Operand<'_>),
    (b, h, kvh, sq, sk, dk, dv): Sizes,
    mask: Option<&AttentionMask>,
    scale: f64,
    f: impl FnOnce(&Problem<'_>) -> Result<R>,
) -> Result<R> {
    let plan = MaskPlan::new(mask, b, h, sq, sk)?;
    let dense = plan.dense().map(|t| CpuF32::new(t, "mask")).transpose()?;
    let problem = Problem {
        batch: b,
        heads: h,
        kv_heads: kvh,
        seq_q: sq,
        seq_k: sk,
        dk,
        dv,
        q,
        k,
        v,
        scale: scale as f32,
        mask: plan.kernel_mask(dense.as_ref())?,
    };
    problem.validate()?;
    f(&problem)
}

/// The log-sum-exp slots of `rows` query rows, set to `-inf` (rows that see no key are left
/// alone by the kernels).
fn lse_slots(lse: Option<&mut [f32]>, rows: usize) -> Result<Option<SharedOut<'_>>> {
    match lse {
        Some(l) if l.len() == rows => {
            l.fill(f32::NEG_INFINITY);
            Ok(Some(SharedOut::new(l)))
        }
        Some(l) => Err(Error::Kernel(format!(
            "{} log-sum-exp slots for {rows} query rows",
            l.len()
        ))),
        None => Ok(None),
    }
}

/// Context `(batch, heads, seq_q, d_v)` in `v`'s dtype, and the weights `(batch, heads,
/// seq_q, seq_k)` f32 in [`WeightsMode::Return`]. Shapes were checked by the caller.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&AttentionMask>,
    scale: f64,
    mode: WeightsMode<'_>,
) -> Result<(Tensor, Option<Tensor>)> {
    let (b, h, sq, dk) = q.dims4()?;
    let (_, kvh, sk, _) = k.dims4()?;
    let (_, _, _, dv) = v.dims4()?;
    let out_dtype = v.dtype();
    if matches!(mode, WeightsMode::Skip) && mask.is_none_or(AttentionMask::is_empty) {
        // A decode step on a half-precision cache: read as stored, no f32 copy.
        if let Some(context) = super::one_query::attention(q, k, v, scale)? {
            return Ok((context, None));
        }
    }
    let (q, k, v) = (f32_rows(q)?, f32_rows(k)?, f32_rows(v)?);
    let (qs, ks, vs) = (
        CpuF32::new(&q, "q")?,
        CpuF32::new(&k, "k")?,
        CpuF32::new(&v, "v")?,
    );
    let mut ctx = vec![0f32; b * h * sq * dv];
    let operands = (qs.operand()?, ks.operand()?, vs.operand()?);
    let weights = with_problem(operands, (b, h, kvh, sq, sk, dk, dv), mask, scale, |p| {
        let out = OutOperand {
            buf: SharedOut::new(&mut ctx),
            offset: 0,
            sb: h * sq * dv,
            sh: sq * dv,
            sr: dv,
            lse: None,
        };
        run(p, &out, mode)
    })?;
    let context = Tensor::from_vec(ctx, (b, h, sq, dv), &Device::Cpu)?.to_dtype(out_dtype)?; // (b, h, sq, dv)
    let weights = weights
        .map(|w| Tensor::from_vec(w, (b, h, sq, sk), &Device::Cpu)) // (b, h, sq, sk)
        .transpose()?;
    Ok((context, weights))
}

/// A rank-4 operand straight from a storage slice and its layout (last dimension contiguous).
fn operand<'a>(data: &'a [f32], l: &Layout, name: &str) -> Result<Operand<'a>> {
    let (dims, stride) = (l.dims(), l.stride());
    if dims.len() != 4 || (stride[3] != 1 && dims[3] > 1) {
        return Err(Error::Kernel(format!(
            "`{name}` must be rank 4 with a contiguous last dimension, found dims {dims:?} strides {stride:?}"
        )));
    }
    Ok(Operand {
        data,
        offset: l.start_offset(),
        sb: stride[0],
        sh: stride[1],
        sr: stride[2],
    })
}

/// The context `(batch, heads, seq_q, d_v)` of f32 storages (the forward of the
/// differentiable op, which sees storages rather than tensors).
pub(crate) fn attention_on_slices(
    q: (&[f32], &Layout),
    k: (&[f32], &Layout),
    v: (&[f32], &Layout),
    mask: Option<&AttentionMask>,
    scale: f64,
    lse: Option<&mut [f32]>,
) -> Result<Vec<f32>> {
    let (qo, ko, vo) = (
        operand(q.0, q.1, "q")?,
        operand(k.0, k.1, "k")?,
        operand(v.0, v.1, "v")?,
    );
    let d4 = |l: &Layout| -> Result<[usize; 4]> {
        l.dims()
            .try_into()
            .map_err(|_| Error::Kernel(format!("rank 4 expected, found {:?}", l.dims())))
    };
    let [b, h, sq, dk] = d4(q.1)?;
    let [_, kvh, sk, _] = d4(k.1)?;
    let [_, _, _, dv] = d4(v.1)?;
    let mut ctx = vec![0f32; b * h * sq * dv];
    let lse = lse_slots(lse, b * h * sq)?;
    with_problem(
        (qo, ko, vo),
        (b, h, kvh, sq, sk, dk, dv),
        mask,
        scale,
        |p| {
            let out = OutOperand {
                buf: SharedOut::new(&mut ctx),
                offset: 0,
                sb: h * sq * dv,
                sh: sq * dv,
                sr: dv,
                lse,
            };
            run(p, &out, WeightsMode::Skip).map(|_| ())
        },
    )?;
    Ok(ctx)
}

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
    mask: Option<&AttentionMask>,
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
    let operands = (qs.operand()?, ks.operand()?, vs.operand()?);
    let (o, d_o) = (os.operand()?, dos.operand()?);
    let (gq, gk, gv) = with_problem(operands, (b, h, kvh, sq, sk, dk, dv), mask, scale, |p| {
        super::backward::attention_backward(p, o, d_o, lse)
    })?;
    Ok((
        Tensor::from_slice(&gq, (b, h, sq, dk), &Device::Cpu)?, // (b, h, sq, dk)
        Tensor::from_slice(&gk, (b, kvh, sk, dk), &Device::Cpu)?, // (b, kvh, sk, dk)
        Tensor::from_slice(&gv, (b, kvh, sk, dv), &Device::Cpu)?, // (b, kvh, sk, dv)
    ))
}

/// The heads of one of Q, K or V inside a row-major `(batch * seq, cols)` f32 matrix (a fused
/// projection's output): head `h` of row `(b, i)` is `data[offset + (b * seq + i) * cols +
/// col0 + h * width ..][..width]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackedHeads<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub seq: usize,
    pub cols: usize,
    pub col0: usize,
    pub heads: usize,
    pub width: usize,
}

impl<'a> PackedHeads<'a> {
    fn operand(&self) -> Operand<'a> {
        Operand {
            data: self.data,
            offset: self.offset + self.col0,
            sb: self.seq * self.cols,
            sh: self.width,
            sr: self.cols,
        }
    }
}

/// The problem of `q`, `k` and `v` in packed form, built and handed to `f`.
fn with_packed_problem<R>(
    batch: usize,
    (q, k, v): (PackedHeads<'_>, PackedHeads<'_>, PackedHeads<'_>),
    mask: Option<&AttentionMask>,
    scale: f64,
    f: impl FnOnce(&Problem<'_>) -> Result<R>,
) -> Result<R> {
    if k.seq != v.seq || k.heads != v.heads || q.width != k.width {
        return Err(Error::Kernel(format!(
            "packed heads do not fit together: q {} x {}, k {} x {} over {} keys, v {} x {} over {}",
            q.heads, q.width, k.heads, k.width, k.seq, v.heads, v.width, v.seq
        )));
    }
    let sizes = (batch, q.heads, k.heads, q.seq, k.seq, q.width, v.width);
    let operands = (q.operand(), k.operand(), v.operand());
    with_problem(operands, sizes, mask, scale, f)
}

/// The context of packed Q, K, V into `ctx`, `(batch * seq_q, heads * d_v)` rows with the
/// heads merged (overwritten), and each
/// query row's log-sum-exp into `lse`, `(batch, heads, seq_q)`, when given (for the
/// backward).
pub(crate) fn packed_attention_into(
    batch: usize,
    qkv: (PackedHeads<'_>, PackedHeads<'_>, PackedHeads<'_>),
    mask: Option<&AttentionMask>,
    scale: f64,
    ctx: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    with_packed_problem(batch, qkv, mask, scale, |p| {
        let (h, sq, dv) = (p.heads, p.seq_q, p.dv);
        if ctx.len() != batch * sq * h * dv {
            return Err(Error::Kernel(format!(
                "context buffer of {} for ({batch} x {sq}, {h} x {dv})",
                ctx.len()
            )));
        }
        // Rows that see no key are left alone by the kernels: they must read as zeros.
        ctx.fill(0.0);
        let lse = lse_slots(lse, batch * h * sq)?;
        let out = OutOperand {
            buf: SharedOut::new(ctx),
            offset: 0,
            sb: sq * h * dv,
            sh: dv,
            sr: h * dv,
            lse,
        };
        run(p, &out, WeightsMode::Skip)?;
        Ok(())
    })
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
    (mask, scale, lse): (Option<&AttentionMask>, f64, Option<&[f32]>),
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
        super::backward::attention_backward(p, ctx_rows(o), ctx_rows(d_o), lse)
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
    use super::super::tests::values;
    use super::*;

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
        packed_attention_into(b, heads, None, 0.3, &mut ctx, Some(&mut lse))?;
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
                (None, 0.3, Some(&lse)),
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
