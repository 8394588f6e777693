//! Differentiable attention on the CPU kernels: a candle [`CustomOp3`] on `(q, k, v)` whose
//! forward is the tiled kernel and whose backward is the FlashAttention-2-style kernel, so
//! candle's autograd sees the attention while it runs at kernel speed and in memory linear
//! in the sequence (see [`crate::dispatch`] for when it runs).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use crate::error::{Error, Result};
use crate::kernels;
use crate::mask::AttentionMask;

/// `softmax(scale * Q K^T + mask) V` as a candle op. The mask is a constant of the op.
struct SdpaOp {
    mask: Option<AttentionMask>,
    scale: f64,
}

/// The context `(batch, heads, seq_q, d_v)` f32 of `q`, `k`, `v` (f32 on the CPU), with a
/// backward to all three.
///
/// # Shapes
/// - `q`: `(batch, heads, seq_q, d_k)`, `k`: `(batch, kv_heads, seq_k, d_k)`,
///   `v`: `(batch, kv_heads, seq_k, d_v)`; checked by the caller
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&AttentionMask>,
    scale: f64,
) -> Result<Tensor> {
    let op = SdpaOp {
        mask: mask.filter(|m| !m.is_empty()).cloned(),
        scale,
    };
    // The kernels read rows with a contiguous last dimension.
    let rows = |t: &Tensor| -> Result<Tensor> {
        let (_, _, _, d) = t.dims4()?;
        Ok(if t.layout().stride()[3] != 1 && d > 1 {
            t.contiguous()?
        } else {
            t.clone()
        })
    };
    Ok(rows(q)?.apply_op3(&rows(k)?, &rows(v)?, op)?)
}

/// A tensor's dims as a `(batch, heads, seq, width)` quadruple.
fn dims4(l: &Layout) -> Result<(usize, usize, usize, usize)> {
    match l.dims() {
        &[b, h, s, d] => Ok((b, h, s, d)),
        d => Err(Error::Kernel(format!(
            "attention operands must be rank 4, found {d:?}"
        ))),
    }
}

impl CustomOp3 for SdpaOp {
    fn name(&self) -> &'static str {
        "candle-attention-sdpa"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let run = || -> Result<(CpuStorage, Shape)> {
            let (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) = (s1, s2, s3) else {
                return Err(Error::Kernel(format!(
                    "the differentiable CPU attention takes f32, found q {:?}, k {:?}, v {:?}",
                    s1.dtype(),
                    s2.dtype(),
                    s3.dtype()
                )));
            };
            let (b, h, sq, _) = dims4(l1)?;
            let (_, _, _, dv) = dims4(l3)?;
            let ctx = kernels::sdpa::attention_on_slices(
                (q, l1),
                (k, l2),
                (v, l3),
                self.mask.as_ref(),
                self.scale,
            )?;
            Ok((CpuStorage::F32(ctx), Shape::from((b, h, sq, dv))))
        };
        run().map_err(Error::into_candle)
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let run = || -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
            let grad = grad_res.to_dtype(candle_core::DType::F32)?.contiguous()?;
            let (dq, dk, dv) = kernels::sdpa::attention_backward(
                q,
                k,
                v,
                res,
                &grad,
                self.mask.as_ref(),
                self.scale,
            )?;
            Ok((Some(dq), Some(dk), Some(dv)))
        };
        run().map_err(Error::into_candle)
    }
}
