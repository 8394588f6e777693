//! What an encoder's forward returns.

use candle_core::Tensor;

/// What [`crate::BertEncoder::forward`] returns.
#[derive(Debug, Clone)]
pub struct EncoderOutput {
    /// `(batch, seq, hidden)`: the last layer's hidden states.
    pub hidden_states: Tensor,
    /// One `(batch, heads, seq, seq)` f32 tensor per layer, when asked for.
    pub attentions: Option<Vec<Tensor>>,
}
