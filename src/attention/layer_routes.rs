//! The bodies of a multi-head layer's routes (which one runs is decided by
//! [`crate::attention::dispatch`]):
//! - [`fused`]: the whole layer on the CPU kernels (`Route::FusedLayer`);
//! - [`trainable_self`]: self-attention as one differentiable op on the CPU kernels
//!   (`Route::CpuKernelsTrainable` without `kv`);
//! - [`composed`]: the projections as tensors, then scaled dot-product attention on the
//!   route's implementation, then the heads merged and `W_O` (every other route; for
//!   cross-attention on `Route::CpuKernelsTrainable`, the two projections as one op).

use candle_core::Tensor;

use crate::attention::dispatch::Route;
use crate::attention::mask::{kernel_plan, AttentionMask};
use crate::attention::ops::layer_op;
use crate::attention::ops::sdpa_op::{self, PackedSizes};
use crate::attention::output::AttentionOutput;
use crate::attention::projections::{linear_in_out, LayerProjections};
use crate::attention::sdpa::{self, scaled_dot_product_attention_streamed};
use crate::error::{Error, Result};
use crate::kernels::attend::fused_layer::{self, FusedLayer};
use crate::kernels::attend::WeightsMode;
use crate::kernels::train::trainable_layer::LayerShape;

/// One call of a layer: queries from `x`, keys and values from `kv` (`None`:
/// self-attention), under `mask` (the causal part already combined), scaled by `scale`.
///
/// # Shapes
/// - `x`: `(batch, seq_q, hidden)`, `kv`: `(batch, seq_k, kv_hidden)` (checked by the layer)
#[derive(Clone, Copy)]
pub(crate) struct LayerCall<'a> {
    pub x: &'a Tensor,
    pub kv: Option<&'a Tensor>,
    pub mask: Option<&'a AttentionMask>,
    pub scale: f64,
}

impl LayerCall<'_> {
    /// `(batch, seq_q, seq_k)`.
    fn sizes(&self) -> Result<(usize, usize, usize)> {
        let (b, t, _) = self.x.dims3()?;
        let s = match self.kv {
            Some(kv) => kv.dims3()?.1,
            None => t,
        };
        Ok((b, t, s))
    }
}

/// The whole layer on the CPU kernels (f32 weights they read, nothing tracking gradients).
///
/// # Shapes
/// - returns `context` `(batch, seq_q, out)`, `weights` `(batch, heads, seq_q, seq_k)` in
///   [`WeightsMode::Return`]
pub(crate) fn fused(
    p: &LayerProjections,
    call: LayerCall<'_>,
    mode: WeightsMode<'_>,
) -> Result<AttentionOutput> {
    let Some((qkv, qkv_bias, out)) = p.fused_weights() else {
        return Err(Error::Kernel(
            "the fused route needs f32 CPU weights with Q/K/V fused".into(),
        ));
    };
    let d = p.dims;
    let layer = FusedLayer {
        qkv,
        qkv_bias,
        out,
        out_bias: p.out_proj.as_ref().and_then(|o| o.bias.as_ref()),
        heads: d.heads,
        kv_heads: d.kv_heads,
        head_dim: d.head_dim,
        v_head_dim: d.v_head_dim,
        scale: call.scale,
    };
    let (b, t, s) = call.sizes()?;
    let plan = kernel_plan(call.mask, b, d.heads, t, s)?;
    let (context, weights) = fused_layer::forward(&layer, call.x, call.kv, &plan, mode)?;
    Ok(AttentionOutput { context, weights })
}

/// Self-attention as one differentiable op on the CPU kernels: gradients to `x` and to every
/// parameter that tracks them, in its checkpoint layout.
///
/// # Shapes
/// - returns `context` `(batch, seq, out)`, no weights
pub(crate) fn trainable_self(p: &LayerProjections, call: LayerCall<'_>) -> Result<AttentionOutput> {
    let (b, t, hidden) = call.x.dims3()?;
    let d = p.dims;
    let (w_qkv, qkv_t, w_o, biases) = p.layer_parameters()?;
    let shape = LayerShape {
        batch: b,
        seq: t,
        hidden,
        heads: d.heads,
        kv_heads: d.kv_heads,
        head_dim: d.head_dim,
        v_head_dim: d.v_head_dim,
        out: p.out_width()?,
        scale: call.scale,
        qkv_t,
        o_t: w_o.as_ref().is_some_and(|(_, t)| *t),
    };
    let w_o = w_o.as_ref().map(|(w, _)| w);
    let context = layer_op::self_attention(call.x, &w_qkv, w_o, &biases, shape, call.mask)?;
    Ok(AttentionOutput {
        context,
        weights: None,
    })
}

/// The projections as tensors, the attention on `route`'s implementation (streamed weights
/// on the CPU kernels), the heads merged and `W_O`.
///
/// # Shapes
/// - returns `context` `(batch, seq_q, out)`, `weights` `(batch, heads, seq_q, seq_k)` in
///   [`WeightsMode::Return`]
pub(crate) fn composed(
    route: Route,
    p: &LayerProjections,
    call: LayerCall<'_>,
    mode: WeightsMode<'_>,
) -> Result<AttentionOutput> {
    let (b, t, dx) = call.x.dims3()?;
    let d = p.dims;
    let (h, kvh, hd, vhd) = (d.heads, d.kv_heads, d.head_dim, d.v_head_dim);
    // The projections: Q, K, V side by side in one product's rows for self-attention,
    // Q and K | V in two for cross-attention.
    let (rows, kv_rows, s) = match call.kv {
        None => {
            let qkv = p.qkv_rows(&call.x.reshape((b * t, dx))?)?; // (b*t, q+k+v)
            (qkv, None, t)
        }
        Some(kv) => {
            let (_, s, dk) = kv.dims3()?;
            let (wq, bq, wkv, bkv) = p.split_for_cross()?;
            let q = linear_in_out(&call.x.reshape((b * t, dx))?, &wq, bq.as_ref())?; // (b*t, h*hd)
            let kvp = linear_in_out(&kv.reshape((b * s, dk))?, &wkv, bkv.as_ref())?; // (b*s, kvh*(hd+vhd))
            (q, Some(kvp), s)
        }
    };
    let (ctx, weights) = if let (Route::CpuKernelsTrainable, Some(kvp)) = (route, &kv_rows) {
        // Cross-attention: heads read in place from the projections, context written
        // merged, and the backward writes straight into the projections' gradient layout.
        let sizes = PackedSizes {
            batch: b,
            seq_q: t,
            seq_k: s,
            heads: h,
            kv_heads: kvh,
            head_dim: hd,
            v_head_dim: vhd,
        };
        let context = sdpa_op::packed_cross_attention(&rows, kvp, sizes, call.mask, call.scale)?; // (b, t, h*vhd)
        (context, None)
    } else {
        let (q, k, v) = match &kv_rows {
            None => (
                rows.narrow(1, 0, h * hd)?,                 // (b*t, h*hd)
                rows.narrow(1, h * hd, kvh * hd)?,          // (b*t, kvh*hd)
                rows.narrow(1, (h + kvh) * hd, kvh * vhd)?, // (b*t, kvh*vhd)
            ),
            Some(kvp) => (
                rows.clone(),                        // (b*t, h*hd)
                kvp.narrow(1, 0, kvh * hd)?,         // (b*s, kvh*hd)
                kvp.narrow(1, kvh * hd, kvh * vhd)?, // (b*s, kvh*vhd)
            ),
        };
        let q = q.reshape((b, t, h, hd))?.transpose(1, 2)?; // (b, h, t, hd)
        let k = k.reshape((b, s, kvh, hd))?.transpose(1, 2)?; // (b, kvh, s, hd)
        let v = v.reshape((b, s, kvh, vhd))?.transpose(1, 2)?; // (b, kvh, s, vhd)
        let out = match mode {
            WeightsMode::Stream(f) => AttentionOutput {
                context: scaled_dot_product_attention_streamed(
                    &q,
                    &k,
                    &v,
                    call.mask,
                    Some(call.scale),
                    f,
                )?,
                weights: None,
            },
            mode => sdpa::run_route(route, &q, &k, &v, call.mask, call.scale, mode)?,
        };
        let ctx = out.context.transpose(1, 2)?.reshape((b, t, h * vhd))?; // (b, t, h*vhd)
        (ctx, out.weights)
    };
    let out = p.output_rows(&ctx.reshape((b * t, h * vhd))?)?; // (b*t, out)
    let (_, o_out) = out.dims2()?;
    Ok(AttentionOutput {
        context: out.reshape((b, t, o_out))?, // (b, t, out)
        weights,
    })
}
