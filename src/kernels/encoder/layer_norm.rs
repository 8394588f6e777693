//! Residual add and LayerNorm in one pass over each row: `y = LN(a + b) gamma + beta`, the
//! step that closes each half of a BERT layer (and sums in BERT's position embeddings).
//! Rows are split among the threads; sums run in independent lanes so the compiler
//! vectorises them.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::simd::{isa, Isa};

/// Independent partial sums per row (one AVX-512 vector, two AVX2 ones).
const LANES: usize = 16;
/// Rows per task.
const ROWS_PER_TASK: usize = 16;

/// `a[r] = LN(a[r] + b[r]) gamma + beta` for every row `r` of width `gamma.len()`: mean
/// and variance (biased, as PyTorch) of the sum, then `(s - mean) / sqrt(var + eps)`.
///
/// # Shapes
/// - `a`, `b`: `(rows, d)` row-major; `gamma`, `beta`: `(d,)`
pub(crate) fn add_layer_norm_in_place(
    a: &mut [f32],
    b: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) -> Result<()> {
    let d = gamma.len();
    if d == 0 || beta.len() != d || a.len() != b.len() || !a.len().is_multiple_of(d) {
        return Err(Error::Kernel(format!(
            "residual LayerNorm of {} + {} values with {} weights and {} biases",
            a.len(),
            b.len(),
            d,
            beta.len()
        )));
    }
    let work = |(ac, bc): (&mut [f32], &[f32])| {
        for (ar, br) in ac.chunks_exact_mut(d).zip(bc.chunks_exact(d)) {
            row(ar, br, gamma, beta, eps);
        }
    };
    let chunk = d * ROWS_PER_TASK;
    if a.len() <= chunk {
        work((a, b));
    } else {
        a.par_chunks_mut(chunk)
            .zip(b.par_chunks(chunk))
            .for_each(work);
    }
    Ok(())
}

/// `a = LN(a + b) gamma + beta` for one row (the first argument of
/// [`add_layer_norm_in_place`] holding one row).
pub(crate) fn add_layer_norm_row(
    a: &mut [f32],
    b: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) -> Result<()> {
    if a.len() != gamma.len() {
        return Err(Error::Kernel(format!(
            "a LayerNorm row of {} values with {} weights",
            a.len(),
            gamma.len()
        )));
    }
    add_layer_norm_in_place(a, b, gamma, beta, eps)
}

/// One row, with the widest vectors the CPU has.
fn row(a: &mut [f32], b: &[f32], gamma: &[f32], beta: &[f32], eps: f32) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F (checked by `isa`).
        Isa::Avx512 => unsafe { row_avx512(a, b, gamma, beta, eps) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2 and FMA (checked by `isa`).
        Isa::Avx2 => unsafe { row_avx2(a, b, gamma, beta, eps) },
        Isa::Scalar => row_lanes(a, b, gamma, beta, eps),
    }
}

/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_avx512(a: &mut [f32], b: &[f32], gamma: &[f32], beta: &[f32], eps: f32) {
    row_lanes(a, b, gamma, beta, eps);
}

/// # Safety
/// The CPU has AVX2 and FMA (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_avx2(a: &mut [f32], b: &[f32], gamma: &[f32], beta: &[f32], eps: f32) {
    row_lanes(a, b, gamma, beta, eps);
}

/// Sum of a row in [`LANES`] lanes, then the tail.
#[inline(always)]
fn lane_sum(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    for c in chunks {
        for k in 0..LANES {
            acc[k] += f(c[k]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn row_lanes(a: &mut [f32], b: &[f32], gamma: &[f32], beta: &[f32], eps: f32) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
    let n = a.len() as f32;
    let mean = lane_sum(a, |v| v) / n;
    let var = lane_sum(a, |v| (v - mean) * (v - mean)) / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((x, g), c) in a.iter_mut().zip(gamma).zip(beta) {
        *x = (*x - mean) * inv * g + c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equals_the_definition_in_f64() -> Result<()> {
        for (rows, d) in [(1, 5), (3, 384), (40, 37)] {
            let a: Vec<f32> = (0..rows * d)
                .map(|i| ((i * 31 % 101) as f32 - 50.0) / 7.0 + 3.0)
                .collect();
            let b: Vec<f32> = (0..rows * d)
                .map(|i| ((i * 17 % 13) as f32) / 5.0)
                .collect();
            let g: Vec<f32> = (0..d).map(|i| 0.5 + (i % 7) as f32 / 7.0).collect();
            let c: Vec<f32> = (0..d).map(|i| (i % 5) as f32 / 10.0 - 0.2).collect();
            let mut got = a.clone();
            add_layer_norm_in_place(&mut got, &b, &g, &c, 1e-12)?;
            for r in 0..rows {
                let s: Vec<f64> = (0..d)
                    .map(|j| (a[r * d + j] + b[r * d + j]) as f64)
                    .collect();
                let mean = s.iter().sum::<f64>() / d as f64;
                let var = s.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
                for j in 0..d {
                    let want = (s[j] - mean) / (var + 1e-12).sqrt() * g[j] as f64 + c[j] as f64;
                    let e = (got[r * d + j] as f64 - want).abs();
                    assert!(
                        e < 2e-5 * (1.0 + want.abs()),
                        "({rows}, {d}) [{r}, {j}]: {e}"
                    );
                }
            }
        }
        assert!(
            add_layer_norm_in_place(&mut [0.0; 6], &[0.0; 5], &[1.0; 3], &[0.0; 3], 1e-5).is_err()
        );
        Ok(())
    }
}
