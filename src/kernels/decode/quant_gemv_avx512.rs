//! AVX-512 dot products of one GGUF weight row with `x`, for the 32-value block types
//! (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): each block is unpacked in registers, its values made
//! exactly as gguf-py makes them (`d * q + m` as a product then a sum, two roundings, never
//! one fused step), and multiplied into f32 accumulators as they go, so the weight is read
//! once and never written out.

// The AVX-512 intrinsics are stable since Rust 1.89, above the `rust-version` the manifest
// declares; candle-core 0.11 itself needs 1.89 on x86-64 (as in `microkernel.rs`).
#![allow(clippy::incompatible_msrv)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::kernels::quant::blocks::QuantType;
#[cfg(target_arch = "x86_64")]
use crate::kernels::simd::{isa, Isa};

/// Whether this CPU runs these kernels for `ty`.
pub(crate) fn supports(ty: QuantType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(isa(), Isa::Avx512)
            && matches!(
                ty,
                QuantType::Q4_0
                    | QuantType::Q4_1
                    | QuantType::Q5_0
                    | QuantType::Q5_1
                    | QuantType::Q8_0
            )
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        false
    }
}

/// The f16 at `b[at..at + 2]` as f32, with the CPU's conversion (exact, as `half`'s).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn half_at(b: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// `sum_k W[k] x[k]` for one row (`row`: whole blocks of `ty`, `x.len()` values); `None` when
/// this CPU or type has no kernel here, or the sizes do not fit.
pub(crate) fn row_dot(ty: QuantType, row: &[u8], x: &[f32]) -> Option<f32> {
    if !supports(ty) || ty.bytes_of(x.len()) != Some(row.len()) {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: AVX-512F checked by `supports`; `row` holds `x.len() / 32` whole blocks.
        Some(unsafe { row_dot_avx512(ty, row, x) })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_dot_avx512(ty: QuantType, row: &[u8], x: &[f32]) -> f32 {
    let size = ty.block_bytes();
    let (mut lo_acc, mut hi_acc) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let nibbles = _mm_set1_epi8(0x0F);
    for (b, xs) in row.chunks_exact(size).zip(x.chunks_exact(32)) {
        let d = _mm512_set1_ps(half_at(b, 0));
        // The 32 values as two halves of 16 lanes: value j and value 16 + j.
        let (lo, hi) = match ty {
            QuantType::Q8_0 => {
                let q = b.as_ptr().add(2) as *const __m128i;
                let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
                let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(1))));
                // gguf-py: q * d.
                (_mm512_mul_ps(lo, d), _mm512_mul_ps(hi, d))
            }
            _ => {
                let (qs_at, qh_at, m) = match ty {
                    QuantType::Q4_0 => (2, None, None),
                    QuantType::Q4_1 => (4, None, Some(half_at(b, 2))),
                    QuantType::Q5_0 => (6, Some(2), None),
                    _ => (8, Some(4), Some(half_at(b, 2))), // Q5_1
                };
                let v = _mm_loadu_si128(b.as_ptr().add(qs_at) as *const __m128i);
                let mut lo = _mm512_cvtepu8_epi32(_mm_and_si128(v, nibbles));
                let mut hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), nibbles));
                if let Some(at) = qh_at {
                    // The fifth bits: bit j of `qh` for value j.
                    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                    let sixteen = _mm512_set1_epi32(16);
                    lo = _mm512_mask_add_epi32(lo, qh as u16, lo, sixteen);
                    hi = _mm512_mask_add_epi32(hi, (qh >> 16) as u16, hi, sixteen);
                }
                let offset = match ty {
                    QuantType::Q4_0 => 8,
                    QuantType::Q5_0 => 16,
                    _ => 0,
                };
                if offset != 0 {
                    let o = _mm512_set1_epi32(offset);
                    lo = _mm512_sub_epi32(lo, o);
                    hi = _mm512_sub_epi32(hi, o);
                }
                let (lo, hi) = (
                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)),
                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)),
                );
                match m {
                    Some(m) => {
                        let m = _mm512_set1_ps(m);
                        (_mm512_add_ps(lo, m), _mm512_add_ps(hi, m))
                    }
                    None => (lo, hi),
                }
            }
        };
        let xp = xs.as_ptr();
        lo_acc = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp), lo_acc);
        hi_acc = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp.add(16)), hi_acc);
    }
    _mm512_reduce_add_ps(_mm512_add_ps(lo_acc, hi_acc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::blocks;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    /// Each row's dot product against the same weight dequantized (gguf-py's values), summed
    /// in f64: within f32 rounding of the sum of magnitudes.
    #[test]
    fn half_scales_convert_exactly() {
        if !matches!(isa(), Isa::Avx512) {
            return;
        }
        for bits in (0..=u16::MAX).step_by(7) {
            let b = bits.to_le_bytes();
            // SAFETY: AVX-512F checked above.
            let got = unsafe { half_at(&b, 0) };
            let want = half::f16::from_bits(bits).to_f32();
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#x}"
            );
        }
    }

    #[test]
    fn row_dots_equal_the_dequantized_weight_s() -> candle_core::Result<()> {
        for (ty, g) in [
            (QuantType::Q4_0, GgmlDType::Q4_0),
            (QuantType::Q4_1, GgmlDType::Q4_1),
            (QuantType::Q5_0, GgmlDType::Q5_0),
            (QuantType::Q5_1, GgmlDType::Q5_1),
            (QuantType::Q8_0, GgmlDType::Q8_0),
        ] {
            if !supports(ty) {
                continue;
            }
            let (rows, cols) = (9, 576);
            let w = crate::kernels::test_values(rows * cols, 11);
            let q = QTensor::quantize(&Tensor::from_vec(w, (rows, cols), &Device::Cpu)?, g)?;
            let bytes = q.data()?;
            let mut deq = vec![0f32; rows * cols];
            assert!(blocks::dequantize(ty, &bytes, &mut deq));
            let x = crate::kernels::test_values(cols, 2);
            let row_bytes = bytes.len() / rows;
            for r in 0..rows {
                let got = row_dot(ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &x)
                    .ok_or_else(|| candle_core::Error::Msg(format!("{ty}: no kernel")))?;
                let w = &deq[r * cols..(r + 1) * cols];
                let want: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = w
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                assert!(
                    (got as f64 - want).abs() <= mag * 1e-6,
                    "{ty} row {r}: {got} vs {want}"
                );
            }
        }
        Ok(())
    }
}
