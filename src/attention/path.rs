//! The implementation a caller asks for.

/// Which implementation runs the attention.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttentionPath {
    /// The CPU kernels on the CPU (any mask, f32 compute); elsewhere CUDA flash-attention
    /// (feature `flash-attn`: f16/bf16, no weights, no mask or the plain causal one), else
    /// the explicit composition.
    #[default]
    Auto,
    /// The explicit composition of candle ops (`Q K^T`, masked softmax, `P V`) on every
    /// device: the reference the kernels are tested against.
    Explicit,
}
