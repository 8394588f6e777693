//! The matrix-vector kernels' inner loops for f16 weights, on the hardware conversion
//! (`vcvtph2ps`: AVX-512F, or F16C with AVX2 + FMA): widening f16 in scalar code does not
//! vectorise, so the generic loops of [`crate::kernels::decode::gemv`] would run at a fraction of the
//! memory bandwidth.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2F16c,
    None,
}

/// The kernels this CPU runs, under the crate's cap (`CANDLE_ATTENTION_ISA`,
/// [`crate::kernels::simd::isa`]).
fn isa() -> Isa {
    use std::sync::OnceLock;
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use crate::kernels::simd::{isa, Isa as Cpu};
            match isa() {
                Cpu::Avx512 => return Isa::Avx512,
                Cpu::Avx2 if crate::kernels::simd::avx2_fma_f16c() => return Isa::Avx2F16c,
                _ => {}
            }
        }
        Isa::None
    })
}

/// Whether this CPU runs these kernels.
pub(crate) fn available() -> bool {
    isa() != Isa::None
}

/// `sum a[i] b[i]`; `None` without the hardware conversion.
pub(crate) fn dot(a: &[f16], b: &[f32]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    let n = a.len().min(b.len());
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (a, b);
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F (checked by `isa`); both slices hold `n` values.
        Isa::Avx512 => Some(unsafe { dot_avx512(&a[..n], &b[..n]) }),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2, F16C and FMA (checked by `isa`); both hold `n` values.
        Isa::Avx2F16c => Some(unsafe { dot_avx2(&a[..n], &b[..n]) }),
        Isa::None => None,
    }
}

/// `ys[j] += sum_k x[k] w[k * out + j0 + j]` (a block of columns of `x W`, `W` `(in, out)`);
/// false without the hardware conversion (nothing done).
pub(crate) fn add_columns(w: &[f16], x: &[f32], out: usize, j0: usize, ys: &mut [f32]) -> bool {
    let n = ys.len();
    if x.is_empty() || (x.len() - 1) * out + j0 + n > w.len() {
        return false;
    }
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            for (k, &xk) in x.iter().enumerate() {
                let row = &w[k * out + j0..k * out + j0 + n];
                // SAFETY: the CPU has AVX-512F (checked by `isa`); `row` and `ys` hold `n`.
                unsafe { axpy_avx512(xk, row, ys) };
            }
            true
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2F16c => {
            for (k, &xk) in x.iter().enumerate() {
                let row = &w[k * out + j0..k * out + j0 + n];
                // SAFETY: the CPU has AVX2, F16C and FMA (checked by `isa`); both hold `n`.
                unsafe { axpy_avx2(xk, row, ys) };
            }
            true
        }
        Isa::None => false,
    }
}

/// # Safety
/// AVX-512F; `a` and `b` of the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(a: &[f16], b: &[f32]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr() as *const u16, b.as_ptr());
    // Two chains hide the FMA latency.
    let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i + 32 <= n {
        let w0 = _mm512_cvtph_ps(_mm256_loadu_si256(pa.add(i) as *const __m256i));
        let w1 = _mm512_cvtph_ps(_mm256_loadu_si256(pa.add(i + 16) as *const __m256i));
        s0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(pb.add(i)), s0);
        s1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(pb.add(i + 16)), s1);
        i += 32;
    }
    let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    for j in i..n {
        sum += a[j].to_f32() * b[j];
    }
    sum
}

/// # Safety
/// AVX2, F16C and FMA; `a` and `b` of the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn dot_avx2(a: &[f16], b: &[f32]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr() as *const u16, b.as_ptr());
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        let w0 = _mm256_cvtph_ps(_mm_loadu_si128(pa.add(i) as *const __m128i));
        let w1 = _mm256_cvtph_ps(_mm_loadu_si128(pa.add(i + 8) as *const __m128i));
        s0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(pb.add(i)), s0);
        s1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(pb.add(i + 8)), s1);
        i += 16;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(s0, s1));
    let mut sum: f32 = lanes.iter().sum();
    for j in i..n {
        sum += a[j].to_f32() * b[j];
    }
    sum
}

/// `y += a w`.
///
/// # Safety
/// AVX-512F; `w` and `y` of the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_avx512(a: f32, w: &[f16], y: &mut [f32]) {
    let n = w.len();
    let (pw, py) = (w.as_ptr() as *const u16, y.as_mut_ptr());
    let av = _mm512_set1_ps(a);
    let mut i = 0;
    while i + 16 <= n {
        let wv = _mm512_cvtph_ps(_mm256_loadu_si256(pw.add(i) as *const __m256i));
        _mm512_storeu_ps(
            py.add(i),
            _mm512_fmadd_ps(av, wv, _mm512_loadu_ps(py.add(i))),
        );
        i += 16;
    }
    for j in i..n {
        y[j] += a * w[j].to_f32();
    }
}

/// `y += a w`.
///
/// # Safety
/// AVX2, F16C and FMA; `w` and `y` of the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn axpy_avx2(a: f32, w: &[f16], y: &mut [f32]) {
    let n = w.len();
    let (pw, py) = (w.as_ptr() as *const u16, y.as_mut_ptr());
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        let wv = _mm256_cvtph_ps(_mm_loadu_si128(pw.add(i) as *const __m128i));
        _mm256_storeu_ps(
            py.add(i),
            _mm256_fmadd_ps(av, wv, _mm256_loadu_ps(py.add(i))),
        );
        i += 8;
    }
    for j in i..n {
        y[j] += a * w[j].to_f32();
    }
}

#[cfg(test)]
mod tests {
    /// The f16 loops follow the crate's instruction-set cap (CI runs the unit tests under
    /// `CANDLE_ATTENTION_ISA=avx2` and `scalar`).
    #[test]
    fn kernels_follow_the_isa_cap() {
        #[cfg(target_arch = "x86_64")]
        let want = {
            use crate::kernels::simd::{isa, Isa as Cpu};
            match isa() {
                Cpu::Avx512 => super::Isa::Avx512,
                Cpu::Avx2 if is_x86_feature_detected!("f16c") => super::Isa::Avx2F16c,
                _ => super::Isa::None,
            }
        };
        #[cfg(not(target_arch = "x86_64"))]
        let want = super::Isa::None;
        assert_eq!(super::isa(), want);
    }
}
