//! A row of ggml blocks as unsigned integers with an f32 scale and offset per group of
//! values: `w = s q + m`, `q` in `0..=255`, for products that multiply the integers
//! themselves (the 8-bit prompt products, [`crate::kernels::gemm::int8_product`]).
//!
//! The types whose values are signed integers get their offset in `m`: Q4_0's `d (q - 8)`
//! is `q` with `s = d`, `m = -8 d`; Q8_0's signed byte `q` is `q + 128` with `m = -128 d`;
//! Q3_K's `q - 4` and Q6_K's `q - 32` likewise. The mins of Q4_1, Q5_1, Q2_K, Q4_K and Q5_K
//! are their `m` as stored. Float types have no integer form.

use half::f16;

use crate::kernels::quant::blocks::{scale_min_k4, QuantType};

/// The values per scale of `ty`: 32, or 16 for Q2_K, Q3_K and Q6_K; `None` for the float
/// types.
pub(crate) fn group_values(ty: QuantType) -> Option<usize> {
    match ty {
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => None,
        QuantType::Q2K | QuantType::Q3K | QuantType::Q6K => Some(16),
        _ => Some(32),
    }
}

#[inline]
fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// `bytes` (whole blocks of `ty`) in integer form: `q[i]` for each of `q.len()` values, and
/// for each group `g` of `group` values `s[g]`, `m[g]`, so that value `i` is
/// `s[i / group] q[i] + m[i / group]`. `group` is the type's own ([`group_values`]) or 16
/// for a type of 32 (each scale then written for both halves). Returns `false`, writing
/// nothing, when the sizes do not agree or the type has no integer form.
pub(crate) fn integer_row(
    ty: QuantType,
    bytes: &[u8],
    group: usize,
    q: &mut [u8],
    s: &mut [f32],
    m: &mut [f32],
) -> bool {
    let Some(own) = group_values(ty) else {
        return false;
    };
    if ty.bytes_of(q.len()) != Some(bytes.len())
        || !(group == own || (group == 16 && own == 32))
        || s.len() * group != q.len()
        || m.len() != s.len()
    {
        return false;
    }
    // One loop per type, so that each block's body is compiled (and vectorised) for it.
    fn each<const B: usize, const N: usize, const G: usize>(
        ty: QuantType,
        bytes: &[u8],
        repeat: usize,
        q: &mut [u8],
        s: &mut [f32],
        m: &mut [f32],
    ) {
        let per = G * repeat;
        for (((b, qb), sb), mb) in bytes
            .chunks_exact(B)
            .zip(q.chunks_exact_mut(N))
            .zip(s.chunks_exact_mut(per))
            .zip(m.chunks_exact_mut(per))
        {
            let mut sm = [(0f32, 0f32); G];
            block(ty, b, qb, &mut sm);
            for (i, &(sv, mv)) in sm.iter().enumerate() {
                sb[i * repeat..(i + 1) * repeat].fill(sv);
                mb[i * repeat..(i + 1) * repeat].fill(mv);
            }
        }
    }
    let repeat = own / group;
    match ty {
        QuantType::Q4_0 => each::<18, 32, 1>(ty, bytes, repeat, q, s, m),
        QuantType::Q4_1 => each::<20, 32, 1>(ty, bytes, repeat, q, s, m),
        QuantType::Q5_0 => each::<22, 32, 1>(ty, bytes, repeat, q, s, m),
        QuantType::Q5_1 => each::<24, 32, 1>(ty, bytes, repeat, q, s, m),
        QuantType::Q8_0 => each::<34, 32, 1>(ty, bytes, repeat, q, s, m),
        QuantType::Q2K => each::<84, 256, 16>(ty, bytes, repeat, q, s, m),
        QuantType::Q3K => each::<110, 256, 16>(ty, bytes, repeat, q, s, m),
        QuantType::Q4K => each::<144, 256, 8>(ty, bytes, repeat, q, s, m),
        QuantType::Q5K => each::<176, 256, 8>(ty, bytes, repeat, q, s, m),
        QuantType::Q6K => each::<210, 256, 16>(ty, bytes, repeat, q, s, m),
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => return false,
    }
    true
}

/// One block's integers into `q` and its groups' `(s, m)` into `sm`.
#[inline(always)]
fn block(ty: QuantType, b: &[u8], q: &mut [u8], sm: &mut [(f32, f32)]) {
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let (d, m, at) = match ty {
                QuantType::Q4_0 => (half_at(b, 0), -8.0 * half_at(b, 0), 2),
                _ => (half_at(b, 0), half_at(b, 2), 4),
            };
            for (j, &v) in b[at..at + 16].iter().enumerate() {
                q[j] = v & 0x0F;
                q[j + 16] = v >> 4;
            }
            sm[0] = (d, m);
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let (d, m, at) = match ty {
                QuantType::Q5_0 => (half_at(b, 0), -16.0 * half_at(b, 0), 2),
                _ => (half_at(b, 0), half_at(b, 2), 4),
            };
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            for (j, &v) in b[at + 4..at + 20].iter().enumerate() {
                q[j] = (v & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
                q[j + 16] = (v >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
            }
            sm[0] = (d, m);
        }
        QuantType::Q8_0 => {
            let d = half_at(b, 0);
            for (o, &v) in q.iter_mut().zip(&b[2..34]) {
                *o = v ^ 0x80;
            }
            sm[0] = (d, -128.0 * d);
        }
        QuantType::Q2K => {
            let (scales, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (half_at(b, 80), half_at(b, 82));
            for (g, qg) in q.chunks_exact_mut(16).enumerate() {
                let (half, shift, first) = (g / 8, 2 * ((g % 8) / 2), 16 * (g % 2));
                for (i, o) in qg.iter_mut().enumerate() {
                    *o = (qs[32 * half + first + i] >> shift) & 3;
                }
                let sc = scales[g];
                sm[g] = (d * (sc & 0x0F) as f32, -dmin * (sc >> 4) as f32);
            }
        }
        QuantType::Q3K => {
            let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = half_at(b, 108);
            for (g, qg) in q.chunks_exact_mut(16).enumerate() {
                let low = (sc[g % 8] >> (4 * (g / 8))) & 0x0F;
                let high = (sc[8 + g % 4] >> (2 * (g / 4))) & 0x03;
                let dl = d * ((low | (high << 4)) as i8 - 32) as f32;
                let (half, shift, first) = (g / 8, 2 * ((g % 8) / 2), 16 * (g % 2));
                let bit = g / 2;
                for (i, o) in qg.iter_mut().enumerate() {
                    let l = first + i;
                    // `q - 4` where the high-mask bit is clear: `q + 4 * bit` in 0..8.
                    *o = ((qs[32 * half + l] >> shift) & 3) | (((hmask[l] >> bit) & 1) << 2);
                }
                sm[g] = (dl, -4.0 * dl);
            }
        }
        QuantType::Q4K | QuantType::Q5K => {
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let sc = &b[4..16];
            let (qh, qs) = match ty {
                QuantType::Q5K => (Some(&b[16..48]), &b[48..176]),
                _ => (None, &b[16..144]),
            };
            for (g, qg) in q.chunks_exact_mut(32).enumerate() {
                let (sv, mv) = scale_min_k4(g, sc);
                let (src, shift) = (&qs[32 * (g / 2)..32 * (g / 2) + 32], 4 * (g % 2));
                for (i, (o, &v)) in qg.iter_mut().zip(src).enumerate() {
                    let fifth = qh.map_or(0, |h| ((h[i] >> g) & 1) << 4);
                    *o = ((v >> shift) & 0x0F) | fifth;
                }
                sm[g] = (d * sv as f32, -dmin * mv as f32);
            }
        }
        QuantType::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = half_at(b, 208);
            for (g, qg) in q.chunks_exact_mut(16).enumerate() {
                let (half, quarter) = (g / 8, (g % 8) / 2);
                for (i, o) in qg.iter_mut().enumerate() {
                    let l = 16 * (g % 2) + i;
                    let low = ql[64 * half + l + 32 * (quarter % 2)] >> (4 * (quarter / 2)) & 0x0F;
                    let high = (qh[32 * half + l] >> (2 * quarter)) & 0x03;
                    *o = low | (high << 4);
                }
                let dl = d * (sc[g] as i8) as f32;
                sm[g] = (dl, -32.0 * dl);
            }
        }
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::blocks::{dequantize, tests::quantized_bytes};

    /// Every integer type's form gives back its dequantized values (within the rounding of
    /// `s q + m` against the type's own expression), for its own group size and for 16.
    #[test]
    fn integers_give_back_the_dequantized_values() {
        let cols = 512;
        for ty in QuantType::ALL {
            let Some(own) = group_values(ty) else {
                let mut q = vec![0u8; cols];
                assert!(!integer_row(ty, &[], 32, &mut q, &mut [], &mut []));
                continue;
            };
            let bytes = quantized_bytes(ty, 1, cols, 3);
            assert!(!bytes.is_empty());
            let mut want = vec![0f32; cols];
            assert!(dequantize(ty, &bytes, &mut want));
            for group in [own, 16] {
                let (mut q, mut s, mut m) = (
                    vec![0u8; cols],
                    vec![0f32; cols / group],
                    vec![0f32; cols / group],
                );
                assert!(
                    integer_row(ty, &bytes, group, &mut q, &mut s, &mut m),
                    "{ty}"
                );
                for (i, &w) in want.iter().enumerate() {
                    let v = s[i / group] * f32::from(q[i]) + m[i / group];
                    let tol = 1e-6 * (s[i / group].abs() * 256.0 + m[i / group].abs()) + 1e-30;
                    assert!(
                        (v - w).abs() <= tol,
                        "{ty} group {group} value {i}: {v} vs {w}"
                    );
                }
            }
            // A group the type cannot give, or sizes that do not fit.
            let (mut q, mut s, mut m) = (vec![0u8; cols], vec![0f32; 8], vec![0f32; 8]);
            assert!(!integer_row(ty, &bytes, 64, &mut q, &mut s, &mut m));
            assert!(!integer_row(ty, &bytes[1..], own, &mut q, &mut s, &mut m));
        }
    }
}
