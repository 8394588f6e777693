//! The differentiable CPU ops: candle custom ops whose forward and backward run on the
//! kernels, so that candle's autograd sees one node per attention or layer
//! ([`layer_op`]: a whole self-attention layer; [`sdpa_op`]: attention on Q, K, V and
//! cross-attention on two projections), and the gradient buffers they reuse ([`grad_pool`]).

pub(crate) mod grad_pool;
pub(crate) mod layer_op;
pub(crate) mod sdpa_op;
