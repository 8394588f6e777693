//! Vectorised row operations of the softmax: row maximum and `2^(x - max)` with its sum.
//!
//! The kernels run the softmax in base 2: the scores come out of the product already
//! multiplied by `log2(e)` (folded into the query scale, see
//! [`Problem::score_scale`](crate::kernels::attend::problem::Problem::score_scale)), so
//! `exp(s - max) = 2^(s log2(e) - max')` needs no range reduction by `ln 2`. Every version
//! (scalar, AVX2 + FMA, AVX-512) computes `2^x` as `2^n 2^r` with `n = round(x)`, `r = x - n`
//! exact and the same degree-5 fit for `2^r` (~1.5 ulp), and flushes inputs below -125 to
//! exactly 0 (so masked `-inf` scores give weight 0 and no denormal ever reaches a matrix
//! multiply). The vector versions are picked at run time.
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

/// Below this, `exp2` returns exactly 0 (`2^-125 ~ 2.4e-38`; the smallest normal f32 is
/// `2^-126`, and `2^n 2^r` with `n >= -125` is always normal).
const EXP2_FLUSH: f32 = -125.0;
/// From this up, `exp2` is `+inf` (the largest f32 is just under `2^128`).
const EXP2_MAX: f32 = 128.0;
/// 1.5 * 2^23: for |x| < 2^22, `x + MAGIC` is an f32 in [2^23, 2^24) (spacing 1), so the
/// addition rounds `x` to the nearest integer `n`, and the sum's mantissa holds `2^22 + n`.
pub(crate) const MAGIC: f32 = 12_582_912.0;

/// `2^r` on `[-0.5, 0.5]` as `1 + r (Q1 + r (Q2 + r (Q3 + r (Q4 + r Q5))))`: a degree-5
/// fit of least maximum relative error (9.2e-8 in exact arithmetic, 1.8e-7 evaluated in f32,
/// about 1.5 ulp).
// A fitted coefficient, close to but deliberately not `ln 2` (the fit spreads the error of
// the truncated series over the interval).
#[allow(clippy::approx_constant)]
pub(crate) const Q1: f32 = 0.693_147;
pub(crate) const Q2: f32 = 0.240_222_42;
pub(crate) const Q3: f32 = 5.550_734_3e-2;
pub(crate) const Q4: f32 = 9.671_514e-3;
pub(crate) const Q5: f32 = 1.326_460_5e-3;

/// `2^r` by the fit above in Horner form, with the given vector multiply-add and splat:
/// the AVX2 and AVX-512 versions evaluate the same polynomial in the same order.
#[cfg(target_arch = "x86_64")]
macro_rules! pow2_fraction {
    ($fmadd:ident, $splat:ident, $r:expr) => {{
        let r = $r;
        let y = $fmadd($splat(Q5), r, $splat(Q4));
        let y = $fmadd(y, r, $splat(Q3));
        let y = $fmadd(y, r, $splat(Q2));
        let y = $fmadd(y, r, $splat(Q1));
        $fmadd(y, r, $splat(1.0))
    }};
}

/// The widest vector instructions this CPU runs these kernels with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Scalar,
}

/// [`Isa`] of this CPU (detected once): AVX-512F, else AVX2 + FMA, else scalar. The
/// environment variable `CANDLE_ATTENTION_ISA` (`avx2` or `scalar`) caps it, to run the
/// narrower kernels on a wider CPU (a laptop's path measured on a server); it never raises it.
pub(crate) fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = std::env::var("CANDLE_ATTENTION_ISA").unwrap_or_default();
        if cap.eq_ignore_ascii_case("scalar") {
            return Isa::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && !cap.eq_ignore_ascii_case("avx2") {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

/// The CPU's features the kernels ask about beyond [`isa`]'s levels, detected once: the
/// one place the crate's kernels detect CPU features.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy)]
struct Features {
    avx2_fma_f16c: bool,
    avx512_vnni: bool,
}

#[cfg(target_arch = "x86_64")]
fn features() -> Features {
    static FEATURES: OnceLock<Features> = OnceLock::new();
    *FEATURES.get_or_init(|| {
        let f16c = is_x86_feature_detected!("f16c");
        let fma = is_x86_feature_detected!("fma");
        Features {
            avx2_fma_f16c: is_x86_feature_detected!("avx2") && fma && f16c,
            avx512_vnni: is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
                && f16c
                && fma,
        }
    })
}

/// AVX2, FMA and F16C, the instruction set not capped below AVX2 (the f16 matrix-vector
/// loops' and the GGUF row kernels' AVX2 forms, exact and 8-bit).
pub(crate) fn avx2_fma_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    return features().avx2_fma_f16c && matches!(isa(), Isa::Avx2 | Isa::Avx512);
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// AVX-512 F, BW, VL and VNNI with F16C and FMA, the instruction set not capped below
/// AVX-512 (the 8-bit GGUF kernels' AVX-512 form).
pub(crate) fn avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    return features().avx512_vnni && isa() == Isa::Avx512;
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the CPU is AMD's ("AuthenticAMD"): a few thresholds were measured apart on AMD
/// Zen 4 and on an Intel Xeon.
pub(crate) fn amd() -> bool {
    static AMD: OnceLock<bool> = OnceLock::new();
    *AMD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: every x86-64 CPU has CPUID; leaf 0 is the vendor string.
            #[allow(unused_unsafe)]
            let r = unsafe { std::arch::x86_64::__cpuid(0) };
            let word = |b: &[u8; 4]| u32::from_le_bytes(*b);
            (r.ebx, r.edx, r.ecx) == (word(b"Auth"), word(b"enti"), word(b"cAMD"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// `2^x`, scalar (same reduction and polynomial as the vector versions): 0 below -125 and
/// for `-inf`, NaN for NaN, `+inf` from 128 up.
#[inline]
pub(crate) fn exp2(x: f32) -> f32 {
    if x < EXP2_FLUSH {
        return 0.0;
    }
    if x.is_nan() {
        return x;
    }
    if x >= EXP2_MAX {
        return f32::INFINITY;
    }
    // Round to nearest by adding and removing MAGIC (no libm call); r is exact.
    let n = (x + MAGIC) - MAGIC;
    let r = x - n;
    let y = ((((Q5 * r + Q4) * r + Q3) * r + Q2) * r + Q1) * r + 1.0;
    // n is in [-125, 128] here; 2^128 is not an f32, so 2^n is applied in two steps.
    let n = n as i32;
    let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    y * pow2(n / 2) * pow2(n - n / 2)
}

/// Largest element (`-inf` for an empty row).
pub(crate) fn row_max(x: &[f32]) -> f32 {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` found AVX-512F on this CPU.
        Isa::Avx512 => unsafe { row_max_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` found AVX2 and FMA on this CPU.
        Isa::Avx2 => unsafe { row_max_avx2(x) },
        Isa::Scalar => x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)),
    }
}

/// `x[j] = 2^(x[j] - m)` for every `j`; returns the sum of the new values. `m` must be
/// finite with every `x[j] - m` at most 126: the softmax's row maximum (in base-2 units),
/// or a reference the scores exceed by a little ([`exp2_shifted_sum_bounded`] on CPUs
/// without its one-pass version).
pub(crate) fn exp2_shifted_sum(x: &mut [f32], m: f32) -> f32 {
    // SAFETY: `isa()` is what this CPU has.
    unsafe { exp2_shifted_sum_on(isa(), x, m) }
}

/// Largest integer reference that [`exp2_shifted_sum_bounded`] folds into its rounding
/// constant (`MAGIC + 127 - m` must stay an integer in `[2^23, 2^24)`); other references
/// are subtracted first.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const FOLDED_REFERENCE: f32 = 1_048_576.0;

/// `x[j] = 2^(x[j] - m)` for every `j` and the sum of the new values, for a finite
/// reference `m` that the scores may exceed by up to `limit` (an integer in `[2, 126]`): the
/// row maximum, or the lazy reference of the tiled softmax, which only moves when a row's
/// scores outgrow it.
///
/// Returns `None` when some `x[j] - m`, rounded to the nearest integer, is above `limit`
/// (the versions without a one pass compare `x[j]` with `m + limit` itself, so they may
/// refuse up to half a unit lower), or when this CPU's version cannot compute the row as
/// [`exp2_shifted_sum`] would: the AVX2 version's powers are one shift and one exact
/// multiply, with no flush, for a window of 128 exponents, so it also refuses rows where
/// some `x[j] - m` rounds below `limit - 127`, and rows with NaN or infinite elements. The
/// caller then recomputes the row's scores and takes [`exp2_shifted_sum`]. After `None`,
/// `x` holds unspecified values. Elsewhere NaN elements give NaN.
///
/// On AVX2 + FMA this is one pass: the power takes 10 vector operations per 8 elements (11
/// when `m` is subtracted) and the check 2 integer ones, where [`exp2_shifted_sum`] takes
/// 14 after a separate [`row_max`] pass. For an integer `m` (`|m| <= 2^20`) the reduction
/// takes `x[j]` itself, so `x[j] - m` is never rounded; otherwise it takes `x[j] - m`
/// rounded to f32, as [`exp2_shifted_sum`] does (the row maximum then gives exactly 1).
/// Elsewhere it is the two passes.
pub(crate) fn exp2_shifted_sum_bounded(x: &mut [f32], m: f32, limit: f32) -> Option<f32> {
    // SAFETY: `isa()` is what this CPU has.
    unsafe { exp2_shifted_sum_bounded_on(isa(), x, m, limit) }
}

/// Exponents in the AVX2 one pass's window: [`exp2_shifted_sum_bounded`] refuses rows
/// with some `x[j] - m` rounding below `limit - ONE_PASS_SPAN`.
pub(crate) const ONE_PASS_SPAN: f32 = 127.0;

/// [`exp2_shifted_sum_bounded`] with the given instruction set.
///
/// # Safety
/// The CPU supports `isa`.
unsafe fn exp2_shifted_sum_bounded_on(isa: Isa, x: &mut [f32], m: f32, limit: f32) -> Option<f32> {
    if !(m.is_finite() && (2.0..=126.0).contains(&limit) && limit.fract() == 0.0) {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // An integer within the range (the conversion truncates) is folded into the
        // rounding constant.
        let folded = m.abs() <= FOLDED_REFERENCE && (m as i32) as f32 == m;
        // SAFETY: the CPU has AVX2 and FMA (the caller's contract); `limit` is an integer
        // in [2, 126]; `m` is an integer with |m| <= 2^20 when folded.
        let (sum, in_window) = unsafe {
            if folded {
                exp2_window_sum_avx2::<false>(x, m, limit as i32)
            } else {
                exp2_window_sum_avx2::<true>(x, m, limit as i32)
            }
        };
        return in_window.then_some(sum);
    }
    let max = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F (the caller's contract).
        Isa::Avx512 => unsafe { row_max_avx512(x) },
        _ => x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)),
    };
    if max > m + limit {
        return None;
    }
    // SAFETY: the caller's contract.
    Some(unsafe { exp2_shifted_sum_on(isa, x, m) })
}

/// Every instruction set this CPU runs (the one [`isa`] picks and the ones below it), so
/// the tests cover each version on any machine.
#[cfg(test)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
fn supported_isas() -> Vec<Isa> {
    let mut all = vec![Isa::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            all.push(Isa::Avx2);
        }
        if is_x86_feature_detected!("avx512f") {
            all.push(Isa::Avx512);
        }
    }
    all
}

/// [`exp2_shifted_sum`] with the given instruction set.
///
/// # Safety
/// The CPU supports `isa`.
unsafe fn exp2_shifted_sum_on(isa: Isa, x: &mut [f32], m: f32) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F (the caller's contract).
        Isa::Avx512 => unsafe { exp2_shifted_sum_avx512(x, m) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2 and FMA (the caller's contract).
        Isa::Avx2 => unsafe { exp2_shifted_sum_avx2(x, m) },
        Isa::Scalar => {
            let mut sum = 0.0;
            for v in x.iter_mut() {
                *v = exp2(*v - m);
                sum += *v;
            }
            sum
        }
    }
}

/// Whether this CPU runs one of the vector versions (AVX-512, or AVX2 + FMA); AVX is part of
/// both.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx() -> bool {
    isa() != Isa::Scalar
}

/// `dst[..n] = src[..n]`, `n` the shorter length (returned), with streaming (non-temporal)
/// stores where the CPU has AVX: the destination's cache lines are written without being
/// read first and do not evict the cache. Meant for large results written once and not read
/// again soon.
pub(crate) fn copy_streaming(dst: &mut [MaybeUninit<f32>], src: &[f32]) -> usize {
    let n = dst.len().min(src.len());
    #[cfg(target_arch = "x86_64")]
    {
        if avx() {
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
    while i < n && !(dst.add(i) as usize).is_multiple_of(32) {
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

/// `x += a y` (element-wise, `x.len() == y.len()`).
#[inline]
pub(crate) fn add_scaled(x: &mut [f32], y: &[f32], a: f32) {
    for (v, b) in x.iter_mut().zip(y) {
        *v += a * *b;
    }
}

/// `2^x`, 16 lanes: `2^n 2^r` with `n = round(x)`, `2^n` applied by
/// [`scalef`](_mm512_scalef_ps); lanes below -125 (and `-inf`) are 0, NaN lanes stay NaN.
///
/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn exp2_avx512(x: __m512) -> __m512 {
    // NaN compares false (ordered), so NaN lanes are kept and come out NaN.
    let flush = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP2_FLUSH));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    // r = x - n in [-0.5, 0.5], exact
    let r = _mm512_sub_ps(x, n);
    let y = pow2_fraction!(_mm512_fmadd_ps, _mm512_set1_ps, r);
    _mm512_maskz_mov_ps(!flush, _mm512_scalef_ps(y, n))
}

/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp2_shifted_sum_avx512(x: &mut [f32], m: f32) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let vm = _mm512_set1_ps(m);
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        let e0 = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), vm));
        let e1 = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(p.add(i + 16)), vm));
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
        let e = exp2_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, p.add(i)), vm));
        _mm512_mask_storeu_ps(p.add(i), mask, e);
        acc0 = _mm512_mask_add_ps(acc0, mask, acc0, e);
        i += 16;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
}

/// # Safety
/// The CPU has AVX-512F (this function's target features).
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

/// `2^x` for `x <= 0`, `-inf` or NaN (what the softmax feeds it: a score minus its row
/// maximum, in base-2 units), 8 lanes, as `2^n 2^r` with `n = round(x)`:
/// - the rounding is the [`MAGIC`] addition, whose low bits also hold `n`, so `2^n` is
///   applied with an integer shift and add to the exponent field (no multiply);
/// - one compare flushes inputs below -125 to exactly 0; NaN inputs come out NaN.
///
/// Five multiply-adds per vector (the two FMA pipes are what the attention products need
/// too). Within 4 ulp of `f32::exp2` (test `vector_exp2_matches_std_flushes_and_keeps_nan`).
///
/// # Safety
/// The CPU has AVX2 and FMA (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp2_nonpositive_avx2(x: __m256) -> __m256 {
    let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(EXP2_FLUSH));
    // t's mantissa holds `2^22 + n`, so its bits shifted left by 23 are `n << 23` (|n| <=
    // 125 for the lanes kept; the rest shifts out).
    let t = _mm256_add_ps(x, _mm256_set1_ps(MAGIC));
    let n = _mm256_sub_ps(t, _mm256_set1_ps(MAGIC));
    // r = x - n in [-0.5, 0.5], exact
    let r = _mm256_sub_ps(x, n);
    let y = pow2_fraction!(_mm256_fmadd_ps, _mm256_set1_ps, r);
    // y * 2^n: n added to the exponent field. For the lanes kept, y is in [0.7, 1.42] and
    // n >= -125, so the result is a normal f32.
    let e = _mm256_castsi256_ps(_mm256_add_epi32(
        _mm256_castps_si256(y),
        _mm256_slli_epi32::<23>(_mm256_castps_si256(t)),
    ));
    // Flushed lanes (and -inf, and NaN) are 0 after the mask; the max then gives NaN lanes
    // their NaN back (it returns its second operand when one is NaN) and leaves the others
    // (e >= 0 >= x).
    _mm256_max_ps(_mm256_and_ps(e, keep), x)
}

/// Lanes `0..n` set (all for `n >= 8`), for masked loads and stores.
///
/// # Safety
/// The CPU has AVX2 (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn first_lanes(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(n.min(8) as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// # Safety
/// The CPU has AVX2 and FMA (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp2_shifted_sum_avx2(x: &mut [f32], m: f32) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let vm = _mm256_set1_ps(m);
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        let e0 = exp2_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vm));
        let e1 = exp2_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(p.add(i + 8)), vm));
        _mm256_storeu_ps(p.add(i), e0);
        _mm256_storeu_ps(p.add(i + 8), e1);
        acc0 = _mm256_add_ps(acc0, e0);
        acc1 = _mm256_add_ps(acc1, e1);
        i += 16;
    }
    while i < n {
        // The last (up to 15) elements with masked loads and stores, so that every element
        // goes through the same vector code.
        let mask = first_lanes(n - i);
        let v = _mm256_maskload_ps(p.add(i), mask);
        let e = exp2_nonpositive_avx2(_mm256_sub_ps(v, vm));
        _mm256_maskstore_ps(p.add(i), mask, e);
        acc0 = _mm256_add_ps(acc0, _mm256_and_ps(e, _mm256_castsi256_ps(mask)));
        i += 8;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(acc0, acc1));
    lanes.iter().sum::<f32>()
}

/// `2^(x - m)` for `x` in `[m - 125, m + 126]` and an integer `m`, 8 lanes, given `c =
/// MAGIC + 127 - m` (exact: `m` is an integer and `|m| <= 2^20`; `m = 0` for inputs
/// already reduced):
/// - `t = x + c` rounds `x` to an integer `k` (`c` is one, and `t` lies in `[2^23, 2^24)`,
///   where f32 spacing is 1), so `t - c = k` and `r = x - k` in `[-0.5, 0.5]` are exact;
/// - `t`'s mantissa holds `2^22 + 127 + n` with `n = k - m` in `[-125, 126]`, so its bits
///   shifted left by 23 are those of `2^n`, a normal f32, and `2^r 2^n` is one exact
///   multiply (NaN lanes stay NaN through it).
///
/// Returns the power and `t`'s bits. No compare, mask or flush: lanes outside the range give
/// unspecified values, so callers check `t` ([`exp2_window_sum_avx2`]).
///
/// # Safety
/// The CPU has AVX2 and FMA (this function's target features).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp2_in_range_avx2(x: __m256, c: __m256) -> (__m256, __m256i) {
    let t = _mm256_add_ps(x, c);
    let r = _mm256_sub_ps(x, _mm256_sub_ps(t, c));
    let y = pow2_fraction!(_mm256_fmadd_ps, _mm256_set1_ps, r);
    let bits = _mm256_castps_si256(t);
    (
        _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(bits))),
        bits,
    )
}

/// `x[j] = 2^(x[j] - m)` with [`exp2_in_range_avx2`] in one pass; returns the sum of the new
/// values and whether every power is right: whether the reduced input of every element
/// rounds to an integer `n` within `[top - 127, top]` (never true for NaN or infinite
/// inputs; true for an empty row). The reduced input is `x[j] - m` rounded to f32 when
/// `SHIFT` (as [`exp2_shifted_sum`] computes it), else `x[j]` itself with `m` folded into
/// the rounding constant.
///
/// The check costs two integer operations per 8 elements: `t`'s bits are those of `MAGIC`
/// plus `127 + n`, so `n` is in the window when they exceed those of `MAGIC` plus `top` by
/// 0 to 127, and one OR collects, for the whole row, whether any lane has a bit from 7 up.
/// (A minimum and a maximum of the inputs, as FP operations, took ~30% longer on AMD Zen 3:
/// they compete with the polynomial for the same pipes.)
///
/// # Safety
/// The CPU has AVX2 and FMA; `2 <= top <= 126`; without `SHIFT`, `m` is an integer with
/// `|m| <= 2^20`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp2_window_sum_avx2<const SHIFT: bool>(x: &mut [f32], m: f32, top: i32) -> (f32, bool) {
    let n = x.len();
    let p = x.as_mut_ptr();
    let (c, vm) = if SHIFT {
        (_mm256_set1_ps(MAGIC + 127.0), _mm256_set1_ps(m))
    } else {
        (_mm256_set1_ps(MAGIC + 127.0 - m), _mm256_setzero_ps())
    };
    let reduce = |v: __m256| if SHIFT { _mm256_sub_ps(v, vm) } else { v };
    // MAGIC's bits plus `top` (MAGIC is 1.5 * 2^23: its bits are far from overflowing).
    let base = _mm256_set1_epi32(MAGIC.to_bits() as i32 + top);
    let mut sum0 = _mm256_setzero_ps();
    let mut sum1 = _mm256_setzero_ps();
    let mut out0 = _mm256_setzero_si256();
    let mut out1 = _mm256_setzero_si256();
    let mut i = 0;
    while i + 16 <= n {
        let (e0, t0) = exp2_in_range_avx2(reduce(_mm256_loadu_ps(p.add(i))), c);
        let (e1, t1) = exp2_in_range_avx2(reduce(_mm256_loadu_ps(p.add(i + 8))), c);
        _mm256_storeu_ps(p.add(i), e0);
        _mm256_storeu_ps(p.add(i + 8), e1);
        sum0 = _mm256_add_ps(sum0, e0);
        sum1 = _mm256_add_ps(sum1, e1);
        out0 = _mm256_or_si256(out0, _mm256_sub_epi32(t0, base));
        out1 = _mm256_or_si256(out1, _mm256_sub_epi32(t1, base));
        i += 16;
    }
    while i < n {
        // The last (up to 15) elements with masked loads and stores; the lanes past the
        // row count neither in the sum nor in the check.
        let mask = first_lanes(n - i);
        let (e, t) = exp2_in_range_avx2(reduce(_mm256_maskload_ps(p.add(i), mask)), c);
        _mm256_maskstore_ps(p.add(i), mask, e);
        sum0 = _mm256_add_ps(sum0, _mm256_and_ps(e, _mm256_castsi256_ps(mask)));
        out0 = _mm256_or_si256(out0, _mm256_and_si256(_mm256_sub_epi32(t, base), mask));
        i += 8;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(sum0, sum1));
    let sum = lanes.iter().sum::<f32>();
    let mut bits = [0i32; 8];
    _mm256_storeu_si256(bits.as_mut_ptr().cast(), _mm256_or_si256(out0, out1));
    let outside = bits.iter().fold(0, |a, &b| a | b) & !127;
    (sum, outside == 0)
}

/// # Safety
/// The CPU has AVX2 and FMA (this function's target features).
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

    /// `got` within 4 ulp of `2^x` computed in f64, and a normal f32.
    fn assert_exp2_close(x: f32, got: f32) {
        let want = (x as f64).exp2();
        assert!(
            (got as f64 - want).abs() <= 4.0 * f32::EPSILON as f64 * want
                && got >= f32::MIN_POSITIVE,
            "2^{x} = {got}, f64 {want}"
        );
    }

    #[test]
    fn exp2_matches_f64_within_a_few_ulp() {
        let mut x: Vec<f32> = (-12_500..=12_700).map(|i| i as f32 * 0.01).collect();
        x.extend([-124.99f32, -50.5, -0.5, 0.5, -1e-7, 0.0, 127.9]);
        for &v in &x {
            assert_exp2_close(v, exp2(v));
        }
        assert_eq!(exp2(0.0), 1.0);
        assert_eq!(exp2(-3.0), 0.125);
        assert_eq!(exp2(-125.01), 0.0);
        assert_eq!(exp2(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2(-1e4), 0.0);
        assert_eq!(exp2(128.0), f32::INFINITY);
        assert_eq!(exp2(f32::INFINITY), f32::INFINITY);
        assert!(exp2(f32::NAN).is_nan());
    }

    #[test]
    fn vector_exp2_matches_std_flushes_and_keeps_nan() {
        // Shifted scores x - m over the whole range the softmax sees, past the flush point,
        // with -inf (masked) and NaN lanes at positions of both vector halves and the tail.
        let mut x: Vec<f32> = (0..=13_000).map(|i| -(i as f32) * 0.01).collect();
        x.extend([-124.99, -125.0, -125.01, -200.0, -1e-7, f32::NEG_INFINITY]);
        x[3] = f32::NAN;
        x[12] = f32::NEG_INFINITY;
        let n = x.len();
        x[n - 2] = f32::NAN;
        // NaNs with payload bits low in the mantissa (they must not leak into the exponent).
        x[20] = f32::from_bits(0x7FC0_01FF);
        x[n - 20] = f32::from_bits(0xFFC0_0101);
        for isa in supported_isas() {
            let mut e = x.clone();
            // SAFETY: the CPU supports every ISA `supported_isas` lists.
            let sum = unsafe { exp2_shifted_sum_on(isa, &mut e, 0.0) };
            assert!(sum.is_nan(), "{isa:?}");
            for (&v, &got) in x.iter().zip(&e) {
                if v.is_nan() {
                    assert!(got.is_nan(), "{isa:?}: 2^NaN = {got}");
                } else if v < EXP2_FLUSH {
                    assert_eq!(got, 0.0, "{isa:?}: 2^{v} must flush to 0");
                } else {
                    assert_exp2_close(v, got);
                }
            }
            // Every length, so that each tail (masked lanes) is covered: the sum counts
            // only the row's own elements and nothing past the row is written.
            for len in 0..40 {
                let mut buf: Vec<f32> = (0..48).map(|i| -(i as f32) * 0.25).collect();
                let want: Vec<f32> = buf[..len].iter().map(|&v| exp2(v)).collect();
                // SAFETY: as above.
                let sum = unsafe { exp2_shifted_sum_on(isa, &mut buf[..len], 0.0) };
                for (j, (&g, &w)) in buf[..len].iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 2.0 * f32::EPSILON * w,
                        "{isa:?}: len {len}, at {j}"
                    );
                }
                let want_sum: f32 = want.iter().sum();
                assert!(
                    (sum - want_sum).abs() <= 1e-6 * want_sum.max(1.0),
                    "{isa:?}: len {len}"
                );
                for (j, &v) in buf.iter().enumerate().skip(len) {
                    assert_eq!(
                        v,
                        -(j as f32) * 0.25,
                        "{isa:?}: len {len}: wrote past the row at {j}"
                    );
                }
            }
        }
    }

    /// Whether `isa` has the one-pass version of [`exp2_shifted_sum_bounded`].
    fn one_pass(isa: Isa) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            isa == Isa::Avx2
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = isa;
            false
        }
    }

    #[test]
    fn bounded_exp2_matches_the_power_and_refuses_what_it_cannot_do_exactly() {
        // The one-pass AVX2 version reduces `x` itself when the reference is an integer it
        // folds (no rounding); otherwise, and on the other CPUs, `x - m` rounded to f32, as
        // `exp2_shifted_sum` does.
        let reduced = |isa: Isa, x: f32, m: f32| {
            if one_pass(isa) && m.fract() == 0.0 && m.abs() <= FOLDED_REFERENCE {
                x as f64 - m as f64
            } else {
                (x - m) as f64
            }
        };
        let close = |isa: Isa, x: f32, m: f32, got: f32| {
            let want = reduced(isa, x, m).exp2();
            assert!(
                (got as f64 - want).abs() <= 4.0 * f32::EPSILON as f64 * want,
                "{isa:?}: 2^({x} - {m}) = {got}, f64 {want}"
            );
        };
        for isa in supported_isas() {
            let run = |x: &mut [f32], m: f32, limit: f32| {
                // SAFETY: the CPU supports every ISA `supported_isas` lists.
                unsafe { exp2_shifted_sum_bounded_on(isa, x, m, limit) }
            };
            // Integer references (folded up to 2^20) and others.
            let refs = [
                -300.0f32,
                -3.0,
                0.0,
                7.0,
                1000.0,
                1_048_576.0,
                0.37,
                -5.5,
                3_000_000.5,
                1e7,
            ];
            for m in refs {
                // From the one pass's floor up to the headroom, at steps that are not
                // fractions of a power of two (every rounding case of the reduction).
                let x: Vec<f32> = (0..1000)
                    .map(|i| m + 8.0 - ONE_PASS_SPAN + i as f32 * 0.133)
                    .filter(|&v| v <= m + 8.0)
                    .collect();
                let mut e = x.clone();
                let sum = run(&mut e, m, 8.0).unwrap_or_else(|| panic!("{isa:?}: m {m}"));
                for (&v, &got) in x.iter().zip(&e) {
                    close(isa, v, m, got);
                }
                let want: f64 = x.iter().map(|&v| reduced(isa, v, m).exp2()).sum();
                assert!(
                    (sum as f64 - want).abs() <= 1e-6 * want,
                    "{isa:?}: sum {sum} vs {want}"
                );
                // Past the headroom (rounded): refused.
                for past in [9.0, 16.0, 1e6] {
                    let mut above = x.clone();
                    above[17] = m + past;
                    assert_eq!(run(&mut above, m, 8.0), None, "{isa:?}: m {m} + {past}");
                }
            }
            // Between the flush point and the floor of a one pass with headroom 8: the AVX2
            // pass refuses the row with that headroom and takes it with headroom 2; below
            // the flush point it refuses it whatever the headroom. The others flush.
            let mut low: Vec<f32> = (0..37).map(|i| -(i as f32) * 0.5).collect();
            low[30] = -122.0;
            let mut e = low.clone();
            assert_eq!(run(&mut e, 0.0, 8.0).is_none(), one_pass(isa), "{isa:?}");
            let mut e = low.clone();
            let sum = run(&mut e, 0.0, 2.0).unwrap_or_else(|| panic!("{isa:?}"));
            close(isa, -122.0, 0.0, e[30]);
            let want: f32 = low.iter().map(|&v| exp2(v)).sum();
            assert!((sum - want).abs() <= 1e-6 * want, "{isa:?}");
            low[30] = -400.0;
            let mut e = low.clone();
            match run(&mut e, 0.0, 2.0) {
                None => assert!(one_pass(isa), "{isa:?}"),
                Some(sum) => {
                    assert_eq!(e[30], 0.0, "{isa:?}");
                    let want: f32 = low.iter().map(|&v| exp2(v)).sum();
                    assert!((sum - want).abs() <= 1e-6 * want, "{isa:?}");
                }
            }
            // NaN elements: the AVX2 pass refuses the row; the others give NaN for them and
            // for the sum, and the right powers for the rest. Infinite ones: refused, except
            // `-inf` by the versions that flush (a power of 0).
            let mut nan: Vec<f32> = (0..37).map(|i| -(i as f32) * 0.5).collect();
            nan[5] = f32::NAN;
            nan[33] = f32::from_bits(0x7FC0_01FF);
            let mut e = nan.clone();
            match run(&mut e, 0.0, 2.0) {
                None => assert!(one_pass(isa), "{isa:?}"),
                Some(sum) => {
                    assert!(sum.is_nan() && e[5].is_nan() && e[33].is_nan(), "{isa:?}");
                    for (j, (&v, &got)) in nan.iter().zip(&e).enumerate() {
                        if j != 5 && j != 33 {
                            close(isa, v, 0.0, got);
                        }
                    }
                }
            }
            for (inf, refused) in [(f32::INFINITY, true), (f32::NEG_INFINITY, one_pass(isa))] {
                let mut e: Vec<f32> = (0..20).map(|i| -(i as f32)).collect();
                e[11] = inf;
                let got = run(&mut e, 0.0, 2.0);
                assert_eq!(got.is_none(), refused, "{isa:?}: {inf}");
                if got.is_some() {
                    assert_eq!(e[11], 0.0, "{isa:?}");
                }
            }
            // A reference or headroom it cannot take leaves the row as it was.
            for (m, limit) in [
                (f32::NAN, 2.0),
                (f32::INFINITY, 2.0),
                (0.0, 127.0),
                (0.0, 1.0),
                (0.0, 2.5),
                (0.0, -1.0),
            ] {
                let mut e = low.clone();
                assert_eq!(run(&mut e, m, limit), None, "{isa:?}: {m} {limit}");
                assert_eq!(e, low);
            }
            // Every length: nothing written past the row, the sum counts only the row (the
            // lanes past it are outside the window for m = 200: they must not count there
            // either).
            for m in [0.0f32, 200.0] {
                for len in 0..40 {
                    let mut buf: Vec<f32> = (0..48).map(|i| m - (i as f32) * 0.25).collect();
                    let sum = run(&mut buf[..len], m, 2.0).unwrap_or_else(|| panic!("{m} {len}"));
                    let mut want = 0.0;
                    for (j, &g) in buf[..len].iter().enumerate() {
                        close(isa, m - (j as f32) * 0.25, m, g);
                        want += g;
                    }
                    assert!(
                        (sum - want).abs() <= 1e-6 * want.max(1.0),
                        "{isa:?}: len {len}"
                    );
                    for (j, &v) in buf.iter().enumerate().skip(len) {
                        assert_eq!(v, m - (j as f32) * 0.25, "{isa:?}: len {len}: past the row");
                    }
                }
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
            let sum = exp2_shifted_sum(&mut s, m);
            let mut ref_sum = 0f32;
            for (j, &x) in v.iter().enumerate() {
                let r = exp2(x - m);
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
