//! A differentiable self-attention layer on the CPU as one candle op: `(x, weights,
//! biases) -> output`, forward and backward on the kernels of `kernels::trainable_layer`
//! (see [`crate::dispatch`] for when it runs). Candle's autograd then sees one node where
//! the composition of candle ops has a dozen, each allocating its output and its gradient.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use crate::error::{Error, Result};
use crate::kernels::cpu_tensor::{storage_f32, CpuF32};
use crate::kernels::trainable_layer::{self, LayerShape, Saved};
use crate::mask::AttentionMask;

struct LayerOp {
    shape: LayerShape,
    mask: Option<AttentionMask>,
    /// The projection and context of the forward, for the backward.
    saved: Mutex<Option<Saved>>,
}

/// The layer's output `(batch, seq, out)` of `x` `(batch, seq, hidden)`, with gradients to
/// `x`, `w_qkv` and `rest`.
///
/// # Shapes
/// - `w_qkv`: `(q + k + v, hidden)`, or `(hidden, q + k + v)` with `shape.qkv_t`
/// - `rest`: `(q + k + v + out * heads * v_head_dim + out,)`: the Q/K/V biases, `W_O`, the
///   output biases (see [`LayerShape`])
pub(crate) fn self_attention(
    x: &Tensor,
    w_qkv: &Tensor,
    rest: &Tensor,
    shape: LayerShape,
    mask: Option<&AttentionMask>,
) -> Result<Tensor> {
    let op = LayerOp {
        shape,
        mask: mask.filter(|m| !m.is_empty()).cloned(),
        saved: Mutex::new(None),
    };
    Ok(x.contiguous()?
        .apply_op3(&w_qkv.contiguous()?, &rest.contiguous()?, op)?)
}

impl CustomOp3 for LayerOp {
    fn name(&self) -> &'static str {
        "candle-attention-self-attention-layer"
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
            let s = &self.shape;
            let (x, w, b) = (
                storage_f32(s1, l1, "x")?,
                storage_f32(s2, l2, "W_qkv")?,
                storage_f32(s3, l3, "biases and W_O")?,
            );
            let (y, saved) = trainable_layer::forward(s, x, w, b, self.mask.as_ref())?;
            if let Ok(mut slot) = self.saved.lock() {
                *slot = Some(saved);
            }
            Ok((
                CpuStorage::F32(y),
                Shape::from((s.batch, s.seq, s.out_cols())),
            ))
        };
        run().map_err(Error::into_candle)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let run = || -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
            let s = &self.shape;
            let dense =
                |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.contiguous()?) };
            let (xt, wt, bt, gt) = (dense(x)?, dense(w)?, dense(b)?, dense(grad_res)?);
            let (xc, wc, bc, gc) = (
                CpuF32::new(&xt, "x")?,
                CpuF32::new(&wt, "W_qkv")?,
                CpuF32::new(&bt, "biases and W_O")?,
                CpuF32::new(&gt, "output gradient")?,
            );
            let (xs, ws, bs, gs) = (
                xc.contiguous()?,
                wc.contiguous()?,
                bc.contiguous()?,
                gc.contiguous()?,
            );
            let mut slot = self
                .saved
                .lock()
                .map_err(|_| Error::Kernel("the layer's saved forward is poisoned".into()))?;
            if slot.is_none() {
                // Not kept (a forward that failed half-way cannot reach here): run it again.
                *slot = Some(trainable_layer::forward(s, xs, ws, bs, self.mask.as_ref())?.1);
            }
            let saved = slot
                .as_ref()
                .ok_or_else(|| Error::Kernel("the layer's forward was not saved".into()))?;
            let (dx, dw, db) =
                trainable_layer::backward(s, xs, ws, bs, saved, gs, self.mask.as_ref())?;
            Ok((
                Some(Tensor::from_vec(dx, x.shape(), x.device())?),
                Some(Tensor::from_vec(dw, w.shape(), w.device())?),
                Some(Tensor::from_vec(db, b.shape(), b.device())?),
            ))
        };
        run().map_err(Error::into_candle)
    }
}
