//! Scaled dot-product attention: `softmax(Q K^T * scale + mask) V`, with grouped K/V heads.
//!
//! Two implementations with one meaning: on the CPU the kernels of `crate::kernels` (tiled
//! online softmax in linear memory without weights, row blocks written straight into the
//! weights tensor with them); elsewhere, and on request as the reference
//! ([`scaled_dot_product_attention_explicit`]), the explicit composition of candle ops.

use candle_core::{Device, Tensor};

use crate::attention::cuda_flash;
use crate::attention::dispatch::{self, Call, Route};
use crate::attention::explicit::explicit;
use crate::attention::mask::{kernel_plan, AttentionMask};
use crate::attention::ops::sdpa_op;
use crate::attention::output::AttentionOutput;
use crate::attention::path::AttentionPath;
use crate::error::{Error, Result};
use crate::kernels::attend::{on_tensors, WeightsBlock, WeightsMode};

/// Options of [`scaled_dot_product_attention`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SdpaOptions {
    /// Multiplier of `Q K^T`; `None` means `1 / sqrt(d_k)`.
    pub scale: Option<f64>,
    /// Also return the attention weights `(batch, heads, seq_q, seq_k)`.
    pub need_weights: bool,
}

impl SdpaOptions {
    /// Default scale, with the weights returned.
    pub fn with_weights() -> Self {
        Self {
            scale: None,
            need_weights: true,
        }
    }
}

/// `softmax(Q K^T / sqrt(d_k) + mask) V`.
///
/// `heads` must be a multiple of `kv_heads`: query head `h` reads key/value head
/// `h / (heads / kv_heads)` (grouped-query attention as in LLaMA and PyTorch's
/// `scaled_dot_product_attention(..., enable_gqa=True)`), without copying K or V.
/// The softmax runs in f32 whatever the storage dtype; on the CPU the products do too.
///
/// On the CPU this runs the tiled kernels: without weights, an online-softmax
/// (FlashAttention-style) loop over key blocks whose memory is linear in the sequence length
/// (causal masks skip the blocks above the diagonal); with weights, row blocks computed
/// straight into the returned weights tensor, after checking that they fit in memory
/// ([`crate::attention_weights_bytes`]; an [`Error::Memory`] otherwise, see
/// [`scaled_dot_product_attention_streamed`]). Both equal
/// [`scaled_dot_product_attention_explicit`] within 1e-5 in f32.
///
/// # Shapes
/// - `q`: `(batch, heads, seq_q, d_k)`
/// - `k`: `(batch, kv_heads, seq_k, d_k)`
/// - `v`: `(batch, kv_heads, seq_k, d_v)`
/// - `mask`: see [`AttentionMask`], applied to `(batch, heads, seq_q, seq_k)`
/// - returns: `context` `(batch, heads, seq_q, d_v)` in `v`'s dtype, `weights`
///   `(batch, heads, seq_q, seq_k)` f32 when `opts.need_weights`
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&AttentionMask>,
    opts: SdpaOptions,
) -> Result<AttentionOutput> {
    scaled_dot_product_attention_on(q, k, v, mask, opts, AttentionPath::Auto)
}

/// [`scaled_dot_product_attention`] on the explicit composition of candle ops whatever the
/// device: `(Q * scale) K^T`, [`crate::masked_softmax`], `P V`. It materialises the `(seq_q,
/// seq_k)` scores; it is the reference the CPU kernels are tested against.
///
/// # Shapes
/// Same as [`scaled_dot_product_attention`].
pub fn scaled_dot_product_attention_explicit(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&AttentionMask>,
    opts: SdpaOptions,
) -> Result<AttentionOutput> {
    scaled_dot_product_attention_on(q, k, v, mask, opts, AttentionPath::Explicit)
}

/// [`scaled_dot_product_attention`] with the implementation chosen by `path`.
///
/// # Shapes
/// Same as [`scaled_dot_product_attention`].
pub fn scaled_dot_product_attention_on(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&AttentionMask>,
    opts: SdpaOptions,
    path: AttentionPath,
) -> Result<AttentionOutput> {
    let (_, _, _, dk) = check_qkv(q, k, v)?;
    let scale = opts.scale.unwrap_or(1.0 / (dk as f64).sqrt());
    let mode = if opts.need_weights {
        WeightsMode::Return
    } else {
        WeightsMode::Skip
    };
    let call = Call {
        device: q.device(),
        dtype: q.dtype(),
        weights: dispatch::weights_of(&mode),
        tracking: dispatch::tracks(&[Some(q), Some(k), Some(v)]),
        mask,
        path,
    };
    run_route(dispatch::route(&call, false), q, k, v, mask, scale, mode)
}

/// Runs the attention on the implementation `route` chose (shapes checked by the caller).
/// The streaming mode runs only on the CPU kernels.
///
/// # Shapes
/// Same as [`scaled_dot_product_attention`].
pub(crate) fn run_route(
    route: Route,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&AttentionMask>,
    scale: f64,
    mode: WeightsMode<'_>,
) -> Result<AttentionOutput> {
    let need_weights = matches!(mode, WeightsMode::Return);
    match route {
        Route::FusedLayer | Route::CpuKernels => {
            let plan = cpu_plan(q, k, mask)?;
            let (context, weights) = on_tensors::attention(q, k, v, &plan, scale, mode)?;
            Ok(AttentionOutput { context, weights })
        }
        Route::CpuKernelsTrainable => Ok(AttentionOutput {
            context: sdpa_op::attention(q, k, v, mask, scale)?,
            weights: None,
        }),
        Route::Flash => match cuda_flash::try_flash_attention(q, k, v, mask, scale)? {
            Some(context) => Ok(AttentionOutput {
                context,
                weights: None,
            }),
            None => explicit(q, k, v, mask, scale, need_weights),
        },
        Route::Explicit => explicit(q, k, v, mask, scale, need_weights),
    }
}

/// Attention whose weights are handed to `on_block` one block of queries at a time instead
/// of being returned: memory stays `O(threads * block * seq_k)` however long `seq_q` is.
/// Blocks arrive in order of batch, head and query; each holds rows that sum to 1 (or are
/// all 0 for a query whose keys are all masked), exactly the rows
/// [`scaled_dot_product_attention`] would return. An error from `on_block` stops the call
/// and is returned. Runs on the CPU (inputs elsewhere are copied there and the context
/// copied back). When an input tracks gradients, the context is the differentiable one of
/// [`scaled_dot_product_attention`] (the blocks are not differentiable).
///
/// # Shapes
/// - `q`, `k`, `v`, `mask`: as in [`scaled_dot_product_attention`]
/// - each [`WeightsBlock`]: `(rows, seq_k)` of one `(batch, head)`
/// - returns: the context `(batch, heads, seq_q, d_v)` in `v`'s dtype
pub fn scaled_dot_product_attention_streamed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&AttentionMask>,
    scale: Option<f64>,
    mut on_block: impl FnMut(WeightsBlock<'_>) -> Result<()>,
) -> Result<Tensor> {
    let (_, _, _, dk) = check_qkv(q, k, v)?;
    let scale = scale.unwrap_or(1.0 / (dk as f64).sqrt());
    if dispatch::tracks(&[Some(q), Some(k), Some(v)]) {
        // A differentiable context; the blocks from the kernels on the values alone.
        let context = scaled_dot_product_attention_on(
            q,
            k,
            v,
            mask,
            SdpaOptions {
                scale: Some(scale),
                need_weights: false,
            },
            AttentionPath::Auto,
        )?
        .context;
        let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
        scaled_dot_product_attention_streamed(&qd, &kd, &vd, mask, Some(scale), on_block)?;
        return Ok(context);
    }
    let device = q.device().clone();
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu);
    let (qc, kc, vc) = (cpu(q)?, cpu(k)?, cpu(v)?);
    let plan = cpu_plan(&qc, &kc, mask)?;
    let (context, _) = on_tensors::attention(
        &qc,
        &kc,
        &vc,
        &plan,
        scale,
        WeightsMode::Stream(&mut on_block),
    )?;
    Ok(context.to_device(&device)?)
}

/// Checks ranks, sizes, head grouping and dtypes; returns `(batch, heads, seq_q, d_k)`.
fn check_qkv(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(usize, usize, usize, usize)> {
    let shape_err = |name: &str, what: &str, t: &Tensor| {
        Error::input(name, what, format!("shape {:?}", t.dims()))
    };
    let (b, h, sq, dk) = q
        .dims4()
        .map_err(|_| shape_err("q", "rank 4 (batch, heads, seq_q, d_k)", q))?;
    let (bk, kv, sk, dk2) = k
        .dims4()
        .map_err(|_| shape_err("k", "rank 4 (batch, kv_heads, seq_k, d_k)", k))?;
    let (bv, kv2, sk2, _dv) = v
        .dims4()
        .map_err(|_| shape_err("v", "rank 4 (batch, kv_heads, seq_k, d_v)", v))?;
    if bk != b || bv != b {
        return Err(Error::input(
            "k/v",
            format!("batch {b} like q"),
            format!("k batch {bk}, v batch {bv}"),
        ));
    }
    if dk2 != dk {
        return Err(Error::input(
            "k",
            format!("d_k = {dk} like q (q {:?})", q.dims()),
            format!("d_k = {dk2} (k {:?})", k.dims()),
        ));
    }
    if kv2 != kv || sk2 != sk {
        return Err(Error::input(
            "v",
            format!("(batch, kv_heads, seq_k) = ({b}, {kv}, {sk}) like k"),
            format!("{:?}", v.dims()),
        ));
    }
    if kv == 0 || h % kv != 0 {
        return Err(Error::Heads(format!(
            "q has {h} heads, which is not a multiple of the {kv} key/value heads"
        )));
    }
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        return Err(Error::input(
            "q/k/v",
            "one dtype",
            format!("q {:?}, k {:?}, v {:?}", q.dtype(), k.dtype(), v.dtype()),
        ));
    }
    Ok((b, h, sq, dk))
}

/// `mask` lowered for the CPU kernels over q `(batch, heads, seq_q, _)` and k `(_, _, seq_k,
/// _)`.
fn cpu_plan(
    q: &Tensor,
    k: &Tensor,
    mask: Option<&AttentionMask>,
) -> Result<crate::kernels::attend::mask_plan::MaskPlan> {
    let (b, h, sq, _) = q.dims4()?;
    let (_, _, sk, _) = k.dims4()?;
    kernel_plan(mask, b, h, sq, sk)
}
