//! AVX-512 dot products of one GGUF weight row with `x`, for the 32-value block types
//! (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants (Q2_K-Q6_K): each block is unpacked in
//! registers and multiplied into f32 accumulators as it goes, so the weight is read once and
//! never written out. Blocks with a minimum (Q4_1, Q5_1, the K-quants but Q3_K and Q6_K) have
//! their values made exactly as gguf-py makes them (`d * q + m` as a product then a sum),
//! looked up in a per-block table of the 16 or 32 a block (or Q4_K's group) can hold
//! (`vpermps`): the product `d * q` is exact in f32, so the table's one fused `d * q + m` is
//! the same value. Where a block's values are `d` times integers (Q4_0, Q5_0, Q8_0), the
//! integers' products with `x` are summed and then multiplied by `d` once: the same sum as
//! gguf-py's values times `x` in exact arithmetic, rounded differently (f32 rounding).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use crate::kernels::decode::held_lanes::HeldLanes;
use crate::kernels::decode::row_kernels::RowKernels;
#[cfg(target_arch = "x86_64")]
use crate::kernels::decode::x86_helpers::RowSums;
#[cfg(target_arch = "x86_64")]
use crate::kernels::decode::x86_helpers::{half_before, halves_at, q3_k_scales, q6_k_bytes};
#[cfg(target_arch = "x86_64")]
use crate::kernels::quant::blocks::scales_mins_k4;
use crate::kernels::quant::blocks::QuantType;
#[cfg(target_arch = "x86_64")]
use crate::kernels::quant::row_kinds::kind;
#[cfg(target_arch = "x86_64")]
use crate::kernels::simd::{isa, Isa};

/// This instruction set's exact row kernels ([`RowKernels`]): AVX-512F, up to 4 rows of `x`
/// per unpacked block.
pub(crate) struct Avx512;

impl RowKernels for Avx512 {
    type Rows = [f32];

    const MOST_ROWS: usize = 4;

    fn cpu_runs() -> bool {
        #[cfg(target_arch = "x86_64")]
        return isa() == Isa::Avx512;
        #[cfg(not(target_arch = "x86_64"))]
        false
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
            unsafe { rows_dots_avx512::<R>(ty, rows, row_bytes, xs.as_ptr(), inp, out, ldo) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (ty, rows, row_bytes, xs, inp, out, ldo);
            false
        }
    }
}

/// The block kinds, as const parameters: one loop compiled per type.
#[cfg(target_arch = "x86_64")]
use crate::kernels::quant::row_kinds::kind::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};

/// [`Avx512`]'s products once checked.
///
/// # Safety
/// AVX-512F; `rows` holds whole rows of `row_bytes` (`inp` values in blocks of `ty`), `xs`
/// `R` rows of `inp` values, `out` `(rows - 1) ldo + R` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_dots_avx512<const R: usize>(
    ty: QuantType,
    rows: &[u8],
    row_bytes: usize,
    xs: *const f32,
    inp: usize,
    out: &mut [f32],
    ldo: usize,
) -> bool {
    use crate::kernels::decode::prefetch::{rows_ahead, AHEAD};
    // One loop over the rows per type, the kernel inlined in it; the rows' sums reduced
    // 16 at a time (one transposing tree instead of a horizontal sum per row); each row's
    // lines requested `AHEAD` bytes ahead.
    macro_rules! each_row {
        ($row:ident => $dot:expr) => {{
            let mut sums = RowSums::<R>::new(out, ldo);
            let end = rows.as_ptr_range().end;
            for $row in rows.chunks_exact(row_bytes) {
                rows_ahead($row.as_ptr(), row_bytes, AHEAD, end);
                let acc = $dot;
                sums.push(std::array::from_fn(|r| {
                    let a = &acc[r];
                    _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]))
                }));
            }
            sums.finish();
        }};
    }
    let hold = hold_all_scales();
    match ty {
        QuantType::Q8_0 => each_row!(row => dot_blocks::<Q8_0, R>(row, xs, inp, hold)),
        QuantType::Q4_0 => each_row!(row => dot_blocks::<Q4_0, R>(row, xs, inp, hold)),
        QuantType::Q4_1 => each_row!(row => dot_blocks::<Q4_1, R>(row, xs, inp, hold)),
        QuantType::Q5_0 => each_row!(row => dot_blocks::<Q5_0, R>(row, xs, inp, hold)),
        QuantType::Q2K => each_row!(row => dot_k::<R, Q2K>(row, xs, inp)),
        QuantType::Q3K => each_row!(row => dot_k::<R, Q3K>(row, xs, inp)),
        QuantType::Q4K => each_row!(row => dot_k::<R, Q4K>(row, xs, inp)),
        QuantType::Q5K => each_row!(row => dot_k::<R, Q5K>(row, xs, inp)),
        QuantType::Q6K => each_row!(row => dot_k::<R, Q6K>(row, xs, inp)),
        QuantType::Q5_1 => each_row!(row => dot_blocks::<Q5_1, R>(row, xs, inp, hold)),
        // `supports` filtered the types: another has no kernel here.
        _ => return false,
    }
    true
}

/// `bytes` (whole blocks of `ty`) dequantized into `out`, the same values as
/// [`crate::kernels::quant::blocks::dequantize`] (each made as the row kernels make it, as
/// gguf-py does), unpacked in registers 16 at a time; `false`, writing nothing, when this CPU
/// or type has no kernel here or the sizes do not agree.
pub(crate) fn dequantize(ty: QuantType, bytes: &[u8], out: &mut [f32]) -> bool {
    if !Avx512::supports(ty) || ty.bytes_of(out.len()) != Some(bytes.len()) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: AVX-512F checked by `supports`; `bytes` holds the whole blocks of `out`.
        unsafe { dequantize_avx512(ty, bytes.as_ptr(), out) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`dequantize`] once checked; `false`, writing nothing, for a type it has no unpacking of.
///
/// # Safety
/// AVX-512F; `b` points at the whole blocks of `ty` that `out` holds the values of.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dequantize_avx512(ty: QuantType, b: *const u8, out: &mut [f32]) -> bool {
    let o = out.as_mut_ptr();
    let blocks = out.len() / ty.block_values();
    let size = ty.block_bytes();
    macro_rules! each_block {
        ($values:expr) => {
            for i in 0..blocks {
                let (lo, hi) = $values(b.add(i * size));
                _mm512_storeu_ps(o.add(32 * i), lo);
                _mm512_storeu_ps(o.add(32 * i + 16), hi);
            }
        };
    }
    match ty {
        QuantType::Q8_0 => each_block!(block_values::<Q8_0>),
        QuantType::Q4_0 => each_block!(block_values::<Q4_0>),
        QuantType::Q4_1 => each_block!(block_values::<Q4_1>),
        QuantType::Q5_0 => each_block!(block_values::<Q5_0>),
        QuantType::Q5_1 => each_block!(block_values::<Q5_1>),
        QuantType::Q4K => {
            for i in 0..blocks {
                q4_k_values(b.add(i * size), |at, v| {
                    _mm512_storeu_ps(o.add(256 * i + at), v)
                });
            }
        }
        QuantType::Q2K => {
            for i in 0..blocks {
                q2_q3_k_values::<false>(b.add(i * size), |at, v| {
                    _mm512_storeu_ps(o.add(256 * i + at), v)
                });
            }
        }
        QuantType::Q3K => {
            for i in 0..blocks {
                q2_q3_k_values::<true>(b.add(i * size), |at, v| {
                    _mm512_storeu_ps(o.add(256 * i + at), v)
                });
            }
        }
        QuantType::Q5K => {
            for i in 0..blocks {
                q5_k_values(b.add(i * size), |at, v| {
                    _mm512_storeu_ps(o.add(256 * i + at), v)
                });
            }
        }
        QuantType::Q6K => {
            for i in 0..blocks {
                q6_k_values(b.add(i * size), |at, v| {
                    _mm512_storeu_ps(o.add(256 * i + at), v)
                });
            }
        }
        _ => return false,
    }
    true
}

/// The 5-bit values `j` and `16 + j` of a Q5_0 or Q5_1 block as table indices (bits 0..4 of
/// each lane; those above are not zero): lane `j` of `bytes` holds the block's byte `j`
/// (value `j`'s low four bits in its low nibble, value `16 + j`'s in its high one), bit `j`
/// of the 32 at `qh` is value `j`'s fifth. Each fifth bit is rotated onto bit 4 of its lane
/// and put in by one bit select: no mask registers, whose loads from memory measured slower
/// than these two rotates.
///
/// # Safety
/// AVX-512F; four readable bytes at `qh`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn five_bit_indices(bytes: __m512i, qh: *const u8) -> (__m512i, __m512i) {
    let qh = _mm512_set1_epi32(std::ptr::read_unaligned(qh as *const i32));
    // Lane j: rotated left by 4 - j (bit j onto bit 4), or by 20 - j (bit 16 + j), mod 32.
    let to_lo = _mm512_setr_epi32(4, 3, 2, 1, 0, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21);
    let to_hi = _mm512_setr_epi32(20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5);
    // `bit4 ? fifth : nibbles`, bit by bit.
    let bit4 = _mm512_set1_epi32(0x10);
    (
        _mm512_ternarylogic_epi32::<0xCA>(bit4, _mm512_rolv_epi32(qh, to_lo), bytes),
        _mm512_ternarylogic_epi32::<0xCA>(
            bit4,
            _mm512_rolv_epi32(qh, to_hi),
            _mm512_srli_epi32::<4>(bytes),
        ),
    )
}

/// The K-quant kinds [`dot_k`] takes, as const parameters.
#[cfg(target_arch = "x86_64")]
const Q2K: u8 = 0;
#[cfg(target_arch = "x86_64")]
const Q3K: u8 = 1;
#[cfg(target_arch = "x86_64")]
const Q4K: u8 = 2;
#[cfg(target_arch = "x86_64")]
const Q5K: u8 = 3;
#[cfg(target_arch = "x86_64")]
const Q6K: u8 = 4;

/// K-quant rows of kind `K`, 256 values a block: Q2_K and Q3_K ([`q2_q3_k_values`]), Q4_K
/// (`{ f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }`, [`q4_k_values`]), Q5_K (the same with
/// `u8 qh[32]` before `qs`, [`q5_k_values`]) or Q6_K (`{ u8 ql[128]; u8 qh[64]; i8
/// scales[16]; f16 d }`, [`q6_k_values`]): four accumulators a row, summed by the caller.
///
/// # Safety
/// AVX-512F; `row` holds `inp / 256` whole blocks of kind `K`, `xp` `R` rows of `inp` readable
/// floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn dot_k<const R: usize, const K: u8>(
    row: &[u8],
    xp: *const f32,
    inp: usize,
) -> [[__m512; 4]; R] {
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    for blk in 0..inp / 256 {
        let add = |at: usize, v: __m512| {
            for (r, a) in acc.iter_mut().enumerate() {
                let x = _mm512_loadu_ps(xp.add(r * inp + blk * 256 + at));
                a[at / 16 % 4] = _mm512_fmadd_ps(v, x, a[at / 16 % 4]);
            }
        };
        match K {
            Q2K => q2_q3_k_values::<false>(row.as_ptr().add(blk * 84), add),
            Q3K => q2_q3_k_values::<true>(row.as_ptr().add(blk * 110), add),
            Q6K => q6_k_values(row.as_ptr().add(blk * 210), add),
            Q5K => q5_k_values(row.as_ptr().add(blk * 176), add),
            Q4K => q4_k_values(row.as_ptr().add(blk * 144), add),
            _ => {}
        }
    }
    acc
}

/// A Q4_K / Q5_K block's `dl` (`d * sc_g`) of its 8 groups in lanes 0..8 and their `ml`
/// (`dmin * m_g`) in lanes 8..16, from `{ f16 d; f16 dmin; u8 scales[12] }` at `b`.
///
/// # Safety
/// AVX-512F; 16 readable bytes at `b` (a Q4_K or Q5_K block's start).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn k4_scales_mins(b: *const u8) -> __m512 {
    // Lanes 0..8 pick `d`, lanes 8..16 `dmin`.
    let d_then_dmin = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let dm = _mm512_permutexvar_ps(d_then_dmin, _mm512_castps128_ps512(halves_at(b)));
    let (sc, mins) = scales_mins_k4(&*(b.add(4) as *const [u8; 12]));
    let sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x(mins as i64, sc as i64)));
    _mm512_mul_ps(dm, sm)
}

/// The 256 values of the Q4_K block at `b`, 16 at a time: `f(at, v)` for values `at..at +
/// 16` (each `at` once, in an order the dot kernel's accumulators follow). Group `g` (32
/// values) is `d * sc_g * q - dmin * m_g` over the low (even `g`) or high (odd) nibbles of
/// `qs[32 (g / 2)..][..32]`. Each group looks its values up in a table of the 16 it can hold:
/// `dl = d * sc_g` (11 by 6 significant bits) and `dl * q` (17 by 4) are exact in f32, so one
/// fused `dl * q - ml` rounds as gguf-py's product then difference.
///
/// # Safety
/// AVX-512F; `b` points at a whole Q4_K block.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn q4_k_values(b: *const u8, mut f: impl FnMut(usize, __m512)) {
    let iota = iota16();
    let mut held = HeldLanes::new();
    let sm = held.hold512(k4_scales_mins(b));
    for p in 0..4 {
        let qs = b.add(16 + 32 * p) as *const __m128i;
        // Group 2p: the low nibbles; group 2p + 1: the high ones.
        let lane = |i: usize| sm.lane512(i);
        let t0 = _mm512_fmsub_ps(lane(2 * p), iota, lane(8 + 2 * p));
        let t1 = _mm512_fmsub_ps(lane(2 * p + 1), iota, lane(9 + 2 * p));
        for h in 0..2 {
            // Lane j: byte 16 h + j, its low nibble in group 2p, its high one in 2p + 1.
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs.add(h)));
            f(64 * p + 16 * h, _mm512_permutexvar_ps(bytes, t0));
            f(
                64 * p + 32 + 16 * h,
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), t1),
            );
        }
    }
}

/// The 256 values of the Q2_K block at `b` (`{ u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }`)
/// or, with `Q3`, the Q3_K block (`{ u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }`), 16
/// at a time as [`q4_k_values`]. Value `128 h + 32 j + l` holds the two bits
/// `qs[32 h + l] >> 2 j` in group `g = 8 h + 2 j + l / 16`: Q2_K's is `(d * (sc_g & 15)) * q -
/// dmin * (sc_g >> 4)` (the product exact, so one fused step rounds as gguf-py's two),
/// Q3_K's `(d * sc_g) * (q - 4)`, the 4 not taken where bit `4 h + j` of `hmask[l]` is set,
/// `sc_g` its 6-bit scale `- 32` ([`q3_k_scales`]).
///
/// # Safety
/// AVX-512F; `b` points at a whole Q2_K block (Q3_K with `Q3`).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn q2_q3_k_values<const Q3: bool>(b: *const u8, mut f: impl FnMut(usize, __m512)) {
    // `dl` (and Q2_K's `ml`) of group g in lane g.
    let (dl, ml) = if Q3 {
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q3_k_scales(b.add(96))));
        (
            _mm512_mul_ps(_mm512_set1_ps(half_before(b.add(110))), sc),
            _mm512_setzero_ps(),
        )
    } else {
        let sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(b as *const __m128i));
        let low = _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(0x0F)));
        let high = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(sc));
        let (d, dmin) = halves_at_ptr(b.add(80));
        (_mm512_mul_ps(d, low), _mm512_mul_ps(dmin, high))
    };
    let mut held = [HeldLanes::new(), HeldLanes::new()];
    let [dh, mh] = &mut held;
    // Q3_K has no `ml`: nothing to hold (its line is never read).
    let (dl, ml) = (dh.hold512(dl), if Q3 { &*mh } else { mh.hold512(ml) });
    let lane = |v: &HeldLanes, g: usize| v.lane512(g);
    // Group g's values in a table indexed by the value's bits (`vpermps` reads bits 0..4 of
    // an index; the table repeats, so bits above the value's are free): Q2_K's four
    // `dl * q - ml` (each one fused rounding, as gguf-py's exact product then difference),
    // Q3_K's eight `dl * (k - 4)` (exact), `k` the two bits and the high-mask bit above them.
    let steps = if Q3 {
        _mm512_setr_ps(
            -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0,
        )
    } else {
        _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0,
        )
    };
    let table = |g: usize| {
        if Q3 {
            _mm512_mul_ps(lane(dl, g), steps)
        } else {
            _mm512_fmsub_ps(lane(dl, g), steps, lane(ml, g))
        }
    };
    let two_bits = _mm512_set1_epi32(3);
    let qs = b.add(if Q3 { 32 } else { 16 });
    for h in 0..2 {
        for half in 0..2 {
            let at = 32 * h + 16 * half;
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs.add(at) as *const __m128i));
            // Q3_K: `hmask[l]` moved up by 2, so that bit `4 h + j` lands on bit 2 after a
            // right shift by `4 h + j`.
            let mask = if Q3 {
                let m = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(16 * half) as *const __m128i));
                _mm512_slli_epi32::<2>(m)
            } else {
                _mm512_setzero_si512()
            };
            for j in 0..4 {
                let g = 8 * h + 2 * j + half;
                let shift = |v: __m512i, n: usize| _mm512_srl_epi32(v, _mm_cvtsi32_si128(n as i32));
                let q = shift(bytes, 2 * j);
                // Q3_K: bits 0..1 from `q`, the rest from the shifted mask.
                let k = if Q3 {
                    _mm512_ternarylogic_epi32::<0xE4>(q, shift(mask, 4 * h + j), two_bits)
                } else {
                    q
                };
                f(
                    128 * h + 32 * j + 16 * half,
                    _mm512_permutexvar_ps(k, table(g)),
                );
            }
        }
    }
}

/// The 256 values of the Q5_K block at `b` (`{ f16 d; f16 dmin; u8 scales[12]; u8 qh[32];
/// u8 qs[128] }`), 16 at a time as [`q4_k_values`]: value `l` of group `g` has the nibble
/// Q4_K gives it and bit `g` of `qh[l]` as its fifth bit. Each group looks its values up in
/// a table of the 32 it can hold (two registers, `vpermt2ps`): `dl * q` (17 by 5
/// significant bits) is exact, so one fused `dl * q - ml` rounds as gguf-py's two steps.
///
/// # Safety
/// AVX-512F; `b` points at a whole Q5_K block.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn q5_k_values(b: *const u8, mut f: impl FnMut(usize, __m512)) {
    let iota = iota16();
    let iota_hi = _mm512_add_ps(iota, _mm512_set1_ps(16.0));
    let mut held = HeldLanes::new();
    let sm = held.hold512(k4_scales_mins(b));
    let low4 = _mm512_set1_epi32(0x0F);
    // Lane j of `high[h]`: byte `16 h + j` of `qh`, shifted so that bit g lands on bit 4
    // after a right shift by g.
    let high: [__m512i; 2] = std::array::from_fn(|h| {
        let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((b.add(16) as *const __m128i).add(h)));
        _mm512_slli_epi32::<4>(bytes)
    });
    let lane = |i: usize| sm.lane512(i);
    for p in 0..4 {
        let qs = b.add(48 + 32 * p) as *const __m128i;
        let tables = [2 * p, 2 * p + 1].map(|g| {
            let (dl, ml) = (lane(g), lane(8 + g));
            (
                _mm512_fmsub_ps(dl, iota, ml),
                _mm512_fmsub_ps(dl, iota_hi, ml),
            )
        });
        for (h, &hb) in high.iter().enumerate() {
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs.add(h)));
            // Bits 0..4 of the index: `vpermt2ps` reads no others, so one bit select (the
            // nibble where `low4` is set, the shifted `qh` elsewhere) makes each.
            let fifth = |g: usize| _mm512_srl_epi32(hb, _mm_cvtsi32_si128(g as i32));
            let q0 = _mm512_ternarylogic_epi32::<0xE4>(bytes, fifth(2 * p), low4);
            let q1 = _mm512_ternarylogic_epi32::<0xE4>(
                _mm512_srli_epi32::<4>(bytes),
                fifth(2 * p + 1),
                low4,
            );
            let (t0, t0h) = tables[0];
            let (t1, t1h) = tables[1];
            f(64 * p + 16 * h, _mm512_permutex2var_ps(t0, q0, t0h));
            f(64 * p + 32 + 16 * h, _mm512_permutex2var_ps(t1, q1, t1h));
        }
    }
}

/// The 256 values of the Q6_K block at `b`, 16 at a time as [`q4_k_values`]: value `128 h +
/// 32 t + l` is `(d * scales[8 h + 2 t + l / 16]) * (q - 32)` with the low four bits from
/// `ql[64 h + 32 (t % 2) + l] >> 4 (t / 2)` and the high two from `qh[32 h + l] >> 2 t`.
///
/// # Safety
/// AVX-512F; `b` points at a whole Q6_K block.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn q6_k_values(b: *const u8, mut f: impl FnMut(usize, __m512)) {
    // `d * scales[g]` in lane g.
    let scales = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        b.add(192) as *const __m128i
    )));
    let mut held = HeldLanes::new();
    let dl = held.hold512(_mm512_mul_ps(
        _mm512_set1_ps(half_before(b.add(210))),
        scales,
    ));
    for h in 0..2 {
        for t in 0..4 {
            let q = q6_k_bytes(b, h, t);
            let g = 8 * h + 2 * t;
            let (dl0, dl1) = (dl.lane512(g), dl.lane512(g + 1));
            let v0 = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q));
            let v1 = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1));
            f(128 * h + 32 * t, _mm512_mul_ps(dl0, _mm512_cvtepi32_ps(v0)));
            f(
                128 * h + 32 * t + 16,
                _mm512_mul_ps(dl1, _mm512_cvtepi32_ps(v1)),
            );
        }
    }
}

/// Whether the 32-value kernels hold every type's scales in memory (eight blocks a step),
/// not only Q4_0's and Q5_0's: faster on an Intel Xeon, where lane broadcasts and permutes
/// share one port with half the FMAs; no faster on AMD Zen 4, which has two shuffle pipes
/// (docs/performance-archive.md).
#[cfg(target_arch = "x86_64")]
fn hold_all_scales() -> bool {
    #[cfg(test)]
    if let Some(hold) = HOLD_ALL.with(|h| h.get()) {
        return hold;
    }
    !crate::kernels::simd::amd()
}

#[cfg(test)]
thread_local! {
    /// The tests' choice of [`hold_all_scales`] on this thread, whatever the CPU's vendor.
    static HOLD_ALL: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// The tests' choice of [`hold_all_scales`] on this thread while it lives (the CPU's
/// vendor's again once dropped, a panic included).
#[cfg(test)]
pub(crate) struct HoldAll;

#[cfg(test)]
impl HoldAll {
    pub(crate) fn set(hold: bool) -> Self {
        HOLD_ALL.with(|h| h.set(Some(hold)));
        HoldAll
    }
}

#[cfg(test)]
impl Drop for HoldAll {
    fn drop(&mut self) {
        HOLD_ALL.with(|h| h.set(None));
    }
}

/// The dot products of whole `K` blocks with each of `R` rows of `x` (row stride `inp`):
/// four accumulators a row (one a block for Q4_0, Q5_0 and Q8_0, two for Q4_1 and Q5_1),
/// summed by the caller. `hold`: eight blocks a step with their scales held in memory for
/// every type ([`hold_all_scales`]), else for Q4_0 and Q5_0 alone.
///
/// # Safety
/// AVX-512F; `row` holds `inp / 32` whole blocks, `xp` `R` rows of `inp` values.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn dot_blocks<const K: u8, const R: usize>(
    row: &[u8],
    xp: *const f32,
    inp: usize,
    hold: bool,
) -> [[__m512; 4]; R] {
    let size = kind::quant_type(K).block_bytes();
    let n = inp / 32;
    let bp = row.as_ptr();
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let mut i = 0;
    // Block `k` against each row of `x`, `d` its scale broadcast: Q4_0's, Q5_0's and Q8_0's
    // integers summed then scaled into accumulator `k % 4` ([`scaled_dot`]), Q4_1's and
    // Q5_1's values (`m` the second factor) into `2 (k % 2)` and the next.
    // `s`: `k % 4`, passed as a constant of an unrolled loop so that the accumulators stay
    // in registers (indexed by a run-time `k % 4` they went through the stack).
    let add = |acc: &mut [[__m512; 4]; R], k: usize, s: usize, d: __m512, m: __m512| {
        let b = bp.add(k * size);
        if symmetric::<K>() {
            let (lo, hi) = block_integers::<K>(b);
            for (r, a) in acc.iter_mut().enumerate() {
                let xb = xp.add(r * inp + k * 32);
                a[s] = scaled_dot(lo, hi, xb, d, a[s]);
            }
        } else {
            let (lo, hi) = block_values_dm::<K>(b, d, m);
            let u = s % 2;
            for (r, a) in acc.iter_mut().enumerate() {
                let xb = xp.add(r * inp + k * 32);
                a[2 * u] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), a[2 * u]);
                a[2 * u + 1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb.add(16)), a[2 * u + 1]);
            }
        }
    };
    // Eight blocks a step: their `d` (and Q4_1's and Q5_1's `m`) converted at once and held
    // in memory, each block's read back broadcast (no lane permutes: see `held_lanes`).
    // Q4_1, Q5_1 and Q8_0 only where `hold` says so.
    while (K == Q4_0 || K == Q5_0 || hold) && i + 8 <= n {
        use crate::kernels::decode::x86_helpers::halves8;
        let at = bp.add(i * size);
        let mut held = HeldLanes::new();
        // Block `k`'s `d` in lane `d_at k`, its `m` in lane `m_at + d_at k`.
        let (dm, d_at, m_at) = if K == Q4_1 {
            (held.hold512(q4_1_scales8(at)), 2, 1)
        } else {
            let m8 = match K {
                Q5_1 => halves8(at.add(2), size),
                _ => _mm256_setzero_ps(),
            };
            (held.hold256(halves8(at, size), m8), 1, 8)
        };
        for k in 0..8 {
            let (d, m) = (dm.lane512(d_at * k), dm.lane512(m_at + d_at * k));
            add(&mut acc, i + k, k % 4, d, m);
        }
        i += 8;
    }
    // The rest four blocks a step, then up to three (`i` a multiple of 4 here); `m`: the f16
    // after `d` (unused but by Q4_1 and Q5_1).
    let one = |acc: &mut [[__m512; 4]; R], k: usize, s: usize| {
        let (d, m) = halves_at_ptr(bp.add(k * size));
        add(acc, k, s, d, m);
    };
    while i + 4 <= n {
        for s in 0..4 {
            one(&mut acc, i + s, s);
        }
        i += 4;
    }
    for s in 0..3 {
        if i + s < n {
            one(&mut acc, i + s, s);
        }
    }
    acc
}

/// The `d` and `m` of the 8 Q4_1 blocks at `b` as f32: block `k`'s in lanes `2 k` and
/// `2 k + 1`. Each block's two f16 are its first 4-byte word, at word `5 k` (20-byte
/// blocks): one two-register permute picks all 8, in place of 8 scalar loads, shifts and
/// ors a scale.
///
/// # Safety
/// AVX-512F; 8 whole Q4_1 blocks at `b` (160 bytes; bytes `0..144` are read).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn q4_1_scales8(b: *const u8) -> __m512 {
    // Words 0..16 and 20..36: blocks 0..4 from the first, 4..8 from the second.
    let (first, second) = (
        _mm512_loadu_si512(b as *const __m512i),
        _mm512_loadu_si512(b.add(80) as *const __m512i),
    );
    let pick = _mm512_setr_epi32(0, 5, 10, 15, 16, 21, 26, 31, 0, 0, 0, 0, 0, 0, 0, 0);
    let words = _mm512_permutex2var_epi32(first, pick, second);
    _mm512_cvtph_ps(_mm512_castsi512_si256(words))
}

/// `0, 1, ..., 15` as f32 lanes.
///
/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn iota16() -> __m512 {
    _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    )
}

/// The two f16 at `p` (a block's `d`, then its `m` or nothing) as f32 lanes broadcast:
/// `(d, m)`.
///
/// # Safety
/// AVX-512F; four readable bytes at `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn halves_at_ptr(p: *const u8) -> (__m512, __m512) {
    let bits = i32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]);
    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    (
        _mm512_broadcastss_ps(dm),
        _mm512_broadcastss_ps(_mm_movehdup_ps(dm)),
    )
}

/// Whether the values of blocks of kind `K` are `d` times an integer (Q4_0's `q - 8`, Q5_0's
/// `q - 16`, Q8_0's `q`), each such product exact in f32 (an f16 `d` has 11 significant bits,
/// the integer at most 8).
#[cfg(target_arch = "x86_64")]
const fn symmetric<const K: u8>() -> bool {
    matches!(K, Q4_0 | Q5_0 | Q8_0)
}

/// The 32 values of the block at `b` as two halves of 16 lanes (values `j` and `16 + j`),
/// each made as gguf-py makes it: `q * d`, `d * (q - 8)`, `d * q + m`, `d * (q - 16)`
/// (the products exact, so `d` times [`block_integers`]; Q4_1 and Q5_1 by
/// [`block_values_dm`]).
///
/// # Safety
/// AVX-512F; `b` points at a whole block of kind `K`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn block_values<const K: u8>(b: *const u8) -> (__m512, __m512) {
    // `m`: the f16 after `d` (unused but by Q4_1 and Q5_1).
    let (d, m) = halves_at_ptr(b);
    if symmetric::<K>() {
        let (lo, hi) = block_integers::<K>(b);
        return (_mm512_mul_ps(d, lo), _mm512_mul_ps(d, hi));
    }
    block_values_dm::<K>(b, d, m)
}

/// The 32 integers of the Q4_0, Q5_0 or Q8_0 block at `b` whose products with its `d` are
/// its values (`q - 8`, `q - 16`, `q`), as f32 lanes (values `j` and `16 + j`). Q4_0's are
/// looked up in the 16 integers its four bits can make (`vpermps` reads a lane's low four
/// bits, so the low nibbles need no mask), Q5_0's by all five bits in the 32 they can make
/// ([`five_bit_indices`]).
///
/// # Safety
/// AVX-512F; `b` points at a whole block of kind `K` (Q4_0, Q5_0 or Q8_0).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn block_integers<const K: u8>(b: *const u8) -> (__m512, __m512) {
    debug_assert!(symmetric::<K>());
    if K == Q8_0 {
        let q = b.add(2) as *const __m128i;
        return (
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(1)))),
        );
    }
    let (qs_at, offset) = if K == Q4_0 { (2, 8.0) } else { (6, 16.0) };
    // Lane j: byte j, value j in its low nibble and value 16 + j in its high one.
    let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(qs_at) as *const __m128i));
    let table = _mm512_sub_ps(iota16(), _mm512_set1_ps(offset));
    if K == Q4_0 {
        return (
            _mm512_permutexvar_ps(bytes, table),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), table),
        );
    }
    let (lo, hi) = five_bit_indices(bytes, b.add(2));
    (
        _mm512_permutex2var_ps(table, lo, iota16()),
        _mm512_permutex2var_ps(table, hi, iota16()),
    )
}

/// `acc + d (lo x[..16] + hi x[16..32])`, lane-wise, for a block whose values are `d` times
/// the integers `lo`, `hi` ([`symmetric`]): those products exact, the integers' products
/// with `x` summed before the one multiplication by `d` are the sum of gguf-py's values
/// times `x` up to f32 rounding. For one row of `x` a Q8_0 block takes one multiplication
/// fewer than making each value, and Q4_0's and Q5_0's integers come from constant tables.
///
/// # Safety
/// AVX-512F; `xb` points at 32 readable floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn scaled_dot(lo: __m512, hi: __m512, xb: *const f32, d: __m512, acc: __m512) -> __m512 {
    let s = _mm512_mul_ps(lo, _mm512_loadu_ps(xb));
    let s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb.add(16)), s);
    _mm512_fmadd_ps(d, s, acc)
}

/// The 32 values `d * q + m` of the Q4_1 or Q5_1 block at `b` ([`block_values`]' form), with
/// its `d` and `m` given as broadcast lanes. Each is looked up in a table of the 16 (or 32)
/// a block can hold, made once per block: `d * q` is exact in f32, so the table's one fused
/// `d * q + m` rounds exactly as gguf-py's product then sum.
///
/// # Safety
/// AVX-512F; `b` points at a whole block of kind `K` (Q4_1 or Q5_1).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn block_values_dm<const K: u8>(b: *const u8, d: __m512, m: __m512) -> (__m512, __m512) {
    debug_assert!(matches!(K, Q4_1 | Q5_1));
    let qs_at = if K == Q4_1 { 4 } else { 8 };
    // Lane j: byte j, value j in its low nibble and value 16 + j in its high one.
    let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(qs_at) as *const __m128i));
    let iota = iota16();
    match K {
        Q4_1 => {
            let table = _mm512_fmadd_ps(d, iota, m);
            (
                _mm512_permutexvar_ps(bytes, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), table),
            )
        }
        _ => {
            // Q5_1: the fifth bits (bit j of `qh` for value j) as bit 4 of the index into
            // the 32 values `d * q + m` (`16 d` added after the lookup would round twice).
            let (lo, hi) = five_bit_indices(bytes, b.add(4));
            // Entries 0..16 and 16..32 of the table.
            let (t0, t1) = (
                _mm512_fmadd_ps(d, iota, m),
                _mm512_fmadd_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16.0)), m),
            );
            (
                _mm512_permutex2var_ps(t0, lo, t1),
                _mm512_permutex2var_ps(t0, hi, t1),
            )
        }
    }
}
