//! One token at a time: matrix-vector products that read f16 / bf16 weights as stored
//! (widened in registers), one query row per head against a key/value cache, and a pool
//! kept awake between the small parallel steps of a decode.
//!
//! The GGUF row kernels are laid out as ggml-cpu lays out its own: the block formats, the
//! types the kernels take and the 8-bit `x` below (`kernels::quant`), the contract each
//! instruction set implements and the one driver over it in [`row_kernels`], the pieces
//! several instruction sets share in [`x86_helpers`], one file per instruction set importing
//! only those (`quant_gemv_avx512`, `quant_gemv_avx2`, and the 8-bit `quant_gemv_vnni`,
//! `quant_gemv_int8_avx2`), and [`quant_gemv`] above them, dispatching.

pub(crate) mod f16_kernels;
pub(crate) mod gemv;
pub(crate) mod gemv_avx512;
pub(crate) mod held_lanes;
pub(crate) mod keep_warm;
pub(crate) mod one_query;
pub(crate) mod prefetch;
pub(crate) mod quant_gemv;
pub(crate) mod quant_gemv_avx2;
pub(crate) mod quant_gemv_avx512;
pub(crate) mod quant_gemv_int8_avx2;
pub(crate) mod quant_gemv_vnni;
pub(crate) mod row_kernels;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_helpers;
