//! An [`AttentionMask`] turned into what the CPU kernels apply per tile: a causal offset, a
//! kept-key range (and, for padding with holes, a `(batch, seq_k)` key bias) per batch row,
//! and a dense bias only for the keep / bias parts that have no structure.

use candle_core::{DType, Device, Tensor};

use super::cpu_tensor::CpuF32;
use super::problem::{DenseBias, KernelMask};
use crate::error::Result;
use crate::mask::AttentionMask;

/// Owned pieces of a [`KernelMask`].
#[derive(Debug, Default)]
pub(crate) struct MaskPlan {
    causal_offset: Option<usize>,
    key_bias: Option<Vec<f32>>,
    key_range: Option<Vec<(usize, usize)>>,
    /// f32 CPU tensor broadcastable to `(batch, heads, seq_q, seq_k)` (rank 4).
    dense: Option<Tensor>,
}

impl MaskPlan {
    /// Validates `mask` against `(batch, heads, seq_q, seq_k)` and splits it up.
    pub fn new(
        mask: Option<&AttentionMask>,
        b: usize,
        h: usize,
        sq: usize,
        sk: usize,
    ) -> Result<Self> {
        let Some(mask) = mask.filter(|m| !m.is_empty()) else {
            return Ok(Self::default());
        };
        mask.validate(b, h, sq, sk)?;
        let mut plan = Self {
            causal_offset: mask.causal_offset(),
            ..Self::default()
        };
        if let Some(keep) = mask.padding_keep()? {
            let keep: Vec<Vec<u8>> = keep.to_dtype(DType::U8)?.to_vec2()?;
            let mut ranges = Vec::with_capacity(b);
            let mut holes = false;
            for row in &keep {
                let first = row.iter().position(|&x| x != 0).unwrap_or(0);
                let end = row.iter().rposition(|&x| x != 0).map_or(0, |e| e + 1);
                holes |= row[first.min(end)..end].contains(&0);
                ranges.push((first.min(end), end));
            }
            if holes {
                plan.key_bias = Some(
                    keep.iter()
                        .flatten()
                        .map(|&x| if x != 0 { 0.0 } else { f32::NEG_INFINITY })
                        .collect(),
                );
            }
            plan.key_range = Some(ranges);
        }
        let dense = mask.unstructured_parts();
        if !dense.is_empty() {
            plan.dense = dense.to_bias(b, h, sq, sk, &Device::Cpu)?;
        }
        Ok(plan)
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
