//! `y = W x` for a weight kept as a GGUF file stores it (ggml blocks), one input row at a
//! time, every block read once per product: with AVX-512 (or AVX2 + FMA + F16C) the block
//! types of real files are unpacked in registers and summed as they are read
//! (`quant_gemv_avx512`, `quant_gemv_avx2`); otherwise each
//! task dequantizes four rows at a time into its scratch (exactly, as gguf-py does) and
//! multiplies them with the f32 matrix-vector kernel, giving the sums the same weight
//! dequantized to f32 would give, bit for bit. Opted in ([`set_int8_activations`]), the
//! 32-value types are multiplied with `x` quantized to 8 bits instead (`quant_gemv_vnni`,
//! `quant_gemv_int8_avx2`), as llama.cpp does.

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::decode::gemv::{dot_rows, task_len, ROWS_PER_TASK};
use crate::kernels::decode::keep_warm;
use crate::kernels::decode::quant_gemv_int8_avx2;
use crate::kernels::decode::quant_gemv_vnni::{self, QuantizedX};
use crate::kernels::decode::{quant_gemv_avx2, quant_gemv_avx512};
use crate::kernels::quant::blocks::{self, QuantType};
use crate::kernels::scratch::with_scratch;

/// Whether GGUF products of a few rows quantize `x` to 8 bits ([`set_int8_activations`]).
static INT8_ACTIVATIONS: AtomicBool = AtomicBool::new(false);

/// Opts in to (or out of) 8-bit activations in the matrix-vector products of GGUF weights
/// on the CPU, as llama.cpp computes them: each product quantizes `x` once into blocks of 32
/// signed bytes with a scale each, and the weight's integers meet them in AVX-512 VNNI
/// dot-product instructions, or AVX2's byte multiply-adds. Faster where the unpacking, not
/// the memory, bounds a product (most of all with AVX2); not exact: the greedy tokens may
/// leave the f32 model's after a few (see the README). Process-wide; off by default. For
/// the K-quants, prompts of more than a few rows and CPUs without AVX2, the products stay
/// exact.
pub fn set_int8_activations(on: bool) {
    INT8_ACTIVATIONS.store(on, Ordering::Relaxed);
}

/// Whether [`set_int8_activations`] is on.
pub fn int8_activations() -> bool {
    INT8_ACTIVATIONS.load(Ordering::Relaxed)
}

/// Rows dequantized together (the f32 kernel's group of rows).
const GROUP: usize = 4;

/// The block types the SIMD row kernels take: those of real files' matrices (Q4_0, Q4_1,
/// Q5_0, Q5_1, Q8_0, and the K-quants of Q4_K_M files).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const ROW_KERNEL_TYPES: [QuantType; 7] = [
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q8_0,
    QuantType::Q4K,
    QuantType::Q6K,
];

/// The 32-value block types as const parameters of the row kernels (one loop compiled per
/// type).
#[cfg(target_arch = "x86_64")]
pub(crate) mod kind {
    use crate::kernels::quant::blocks::QuantType;

    pub(crate) const Q8_0: u8 = 0;
    pub(crate) const Q4_0: u8 = 1;
    pub(crate) const Q4_1: u8 = 2;
    pub(crate) const Q5_0: u8 = 3;
    pub(crate) const Q5_1: u8 = 4;

    /// The type of kind `k`.
    pub(crate) fn quant_type(k: u8) -> QuantType {
        match k {
            Q8_0 => QuantType::Q8_0,
            Q4_0 => QuantType::Q4_0,
            Q4_1 => QuantType::Q4_1,
            Q5_0 => QuantType::Q5_0,
            _ => QuantType::Q5_1,
        }
    }
}

/// An 8-bit row kernel's signature: `sum_k W[k] x[k]` for one row of `ty` blocks against
/// `x` quantized.
type Int8Dot = fn(QuantType, &[u8], &QuantizedX) -> Option<f32>;

/// A row kernel's signature: `sum_k W[k] x[k]` for one row of `ty` blocks.
type RowDot = fn(QuantType, &[u8], &[f32]) -> Option<f32>;

/// The row kernel for `ty` on this CPU: AVX-512, else AVX2 + FMA + F16C (both capped by
/// `CANDLE_ATTENTION_ISA`), else none (rows dequantized into scratch).
fn row_kernel(ty: QuantType) -> Option<RowDot> {
    if quant_gemv_avx512::supports(ty) {
        Some(quant_gemv_avx512::row_dot)
    } else if quant_gemv_avx2::supports(ty) {
        Some(quant_gemv_avx2::row_dot)
    } else {
        None
    }
}

/// `y[j] = sum_k W[j, k] x[k] (+ bias[j])` for `W` `(y.len(), x.len())` stored as `ty` rows
/// in `data`.
pub(crate) fn quant_gemv(
    ty: QuantType,
    data: &[u8],
    x: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<()> {
    let (out, inp) = (y.len(), x.len());
    let row_bytes = ty
        .bytes_of(inp)
        .ok_or_else(|| Error::Kernel(format!("rows of {inp} values are not whole {ty} blocks")))?;
    if data.len() != out * row_bytes || bias.is_some_and(|b| b.len() != out) {
        return Err(Error::Kernel(format!(
            "{ty} product of {} bytes by {inp} inputs into {out} outputs",
            data.len()
        )));
    }
    product(ty, data, x, bias, y, row_bytes, int8_activations())
}

/// [`quant_gemv`] for sizes checked (`row_bytes` a row's), with 8-bit activations where
/// `int8` and this CPU and type have them.
fn product(
    ty: QuantType,
    data: &[u8],
    x: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
    row_bytes: usize,
    int8: bool,
) -> Result<()> {
    let (out, inp) = (y.len(), x.len());
    let len = task_len(out, GROUP, ROWS_PER_TASK);
    let row_dot = row_kernel(ty);
    // 8-bit activations: AVX-512 VNNI, else AVX2 (`None`: exact).
    let int8_dot: Option<Int8Dot> = if !int8 {
        None
    } else if quant_gemv_vnni::supports(ty) {
        Some(quant_gemv_vnni::row_dot)
    } else if quant_gemv_int8_avx2::supports(ty) {
        Some(quant_gemv_int8_avx2::row_dot)
    } else {
        None
    };
    let xq = int8_dot.and_then(|dot| QuantizedX::new(x).map(|q| (dot, q)));
    let work = |(c, ys): (usize, &mut [f32])| -> Result<()> {
        let j0 = c * len;
        if let Some((int8_dot, xq)) = &xq {
            // 8-bit activations (opted in): each row's integers against `x` quantized.
            for (r, yv) in ys.iter_mut().enumerate() {
                let at = (j0 + r) * row_bytes;
                *yv = int8_dot(ty, &data[at..at + row_bytes], xq)
                    .ok_or_else(|| Error::Kernel(format!("{ty}: no 8-bit row kernel")))?;
            }
        } else if let Some(row_dot) = row_dot {
            // Each row unpacked in registers and summed as it is read.
            for (r, yv) in ys.iter_mut().enumerate() {
                let at = (j0 + r) * row_bytes;
                *yv = row_dot(ty, &data[at..at + row_bytes], x)
                    .ok_or_else(|| Error::Kernel(format!("{ty}: no row kernel")))?;
            }
        } else {
            with_scratch(GROUP * inp, |rows| {
                for (g, yg) in ys.chunks_mut(GROUP).enumerate() {
                    let first = j0 + g * GROUP;
                    let (n, at) = (yg.len(), first * row_bytes);
                    let w = &mut rows[..n * inp];
                    if !blocks::dequantize(ty, &data[at..at + n * row_bytes], w) {
                        return Err(Error::Kernel(format!(
                            "{ty} rows {first}.. do not dequantize"
                        )));
                    }
                    dot_rows(w, x, yg);
                }
                Ok(())
            })?;
        }
        if let Some(b) = bias {
            for (yv, bv) in ys.iter_mut().zip(&b[j0..]) {
                *yv += bv;
            }
        }
        Ok(())
    };
    if out * inp < 1 << 16 {
        y.chunks_mut(len).enumerate().try_for_each(work)
    } else {
        keep_warm::run(|| y.par_chunks_mut(len).enumerate().try_for_each(work))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::decode::gemv::gemv;
    use crate::kernels::quant::blocks::tests::ggml;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    /// Each row kernel's dot product (AVX-512, AVX2 + FMA + F16C) against the same weight
    /// dequantized (gguf-py's values), summed in f64: within f32 rounding of the sum of
    /// magnitudes, for every type it takes, on any CPU that runs it; a row of the wrong size
    /// has no kernel.
    #[test]
    fn row_dots_equal_the_dequantized_weight_s() -> candle_core::Result<()> {
        #[cfg(target_arch = "x86_64")]
        for ty in ROW_KERNEL_TYPES {
            use crate::kernels::simd::{isa, Isa};
            assert_eq!(
                quant_gemv_avx512::supports(ty),
                matches!(isa(), Isa::Avx512),
                "{ty}: kernel"
            );
        }
        type Supports = fn(QuantType) -> bool;
        let kernels: [(Supports, RowDot); 2] = [
            (quant_gemv_avx512::supports, quant_gemv_avx512::row_dot),
            (quant_gemv_avx2::supports, quant_gemv_avx2::row_dot),
        ];
        for (supports, row_dot) in kernels {
            for ty in ROW_KERNEL_TYPES {
                if !supports(ty) {
                    continue;
                }
                let (rows, cols) = (9, 768);
                let w = crate::kernels::test_values(rows * cols, 11);
                let q =
                    QTensor::quantize(&Tensor::from_vec(w, (rows, cols), &Device::Cpu)?, ggml(ty))?;
                let bytes = q.data()?;
                let mut deq = vec![0f32; rows * cols];
                assert!(blocks::dequantize(ty, &bytes, &mut deq));
                let x = crate::kernels::test_values(cols, 2);
                let row_bytes = bytes.len() / rows;
                for r in 0..rows {
                    let got = row_dot(ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &x)
                        .ok_or_else(|| candle_core::Error::Msg(format!("{ty}: no kernel")))?;
                    let w = &deq[r * cols..(r + 1) * cols];
                    let want: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mag: f64 = w
                        .iter()
                        .zip(&x)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                    assert!(
                        (got as f64 - want).abs() <= mag * 1e-6,
                        "{ty} row {r}: {got} vs {want}"
                    );
                }
                assert!(row_dot(ty, &bytes[..row_bytes - 1], &x).is_none());
                // Each weight exactly as gguf-py makes it: the dot with a unit vector is that
                // one value, with no rounding of its own.
                let mut e = vec![0f32; cols];
                for r in 0..2 {
                    let row = &bytes[r * row_bytes..(r + 1) * row_bytes];
                    for k in 0..cols {
                        e[k] = 1.0;
                        let got = row_dot(ty, row, &e)
                            .ok_or_else(|| candle_core::Error::Msg(format!("{ty}: no kernel")))?;
                        e[k] = 0.0;
                        let want = deq[r * cols + k];
                        assert!(got == want, "{ty} ({r}, {k}): {got} vs {want}");
                    }
                }
            }
        }
        Ok(())
    }

    /// The product on the blocks equals the f32 kernel's on the dequantized weight (bit for
    /// bit where it runs that kernel, within rounding where the fused kernels sum in their
    /// own order), for every type and for sizes that leave partial tasks and groups.
    #[test]
    fn equals_the_f32_product_of_the_dequantized_weight() -> candle_core::Result<()> {
        // Every block type.
        let types = QuantType::ALL.into_iter().filter(|t| t.block_values() > 1);
        for (ty, g) in types.map(|t| (t, ggml(t))) {
            for (out, inp) in [(7usize, 256usize), (301, 512), (1030, 256)] {
                let w = crate::kernels::test_values(out * inp, 3);
                let wt = Tensor::from_vec(w, (out, inp), &Device::Cpu)?;
                let q = QTensor::quantize(&wt, g)?;
                let bytes = q.data()?;
                let mut deq = vec![0f32; out * inp];
                assert!(blocks::dequantize(ty, &bytes, &mut deq));
                let x = crate::kernels::test_values(inp, 9);
                let bias = crate::kernels::test_values(out, 4);
                let (mut want, mut got) = (vec![0f32; out], vec![f32::NAN; out]);
                gemv(&deq, &x, Some(&bias), &mut want).map_err(crate::Error::into_candle)?;
                quant_gemv(ty, &bytes, &x, Some(&bias), &mut got)
                    .map_err(crate::Error::into_candle)?;
                for (j, (a, b)) in got.iter().zip(&want).enumerate() {
                    if row_kernel(ty).is_some() {
                        // Summed in another order: within f32 rounding of the magnitudes.
                        let row = &deq[j * inp..(j + 1) * inp];
                        let mag: f32 = row.iter().zip(&x).map(|(w, v)| (w * v).abs()).sum();
                        let tol = (mag + bias[j].abs()) * 1e-6;
                        assert!((a - b).abs() <= tol, "{ty} {out}x{inp} row {j}: {a} vs {b}");
                    } else {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{ty} {out}x{inp} row {j}: {a} vs {b}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// With 8-bit activations (where this CPU has them): every type's product within the
    /// quantization of `x` of the exact one (`sum |w| dx / 2` a block, `dx = max|x| / 127`),
    /// rows split over tasks as the exact path splits them; the bias added.
    #[test]
    fn int8_products_stay_within_the_quantization_of_x() -> candle_core::Result<()> {
        for ty in quant_gemv_vnni::TYPES {
            let (out, inp) = (301usize, 576usize);
            let w = crate::kernels::test_values(out * inp, 5);
            let q = QTensor::quantize(&Tensor::from_vec(w, (out, inp), &Device::Cpu)?, ggml(ty))?;
            let bytes = q.data()?;
            let mut deq = vec![0f32; out * inp];
            assert!(blocks::dequantize(ty, &bytes, &mut deq));
            let x = crate::kernels::test_values(inp, 7);
            let bias = crate::kernels::test_values(out, 4);
            let row_bytes = bytes.len() / out;
            let mut got = vec![f32::NAN; out];
            product(ty, &bytes, &x, Some(&bias), &mut got, row_bytes, true)
                .map_err(crate::Error::into_candle)?;
            for (j, g) in got.iter().enumerate() {
                let row = &deq[j * inp..(j + 1) * inp];
                let exact: f64 = row
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    + bias[j] as f64;
                let bound: f64 = row
                    .chunks(32)
                    .zip(x.chunks(32))
                    .map(|(wb, xb)| {
                        let dx = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                        wb.iter().map(|v| v.abs() as f64).sum::<f64>() * dx / 2.0
                    })
                    .sum();
                let mag: f64 = row
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                assert!(
                    (*g as f64 - exact).abs() <= bound + mag * 1e-5,
                    "{ty} row {j}: {g} vs {exact}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn sizes_that_do_not_fit_are_errors() {
        let mut y = vec![0f32; 2];
        assert!(quant_gemv(QuantType::Q8_0, &[0u8; 34], &[0f32; 32], None, &mut y).is_err());
        assert!(quant_gemv(QuantType::Q8_0, &[0u8; 68], &[0f32; 31], None, &mut y).is_err());
        assert!(quant_gemv(QuantType::Q8_0, &[0u8; 68], &[0f32; 32], None, &mut y).is_ok());
    }
}
