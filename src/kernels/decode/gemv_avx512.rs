//! The matrix-vector kernels' AVX-512 loops for f32, bf16 and f16 weights (f32 sums):
//! `W x` four weight rows per pass with one FMA chain each, and `x W` four rows at a time
//! added into a partial sum. The compiler-vectorised loops of [`crate::kernels::decode::gemv`] ran a
//! single dependent add chain per row with a serial horizontal sum, which held bf16 reads to
//! ~14 GB/s on two cores (see docs/performance-archive.md).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::kernels::widen::Load16;

#[cfg(target_arch = "x86_64")]
use crate::kernels::simd::{isa, Isa};

/// How far ahead of the rows being summed [`dot_rows`] asks for the next ones (one pass of
/// four rows; 8 and 16 measured no faster).
#[cfg(target_arch = "x86_64")]
const AHEAD_ROWS: usize = 4;
/// Rows summed side by side in one pass (8 measured no faster).
#[cfg(target_arch = "x86_64")]
const GROUP: usize = 4;

/// Whether this CPU runs these kernels (AVX-512F).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return isa() == Isa::Avx512;
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `ys[r] = dot(w[r * in..(r + 1) * in], x)` for the `ys.len()` rows of `w` (`in = x.len()`);
/// false (nothing done) without AVX-512 or when the sizes disagree.
pub(crate) fn dot_rows<T: Load16>(w: &[T], x: &[f32], ys: &mut [f32]) -> bool {
    if !available() || w.len() != x.len() * ys.len() {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX-512F (checked by `available`); `w` holds `ys.len()` rows of
    // `x.len()` values (checked above).
    unsafe {
        dot_rows_avx512(w, x, ys)
    };
    true
}

/// # Safety
/// AVX-512F; `w.len() == x.len() * ys.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_rows_avx512<T: Load16>(w: &[T], x: &[f32], ys: &mut [f32]) {
    let inp = x.len();
    let full = inp - inp % 16;
    let (pw, px) = (w.as_ptr(), x.as_ptr());
    // The elements past the last whole vector, in scalar code.
    let tail = |r: usize| -> f32 {
        let row = &w[r * inp..(r + 1) * inp];
        row[full..]
            .iter()
            .zip(&x[full..])
            .map(|(a, b)| a.to_f32() * b)
            .sum()
    };
    let quads = ys.len() / GROUP;
    for q in 0..quads {
        let r0 = GROUP * q;
        let p: [*const T; GROUP] = std::array::from_fn(|i| pw.add((r0 + i) * inp));
        let mut acc = [_mm512_setzero_ps(); GROUP];
        // The next four rows, a cache line per row per step, into L1 ahead of their pass.
        let ahead = (AHEAD_ROWS * inp * std::mem::size_of::<T>()) as isize;
        let end = pw.add(w.len()) as *const i8;
        let mut i = 0;
        while i < full {
            let xv = _mm512_loadu_ps(px.add(i));
            for (a, row) in acc.iter_mut().zip(&p) {
                let next = (row.add(i) as *const i8).wrapping_offset(ahead);
                if next < end {
                    _mm_prefetch::<_MM_HINT_T0>(next);
                }
                *a = _mm512_fmadd_ps(T::load16(row.add(i)), xv, *a);
            }
            i += 16;
        }
        for (k, a) in acc.iter().enumerate() {
            ys[r0 + k] = _mm512_reduce_add_ps(*a) + tail(r0 + k);
        }
    }
    for (r, y) in ys.iter_mut().enumerate().skip(GROUP * quads) {
        let row = pw.add(r * inp);
        let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + 32 <= full {
            a0 = _mm512_fmadd_ps(T::load16(row.add(i)), _mm512_loadu_ps(px.add(i)), a0);
            a1 = _mm512_fmadd_ps(
                T::load16(row.add(i + 16)),
                _mm512_loadu_ps(px.add(i + 16)),
                a1,
            );
            i += 32;
        }
        if i < full {
            a0 = _mm512_fmadd_ps(T::load16(row.add(i)), _mm512_loadu_ps(px.add(i)), a0);
        }
        *y = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + tail(r);
    }
}

/// `acc[j] += sum_r x[r] w[r * out + j]` over the `x.len()` rows of `w` (`out =
/// acc.len()` values each, one after another): the rows read in order, four at a time, so
/// that a task streams one contiguous stretch of a `(in, out)` weight; false (nothing done)
/// without AVX-512 or when the sizes disagree.
pub(crate) fn add_rows<T: Load16>(w: &[T], x: &[f32], acc: &mut [f32]) -> bool {
    if !available() || w.len() != x.len() * acc.len() {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX-512F (checked by `available`); `w` holds `x.len()` rows of
    // `acc.len()` values (checked above).
    unsafe {
        add_rows_avx512(w, x, acc)
    };
    true
}

/// # Safety
/// AVX-512F; `w.len() == x.len() * acc.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_rows_avx512<T: Load16>(w: &[T], x: &[f32], acc: &mut [f32]) {
    let out = acc.len();
    let full = out - out % 16;
    let (pw, pa) = (w.as_ptr(), acc.as_mut_ptr());
    let mut r = 0;
    while r + GROUP <= x.len() {
        let xs: [__m512; GROUP] = std::array::from_fn(|i| _mm512_set1_ps(x[r + i]));
        let rows: [*const T; GROUP] = std::array::from_fn(|i| pw.add((r + i) * out));
        let mut j = 0;
        while j < full {
            let mut a = _mm512_loadu_ps(pa.add(j));
            for (xv, row) in xs.iter().zip(&rows) {
                a = _mm512_fmadd_ps(*xv, T::load16(row.add(j)), a);
            }
            _mm512_storeu_ps(pa.add(j), a);
            j += 16;
        }
        for (j, y) in acc.iter_mut().enumerate().skip(full) {
            *y += (r..r + GROUP)
                .map(|i| x[i] * w[i * out + j].to_f32())
                .sum::<f32>();
        }
        r += GROUP;
    }
    for (i, &xi) in x.iter().enumerate().skip(r) {
        let (xv, row) = (_mm512_set1_ps(xi), pw.add(i * out));
        let mut j = 0;
        while j < full {
            let a = _mm512_fmadd_ps(xv, T::load16(row.add(j)), _mm512_loadu_ps(pa.add(j)));
            _mm512_storeu_ps(pa.add(j), a);
            j += 16;
        }
        for (j, y) in acc.iter_mut().enumerate().skip(full) {
            *y += xi * w[i * out + j].to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn f(i: usize, m: usize) -> f32 {
        ((i * 37 % m) as f32 - (m / 2) as f32) / 8.0
    }

    /// Every row count (the four-row passes and the rest) and input lengths with and
    /// without a tail past the last whole vector, in the three types.
    #[test]
    #[cfg_attr(
        not(isa_avx512),
        ignore = "needs AVX-512, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn dot_rows_equal_f64_sums() {
        assert!(
            available(),
            "built for this CPU's kernels, running without them"
        );
        for (rows, inp) in [(1, 16), (3, 17), (4, 576), (7, 40), (9, 1536), (5, 5)] {
            let w: Vec<f32> = (0..rows * inp).map(|i| f(i, 17)).collect();
            let x: Vec<f32> = (0..inp).map(|i| f(i, 11) / 2.0).collect();
            let want: Vec<f64> = (0..rows)
                .map(|r| {
                    (0..inp)
                        .map(|k| f64::from(w[r * inp + k]) * f64::from(x[k]))
                        .sum()
                })
                .collect();
            let check = |got: &[f32], what: &str| {
                for (g, w) in got.iter().zip(&want) {
                    assert!((f64::from(*g) - w).abs() < 1e-4, "{what} {rows}x{inp}");
                }
            };
            let mut ys = vec![f32::NAN; rows];
            assert!(dot_rows(&w, &x, &mut ys));
            check(&ys, "f32");
            // Multiples of 1/8 up to 1: exact in both half formats.
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            assert!(dot_rows(&wb, &x, &mut ys));
            check(&ys, "bf16");
            let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            assert!(dot_rows(&wh, &x, &mut ys));
            check(&ys, "f16");
        }
    }

    /// Rows in groups of four and alone, widths with and without a tail, added to `acc`.
    #[test]
    #[cfg_attr(
        not(isa_avx512),
        ignore = "needs AVX-512, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn add_rows_equal_f64_sums() {
        assert!(
            available(),
            "built for this CPU's kernels, running without them"
        );
        for (rows, out) in [(1, 16), (4, 17), (7, 960), (9, 5), (72, 576)] {
            let w: Vec<f32> = (0..rows * out).map(|i| f(i, 13)).collect();
            let x: Vec<f32> = (0..rows).map(|i| f(i, 7)).collect();
            let want: Vec<f64> = (0..out)
                .map(|j| {
                    0.5 + (0..rows)
                        .map(|r| f64::from(w[r * out + j]) * f64::from(x[r]))
                        .sum::<f64>()
                })
                .collect();
            let check = |got: &[f32], what: &str| {
                for (g, v) in got.iter().zip(&want) {
                    assert!((f64::from(*g) - v).abs() < 1e-4, "{what} {rows}x{out}");
                }
            };
            let mut acc = vec![0.5f32; out];
            assert!(add_rows(&w, &x, &mut acc));
            check(&acc, "f32");
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            acc.fill(0.5);
            assert!(add_rows(&wb, &x, &mut acc));
            check(&acc, "bf16");
            let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            acc.fill(0.5);
            assert!(add_rows(&wh, &x, &mut acc));
            check(&acc, "f16");
        }
        assert!(!add_rows(&[0f32; 10], &[1.0, 2.0], &mut [0f32; 4]));
    }
}
