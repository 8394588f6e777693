//! One token at a time: matrix-vector products that read f16 / bf16 weights as stored
//! (widened in registers), one query row per head against a key/value cache, and a pool
//! kept awake between the small parallel steps of a decode.

pub(crate) mod f16_kernels;
pub(crate) mod gemv;
pub(crate) mod gemv_avx512;
pub(crate) mod held_lanes;
pub(crate) mod keep_warm;
pub(crate) mod lines;
pub(crate) mod one_query;
pub(crate) mod prefetch;
pub(crate) mod quant_gemv;
pub(crate) mod quant_gemv_avx2;
pub(crate) mod quant_gemv_avx512;
pub(crate) mod quant_gemv_int8_avx2;
pub(crate) mod quant_gemv_vnni;
pub(crate) mod widen;
