//! AVX2 + FMA + F16C dot products of one GGUF weight row with `x` (CPUs without AVX-512:
//! most laptops), for the same types as [`crate::kernels::decode::quant_gemv_avx512`]: each
//! block unpacked in registers, eight values at a time, its values made exactly as gguf-py
//! makes them, multiplied into f32 accumulators as they go. The types with a minimum make
//! each value as one fused `d * q + m` (Q4_K's `dl * q - ml`): `d * q` is exact in f32 (an
//! f16 `d` has 11 significant bits, `q` at most 5; Q4_K's `dl = d * sc` 17, `q` 4), so the
//! one rounding of the fused step is gguf-py's product then sum. Where a block's values are
//! `d` times integers (Q4_0, Q5_0, Q8_0), the integers' products with `x` are summed and then
//! multiplied by `d` once: the same sum as gguf-py's values times `x` in exact arithmetic,
//! rounded differently (f32 rounding).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use crate::kernels::decode::held_lanes::HeldLanes;
use crate::kernels::decode::row_kernels::RowKernels;
#[cfg(target_arch = "x86_64")]
use crate::kernels::decode::x86_helpers::{fifth_bit_set, fifth_bits, nibbles};
#[cfg(target_arch = "x86_64")]
use crate::kernels::decode::x86_helpers::{
    half_at, half_before, halves_at, q3_k_scales, q6_k_bytes,
};
#[cfg(target_arch = "x86_64")]
use crate::kernels::quant::blocks::scales_mins_k4;
use crate::kernels::quant::blocks::QuantType;
#[cfg(target_arch = "x86_64")]
use crate::kernels::quant::row_kinds::kind;

/// This instruction set's exact row kernels ([`RowKernels`]): AVX2, FMA and F16C (most
/// laptops), up to 2 rows of `x` per unpacked block.
pub(crate) struct Avx2;

impl RowKernels for Avx2 {
    type Rows = [f32];

    const MOST_ROWS: usize = 2;

    fn cpu_runs() -> bool {
        crate::kernels::simd::avx2_fma_f16c()
    }

    unsafe fn rows_dots_checked<const R: usize>(
        ty: QuantType,
        rows: &[u8],
        row_bytes: usize,
        xs: &[f32],
        inp: usize,
        out: &mut [f32],
        ldo: usize,
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: the caller checked the features (`supports`) and the sizes (`shape`):
            // `rows` holds whole rows of `row_bytes`, `xs` `R` rows of `inp` values, `out`
            // `(n - 1) ldo + R` floats.
            unsafe { rows_dots_avx2::<R>(ty, rows, row_bytes, xs.as_ptr(), inp, out, ldo) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (ty, rows, row_bytes, xs, inp, out, ldo);
            false
        }
    }
}

#[cfg(target_arch = "x86_64")]
use crate::kernels::quant::row_kinds::kind::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};

/// # Safety
/// AVX2, FMA and F16C; `rows` holds whole rows of `row_bytes` (`inp` values in blocks of `ty`),
/// `xs` points at `R` rows of `inp` readable floats, `out` holds `(rows - 1) ldo + R` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_dots_avx2<const R: usize>(
    ty: QuantType,
    rows: &[u8],
    row_bytes: usize,
    xs: *const f32,
    inp: usize,
    out: &mut [f32],
    ldo: usize,
) -> bool {
    use crate::kernels::decode::prefetch::{rows_ahead, AHEAD};
    // One loop over the rows per type, the kernel inlined in it; the rows' sums reduced 8
    // at a time (one transposing tree instead of a horizontal sum per row); each row's
    // lines requested `AHEAD` bytes ahead.
    macro_rules! each_row {
        ($row:ident => $dot:expr) => {{
            let mut pending = [[_mm256_setzero_ps(); 8]; R];
            let mut first = 0;
            let end = rows.as_ptr_range().end;
            for (j, $row) in rows.chunks_exact(row_bytes).enumerate() {
                rows_ahead($row.as_ptr(), row_bytes, AHEAD, end);
                let acc = $dot;
                for (r, a) in acc.iter().enumerate() {
                    pending[r][j - first] =
                        _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
                }
                if j + 1 - first == 8 {
                    write_sums(&pending, 8, &mut out[first * ldo..], ldo);
                    first = j + 1;
                }
            }
            let left = rows.len() / row_bytes - first;
            if left > 0 {
                for p in pending.iter_mut() {
                    p[left..].fill(_mm256_setzero_ps());
                }
                write_sums(&pending, left, &mut out[first * ldo..], ldo);
            }
        }};
    }
    match ty {
        QuantType::Q8_0 => each_row!(row => dot_blocks::<Q8_0, R>(row, xs, inp)),
        QuantType::Q4_0 => each_row!(row => dot_blocks::<Q4_0, R>(row, xs, inp)),
        QuantType::Q4_1 => each_row!(row => dot_blocks::<Q4_1, R>(row, xs, inp)),
        QuantType::Q5_0 => each_row!(row => dot_blocks::<Q5_0, R>(row, xs, inp)),
        QuantType::Q2K => each_row!(row => dot_q2_q3_k::<R, false>(row, xs, inp)),
        QuantType::Q3K => each_row!(row => dot_q2_q3_k::<R, true>(row, xs, inp)),
        QuantType::Q4K => each_row!(row => dot_q4_k::<R, false>(row, xs, inp)),
        QuantType::Q5K => each_row!(row => dot_q4_k::<R, true>(row, xs, inp)),
        QuantType::Q6K => each_row!(row => dot_q6_k::<R>(row, xs, inp)),
        QuantType::Q5_1 => each_row!(row => dot_blocks::<Q5_1, R>(row, xs, inp)),
        // `supports` filtered the types: another has no kernel here.
        _ => return false,
    }
    true
}

/// `out[ldo i + r]` = the sum of `pending[r][i]`'s lanes for `i < n`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn write_sums<const R: usize>(
    pending: &[[__m256; 8]; R],
    n: usize,
    out: &mut [f32],
    ldo: usize,
) {
    for (r, p) in pending.iter().enumerate() {
        let mut sums = [0f32; 8];
        _mm256_storeu_ps(sums.as_mut_ptr(), sum8(p));
        for (i, &s) in sums.iter().take(n).enumerate() {
            out[i * ldo + r] = s;
        }
    }
}

/// Lane `i` = the sum of `v[i]`'s 8 lanes, in an order that depends on `v[i]` alone.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sum8(v: &[__m256; 8]) -> __m256 {
    // Pairs: per 128-bit lane (a0 + a2, b0 + b2, a1 + a3, b1 + b3).
    let w: [__m256; 4] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b))
    });
    // Fours: per 128-bit lane, one partial sum of each of 4 rows.
    let x: [__m256; 2] = std::array::from_fn(|i| {
        let (a, b) = (_mm256_castps_pd(w[2 * i]), _mm256_castps_pd(w[2 * i + 1]));
        _mm256_add_ps(
            _mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
            _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)),
        )
    });
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(x[0], x[1]),
        _mm256_permute2f128_ps::<0x31>(x[0], x[1]),
    )
}

/// Bytes `8 i..8 i + 8` of `v` (`i = half`), signed or unsigned, as 8 i32 lanes.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn byte_lanes<const SIGNED: bool>(v: __m128i, half: bool) -> __m256i {
    let v = if half { _mm_srli_si128(v, 8) } else { v };
    if SIGNED {
        _mm256_cvtepi8_epi32(v)
    } else {
        _mm256_cvtepu8_epi32(v)
    }
}

/// The 32 bytes of `v`, signed or unsigned, as four groups of 8 i32 lanes (bytes
/// `8 g..8 g + 8`).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn byte_groups<const SIGNED: bool>(v: __m256i) -> [__m256i; 4] {
    let (low, high) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    [
        byte_lanes::<SIGNED>(low, false),
        byte_lanes::<SIGNED>(low, true),
        byte_lanes::<SIGNED>(high, false),
        byte_lanes::<SIGNED>(high, true),
    ]
}

/// The 32 values of a 4-bit block's 16 bytes at `qs` as four groups of 8 i32 lanes (values
/// `8 g..8 g + 8`: the low nibbles of bytes 0..8 and 8..16, then their high nibbles), each
/// group from bytes widened as they are loaded: six instructions for [`nibbles`] and
/// [`byte_groups`]' twelve.
///
/// # Safety
/// AVX2 (the caller's target features); 16 readable bytes at `qs`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn nibble_groups(qs: *const u8) -> [__m256i; 4] {
    let a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs as *const __m128i));
    let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(8) as *const __m128i));
    let mask = _mm256_set1_epi32(0x0F);
    [
        _mm256_and_si256(a, mask),
        _mm256_and_si256(b, mask),
        _mm256_srli_epi32::<4>(a),
        _mm256_srli_epi32::<4>(b),
    ]
}

/// [`nibbles`] with the 16 bytes broadcast to both lanes and the high lane shifted by 4 (per
/// 32-bit word; the bits crossing in from a neighbour byte are masked off): three
/// instructions for five, fewer on the shuffle pipes. Only Q5_0 takes it: it measured faster
/// there and slower for Q4_1 (docs/performance-archive.md).
///
/// # Safety
/// AVX2 (the caller's target features); 16 readable bytes at `qs`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn nibbles_by_shift(qs: *const u8) -> __m256i {
    let b = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
    let shifted = _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
}

/// The 32 values `d * q + m` of the Q4_1 or Q5_1 block at `b` as four groups of 8 lanes
/// (values `8 g..8 g + 8`), each made as gguf-py makes it, in one fused step.
///
/// # Safety
/// AVX2, FMA and F16C; `b` points at a whole block of kind `K` (Q4_1 or Q5_1).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_values<const K: u8>(b: *const u8) -> [__m256; 4] {
    debug_assert!(matches!(K, Q4_1 | Q5_1));
    let d = _mm256_set1_ps(half_at(b));
    // Q5_1: the values as bytes in order (low nibbles, then high) with the fifth bits (bit
    // j of `qh` for value j) put in, then 8 lanes at a time; Q4_1's from bytes widened as
    // they load.
    let q = if K == Q5_1 {
        byte_groups::<false>(_mm256_or_si256(nibbles(b.add(8)), fifth_bits(b.add(4))))
    } else {
        nibble_groups(b.add(4))
    };
    let m = _mm256_set1_ps(half_at(b.add(2)));
    q.map(|lanes| _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lanes), m))
}

/// The 32 integers whose products with the block's `d` are its values, for the types whose
/// values are such products (`q` of Q8_0, `q - 8` of Q4_0, `q - 16` of Q5_0), as f32 in four
/// groups of 8 lanes (values `8 g..8 g + 8`).
///
/// # Safety
/// AVX2, FMA and F16C; `b` points at a whole block of kind `K` (Q4_0, Q5_0 or Q8_0).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_integers<const K: u8>(b: *const u8) -> [__m256; 4] {
    debug_assert!(matches!(K, Q4_0 | Q5_0 | Q8_0));
    if K == Q8_0 {
        let q = b.add(2);
        return std::array::from_fn(|g| {
            let v = _mm_loadl_epi64(q.add(8 * g) as *const __m128i);
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
        });
    }
    if K == Q5_0 {
        let v = nibbles_by_shift(b.add(6));
        // `q - 16`: the offset taken off the bytes once for the block (signed from then on;
        // faster than on the lanes, and Q4_0 the other way round), as `low - 16`
        // where the fifth bit is clear, `low` where it is set.
        let clear = _mm256_andnot_si256(fifth_bit_set(b.add(2)), _mm256_set1_epi8(-16));
        return byte_groups::<true>(_mm256_add_epi8(v, clear)).map(|l| _mm256_cvtepi32_ps(l));
    }
    // Q4_0's `q - 8`: the offset on the integers (measured faster than folding it into a
    // fused `d * q - 8 d`, or taking it off the bytes).
    let o = _mm256_set1_epi32(8);
    nibble_groups(b.add(2)).map(|l| _mm256_cvtepi32_ps(_mm256_sub_epi32(l, o)))
}

/// The dot products of whole `K` blocks with each of `R` rows of `x` (row stride `inp`):
/// four accumulators a row, summed by the caller.
///
/// # Safety
/// AVX2, FMA and F16C; `row` holds `inp / 32` whole blocks, `xp` `R` rows of `inp` values.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_blocks<const K: u8, const R: usize>(
    row: &[u8],
    xp: *const f32,
    inp: usize,
) -> [[__m256; 4]; R] {
    let size = kind::quant_type(K).block_bytes();
    let bp = row.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    if matches!(K, Q4_0 | Q5_0 | Q8_0) {
        // Values `d * q'` exact in f32 (an f16 `d` has 11 significant bits, `q'` at most 8):
        // each block's `q' x` summed, then multiplied by `d` once, is the sum of gguf-py's
        // values times `x` up to f32 rounding, with three multiplications a block fewer for
        // one row of `x`.
        for i in 0..inp / 32 {
            let b = bp.add(i * size);
            let q = block_integers::<K>(b);
            let d = _mm256_set1_ps(half_at(b));
            for (r, acc) in acc.iter_mut().enumerate() {
                let xb = xp.add(r * inp + i * 32);
                let mut s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
                for (g, &qg) in q.iter().enumerate().skip(1) {
                    s = _mm256_fmadd_ps(qg, _mm256_loadu_ps(xb.add(8 * g)), s);
                }
                acc[i % 4] = _mm256_fmadd_ps(d, s, acc[i % 4]);
            }
        }
        return acc;
    }
    for i in 0..inp / 32 {
        let w = block_values::<K>(bp.add(i * size));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xb = xp.add(r * inp + i * 32);
            for (g, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(w[g], _mm256_loadu_ps(xb.add(8 * g)), *a);
            }
        }
    }
    acc
}

/// `acc += (dl * q - ml) * x` over 32 values `q` in four groups of 8 i32 lanes (gguf-py's
/// Q4_K form: the product, then the difference, as one fused step: `dl * q` is exact).
///
/// # Safety
/// AVX2, FMA and F16C; `x` points at `R` rows (row stride `inp`) of 32 readable floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fma_scaled_min<const R: usize>(
    q: [__m256i; 4],
    dl: __m256,
    ml: __m256,
    x: *const f32,
    inp: usize,
    acc: &mut [[__m256; 4]; R],
) {
    for (g, lanes) in q.into_iter().enumerate() {
        let w = _mm256_fmsub_ps(dl, _mm256_cvtepi32_ps(lanes), ml);
        for (r, a) in acc.iter_mut().enumerate() {
            a[g] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x.add(r * inp + 8 * g)), a[g]);
        }
    }
}

/// Q4_K rows: `{ f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }` per 256 values; group `g`
/// is `d * sc_g * q - dmin * m_g` over the low (even `g`) or high (odd) nibbles of
/// `qs[32 (g / 2)..][..32]`. With `Q5`, Q5_K rows: `u8 qh[32]` before `qs`, bit `g` of
/// `qh[l]` the fifth bit of value `l` of group `g`.
///
/// # Safety
/// AVX2, FMA and F16C; `row` holds `inp / 256` whole blocks, `xp` `R` rows of `inp` readable
/// floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k<const R: usize, const Q5: bool>(
    row: &[u8],
    xp: *const f32,
    inp: usize,
) -> [[__m256; 4]; R] {
    let bp = row.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let nibble = _mm256_set1_epi32(0x0F);
    let (size, qs_at) = if Q5 { (176, 48) } else { (144, 16) };
    for blk in 0..inp / 256 {
        let b = bp.add(blk * size);
        // Q5_K: byte `l` of `qh` shifted left by 4, lanes as the `qs` bytes below; bit `g`
        // lands on bit 4 after a right shift by `g`.
        let high: [__m256i; 4] = std::array::from_fn(|c| {
            if Q5 {
                let v = _mm_loadl_epi64(b.add(16 + 8 * c) as *const __m128i);
                _mm256_slli_epi32::<4>(_mm256_cvtepu8_epi32(v))
            } else {
                _mm256_setzero_si256()
            }
        });
        // `dl` (`d * sc`) and `ml` of the 8 groups, lane g for group g.
        let dm = halves_at(b);
        let (sc, mins) = scales_mins_k4(&*(b.add(4) as *const [u8; 12]));
        let u8_floats =
            |v: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
        let dls = _mm256_mul_ps(_mm256_broadcastss_ps(dm), u8_floats(sc));
        let mls = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)), u8_floats(mins));
        // Group g's `dl` in lane g, its `ml` in lane 8 + g.
        let mut held = HeldLanes::new();
        let dl_ml = held.hold256(dls, mls);
        for p in 0..4 {
            // Bytes widened as they are loaded, 8 at a time: their low nibbles are group
            // `2 p`'s values, their high ones group `2 p + 1`'s.
            let qs = b.add(qs_at + 32 * p);
            let bytes: [__m256i; 4] = std::array::from_fn(|c| {
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(8 * c) as *const __m128i))
            });
            let mut ql = bytes.map(|v| _mm256_and_si256(v, nibble));
            let mut qh = bytes.map(|v| _mm256_srli_epi32::<4>(v));
            if Q5 {
                let bit4 = _mm256_set1_epi32(0x10);
                let fifth = |v: __m256i, g: usize| {
                    _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(g as i32)), bit4)
                };
                for c in 0..4 {
                    ql[c] = _mm256_or_si256(ql[c], fifth(high[c], 2 * p));
                    qh[c] = _mm256_or_si256(qh[c], fifth(high[c], 2 * p + 1));
                }
            }
            let xg = xp.add(blk * 256 + 64 * p);
            for (half, q) in [ql, qh].into_iter().enumerate() {
                let g = 2 * p + half;
                let (dl, ml) = (dl_ml.lane256(g), dl_ml.lane256(8 + g));
                fma_scaled_min(q, dl, ml, xg.add(32 * half), inp, &mut acc);
            }
        }
    }
    acc
}

/// Q2_K rows (`{ u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }` per 256 values) or, with
/// `Q3`, Q3_K rows (`{ u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }`): value `128 h +
/// 32 j + l` holds the two bits `qs[32 h + l] >> 2 j` in group `g = 8 h + 2 j + l / 16`, as
/// the AVX-512 kernel's `q2_q3_k_values` makes it (Q2_K: `(d * (sc_g & 15)) * q - dmin *
/// (sc_g >> 4)`; Q3_K: `(d * sc_g) * (q - 4)`, the 4 not taken where bit `4 h + j` of
/// `hmask[l]` is set).
///
/// # Safety
/// AVX2, FMA and F16C; `row` holds `inp / 256` whole blocks, `xp` `R` rows of `inp` readable
/// floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q2_q3_k<const R: usize, const Q3: bool>(
    row: &[u8],
    xp: *const f32,
    inp: usize,
) -> [[__m256; 4]; R] {
    let bp = row.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let (size, qs_at) = if Q3 { (110, 32) } else { (84, 16) };
    let (two_bits, one, four) = (
        _mm256_set1_epi32(3),
        _mm256_set1_epi32(1),
        _mm256_set1_epi32(4),
    );
    for blk in 0..inp / 256 {
        let b = bp.add(blk * size);
        // `dl` (and Q2_K's `ml`) of group g in lane g % 8 of the pair's `g / 8`th.
        let (dls, mls) = if Q3 {
            let sc = q3_k_scales(b.add(96));
            let d = _mm256_set1_ps(half_before(b.add(110)));
            let eight = |v: __m128i| _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
            (
                [eight(sc), eight(_mm_srli_si128::<8>(sc))],
                [_mm256_setzero_ps(); 2],
            )
        } else {
            let dm = halves_at(b.add(80));
            let (d, dmin) = (
                _mm256_broadcastss_ps(dm),
                _mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
            );
            let pair = |at: usize| {
                let sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.add(at) as *const __m128i));
                let low = _mm256_and_si256(sc, _mm256_set1_epi32(0x0F));
                (
                    _mm256_mul_ps(d, _mm256_cvtepi32_ps(low)),
                    _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(sc))),
                )
            };
            let ((d0, m0), (d1, m1)) = (pair(0), pair(8));
            ([d0, d1], [m0, m1])
        };
        let mut held = [HeldLanes::new(), HeldLanes::new()];
        let [dh, mh] = &mut held;
        let (dls, mls) = (dh.hold256(dls[0], dls[1]), mh.hold256(mls[0], mls[1]));
        let lane = |v: &HeldLanes, g: usize| v.lane256(g);
        let shift = |v: __m256i, n: usize| _mm256_srl_epi32(v, _mm_cvtsi32_si128(n as i32));
        // Q3_K: `hmask[l]`, `l = 8 c..8 c + 8`.
        let mask: [__m256i; 4] = std::array::from_fn(|c| {
            if Q3 {
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.add(8 * c) as *const __m128i))
            } else {
                _mm256_setzero_si256()
            }
        });
        for h in 0..2 {
            // Bytes `l = 8 c..8 c + 8` of the half's 32, widened as they load.
            let bytes: [__m256i; 4] = std::array::from_fn(|c| {
                let v = _mm_loadl_epi64(b.add(qs_at + 32 * h + 8 * c) as *const __m128i);
                _mm256_cvtepu8_epi32(v)
            });
            for j in 0..4 {
                let xg = xp.add(blk * 256 + 128 * h + 32 * j);
                for c in 0..4 {
                    let g = 8 * h + 2 * j + c / 2;
                    let q = _mm256_and_si256(shift(bytes[c], 2 * j), two_bits);
                    let w = if Q3 {
                        let set = _mm256_and_si256(shift(mask[c], 4 * h + j), one);
                        let q =
                            _mm256_sub_epi32(_mm256_or_si256(q, _mm256_slli_epi32::<2>(set)), four);
                        _mm256_mul_ps(lane(dls, g), _mm256_cvtepi32_ps(q))
                    } else {
                        _mm256_fmsub_ps(lane(dls, g), _mm256_cvtepi32_ps(q), lane(mls, g))
                    };
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let x = _mm256_loadu_ps(xg.add(r * inp + 8 * c));
                        acc[c] = _mm256_fmadd_ps(w, x, acc[c]);
                    }
                }
            }
        }
    }
    acc
}

/// Q6_K rows: `{ u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }` per 256 values; value
/// `128 h + 32 t + l` is `(d * scales[8 h + 2 t + l / 16]) * (q - 32)` with the low four
/// bits from `ql[64 h + 32 (t % 2) + l] >> 4 (t / 2)` and the high two from
/// `qh[32 h + l] >> 2 t`.
///
/// # Safety
/// AVX2, FMA and F16C; `row` holds `inp / 256` whole blocks, `xp` `R` rows of `inp` readable
/// floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k<const R: usize>(row: &[u8], xp: *const f32, inp: usize) -> [[__m256; 4]; R] {
    let bp = row.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    for blk in 0..inp / 256 {
        let b = bp.add(blk * 210);
        // `d * scales[g]`: lane g of `dls`.
        let d = _mm256_set1_ps(half_before(b.add(210)));
        let scales = _mm_loadu_si128(b.add(192) as *const __m128i);
        let mut held = HeldLanes::new();
        let dls = held.hold256(
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales))),
            _mm256_mul_ps(
                d,
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8))),
            ),
        );
        for h in 0..2 {
            for t in 0..4 {
                let q = q6_k_bytes(b, h, t);
                let halves = [_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)];
                let g = 8 * h + 2 * t;
                let xv = xp.add(blk * 256 + 128 * h + 32 * t);
                for k in 0..4 {
                    // Lanes 16 (k / 2)..: scale g + k / 2.
                    let s = g + k / 2;
                    let dl = dls.lane256(s);
                    let v = byte_lanes::<true>(halves[k / 2], k % 2 == 1);
                    let w = _mm256_mul_ps(dl, _mm256_cvtepi32_ps(v));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let xr = xv.add(r * inp + 8 * k);
                        a[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr), a[k]);
                    }
                }
            }
        }
    }
    acc
}

#[cfg(all(test, target_arch = "x86_64"))]
mod sum_tests {
    use super::*;

    /// Each lane is its vector's sum, whatever the other vectors hold.
    #[test]
    #[cfg_attr(not(cpu_avx2), ignore = "needs a CPU with AVX2 + FMA + F16C")]
    fn sum8_gives_each_vector_its_own_sum() {
        assert!(
            (is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")),
            "built for this CPU's kernels, running without them"
        );
        crate::kernels::decode::quant_gemv::check_sum_tree::<8>(|v| {
            let mut out = [0f32; 8];
            // SAFETY: AVX2, FMA and F16C checked above; 8 floats read and written per vector.
            unsafe {
                let v = v.map(|l| _mm256_loadu_ps(l.as_ptr()));
                _mm256_storeu_ps(out.as_mut_ptr(), sum8(&v));
            }
            out
        });
    }
}
