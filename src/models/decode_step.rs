//! A decode step of a LLaMA-family layer whose projections are GGUF blocks on the CPU: one
//! token, batch 1, on plain f32 buffers. The tensor path makes ~25 candle ops a layer around
//! its products (norms, reshapes, the rotary embedding, views, adds), ~14 us a layer at
//! SmolLM2's size, a tenth of a decode step (see docs/performance.md). This path calls the
//! same kernels on the same values in the same order, so its logits are the tensor path's
//! bit for bit (tested below).

use candle_core::{Device, Tensor};
use candle_nn::RmsNorm;

use crate::attention::sdpa::{scaled_dot_product_attention, SdpaOptions};
use crate::error::{Error, Result};
use crate::kernels::decode::one_query;
use crate::kernels::rms_norm::rms_norm_rows;
use crate::models::kv_cache::KvCache;
use crate::models::rope::{RopeRow, RotaryEmbedding};
use crate::weights::quantized::QuantWeight;

/// A layer's attention projections as GGUF blocks: Q, K and V (llama.cpp's rotary row order
/// undone) with their fused bias, and the output projection with its bias.
#[derive(Debug, Clone)]
pub(crate) struct StepAttention {
    pub(crate) qkv: [QuantWeight; 3],
    pub(crate) qkv_bias: Option<Vec<f32>>,
    pub(crate) o: QuantWeight,
    pub(crate) o_bias: Option<Vec<f32>>,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
}

/// A layer's weights as the decode step reads them.
#[derive(Debug, Clone)]
pub(crate) struct DecodeStep {
    input_norm: Norm,
    post_norm: Norm,
    attn: StepAttention,
    gate: QuantWeight,
    up: QuantWeight,
    down: QuantWeight,
}

/// An RMS norm's weight and epsilon, as candle's fused op reads them.
#[derive(Debug, Clone)]
struct Norm {
    weight: Vec<f32>,
    eps: f32,
}

impl Norm {
    fn of(norm: &RmsNorm) -> Result<Self> {
        Ok(Self {
            weight: norm.weight().to_vec1::<f32>()?,
            eps: norm.eps() as f32,
        })
    }

    /// `x / sqrt(mean(x^2) + eps) * w`: candle-nn's `rms_norm` CPU kernel's expressions, in
    /// its order (the sum of squares left to right in f32).
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        rms_norm_rows(x, &self.weight, self.eps)
    }
}

impl DecodeStep {
    /// The step's weights: the norms (f32), the attention's blocks and the MLP's gate, up
    /// and down blocks; sizes checked.
    pub(crate) fn new(
        input_norm: &RmsNorm,
        post_norm: &RmsNorm,
        attn: StepAttention,
        [gate, up, down]: [QuantWeight; 3],
    ) -> Result<Self> {
        let (hd, h, kvh) = (attn.head_dim, attn.heads, attn.kv_heads);
        let d = attn.qkv[0].dims().1;
        let rows = attn.qkv.each_ref().map(|w| w.dims());
        let i = gate.dims().0;
        let fits = rows == [(h * hd, d), (kvh * hd, d), (kvh * hd, d)]
            && attn.o.dims() == (d, h * hd)
            && kvh > 0
            && h % kvh == 0
            && gate.dims() == (i, d)
            && up.dims() == (i, d)
            && down.dims() == (d, i)
            && attn
                .qkv_bias
                .as_ref()
                .is_none_or(|b| b.len() == (h + 2 * kvh) * hd)
            && attn.o_bias.as_ref().is_none_or(|b| b.len() == d);
        if !fits {
            return Err(Error::config(format!(
                "a decode step's weights do not fit together: q/k/v {rows:?}, o {:?}, gate {:?}, up {:?}, down {:?}",
                attn.o.dims(),
                gate.dims(),
                up.dims(),
                down.dims()
            )));
        }
        let (input_norm, post_norm) = (Norm::of(input_norm)?, Norm::of(post_norm)?);
        if input_norm.weight.len() != d || post_norm.weight.len() != d {
            return Err(Error::config(format!(
                "norms of {} and {} values for a hidden size of {d}",
                input_norm.weight.len(),
                post_norm.weight.len()
            )));
        }
        Ok(Self {
            input_norm,
            post_norm,
            attn,
            gate,
            up,
            down,
        })
    }

    /// The attention's weights.
    #[cfg(test)]
    pub(crate) fn attention(&self) -> &StepAttention {
        &self.attn
    }

    /// Replaces the attention's biases.
    #[cfg(test)]
    pub(crate) fn set_biases(&mut self, qkv: Vec<f32>, o: Vec<f32>) {
        self.attn.qkv_bias = Some(qkv);
        self.attn.o_bias = Some(o);
    }

    /// The layer on `x` (one token's hidden state, `hidden` f32 values, replaced by the
    /// layer's output) at position `cache.len()`, rotated by `angles` (that position's, else
    /// fetched from `rope`); the cache grows by one position. With a sliding `window`, the
    /// query reads only the last `window` keys.
    pub(crate) fn forward(
        &self,
        x: &mut [f32],
        (rope, angles): (&RotaryEmbedding, &RopeRow),
        cache: &mut KvCache,
        window: Option<usize>,
    ) -> Result<()> {
        let a = &self.attn;
        let (h, kvh, hd) = (a.heads, a.kv_heads, a.head_dim);
        let offset = cache.len();
        let fetched;
        let angles = if angles.position == offset {
            angles
        } else {
            fetched = rope.row(offset)?;
            &fetched
        };
        let normed = self.input_norm.apply(x);
        let mut qkv = vec![0f32; (h + 2 * kvh) * hd];
        let [q, k, v] = &a.qkv;
        QuantWeight::row_product(&[q, k, v], &normed, &mut qkv)?;
        if let Some(b) = &a.qkv_bias {
            add_into(&mut qkv, b);
        }
        // Q and K side by side: rotated in one pass.
        angles.rotate(&mut qkv[..(h + kvh) * hd])?;
        let (qs, kv) = qkv.split_at(h * hd);
        let (ks, vs) = kv.split_at(kvh * hd);
        let kt = Tensor::from_slice(ks, (1, kvh, 1, hd), &Device::Cpu)?;
        let vt = Tensor::from_slice(vs, (1, kvh, 1, hd), &Device::Cpu)?;
        let (k_all, v_all) = cache.append(&kt, &vt)?; // (1, kvh, offset + 1, hd)
        let total = offset + 1;
        let (k_all, v_all) = match window {
            Some(w) if total > w => (
                k_all.narrow(2, total - w, w)?,
                v_all.narrow(2, total - w, w)?,
            ),
            _ => (k_all, v_all),
        };
        let scale = 1.0 / (hd as f64).sqrt();
        let ctx = match one_query::attention_rows(qs, h, &k_all, &v_all, scale)? {
            Some(ctx) => ctx,
            // A cache this kernel does not read: the attention on tensors.
            None => {
                let q = Tensor::from_slice(qs, (1, h, 1, hd), &Device::Cpu)?;
                let opts = SdpaOptions {
                    scale: None,
                    need_weights: false,
                };
                let out = scaled_dot_product_attention(&q, &k_all, &v_all, None, opts)?;
                out.context.flatten_all()?.to_vec1::<f32>()?
            }
        };
        let d = x.len();
        let mut attn = vec![0f32; d];
        QuantWeight::row_product(&[&a.o], &ctx, &mut attn)?;
        if let Some(b) = &a.o_bias {
            add_into(&mut attn, b);
        }
        add_into(x, &attn);
        let normed = self.post_norm.apply(x);
        let mut gated = vec![0f32; self.gate.dims().0];
        QuantWeight::row_gated(&self.gate, &self.up, &normed, &mut gated)?;
        let mut mlp = vec![0f32; d];
        QuantWeight::row_product(&[&self.down], &gated, &mut mlp)?;
        add_into(x, &mlp);
        Ok(())
    }
}

/// `x += y` element by element.
fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::llama::{argmax_ids, LlamaModel};
    use candle_core::DType;

    /// The tiny GGUF decoders (`scripts/gen_gguf_fixtures.py`: grouped heads, linear and
    /// LLaMA 3 rotary scaling, a head dim apart from hidden / heads) in Q8_0 and Q4_1: after
    /// the same prompt, every decode step's logits on this path are the tensor path's bit for
    /// bit, as they are, with a sliding window, and with Q/K/V and output biases (Qwen2's:
    /// its fixture's hidden size, 48, leaves its matrices in f32, so no decode step).
    #[test]
    fn steps_are_the_tensor_path_bit_for_bit() -> Result<()> {
        let cases = [
            "llama_gqa",
            "llama_linear_rope",
            "llama3_rope",
            "llama_head_dim",
        ];
        for case in cases {
            for ty in ["q8_0", "q4_1"] {
                let path = format!(
                    "{}/tests/fixtures/gguf/{case}.{ty}.gguf",
                    env!("CARGO_MANIFEST_DIR")
                );
                let model = LlamaModel::from_gguf(&path, DType::F32, &Device::Cpu)?;
                assert!(model.has_decode_step(), "{case} {ty}: no decode step");
                for variant in ["as stored", "window", "biases"] {
                    let stepped = match variant {
                        "window" => model.clone().with_window(3),
                        "biases" => model.clone().with_biases()?,
                        _ => model.clone(),
                    };
                    let tensors = stepped.clone().without_decode_step();
                    let (mut a, mut b) = (stepped.new_caches(16), tensors.new_caches(16));
                    let prompt = Tensor::new(&[[1u32, 7, 3, 12, 5]], &Device::Cpu)?;
                    let mut la = stepped.forward_last(&prompt, &mut a)?;
                    let lb = tensors.forward_last(&prompt, &mut b)?;
                    assert_eq!(la.to_vec2::<f32>()?, lb.to_vec2::<f32>()?);
                    for step in 0..6 {
                        let next = argmax_ids(&la)?;
                        let ids = Tensor::new(&[[next[0]]], &Device::Cpu)?;
                        la = stepped.forward_last(&ids, &mut a)?;
                        let lb = tensors.forward_last(&ids, &mut b)?;
                        assert_eq!(
                            la.to_vec2::<f32>()?,
                            lb.to_vec2::<f32>()?,
                            "{case} {ty} {variant}: step {step}"
                        );
                    }
                    assert_eq!(a[0].len(), b[0].len());
                }
            }
        }
        Ok(())
    }

    /// The norm is candle-nn's fused op's values, bit for bit.
    #[test]
    fn the_norm_is_candles() -> Result<()> {
        let x: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let w: Vec<f32> = (0..96).map(|i| 0.5 + (i % 5) as f32 / 9.0).collect();
        let norm = RmsNorm::new(Tensor::new(w.as_slice(), &Device::Cpu)?, 1e-5);
        let want: Vec<f32> = candle_core::Module::forward(
            &norm,
            &Tensor::from_slice(&x, (1, 1, 96), &Device::Cpu)?,
        )?
        .flatten_all()?
        .to_vec1()?;
        assert_eq!(Norm::of(&norm)?.apply(&x), want);
        Ok(())
    }
}
