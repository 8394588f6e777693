//! Matrix products on f32 slices: the micro-kernels (AVX-512, AVX2 + FMA, picked at run
//! time), weights packed once into their panels, matrix views, and `x W^T + b` on the `gemm`
//! crate for CPUs without either, and the transposed copy that packs rows into panels.

pub(crate) mod depth_blocks;
pub(crate) mod half_rows_product;
pub(crate) mod int8_product;
pub(crate) mod matrix;
pub(crate) mod microkernel;
pub(crate) mod microkernel_avx2;
pub(crate) mod packed;
pub(crate) mod projection;
pub(crate) mod transpose;
pub(crate) mod weight_ref;

pub(crate) use weight_ref::WeightRef;
