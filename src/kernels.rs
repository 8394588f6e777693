//! CPU kernels on f32 slices, grouped by kind (as ggml-cpu groups its kernels). Nothing here
//! knows the crate's layers, masks or checkpoints: callers above pass plain descriptions
//! (sizes, strides, a [`attend::mask_plan::MaskPlan`], a [`gemm::WeightRef`]).
//!
//! - [`gemm`]: matrix products: the AVX-512 and AVX2 + FMA micro-kernels, weights packed
//!   once at load time, matrix views over slices, the `gemm` crate path;
//! - [`attend`]: attention on those products: the tiled online-softmax kernel (memory linear
//!   in the sequence, no weights), row blocks (weights returned or streamed), the tile
//!   products, the mask as applied per tile, and the whole fused self-attention layer;
//! - [`decode`]: one token at a time: matrix-vector products reading f16 / bf16 as stored,
//!   one query row against a cache, and keeping the pool's threads awake between steps;
//! - [`train`]: the FlashAttention-2-style backward and the trainable layer's forward and
//!   backward on shared buffers;
//! - [`quant`]: ggml's quantized block formats (GGUF files) and their dequantization, the
//!   block types the row kernels take, and the 8-bit form of an activation row;
//! - [`encoder`]: BERT's element-wise parts: embeddings, the fused feed-forward, LayerNorm;
//! - [`rms_norm`]: the decoders' RMS norm, candle-nn's bits with rows summed side by side;
//!   [`residual`]: their residual sums on rayon's pool;
//! - [`simd`], [`activation`]: vectorised `exp`, reductions and GELU, picked at run time by
//!   instruction set, and the one place CPU features are detected; [`cpu_tensor`]: f32
//!   views of candle's CPU tensors; [`scratch`]: per-thread scratch and training buffers;
//!   [`aligned`]: buffers on 64-byte lines; [`widen`]: half-precision values widened to f32;
//!   [`pool`]: a model call run on a thread of rayon's pool.
//!
//! Dependencies inside run one way, each group reading only those before it (and no circle
//! within a group; `tests/module_graph.rs` checks both): `simd`, `activation`, `scratch`,
//! `pool`, `aligned`, `widen`, `quant`; `gemm`; `cpu_tensor`; `decode`, `encoder`,
//! `rms_norm`, `residual`; `attend`; `train`.

pub(crate) mod activation;
pub(crate) mod aligned;
pub(crate) mod attend;
pub(crate) mod cpu_tensor;
pub(crate) mod decode;
pub(crate) mod encoder;
pub(crate) mod gemm;
pub(crate) mod pool;
pub(crate) mod quant;
pub(crate) mod residual;
pub(crate) mod rms_norm;
pub(crate) mod scratch;
pub(crate) mod simd;
pub(crate) mod train;
pub(crate) mod widen;

/// `v` rounded to f16 (or bf16) as little-endian bytes, with the rounded values as f32 (tests
/// only).
#[cfg(test)]
pub(crate) fn test_half(v: &[f32], bf16: bool) -> (Vec<u8>, Vec<f32>) {
    let bits: Vec<u16> = v
        .iter()
        .map(|&x| {
            if bf16 {
                half::bf16::from_f32(x).to_bits()
            } else {
                half::f16::from_f32(x).to_bits()
            }
        })
        .collect();
    let wide = bits
        .iter()
        .map(|&b| {
            if bf16 {
                half::bf16::from_bits(b).to_f32()
            } else {
                half::f16::from_bits(b).to_f32()
            }
        })
        .collect();
    (bits.iter().flat_map(|b| b.to_le_bytes()).collect(), wide)
}

/// Deterministic test values in `[-1, 1)`, distinct enough per `seed` (tests only).
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0) - 1.0)
        .collect()
}
