//! RMS normalization of f32 rows, the same bits as candle-nn's `rms_norm` CPU kernel: each
//! row's sum of squares left to right in f32, then `x / sqrt(sum / n + eps) * w`. That sum is
//! a chain of dependent adds (a row of 576 waits ~1700 cycles on them); [`ROWS`] rows are
//! summed side by side, each in its own order, so that their chains overlap.

use std::mem::MaybeUninit;

use candle_core::{DType, Tensor, D};
use candle_nn::{Module, RmsNorm};
use rayon::prelude::*;

use crate::error::Result;
use crate::kernels::cpu_tensor::CpuF32;

/// Rows whose sums run side by side.
const ROWS: usize = 8;

/// Rows below which the pool is not worth a hand-over (candle's own threshold).
const SERIAL_ROWS: usize = 32;

/// `x[r] / sqrt(mean(x[r]^2) + eps) * w` for each whole row `r` of `x` (rows of `w.len()`
/// values), bit for bit candle-nn's `rms_norm` on the CPU; a partial last row is left out.
pub(crate) fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    let len = x.len().checked_div(n).map_or(0, |rows| rows * n);
    let (x, mut out) = (&x[..len], Vec::with_capacity(len));
    let group = |(x, out): (&[f32], &mut [MaybeUninit<f32>])| normalize_group(x, w, eps, out);
    let slots = &mut out.spare_capacity_mut()[..len];
    if len <= SERIAL_ROWS * n {
        x.chunks(ROWS * n.max(1))
            .zip(slots.chunks_mut(ROWS * n.max(1)))
            .for_each(group);
    } else {
        x.par_chunks(ROWS * n)
            .zip(slots.par_chunks_mut(ROWS * n))
            .for_each(group);
    }
    // SAFETY: `normalize_group` writes every value of each chunk (whole rows): no zeroing
    // pass first.
    unsafe { out.set_len(len) };
    out
}

/// `norm(x)` as candle-nn's `RmsNorm` computes it: f32 CPU rows (contiguous, nothing tracking
/// gradients, an f32 weight) by [`rms_norm_rows`], the same bits; anything else by candle.
pub(crate) fn rms_norm(norm: &RmsNorm, x: &Tensor) -> Result<Tensor> {
    let w = norm.weight();
    let ours = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous();
    if ours(x) && ours(w) && !x.track_op() && x.dim(D::Minus1)? == w.elem_count() {
        let (xv, wv) = (CpuF32::new(x, "x")?, CpuF32::new(w, "norm weight")?);
        let out = rms_norm_rows(xv.contiguous()?, wv.contiguous()?, norm.eps() as f32);
        return Ok(Tensor::from_vec(out, x.shape(), x.device())?);
    }
    Ok(norm.forward(x)?)
}

/// Up to [`ROWS`] whole rows of `x` into `out`, compiled for the widest vectors this CPU has
/// (the divisions and products are per lane, the same bits at any width).
fn normalize_group(x: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::simd::{isa, Isa};
        match isa() {
            // SAFETY: `isa` found AVX-512F on this CPU.
            Isa::Avx512 => return unsafe { group_avx512(x, w, eps, out) },
            // SAFETY: `isa` found AVX2 (and FMA) on this CPU.
            Isa::Avx2 => return unsafe { group_avx2(x, w, eps, out) },
            Isa::Scalar => {}
        }
    }
    group(x, w, eps, out)
}

/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn group_avx512(x: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) {
    group(x, w, eps, out)
}

/// # Safety
/// The CPU has AVX2 (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn group_avx2(x: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) {
    group(x, w, eps, out)
}

#[inline(always)]
fn group(x: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) {
    let n = w.len();
    let rows = x.len() / n;
    let mut sums = [0f32; ROWS];
    if rows == ROWS {
        // The common case with a constant trip count: one add per row per column, each row's
        // sum in its own order (only independent sums are interleaved).
        for j in 0..n {
            for (r, s) in sums.iter_mut().enumerate() {
                let v = x[r * n + j];
                *s += v * v;
            }
        }
    } else {
        for (s, row) in sums.iter_mut().zip(x.chunks_exact(n)) {
            *s = row.iter().map(|&v| v * v).sum::<f32>();
        }
    }
    for ((row, o), &s) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)).zip(&sums) {
        let m = (s / n as f32 + eps).sqrt();
        for ((d, &v), &a) in o.iter_mut().zip(row).zip(w) {
            d.write(v / m * a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// The tensor form equals candle-nn's layer, on a 3-d input and a strided one (candle's
    /// fallback).
    #[test]
    fn tensor_form_equals_the_layer() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::from_vec(
            crate::kernels::test_values(2 * 40 * 24, 3),
            (2, 40, 24),
            &dev,
        )?;
        let norm = RmsNorm::new(
            Tensor::from_vec(crate::kernels::test_values(24, 4), 24, &dev)?,
            1e-6,
        );
        for x in [x.clone(), x.transpose(0, 1)?] {
            let (a, b) = (rms_norm(&norm, &x)?, norm.forward(&x)?);
            assert_eq!(a.dims(), b.dims());
            let (a, b) = (
                a.flatten_all()?.to_vec1::<f32>()?,
                b.flatten_all()?.to_vec1::<f32>()?,
            );
            assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
        }
        Ok(())
    }

    /// Equals candle-nn's kernel bit for bit: rows in whole and partial groups, on and off the
    /// pool, widths with and without a vector's remainder, large and tiny values.
    #[test]
    fn equals_candle_bit_for_bit() -> candle_core::Result<()> {
        for (rows, n) in [(1, 576), (5, 64), (8, 17), (33, 576), (70, 96), (9, 1)] {
            let x: Vec<f32> = crate::kernels::test_values(rows * n, rows + n)
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v * if i % 13 == 0 {
                        1e3
                    } else {
                        1.0 + (i % 5) as f32
                    }
                })
                .collect();
            let w = crate::kernels::test_values(n, 7);
            let eps = 1e-5;
            let expected = candle_nn::ops::rms_norm(
                &Tensor::from_slice(&x, (rows, n), &Device::Cpu)?,
                &Tensor::from_slice(&w, n, &Device::Cpu)?,
                eps,
            )?
            .flatten_all()?
            .to_vec1::<f32>()?;
            let out = rms_norm_rows(&x, &w, eps);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&expected), "{rows} x {n}");
        }
        Ok(())
    }
}
