//! `x W^T + b` for a few rows of `x` against half-precision `(out, in)` weight rows read
//! where the checkpoint is mapped: nothing is packed or widened ahead, so a short input (the
//! main job's one sentence) runs without the f32 panels that packing the whole model would
//! fault in. Each task takes a run of outputs; a tile is 4 weight rows x 4 input rows, 16
//! FMA chains along `in`, each weight vector widened once for 4 inputs. AVX-512F only:
//! elsewhere callers pack the weight ([`crate::kernels::gemm::packed`]).
// Elsewhere `available()` is false and the tasks are never run.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::gemm::matrix::{HalfRows, MatRef, SharedOut};
#[cfg(target_arch = "x86_64")]
use crate::kernels::widen::Load16;

/// Most input rows this path takes; longer inputs are multiplied on packed panels, whose
/// micro-kernels are faster per row once the packing is paid (see docs/performance-archive.md).
pub(crate) const MOST_ROWS: usize = 32;
/// Outputs per task (a multiple of the tile's 4).
const TASK_OUTS: usize = 32;

/// Whether this CPU runs the kernel (AVX-512F).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return crate::kernels::simd::isa() == crate::kernels::simd::Isa::Avx512;
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// One task: rows `rows` of part `part`, written to output columns from `col`.
#[derive(Debug, Clone)]
struct Task {
    part: usize,
    rows: Range<usize>,
    col: usize,
}

/// Columns `cols` of `x W^T + b`, `W` the `parts` stacked along their outputs, then `finish`
/// on each task's stretch of each output row (still in cache): returns `(m, cols)`
/// row-major. `Ok(None)` without AVX-512F (the caller packs instead).
///
/// # Shapes
/// - `x`: `(m, in)` with contiguous rows; each part `(out_i, in)`
/// - `bias`: `(sum out_i,)`, the whole weight's (the columns' part is used)
pub(crate) fn linear(
    x: MatRef<'_>,
    parts: &[HalfRows<'_>],
    cols: Range<usize>,
    bias: Option<&[f32]>,
    finish: &(dyn Fn(&mut [f32]) + Sync),
) -> Result<Option<Vec<f32>>> {
    if !available() {
        return Ok(None);
    }
    let (m, k) = (x.rows, x.cols);
    let n: usize = parts.iter().map(|p| p.rows).sum();
    let bad = |what: String| Err(Error::Kernel(format!("half-row product: {what}")));
    if x.cs != 1 && k > 1 {
        return bad(format!("input of column stride {}", x.cs));
    }
    if let Some(p) = parts
        .iter()
        .find(|p| p.cols != k || p.bytes.len() != 2 * p.rows * p.cols)
    {
        return bad(format!(
            "a {}x{} part in {} bytes against an input of width {k}",
            p.rows,
            p.cols,
            p.bytes.len()
        ));
    }
    if cols.start > cols.end || cols.end > n || bias.is_some_and(|b| b.len() != n) {
        return bad(format!(
            "columns {cols:?} (bias of {:?}) of {n} outputs",
            bias.map(<[f32]>::len)
        ));
    }
    let width = cols.len();
    let mut tasks = Vec::new();
    let mut base = 0;
    for (i, p) in parts.iter().enumerate() {
        let (r0, r1) = (
            cols.start.clamp(base, base + p.rows) - base,
            cols.end.clamp(base, base + p.rows) - base,
        );
        let mut r = r0;
        while r < r1 {
            let end = (r + TASK_OUTS).min(r1);
            tasks.push(Task {
                part: i,
                rows: r..end,
                col: base + r - cols.start,
            });
            r = end;
        }
        base += p.rows;
    }
    let mut out = vec![0f32; m * width];
    let shared = SharedOut::new(&mut out);
    let run = |t: &Task| -> Result<()> {
        // SAFETY: tasks cover disjoint output columns (their rows of distinct parts, or
        // distinct rows of one part), so no two views address one element.
        let mut dst = unsafe { shared.mat_mut(t.col, m, t.rows.len(), width) }?;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F was checked above; `w` holds `t.rows.len()` rows of `k` values,
        // `x` is a bounds-checked `(m, k)` view with contiguous rows, `dst` a bounds-checked
        // `(m, rows)` view with row stride `width`.
        unsafe {
            let p = &parts[t.part];
            let first = t.col + cols.start; // the task's first output in the whole weight
            let b = bias.map(|b| &b[first..first + t.rows.len()]);
            let w = &p.bytes[2 * t.rows.start * k..2 * t.rows.end * k];
            let (xp, d, outs) = (x.ptr(), dst.as_mut_ptr(), t.rows.len());
            if p.bf16 {
                let wp = w.as_ptr() as *const bf16;
                rows_avx512(xp, x.rs, m, k, wp, outs, b, d, width)
            } else {
                let wp = w.as_ptr() as *const f16;
                rows_avx512(xp, x.rs, m, k, wp, outs, b, d, width)
            }
        }
        for r in 0..m {
            let row = dst
                .row_mut(r)
                .ok_or_else(|| Error::Kernel(format!("half-row product: output row {r}")))?;
            finish(row);
        }
        Ok(())
    };
    if m > 0 && width > 0 {
        if tasks.len() == 1 || rayon::current_num_threads() == 1 || m * k * width < 1 << 18 {
            tasks.iter().try_for_each(run)?;
        } else {
            tasks.par_iter().with_max_len(1).try_for_each(run)?;
        }
    }
    Ok(Some(out))
}

/// `out[r * ldo + o] = b[o] + sum_i x[r * lda + i] w[o * k + i]` for `m` input rows and
/// `outs` weight rows.
///
/// # Safety
/// AVX-512F; `x` addresses `m` rows of `k` floats `lda` apart, `w` `outs` rows of `k` values
/// one after another, `out` `m` rows of `outs` floats `ldo` apart, `b` (when given) `outs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_avx512<T: Load16>(
    x: *const f32,
    lda: usize,
    m: usize,
    k: usize,
    w: *const T,
    outs: usize,
    b: Option<&[f32]>,
    out: *mut f32,
    ldo: usize,
) {
    let bias = |o: usize| b.and_then(|b| b.get(o)).copied().unwrap_or(0.0);
    let mut o = 0;
    while o < outs {
        let four = outs - o >= 4;
        let wo = w.add(o * k);
        let bo: [f32; 4] = [bias(o), bias(o + 1), bias(o + 2), bias(o + 3)];
        // The first tile of a group asks for the next group's rows (the same place in each).
        let end = w.add(outs * k) as *const i8;
        let mut r = 0;
        while r < m {
            let (xr, dst) = (x.add(r * lda), out.add(r * ldo + o));
            if r == 0 {
                prefetch_rows(wo, k, end);
            }
            match (four, m - r) {
                (true, 1) => tile::<T, 4, 1>(xr, lda, k, wo, dst, ldo, bo),
                (true, 2) => tile::<T, 4, 2>(xr, lda, k, wo, dst, ldo, bo),
                (true, 3) => tile::<T, 4, 3>(xr, lda, k, wo, dst, ldo, bo),
                (true, _) => tile::<T, 4, 4>(xr, lda, k, wo, dst, ldo, bo),
                (false, 1) => tile::<T, 1, 1>(xr, lda, k, wo, dst, ldo, bo),
                (false, 2) => tile::<T, 1, 2>(xr, lda, k, wo, dst, ldo, bo),
                (false, 3) => tile::<T, 1, 3>(xr, lda, k, wo, dst, ldo, bo),
                (false, _) => tile::<T, 1, 4>(xr, lda, k, wo, dst, ldo, bo),
            }
            r += 4;
        }
        o += if four { 4 } else { 1 };
    }
}

/// Asks for the 4 weight rows after the 4 at `w` (`k` values each) to be brought into L1,
/// stopping at `end`.
///
/// # Safety
/// None beyond `w` pointing into the weight: prefetches never fault.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_rows<T>(w: *const T, k: usize, end: *const i8) {
    let bytes = 4 * k * std::mem::size_of::<T>();
    let next = (w as *const i8).wrapping_add(bytes);
    let mut off = 0;
    while off < bytes {
        let p = next.wrapping_add(off);
        if p >= end {
            break;
        }
        _mm_prefetch::<_MM_HINT_T0>(p);
        off += 64;
    }
}

/// One tile: `O` weight rows by `R` input rows, the part of `k` past the last whole vector in
/// scalar code.
///
/// # Safety
/// As [`rows_avx512`], for `O` weight rows and `R` input rows.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<T: Load16, const O: usize, const R: usize>(
    x: *const f32,
    lda: usize,
    k: usize,
    w: *const T,
    out: *mut f32,
    ldo: usize,
    bias: [f32; 4],
) {
    let full = k - k % 16;
    let mut acc = [[_mm512_setzero_ps(); R]; O];
    let mut xv = [_mm512_setzero_ps(); R];
    let mut i = 0;
    while i < full {
        for r in 0..R {
            xv[r] = _mm512_loadu_ps(x.add(r * lda + i));
        }
        for o in 0..O {
            let wv = T::load16(w.add(o * k + i));
            for r in 0..R {
                acc[o][r] = _mm512_fmadd_ps(wv, xv[r], acc[o][r]);
            }
        }
        i += 16;
    }
    // Four weight rows: all chains summed at once by one transposing tree (45 vector
    // operations where sixteen separate sums take about 128).
    let mut sums = [0f32; 16];
    if O == 4 {
        let mut flat = [_mm512_setzero_ps(); 16];
        for o in 0..O {
            for r in 0..R {
                flat[4 * o + r] = acc[o][r];
            }
        }
        _mm512_storeu_ps(sums.as_mut_ptr(), sum_each(&flat));
    } else {
        for o in 0..O {
            for r in 0..R {
                sums[4 * o + r] = _mm512_reduce_add_ps(acc[o][r]);
            }
        }
    }
    for o in 0..O {
        for r in 0..R {
            let mut s = sums[4 * o + r];
            for j in full..k {
                s += (*w.add(o * k + j)).to_f32() * *x.add(r * lda + j);
            }
            *out.add(r * ldo + o) = s + bias[o];
        }
    }
}

/// Lane `j` of the result is the sum of the lanes of `v[j]`: pairs of vectors are interleaved
/// and added, halving the vectors and doubling the sums each holds, four times.
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sum_each(v: &[__m512; 16]) -> __m512 {
    // Each 128-bit lane of `pairs[i]`: partial sums of v[2i], v[2i+1], v[2i], v[2i+1].
    let mut pairs = [_mm512_setzero_ps(); 8];
    for (i, p) in pairs.iter_mut().enumerate() {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        *p = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    // Each 128-bit lane of `quads[i]`: partial sums of v[4i..4i + 4].
    let mut quads = [_mm512_setzero_ps(); 4];
    for (i, q) in quads.iter_mut().enumerate() {
        let (a, b) = (
            _mm512_castps_pd(pairs[2 * i]),
            _mm512_castps_pd(pairs[2 * i + 1]),
        );
        *q = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
        );
    }
    let (lo, hi) = (fold(quads[0], quads[1]), fold(quads[2], quads[3]));
    fold(lo, hi)
}

/// 128-bit lanes 0 and 2 of `a` then `b`, plus their lanes 1 and 3 (a function, not a
/// closure: a closure would not take the caller's AVX-512 and pass vectors wrongly).
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn fold(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kernels::test_values as values;

    /// Every column range of stacked parts (tiles of 4 and 1 outputs, 1 to 4 input rows, a
    /// width that is no multiple of 16, f16 and bf16 parts) equals the f64 sums of the
    /// widened values, and `finish` sees each output once.
    #[test]
    #[cfg_attr(
        not(isa_avx512),
        ignore = "needs AVX-512, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn equals_f64_sums_of_the_widened_values() -> Result<()> {
        assert!(
            available(),
            "built for this CPU's kernels, running without them"
        );
        let k = 70;
        let outs = [37usize, 6, 61];
        let bfs = [false, true, false];
        let (bytes, rounded): (Vec<Vec<u8>>, Vec<Vec<f32>>) = outs
            .iter()
            .zip(bfs)
            .enumerate()
            .map(|(i, (&n, bf))| crate::kernels::test_half(&values(n * k, 3 + i), bf))
            .unzip();
        let parts: Vec<HalfRows<'_>> = bytes
            .iter()
            .zip(outs)
            .zip(bfs)
            .map(|((b, rows), bf16)| HalfRows {
                bytes: b,
                rows,
                cols: k,
                bf16,
            })
            .collect();
        let all: Vec<f32> = rounded.concat(); // (104, k)
        let n = all.len() / k;
        let bias = values(n, 9);
        for m in [1usize, 3, 4, 9] {
            let lda = k + 5;
            let xs = values(m * lda, 4);
            let x = MatRef::new(&xs, 0, m, k, lda, 1)?;
            for cols in [0..n, 0..37, 37..43, 40..104, 5..6] {
                let seen = std::sync::atomic::AtomicUsize::new(0);
                let count = |row: &mut [f32]| {
                    seen.fetch_add(row.len(), std::sync::atomic::Ordering::Relaxed);
                };
                let got = linear(x, &parts, cols.clone(), Some(&bias), &count)?
                    .ok_or_else(|| Error::Kernel("no AVX-512F".into()))?;
                assert_eq!(seen.into_inner(), m * cols.len());
                for r in 0..m {
                    for (j, c) in cols.clone().enumerate() {
                        let want: f64 = (0..k)
                            .map(|i| f64::from(xs[r * lda + i]) * f64::from(all[c * k + i]))
                            .sum::<f64>()
                            + f64::from(bias[c]);
                        let g = got[r * cols.len() + j];
                        assert!(
                            (f64::from(g) - want).abs() < 1e-5,
                            "m {m} cols {cols:?} ({r}, {c}): {g} vs {want}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    #[cfg_attr(
        not(isa_avx512),
        ignore = "needs AVX-512, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn mismatched_sizes_are_errors() -> Result<()> {
        assert!(
            available(),
            "built for this CPU's kernels, running without them"
        );
        let bytes = vec![0u8; 2 * 4 * 8];
        let part = HalfRows {
            bytes: &bytes,
            rows: 4,
            cols: 8,
            bf16: false,
        };
        let xs = vec![1f32; 2 * 9];
        let x = MatRef::new(&xs, 0, 2, 9, 9, 1)?;
        assert!(linear(x, &[part], 0..4, None, &|_| ()).is_err());
        let x = MatRef::new(&xs, 0, 2, 8, 9, 1)?;
        assert!(linear(x, &[part], 0..5, None, &|_| ()).is_err());
        assert!(linear(x, &[part], 0..4, Some(&[0.0; 3]), &|_| ()).is_err());
        assert_eq!(
            linear(x, &[part], 0..4, None, &|_| ())?.map(|v| v.len()),
            Some(8)
        );
        Ok(())
    }
}
