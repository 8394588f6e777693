//! Typed result of an attention call.

use candle_core::Tensor;

/// What an attention call returns.
///
/// `context` is the attended values; `weights` holds the attention probabilities when the
/// caller asked for them (the fast paths never materialise them otherwise).
#[derive(Debug, Clone)]
pub struct AttentionOutput {
    /// For [`crate::scaled_dot_product_attention`]: `(batch, heads, seq_q, d_v)` in the value
    /// dtype. For the modules: `(batch, seq_q, hidden_out)`.
    pub context: Tensor,
    /// `(batch, heads, seq_q, seq_k)`, f32 (the dtype the softmax is computed in); rows sum to
    /// 1, or are all zero for a query whose keys are all masked.
    pub weights: Option<Tensor>,
}
