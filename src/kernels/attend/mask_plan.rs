//! A mask as the CPU kernels apply it per tile: a causal offset, a kept-key range (and, for
//! padding with holes, a `(batch, seq_k)` key bias) per batch row, and a dense bias only for
//! the parts that have no structure. `crate::attention::mask` lowers an `AttentionMask` into
//! it; the kernels know nothing of the mask's other forms.

use candle_core::Tensor;

use crate::error::Result;
use crate::kernels::attend::problem::{DenseBias, KernelMask};
use crate::kernels::cpu_tensor::CpuF32;

/// Owned pieces of a [`KernelMask`]; the default masks nothing.
#[derive(Debug, Default)]
pub(crate) struct MaskPlan {
    /// Query `i` sees keys `0..=offset + i`.
    pub causal_offset: Option<usize>,
    /// `(batch, seq_k)`: 0 for a kept key, `-inf` for a masked one.
    pub key_bias: Option<Vec<f32>>,
    /// Per batch row, the range of keys outside which all are masked.
    pub key_range: Option<Vec<(usize, usize)>>,
    /// f32 CPU tensor broadcastable to `(batch, heads, seq_q, seq_k)` (rank 4).
    pub dense: Option<Tensor>,
}

impl MaskPlan {
    /// Whether the plan masks nothing.
    pub fn is_empty(&self) -> bool {
        self.causal_offset.is_none()
            && self.key_bias.is_none()
            && self.key_range.is_none()
            && self.dense.is_none()
    }

    /// The dense bias tensor to borrow for the duration of a kernel call.
    pub fn dense(&self) -> Option<&Tensor> {
        self.dense.as_ref()
    }

    /// The kernels' view; `dense` is the borrow of [`MaskPlan::dense`].
    pub fn kernel_mask<'a>(&'a self, dense: Option<&'a CpuF32<'a>>) -> Result<KernelMask<'a>> {
        let dense = match dense {
            Some(d) => {
                let dims = d.layout().dims();
                let stride = d.layout().stride();
                let mut strides = [0usize; 4];
                for i in 0..4 {
                    strides[i] = if dims[i] == 1 { 0 } else { stride[i] };
                }
                Some(DenseBias {
                    data: d.slice()?,
                    offset: d.layout().start_offset(),
                    strides,
                })
            }
            None => None,
        };
        Ok(KernelMask {
            causal_offset: self.causal_offset,
            key_bias: self.key_bias.as_deref(),
            key_range: self.key_range.as_deref(),
            dense,
        })
    }
}
