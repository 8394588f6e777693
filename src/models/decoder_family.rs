//! The pre-norm decoder families (LLaMA, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, GPT-2,
//! GPT-NeoX / Pythia) as descriptions over one decoder ([`crate::LlamaModel`]): which norms a
//! layer has and how they scale (RMSNorm, `1 + w`, LayerNorm), whether queries and keys are
//! normed per head, how positions enter (rotary, learned), how the embeddings are scaled,
//! whether the MLP is gated, whether the two halves add in parallel, which projections a
//! checkpoint fuses, and which layers attend within a sliding window.
//! A configuration value that would change the math in a way the decoder does not implement
//! is an error naming the field, and so is every tensor the decoder would not read.
//!
//! Adding a family of this form is one more `DecoderFamily` constant and its `model_type`s in
//! [`DecoderFamily::ALL`]; renamed config fields go in [`DecoderFamily::normalize_config`],
//! renamed tensors in `crate::weights::decoder_names`.

use std::collections::BTreeSet;

use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::weights::checkpoint::refuse_unread;
use crate::weights::decoder_names::Renaming;

/// The norms of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// RMSNorm, `weight` only.
    Rms,
    /// LayerNorm with `weight` and `bias` (GPT-2, GPT-NeoX).
    Layer,
}

/// Which layers attend within `sliding_window` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowRule {
    /// None (LLaMA).
    Never,
    /// Every layer, when `sliding_window` is set (Mistral, Phi-3).
    Always,
    /// Layers from `max_window_layers` on, when `use_sliding_window` (Qwen2, Qwen3).
    FromMaxWindowLayers,
    /// The layers `layer_types` names `sliding_attention` (Gemma 3), or, without it, those
    /// whose `(i + 1) % sliding_window_pattern != 0`.
    LayerTypes,
}

/// One decoder family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderFamily {
    /// The family's name in messages.
    pub name: &'static str,
    /// The `model_type`s of `config.json` that name it.
    pub model_types: &'static [&'static str],
    /// Queries and keys go through an RMSNorm over each head's features before the rotation
    /// (`self_attn.q_norm`, `self_attn.k_norm`; Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// RMSNorms scale by `1 + w` (Gemma), not `w`.
    pub norm_plus_one: bool,
    /// The attention's and the MLP's outputs are normed before their residual add
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`), the MLP's input by
    /// `pre_feedforward_layernorm` (Gemma 2 and 3).
    pub sandwich_norms: bool,
    /// The embeddings are multiplied by `sqrt(hidden_size)` (Gemma).
    pub embed_scale: bool,
    /// Q, K and V stored as one `qkv_proj`, gate and up as one `gate_up_proj` (Phi-3).
    pub fused_projections: bool,
    /// Which layers have a sliding window.
    pub window: WindowRule,
    /// The MLP activations the family's configs name (`hidden_act`).
    pub activations: &'static [&'static str],
    /// RMSNorm or LayerNorm.
    pub norm: NormKind,
    /// Positions are a learned table added to the embeddings (GPT-2), not a rotation.
    pub learned_positions: bool,
    /// The MLP is `down(act(gate(x)) * up(x))`; `false`: `down(act(up(x)))` (GPT-2, NeoX).
    pub gated_mlp: bool,
    /// The attention's and the MLP's outputs both add to the layer's input (GPT-NeoX's
    /// `use_parallel_residual`, its default).
    pub parallel_residual: bool,
    /// The checkpoint's names where they are not LLaMA's.
    pub renaming: Option<Renaming>,
}

impl DecoderFamily {
    /// LLaMA, SmolLM2, TinyLlama, ...
    pub const LLAMA: DecoderFamily = DecoderFamily {
        name: "LLaMA",
        model_types: &["llama"],
        qk_norm: false,
        norm_plus_one: false,
        sandwich_norms: false,
        embed_scale: false,
        fused_projections: false,
        window: WindowRule::Never,
        activations: &["silu"],
        norm: NormKind::Rms,
        learned_positions: false,
        gated_mlp: true,
        parallel_residual: false,
        renaming: None,
    };
    /// Mistral: LLaMA with a sliding window in every layer.
    pub const MISTRAL: DecoderFamily = DecoderFamily {
        name: "Mistral",
        model_types: &["mistral"],
        window: WindowRule::Always,
        ..Self::LLAMA
    };
    /// Qwen2 / Qwen2.5: LLaMA with Q/K/V biases.
    pub const QWEN2: DecoderFamily = DecoderFamily {
        name: "Qwen2",
        model_types: &["qwen2"],
        window: WindowRule::FromMaxWindowLayers,
        ..Self::LLAMA
    };
    /// Qwen3: per-head RMSNorm on queries and keys, `head_dim` of its own.
    pub const QWEN3: DecoderFamily = DecoderFamily {
        name: "Qwen3",
        model_types: &["qwen3"],
        qk_norm: true,
        window: WindowRule::FromMaxWindowLayers,
        ..Self::LLAMA
    };
    /// Gemma 3 (text): `(1 + w)` norms around both halves, q/k norms, scaled embeddings,
    /// sliding and global layers with their own rotary bases, GeGLU (tanh GELU).
    pub const GEMMA3: DecoderFamily = DecoderFamily {
        name: "Gemma 3",
        model_types: &["gemma3_text"],
        qk_norm: true,
        norm_plus_one: true,
        sandwich_norms: true,
        embed_scale: true,
        fused_projections: false,
        window: WindowRule::LayerTypes,
        activations: &["gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu"],
        ..Self::LLAMA
    };
    /// Phi-3: fused `qkv_proj` and `gate_up_proj`, a sliding window in every layer.
    pub const PHI3: DecoderFamily = DecoderFamily {
        name: "Phi-3",
        model_types: &["phi3"],
        fused_projections: true,
        window: WindowRule::Always,
        ..Self::LLAMA
    };

    /// GPT-2: learned positions, LayerNorms, `Conv1D` projections (fused `c_attn`), a plain
    /// MLP, the head tied to the embeddings.
    pub const GPT2: DecoderFamily = DecoderFamily {
        name: "GPT-2",
        model_types: &["gpt2"],
        activations: &["gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu", "relu"],
        norm: NormKind::Layer,
        learned_positions: true,
        gated_mlp: false,
        renaming: Some(Renaming::Gpt2),
        ..Self::LLAMA
    };
    /// GPT-NeoX / Pythia: LayerNorms, partial rotation, fused `query_key_value` laid out per
    /// head, a plain MLP, the two halves in parallel.
    pub const GPT_NEOX: DecoderFamily = DecoderFamily {
        name: "GPT-NeoX",
        model_types: &["gpt_neox"],
        activations: &["gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu"],
        norm: NormKind::Layer,
        gated_mlp: false,
        parallel_residual: true,
        renaming: Some(Renaming::GptNeoX),
        ..Self::LLAMA
    };

    /// Every decoder family of this form.
    pub const ALL: [DecoderFamily; 8] = [
        Self::LLAMA,
        Self::MISTRAL,
        Self::QWEN2,
        Self::QWEN3,
        Self::GEMMA3,
        Self::PHI3,
        Self::GPT2,
        Self::GPT_NEOX,
    ];

    /// The family of a `model_type` (`None`: LLaMA).
    pub fn of_model_type(model_type: Option<&str>) -> Result<&'static DecoderFamily> {
        let wanted = model_type.unwrap_or("llama");
        const ALL: &[DecoderFamily] = &DecoderFamily::ALL;
        ALL.iter()
            .find(|f| f.model_types.contains(&wanted))
            .ok_or_else(|| {
                Error::config(format!(
                    "model_type `{wanted}` is not a decoder this crate implements; supported \
                     decoders: {}",
                    decoder_model_types().join(", ")
                ))
            })
    }

    /// Whether the decode step's fused route ([`crate::models::decode_step`]) computes the
    /// family's layer: RMSNorms (plain or `1 + w`, q/k and sandwich norms included), a gated
    /// MLP, rotary positions and the sequential residual (the caller checks a config's
    /// `use_parallel_residual`).
    pub(crate) fn steps_in_one_pass(&self) -> bool {
        self.norm == NormKind::Rms
            && self.gated_mlp
            && !self.learned_positions
            && !self.parallel_residual
    }

    /// The config as LLaMA's field names hold it: the family's own names copied to them
    /// (Gemma's `hidden_activation`, the pre-`rope_parameters` spellings of Gemma 3's two
    /// rotary bases are read by the rope code).
    pub(crate) fn normalize_config(&self, raw: &mut Value) {
        let Some(obj) = raw.as_object_mut() else {
            return;
        };
        if let Some(act) = obj.get("hidden_activation").cloned() {
            if !act.is_null() {
                obj.insert("hidden_act".into(), act);
            }
        }
        // Another family's spelling of a field, copied to LLaMA's where that is absent.
        let mut alias = |from: &str, to: &str| {
            if let Some(v) = obj.get(from).cloned().filter(|v| !v.is_null()) {
                obj.entry(to.to_string()).or_insert(v);
            }
        };
        match self.renaming {
            Some(Renaming::Gpt2) => {
                for (from, to) in [
                    ("n_embd", "hidden_size"),
                    ("n_head", "num_attention_heads"),
                    ("n_layer", "num_hidden_layers"),
                    ("n_positions", "max_position_embeddings"),
                    ("n_inner", "intermediate_size"),
                    ("layer_norm_epsilon", "rms_norm_eps"),
                    ("activation_function", "hidden_act"),
                ] {
                    alias(from, to);
                }
                // GPT2Config's defaults: a 4x MLP, the head tied to the embeddings.
                if let Some(d) = obj.get("hidden_size").and_then(Value::as_u64) {
                    obj.entry("intermediate_size").or_insert(json!(4 * d));
                }
                obj.entry("tie_word_embeddings").or_insert(json!(true));
                obj.entry("hidden_act").or_insert(json!("gelu_new"));
            }
            Some(Renaming::GptNeoX) => {
                for (from, to) in [
                    ("layer_norm_eps", "rms_norm_eps"),
                    ("rotary_pct", "partial_rotary_factor"),
                    ("rotary_emb_base", "rope_theta"),
                ] {
                    alias(from, to);
                }
                // GPTNeoXConfig's defaults.
                obj.entry("partial_rotary_factor").or_insert(json!(0.25));
                obj.entry("hidden_act").or_insert(json!("gelu"));
            }
            None => {}
        }
    }

    /// Refuses the configuration values that would change the math in a way this decoder
    /// does not implement, naming the field.
    pub(crate) fn check_config(&self, raw: &Value, hidden_act: &str) -> Result<()> {
        let refuse = |field: &str, value: &Value, why: &str| {
            Err(Error::config(format!(
                "`{field}` = {value} is not supported for {} ({why})",
                self.name
            )))
        };
        if !self.activations.contains(&hidden_act) {
            return refuse(
                "hidden_act",
                &Value::from(hidden_act),
                &format!("supported: {}", self.activations.join(", ")),
            );
        }
        let set = |key: &str| {
            raw.get(key)
                .filter(|v| !v.is_null() && *v != &Value::Bool(false))
        };
        for field in ["attn_logit_softcapping", "final_logit_softcapping"] {
            if let Some(v) = set(field) {
                return refuse(field, v, "logit softcapping is not implemented");
            }
        }
        if self.renaming == Some(Renaming::Gpt2) {
            for field in ["scale_attn_by_inverse_layer_idx", "add_cross_attention"] {
                if let Some(v) = set(field) {
                    return refuse(field, v, "not implemented");
                }
            }
            if let Some(v) = raw
                .get("scale_attn_weights")
                .filter(|v| **v == Value::Bool(false))
            {
                return refuse(
                    "scale_attn_weights",
                    v,
                    "unscaled scores are not implemented",
                );
            }
        }
        if let Some(v) = set("use_bidirectional_attention") {
            return refuse(
                "use_bidirectional_attention",
                v,
                "only causal attention is implemented",
            );
        }
        if let Some(v) = raw
            .get("pretraining_tp")
            .filter(|v| v.as_u64().is_some_and(|n| n > 1))
        {
            return refuse(
                "pretraining_tp",
                v,
                "tensor-parallel slicing of the projections is not implemented",
            );
        }
        if let Some(v) = set("mlp_bias") {
            return refuse("mlp_bias", v, "MLP biases are not implemented");
        }
        if !self.qk_norm {
            if let Some(v) = set("qk_layernorm").or_else(|| set("use_qk_norm")) {
                return refuse("qk_layernorm", v, "this family has no q/k norms");
            }
        }
        if let Some(types) = raw.get("layer_types").and_then(Value::as_array) {
            for t in types {
                if !matches!(t.as_str(), Some("full_attention" | "sliding_attention")) {
                    return refuse(
                        "layer_types",
                        t,
                        "only full_attention and sliding_attention are implemented",
                    );
                }
            }
        }
        Ok(())
    }

    /// The names the decoder reads under `model.` and beside it, for `layers` layers; a
    /// projection's `bias` is read where the checkpoint has one.
    pub(crate) fn expected_names(&self, layers: usize, tied: bool) -> BTreeSet<String> {
        let mut names = BTreeSet::from([
            "model.embed_tokens.weight".to_string(),
            "model.norm.weight".to_string(),
        ]);
        if self.norm == NormKind::Layer {
            names.insert("model.norm.bias".into());
        }
        if self.learned_positions {
            names.insert("model.embed_positions.weight".into());
        }
        if !tied {
            names.insert("lm_head.weight".into());
        }
        let layer_norm = self.norm == NormKind::Layer;
        for i in 0..layers {
            let l = format!("model.layers.{i}");
            let mut add = |n: &str| {
                names.insert(format!("{l}.{n}"));
            };
            add("input_layernorm.weight");
            add("post_attention_layernorm.weight");
            if layer_norm {
                add("input_layernorm.bias");
                add("post_attention_layernorm.bias");
            }
            if self.sandwich_norms {
                add("pre_feedforward_layernorm.weight");
                add("post_feedforward_layernorm.weight");
            }
            if self.qk_norm {
                add("self_attn.q_norm.weight");
                add("self_attn.k_norm.weight");
            }
            let projections: &[&str] = if self.fused_projections {
                &[
                    "self_attn.qkv_proj",
                    "self_attn.o_proj",
                    "mlp.gate_up_proj",
                    "mlp.down_proj",
                ]
            } else if !self.gated_mlp {
                &[
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                    "self_attn.o_proj",
                    "mlp.up_proj",
                    "mlp.down_proj",
                ]
            } else {
                &[
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                    "self_attn.o_proj",
                    "mlp.gate_proj",
                    "mlp.up_proj",
                    "mlp.down_proj",
                ]
            };
            for p in projections {
                add(&format!("{p}.weight"));
                add(&format!("{p}.bias"));
            }
        }
        names
    }

    /// Checks that every tensor of a checkpoint is one the decoder reads (rotary buffers
    /// aside); the error lists the others.
    pub(crate) fn check_tensors<'a>(
        &self,
        names: impl Iterator<Item = &'a str>,
        layers: usize,
        tied: bool,
    ) -> Result<()> {
        let expected = self.expected_names(layers, tied);
        let unused: Vec<&str> = names
            .filter(|n| {
                let read = expected.contains(*n) || (tied && *n == "lm_head.weight");
                !(read || n.ends_with("rotary_emb.inv_freq"))
            })
            .collect();
        refuse_unread(&self.describe(layers), unused)
    }

    /// `a Gemma 3 decoder of 18 layers`, for messages.
    pub(crate) fn describe(&self, layers: usize) -> String {
        format!("a {} decoder of {layers} layers", self.name)
    }
}

/// Every decoder `model_type`.
pub fn decoder_model_types() -> Vec<&'static str> {
    DecoderFamily::ALL
        .iter()
        .flat_map(|f| f.model_types.iter().copied())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn families_by_model_type() -> Result<()> {
        assert_eq!(DecoderFamily::of_model_type(None)?.name, "LLaMA");
        assert_eq!(
            DecoderFamily::of_model_type(Some("gemma3_text"))?.name,
            "Gemma 3"
        );
        let err = DecoderFamily::of_model_type(Some("falcon"))
            .expect_err("not implemented")
            .to_string();
        assert!(err.contains("falcon") && err.contains("qwen3"), "{err}");
        Ok(())
    }

    /// Each family refuses a math-changing value it does not implement, by name.
    #[test]
    fn unsupported_fields_are_refused_by_name() {
        let cases = [
            (
                DecoderFamily::GEMMA3,
                json!({"final_logit_softcapping": 30.0}),
                "gelu_pytorch_tanh",
                "final_logit_softcapping",
            ),
            (
                DecoderFamily::GEMMA3,
                json!({"attn_logit_softcapping": 50.0}),
                "gelu_pytorch_tanh",
                "attn_logit_softcapping",
            ),
            (
                DecoderFamily::GEMMA3,
                json!({"use_bidirectional_attention": true}),
                "gelu_pytorch_tanh",
                "use_bidirectional_attention",
            ),
            (DecoderFamily::GEMMA3, json!({}), "silu", "hidden_act"),
            (
                DecoderFamily::QWEN3,
                json!({"layer_types": ["chunked_attention"]}),
                "silu",
                "layer_types",
            ),
            (
                DecoderFamily::LLAMA,
                json!({"pretraining_tp": 2}),
                "silu",
                "pretraining_tp",
            ),
            (
                DecoderFamily::LLAMA,
                json!({"mlp_bias": true}),
                "silu",
                "mlp_bias",
            ),
            (DecoderFamily::PHI3, json!({}), "gelu", "hidden_act"),
        ];
        for (family, raw, act, field) in cases {
            let err = family.check_config(&raw, act).expect_err(field).to_string();
            assert!(err.contains(field), "{}: {err}", family.name);
        }
        assert!(DecoderFamily::GEMMA3
            .check_config(
                &json!({"final_logit_softcapping": null}),
                "gelu_pytorch_tanh"
            )
            .is_ok());
    }

    #[test]
    fn unread_tensors_are_named() {
        let f = DecoderFamily::QWEN3;
        let mut names: Vec<String> = f
            .expected_names(1, false)
            .into_iter()
            .filter(|n| !n.ends_with(".bias"))
            .collect();
        names.push("model.layers.0.self_attn.rotary_emb.inv_freq".into());
        let check = |names: &[String]| f.check_tensors(names.iter().map(String::as_str), 1, false);
        assert!(check(&names).is_ok());
        names.push("model.layers.0.self_attn.sinks".into());
        let err = check(&names).expect_err("unread").to_string();
        assert!(err.contains("self_attn.sinks"), "{err}");
    }
}
