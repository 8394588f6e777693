//! A borrowed `(in, out)` projection weight in a form the CPU products read.

use candle_core::Tensor;

use crate::kernels::gemm::packed::PackedWeight;

/// What the CPU kernels read of a stored projection.
#[derive(Debug, Clone, Copy)]
pub(crate) enum WeightRef<'a> {
    /// `(in, out)` f32 on the CPU.
    Tensor(&'a Tensor),
    /// Micro-kernel panels (packed at load, or on first need from mapped half-precision rows).
    Packed(&'a PackedWeight),
}
