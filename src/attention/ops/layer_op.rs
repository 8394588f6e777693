//! A differentiable self-attention layer on the CPU as candle ops: `(x, W_qkv, W_O, biases)
//! -> output`, forward and backward on the kernels of `kernels::trainable_layer` (see
//! [`crate::attention::dispatch`] for when it runs). Candle's autograd then sees one node where the
//! composition of candle ops has a dozen, each allocating its output and its gradient.
//!
//! Candle's custom ops take at most three inputs, and every node between a variable and the
//! op costs a zeros tensor and an add of the variable's size per backward. So with `W_O` the
//! layer is two nodes that take every parameter as stored: a `bundle` of
//! `(biases, W_O)` whose output is one placeholder element, and the layer op on
//! `(x, W_qkv, bundle)`, which reads the bundle's inputs itself. The layer's backward (which
//! candle runs first) computes every gradient and hands the bundle its two.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use super::grad_pool;
use crate::attention::mask::{kernel_plan, AttentionMask};
use crate::error::{Error, Result};
use crate::kernels::attend::mask_plan::MaskPlan;
use crate::kernels::cpu_tensor::{storage_f32, CpuF32};
use crate::kernels::train::trainable_layer::{self, GradsInto, LayerShape, Params, Saved};

/// Gradients of the bundle's inputs `(biases, W_O)`, from the layer's backward to the
/// bundle's.
type Handoff = Arc<Mutex<Option<(Vec<f32>, Vec<f32>)>>>;

/// `W_O` and the biases with the handoff of their gradients (the layer op's third input is
/// then the bundle's placeholder).
struct Bundled {
    w_o: Tensor,
    biases: Tensor,
    grads: Handoff,
}

struct LayerOp {
    shape: LayerShape,
    mask: MaskPlan,
    /// The projection and context of the forward, for the backward.
    saved: Mutex<Option<Saved>>,
    /// `None`: no output projection, the op's third input is the biases.
    bundled: Option<Bundled>,
}

/// The placeholder node whose inputs are `(biases, W_O)`.
struct BundleOp {
    grads: Handoff,
}

/// The layer's output `(batch, seq, out)` of `x` `(batch, seq, hidden)`, with gradients to
/// every input that tracks them.
///
/// # Shapes
/// - `w_qkv`: `(q + k + v, hidden)`, or `(hidden, q + k + v)` with `shape.qkv_t`
/// - `w_o`: `(out, heads * v_head_dim)`, or `(heads * v_head_dim, out)` with `shape.o_t`;
///   `None` without an output projection
/// - `biases`: `(q + k + v + out,)`: the Q/K/V biases then the output biases (see
///   [`LayerShape`])
pub(crate) fn self_attention(
    x: &Tensor,
    w_qkv: &Tensor,
    w_o: Option<&Tensor>,
    biases: &Tensor,
    shape: LayerShape,
    mask: Option<&AttentionMask>,
) -> Result<Tensor> {
    let (x, w_qkv, biases) = (x.contiguous()?, w_qkv.contiguous()?, biases.contiguous()?);
    let mut op = LayerOp {
        shape,
        mask: kernel_plan(mask, shape.batch, shape.heads, shape.seq, shape.seq)?,
        saved: Mutex::new(None),
        bundled: None,
    };
    let third = match w_o {
        None => biases,
        Some(w_o) => {
            let w_o = w_o.contiguous()?;
            let grads: Handoff = Arc::new(Mutex::new(None));
            let token = biases.apply_op2(
                &w_o,
                BundleOp {
                    grads: grads.clone(),
                },
            )?;
            op.bundled = Some(Bundled { w_o, biases, grads });
            token
        }
    };
    Ok(x.apply_op3(&w_qkv, &third, op)?)
}

/// `v` as the gradient of `t` when `t` tracks gradients; `None` otherwise (candle sums each
/// returned gradient into a fresh tensor, so an unneeded one costs its size twice).
fn gradient_for(t: &Tensor, v: Vec<f32>) -> Result<Option<Tensor>> {
    Ok(if t.track_op() {
        Some(Tensor::from_vec(v, t.shape(), t.device())?)
    } else {
        None
    })
}

/// A tensor's f32 data, contiguous, on the CPU.
fn dense(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_dtype(DType::F32)?.contiguous()?)
}

impl LayerOp {
    /// Runs `f` on the parameters as flat slices: `W_qkv`, and `W_O` and the biases from the
    /// bundle, or the biases from `third`.
    fn with_params<T>(
        &self,
        w_qkv: &[f32],
        third: &[f32],
        f: impl FnOnce(Params) -> Result<T>,
    ) -> Result<T> {
        match &self.bundled {
            None => f(Params {
                w_qkv,
                w_o: &[],
                biases: third,
            }),
            Some(b) => {
                let (wo, bs) = (dense(&b.w_o)?, dense(&b.biases)?);
                let (wo, bs) = (CpuF32::new(&wo, "W_O")?, CpuF32::new(&bs, "biases")?);
                f(Params {
                    w_qkv,
                    w_o: wo.contiguous()?,
                    biases: bs.contiguous()?,
                })
            }
        }
    }
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
            let (x, w, third) = (
                storage_f32(s1, l1, "x")?,
                storage_f32(s2, l2, "W_qkv")?,
                storage_f32(s3, l3, "biases")?,
            );
            let (y, saved) =
                self.with_params(w, third, |p| trainable_layer::forward(s, x, p, &self.mask))?;
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
        third: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let run = || -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
            let s = &self.shape;
            let (xt, wt, tt, gt) = (dense(x)?, dense(w)?, dense(third)?, dense(grad_res)?);
            let (xc, wc, tc, gc) = (
                CpuF32::new(&xt, "x")?,
                CpuF32::new(&wt, "W_qkv")?,
                CpuF32::new(&tt, "biases")?,
                CpuF32::new(&gt, "output gradient")?,
            );
            let (xs, ws, ts, gs) = (
                xc.contiguous()?,
                wc.contiguous()?,
                tc.contiguous()?,
                gc.contiguous()?,
            );
            let mut slot = self
                .saved
                .lock()
                .map_err(|_| Error::Kernel("the layer's saved forward is poisoned".into()))?;
            let mask = &self.mask;
            if slot.is_none() {
                // Not kept (a forward that failed half-way cannot reach here): run it again.
                let saved =
                    self.with_params(ws, ts, |p| trainable_layer::forward(s, xs, p, mask))?;
                *slot = Some(saved.1);
            }
            let saved = slot
                .as_ref()
                .ok_or_else(|| Error::Kernel("the layer's forward was not saved".into()))?;
            // `x`'s and `W_qkv`'s gradients go to tensors kept from step to step.
            let mut other = None;
            let (gx, gw) = grad_pool::two_gradients(
                (x.elem_count(), w.elem_count()),
                (x.shape(), w.shape()),
                |dx, dw| {
                    let into = GradsInto { x: dx, w_qkv: dw };
                    other = Some(self.with_params(ws, ts, |p| {
                        trainable_layer::backward(s, xs, p, saved, gs, mask, into)
                    })?);
                    Ok(())
                },
            )?;
            let g =
                other.ok_or_else(|| Error::Kernel("the layer's backward did not run".into()))?;
            let third_grad = match &self.bundled {
                None => gradient_for(third, g.biases)?,
                Some(b) => {
                    let mut handoff = b.grads.lock().map_err(|_| {
                        Error::Kernel("the layer's gradient handoff is poisoned".into())
                    })?;
                    *handoff = Some((g.biases, g.w_o));
                    // The placeholder's gradient: it only routes the backward to the bundle.
                    gradient_for(third, vec![0.0; third.elem_count()])?
                }
            };
            let keep = |t: &Tensor, g: Tensor| t.track_op().then_some(g);
            Ok((keep(x, gx), keep(w, gw), third_grad))
        };
        run().map_err(Error::into_candle)
    }
}

impl CustomOp2 for BundleOp {
    fn name(&self) -> &'static str {
        "candle-attention-layer-parameters"
    }

    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(1)))
    }

    fn bwd(
        &self,
        biases: &Tensor,
        w_o: &Tensor,
        _res: &Tensor,
        _grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let run = || -> Result<(Option<Tensor>, Option<Tensor>)> {
            let (db, dw) = self
                .grads
                .lock()
                .map_err(|_| Error::Kernel("the layer's gradient handoff is poisoned".into()))?
                .take()
                .ok_or_else(|| {
                    Error::Kernel("the layer's backward did not hand over W_O's gradient".into())
                })?;
            Ok((gradient_for(biases, db)?, gradient_for(w_o, dw)?))
        };
        run().map_err(Error::into_candle)
    }
}
