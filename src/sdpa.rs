//! Scaled dot-product attention: `softmax(Q K^T * scale + mask) V`, with grouped K/V heads.

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};
use crate::mask::AttentionMask;
use crate::output::AttentionOutput;
use crate::softmax::masked_softmax;

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
    let shape_err = |name: &str, what: &str, t: &Tensor| {
        Error::input(name, what, format!("shape {:?}", t.dims()))
    };
    let (b, h, sq, dk) = q
        .dims4()
        .map_err(|_| shape_err("q", "rank 4 (batch, heads, seq_q, d_k)", q))?;
    let (bk, kv, sk, dk2) = k
        .dims4()
        .map_err(|_| shape_err("k", "rank 4 (batch, kv_heads, seq_k, d_k)", k))?;
    let (bv, kv2, sk2, dv) = v
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
    let g = h / kv;
    let scale = opts.scale.unwrap_or(1.0 / (dk as f64).sqrt());
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
    let probs = masked_softmax(&scores, bias.as_ref())?; // (b, h, sq, sk) f32
    let pv = probs
        .to_dtype(compute)?
        .reshape((b, kv, g * sq, sk))? // (b, kv, g*sq, sk)
        .matmul(&v.contiguous()?)?; // (b, kv, g*sq, dv)
    let context = pv.reshape((b, h, sq, dv))?.to_dtype(out_dtype)?; // (b, h, sq, dv)
    Ok(AttentionOutput {
        context,
        weights: opts.need_weights.then_some(probs),
    })
}
