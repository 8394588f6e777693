//! One mask type for every way of hiding keys from queries.
//!
//! An [`AttentionMask`] is a combination of parts, each with its meaning in the name of its
//! constructor: [`AttentionMask::causal`], [`AttentionMask::padding`] (1 = keep, the Hugging
//! Face `attention_mask` convention), [`AttentionMask::keep`] / [`AttentionMask::block`]
//! (boolean masks broadcastable to `(batch, heads, seq_q, seq_k)`), and
//! [`AttentionMask::bias`] (an additive float bias). Parts combine with
//! [`AttentionMask::and`]: a key is hidden when any part hides it, biases add up.
//!
//! Hidden keys get attention weight exactly 0; a query whose keys are all hidden gets all-zero
//! weights and a zero context vector (never NaN).

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::kernels::attend::mask_plan::MaskPlan;

/// One constraint on which keys a query may attend to.
#[derive(Debug, Clone)]
pub enum MaskPart {
    /// Query `i` sees keys `0..=offset + i` (`offset` = keys already cached before this chunk).
    Causal {
        /// Keys already cached before this chunk of queries.
        offset: usize,
    },
    /// `(batch, seq_k)`, 1 = keep, 0 = padding. Stored as u8.
    Padding(Tensor),
    /// Broadcastable to `(batch, heads, seq_q, seq_k)` (rank <= 4, right aligned); non-zero = keep.
    Keep(Tensor),
    /// Broadcastable to `(batch, heads, seq_q, seq_k)`; added to the scaled scores (f32).
    Bias(Tensor),
}

/// A combination of [`MaskPart`]s; the empty mask hides nothing.
#[derive(Debug, Clone, Default)]
pub struct AttentionMask {
    parts: Vec<MaskPart>,
}

impl AttentionMask {
    /// The mask that hides nothing.
    pub fn none() -> Self {
        Self::default()
    }

    /// Causal mask: query `i` attends to keys `0..=i`.
    pub fn causal() -> Self {
        Self::causal_with_offset(0)
    }

    /// Causal mask for a chunk of queries that comes after `offset` cached keys: query `i`
    /// (position `offset + i`) attends to keys `0..=offset + i`.
    pub fn causal_with_offset(offset: usize) -> Self {
        Self {
            parts: vec![MaskPart::Causal { offset }],
        }
    }

    /// Padding mask from a `(batch, seq_k)` tensor of 0/1 values, 1 = keep (the Hugging Face
    /// `attention_mask` convention). Any integer or float dtype; values other than 0 and 1 are
    /// an error.
    ///
    /// # Shapes
    /// - `attention_mask`: `(batch, seq_k)`
    pub fn padding(attention_mask: &Tensor) -> Result<Self> {
        let (_b, _k) = attention_mask.dims2().map_err(|_| {
            Error::Mask(format!(
                "a padding mask must have shape (batch, seq_k), found {:?}",
                attention_mask.dims()
            ))
        })?;
        let as_f32 = attention_mask.to_dtype(DType::F32)?;
        let bad = as_f32
            .ne(0f32)?
            .mul(&as_f32.ne(1f32)?)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
        if bad > 0.0 {
            let values: Vec<f32> = as_f32.flatten_all()?.to_vec1()?;
            let first = values
                .iter()
                .find(|v| **v != 0.0 && **v != 1.0)
                .copied()
                .unwrap_or(f32::NAN);
            return Err(Error::Mask(format!(
                "a padding mask must hold only 0 (padding) and 1 (keep); found {bad} other values, e.g. {first}"
            )));
        }
        Ok(Self {
            parts: vec![MaskPart::Padding(as_f32.to_dtype(DType::U8)?)],
        })
    }

    /// Boolean mask where a non-zero entry means "may attend". Broadcastable to
    /// `(batch, heads, seq_q, seq_k)` (rank 2 `(seq_q, seq_k)`, 3 `(batch, seq_q, seq_k)` or 4).
    ///
    /// # Shapes
    /// - `keep`: `(seq_q, seq_k)`, `(batch, seq_q, seq_k)` or `(batch, heads, seq_q, seq_k)`
    pub fn keep(keep: &Tensor) -> Result<Self> {
        check_rank(keep, "keep")?;
        Ok(Self {
            parts: vec![MaskPart::Keep(keep.ne(0f32)?.to_dtype(DType::U8)?)],
        })
    }

    /// Boolean mask where a non-zero entry means "must not attend" (PyTorch's boolean
    /// `attn_mask` / `key_padding_mask` convention). Broadcastable like [`AttentionMask::keep`].
    ///
    /// # Shapes
    /// - `block`: as `keep` in [`AttentionMask::keep`]
    pub fn block(block: &Tensor) -> Result<Self> {
        check_rank(block, "block")?;
        Ok(Self {
            parts: vec![MaskPart::Keep(block.eq(0f32)?.to_dtype(DType::U8)?)],
        })
    }

    /// Additive float bias, broadcastable to `(batch, heads, seq_q, seq_k)`, added to the
    /// scaled scores before the softmax (ALiBi, relative position biases, ...). `-inf`
    /// entries hide keys exactly.
    ///
    /// # Shapes
    /// - `bias`: broadcastable to `(batch, heads, seq_q, seq_k)`, any float dtype
    pub fn bias(bias: &Tensor) -> Result<Self> {
        check_rank(bias, "bias")?;
        Ok(Self {
            parts: vec![MaskPart::Bias(bias.to_dtype(DType::F32)?)],
        })
    }

    /// Both masks at once: a key is hidden if either hides it; biases add.
    pub fn and(mut self, other: AttentionMask) -> Self {
        self.parts.extend(other.parts);
        self
    }

    /// The parts of this mask.
    pub fn parts(&self) -> &[MaskPart] {
        &self.parts
    }

    /// Whether the mask hides nothing.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The causal offset if the mask has a causal part (the smallest one when several).
    pub fn causal_offset(&self) -> Option<usize> {
        self.parts
            .iter()
            .filter_map(|p| match p {
                MaskPart::Causal { offset } => Some(*offset),
                _ => None,
            })
            .min()
    }

    /// The `(batch, seq_k)` keep tensor of the padding parts (multiplied together), if any.
    pub fn padding_keep(&self) -> Result<Option<Tensor>> {
        let mut out: Option<Tensor> = None;
        for part in &self.parts {
            if let MaskPart::Padding(p) = part {
                out = Some(match out {
                    None => p.clone(),
                    Some(o) => o.mul(p)?,
                });
            }
        }
        Ok(out)
    }

    /// Whether the mask only has causal and padding parts (the structured masks that the
    /// tiled kernels handle without materialising a `(seq_q, seq_k)` matrix).
    pub fn is_structured(&self) -> bool {
        self.parts
            .iter()
            .all(|p| matches!(p, MaskPart::Causal { .. } | MaskPart::Padding(_)))
    }

    /// The keep / block / bias parts alone (the ones without structure, which the CPU
    /// kernels apply from a materialised bias).
    pub(crate) fn unstructured_parts(&self) -> AttentionMask {
        AttentionMask {
            parts: self
                .parts
                .iter()
                .filter(|p| matches!(p, MaskPart::Keep(_) | MaskPart::Bias(_)))
                .cloned()
                .collect(),
        }
    }

    /// Checks that every part fits attention of the given sizes.
    pub fn validate(&self, b: usize, h: usize, q: usize, k: usize) -> Result<()> {
        for part in &self.parts {
            match part {
                MaskPart::Causal { .. } => {}
                MaskPart::Padding(p) => {
                    let (pb, pk) = p.dims2()?;
                    if (pb, pk) != (b, k) {
                        return Err(Error::Mask(format!(
                            "padding mask has shape [{pb}, {pk}], expected (batch, seq_k) = [{b}, {k}]"
                        )));
                    }
                }
                MaskPart::Keep(t) => check_broadcast(t, "keep", b, h, q, k)?,
                MaskPart::Bias(t) => check_broadcast(t, "bias", b, h, q, k)?,
            }
        }
        Ok(())
    }

    /// The mask as an f32 additive bias broadcastable to `(batch, heads, seq_q, seq_k)`:
    /// 0 where a key is visible, `-inf` where it is hidden, plus any float bias.
    /// `None` for the empty mask.
    ///
    /// # Shapes
    /// - returns: `(batch | 1, heads | 1, seq_q, seq_k)`
    pub fn to_bias(
        &self,
        b: usize,
        h: usize,
        q: usize,
        k: usize,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        self.validate(b, h, q, k)?;
        let mut acc: Option<Tensor> = None;
        for part in &self.parts {
            let t = match part {
                MaskPart::Causal { offset } => causal_bias(q, k, *offset, device)?,
                MaskPart::Padding(p) => {
                    keep_to_bias(&p.to_device(device)?)?.reshape((b, 1, 1, k))? // (b, 1, 1, k)
                }
                MaskPart::Keep(t) => keep_to_bias(&to_rank4(&t.to_device(device)?)?)?,
                MaskPart::Bias(t) => to_rank4(&t.to_device(device)?)?,
            };
            acc = Some(match acc {
                None => t,
                Some(a) => a.broadcast_add(&t)?,
            });
        }
        Ok(acc)
    }
}

/// Lowers `mask` into what the CPU kernels apply per tile, after validating it against
/// `(batch, heads, seq_q, seq_k)`.
pub(crate) fn kernel_plan(
    mask: Option<&AttentionMask>,
    b: usize,
    h: usize,
    sq: usize,
    sk: usize,
) -> Result<MaskPlan> {
    let Some(mask) = mask.filter(|m| !m.is_empty()) else {
        return Ok(MaskPlan::default());
    };
    mask.validate(b, h, sq, sk)?;
    let mut plan = MaskPlan {
        causal_offset: mask.causal_offset(),
        ..MaskPlan::default()
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

/// `(1, 1, q, k)` f32: 0 where `j <= offset + i`, `-inf` above.
fn causal_bias(q: usize, k: usize, offset: usize, device: &Device) -> Result<Tensor> {
    // Built where it is used: a GPU gets two index vectors, not q * k host values. An
    // offset past the keys shows them all, as `k` does (and fits the u32 indices).
    let offset = offset.min(k);
    let last = Tensor::arange(offset as u32, (offset + q) as u32, device)?.reshape((q, 1))?;
    let keys = Tensor::arange(0u32, k as u32, device)?.reshape((1, k))?;
    let keep = keys.broadcast_le(&last)?; // (q, k): key j <= offset + i
    Ok(keep_to_bias(&keep)?.reshape((1, 1, q, k))?)
}

/// u8 keep (non-zero = keep) to f32 0 / -inf, same shape.
fn keep_to_bias(keep: &Tensor) -> Result<Tensor> {
    let zeros = Tensor::zeros(keep.shape(), DType::F32, keep.device())?;
    let neg = Tensor::full(f32::NEG_INFINITY, keep.shape(), keep.device())?;
    Ok(keep.where_cond(&zeros, &neg)?)
}

fn to_rank4(t: &Tensor) -> Result<Tensor> {
    let dims = t.dims();
    let mut shape = vec![1usize; 4 - dims.len()];
    shape.extend_from_slice(dims);
    Ok(t.reshape(shape)?)
}

fn check_rank(t: &Tensor, what: &str) -> Result<()> {
    let r = t.rank();
    if !(2..=4).contains(&r) {
        return Err(Error::Mask(format!(
            "a {what} mask must have rank 2 (seq_q, seq_k), 3 (batch, seq_q, seq_k) or 4 (batch, heads, seq_q, seq_k); found shape {:?}",
            t.dims()
        )));
    }
    Ok(())
}

fn check_broadcast(t: &Tensor, what: &str, b: usize, h: usize, q: usize, k: usize) -> Result<()> {
    let dims = t.dims();
    let target = [b, h, q, k];
    let offset = 4 - dims.len();
    let fits = dims
        .iter()
        .enumerate()
        .all(|(i, &d)| d == 1 || d == target[offset + i]);
    if !fits {
        return Err(Error::Mask(format!(
            "{what} mask of shape {dims:?} does not broadcast to (batch, heads, seq_q, seq_k) = {target:?}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_bias_hides_future_keys() -> Result<()> {
        let bias = causal_bias(2, 3, 1, &Device::Cpu)?;
        let v: Vec<Vec<f32>> = bias.reshape((2, 3))?.to_vec2()?;
        assert_eq!(v[0], vec![0.0, 0.0, f32::NEG_INFINITY]);
        assert_eq!(v[1], vec![0.0, 0.0, 0.0]);
        // An offset past the keys (even past u32's range) shows them all.
        for offset in [3, 1 << 20, usize::MAX - 8] {
            let all: Vec<f32> = causal_bias(2, 3, offset, &Device::Cpu)?
                .flatten_all()?
                .to_vec1()?;
            assert_eq!(all, vec![0.0; 6], "offset {offset}");
        }
        Ok(())
    }

    #[test]
    fn padding_rejects_values_other_than_zero_and_one() -> Result<()> {
        let m = Tensor::new(&[[1i64, 2, 0]], &Device::Cpu)?;
        let err = AttentionMask::padding(&m).unwrap_err();
        assert!(matches!(err, Error::Mask(_)), "{err}");
        assert!(err.to_string().contains("only 0"), "{err}");
        Ok(())
    }

    #[test]
    fn padding_of_wrong_shape_is_an_error() -> Result<()> {
        let m = Tensor::new(&[[1u8, 1, 0]], &Device::Cpu)?;
        let mask = AttentionMask::padding(&m)?;
        let err = mask.to_bias(2, 1, 3, 3, &Device::Cpu).unwrap_err();
        assert!(
            err.to_string().contains("expected (batch, seq_k) = [2, 3]"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn keep_mask_must_broadcast() -> Result<()> {
        let m = Tensor::ones((3, 5), DType::U8, &Device::Cpu)?;
        let mask = AttentionMask::keep(&m)?;
        assert!(mask.to_bias(1, 2, 3, 5, &Device::Cpu)?.is_some());
        assert!(mask.to_bias(1, 2, 4, 5, &Device::Cpu).is_err());
        Ok(())
    }
}
