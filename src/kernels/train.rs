//! Training on the CPU kernels: the FlashAttention-2-style attention backward (probabilities
//! recomputed per tile from the saved log-sum-exps), its tensor and packed-buffer forms, and
//! the whole trainable self-attention layer's forward and backward on shared buffers.

pub(crate) mod backward;
pub(crate) mod sdpa_backward;
pub(crate) mod trainable_layer;
