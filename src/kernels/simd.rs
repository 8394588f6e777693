//! Vectorised row operations of the softmax: row maximum and `exp(x - max)` with its sum.
//!
//! The exponential is the Cephes single-precision polynomial (relative error ~2 ulp) in the
//! scalar and AVX-512 code, and a `2^n 2^r` form with fewer multiply-adds in the AVX2+FMA
//! code (~1.5 ulp; see [`exp_nonpositive_avx2`]); every version flushes inputs below -87 to
//! exactly 0 (so masked `-inf` scores give weight 0 and no denormal ever reaches a matrix
//! multiply). The vector versions are picked at run time.
// The AVX-512 intrinsics are stable since Rust 1.89, above the `rust-version` the manifest
// declares; candle-core 0.11 itself needs 1.89 on x86-64 (it uses them too), so the
// declared version cannot build this crate anyway.
#![allow(clippy::incompatible_msrv)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

/// Below this, `exp` returns exactly 0 (`exp(-87) ~ 1.6e-38`, the smallest normal f32 is
/// `1.2e-38`).
const EXP_FLUSH: f32 = -87.0;
const EXP_MAX: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split in two so that `x - n ln 2` stays exact for |n| <= 128.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const P0: f32 = 1.987_569_1e-4;
const P1: f32 = 1.398_2e-3;
const P2: f32 = 8.333_452e-3;
const P3: f32 = 4.166_579_6e-2;
const P4: f32 = 1.666_666_5e-1;
const P5: f32 = 0.5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Scalar,
}

fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

/// The scalar exponential (same polynomial as the vector versions).
#[inline]
pub(crate) fn exp(x: f32) -> f32 {
    if x < EXP_FLUSH {
        return 0.0;
    }
    if x.is_nan() {
        return x;
    }
    let x = x.min(EXP_MAX);
    // Round to nearest by adding and removing 1.5 * 2^23 (no libm call).
    const ROUND: f32 = 12_582_912.0;
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut y = P0;
    y = y * r + P1;
    y = y * r + P2;
    y = y * r + P3;
    y = y * r + P4;
    y = y * r + P5;
    let y = y * (r * r) + r + 1.0;
    // n is in [-126, 127] here, so 2^n is a normal f32.
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Largest element (`-inf` for an empty row).
pub(crate) fn row_max(x: &[f32]) -> f32 {
    match isa() {
        // SAFETY: the CPU has the features these functions are compiled for (checked above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { row_max_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { row_max_avx2(x) },
        Isa::Scalar => x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)),
    }
}

/// `x[j] = exp(x[j] - m)` for every `j`; returns the sum of the new values. `m` must be
/// finite.
pub(crate) fn exp_shifted_sum(x: &mut [f32], m: f32) -> f32 {
    match isa() {
        // SAFETY: the CPU has the features these functions are compiled for (checked above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { exp_shifted_sum_avx512(x, m) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { exp_shifted_sum_avx2(x, m) },
        Isa::Scalar => {
            let mut sum = 0.0;
            for v in x.iter_mut() {
                *v = exp(*v - m);
                sum += *v;
            }
            sum
        }
    }
}

/// `dst[..n] = src[..n]`, `n` the shorter length (returned), with streaming (non-temporal)
/// stores where the CPU has AVX: the destination's cache lines are written without being
/// read first and do not evict the cache. Meant for large results written once and not read
/// again soon.
pub(crate) fn copy_streaming(dst: &mut [MaybeUninit<f32>], src: &[f32]) -> usize {
    let n = dst.len().min(src.len());
    #[cfg(target_arch = "x86_64")]
    {
        if isa() != Isa::Scalar {
            // SAFETY: AVX is part of both vector ISAs checked by `isa`; both slices hold `n`
            // elements and do not overlap (one is borrowed mutably).
            unsafe { copy_streaming_avx(dst.as_mut_ptr().cast::<f32>(), src.as_ptr(), n) };
            return n;
        }
    }
    for (d, &s) in dst[..n].iter_mut().zip(&src[..n]) {
        d.write(s);
    }
    n
}

/// # Safety
/// The CPU has AVX; `dst` and `src` address `n` floats each and do not overlap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn copy_streaming_avx(dst: *mut f32, src: *const f32, n: usize) {
    // Scalar stores up to a 32-byte boundary of `dst` (streaming stores need it).
    let mut i = 0;
    while i < n && (dst.add(i) as usize) % 32 != 0 {
        *dst.add(i) = *src.add(i);
        i += 1;
    }
    while i + 8 <= n {
        _mm256_stream_ps(dst.add(i), _mm256_loadu_ps(src.add(i)));
        i += 8;
    }
    while i < n {
        *dst.add(i) = *src.add(i);
        i += 1;
    }
    // Streaming stores are weakly ordered: make them visible before anything that follows
    // (the task's completion, then the caller's reads).
    _mm_sfence();
}

/// `x *= a`.
#[inline]
pub(crate) fn scale(x: &mut [f32], a: f32) {
    for v in x.iter_mut() {
        *v *= a;
    }
}

/// `x += y` (element-wise, `x.len() == y.len()`).
#[inline]
pub(crate) fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += *b;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_avx512(x: __m512) -> __m512 {
    let flush = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_FLUSH));
    // `max(lo, x)` / `min(hi, x)` return `x` when it is NaN, so NaN propagates.
    let x = _mm512_max_ps(_mm512_set1_ps(EXP_FLUSH), x);
    let x = _mm512_min_ps(_mm512_set1_ps(EXP_MAX), x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut y = _mm512_set1_ps(P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P5));
    let r2 = _mm512_mul_ps(r, r);
    y = _mm512_fmadd_ps(y, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
    _mm512_maskz_mov_ps(!flush, _mm512_scalef_ps(y, n))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_sum_avx512(x: &mut [f32], m: f32) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let vm = _mm512_set1_ps(m);
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        let e0 = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), vm));
        let e1 = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(p.add(i + 16)), vm));
        _mm512_storeu_ps(p.add(i), e0);
        _mm512_storeu_ps(p.add(i + 16), e1);
        acc0 = _mm512_add_ps(acc0, e0);
        acc1 = _mm512_add_ps(acc1, e1);
        i += 32;
    }
    while i < n {
        let left = n - i;
        let mask: __mmask16 = if left >= 16 {
            0xffff
        } else {
            (1u16 << left) - 1
        };
        let e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, p.add(i)), vm));
        _mm512_mask_storeu_ps(p.add(i), mask, e);
        acc0 = _mm512_mask_add_ps(acc0, mask, acc0, e);
        i += 16;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_max_avx512(x: &[f32]) -> f32 {
    let n = x.len();
    let p = x.as_ptr();
    let mut acc0 = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut acc1 = acc0;
    let mut i = 0;
    while i + 32 <= n {
        acc0 = _mm512_max_ps(acc0, _mm512_loadu_ps(p.add(i)));
        acc1 = _mm512_max_ps(acc1, _mm512_loadu_ps(p.add(i + 16)));
        i += 32;
    }
    while i < n {
        let left = n - i;
        let mask: __mmask16 = if left >= 16 {
            0xffff
        } else {
            (1u16 << left) - 1
        };
        acc0 = _mm512_mask_max_ps(acc0, mask, acc0, _mm512_maskz_loadu_ps(mask, p.add(i)));
        i += 16;
    }
    _mm512_reduce_max_ps(_mm512_max_ps(acc0, acc1))
}

/// `2^r` on `[-0.5, 0.5]` as `1 + r (Q1 + r (Q2 + r (Q3 + r (Q4 + r Q5))))`: a degree-5
/// fit of least maximum relative error (9.2e-8 in exact arithmetic, 1.8e-7 evaluated in f32
/// within [`exp_nonpositive_avx2`], about 1.5 ulp).
// A fitted coefficient, close to but deliberately not `ln 2` (the fit spreads the error of
// the truncated series over the interval).
#[allow(clippy::approx_constant)]
const Q1: f32 = 0.693_147;
const Q2: f32 = 0.240_222_42;
const Q3: f32 = 5.550_734_3e-2;
const Q4: f32 = 9.671_514e-3;
const Q5: f32 = 1.326_460_5e-3;
/// `log2(e)` split in two f32 (`LOG2E` rounded, then the rest) so that `x log2(e)` keeps
/// ~48 bits.
const LOG2E_HI: f32 = LOG2E;
const LOG2E_LO: f32 = 1.925_963e-8;

/// `exp(x)` for `x <= 0`, `-inf` or NaN (what the softmax feeds it: a score minus its row
/// maximum), 8 lanes, as `2^n 2^r` with `n = round(x log2(e))`: fewer multiply-adds than
/// the general exponential (the two FMA pipes are what the attention products need too).
/// - the rounding is the "magic number" addition, whose low bits also hold `n`, so `2^n`
///   is applied with an integer shift and add to the exponent field (no multiply);
/// - one compare flushes inputs below -87 to exactly 0 (no denormal reaches a product);
///   NaN inputs come out NaN.
///
/// Within 4 ulp of `f32::exp` (test `vector_exp_matches_std_flushes_and_keeps_nan`).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_nonpositive_avx2(x: __m256) -> __m256 {
    // 1.5 * 2^23: `x log2(e) + MAGIC` is an f32 in [2^23, 2^24) whose mantissa holds
    // `2^22 + n`, so its bits shifted left by 23 are `n << 23` (|n| <= 126 for the lanes
    // kept; the rest shifts out).
    const MAGIC: f32 = 12_582_912.0;
    let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(EXP_FLUSH));
    let t = _mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E_HI), _mm256_set1_ps(MAGIC));
    let n = _mm256_sub_ps(t, _mm256_set1_ps(MAGIC));
    // r = x log2(e) - n in [-0.5, 0.5]
    let r = _mm256_fmsub_ps(x, _mm256_set1_ps(LOG2E_HI), n);
    let r = _mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E_LO), r);
    let mut y = _mm256_fmadd_ps(_mm256_set1_ps(Q5), r, _mm256_set1_ps(Q4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(Q3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(Q2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(Q1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0));
    // y * 2^n: n added to the exponent field. For the lanes kept the result is a normal
    // f32 (n = -126 only for x log2(e) in [-125.52, -125.5), where y > 1).
    let e = _mm256_castsi256_ps(_mm256_add_epi32(
        _mm256_castps_si256(y),
        _mm256_slli_epi32::<23>(_mm256_castps_si256(t)),
    ));
    // Flushed lanes (and -inf, and NaN) are 0 after the mask; the max then gives NaN lanes
    // their NaN back (it returns its second operand when one is NaN) and leaves the others
    // (e >= 0 >= x).
    _mm256_max_ps(_mm256_and_ps(e, keep), x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_sum_avx2(x: &mut [f32], m: f32) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let vm = _mm256_set1_ps(m);
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        let e0 = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vm));
        let e1 = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(p.add(i + 8)), vm));
        _mm256_storeu_ps(p.add(i), e0);
        _mm256_storeu_ps(p.add(i + 8), e1);
        acc0 = _mm256_add_ps(acc0, e0);
        acc1 = _mm256_add_ps(acc1, e1);
        i += 16;
    }
    if i + 8 <= n {
        let e = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vm));
        _mm256_storeu_ps(p.add(i), e);
        acc0 = _mm256_add_ps(acc0, e);
        i += 8;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(acc0, acc1));
    let mut sum = lanes.iter().sum::<f32>();
    while i < n {
        let e = exp(*p.add(i) - m);
        *p.add(i) = e;
        sum += e;
        i += 1;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_max_avx2(x: &[f32]) -> f32 {
    let n = x.len();
    let p = x.as_ptr();
    let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 8 <= n {
        acc = _mm256_max_ps(acc, _mm256_loadu_ps(p.add(i)));
        i += 8;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    let mut m = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    while i < n {
        m = m.max(*p.add(i));
        i += 1;
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_within_a_few_ulp() {
        let mut x: Vec<f32> = (-8700..=0).map(|i| i as f32 * 0.01).collect();
        x.extend([-86.99f32, -50.5, -1e-7, 0.0, 3.5, 80.0]);
        for &v in &x {
            let e = exp(v);
            let r = v.exp();
            assert!(
                (e - r).abs() <= 4.0 * f32::EPSILON * r,
                "exp({v}) = {e}, std {r}"
            );
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1e4), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn vector_exp_matches_std_flushes_and_keeps_nan() {
        // Shifted scores x - m over the whole range the softmax sees, past the flush point,
        // with -inf (masked) and NaN lanes at positions of both vector halves and the tail.
        let mut x: Vec<f32> = (0..=9000).map(|i| -(i as f32) * 0.01).collect();
        x.extend([-86.99, -87.0, -87.01, -100.0, -1e-7, f32::NEG_INFINITY]);
        x[3] = f32::NAN;
        x[12] = f32::NEG_INFINITY;
        let n = x.len();
        x[n - 2] = f32::NAN;
        // NaNs with payload bits low in the mantissa (they must not leak into the exponent).
        x[20] = f32::from_bits(0x7FC0_01FF);
        x[n - 20] = f32::from_bits(0xFFC0_0101);
        let mut e = x.clone();
        let sum = exp_shifted_sum(&mut e, 0.0);
        assert!(sum.is_nan());
        for (&v, &got) in x.iter().zip(&e) {
            if v.is_nan() {
                assert!(got.is_nan(), "exp(NaN) = {got}");
            } else if v < EXP_FLUSH {
                assert_eq!(got, 0.0, "exp({v}) must flush to 0");
            } else {
                let r = v.exp();
                assert!(
                    (got - r).abs() <= 4.0 * f32::EPSILON * r && got >= f32::MIN_POSITIVE,
                    "exp({v}) = {got}, std {r}"
                );
            }
        }
    }

    #[test]
    fn streaming_copy_writes_every_element_at_any_alignment() {
        let src: Vec<f32> = (0..300).map(|i| i as f32 * 0.5 - 7.0).collect();
        for start in 0..9 {
            for len in [0usize, 1, 7, 8, 9, 31, 100, 291 - start] {
                let mut dst = vec![MaybeUninit::new(f32::NAN); 300];
                assert_eq!(
                    copy_streaming(&mut dst[start..start + len], &src[..len]),
                    len
                );
                for (i, d) in dst.iter().enumerate() {
                    // SAFETY: every element was initialised (NaN, then maybe copied over).
                    let v = unsafe { d.assume_init() };
                    if i >= start && i < start + len {
                        assert_eq!(v, src[i - start], "start {start}, len {len}, at {i}");
                    } else {
                        assert!(v.is_nan(), "start {start}, len {len}: wrote outside at {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn vector_rows_match_scalar() {
        for n in [0usize, 1, 5, 15, 16, 17, 31, 32, 33, 100, 257] {
            let base: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
                .collect();
            let m = row_max(&base);
            let expected = base.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            assert_eq!(m, expected, "max of {n}");
            if n == 0 {
                continue;
            }
            let mut v = base.clone();
            v[0] = f32::NEG_INFINITY;
            let mut s = v.clone();
            let sum = exp_shifted_sum(&mut s, m);
            let mut ref_sum = 0f32;
            for (j, &x) in v.iter().enumerate() {
                let r = exp(x - m);
                ref_sum += r;
                assert!(
                    (s[j] - r).abs() <= 1e-6 * r.max(1e-30),
                    "{n}: {} vs {r}",
                    s[j]
                );
            }
            assert_eq!(s[0], 0.0);
            assert!(
                (sum - ref_sum).abs() <= 1e-5 * ref_sum,
                "{sum} vs {ref_sum}"
            );
        }
    }
}
