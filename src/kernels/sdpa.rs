//! The CPU kernels behind [`crate::scaled_dot_product_attention`]: Q, K and V read in place
//! (any strides with a contiguous last dimension, so a `transpose(1, 2)` view costs nothing),
//! f16 / bf16 computed in f32.

use candle_core::{DType, Device, Tensor};

use super::cpu_tensor::CpuF32;
use super::mask_plan::MaskPlan;
use super::matrix::SharedOut;
use super::problem::{OutOperand, Problem};
use super::{run, WeightsMode};
use crate::error::Result;
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
