//! f16 / bf16 CPU tensors widened to f32 on the rayon pool (candle's conversion runs on
//! one thread): the decoder computes in f32 on the CPU whatever its weights' dtype, and
//! widens a half-precision weight once per product of many rows (a prompt's prefill).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use candle_core::{CpuStorage, DType, Storage, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::Result;

/// A weight element these kernels read sixteen at a time as f32 lanes.
pub(crate) trait Load16: Copy + Send + Sync {
    /// The value as f32.
    fn to_f32(self) -> f32;

    /// Sixteen values from `p` widened to f32.
    ///
    /// # Safety
    /// AVX-512F; `p` points at sixteen readable values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> __m512;
}

impl Load16 for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    /// # Safety
    /// As [`Load16::load16`]: AVX-512F; `p` points at sixteen readable values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_loadu_ps(p)
    }
}

impl Load16 for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }

    /// bf16 is the top half of an f32: zero-extend to 32 bits and shift.
    ///
    /// # Safety
    /// As [`Load16::load16`]: AVX-512F; `p` points at sixteen readable values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
}

impl Load16 for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    /// The hardware conversion (`vcvtph2ps`).
    ///
    /// # Safety
    /// As [`Load16::load16`]: AVX-512F; `p` points at sixteen readable values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

/// Values per task.
const CHUNK: usize = 1 << 16;

/// Little-endian f16 (or bf16) bytes `src` widened to f32 (exact) into `out` (as many values
/// as `src` holds), 64 at a time through the CPU's conversion instructions.
pub(crate) fn widen_half_bytes(src: &[u8], bf16: bool, out: &mut [f32]) {
    let mut bits = [0u16; 64];
    for (src, dst) in src.chunks(128).zip(out.chunks_mut(64)) {
        let n = src.len() / 2;
        for (b, c) in bits.iter_mut().zip(src.chunks_exact(2)) {
            *b = u16::from_le_bytes([c[0], c[1]]);
        }
        if bf16 {
            for (d, &b) in dst.iter_mut().zip(&bits[..n]) {
                *d = f32::from_bits(u32::from(b) << 16);
            }
        } else {
            let halves: &[half::f16] = half::slice::HalfBitsSliceExt::reinterpret_cast(&bits[..n]);
            halves.convert_to_f32_slice(&mut dst[..n]);
        }
    }
}

/// `t` as f32 (contiguous); other dtypes and devices through candle's conversion.
pub(crate) fn to_f32(t: &Tensor) -> Result<Tensor> {
    if t.dtype() == DType::F32 || !t.device().is_cpu() {
        return Ok(t.to_dtype(DType::F32)?);
    }
    let t = t.contiguous()?;
    let mut out = vec![0f32; t.elem_count()];
    {
        let (guard, layout) = t.storage_and_layout();
        let Some((s, e)) = layout.contiguous_offsets() else {
            return Ok(t.to_dtype(DType::F32)?);
        };
        match &*guard {
            Storage::Cpu(CpuStorage::BF16(v)) => out
                .par_chunks_mut(CHUNK)
                .zip(v[s..e].par_chunks(CHUNK))
                .for_each(|(o, h)| h.convert_to_f32_slice(o)),
            Storage::Cpu(CpuStorage::F16(v)) => out
                .par_chunks_mut(CHUNK)
                .zip(v[s..e].par_chunks(CHUNK))
                .for_each(|(o, h)| h.convert_to_f32_slice(o)),
            _ => return Ok(t.to_dtype(DType::F32)?),
        }
    }
    Ok(Tensor::from_vec(out, t.shape(), t.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn equals_candles_conversion() -> Result<()> {
        let n = 3 * CHUNK + 17;
        let v: Vec<f32> = (0..n).map(|i| (i as f32 - 5000.0) * 0.37).collect();
        let t = Tensor::from_vec(v, n, &Device::Cpu)?;
        for dt in [DType::BF16, DType::F16] {
            let h = t.to_dtype(dt)?;
            let want: Vec<f32> = h.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let got = to_f32(&h)?;
            assert_eq!(got.dims(), t.dims());
            assert_eq!(got.flatten_all()?.to_vec1::<f32>()?, want);
            // A strided view too.
            let ht = h.narrow(0, 1, n - 1)?;
            let want: Vec<f32> = ht.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            assert_eq!(to_f32(&ht)?.flatten_all()?.to_vec1::<f32>()?, want);
        }
        Ok(())
    }
}
