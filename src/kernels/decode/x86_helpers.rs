//! x86 pieces the GGUF row kernels of several instruction sets share: f16 scales read from
//! blocks, bits and nibbles unpacked to bytes, the 8-bit AVX2 block product (also the
//! AVX-512 VNNI kernels' last odd block), horizontal sums and the rows' sum vectors. Each
//! carries the instruction sets it needs as `target_feature`; this module imports nothing
//! above the block formats.

use std::arch::x86_64::*;

use crate::kernels::quant::activations::QuantizedX;

/// The sum of the 8 lanes.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

/// The f16 at `p` and `p + 2` as the f32 lanes `(a, b, 0, 0)`, with the CPU's conversion
/// (exact). The four bytes are read by a `vmovd`, which writes its whole register: left to
/// the compiler, the read shrinks to a 16-bit insert (`vpinsrw`) into whatever register it
/// picks, and then waits for that register's last writer, often a loop's accumulator
/// (Q8_0 rows were half again as slow so on Zen 4).
///
/// # Safety
/// AVX and F16C (every caller's target has them); four readable bytes at `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn halves_at(p: *const u8) -> __m128 {
    let bits: __m128i;
    std::arch::asm!(
        "vmovd {bits}, dword ptr [{p}]",
        bits = out(xmm_reg) bits,
        p = in(reg) p,
        options(pure, readonly, nostack, preserves_flags),
    );
    _mm_cvtph_ps(bits)
}

/// The f16 at `p` as f32 ([`halves_at`]; four readable bytes at `p`).
///
/// # Safety
/// F16C (the caller's target features); four readable bytes at `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn half_at(p: *const u8) -> f32 {
    _mm_cvtss_f32(halves_at(p))
}

/// The f16 ending a block at `end` (Q6_K's `d`) as f32: read with the two bytes before it.
///
/// # Safety
/// F16C (the caller's target features); four readable bytes ending at `end`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn half_before(end: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_movehdup_ps(halves_at(end.sub(4))))
}

/// The 32 values `q - 32` of the Q6_K block at `b` from value `128 h + 32 t` on, as signed
/// bytes: the low four bits from `ql[64 h + 32 (t % 2) + l] >> 4 (t / 2)`, the high two from
/// `qh[32 h + l] >> 2 t` (both row kernels' unpacking).
///
/// # Safety
/// AVX2; `b` points at a whole Q6_K block, `h` below 2 and `t` below 4.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn q6_k_bytes(b: *const u8, h: usize, t: usize) -> __m256i {
    let (nibbles, twos) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x03));
    let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
    let ql = _mm256_loadu_si256(b.add(64 * h + 32 * (t % 2)) as *const __m256i);
    let low = if t / 2 == 0 {
        _mm256_and_si256(ql, nibbles)
    } else {
        _mm256_and_si256(_mm256_srli_epi16(ql, 4), nibbles)
    };
    let high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t as i32)), twos);
    _mm256_sub_epi8(
        _mm256_or_si256(low, _mm256_slli_epi16(high, 4)),
        _mm256_set1_epi8(32),
    )
}

/// The 16 scales `- 32` of a Q3_K block from its 12 scale bytes at `p`, as signed bytes,
/// group `g` in byte `g`: the low four bits from `sc[g % 8] >> 4 (g / 8)`, the high two
/// from `sc[8 + g % 4] >> 2 (g / 4)` (llama.cpp's unpacking over 32-bit words, the four
/// words side by side).
///
/// # Safety
/// AVX2; 12 readable bytes at `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn q3_k_scales(p: *const u8) -> __m128i {
    let a = _mm_loadl_epi64(p as *const __m128i); // words a0, a1
    let high = _mm_set1_epi32(std::ptr::read_unaligned(p.add(8) as *const i32));
    // Words [a0, a1, a0 >> 4, a1 >> 4] & 0x0F0F0F0F: the low four bits.
    let low = _mm_srlv_epi32(
        _mm_shuffle_epi32::<0b01_00_01_00>(a),
        _mm_setr_epi32(0, 0, 4, 4),
    );
    let low = _mm_and_si128(low, _mm_set1_epi8(0x0F));
    // [high, high >> 2, high >> 4, high >> 6] & 0x03030303, moved up by 4.
    let top = _mm_and_si128(
        _mm_srlv_epi32(high, _mm_setr_epi32(0, 2, 4, 6)),
        _mm_set1_epi8(3),
    );
    let six = _mm_or_si128(low, _mm_slli_epi32::<4>(top));
    _mm_sub_epi8(six, _mm_set1_epi8(32))
}

/// The 32 values of a 4-bit block's 16 bytes at `qs` as unsigned bytes in value order
/// (values `j` in the low nibbles, `16 + j` in the high ones).
///
/// # Safety
/// AVX2 (the caller's target features); 16 readable bytes at `qs`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn nibbles(qs: *const u8) -> __m256i {
    let b = _mm_loadu_si128(qs as *const __m128i);
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(b, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), mask);
    _mm256_set_m128i(hi, lo)
}

/// 0x10 in byte `j` where bit `j` of the u32 at `qh` is set (the 5-bit types' high bits).
///
/// # Safety
/// AVX2 (the caller's target features); four readable bytes at `qh`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn fifth_bits(qh: *const u8) -> __m256i {
    _mm256_and_si256(fifth_bit_set(qh), _mm256_set1_epi8(0x10))
}

/// 0xFF in byte `j` where bit `j` of the u32 at `qh` is set, else 0: each byte of the
/// broadcast bits picked for its 8 lanes, then compared whole.
///
/// # Safety
/// AVX2 (the caller's target features); four readable bytes at `qh`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn fifth_bit_set(qh: *const u8) -> __m256i {
    use crate::kernels::decode::x86_helpers::read_u32;
    let bits = _mm256_set1_epi32(read_u32(qh) as i32);
    let spread = _mm256_shuffle_epi8(
        bits,
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    // All other bits of each byte set: the byte is 0xFF exactly where its own bit is.
    let others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1))
}

/// The f16 at `p` and at each of the next 7 strides of `stride` bytes (one field of 8
/// consecutive blocks: their `d`, or `m`) as 8 f32 lanes. Gathered into two 64-bit words by
/// scalar loads and shifts: eight `vpinsrw` took the shuffle ports the 8-bit kernels need
/// (Q4_1 from L2: 3.6 -> 3.3 cycles a block; see docs/performance-archive.md).
///
/// # Safety
/// AVX2 and F16C; two readable bytes at `p + k stride` for `k < 8`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn halves8(p: *const u8, stride: usize) -> __m256 {
    let h = |k: usize| {
        u64::from(u16::from_le_bytes([
            *p.add(k * stride),
            *p.add(k * stride + 1),
        ]))
    };
    let lo = h(0) | h(1) << 16 | h(2) << 32 | h(3) << 48;
    let hi = h(4) | h(5) << 16 | h(6) << 32 | h(7) << 48;
    _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64))
}

/// Block `i` of a row (at `b`) against block `i` of `x`, added to `acc` (8 lanes of
/// `d dx q qx` sums) and `terms` (its offset or `m` term).
///
/// # Safety
/// AVX2, FMA and F16C; `b` points at a whole `K` block, `i` below `x.d.len()`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn block<const K: u8>(
    b: *const u8,
    x: &QuantizedX,
    i: usize,
    acc: &mut __m256,
    terms: &mut f32,
) {
    with_x::<K>(weights::<K>(b), x, i, acc, terms);
}

/// A block's values as bytes, unpacked once for any number of rows of `x`: the integers
/// (Q8_0's signed ones as they are stored), `d`, and the factor of `dx sum qx` (the offset
/// or `m` term).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Weights {
    pub(crate) q: __m256i,
    pub(crate) d: f32,
    pub(crate) term: f32,
}

/// The block at `b` unpacked ([`Weights`]).
///
/// # Safety
/// AVX2, FMA and F16C; `b` points at a whole `K` block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn weights<const K: u8>(b: *const u8) -> Weights {
    use crate::kernels::decode::x86_helpers::half_at;
    use crate::kernels::quant::row_kinds::kind::{Q4_0, Q4_1, Q5_0, Q8_0};
    let d = half_at(b);
    let (q, term) = match K {
        Q8_0 => (_mm256_loadu_si256(b.add(2) as *const __m256i), 0.0),
        Q4_0 => (nibbles(b.add(2)), -8.0 * d),
        Q4_1 => (nibbles(b.add(4)), half_at(b.add(2))),
        Q5_0 => (
            _mm256_or_si256(nibbles(b.add(6)), fifth_bits(b.add(2))),
            -16.0 * d,
        ),
        _ => (
            _mm256_or_si256(nibbles(b.add(8)), fifth_bits(b.add(4))),
            half_at(b.add(2)),
        ),
    };
    Weights { q, d, term }
}

/// Unpacked block `w` (block `i` of its row) against block `i` of `x`, added to `acc` and
/// `terms` as [`block`] adds them. Q8_0's signed weights go in as their magnitudes, their
/// signs moved onto `x`.
///
/// # Safety
/// AVX2, FMA and F16C; `i` below `x.d.len()`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn with_x<const K: u8>(
    w: Weights,
    x: &QuantizedX,
    i: usize,
    acc: &mut __m256,
    terms: &mut f32,
) {
    use crate::kernels::quant::row_kinds::kind::Q8_0;
    let xv = _mm256_loadu_si256(x.qs.as_ptr().add(32 * i) as *const __m256i);
    let (q, xv) = if K == Q8_0 {
        (_mm256_sign_epi8(w.q, w.q), _mm256_sign_epi8(xv, w.q))
    } else {
        (w.q, xv)
    };
    let pairs = _mm256_maddubs_epi16(q, xv);
    let sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    let scale = _mm256_set1_ps(w.d * *x.d.get_unchecked(i));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, *acc);
    *terms += w.term * *x.dsum.get_unchecked(i);
}

/// The little-endian u32 at `p`.
///
/// # Safety
/// Four readable bytes at `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn read_u32(p: *const u8) -> u32 {
    u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)])
}

/// Weight rows' sum vectors (one per row of `x`) gathered 16 rows at a time and written out
/// reduced: `out[ldo j + r]` = the sum of row `j`'s vector `r`'s lanes.
#[cfg(target_arch = "x86_64")]
pub(crate) struct RowSums<'a, const R: usize> {
    pending: [[__m512; 16]; R],
    filled: usize,
    out: &'a mut [f32],
    ldo: usize,
}

#[cfg(target_arch = "x86_64")]
impl<'a, const R: usize> RowSums<'a, R> {
    /// Sums for rows `0..` of `out` (row stride `ldo`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn new(out: &'a mut [f32], ldo: usize) -> Self {
        Self {
            pending: [[_mm512_setzero_ps(); 16]; R],
            filled: 0,
            out,
            ldo,
        }
    }

    /// The next row's vectors.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn push(&mut self, sums: [__m512; R]) {
        for (p, s) in self.pending.iter_mut().zip(sums) {
            p[self.filled] = s;
        }
        self.filled += 1;
        if self.filled == 16 {
            self.write();
        }
    }

    /// Writes the rows still gathered.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn finish(mut self) {
        if self.filled > 0 {
            for p in self.pending.iter_mut() {
                p[self.filled..].fill(_mm512_setzero_ps());
            }
            self.write();
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn write(&mut self) {
        let (n, ldo) = (self.filled, self.ldo);
        for (r, p) in self.pending.iter().enumerate() {
            let mut sums = [0f32; 16];
            // SAFETY: 16 floats to a local array.
            unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), sum16(p)) };
            for (i, &s) in sums.iter().take(n).enumerate() {
                self.out[i * ldo + r] = s;
            }
        }
        let next = (n * ldo).min(self.out.len());
        self.out = &mut std::mem::take(&mut self.out)[next..];
        self.filled = 0;
    }
}

/// Lane `i` = the sum of `v[i]`'s 16 lanes, in an order that depends on `v[i]` alone.
///
/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn sum16(v: &[__m512; 16]) -> __m512 {
    // Pairs: per 128-bit lane (a0 + a2, b0 + b2, a1 + a3, b1 + b3).
    let w: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
    });
    // Fours: per 128-bit lane, one partial sum of each of 4 rows.
    let x: [__m512; 4] = std::array::from_fn(|i| {
        let (a, b) = (_mm512_castps_pd(w[2 * i]), _mm512_castps_pd(w[2 * i + 1]));
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
        )
    });
    // The four 128-bit lanes of each summed; lane group k holds rows 4k..4k + 4.
    let y: [__m512; 2] = std::array::from_fn(|i| {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    });
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(y[0], y[1]),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(y[0], y[1]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f16 scales read from blocks (one, a pair, the one before an address) are the f16
    /// values, bit for bit, NaNs as NaNs.
    #[test]
    #[cfg_attr(
        not(isa_avx2),
        ignore = "needs AVX2 + FMA + F16C, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn half_scales_convert_exactly() {
        assert!(
            crate::kernels::simd::avx2_fma_f16c(),
            "built for this CPU's kernels, running without them"
        );
        for bits in (0..=u16::MAX).step_by(7) {
            let other = bits.rotate_left(5);
            let mut b = [0u8; 6];
            b[..2].copy_from_slice(&other.to_le_bytes());
            b[2..4].copy_from_slice(&bits.to_le_bytes());
            b[4..].copy_from_slice(&other.to_le_bytes());
            let want = half::f16::from_bits(bits).to_f32();
            // SAFETY: F16C checked above; four bytes readable at each pointer.
            let got = unsafe {
                let pair = halves_at(b.as_ptr().add(2));
                [
                    half_at(b.as_ptr().add(2)),
                    half_before(b.as_ptr().add(4)),
                    _mm_cvtss_f32(pair),
                    _mm_cvtss_f32(_mm_movehdup_ps(halves_at(b.as_ptr()))),
                ]
            };
            for g in got {
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "{bits:#x}"
                );
            }
        }
    }

    /// The vector unpacking gives each group's scale as the per-group formula does, on
    /// scale bytes of every pattern.
    #[test]
    #[cfg_attr(not(cpu_avx2), ignore = "needs a CPU with AVX2 + FMA + F16C")]
    fn q3_k_scales_are_the_per_group_formula() {
        assert!(
            is_x86_feature_detected!("avx2"),
            "built for this CPU's kernels, running without them"
        );
        for seed in 0..2000u32 {
            let sc: [u8; 12] = std::array::from_fn(|i| {
                (seed.wrapping_mul(2_654_435_761).rotate_left(i as u32 * 3) >> 7) as u8
                    ^ (i as u8).wrapping_mul(37)
                    ^ seed as u8
            });
            let want: [i8; 16] = std::array::from_fn(|g| {
                let low = (sc[g % 8] >> (4 * (g / 8))) & 0x0F;
                let high = (sc[8 + g % 4] >> (2 * (g / 4))) & 0x03;
                (low | (high << 4)) as i8 - 32
            });
            let mut got = [0i8; 16];
            // SAFETY: AVX2 checked above; 12 readable bytes, 16 writable.
            unsafe { _mm_storeu_si128(got.as_mut_ptr() as *mut __m128i, q3_k_scales(sc.as_ptr())) };
            assert_eq!(got, want, "{sc:?}");
        }
    }

    /// Each lane is its vector's sum, whatever the other vectors hold.
    #[test]
    #[cfg_attr(not(cpu_avx512), ignore = "needs a CPU with AVX-512F")]
    fn sum16_gives_each_vector_its_own_sum() {
        assert!(
            is_x86_feature_detected!("avx512f"),
            "built for this CPU's kernels, running without them"
        );
        crate::kernels::decode::quant_gemv::check_sum_tree::<16>(|v| {
            let mut out = [0f32; 16];
            // SAFETY: AVX-512F checked above; 16 floats read and written per vector.
            unsafe {
                let v = v.map(|l| _mm512_loadu_ps(l.as_ptr()));
                _mm512_storeu_ps(out.as_mut_ptr(), sum16(&v));
            }
            out
        });
    }
}
