//! The attention itself: the layers ([`single_head`], [`multi_head`]), scaled dot-product
//! attention ([`sdpa`]), masks, the f32 softmax, typed outputs and costs; [`dispatch`] picks
//! the implementation of each call, and each implementation's body lives in its own module:
//! [`layer_routes`] (a layer's routes), [`explicit`] (the composition of candle ops),
//! [`cuda_flash`] (candle-flash-attn), [`ops`] (the differentiable CPU ops) and the CPU
//! kernels of `crate::kernels`.

pub(crate) mod cost;
pub(crate) mod cuda_flash;
pub mod dispatch;
pub(crate) mod explicit;
pub(crate) mod layer_routes;
pub(crate) mod mask;
pub(crate) mod multi_head;
pub(crate) mod ops;
pub(crate) mod output;
pub(crate) mod path;
pub(crate) mod projections;
pub(crate) mod sdpa;
pub(crate) mod single_head;
pub(crate) mod softmax;
