//! A decode step of a LLaMA-family layer whose projections are GGUF blocks on the CPU: one
//! token, batch 1, on plain f32 buffers; with the switches of the families that keep LLaMA's
//! layer shape (Qwen3's and Gemma 3's per-head q/k norms, Gemma's norms of the attention's
//! and MLP's outputs, a GELU-gated MLP, a scale of the scores apart from `head_dim^-1/2`). The tensor path makes ~25 candle ops a layer around
//! its products (norms, reshapes, the rotary embedding, views, adds), ~14 us a layer at
//! SmolLM2's size, a tenth of a decode step (see docs/performance-archive.md). This path calls the
//! same kernels on the same values in the same order, so its logits are the tensor path's
//! bit for bit (tested below).

use candle_core::{Device, Tensor};
use candle_nn::RmsNorm;

use crate::attention::sdpa::{scaled_dot_product_attention, SdpaOptions};
use crate::error::{Error, Result};
use crate::kernels::decode::one_query;
use crate::kernels::rms_norm::rms_norm_rows;
use crate::models::hidden_act::Activation;
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

/// A layer's RMS norms as the tensor path holds them.
pub(crate) struct StepNorms<'a> {
    /// The attention's input norm.
    pub(crate) input: &'a RmsNorm,
    /// The MLP's input norm.
    pub(crate) post: &'a RmsNorm,
    /// Per-head norms of the queries and keys before the rotation (Qwen3, Gemma 3).
    pub(crate) qk: Option<&'a (RmsNorm, RmsNorm)>,
    /// Norms of the attention's and the MLP's outputs before their residual adds (Gemma).
    pub(crate) out: Option<&'a (RmsNorm, RmsNorm)>,
}

/// A layer's weights as the decode step reads them.
#[derive(Debug, Clone)]
pub(crate) struct DecodeStep {
    input_norm: Norm,
    post_norm: Norm,
    qk_norms: Option<(Norm, Norm)>,
    out_norms: Option<(Norm, Norm)>,
    attn: StepAttention,
    gate: QuantWeight,
    up: QuantWeight,
    down: QuantWeight,
    /// The gate's activation: SiLU (SwiGLU) or the tanh GELU (GeGLU).
    activation: Activation,
    /// The multiplier of the scores.
    scale: f64,
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
    /// and down blocks, the gate's `activation` and the scores' `scale` (`None`:
    /// `head_dim^-1/2`); sizes checked, activations other than SiLU and the tanh GELU
    /// refused.
    pub(crate) fn new(
        norms: StepNorms,
        attn: StepAttention,
        [gate, up, down]: [QuantWeight; 3],
        activation: Activation,
        scale: Option<f64>,
    ) -> Result<Self> {
        if !matches!(activation, Activation::Silu | Activation::GeluTanh) {
            return Err(Error::config(format!(
                "a decode step gates with SiLU or the tanh GELU, not {activation:?}"
            )));
        }
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
        let pair = |p: Option<&(RmsNorm, RmsNorm)>| -> Result<Option<(Norm, Norm)>> {
            p.map(|(a, b)| Ok((Norm::of(a)?, Norm::of(b)?))).transpose()
        };
        let (input_norm, post_norm) = (Norm::of(norms.input)?, Norm::of(norms.post)?);
        let (qk_norms, out_norms) = (pair(norms.qk)?, pair(norms.out)?);
        let sizes = [&input_norm, &post_norm]
            .into_iter()
            .chain(out_norms.iter().flat_map(|(a, b)| [a, b]))
            .map(|n| (n.weight.len(), d))
            .chain(
                qk_norms
                    .iter()
                    .flat_map(|(a, b)| [a, b])
                    .map(|n| (n.weight.len(), hd)),
            );
        for (len, want) in sizes {
            if len != want {
                return Err(Error::config(format!(
                    "a norm of {len} values where the layer has {want} (hidden {d}, head {hd})"
                )));
            }
        }
        Ok(Self {
            input_norm,
            post_norm,
            qk_norms,
            out_norms,
            attn,
            gate,
            up,
            down,
            activation,
            scale: scale.unwrap_or(1.0 / (hd as f64).sqrt()),
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
        if let Some((qn, kn)) = &self.qk_norms {
            // Each head's `hd` values normed as one row.
            let (qs, ks) = qkv[..(h + kvh) * hd].split_at_mut(h * hd);
            qs.copy_from_slice(&qn.apply(qs));
            ks.copy_from_slice(&kn.apply(ks));
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
        let ctx = match one_query::attention_rows(qs, h, &k_all, &v_all, self.scale)? {
            Some(ctx) => ctx,
            // A cache this kernel does not read: the attention on tensors.
            None => {
                let q = Tensor::from_slice(qs, (1, h, 1, hd), &Device::Cpu)?;
                let opts = SdpaOptions {
                    scale: Some(self.scale),
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
        if let Some((after_attn, _)) = &self.out_norms {
            attn = after_attn.apply(&attn);
        }
        add_into(x, &attn);
        let normed = self.post_norm.apply(x);
        let i = self.gate.dims().0;
        let gated = match self.activation {
            Activation::Silu => {
                let mut gated = vec![0f32; i];
                QuantWeight::row_gated(&self.gate, &self.up, &normed, &mut gated)?;
                gated
            }
            // The tensor path's `gelu(g) * u`, element by element.
            _ => {
                let mut gu = vec![0f32; 2 * i];
                QuantWeight::row_product(&[&self.gate, &self.up], &normed, &mut gu)?;
                let (g, u) = gu.split_at(i);
                g.iter().zip(u).map(|(&g, &u)| gelu_tanh(g) * u).collect()
            }
        };
        let mut mlp = vec![0f32; d];
        QuantWeight::row_product(&[&self.down], &gated, &mut mlp)?;
        if let Some((_, after_mlp)) = &self.out_norms {
            mlp = after_mlp.apply(&mlp);
        }
        add_into(x, &mlp);
        Ok(())
    }
}

/// The tanh GELU as candle's CPU op computes it (`Tensor::gelu` on f32), expression for
/// expression.
fn gelu_tanh(v: f32) -> f32 {
    // candle-core's `SQRT_TWO_OVER_PI_F32`, as written there.
    #[allow(clippy::excessive_precision)]
    const SQRT_TWO_OVER_PI: f32 = 0.79788456080286535587989211986876373;
    0.5 * v * (1.0 + f32::tanh(SQRT_TWO_OVER_PI * v * (1.0 + 0.044715 * v * v)))
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
        let both: &[&str] = &["q8_0", "q4_1"];
        let cases = [
            ("llama_gqa", both),
            ("llama_linear_rope", both),
            ("llama3_rope", both),
            ("llama_head_dim", both),
            // Per-head q/k norms; Gemma's `1 + w` and output norms, GeGLU, two rotations.
            ("qwen3", &["q8_0"]),
            ("gemma3", &["q8_0"]),
        ];
        for (case, types) in cases {
            for &ty in types {
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

    /// The GELU is candle's `Tensor::gelu` on f32, bit for bit, across its range.
    #[test]
    fn the_gelu_is_candles() -> Result<()> {
        let x: Vec<f32> = (0..4001).map(|i| (i as f32 - 2000.0) / 150.0).collect();
        let want = Tensor::new(x.as_slice(), &Device::Cpu)?
            .gelu()?
            .to_vec1::<f32>()?;
        let got: Vec<f32> = x.iter().map(|&v| gelu_tanh(v)).collect();
        assert_eq!(got, want);
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
