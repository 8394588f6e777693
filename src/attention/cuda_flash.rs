//! Optional CUDA flash-attention fast path (cargo feature `flash-attn`, candle-flash-attn).
//!
//! Used only when the caller does not ask for the weights, the tensors live on a CUDA
//! device in f16/bf16, the head dims are equal and supported, and the mask is empty or
//! the plain causal mask (flash-attention's causal mask is aligned to the bottom right,
//! i.e. our `causal_with_offset(seq_k - seq_q)`). Anything else returns `None` and the
//! caller takes the explicit path.

use candle_core::Tensor;

use crate::attention::mask::AttentionMask;
use crate::error::Result;

/// `Some(context)` `(batch, heads, seq_q, d_v)` when flash-attention computed the call.
///
/// # Shapes
/// - `q`: `(batch, heads, seq_q, d_k)`, `k`: `(batch, kv_heads, seq_k, d_k)`,
///   `v`: `(batch, kv_heads, seq_k, d_v)`
#[cfg(feature = "flash-attn")]
pub(crate) fn try_flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&AttentionMask>,
    scale: f64,
) -> Result<Option<Tensor>> {
    use crate::attention::mask::MaskPart;
    use candle_core::DType;

    if !q.device().is_cuda() || !matches!(q.dtype(), DType::F16 | DType::BF16) {
        return Ok(None);
    }
    let (_b, _h, sq, dk) = q.dims4()?;
    let (_b, _kv, sk, dv) = v.dims4()?;
    if dk != dv || dk > 256 || dk % 8 != 0 {
        return Ok(None);
    }
    let causal = match mask.map(AttentionMask::parts) {
        None | Some([]) => false,
        Some([MaskPart::Causal { offset }]) if offset + sq == sk => true,
        _ => return Ok(None),
    };
    let to_bshd = |x: &Tensor| x.transpose(1, 2).and_then(|x| x.contiguous()); // (b, s, h, d)
    let out = candle_flash_attn::flash_attn(
        &to_bshd(q)?,
        &to_bshd(k)?,
        &to_bshd(v)?,
        scale as f32,
        causal,
    )?; // (b, sq, h, d)
    Ok(Some(out.transpose(1, 2)?)) // (b, h, sq, d)
}

/// Without the `flash-attn` feature there is no flash path.
#[cfg(not(feature = "flash-attn"))]
pub(crate) fn try_flash_attention(
    _q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _mask: Option<&AttentionMask>,
    _scale: f64,
) -> Result<Option<Tensor>> {
    Ok(None)
}
