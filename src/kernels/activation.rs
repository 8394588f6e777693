//! Activations, vectorised: the exact (erf) GELU, `gelu(x) = x/2 erfc(-x/sqrt 2)`, and
//! SwiGLU's gate, `silu(g) u = g / (1 + e^-g) u`.
//!
//! `erfc(z)` for `z >= 0` is Numerical Recipes' Chebyshev fit `t exp(-z^2 + P(t))`,
//! `t = 1 / (1 + z/2)`, whose relative error is below 1.2e-7 everywhere; for `z < 0`,
//! `erfc(z) = 2 - erfc(-z)`. Working with `erfc` instead of `1 + erf` keeps the negative
//! tail accurate to a few ulp where `1 + erf(x)` cancels (libm's `erff` there loses digits:
//! see the test). The code is branch-free, so the compiler vectorises it in the AVX-512 and
//! AVX2 + FMA builds picked at run time.

use std::mem::MaybeUninit;

use crate::kernels::simd::{self, isa, Isa};

/// The coefficients of `P(t)` (Numerical Recipes, `erfcc`), constant term first.
// The published 8-digit values, rounded to f32 by the compiler.
#[allow(clippy::excessive_precision)]
const ERFC: [f32; 10] = [
    -1.265_512_23,
    1.000_023_68,
    0.374_091_96,
    0.096_784_18,
    -0.186_288_06,
    0.278_868_07,
    -1.135_203_98,
    1.488_515_87,
    -0.822_152_23,
    0.170_872_77,
];

/// `erf(z) = z S(z^2)` near 0: the Maclaurin series, `2/sqrt(pi) (-1)^n / (n! (2n + 1))`,
/// constant term first; below [`SERIES_MAX`] the terms left out are under 1e-9 of the sum.
#[allow(clippy::excessive_precision)]
const ERF_SERIES: [f32; 9] = [
    std::f32::consts::FRAC_2_SQRT_PI,
    -0.376_126_389_031_837_54,
    0.112_837_916_709_551_26,
    -0.026_866_170_645_131_252,
    0.005_223_977_625_442_188,
    -0.000_854_832_702_345_085_3,
    0.000_120_553_329_817_896_64,
    -1.492_565_035_840_625_1e-5,
    1.646_211_436_588_924_6e-6,
];
/// `|z|` below which the series gives `erf` (the fit's 1.2e-7 would dominate near 0).
const SERIES_MAX: f32 = 0.6;

/// `2^r` on `[-0.5, 0.5]`: the softmax's degree-5 fit (about 1.5 ulp), constant term first.
const POW2: [f32; 6] = [1.0, simd::Q1, simd::Q2, simd::Q3, simd::Q4, simd::Q5];

/// `ln 2` in two parts: `LN2_HI` has few enough bits that `n LN2_HI` is exact for the
/// integers `n` used here (Cody and Waite's reduction).
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;

/// `exp(p - hi - lo)` for `p - hi - lo <= 0`, where `hi + lo` is exactly `x^2 / 2` and `p`
/// is small: the reduction `n ln 2` is taken off `hi` exactly, so the large term adds no
/// rounding; `2^r` by the f32 fit. 0 where the result would not be a normal f32.
#[inline(always)]
fn exp_split(p: f32, hi: f32, lo: f32) -> f32 {
    let x = ((p - hi) * std::f32::consts::LOG2_E).max(-126.0);
    let shifted = x + simd::MAGIC;
    let n = shifted - simd::MAGIC;
    // -hi - n LN2_HI is exact before its one rounding (|result| < 2); the rest is small.
    let r = n.mul_add(-LN2_HI, -hi) + (p - lo) - n * LN2_LO;
    let r = r * std::f32::consts::LOG2_E;
    let mut q = POW2[5];
    for c in POW2[..5].iter().rev() {
        q = q.mul_add(r, *c);
    }
    // n is an integer in [-126, 0], held in the low bits of `shifted` (2^22 + n): 2^n is
    // its exponent bits (read without a float-to-int conversion, which does not vectorise).
    let n_bits = (shifted.to_bits() & 0x7f_ffff)
        .wrapping_sub(1 << 22)
        .wrapping_add(127);
    let scale = f32::from_bits(n_bits << 23);
    if x > -126.0 {
        q * scale
    } else {
        0.0
    }
}

/// `gelu(x) = x/2 erfc(-x / sqrt 2)`, branch-free: `1 + erf` from the series near 0,
/// `erfc` from the fit elsewhere.
#[inline(always)]
pub(crate) fn gelu_erf(x: f32) -> f32 {
    let zs = x * std::f32::consts::FRAC_1_SQRT_2;
    let z2 = zs * zs;
    let mut s = ERF_SERIES[8];
    for c in ERF_SERIES[..8].iter().rev() {
        s = s.mul_add(z2, *c);
    }
    let near = 1.0 + zs * s;
    let z = zs.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut p = ERFC[9];
    for c in ERFC[..9].iter().rev() {
        p = p.mul_add(t, *c);
    }
    // x^2 / 2 as hi + lo exactly (0.5 x is exact, the FMA gives the product's rounding).
    let half = 0.5 * x;
    let hi = half * x;
    let lo = half.mul_add(x, -hi);
    let tail = t * exp_split(p, hi, lo); // erfc(|x| / sqrt 2)
    let far = if x >= 0.0 { 2.0 - tail } else { tail };
    let erfc = if z < SERIES_MAX { near } else { far };
    // NaN stays NaN (every step above propagates it except the select, which keeps it).
    0.5 * x * erfc
}

/// `x[i] = gelu(x[i])` for every element, with the widest vectors the CPU has.
pub(crate) fn gelu_erf_in_place(x: &mut [f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F (checked by `isa`).
        Isa::Avx512 => unsafe { gelu_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2 and FMA (checked by `isa`).
        Isa::Avx2 => unsafe { gelu_avx2(x) },
        Isa::Scalar => x.iter_mut().for_each(|v| *v = gelu_erf(*v)),
    }
}

/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu_avx512(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = gelu_erf(*v));
}

/// # Safety
/// The CPU has AVX2 and FMA (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_avx2(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = gelu_erf(*v));
}

/// `e^r = 1 + r + r^2 P(r)` on `|r| <= ln 2 / 2`: Cephes' `expf` fit, highest power first.
#[allow(clippy::excessive_precision)]
const EXP_FIT: [f32; 6] = [
    1.987_569_150_0e-4,
    1.398_199_950_7e-3,
    8.333_451_907_3e-3,
    4.166_579_589_4e-2,
    1.666_666_545_9e-1,
    5.000_000_120_1e-1,
];
/// Cephes' two-part `ln 2` for that fit: `n EXP_LN2_HI` is exact for `|n| <= 2^15`.
const EXP_LN2_HI: f32 = 355.0 / 512.0;
#[allow(clippy::excessive_precision)]
const EXP_LN2_LO: f32 = -2.121_944_40e-4;

/// Largest `x` whose `e^x` is a finite f32 (`ln` of the largest f32, rounded down).
const EXP_MAX: f32 = 88.722_83;
/// `x` below which [`exp_for_silu`] computes `e^-87` instead: `1 + e^x` is 1 there either
/// way (`e^-87` is 1.6e-38), so the SiLU is unchanged, and `2^n` stays a normal f32.
const EXP_FLOOR: f32 = -87.0;

/// `e^x` as [`silu`] needs it: `x = n ln 2 + r` (Cody and Waite's two-part `ln 2`, `|r| <=
/// ln 2 / 2`), `e^r` by Cephes' fit ([`EXP_FIT`]), times `2^n` in two exact steps (`n`
/// reaches 128, past an f32's exponents); `+inf` above [`EXP_MAX`], `e^-87` below
/// [`EXP_FLOOR`], NaN for NaN. Branch-free, so it vectorises. (The GELU's `2^t` fit in
/// place of Cephes' gave the SiLU 3.07 ulp at worst, past libm's 2.31.)
#[inline(always)]
fn exp_for_silu(x: f32) -> f32 {
    let xc = x.clamp(EXP_FLOOR, EXP_MAX);
    let shifted = xc.mul_add(std::f32::consts::LOG2_E, simd::MAGIC);
    let n = shifted - simd::MAGIC;
    let r = n.mul_add(-EXP_LN2_HI, xc);
    let r = n.mul_add(-EXP_LN2_LO, r);
    let mut p = EXP_FIT[0];
    for c in &EXP_FIT[1..] {
        p = p.mul_add(r, *c);
    }
    let q = p.mul_add(r * r, r) + 1.0;
    // n, an integer in [-126, 128], is in the low bits of `shifted` (2^22 + n); 2^n is
    // applied as 2^(n >> 1) 2^(n - (n >> 1)), both normal, each product exact or rounded once.
    let n = (shifted.to_bits() & 0x7f_ffff) as i32 - (1 << 22);
    let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    let e = q * pow2(n >> 1) * pow2(n - (n >> 1));
    if x > EXP_MAX {
        f32::INFINITY
    } else {
        e
    }
}

/// `silu(g) = g / (1 + e^-g)`, PyTorch's and candle's expression, with the vectorised
/// [`exp_for_silu`] in place of libm's `expf` (within ~2 ulp of each other; the same bits
/// on every instruction set, the fused multiply-adds being fused everywhere).
#[inline(always)]
pub(crate) fn silu(g: f32) -> f32 {
    g / (1.0 + exp_for_silu(-g))
}

/// `g[j] = silu(g[j]) u[j]` for every `j` (SwiGLU's gate), with the widest vectors the CPU
/// has; `g` and `u` of one length.
pub(crate) fn silu_times_in_place(g: &mut [f32], u: &[f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F (checked by `isa`).
        Isa::Avx512 => unsafe { silu_in_place_avx512(g, u) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2 and FMA (checked by `isa`).
        Isa::Avx2 => unsafe { silu_in_place_avx2(g, u) },
        _ => silu_in_place_lanes(g, u),
    }
}

/// `y[j] = silu(g[j]) u[j]` for every `j`, written into all of `y`, with the widest vectors
/// the CPU has; false, writing nothing, unless `g`, `u` and `y` are of one length.
pub(crate) fn silu_times_into(g: &[f32], u: &[f32], y: &mut [MaybeUninit<f32>]) -> bool {
    if g.len() != y.len() || u.len() != y.len() {
        return false;
    }
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F (checked by `isa`).
        Isa::Avx512 => unsafe { silu_into_avx512(g, u, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2 and FMA (checked by `isa`).
        Isa::Avx2 => unsafe { silu_into_avx2(g, u, y) },
        _ => silu_into_lanes(g, u, y),
    }
    true
}

#[inline(always)]
fn silu_in_place_lanes(g: &mut [f32], u: &[f32]) {
    for (gv, &uv) in g.iter_mut().zip(u) {
        *gv = silu(*gv) * uv;
    }
}

#[inline(always)]
fn silu_into_lanes(g: &[f32], u: &[f32], y: &mut [MaybeUninit<f32>]) {
    for ((yv, &gv), &uv) in y.iter_mut().zip(g).zip(u) {
        yv.write(silu(gv) * uv);
    }
}

/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_in_place_avx512(g: &mut [f32], u: &[f32]) {
    silu_in_place_lanes(g, u);
}

/// # Safety
/// The CPU has AVX2 and FMA (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_in_place_avx2(g: &mut [f32], u: &[f32]) {
    silu_in_place_lanes(g, u);
}

/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_into_avx512(g: &[f32], u: &[f32], y: &mut [MaybeUninit<f32>]) {
    silu_into_lanes(g, u, y);
}

/// # Safety
/// The CPU has AVX2 and FMA (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_into_avx2(g: &[f32], u: &[f32], y: &mut [MaybeUninit<f32>]) {
    silu_into_lanes(g, u, y);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x/2 erfc(-x/sqrt 2)` in f64 (libm's erfc: no cancellation in either tail).
    fn reference(x: f32) -> f64 {
        let x = x as f64;
        0.5 * x * libm::erfc(-x / std::f64::consts::SQRT_2)
    }

    /// Relative error against the f64 reference (absolute below 1e-30).
    fn error(got: f32, x: f32) -> f64 {
        let want = reference(x);
        (got as f64 - want).abs() / want.abs().max(1e-30)
    }

    /// `g / (1 + e^-g)` in f64.
    fn silu_reference(g: f32) -> f64 {
        let g = g as f64;
        g / (1.0 + (-g).exp())
    }

    /// Within 2.5 ulp of the f64 SiLU from -87 up (measured 2.25; libm's `expf` in the same
    /// expression: 2.31), the same bits from the vector kernels as from the scalar
    /// expression, and candle's values at the ends (0 and -0 where `e^-g` is huge, `g`
    /// itself where it vanishes, NaN for NaN and for -inf, inf for inf).
    #[test]
    fn silu_within_a_few_ulp_and_the_same_on_every_path() {
        let mut grid: Vec<f32> = (-110_000..=110_000).map(|i| i as f32 / 1000.0).collect();
        grid.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            EXP_MAX,
            -EXP_MAX,
            -88.73,
            -88.72,
            -87.0,
            87.0,
            103.0,
            -103.0,
            f32::MAX,
            f32::MIN,
        ]);
        let ones = vec![1f32; grid.len()];
        let mut in_place = grid.clone();
        silu_times_in_place(&mut in_place, &ones);
        let mut into = vec![MaybeUninit::new(f32::NAN); grid.len()];
        assert!(silu_times_into(&grid, &ones, &mut into));
        assert!(!silu_times_into(&grid[1..], &ones, &mut into));
        let ulp = |x: f32| (f32::from_bits(x.abs().to_bits() + 1) - x.abs()) as f64;
        let (mut worst, mut worst_libm) = (0f64, 0f64);
        for ((&g, &a), b) in grid.iter().zip(&in_place).zip(&into) {
            // SAFETY: `silu_times_into` wrote every element.
            let b = unsafe { b.assume_init() };
            assert_eq!(a.to_bits(), silu(g).to_bits(), "in place vs scalar at {g}");
            assert_eq!(b.to_bits(), silu(g).to_bits(), "into vs scalar at {g}");
            let want = silu_reference(g);
            // Below -87 the result is near or under the smallest normal f32 (under -EXP_MAX
            // `e^-g` is past the largest: -0, as libm's `expf` gives).
            if g < -EXP_MAX {
                assert_eq!(a.to_bits(), (-0f32).to_bits(), "silu({g})");
            } else if g >= -87.0 && (want as f32).is_normal() {
                let e = (a as f64 - want).abs() / ulp(want as f32);
                worst = worst.max(e);
                let libm = g / (1.0 + (-g).exp());
                worst_libm = worst_libm.max((libm as f64 - want).abs() / ulp(want as f32));
                assert!(e <= 2.5, "silu({g}) = {a}, want {want} ({e} ulp)");
            }
        }
        eprintln!("silu: worst {worst:.2} ulp (libm expf: {worst_libm:.2})");
        let at = |g: f32| silu(g);
        assert_eq!(at(0.0).to_bits(), 0f32.to_bits());
        assert_eq!(at(-0.0).to_bits(), (-0f32).to_bits());
        assert_eq!(at(-100.0).to_bits(), (-0f32).to_bits());
        assert_eq!(at(100.0), 100.0);
        assert_eq!(at(f32::INFINITY), f32::INFINITY);
        assert!(at(f32::NEG_INFINITY).is_nan());
        assert!(at(f32::NAN).is_nan());
        // Products with `u` as the expression's: silu first, then times `u`.
        let (g, u) = ([1.5f32, -2.25, 7.0], [0.3f32, -1.7, 1e-3]);
        let mut y = g;
        silu_times_in_place(&mut y, &u);
        for j in 0..3 {
            assert_eq!(y[j].to_bits(), (silu(g[j]) * u[j]).to_bits());
        }
    }

    #[test]
    fn as_accurate_as_libm_and_better_in_the_negative_tail() {
        let grid: Vec<f32> = (-12_000..=12_000).map(|i| i as f32 / 1000.0).collect();
        let mut ours = grid.clone();
        gelu_erf_in_place(&mut ours);
        // candle's `gelu_erf`: 0.5 x (1 + erf(x / sqrt 2)) with libm's erff.
        let libm_gelu = |x: f32| 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
        let (mut worst_ours, mut worst_libm) = (0f64, 0f64);
        for (&x, &g) in grid.iter().zip(&ours) {
            assert_eq!(
                g.to_bits(),
                gelu_erf(x).to_bits(),
                "vector vs scalar at {x}"
            );
            let e = error(g, x);
            assert!(e < 5e-7, "x = {x}: {g} vs {} ({e:e})", reference(x));
            if x > -3.0 {
                worst_ours = worst_ours.max(error(g, x));
                worst_libm = worst_libm.max(error(libm_gelu(x), x));
            }
        }
        eprintln!(
            "max relative error on [-3, 12]: ours {worst_ours:e}, libm's erff {worst_libm:e}"
        );
        assert!(
            worst_ours <= worst_libm,
            "ours {worst_ours:e}, libm {worst_libm:e}"
        );
        let mut special = [
            0.0f32,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -200.0,
        ];
        gelu_erf_in_place(&mut special);
        assert_eq!(special[0], 0.0);
        assert!(special[2].is_nan());
        assert_eq!(special[3], f32::INFINITY);
        assert_eq!(special[5], 0.0);
    }
}
