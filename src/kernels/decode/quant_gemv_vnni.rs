//! The opt-in 8-bit-activation products of GGUF rows (llama.cpp's way, not exact): `x` is
//! quantized once per product into blocks of 32 signed bytes with an f32 scale each
//! (`dx = max|x| / 127`, `qx = round(x / dx)`), and each weight block's integers meet them
//! in one AVX-512 VNNI instruction (`vpdpbusd`: 32 byte products summed into 8 lanes),
//! scaled once per block:
//!
//! `sum_k (d q_k + m) x_k ~ d dx sum_k q_k qx_k + m dx sum_k qx_k`
//!
//! The weight's integers go in as unsigned bytes: Q4_0's `q - 8`, Q5_0's `q - 16` and
//! Q8_0's signed `q` (its bytes XOR 0x80, `q + 128`) are summed as `q` plus an offset whose
//! term, `-offset d dx sum_k qx_k`, is added per block like Q4_1's and Q5_1's `m` term.
//! The K-quants' 256-value blocks take their groups' scales (per 32 values for Q4_K and
//! Q5_K, per 16 for Q2_K, Q3_K and Q6_K) in the same way: Q4_K and Q5_K with their `dmin m`
//! term per group, Q6_K and Q3_K with their offsets of 32 and 4, Q2_K with its mins.
//! The error against the f32 product is the quantization of `x` alone (the weight's values
//! are exact): at most `sum_k |w_k| dx / 2` per block.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::kernels::decode::row_kernels::RowKernels;
#[cfg(target_arch = "x86_64")]
use crate::kernels::decode::x86_helpers::read_u32;
use crate::kernels::quant::activations::QuantizedX;
use crate::kernels::quant::blocks::QuantType;
#[cfg(target_arch = "x86_64")]
use crate::kernels::quant::row_kinds::{FIVE_BITS, FOUR_BITS, THREE_BITS, TWO_BITS};

/// This instruction set's 8-bit row kernels ([`RowKernels`]): AVX-512 F, BW, VL and VNNI, up
/// to 4 rows of `x` per unpacked pair of blocks.
pub(crate) struct Vnni;

impl RowKernels for Vnni {
    type Rows = [QuantizedX];

    const MOST_ROWS: usize = 4;

    fn cpu_runs() -> bool {
        crate::kernels::simd::avx512_vnni()
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
            // SAFETY: the caller checked the features (`supports`) and the sizes (`shape`):
            // `rows` holds whole rows of blocks, each of `xs` `inp` values with their scales,
            // sums and offsets, `out` room for them.
            unsafe { rows_dots_vnni::<R>(ty, rows, row_bytes, xs, out, ldo) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (ty, rows, row_bytes, xs, out, ldo);
            false
        }
    }
}

/// [`Vnni`]'s products once checked: one loop over the rows per type.
///
/// # Safety
/// As [`dot_pairs`], for each row of `rows` (whole rows of `row_bytes`); `out` holds
/// `(rows - 1) ldo + R` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,avx2")]
unsafe fn rows_dots_vnni<const R: usize>(
    ty: QuantType,
    rows: &[u8],
    row_bytes: usize,
    xs: &[QuantizedX],
    out: &mut [f32],
    ldo: usize,
) -> bool {
    use crate::kernels::decode::prefetch::{rows_ahead, vnni_ahead};
    use crate::kernels::decode::x86_helpers::RowSums;
    use crate::kernels::quant::row_kinds::kind::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
    // The rows' lanes summed 16 rows at a time, as the exact kernels sum theirs; each row's
    // lines requested `ahead` bytes ahead where that helps (see `prefetch.rs`).
    let (ahead, end) = (vnni_ahead(), rows.as_ptr_range().end);
    macro_rules! each_row {
        ($dot:ident $(::<$k:ident>)?) => {{
            let mut sums = RowSums::<R>::new(out, ldo);
            for row in rows.chunks_exact(row_bytes) {
                if ahead > 0 {
                    rows_ahead(row.as_ptr(), row_bytes, ahead, end);
                }
                sums.push($dot::<$($k,)? R>(row.as_ptr(), xs));
            }
            sums.finish();
        }};
    }
    match ty {
        QuantType::Q8_0 => each_row!(dot_pairs::<Q8_0>),
        QuantType::Q4_0 => each_row!(dot_pairs::<Q4_0>),
        QuantType::Q4_1 => each_row!(dot_pairs::<Q4_1>),
        QuantType::Q5_0 => each_row!(dot_pairs::<Q5_0>),
        QuantType::Q4K => each_row!(dot_q4_k::<FOUR_BITS>),
        QuantType::Q5K => each_row!(dot_q4_k::<FIVE_BITS>),
        QuantType::Q6K => each_row!(dot_q6_k),
        QuantType::Q2K => each_row!(dot_q2_q3_k::<TWO_BITS>),
        QuantType::Q3K => each_row!(dot_q2_q3_k::<THREE_BITS>),
        QuantType::Q5_1 => each_row!(dot_pairs::<Q5_1>),
        // `supports` filtered the types: another has no kernel here.
        _ => return false,
    }
    true
}

/// One row of `K` blocks at `b0` against `x`, two blocks to an instruction: per pair one
/// 512-bit `vpdpbusd`, its 16 lanes scaled by each block's `d dx` (a vector of the two,
/// spread to the lanes each block's sums are in), the offset or `m` terms summed apart; a
/// last odd block in 256 bits (`crate::kernels::decode::x86_helpers::block`).
///
/// For each of the `R` rows of `xs`, the block pair unpacked once for all of them, each
/// row's own accumulators in the same order as alone.
///
/// # Safety
/// AVX-512 F, BW, VL, VNNI, F16C and FMA; `xs` holds `R` rows of one length, `b0` points at
/// `xs[0].d.len()` whole blocks.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,avx2")]
unsafe fn dot_pairs<const K: u8, const R: usize>(b0: *const u8, xs: &[QuantizedX]) -> [__m512; R] {
    use crate::kernels::quant::row_kinds::kind::{self, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
    let size = kind::quant_type(K).block_bytes();
    let n = xs[0].d.len();
    // Lanes of the sums: the pair's blocks in order, 8 lanes each.
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let (mut acc, mut terms) = ([_mm512_setzero_ps(); R], [_mm_setzero_ps(); R]);
    let mut xq = [std::ptr::null::<i8>(); R];
    for (q, x) in xq.iter_mut().zip(xs) {
        *q = x.qs.as_ptr();
    }
    let half = |p: *const u8| u32::from(u16::from_le_bytes([*p, *p.add(1)]));
    // The pair of blocks at `a` and `b` as 64 unsigned bytes, in the lanes `xq` expects.
    let pair = |a: *const u8, b: *const u8| -> __m512i {
        if K == Q8_0 {
            let lo = _mm512_castsi256_si512(_mm256_loadu_si256(a.add(2) as *const __m256i));
            let both = _mm512_inserti64x4::<1>(lo, _mm256_loadu_si256(b.add(2) as *const __m256i));
            _mm512_xor_si512(both, _mm512_set1_epi8(-128))
        } else {
            let at = match K {
                Q4_0 => 2,
                Q4_1 => 4,
                Q5_0 => 6,
                _ => 8,
            };
            // Both blocks' values in order (`x`'s own): `a`'s 16 bytes broadcast to the
            // first two 128-bit lanes, `b`'s to the last two (loads, no lane shuffles), the
            // second lane of each shifted down a nibble.
            let both = _mm512_mask_broadcast_i32x4(
                _mm512_broadcast_i32x4(_mm_loadu_si128(a.add(at) as *const __m128i)),
                0xFF00,
                _mm_loadu_si128(b.add(at) as *const __m128i),
            );
            let nibble = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
            let w = _mm512_and_si512(_mm512_srlv_epi32(both, nibble), _mm512_set1_epi8(0x0F));
            if K == Q5_0 || K == Q5_1 {
                // Bit j of `qh` is value j's fifth bit: `a`'s 32 bits, then `b`'s.
                let qh = if K == Q5_0 { 2 } else { 4 };
                let bits = u64::from(read_u32(a.add(qh))) | u64::from(read_u32(b.add(qh))) << 32;
                _mm512_mask_add_epi8(w, bits, w, _mm512_set1_epi8(0x10))
            } else {
                w
            }
        }
    };
    // Four pairs a step: the 8 blocks' scales (and offsets or `m`) converted and multiplied
    // as one vector each.
    let spreads: [__m512i; 4] =
        std::array::from_fn(|q| _mm512_add_epi32(spread, _mm512_set1_epi32(2 * q as i32)));
    let mut terms8 = [_mm256_setzero_ps(); R];
    let mut p = 0;
    while 2 * p + 8 <= n {
        let blk = |k: usize| b0.add((2 * p + k) * size);
        let eight = |at: usize| {
            crate::kernels::decode::x86_helpers::halves8(b0.add(2 * p * size + at), size)
        };
        let d8 = eight(0);
        let factor8 = match K {
            Q4_0 => _mm256_mul_ps(d8, _mm256_set1_ps(-8.0)),
            Q5_0 => _mm256_mul_ps(d8, _mm256_set1_ps(-16.0)),
            Q8_0 => _mm256_mul_ps(d8, _mm256_set1_ps(-128.0)),
            _ => eight(2),
        };
        let w: [__m512i; 4] = std::array::from_fn(|q| pair(blk(2 * q), blk(2 * q + 1)));
        for r in 0..R {
            let x = &xs[r];
            let s8 = _mm256_mul_ps(d8, _mm256_loadu_ps(x.d.as_ptr().add(2 * p)));
            let s8 = _mm512_castps256_ps512(s8);
            for (q, (wq, sq)) in w.iter().zip(&spreads).enumerate() {
                let xv = _mm512_loadu_si512(xq[r].add(64 * (p + q)) as *const _);
                let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), *wq, xv);
                let scale = _mm512_permutexvar_ps(*sq, s8);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
            }
            let dsum = _mm256_loadu_ps(x.dsum.as_ptr().add(2 * p));
            terms8[r] = _mm256_fmadd_ps(factor8, dsum, terms8[r]);
        }
        p += 4;
    }
    for p in p..n / 2 {
        let (a, b) = (b0.add(2 * p * size), b0.add((2 * p + 1) * size));
        let w = pair(a, b);
        // (d_a, d_b) and, for Q4_1 and Q5_1, (m_a, m_b) as f32 lanes 0 and 1.
        let (d, m) = if K == Q4_1 || K == Q5_1 {
            let dm = _mm_cvtph_ps(_mm_set_epi32(0, 0, read_u32(b) as i32, read_u32(a) as i32));
            (
                _mm_shuffle_ps::<0b10_00_10_00>(dm, dm),
                _mm_shuffle_ps::<0b11_01_11_01>(dm, dm),
            )
        } else {
            let dd = _mm_cvtph_ps(_mm_cvtsi32_si128((half(a) | half(b) << 16) as i32));
            (dd, dd)
        };
        let factor = match K {
            Q4_0 => _mm_mul_ps(m, _mm_set1_ps(-8.0)),
            Q5_0 => _mm_mul_ps(m, _mm_set1_ps(-16.0)),
            Q8_0 => _mm_mul_ps(m, _mm_set1_ps(-128.0)),
            _ => m,
        };
        for r in 0..R {
            let x = &xs[r];
            let sums = _mm512_dpbusd_epi32(
                _mm512_setzero_si512(),
                w,
                _mm512_loadu_si512(xq[r].add(64 * p) as *const _),
            );
            let dx = _mm_castpd_ps(_mm_load_sd(x.d.as_ptr().add(2 * p) as *const f64));
            let scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(d, dx)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
            let dsum = _mm_castpd_ps(_mm_load_sd(x.dsum.as_ptr().add(2 * p) as *const f64));
            terms[r] = _mm_fmadd_ps(factor, dsum, terms[r]);
        }
    }
    let mut out = acc;
    for (r, o) in out.iter_mut().enumerate() {
        // The terms' lanes past the pair's two are zero (their `dsum` lanes are).
        *o = _mm512_add_ps(*o, _mm512_zextps128_ps512(terms[r]));
        *o = _mm512_add_ps(*o, _mm512_zextps256_ps512(terms8[r]));
        if n % 2 == 1 {
            // The last block alone, as the AVX2 kernel takes it (the same integer sum).
            let (mut v, mut t) = (_mm256_setzero_ps(), 0f32);
            crate::kernels::decode::x86_helpers::block::<K>(
                b0.add((n - 1) * size),
                &xs[r],
                n - 1,
                &mut v,
                &mut t,
            );
            let last = _mm256_add_ps(v, _mm256_zextps128_ps256(_mm_set_ss(t)));
            *o = _mm512_add_ps(*o, _mm512_zextps256_ps512(last));
        }
    }
    out
}

/// One Q4_K row against `x`: per block of 256 values, `{ f16 d; f16 dmin; u8 scales[12];
/// u8 qs[128] }`, group `g` (32 values, `x`'s block `g`) is `d sc_g q - dmin m_g` over the
/// low (even `g`) or high (odd) nibbles of `qs[32 (g / 2)..][..32]`. A pair of groups is one
/// 512-bit `vpdpbusd` against `x`'s bytes in order, its lanes scaled by `d sc_g dx_g`; the
/// `dmin m_g dsum_g` terms are summed apart, 8 lanes a block. With `Q5`, Q5_K rows: `u8
/// qh[32]` before `qs`, bit `g` of `qh[l]` the fifth bit of value `l` of group `g` (the
/// values 0..32 are still unsigned bytes for `vpdpbusd`).
///
/// # Safety
/// As [`dot_pairs`] (`b0` at `xs[0].d.len() / 8` whole blocks).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,avx2")]
unsafe fn dot_q4_k<const Q5: bool, const R: usize>(
    b0: *const u8,
    xs: &[QuantizedX],
) -> [__m512; R] {
    use crate::kernels::decode::x86_helpers::halves_at;
    use crate::kernels::quant::blocks::scales_mins_k4;
    let n = xs[0].d.len() / 8;
    let (mut acc, mut terms) = ([_mm512_setzero_ps(); R], [_mm256_setzero_ps(); R]);
    let mask = _mm256_set1_epi8(0x0F);
    // Lanes 0..8 from group 2p's factor, 8..16 from group 2p + 1's.
    let spread = |p: i32| {
        _mm512_setr_epi32(
            2 * p,
            2 * p,
            2 * p,
            2 * p,
            2 * p,
            2 * p,
            2 * p,
            2 * p,
            2 * p + 1,
            2 * p + 1,
            2 * p + 1,
            2 * p + 1,
            2 * p + 1,
            2 * p + 1,
            2 * p + 1,
            2 * p + 1,
        )
    };
    let spreads = [spread(0), spread(1), spread(2), spread(3)];
    let eight =
        |bytes: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64)));
    let (size, qs_at) = if Q5 { (176, 48) } else { (144, 16) };
    let one = _mm256_set1_epi8(1);
    for blk in 0..n {
        let b = b0.add(blk * size);
        let dm = halves_at(b);
        let (sc, mins) = scales_mins_k4(&*(b.add(4) as *const [u8; 12]));
        let dsc = _mm256_mul_ps(_mm256_broadcastss_ps(dm), eight(sc));
        let dmm = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)), eight(mins));
        // Pair p: the low nibbles (group 2p), then the high ones (2p + 1), in value order.
        let w: [__m512i; 4] = std::array::from_fn(|p| {
            let bytes = _mm256_loadu_si256(b.add(qs_at + 32 * p) as *const __m256i);
            let mut lo = _mm256_and_si256(bytes, mask);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), mask);
            if Q5 {
                // Bit g of each `qh` byte to bit 4 (shifted within 16-bit words, masked
                // to each byte's bit 0 before moving up).
                let qh = _mm256_loadu_si256(b.add(16) as *const __m256i);
                let fifth = |g: usize| {
                    let bit = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(g as i32));
                    _mm256_slli_epi16::<4>(_mm256_and_si256(bit, one))
                };
                lo = _mm256_or_si256(lo, fifth(2 * p));
                hi = _mm256_or_si256(hi, fifth(2 * p + 1));
            }
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
        });
        for r in 0..R {
            let x = &xs[r];
            let f = _mm512_castps256_ps512(_mm256_mul_ps(
                dsc,
                _mm256_loadu_ps(x.d.as_ptr().add(8 * blk)),
            ));
            let dsum = _mm256_loadu_ps(x.dsum.as_ptr().add(8 * blk));
            terms[r] = _mm256_fnmadd_ps(dmm, dsum, terms[r]);
            for (p, (wp, sp)) in w.iter().zip(&spreads).enumerate() {
                let xq = _mm512_loadu_si512(x.qs.as_ptr().add(256 * blk + 64 * p) as *const _);
                let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), *wp, xq);
                let scale = _mm512_permutexvar_ps(*sp, f);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
            }
        }
    }
    let mut out = acc;
    for (o, t) in out.iter_mut().zip(terms) {
        *o = _mm512_add_ps(*o, _mm512_zextps256_ps512(t));
    }
    out
}

/// The lanes of a 64-value chunk's `vpdpbusd` sums by 16-value group, as indices into a
/// vector of the 16 groups' factors: chunk `c`'s lanes 4 each from groups `4 c..4 c + 4`.
///
/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn group_quads() -> [__m512i; 4] {
    std::array::from_fn(|c| {
        let g = 4 * c as i32;
        _mm512_setr_epi32(
            g,
            g,
            g,
            g,
            g + 1,
            g + 1,
            g + 1,
            g + 1,
            g + 2,
            g + 2,
            g + 2,
            g + 2,
            g + 3,
            g + 3,
            g + 3,
            g + 3,
        )
    })
}

/// One Q2_K row (`{ u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }` per 256 values) or, with
/// `Q3`, Q3_K row (`{ u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }`) against `x`: value
/// `128 h + 32 j + l` holds the two bits `qs[32 h + l] >> 2 j` (Q3_K: and bit `4 h + j` of
/// `hmask[l]` as its third, the value `q - 4`), in group `g = 8 h + 2 j + l / 16`. Each 64
/// values in order are one 512-bit `vpdpbusd` of the unsigned bits against `x`'s bytes, 4
/// lanes a 16-value group scaled by `d sc_g dx` (Q2_K: `d (sc_g & 15) dx`). The offsets
/// come from `x`'s `-32 sum qx` per 4 values: Q3_K's `-4 sum qx` (an exact shift) starts
/// the sums; Q2_K's `-dmin (sc_g >> 4) dx sum qx` is those lanes times `dmin m_g dx / 32`.
///
/// # Safety
/// As [`dot_pairs`] (`b0` at `xs[0].d.len() / 8` whole blocks).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,avx2")]
unsafe fn dot_q2_q3_k<const Q3: bool, const R: usize>(
    b0: *const u8,
    xs: &[QuantizedX],
) -> [__m512; R] {
    use crate::kernels::decode::x86_helpers::{half_before, halves_at, q3_k_scales};
    let n = xs[0].d.len() / 8;
    let mut acc = [_mm512_setzero_ps(); R];
    let (size, qs_at) = if Q3 { (110, 32) } else { (84, 16) };
    let (twos, ones) = (_mm256_set1_epi8(0x03), _mm256_set1_epi8(0x01));
    // Group g's `dx`: `x`'s block g / 2.
    let halves = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let quads = group_quads();
    let shift = |v: __m256i, k: usize| _mm256_srl_epi16(v, _mm_cvtsi32_si128(k as i32));
    for blk in 0..n {
        let b = b0.add(blk * size);
        // `dl` (and Q2_K's `ml`) of group g in lane g.
        let (dl, ml) = if Q3 {
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q3_k_scales(b.add(96))));
            let d = _mm512_set1_ps(half_before(b.add(110)));
            (_mm512_mul_ps(d, sc), _mm512_setzero_ps())
        } else {
            let sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(b as *const __m128i));
            let dm = halves_at(b.add(80));
            let (d, dmin) = (
                _mm512_broadcastss_ps(dm),
                _mm512_broadcastss_ps(_mm_movehdup_ps(dm)),
            );
            let low = _mm512_and_si512(sc, _mm512_set1_epi32(0x0F));
            (
                _mm512_mul_ps(d, _mm512_cvtepi32_ps(low)),
                _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(sc))),
            )
        };
        // Chunk c = 2 h + p: values 128 h + 64 p.., `j` = 2 p and 2 p + 1.
        let hmask = if Q3 {
            _mm256_loadu_si256(b as *const __m256i)
        } else {
            _mm256_setzero_si256()
        };
        let mut w = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let q = _mm256_loadu_si256(b.add(qs_at + 32 * h) as *const __m256i);
            for p in 0..2 {
                let part = |j: usize| {
                    let bits = _mm256_and_si256(shift(q, 2 * j), twos);
                    if Q3 {
                        let third = _mm256_and_si256(shift(hmask, 4 * h + j), ones);
                        _mm256_or_si256(bits, _mm256_slli_epi16::<2>(third))
                    } else {
                        bits
                    }
                };
                let (lo, hi) = (part(2 * p), part(2 * p + 1));
                w[2 * h + p] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            }
        }
        for r in 0..R {
            let x = &xs[r];
            let dx = _mm512_castps256_ps512(_mm256_loadu_ps(x.d.as_ptr().add(8 * blk)));
            let dx = _mm512_permutexvar_ps(halves, dx);
            let f = _mm512_mul_ps(dl, dx);
            let fm = _mm512_mul_ps(_mm512_mul_ps(ml, dx), _mm512_set1_ps(1.0 / 32.0));
            for (c, (wc, qc)) in w.iter().zip(&quads).enumerate() {
                let at = 256 * blk + 64 * c;
                let offsets = _mm512_loadu_si512(x.offsets.as_ptr().add(at / 4) as *const _);
                let xq = _mm512_loadu_si512(x.qs.as_ptr().add(at) as *const _);
                let start = if Q3 {
                    _mm512_srai_epi32::<3>(offsets)
                } else {
                    _mm512_setzero_si512()
                };
                let sums = _mm512_dpbusd_epi32(start, *wc, xq);
                acc[r] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(sums),
                    _mm512_permutexvar_ps(*qc, f),
                    acc[r],
                );
                if !Q3 {
                    acc[r] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(offsets),
                        _mm512_permutexvar_ps(*qc, fm),
                        acc[r],
                    );
                }
            }
        }
    }
    acc
}

/// One Q6_K row against `x`: per block of 256 values, `{ u8 ql[128]; u8 qh[64]; i8
/// scales[16]; f16 d }`, value `128 h + 32 t + l` is `d scales[8 h + 2 t + l / 16] (q - 32)`,
/// the low four bits of `q` from `ql[64 h + 32 (t % 2) + l] >> 4 (t / 2)`, the high two from
/// `qh[32 h + l] >> 2 t`. Each 64 values in order are one 512-bit `vpdpbusd` of `q` (0..64)
/// against `x`'s bytes, started from `x`'s `-32 sum qx` per 4 values (the offset); 4 lanes
/// a 16-value group, scaled by `d sc_g dx`.
///
/// # Safety
/// As [`dot_pairs`] (`b0` at `xs[0].d.len() / 8` whole blocks).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,avx2")]
unsafe fn dot_q6_k<const R: usize>(b0: *const u8, xs: &[QuantizedX]) -> [__m512; R] {
    use crate::kernels::decode::x86_helpers::half_before;
    let n = xs[0].d.len() / 8;
    let mut acc = [_mm512_setzero_ps(); R];
    let (fours, twos) = (_mm512_set1_epi8(0x0F), _mm256_set1_epi8(0x03));
    // Group g's `dx`: `x`'s block g / 2.
    let halves = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let quads = group_quads();
    for blk in 0..n {
        let b = b0.add(blk * 210);
        let scales = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
            b.add(192) as *const __m128i
        )));
        let dl = _mm512_mul_ps(_mm512_set1_ps(half_before(b.add(210))), scales);
        let mut w = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let ql = _mm512_loadu_si512(b.add(64 * h) as *const _);
            let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
            let two = |v: __m256i| _mm256_and_si256(v, twos);
            let (h0, h1) = (two(qh), two(_mm256_srli_epi16::<2>(qh)));
            let (h2, h3) = (
                two(_mm256_srli_epi16::<4>(qh)),
                two(_mm256_srli_epi16::<6>(qh)),
            );
            let join = |a: __m256i, b: __m256i| {
                _mm512_slli_epi16::<4>(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b))
            };
            // Values 128 h .. + 64 (t = 0, 1): the low nibbles; the next 64: the high ones.
            w[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, fours), join(h0, h1));
            w[2 * h + 1] = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), fours),
                join(h2, h3),
            );
        }
        for r in 0..R {
            let x = &xs[r];
            let dx = _mm512_castps256_ps512(_mm256_loadu_ps(x.d.as_ptr().add(8 * blk)));
            let f = _mm512_mul_ps(dl, _mm512_permutexvar_ps(halves, dx));
            for (c, (wc, qc)) in w.iter().zip(&quads).enumerate() {
                let at = 256 * blk + 64 * c;
                let start = _mm512_loadu_si512(x.offsets.as_ptr().add(at / 4) as *const _);
                let xq = _mm512_loadu_si512(x.qs.as_ptr().add(at) as *const _);
                let sums = _mm512_dpbusd_epi32(start, *wc, xq);
                let scale = _mm512_permutexvar_ps(*qc, f);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
            }
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::decode::quant_gemv_int8_avx2::Int8Avx2;
    use crate::kernels::decode::row_kernels::{row_dot, rows_dots};
    use crate::kernels::quant::blocks::{self, tests::ggml};
    use crate::kernels::quant::row_kinds::ROW_KERNEL_TYPES;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    /// Row widths for `ty`: an even number of 32-value blocks and an odd one (its last
    /// block alone), or two numbers of 256-value blocks for the K-quants.
    fn widths(ty: QuantType) -> [(QuantType, usize); 2] {
        if ty.block_values() == 256 {
            [(ty, 768), (ty, 1536)]
        } else {
            [(ty, 576), (ty, 608)]
        }
    }

    /// Each kernel's (AVX-512 VNNI, AVX2) dot product for each type, rows of 18 and 19
    /// blocks, equals the exact weight (gguf-py's values) times the quantized `x`'s values,
    /// summed in f64, within f32 rounding of the magnitudes: the integer sums, the offsets
    /// and the `m` terms are right, and the only error against the f32 product is `x`'s
    /// quantization.
    fn several_rows_of_x_sum_as_each_alone(which: usize) -> candle_core::Result<()> {
        type Supports = fn(QuantType) -> bool;
        type Dot = fn(QuantType, &[u8], &[QuantizedX]) -> Option<f32>;
        type Rows = fn(QuantType, &[u8], &[QuantizedX], &mut [f32], usize) -> bool;
        // Per kernel: its rows_dots for 1..=4 rows of `x` (AVX2 takes up to 2).
        let vnni: [Rows; 4] = [
            rows_dots::<Vnni, 1>,
            rows_dots::<Vnni, 2>,
            rows_dots::<Vnni, 3>,
            rows_dots::<Vnni, 4>,
        ];
        let avx2: [Rows; 2] = [rows_dots::<Int8Avx2, 1>, rows_dots::<Int8Avx2, 2>];
        let kernels: [(Supports, Dot, &[Rows]); 2] = [
            (Vnni::supports, row_dot::<Vnni>, &vnni),
            (Int8Avx2::supports, row_dot::<Int8Avx2>, &avx2),
        ];
        let kernels = [kernels[which]];
        let cases = ROW_KERNEL_TYPES.into_iter().flat_map(widths);
        for ((ty, cols), (supports, row_dot, multi)) in cases.flat_map(|c| kernels.map(|k| (c, k)))
        {
            assert!(
                supports(ty),
                "{ty}: built for this CPU's kernels, running without them"
            );
            let rows = 7;
            let w = crate::kernels::test_values(rows * cols, 17);
            let q = QTensor::quantize(&Tensor::from_vec(w, (rows, cols), &Device::Cpu)?, ggml(ty))?;
            let bytes = q.data()?;
            let row_bytes = bytes.len() / rows;
            let xs: Vec<QuantizedX> = (0..4)
                .map(|i| QuantizedX::new(&crate::kernels::test_values(cols, 20 + i)))
                .collect::<Option<_>>()
                .expect("whole blocks");
            let ldo = 6;
            for (k, dots) in multi.iter().enumerate() {
                let nx = k + 1;
                let mut out = vec![f32::NAN; rows * ldo];
                assert!(
                    dots(ty, &bytes, &xs[..nx], &mut out, ldo),
                    "{ty} {cols}: {nx} rows"
                );
                for r in 0..rows {
                    let row = &bytes[r * row_bytes..(r + 1) * row_bytes];
                    for (i, x) in xs[..nx].iter().enumerate() {
                        let alone = row_dot(ty, row, std::slice::from_ref(x)).expect("a kernel");
                        assert_eq!(
                            out[r * ldo + i].to_bits(),
                            alone.to_bits(),
                            "{ty} ({r}, {i})"
                        );
                    }
                    assert!(out[r * ldo + nx].is_nan(), "{ty}: wrote past its rows");
                }
            }
            // Rows of `x` of another length, or too short an output, are refused.
            let short =
                QuantizedX::new(&crate::kernels::test_values(cols - 32, 1)).expect("blocks");
            let mixed = [xs[0].clone(), short];
            assert!(!multi[1](ty, &bytes, &mixed, &mut [0f32; 64], 2));
            assert!(!multi[0](ty, &bytes, &xs[..1], &mut [0f32; 3], 1));
        }
        Ok(())
    }

    #[test]
    #[cfg_attr(
        not(isa_vnni),
        ignore = "needs AVX-512 VNNI, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn several_rows_of_x_sum_as_each_alone_vnni() -> candle_core::Result<()> {
        several_rows_of_x_sum_as_each_alone(0)
    }

    #[test]
    #[cfg_attr(
        not(isa_avx2),
        ignore = "needs AVX2 + FMA + F16C, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn several_rows_of_x_sum_as_each_alone_avx2() -> candle_core::Result<()> {
        several_rows_of_x_sum_as_each_alone(1)
    }
    fn equals_the_weight_times_the_quantized_x(which: usize) -> candle_core::Result<()> {
        type Supports = fn(QuantType) -> bool;
        type Dot = fn(QuantType, &[u8], &[QuantizedX]) -> Option<f32>;
        let kernels: [(Supports, Dot); 2] = [
            (Vnni::supports, row_dot::<Vnni>),
            (Int8Avx2::supports, row_dot::<Int8Avx2>),
        ];
        let kernels = [kernels[which]];
        // An even number of blocks a row, and an odd one (its last block alone).
        let cases = ROW_KERNEL_TYPES.into_iter().flat_map(widths);
        for ((ty, cols), (supports, row_dot)) in cases.flat_map(|c| kernels.map(|k| (c, k))) {
            assert!(
                supports(ty),
                "{ty}: built for this CPU's kernels, running without them"
            );
            let rows = 5;
            let w = crate::kernels::test_values(rows * cols, 13);
            let q = QTensor::quantize(&Tensor::from_vec(w, (rows, cols), &Device::Cpu)?, ggml(ty))?;
            let bytes = q.data()?;
            let mut deq = vec![0f32; rows * cols];
            assert!(blocks::dequantize(ty, &bytes, &mut deq));
            let x = crate::kernels::test_values(cols, 3);
            let xq = QuantizedX::new(&x).expect("whole blocks");
            let xv = xq.values();
            let row_bytes = bytes.len() / rows;
            for r in 0..rows {
                let got = row_dot(
                    ty,
                    &bytes[r * row_bytes..(r + 1) * row_bytes],
                    std::slice::from_ref(&xq),
                )
                .expect("a kernel");
                let w = &deq[r * cols..(r + 1) * cols];
                let want: f64 = w.iter().zip(&xv).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = w
                    .iter()
                    .zip(&xv)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                assert!(
                    (got as f64 - want).abs() <= mag * 2e-6,
                    "{ty} row {r}: {got} vs {want}"
                );
                // Against the f32 `x`: within its quantization error.
                let exact: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let bound: f64 = w
                    .chunks(32)
                    .zip(&xq.d)
                    .map(|(b, d)| b.iter().map(|v| v.abs() as f64).sum::<f64>() * *d as f64 / 2.0)
                    .sum();
                assert!(
                    (got as f64 - exact).abs() <= bound + mag * 2e-6,
                    "{ty} row {r}"
                );
            }
            assert!(row_dot(ty, &bytes[..row_bytes - 1], std::slice::from_ref(&xq)).is_none());
        }
        Ok(())
    }

    #[test]
    #[cfg_attr(
        not(isa_vnni),
        ignore = "needs AVX-512 VNNI, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn equals_the_weight_times_the_quantized_x_vnni() -> candle_core::Result<()> {
        equals_the_weight_times_the_quantized_x(0)
    }

    #[test]
    #[cfg_attr(
        not(isa_avx2),
        ignore = "needs AVX2 + FMA + F16C, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn equals_the_weight_times_the_quantized_x_avx2() -> candle_core::Result<()> {
        equals_the_weight_times_the_quantized_x(1)
    }
}
