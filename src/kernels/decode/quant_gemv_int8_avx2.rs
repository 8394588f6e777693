//! The opt-in 8-bit-activation products of GGUF rows on CPUs without AVX-512 VNNI but with
//! AVX2 (most laptops), as llama.cpp's AVX2 kernels compute them: per 32-value block the
//! weight's integers as unsigned bytes meet `x`'s signed bytes ([`QuantizedX`]) in
//! `vpmaddubsw` (pairs of byte products summed into 16-bit lanes) and `vpmaddwd` (pairs of
//! those into 32-bit lanes), then one scaled FMA. Q8_0's signed weights go in as their
//! magnitudes with their signs moved onto `x` (`vpsignb`), so that no 16-bit sum
//! saturates (at most 2 x 128 x 127); the other types as in
//! [`crate::kernels::decode::quant_gemv_vnni`], with their offset or `m` terms, the K-quants
//! (256-value blocks) 32 values at a time with their groups' scales. Each block is
//! unpacked once for up to 2 rows of `x`, and the 32-value types' scales are converted 8
//! blocks at a time.

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::kernels::decode::row_kernels::RowKernels;
#[cfg(target_arch = "x86_64")]
use crate::kernels::decode::x86_helpers::{halves8, weights, with_x};
use crate::kernels::quant::activations::QuantizedX;
use crate::kernels::quant::blocks::QuantType;

/// This instruction set's 8-bit row kernels ([`RowKernels`]): AVX2, FMA and F16C (where the
/// exact AVX2 ones run), up to 2 rows of `x` per unpacked block.
pub(crate) struct Int8Avx2;

impl RowKernels for Int8Avx2 {
    type Rows = [QuantizedX];

    const MOST_ROWS: usize = 2;

    fn cpu_runs() -> bool {
        crate::kernels::simd::avx2_fma_f16c()
    }

    unsafe fn rows_dots_checked<const R: usize>(
        ty: QuantType,
        rows: &[u8],
        row_bytes: usize,
        xs: &[QuantizedX],
        _inp: usize,
        out: &mut [f32],
        ldo: usize,
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use crate::kernels::decode::prefetch::{rows_ahead, AHEAD};
            use crate::kernels::quant::row_kinds::kind::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
            use crate::kernels::quant::row_kinds::{FIVE_BITS, FOUR_BITS, THREE_BITS, TWO_BITS};
            let end = rows.as_ptr_range().end;
            // Each row's lines requested `AHEAD` bytes ahead.
            macro_rules! each_row {
                ($dot:ident $(::<$k:ident>)?) => {
                    for (j, row) in rows.chunks_exact(row_bytes).enumerate() {
                        rows_ahead(row.as_ptr(), row_bytes, AHEAD, end);
                        // SAFETY: the caller checked the features (`supports`) and the sizes:
                        // `row` holds `inp / 32` whole blocks (`inp / 256` for the K-quants),
                        // each of `xs` `inp` values.
                        let sums = unsafe { $dot::<$($k,)? R>(row.as_ptr(), xs) };
                        out[j * ldo..j * ldo + R].copy_from_slice(&sums);
                    }
                };
            }
            match ty {
                QuantType::Q8_0 => each_row!(dot::<Q8_0>),
                QuantType::Q4_0 => each_row!(dot::<Q4_0>),
                QuantType::Q4_1 => each_row!(dot::<Q4_1>),
                QuantType::Q5_0 => each_row!(dot::<Q5_0>),
                QuantType::Q4K => each_row!(dot_q4_k::<FOUR_BITS>),
                QuantType::Q5K => each_row!(dot_q4_k::<FIVE_BITS>),
                QuantType::Q6K => each_row!(dot_q6_k),
                QuantType::Q2K => each_row!(dot_q2_q3_k::<TWO_BITS>),
                QuantType::Q3K => each_row!(dot_q2_q3_k::<THREE_BITS>),
                QuantType::Q5_1 => each_row!(dot::<Q5_1>),
                // `supports` filtered the types: another has no kernel here.
                _ => return false,
            }
            true
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (ty, rows, xs, out, ldo, row_bytes);
            false
        }
    }
}

/// One row of `K` blocks at `b0` against each of the `R` rows of `xs`: per block the byte
/// products summed into 8 lanes, scaled by `d dx` into the accumulator of even or odd
/// blocks, and the offset or `m` term summed apart; each block unpacked once for all rows.
///
/// # Safety
/// AVX2, FMA and F16C; `b0` points at `xs[0].d.len()` whole blocks, `xs` holds `R` rows of
/// that many blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot<const K: u8, const R: usize>(b0: *const u8, xs: &[QuantizedX]) -> [f32; R] {
    use crate::kernels::decode::x86_helpers::hsum;
    use crate::kernels::quant::row_kinds::kind::{self, Q4_0, Q5_0, Q8_0};
    let size = kind::quant_type(K).block_bytes();
    let n = xs[0].d.len();
    let (mut even, mut odd) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
    let (mut terms_even, mut terms_odd) = ([0f32; R], [0f32; R]);
    let mut terms8 = [_mm256_setzero_ps(); R];
    let ones = _mm256_set1_epi16(1);
    // Eight blocks a step: their scales converted and multiplied by `x`'s as one vector, the
    // offset or `m` terms added 8 lanes at once; even and odd blocks into two accumulators.
    let mut i = 0;
    while i + 8 <= n {
        let blk = |k: usize| b0.add((i + k) * size);
        let eight = |at: usize| halves8(b0.add(i * size + at), size);
        let d8 = eight(0);
        let factor8 = match K {
            Q4_0 => _mm256_mul_ps(d8, _mm256_set1_ps(-8.0)),
            Q5_0 => _mm256_mul_ps(d8, _mm256_set1_ps(-16.0)),
            Q8_0 => _mm256_setzero_ps(),
            _ => eight(2),
        };
        let s8: [__m256; R] =
            std::array::from_fn(|r| _mm256_mul_ps(d8, _mm256_loadu_ps(xs[r].d.as_ptr().add(i))));
        for k in 0..8 {
            let w = weights::<K>(blk(k));
            let lane = _mm256_set1_epi32(k as i32);
            for r in 0..R {
                let xv = _mm256_loadu_si256(xs[r].qs.as_ptr().add(32 * (i + k)) as *const __m256i);
                let (q, xv) = if K == Q8_0 {
                    (_mm256_sign_epi8(w.q, w.q), _mm256_sign_epi8(xv, w.q))
                } else {
                    (w.q, xv)
                };
                let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
                let scale = _mm256_permutevar8x32_ps(s8[r], lane);
                let acc = if k % 2 == 0 {
                    &mut even[r]
                } else {
                    &mut odd[r]
                };
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, *acc);
            }
        }
        for r in 0..R {
            let dsum = _mm256_loadu_ps(xs[r].dsum.as_ptr().add(i));
            terms8[r] = _mm256_fmadd_ps(factor8, dsum, terms8[r]);
        }
        i += 8;
    }
    // Two blocks a step, one into each accumulator (two chains in flight).
    while i + 2 <= n {
        let (wa, wb) = (
            weights::<K>(b0.add(i * size)),
            weights::<K>(b0.add((i + 1) * size)),
        );
        for r in 0..R {
            with_x::<K>(wa, &xs[r], i, &mut even[r], &mut terms_even[r]);
            with_x::<K>(wb, &xs[r], i + 1, &mut odd[r], &mut terms_odd[r]);
        }
        i += 2;
    }
    if i < n {
        let w = weights::<K>(b0.add(i * size));
        for r in 0..R {
            with_x::<K>(w, &xs[r], i, &mut even[r], &mut terms_even[r]);
        }
    }
    std::array::from_fn(|r| {
        hsum(_mm256_add_ps(even[r], odd[r])) + (terms_even[r] + terms_odd[r]) + hsum(terms8[r])
    })
}

/// One Q4_K row (with `Q5`, Q5_K: `u8 qh[32]` before `qs`, bit `g` of `qh[l]` the fifth bit
/// of value `l` of group `g`) against each of the `R` rows of `xs` (the layout in
/// `quant_gemv_vnni`'s kernel): per 32-value group `g`, its 4- or 5-bit values against `x`'s
/// block `g` in `vpmaddubsw` and `vpmaddwd`, scaled by `d sc_g dx_g`; the `dmin m_g dsum_g`
/// terms summed apart.
///
/// # Safety
/// AVX2, FMA and F16C; `b0` points at `xs[0].d.len() / 8` whole blocks, `xs` holds `R` rows
/// of that many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k<const Q5: bool, const R: usize>(b0: *const u8, xs: &[QuantizedX]) -> [f32; R] {
    use crate::kernels::decode::x86_helpers::{halves_at, hsum};
    use crate::kernels::quant::blocks::scales_mins_k4;
    let (mut even, mut odd) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
    let mut terms = [0f32; R];
    let (mask, one, ones) = (
        _mm256_set1_epi8(0x0F),
        _mm256_set1_epi8(1),
        _mm256_set1_epi16(1),
    );
    let (size, qs_at) = if Q5 { (176, 48) } else { (144, 16) };
    for blk in 0..xs[0].d.len() / 8 {
        let b = b0.add(blk * size);
        let dm = halves_at(b);
        let (d, dmin) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
        let (sc, mins) = scales_mins_k4(&*(b.add(4) as *const [u8; 12]));
        let qh = if Q5 {
            _mm256_loadu_si256(b.add(16) as *const __m256i)
        } else {
            _mm256_setzero_si256()
        };
        for p in 0..4 {
            let bytes = _mm256_loadu_si256(b.add(qs_at + 32 * p) as *const __m256i);
            let halves = [
                _mm256_and_si256(bytes, mask),
                _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), mask),
            ];
            for (h, w) in halves.into_iter().enumerate() {
                let g = 2 * p + h;
                let w = if Q5 {
                    // Bit g of each `qh` byte to bit 4 (shifted within 16-bit words, masked
                    // to each byte's bit 0 before moving up).
                    let bit = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(g as i32));
                    _mm256_or_si256(w, _mm256_slli_epi16::<4>(_mm256_and_si256(bit, one)))
                } else {
                    w
                };
                let i = 8 * blk + g;
                let (dl, ml) = (
                    d * ((sc >> (8 * g)) & 0xFF) as f32,
                    dmin * ((mins >> (8 * g)) & 0xFF) as f32,
                );
                for r in 0..R {
                    let x = &xs[r];
                    let xv = _mm256_loadu_si256(x.qs.as_ptr().add(32 * i) as *const __m256i);
                    let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
                    let f = _mm256_set1_ps(dl * *x.d.get_unchecked(i));
                    let acc = if h == 0 { &mut even[r] } else { &mut odd[r] };
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), f, *acc);
                    terms[r] -= ml * *x.dsum.get_unchecked(i);
                }
            }
        }
    }
    std::array::from_fn(|r| hsum(_mm256_add_ps(even[r], odd[r])) + terms[r])
}

/// One Q2_K row or, with `Q3`, Q3_K row against each of the `R` rows of `xs` (the layouts
/// in `quant_gemv_vnni`'s kernel): per 32 values in order (two 16-value groups), the
/// unsigned bits (Q3_K: its third bit added as 4) against `x`'s bytes in `vpmaddubsw` and
/// `vpmaddwd`, 4 lanes a group scaled by `d sc_g dx` (Q2_K: `d (sc_g & 15) dx`). Q3_K's sums start from `x`'s `-4 sum
/// qx` per 4 values (its `-32` offsets shifted right by 3, exact); Q2_K's `-dmin m_g dx sum
/// qx` (`m_g = sc_g >> 4`) is those offsets' lanes times `dmin m_g dx / 32`.
///
/// # Safety
/// AVX2, FMA and F16C; `b0` points at `xs[0].d.len() / 8` whole blocks, `xs` holds `R` rows
/// of that many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q2_q3_k<const Q3: bool, const R: usize>(
    b0: *const u8,
    xs: &[QuantizedX],
) -> [f32; R] {
    use crate::kernels::decode::x86_helpers::{half_before, halves_at, hsum, q3_k_scales};
    let (mut even, mut odd) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
    let (size, qs_at) = if Q3 { (110, 32) } else { (84, 16) };
    let (twos, one, ones) = (
        _mm256_set1_epi8(0x03),
        _mm256_set1_epi8(1),
        _mm256_set1_epi16(1),
    );
    // The lanes of the 32 values `128 h + 32 j..`: 4 from group `8 h + 2 j`, 4 from the next
    // (lanes `2 j`, `2 j + 1` of half `h`'s factors).
    let pairs: [__m256i; 4] = std::array::from_fn(|j| {
        let g = 2 * j as i32;
        _mm256_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1)
    });
    let shift = |v: __m256i, k: usize| _mm256_srl_epi16(v, _mm_cvtsi32_si128(k as i32));
    let eight = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    for blk in 0..xs[0].d.len() / 8 {
        let b = b0.add(blk * size);
        // `dl` (and Q2_K's `ml`) of groups `8 h..8 h + 8` in half `h`.
        let (dl, ml) = if Q3 {
            let sc = q3_k_scales(b.add(96));
            let d = _mm256_set1_ps(half_before(b.add(110)));
            let dl = [
                _mm256_mul_ps(d, eight(sc)),
                _mm256_mul_ps(d, eight(_mm_unpackhi_epi64(sc, sc))),
            ];
            (dl, [_mm256_setzero_ps(); 2])
        } else {
            let sc = _mm_loadu_si128(b as *const __m128i);
            let nib = _mm_set1_epi8(0x0F);
            let (low, high) = (
                _mm_and_si128(sc, nib),
                _mm_and_si128(_mm_srli_epi16::<4>(sc), nib),
            );
            let dm = halves_at(b.add(80));
            let (d, dmin) = (
                _mm256_broadcastss_ps(dm),
                _mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
            );
            // Scale the mins by 1 / 32 (exact) for the `-32` offsets.
            let dmin = _mm256_mul_ps(dmin, _mm256_set1_ps(1.0 / 32.0));
            let halves = |v: __m128i, f: __m256| {
                [
                    _mm256_mul_ps(f, eight(v)),
                    _mm256_mul_ps(f, eight(_mm_unpackhi_epi64(v, v))),
                ]
            };
            (halves(low, d), halves(high, dmin))
        };
        let hmask = if Q3 {
            _mm256_loadu_si256(b as *const __m256i)
        } else {
            _mm256_setzero_si256()
        };
        for h in 0..2 {
            let q = _mm256_loadu_si256(b.add(qs_at + 32 * h) as *const __m256i);
            for (j, lanes) in pairs.iter().enumerate() {
                let bits = _mm256_and_si256(shift(q, 2 * j), twos);
                let w = if Q3 {
                    let third = _mm256_and_si256(shift(hmask, 4 * h + j), one);
                    _mm256_or_si256(bits, _mm256_slli_epi16::<2>(third))
                } else {
                    bits
                };
                let at = 256 * blk + 128 * h + 32 * j;
                let f = _mm256_permutevar8x32_ps(dl[h], *lanes);
                let fm = _mm256_permutevar8x32_ps(ml[h], *lanes);
                for r in 0..R {
                    let x = &xs[r];
                    let xv = _mm256_loadu_si256(x.qs.as_ptr().add(at) as *const __m256i);
                    let offsets =
                        _mm256_loadu_si256(x.offsets.as_ptr().add(at / 4) as *const __m256i);
                    let products = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
                    let sums = if Q3 {
                        _mm256_add_epi32(_mm256_srai_epi32::<3>(offsets), products)
                    } else {
                        products
                    };
                    let dx = _mm256_set1_ps(*x.d.get_unchecked(at / 32));
                    let acc = if j % 2 == 0 {
                        &mut even[r]
                    } else {
                        &mut odd[r]
                    };
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(f, dx), *acc);
                    if !Q3 {
                        *acc = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(offsets),
                            _mm256_mul_ps(fm, dx),
                            *acc,
                        );
                    }
                }
            }
        }
    }
    std::array::from_fn(|r| hsum(_mm256_add_ps(even[r], odd[r])))
}

/// One Q6_K row against each of the `R` rows of `xs` (the layout in `quant_gemv_vnni`'s
/// kernel): per 32 values, `q` (0..64) against `x`'s bytes in `vpmaddubsw` and `vpmaddwd`,
/// plus `x`'s `-32 sum qx` per 4 values (the offset), the two 16-value groups' lanes scaled
/// by `d sc_g dx`.
///
/// # Safety
/// AVX2, FMA and F16C; `b0` points at `xs[0].d.len() / 8` whole blocks, `xs` holds `R` rows
/// of that many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k<const R: usize>(b0: *const u8, xs: &[QuantizedX]) -> [f32; R] {
    use crate::kernels::decode::x86_helpers::{half_before, hsum};
    let (mut even, mut odd) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
    let (fours, twos, ones) = (
        _mm256_set1_epi8(0x0F),
        _mm256_set1_epi8(0x03),
        _mm256_set1_epi16(1),
    );
    for blk in 0..xs[0].d.len() / 8 {
        let b = b0.add(blk * 210);
        let d = half_before(b.add(210));
        let sc = b.add(192) as *const i8;
        for h in 0..2 {
            let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
            for t in 0..4 {
                let ql = _mm256_loadu_si256(b.add(64 * h + 32 * (t % 2)) as *const __m256i);
                let low = if t < 2 {
                    _mm256_and_si256(ql, fours)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql), fours)
                };
                let high =
                    _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t as i32)), twos);
                let w = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
                let at = 256 * blk + 128 * h + 32 * t;
                let g = 8 * h + 2 * t;
                let (dla, dlb) = (d * f32::from(*sc.add(g)), d * f32::from(*sc.add(g + 1)));
                for r in 0..R {
                    let x = &xs[r];
                    let xv = _mm256_loadu_si256(x.qs.as_ptr().add(at) as *const __m256i);
                    let start =
                        _mm256_loadu_si256(x.offsets.as_ptr().add(at / 4) as *const __m256i);
                    let sums = _mm256_add_epi32(
                        start,
                        _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones),
                    );
                    let dx = *x.d.get_unchecked(at / 32);
                    let scale = _mm256_setr_m128(_mm_set1_ps(dla * dx), _mm_set1_ps(dlb * dx));
                    let acc = if t % 2 == 0 {
                        &mut even[r]
                    } else {
                        &mut odd[r]
                    };
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, *acc);
                }
            }
        }
    }
    std::array::from_fn(|r| hsum(_mm256_add_ps(even[r], odd[r])))
}
