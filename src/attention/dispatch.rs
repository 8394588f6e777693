//! The one place that decides which implementation runs an attention call.
//!
//! Every entry point ([`crate::scaled_dot_product_attention`], the layers' `forward`,
//! `forward_with_weights`, `cross_attention`) describes its call as a `Call` and runs the
//! `Route` that `route` returns:
//!
//! | route | when | forward | backward |
//! |---|---|---|---|
//! | `FusedLayer` | a layer on the CPU, f32, Q/K/V fused, path `Auto`, no input or weight tracks gradients | the whole layer on the CPU kernels: Q/K/V micro-kernel product, attention reading the heads in place, `W_O` | none: nothing to differentiate |
//! | `CpuKernels` | the CPU, path `Auto`, nothing tracks gradients (any dtype, computed in f32) | tiled online softmax (no weights), row blocks (weights returned or streamed); one query row per head against a cache (a decode step) read as stored (`kernels::decode::one_query`) | none |
//! | `CpuKernelsTrainable` | the CPU, f32, path `Auto`, something tracks gradients, no weights asked, the mask holds no tensor that tracks gradients | self-attention in a layer: the whole layer as one candle op on the kernels (`crate::attention::ops::layer_op`); cross-attention: the tiled kernel on the two projections as one op; `scaled_dot_product_attention`: the tiled kernel as one op (`crate::attention::ops::sdpa_op`); each keeps the rows' log-sum-exps | the FlashAttention-2-style CPU kernel (probabilities recomputed per tile from the log-sum-exps, memory linear in the sequence), and for the layer its projections' products on the same buffers |
//! | `Flash` | CUDA with feature `flash-attn`, f16/bf16, no weights, nothing tracks gradients, no mask or the plain (bottom-right) causal one, equal head dims up to 256 | candle-flash-attn | none |
//! | `Explicit` | everything else, and path `Explicit` | candle ops: `Q K^T`, masked softmax in f32, `P V` | candle's autograd |
//!
//! On every route that tracks gradients the layers read the caller's tensors as they are
//! (views, or `in_proj_weight` / `c_attn` as stored), so gradients reach the caller's
//! variables in their checkpoint layout and an optimizer's update is seen by the next call.

use candle_core::{DType, Device, Tensor};

use crate::attention::mask::{AttentionMask, MaskPart};
use crate::attention::path::AttentionPath;
use crate::kernels::attend::WeightsMode;

/// What the attention weights are wanted for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Weights {
    /// Context only.
    Skip,
    /// Returned as a tensor.
    Return,
    /// Handed out block by block.
    Stream,
}

/// What decides the route of one call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call<'a> {
    pub device: &'a Device,
    /// The compute dtype of the inputs.
    pub dtype: DType,
    pub weights: Weights,
    /// Whether an input or a weight tracks gradients (`Tensor::track_op`).
    pub tracking: bool,
    pub mask: Option<&'a AttentionMask>,
    pub path: AttentionPath,
}

/// An implementation of the attention (see the module docs' table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    FusedLayer,
    CpuKernels,
    CpuKernelsTrainable,
    Flash,
    Explicit,
}

/// What `mode` wants the weights for.
pub(crate) fn weights_of(mode: &WeightsMode<'_>) -> Weights {
    match mode {
        WeightsMode::Skip => Weights::Skip,
        WeightsMode::Return => Weights::Return,
        WeightsMode::Stream(_) => Weights::Stream,
    }
}

/// Whether any of `tensors` tracks gradients.
pub(crate) fn tracks(tensors: &[Option<&Tensor>]) -> bool {
    tensors.iter().flatten().any(|t| t.track_op())
}

/// Whether the mask holds a tensor that tracks gradients (a learned bias, say).
fn mask_tracks(mask: Option<&AttentionMask>) -> bool {
    mask.is_some_and(|m| {
        m.parts().iter().any(|p| match p {
            MaskPart::Causal { .. } => false,
            MaskPart::Padding(t) | MaskPart::Keep(t) | MaskPart::Bias(t) => t.track_op(),
        })
    })
}

/// The route of an attention call; `fused_layer` says whether the caller is a layer whose
/// whole forward the CPU kernels can run (fused Q/K/V weights they can read).
pub(crate) fn route(c: &Call<'_>, fused_layer: bool) -> Route {
    if c.path == AttentionPath::Explicit {
        return Route::Explicit;
    }
    let cpu = c.device.is_cpu();
    if !c.tracking {
        if cpu && fused_layer && c.dtype == DType::F32 {
            return Route::FusedLayer;
        }
        if cpu {
            return Route::CpuKernels;
        }
        if c.weights == Weights::Skip && flash_applies(c) {
            return Route::Flash;
        }
        return Route::Explicit;
    }
    if cpu && c.dtype == DType::F32 && c.weights == Weights::Skip && !mask_tracks(c.mask) {
        return Route::CpuKernelsTrainable;
    }
    Route::Explicit
}

/// Whether the flash-attention kernels were compiled in and may take a CUDA call in this
/// dtype (the shape and mask conditions are checked by `crate::attention::cuda_flash`, which falls back to
/// the explicit composition).
fn flash_applies(c: &Call<'_>) -> bool {
    cfg!(feature = "flash-attn")
        && c.device.is_cuda()
        && matches!(c.dtype, DType::F16 | DType::BF16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(dtype: DType, weights: Weights, tracking: bool, path: AttentionPath) -> Call<'static> {
        static CPU: Device = Device::Cpu;
        Call {
            device: &CPU,
            dtype,
            weights,
            tracking,
            mask: None,
            path,
        }
    }

    #[test]
    fn the_table_on_the_cpu() {
        use AttentionPath::{Auto, Explicit};
        let r = |d, w, t, p, fused| route(&call(d, w, t, p), fused);
        assert_eq!(
            r(DType::F32, Weights::Skip, false, Auto, true),
            Route::FusedLayer
        );
        assert_eq!(
            r(DType::F32, Weights::Return, false, Auto, true),
            Route::FusedLayer
        );
        assert_eq!(
            r(DType::F16, Weights::Skip, false, Auto, true),
            Route::CpuKernels
        );
        assert_eq!(
            r(DType::F32, Weights::Skip, false, Auto, false),
            Route::CpuKernels
        );
        assert_eq!(
            r(DType::F32, Weights::Skip, true, Auto, true),
            Route::CpuKernelsTrainable
        );
        assert_eq!(
            r(DType::F32, Weights::Return, true, Auto, true),
            Route::Explicit
        );
        assert_eq!(
            r(DType::BF16, Weights::Skip, true, Auto, true),
            Route::Explicit
        );
        assert_eq!(
            r(DType::F32, Weights::Skip, false, Explicit, true),
            Route::Explicit
        );
    }

    #[test]
    fn a_learned_mask_bias_takes_the_explicit_route() -> candle_core::Result<()> {
        let bias = candle_core::Var::zeros((1, 1, 2, 2), DType::F32, &Device::Cpu)?;
        let mask = AttentionMask::bias(bias.as_tensor()).map_err(crate::Error::into_candle)?;
        let mut c = call(DType::F32, Weights::Skip, true, AttentionPath::Auto);
        c.mask = Some(&mask);
        assert_eq!(route(&c, true), Route::Explicit);
        Ok(())
    }
}
