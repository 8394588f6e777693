//! A projection weight stored in the form its device multiplies fastest.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::error::Result;
use crate::kernels::cpu_tensor::CpuF32;
use crate::kernels::gemm::matrix::HalfSource;
use crate::kernels::gemm::packed::{self, PackedWeight};
use crate::kernels::gemm::WeightRef;
use crate::weights::quantized::QuantWeight;

/// The `(in, out)` form of a `(out, in)` checkpoint weight (the matrix `x W^T` multiplies
/// by), stored as:
/// - packed panels on a CPU with AVX-512 or AVX2 + FMA in f32 (the fused path's micro-kernels
///   stream them without repacking on every call; the explicit path unpacks them), or, for
///   a half-precision checkpoint, its mapped rows until a long input packs them;
/// - a contiguous `(in, out)` tensor on other CPUs (the matrix multiply reads it without
///   repacking), or the transposed view of the `(out, in)` tensor on other devices.
///
/// Only one copy is kept, so memory does not grow.
#[derive(Debug, Clone)]
pub(crate) enum StoredWeight {
    Tensor(Tensor),
    Packed(Arc<PackedWeight>),
    /// GGUF weights in their blocks, `(out_i, in)` each, stacked along the outputs (Q, K, V
    /// of a fused projection may each have their own type).
    Quantized(Arc<[QuantWeight]>),
}

impl StoredWeight {
    /// Stores `weight` `(out, in)`; `splits` are output indices where independently usable
    /// column ranges start (Q | K, V of a fused projection).
    pub fn new(weight: &Tensor, splits: &[usize]) -> Result<Self> {
        let t = weight.t()?; // (in, out)
        if !weight.device().is_cpu() {
            return Ok(Self::Tensor(t));
        }
        if weight.dtype() == DType::F32 && packed::available() {
            let view = CpuF32::new(weight, "weight")?;
            if let Some(p) = PackedWeight::pack(view.matrix()?.t(), splits) {
                return Ok(Self::Packed(Arc::new(p)));
            }
        }
        Ok(Self::Tensor(t.contiguous()?))
    }

    /// Half-precision `(out_i, in)` matrices stacked along their outputs, read where they are
    /// stored and packed on first need ([`PackedWeight::from_half`]; `splits` as for
    /// [`StoredWeight::new`]); `Ok(None)` on a CPU without the packed kernels, where the
    /// caller loads tensors instead.
    pub fn from_half(source: Arc<dyn HalfSource>, splits: &[usize]) -> Result<Option<Self>> {
        Ok(PackedWeight::from_half(source, splits)?.map(|p| Self::Packed(Arc::new(p))))
    }

    /// The `(in, out)` matrix as a tensor (a copy when packed or quantized).
    pub fn tensor(&self) -> Result<Tensor> {
        match self {
            Self::Quantized(parts) => {
                let rows = parts
                    .iter()
                    .map(|q| q.dequantize(&Device::Cpu))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&rows, 0)?.t()?) // (in, out)
            }
            Self::Tensor(t) => Ok(t.clone()),
            Self::Packed(p) => {
                let (k, n) = p.dims();
                Ok(Tensor::from_vec(p.unpack()?, (k, n), &Device::Cpu)?) // (in, out)
            }
        }
    }

    /// `(in, out)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match self {
            Self::Quantized(parts) => {
                let cols = parts.first().map_or(0, |q| q.dims().1);
                Ok((cols, parts.iter().map(|q| q.dims().0).sum()))
            }
            Self::Tensor(t) => Ok(t.dims2()?),
            Self::Packed(p) => Ok(p.dims()),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Self::Tensor(t) => t.dtype(),
            Self::Packed(_) | Self::Quantized(_) => DType::F32,
        }
    }

    pub fn elem_count(&self) -> usize {
        match self {
            Self::Tensor(t) => t.elem_count(),
            Self::Packed(p) => p.dims().0 * p.dims().1,
            Self::Quantized(parts) => parts.iter().map(|q| q.dims().0 * q.dims().1).sum(),
        }
    }

    /// The view the CPU kernels read, when they can (f32 on the CPU).
    pub fn cpu_f32(&self) -> Option<WeightRef<'_>> {
        match self {
            Self::Packed(p) => Some(WeightRef::Packed(p)),
            Self::Tensor(t) if t.device().is_cpu() && t.dtype() == DType::F32 => {
                Some(WeightRef::Tensor(t))
            }
            Self::Tensor(_) | Self::Quantized(_) => None,
        }
    }

    /// `x W` on the blocks for a quantized weight (`x` `(rows, in)` f32 on the CPU); `None`
    /// for the other forms.
    pub fn quantized_forward(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let Self::Quantized(parts) = self else {
            return Ok(None);
        };
        if let Some(y) = QuantWeight::stacked_rows(parts, x)? {
            return Ok(Some(y));
        }
        let outs = parts
            .iter()
            .map(|q| q.forward(x))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Tensor::cat(&outs, candle_core::D::Minus1)?))
    }
}
