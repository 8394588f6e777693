//! `y = W x` for a weight kept as a GGUF file stores it (ggml blocks), one input row at a
//! time, every block read once per product: with AVX-512 (or AVX2 + FMA + F16C) the block
//! types of real files are unpacked in registers and summed as they are read
//! (`quant_gemv_avx512`, `quant_gemv_avx2`); otherwise each
//! task dequantizes four rows at a time into its scratch (exactly, as gguf-py does) and
//! multiplies them with the f32 matrix-vector kernel, giving the sums the same weight
//! dequantized to f32 would give, bit for bit.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::decode::gemv::{dot_rows, task_len, ROWS_PER_TASK};
use crate::kernels::decode::keep_warm;
use crate::kernels::decode::{quant_gemv_avx2, quant_gemv_avx512};
use crate::kernels::quant::blocks::{self, QuantType};
use crate::kernels::scratch::with_scratch;

/// Rows dequantized together (the f32 kernel's group of rows).
const GROUP: usize = 4;

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
    let len = task_len(out, GROUP, ROWS_PER_TASK);
    let row_dot = row_kernel(ty);
    let work = |(c, ys): (usize, &mut [f32])| -> Result<()> {
        let j0 = c * len;
        if let Some(row_dot) = row_dot {
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
                    if quant_gemv_avx512::supports(ty) {
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

    #[test]
    fn sizes_that_do_not_fit_are_errors() {
        let mut y = vec![0f32; 2];
        assert!(quant_gemv(QuantType::Q8_0, &[0u8; 34], &[0f32; 32], None, &mut y).is_err());
        assert!(quant_gemv(QuantType::Q8_0, &[0u8; 68], &[0f32; 31], None, &mut y).is_err());
        assert!(quant_gemv(QuantType::Q8_0, &[0u8; 68], &[0f32; 32], None, &mut y).is_ok());
    }
}
