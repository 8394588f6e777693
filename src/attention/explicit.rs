//! The explicit composition of candle ops, `(Q * scale) K^T`, the masked f32 softmax, `P V`:
//! the reference every other implementation is tested against, and the route for what they
//! do not cover (candle's autograd differentiates it).

use candle_core::{DType, Tensor};

use crate::attention::mask::AttentionMask;
use crate::attention::output::AttentionOutput;
use crate::attention::softmax::masked_softmax_of_products;
use crate::error::Result;
use crate::memory;

/// The explicit composition (see [`crate::scaled_dot_product_attention_explicit`]).
///
/// # Shapes
/// Same as [`crate::scaled_dot_product_attention`].
pub(crate) fn explicit(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&AttentionMask>,
    scale: f64,
    need_weights: bool,
) -> Result<AttentionOutput> {
    explicit_probed(q, k, v, mask, scale, need_weights, None)
}

/// [`explicit`], with `probe` (zeros, a variable) added to the weights where they multiply
/// `V`: candle's backward keeps the gradients of variables only, and the probe's gradient
/// is the gradient with respect to the weights (explanations read it).
///
/// # Shapes
/// - `probe`: `(batch, heads, seq_q, seq_k)` f32; the rest as [`explicit`]
pub(crate) fn explicit_probed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&AttentionMask>,
    scale: f64,
    need_weights: bool,
    probe: Option<&Tensor>,
) -> Result<AttentionOutput> {
    let (b, h, sq, dk) = q.dims4()?;
    let (_, kv, sk, _) = k.dims4()?;
    let (_, _, _, dv) = v.dims4()?;
    if q.device().is_cpu() {
        // Scores, their exponentials and the weights live at once in host memory.
        let bytes = memory::attention_weights_bytes(b, h, sq, sk).saturating_mul(3);
        memory::ensure_allocatable("the explicit attention scores and weights", bytes)?;
    }
    let g = h / kv;
    let bias = match mask {
        Some(m) if !m.is_empty() => m.to_bias(b, h, sq, sk, q.device())?,
        _ => None,
    };
    // On the CPU the products run in f32 too; on GPUs in the storage dtype, with q scaled
    // first so that half-precision scores stay in range.
    let out_dtype = v.dtype();
    let compute = if q.device().is_cpu() {
        DType::F32
    } else {
        q.dtype()
    };
    let (q, k, v) = (
        q.to_dtype(compute)?,
        k.to_dtype(compute)?,
        v.to_dtype(compute)?,
    );
    // Query heads of one group are contiguous: (b, h, sq, dk) -> (b, kv, g * sq, dk).
    let qg = (q.contiguous()?.reshape((b, kv, g * sq, dk))? * scale)?; // (b, kv, g*sq, dk)
    let scores = qg.matmul(&k.contiguous()?.t()?)?; // (b, kv, g*sq, sk)
    let scores = scores.reshape((b, h, sq, sk))?; // (b, h, sq, sk)
    let probs = masked_softmax_of_products(&scores, bias.as_ref())?; // (b, h, sq, sk) f32
    let used = match probe {
        Some(p) => (&probs + p)?,
        None => probs.clone(),
    };
    let pv = used
        .to_dtype(compute)?
        .reshape((b, kv, g * sq, sk))? // (b, kv, g*sq, sk)
        .matmul(&v.contiguous()?)?; // (b, kv, g*sq, dv)
    let context = pv.reshape((b, h, sq, dv))?.to_dtype(out_dtype)?; // (b, h, sq, dv)
    Ok(AttentionOutput {
        context,
        weights: need_weights.then_some(probs),
    })
}
