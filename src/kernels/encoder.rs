//! BERT's parts beside the attention: embeddings in one pass per token, the feed-forward
//! block on the packed micro-kernels with bias and GELU fused, and LayerNorm with the
//! residual add fused.

pub(crate) mod embedding;
pub(crate) mod feed_forward;
pub(crate) mod layer_norm;
