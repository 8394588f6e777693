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
    let (q, k, v) = (f32_rows(q)?, f32_rows(k)?, f32_rows(v)?);
    let (qs, ks, vs) = (
        CpuF32::new(&q, "q")?,
        CpuF32::new(&k, "k")?,
        CpuF32::new(&v, "v")?,
    );
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
        q: qs.operand()?,
        k: ks.operand()?,
        v: vs.operand()?,
        scale: scale as f32,
        mask: plan.kernel_mask(dense.as_ref())?,
    };
    let mut ctx = vec![0f32; b * h * sq * dv];
    let weights = {
        let out = OutOperand {
            buf: SharedOut::new(&mut ctx),
            offset: 0,
            sb: h * sq * dv,
            sh: sq * dv,
            sr: dv,
        };
        run(&problem, &out, mode)?
    };
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
        q: qo,
        k: ko,
        v: vo,
        scale: scale as f32,
        mask: plan.kernel_mask(dense.as_ref())?,
    };
    problem.validate()?;
    let mut ctx = vec![0f32; b * h * sq * dv];
    {
        let out = OutOperand {
            buf: SharedOut::new(&mut ctx),
            offset: 0,
            sb: h * sq * dv,
            sh: sq * dv,
            sr: dv,
        };
        run(&problem, &out, WeightsMode::Skip)?;
    }
    Ok(ctx)
}

/// Gradients `(dq, dk, dv)` of the attention of `q`, `k`, `v` (f32 on the CPU) whose output
/// was `o`, given `d_o`.
///
/// # Shapes
/// - `q`: `(batch, heads, seq_q, d_k)`, `k`: `(batch, kv_heads, seq_k, d_k)`,
///   `v`: `(batch, kv_heads, seq_k, d_v)`, `o` and `d_o`: `(batch, heads, seq_q, d_v)`
/// - returns tensors of the shapes of `q`, `k` and `v`
pub(crate) fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    d_o: &Tensor,
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
        q: qs.operand()?,
        k: ks.operand()?,
        v: vs.operand()?,
        scale: scale as f32,
        mask: plan.kernel_mask(dense.as_ref())?,
    };
    problem.validate()?;
    let (gq, gk, gv) =
        super::backward::attention_backward(&problem, os.operand()?, dos.operand()?)?;
    Ok((
        Tensor::from_vec(gq, (b, h, sq, dk), &Device::Cpu)?, // (b, h, sq, dk)
        Tensor::from_vec(gk, (b, kvh, sk, dk), &Device::Cpu)?, // (b, kvh, sk, dk)
        Tensor::from_vec(gv, (b, kvh, sk, dv), &Device::Cpu)?, // (b, kvh, sk, dv)
    ))
}
