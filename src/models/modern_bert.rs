//! ModernBERT: the pre-norm encoder form beside BERT's post-norm one, from the same parts
//! (this crate's attention, [`RotaryEmbedding`], candle-nn's LayerNorm): token embeddings and
//! a LayerNorm (no position table); per layer `x + Wo(attn(attn_norm(x)))` (no `attn_norm` in
//! layer 0) with rotary positions and, in the local layers, a window of `local_attention / 2`
//! keys on each side, then `x + Wo(act(input) * gate)` of `Wi(mlp_norm(x))` (GeGLU); a final
//! LayerNorm. Global layers (every `global_attn_every_n_layers`-th from layer 0, or as
//! `layer_types` says) rotate with `global_rope_theta`, local ones with `local_rope_theta`.

use candle_core::{Device, Module, Tensor};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};
use serde_json::Value;

use crate::attention::explicit::explicit_probed;
use crate::attention::mask::AttentionMask;
use crate::attention::multi_head::MultiHeadSelfAttention;
use crate::attention::sdpa::{scaled_dot_product_attention, SdpaOptions};
use crate::error::{Error, Result};
use crate::models::encoder_output::EncoderOutput;
use crate::models::hidden_act::Activation;
use crate::models::rope::{RopeConfig, RopeLayout, RopeScaling, RotaryEmbedding};
use crate::models::trace::{graph_input, probe, ForwardTrace, TraceOptions};
use crate::weights::config::{AttentionConfig, HfConfig};
use crate::weights::layout::WeightLayout;

/// The fields of a ModernBERT `config.json` beyond [`HfConfig`]'s.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ModernBertConfig {
    norm_eps: f64,
    norm_bias: bool,
    /// Keys on each side a local layer's query sees (`local_attention / 2`).
    half_window: usize,
    /// Per layer: whether it is global.
    global: Vec<bool>,
    global_theta: f64,
    local_theta: f64,
    activation: Activation,
    max_positions: usize,
}

impl ModernBertConfig {
    /// Reads `raw`, refusing what changes the math and is not implemented.
    pub(crate) fn from_raw(raw: &Value, cfg: &HfConfig) -> Result<Self> {
        let f64_of = |k: &str| raw.get(k).and_then(Value::as_f64);
        let u64_of = |k: &str| raw.get(k).and_then(Value::as_u64);
        let bool_of = |k: &str| raw.get(k).and_then(Value::as_bool);
        let refusal = |field: &str, value: &Value, why: &str| {
            Error::config(format!(
                "`{field}` = {value} is not supported for ModernBERT ({why})"
            ))
        };
        if let Some(v) = raw.get("is_causal").filter(|v| **v == Value::Bool(true)) {
            return Err(refusal("is_causal", v, "the encoder attends both ways"));
        }
        let layers = cfg.num_hidden_layers;
        let global: Vec<bool> = match raw.get("layer_types").and_then(Value::as_array) {
            Some(types) => {
                if types.len() != layers {
                    return Err(Error::config(format!(
                        "`layer_types` has {} entries for {layers} layers",
                        types.len()
                    )));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("full_attention") => Ok(true),
                        Some("sliding_attention") => Ok(false),
                        _ => Err(Error::config(format!(
                            "`layer_types` entry {t} is not supported (full_attention, \
                             sliding_attention)"
                        ))),
                    })
                    .collect::<Result<_>>()?
            }
            None => {
                let every = u64_of("global_attn_every_n_layers").unwrap_or(3).max(1) as usize;
                (0..layers).map(|i| i % every == 0).collect()
            }
        };
        // transformers 5: `rope_parameters` keyed by layer type; before: two thetas.
        let theta_of = |kind: &str, old: &str, default: f64| -> Result<f64> {
            match raw.get("rope_parameters").and_then(|p| p.get(kind)) {
                Some(p) => {
                    let t = p
                        .get("rope_type")
                        .and_then(Value::as_str)
                        .unwrap_or("default");
                    if t != "default" {
                        return Err(refusal(
                            "rope_parameters",
                            p,
                            "only default rotation is implemented",
                        ));
                    }
                    Ok(p.get("rope_theta")
                        .and_then(Value::as_f64)
                        .unwrap_or(default))
                }
                None => Ok(f64_of(old).unwrap_or(default)),
            }
        };
        if let Some(s) = raw.get("rope_scaling").filter(|v| !v.is_null()) {
            return Err(refusal(
                "rope_scaling",
                s,
                "only default rotation is implemented",
            ));
        }
        let local_attention = u64_of("local_attention").unwrap_or(128) as usize;
        let act = raw
            .get("hidden_activation")
            .and_then(Value::as_str)
            .unwrap_or("gelu");
        Ok(Self {
            norm_eps: f64_of("norm_eps").unwrap_or(1e-5),
            norm_bias: bool_of("norm_bias").unwrap_or(false),
            half_window: local_attention / 2,
            global,
            global_theta: theta_of("full_attention", "global_rope_theta", 160_000.0)?,
            local_theta: theta_of("sliding_attention", "local_rope_theta", 10_000.0)?,
            activation: Activation::from_name(act)?,
            max_positions: cfg.max_position_embeddings.unwrap_or(8192),
        })
    }
}

/// `LayerNorm` with its bias where the config has one.
fn layer_norm(vb: VarBuilder, d: usize, cfg: &ModernBertConfig) -> Result<LayerNorm> {
    let w = vb.get(d, "weight")?;
    Ok(match cfg.norm_bias {
        true => LayerNorm::new(w, vb.get(d, "bias")?, cfg.norm_eps),
        false => LayerNorm::new_no_bias(w, cfg.norm_eps),
    })
}

/// [`LayerNorm`] in candle's differentiable ops.
fn layer_norm_diff(n: &LayerNorm, x: &Tensor) -> Result<Tensor> {
    let bias = match n.bias() {
        Some(b) => b.clone(),
        None => n.weight().zeros_like()?,
    };
    Ok(candle_nn::ops::layer_norm_slow(
        x,
        n.weight(),
        &bias,
        n.eps() as f32,
    )?)
}

/// `(out, in)` weight and its bias where the checkpoint has one.
fn linear(vb: VarBuilder, out: usize, inp: usize) -> Result<Linear> {
    let w = vb.get((out, inp), "weight")?;
    let b = match vb.contains_tensor("bias") {
        true => Some(vb.get(out, "bias")?),
        false => None,
    };
    Ok(Linear::new(w, b))
}

/// One pre-norm layer.
struct PreNormLayer {
    /// `None` in layer 0 (its input is the embeddings' norm).
    attn_norm: Option<LayerNorm>,
    attention: MultiHeadSelfAttention,
    mlp_norm: LayerNorm,
    wi: Linear,
    wo: Linear,
    activation: Activation,
    /// A local layer: the window and the local rotation.
    local: bool,
}

impl PreNormLayer {
    fn load(vb: VarBuilder, cfg: &HfConfig, mcfg: &ModernBertConfig, i: usize) -> Result<Self> {
        let d = cfg.hidden_size;
        let heads = cfg.num_attention_heads;
        let acfg = AttentionConfig::new(WeightLayout::ModernBert, heads)
            .with_hidden_size(d)
            .with_kv_heads(heads);
        let inter = cfg
            .intermediate_size
            .ok_or_else(|| Error::config("`intermediate_size` is missing"))?;
        Ok(Self {
            attn_norm: match i {
                0 => None,
                _ => Some(layer_norm(vb.pp("attn_norm"), d, mcfg)?),
            },
            attention: MultiHeadSelfAttention::load(vb.pp("attn"), &acfg)?,
            mlp_norm: layer_norm(vb.pp("mlp_norm"), d, mcfg)?,
            wi: linear(vb.pp("mlp").pp("Wi"), 2 * inter, d)?,
            wo: linear(vb.pp("mlp").pp("Wo"), d, inter)?,
            activation: mcfg.activation,
            local: !mcfg.global.get(i).copied().unwrap_or(true),
        })
    }

    /// `Wo(act(input) * gate)` with `input, gate` the two halves of `Wi(x)`.
    fn mlp(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.wi.forward(x)?;
        let inter = h.dim(candle_core::D::Minus1)? / 2;
        let input = h.narrow(candle_core::D::Minus1, 0, inter)?;
        let gate = h.narrow(candle_core::D::Minus1, inter, inter)?;
        Ok(self.wo.forward(&(self.activation.apply(&input)? * gate)?)?)
    }
}

/// The whole pre-norm encoder.
pub(crate) struct ModernBert {
    tok: Embedding,
    norm: LayerNorm,
    layers: Vec<PreNormLayer>,
    final_norm: LayerNorm,
    /// Global, then local.
    ropes: [RotaryEmbedding; 2],
    half_window: usize,
    max_positions: usize,
}

impl ModernBert {
    /// Loads the encoder under `vb` (the base model's root: `embeddings.tok_embeddings`,
    /// `layers.N`, `final_norm`).
    pub(crate) fn load(vb: VarBuilder, cfg: &HfConfig, mcfg: &ModernBertConfig) -> Result<Self> {
        let d = cfg.hidden_size;
        let tok = vb
            .pp("embeddings")
            .pp("tok_embeddings")
            .get_unchecked("weight")?;
        if tok.dims2()?.1 != d {
            return Err(Error::ShapeMismatch {
                tensor: "embeddings.tok_embeddings.weight".into(),
                expected: format!("(vocab, {d})"),
                found: tok.dims().to_vec(),
            });
        }
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| PreNormLayer::load(vb.pp(format!("layers.{i}")), cfg, mcfg, i))
            .collect::<Result<Vec<_>>>()?;
        let head_dim = d / cfg.num_attention_heads.max(1);
        let rope = |theta: f64| -> Result<RotaryEmbedding> {
            let c = RopeConfig {
                theta,
                head_dim,
                rotary_dim: head_dim,
                scaling: RopeScaling::Default,
                layout: RopeLayout::Half,
            };
            c.validate()?;
            RotaryEmbedding::new(c, mcfg.max_positions.min(1 << 16), vb.device())
        };
        Ok(Self {
            tok: Embedding::new(tok, d),
            norm: layer_norm(vb.pp("embeddings").pp("norm"), d, mcfg)?,
            layers,
            final_norm: layer_norm(vb.pp("final_norm"), d, mcfg)?,
            ropes: [rope(mcfg.global_theta)?, rope(mcfg.local_theta)?],
            half_window: mcfg.half_window,
            max_positions: mcfg.max_positions,
        })
    }

    /// The longest input.
    pub(crate) fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The local layers' band: query `i` sees keys `j` with `|i - j| <= half_window`.
    fn band(&self, t: usize, device: &Device) -> Result<AttentionMask> {
        let w = self.half_window;
        let keep: Vec<u8> = (0..t)
            .flat_map(|i| (0..t).map(move |j| u8::from(i.abs_diff(j) <= w)))
            .collect();
        AttentionMask::keep(&Tensor::from_vec(keep, (t, t), device)?)
    }

    fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_, t) = input_ids.dims2()?;
        if t > self.max_positions {
            return Err(Error::SequenceTooLong {
                len: t,
                max: self.max_positions,
            });
        }
        Ok(self.norm.forward(&self.tok.forward(input_ids)?)?)
    }

    /// # Shapes
    /// - `input_ids`: `(batch, seq)`; `attention_mask`: `(batch, seq)` 0/1; returns hidden
    ///   states `(batch, seq, hidden)` and, when asked, `(batch, heads, seq, seq)` per layer
    pub(crate) fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        output_attentions: bool,
    ) -> Result<EncoderOutput> {
        let (_, t) = input_ids.dims2()?;
        let mut x = self.embed(input_ids)?;
        let padding = attention_mask.map(AttentionMask::padding).transpose()?;
        let band = self.band(t, input_ids.device())?;
        let local = match &padding {
            Some(p) => p.clone().and(band),
            None => band,
        };
        let mut attentions = output_attentions.then(Vec::new);
        for layer in &self.layers {
            let h = match &layer.attn_norm {
                Some(n) => n.forward(&x)?,
                None => x.clone(),
            };
            let (q, k, v) = layer.attention.project_qkv(&h)?;
            let rope = &self.ropes[usize::from(layer.local)];
            let (q, k) = (rope.apply(&q, 0)?, rope.apply(&k, 0)?); // (b, h, t, hd)
            let mask = match layer.local {
                true => Some(&local),
                false => padding.as_ref(),
            };
            let opts = SdpaOptions {
                scale: None,
                need_weights: output_attentions,
            };
            let out = scaled_dot_product_attention(&q, &k, &v, mask, opts)?;
            x = (&x + layer.attention.merge_heads(&out.context)?)?;
            x = (&x + layer.mlp(&layer.mlp_norm.forward(&x)?)?)?;
            if let (Some(all), Some(w)) = (attentions.as_mut(), out.weights) {
                all.push(w);
            }
        }
        Ok(EncoderOutput {
            hidden_states: self.final_norm.forward(&x)?,
            attentions,
        })
    }

    /// One sentence kept for explanations (see `BertEncoder::trace`).
    ///
    /// # Shapes
    /// - `input_ids`: `(1, seq)`
    pub(crate) fn trace(&self, input_ids: &Tensor, opts: TraceOptions) -> Result<ForwardTrace> {
        let (_, t) = input_ids.dims2()?;
        let x = self.embed(input_ids)?;
        let mut x = graph_input(x, opts.grad)?;
        let band = self.band(t, input_ids.device())?;
        let (mut attentions, mut probes, mut value_norms) = (Vec::new(), Vec::new(), Vec::new());
        for layer in &self.layers {
            let h = match &layer.attn_norm {
                Some(n) => layer_norm_diff(n, &x)?,
                None => x.clone(),
            };
            if opts.value_norms {
                value_norms.push(layer.attention.value_output_norms(&h.detach())?);
            }
            let p = probe(opts.grad, layer.attention.num_heads(), t, x.device())?;
            let (q, k, v) = layer.attention.project_qkv(&h)?;
            let rope = &self.ropes[usize::from(layer.local)];
            let (q, k) = (rope.apply(&q, 0)?, rope.apply(&k, 0)?);
            let mask = layer.local.then_some(&band);
            let scale = layer.attention.score_scale();
            let out = explicit_probed(&q, &k, &v, mask, scale, true, p.as_ref())?;
            let probs = out.weights.ok_or_else(|| {
                Error::Kernel("the explicit attention returned no weights".into())
            })?;
            x = (&x + layer.attention.merge_heads(&out.context)?)?;
            x = (&x + layer.mlp(&layer_norm_diff(&layer.mlp_norm, &x)?)?)?;
            attentions.push(probs);
            probes.extend(p);
        }
        Ok(ForwardTrace {
            output: layer_norm_diff(&self.final_norm, &x)?,
            attentions,
            probes,
            value_norms,
        })
    }
}
