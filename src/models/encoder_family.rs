//! The encoder families (BERT, RoBERTa / XLM-RoBERTa / CamemBERT, DistilBERT post-norm;
//! ModernBERT pre-norm) as descriptions over one encoder ([`crate::BertEncoder`]): where each
//! keeps its tensors, how it numbers positions, whether it has token types, and which
//! configuration values it takes. A field that would change the math in a way the encoder does not implement is an
//! error naming it, and so is every tensor of a checkpoint that the encoder would not read.
//!
//! Adding a family of the same form (embeddings, then per layer attention, residual +
//! LayerNorm, feed-forward, residual + LayerNorm) is one more `EncoderFamily` constant:
//! its names, its positions, its attention [`WeightLayout`], and its `model_type`s in
//! [`EncoderFamily::ALL`].

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::weights::checkpoint::refuse_unread;
use crate::weights::config::HfConfig;
use crate::weights::layout::WeightLayout;

/// How a family numbers its tokens' positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PositionIds {
    /// `0, 1, ..., seq - 1` (BERT, DistilBERT).
    FromZero,
    /// transformers' `create_position_ids_from_input_ids` (RoBERTa, XLM-R): a padding token
    /// gets `pad_token_id`, any other `pad_token_id + 1 +` the number of non-padding tokens
    /// before it, so the first real position is `pad_token_id + 1`.
    AfterPadding,
}

impl PositionIds {
    /// The position ids of `ids`, row by row.
    ///
    /// # Shapes
    /// - `ids`: `(batch * seq,)` row-major `(batch, seq)`; returns the same
    pub(crate) fn of(&self, ids: &[u32], seq: usize, pad_token_id: u32) -> Vec<u32> {
        match self {
            PositionIds::FromZero => (0..ids.len()).map(|i| (i % seq.max(1)) as u32).collect(),
            PositionIds::AfterPadding => ids
                .chunks(seq.max(1))
                .flat_map(|row| {
                    let mut count = 0u32;
                    row.iter()
                        .map(move |&id| {
                            if id == pad_token_id {
                                pad_token_id
                            } else {
                                count += 1;
                                pad_token_id + count
                            }
                        })
                        .collect::<Vec<_>>()
                })
                .collect(),
        }
    }
}

/// One encoder family: names relative to the base model's root, positions, token types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncoderFamily {
    /// The family's name in messages.
    pub name: &'static str,
    /// The `model_type`s of `config.json` that name it.
    pub model_types: &'static [&'static str],
    /// The prefix task checkpoints keep the base model under (`bert` in
    /// `BertForMaskedLM`'s `bert.embeddings...`).
    pub base_prefix: &'static str,
    /// The layers' prefix; layer `i` is `{layers}.{i}`.
    pub layers: &'static str,
    /// The attention module, relative to a layer.
    pub attention: &'static str,
    /// Where the attention's projections live under it.
    pub attention_layout: WeightLayout,
    /// The LayerNorm after the attention's residual, relative to a layer.
    pub attention_norm: &'static str,
    /// The feed-forward's first `(inter, hidden)` dense layer, relative to a layer.
    pub intermediate: &'static str,
    /// The feed-forward's second `(hidden, inter)` dense layer, relative to a layer.
    pub output: &'static str,
    /// The LayerNorm after the feed-forward's residual, relative to a layer.
    pub output_norm: &'static str,
    /// Whether the embeddings add a token-type (segment) table.
    pub token_types: bool,
    /// How positions are numbered.
    pub positions: PositionIds,
    /// Tensors outside the encoder that task checkpoints carry (heads on top of the last
    /// hidden states, buffers): never read, allowed in a checkpoint. Prefixes from the
    /// checkpoint's root, or from the base model's.
    pub outside: &'static [&'static str],
    /// The pre-norm form (ModernBERT: rotary positions, local windows, GeGLU, a final norm;
    /// `crate::models::modern_bert`), not BERT's post-norm one.
    pub pre_norm: bool,
}

impl EncoderFamily {
    /// BERT, MiniLM, all-MiniLM-L6-v2, ELECTRA discriminators of one width.
    pub const BERT: EncoderFamily = EncoderFamily {
        name: "BERT",
        model_types: &["bert", "electra"],
        base_prefix: "bert",
        layers: "encoder.layer",
        attention: "attention",
        attention_layout: WeightLayout::Bert,
        attention_norm: "attention.output.LayerNorm",
        intermediate: "intermediate.dense",
        output: "output.dense",
        output_norm: "output.LayerNorm",
        token_types: true,
        positions: PositionIds::FromZero,
        outside: &[
            "pooler.",
            "cls.",
            "classifier.",
            "qa_outputs.",
            "discriminator_predictions.",
            "generator_predictions.",
            "generator_lm_head.",
            "embeddings.position_ids",
            "embeddings.token_type_ids",
        ],
        pre_norm: false,
    };

    /// RoBERTa, XLM-RoBERTa, CamemBERT: BERT's names, positions from past the padding id.
    pub const ROBERTA: EncoderFamily = EncoderFamily {
        name: "RoBERTa",
        model_types: &["roberta", "xlm-roberta", "camembert"],
        base_prefix: "roberta",
        positions: PositionIds::AfterPadding,
        outside: &[
            "pooler.",
            "lm_head.",
            "classifier.",
            "qa_outputs.",
            "embeddings.position_ids",
            "embeddings.token_type_ids",
        ],
        ..Self::BERT
    };

    /// DistilBERT: `q_lin`/`k_lin`/`v_lin`/`out_lin`, `sa_layer_norm`, `ffn.lin1`/`ffn.lin2`,
    /// `output_layer_norm`, no token types.
    pub const DISTILBERT: EncoderFamily = EncoderFamily {
        name: "DistilBERT",
        model_types: &["distilbert"],
        base_prefix: "distilbert",
        layers: "transformer.layer",
        attention: "attention",
        attention_layout: WeightLayout::DistilBert,
        attention_norm: "sa_layer_norm",
        intermediate: "ffn.lin1",
        output: "ffn.lin2",
        output_norm: "output_layer_norm",
        token_types: false,
        positions: PositionIds::FromZero,
        outside: &[
            "vocab_transform.",
            "vocab_layer_norm.",
            "vocab_projector.",
            "pre_classifier.",
            "classifier.",
            "qa_outputs.",
            "embeddings.position_ids",
        ],
        pre_norm: false,
    };

    /// ModernBERT: `embeddings.tok_embeddings` + `embeddings.norm`, `layers.N.attn_norm` (not in
    /// layer 0), `attn.Wqkv`, `attn.Wo`, `mlp_norm`, `mlp.Wi`, `mlp.Wo`, `final_norm`.
    pub const MODERNBERT: EncoderFamily = EncoderFamily {
        name: "ModernBERT",
        model_types: &["modernbert"],
        base_prefix: "model",
        layers: "layers",
        attention: "attn",
        attention_layout: WeightLayout::ModernBert,
        attention_norm: "attn_norm",
        intermediate: "mlp.Wi",
        output: "mlp.Wo",
        output_norm: "mlp_norm",
        token_types: false,
        positions: PositionIds::FromZero,
        outside: &["head.", "decoder.", "classifier.", "drop."],
        pre_norm: true,
    };

    /// Every encoder family.
    pub const ALL: [EncoderFamily; 4] = [
        Self::BERT,
        Self::ROBERTA,
        Self::DISTILBERT,
        Self::MODERNBERT,
    ];

    /// The family of a `model_type` (`None`: BERT, as configs without one are).
    pub fn of_model_type(model_type: Option<&str>) -> Result<&'static EncoderFamily> {
        let wanted = model_type.unwrap_or("bert");
        const ALL: &[EncoderFamily] = &EncoderFamily::ALL;
        ALL.iter()
            .find(|f| f.model_types.contains(&wanted))
            .ok_or_else(|| {
                Error::config(format!(
                    "model_type `{wanted}` is not an encoder this crate implements; supported \
                     encoders: {}",
                    supported_model_types()
                ))
            })
    }

    /// Whether `model_type` names an encoder family.
    pub fn is_encoder(model_type: Option<&str>) -> bool {
        Self::of_model_type(model_type).is_ok()
    }

    /// Refuses the configuration values that would change the math in a way this encoder
    /// does not implement, naming the field.
    pub fn check_config(&self, cfg: &HfConfig) -> Result<()> {
        let refuse = |field: &str, value: String, why: &str| {
            Err(Error::config(format!(
                "`{field}` = {value} is not supported for {} ({why})",
                self.name
            )))
        };
        if self.pre_norm {
            // ModernBERT's own fields are read (and refused) with its config.
            return Ok(());
        }
        if cfg.position_embedding_type != "absolute" {
            return refuse(
                "position_embedding_type",
                format!("`{}`", cfg.position_embedding_type),
                "only `absolute` position embeddings are implemented",
            );
        }
        if cfg.is_decoder {
            return refuse(
                "is_decoder",
                "true".into(),
                "the encoder attends both ways; a causal BERT is not implemented",
            );
        }
        if let Some(e) = cfg.embedding_size.filter(|&e| e != cfg.hidden_size) {
            return refuse(
                "embedding_size",
                e.to_string(),
                "embeddings narrower than hidden_size need a projection that is not implemented",
            );
        }
        if self.positions == PositionIds::AfterPadding {
            match cfg.pad_token_id {
                None => {
                    return Err(Error::config(format!(
                        "`pad_token_id` is missing: {} numbers positions from past it",
                        self.name
                    )))
                }
                Some(p) if p < 0 || p > u32::MAX as i64 / 2 => {
                    return refuse(
                        "pad_token_id",
                        p.to_string(),
                        "positions are numbered from past it, so it must be a token id",
                    )
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// The word table's name under the base model's root.
    pub(crate) fn word_table(&self) -> &'static str {
        match self.pre_norm {
            true => "embeddings.tok_embeddings.weight",
            false => "embeddings.word_embeddings.weight",
        }
    }

    /// The padding id positions count from (0 where the family does not use it).
    pub(crate) fn pad_token_id(&self, cfg: &HfConfig) -> u32 {
        match self.positions {
            PositionIds::AfterPadding => cfg.pad_token_id.unwrap_or(0).max(0) as u32,
            PositionIds::FromZero => 0,
        }
    }

    /// The longest sequence a position table of `rows` rows covers.
    pub(crate) fn max_sequence(&self, rows: usize, cfg: &HfConfig) -> usize {
        match self.positions {
            PositionIds::FromZero => rows,
            PositionIds::AfterPadding => rows.saturating_sub(self.pad_token_id(cfg) as usize + 1),
        }
    }

    /// The names the encoder reads, relative to the base model's root (a LayerNorm's
    /// `gamma`/`beta` are read as `weight`/`bias`).
    fn expected_names(&self, cfg: &HfConfig) -> BTreeSet<String> {
        if self.pre_norm {
            return self.pre_norm_names(cfg);
        }
        let mut names = BTreeSet::new();
        let mut both = |prefix: String| {
            names.insert(format!("{prefix}.weight"));
            names.insert(format!("{prefix}.bias"));
        };
        both("embeddings.LayerNorm".into());
        let mut tables = vec!["word_embeddings", "position_embeddings"];
        if self.token_types {
            tables.push("token_type_embeddings");
        }
        for i in 0..cfg.num_hidden_layers {
            let layer = format!("{}.{i}", self.layers);
            if let Some(projections) = self.attention_layout.separate_projections() {
                for p in projections {
                    both(format!("{layer}.{}.{p}", self.attention));
                }
            }
            for part in [
                self.attention_norm,
                self.intermediate,
                self.output,
                self.output_norm,
            ] {
                both(format!("{layer}.{part}"));
            }
        }
        for t in tables {
            names.insert(format!("embeddings.{t}.weight"));
        }
        names
    }

    /// ModernBERT's names (each `bias` read where the config has biases: allowed).
    fn pre_norm_names(&self, cfg: &HfConfig) -> BTreeSet<String> {
        let mut names = BTreeSet::from(["embeddings.tok_embeddings.weight".to_string()]);
        let mut both = |prefix: String| {
            names.insert(format!("{prefix}.weight"));
            names.insert(format!("{prefix}.bias"));
        };
        both("embeddings.norm".into());
        both("final_norm".into());
        for i in 0..cfg.num_hidden_layers {
            let l = format!("{}.{i}", self.layers);
            if i > 0 {
                both(format!("{l}.{}", self.attention_norm));
            }
            for part in [
                "attn.Wqkv",
                "attn.Wo",
                self.output_norm,
                self.intermediate,
                self.output,
            ] {
                both(format!("{l}.{part}"));
            }
        }
        names
    }

    /// Checks that every tensor of a checkpoint is one the encoder reads or one outside it
    /// (a task head, a buffer); `base` is the prefix the encoder was found under (`""` or
    /// `"roberta."`). The error lists the others.
    pub(crate) fn check_tensors<'a>(
        &self,
        names: impl Iterator<Item = &'a str>,
        base: &str,
        cfg: &HfConfig,
    ) -> Result<()> {
        let expected = self.expected_names(cfg);
        let unused: Vec<&str> = names
            .filter(|&name| {
                let inner = name.strip_prefix(base).unwrap_or(name);
                let outside = |n: &str| self.outside.iter().any(|o| n.starts_with(o));
                let read = name.starts_with(base) && {
                    let canonical = match inner.rsplit_once('.') {
                        Some((stem, "gamma")) => format!("{stem}.weight"),
                        Some((stem, "beta")) => format!("{stem}.bias"),
                        _ => inner.to_string(),
                    };
                    expected.contains(&canonical)
                };
                !(read || outside(inner) || outside(name))
            })
            .collect();
        let model = format!(
            "a {} encoder of {} layers",
            self.name, cfg.num_hidden_layers
        );
        refuse_unread(&model, unused)
    }
}

/// The encoder `model_type`s, comma-separated (for messages).
pub fn supported_model_types() -> String {
    EncoderFamily::ALL
        .iter()
        .flat_map(|f| f.model_types.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> HfConfig {
        HfConfig::from_json(json).expect("a config")
    }

    /// RoBERTa's positions: from `pad + 1`, padding at `pad`, counted per row.
    #[test]
    fn roberta_positions_follow_transformers() {
        let ids = [0u32, 7, 9, 2, 1, 1, 0, 5, 2, 1, 1, 1];
        assert_eq!(
            PositionIds::AfterPadding.of(&ids, 6, 1),
            vec![2, 3, 4, 5, 1, 1, 2, 3, 4, 1, 1, 1]
        );
        assert_eq!(
            PositionIds::FromZero.of(&ids, 6, 1),
            vec![0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
        );
    }

    #[test]
    fn families_by_model_type() -> Result<()> {
        assert_eq!(EncoderFamily::of_model_type(None)?.name, "BERT");
        assert_eq!(
            EncoderFamily::of_model_type(Some("xlm-roberta"))?.name,
            "RoBERTa"
        );
        assert_eq!(
            EncoderFamily::of_model_type(Some("distilbert"))?.name,
            "DistilBERT"
        );
        let err = EncoderFamily::of_model_type(Some("albert"))
            .expect_err("not implemented")
            .to_string();
        assert!(
            err.contains("albert") && err.contains("distilbert"),
            "{err}"
        );
        Ok(())
    }

    /// Each family refuses a value of a math-changing field it does not implement.
    #[test]
    fn unsupported_fields_are_refused_by_name() {
        let base = r#""hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2"#;
        let cases = [
            (
                "bert",
                r#""position_embedding_type": "relative_key""#,
                "position_embedding_type",
            ),
            ("bert", r#""is_decoder": true"#, "is_decoder"),
            ("electra", r#""embedding_size": 16"#, "embedding_size"),
            (
                "roberta",
                r#""pad_token_id": 1, "position_embedding_type": "relative_key_query""#,
                "position_embedding_type",
            ),
            ("roberta", r#""type_vocab_size": 1"#, "pad_token_id"),
            ("xlm-roberta", r#""pad_token_id": -1"#, "pad_token_id"),
            ("distilbert", r#""is_decoder": true"#, "is_decoder"),
        ];
        for (model_type, field, name) in cases {
            let cfg = config(&format!(
                r#"{{"model_type": "{model_type}", {base}, {field}}}"#
            ));
            let family = EncoderFamily::of_model_type(cfg.model_type.as_deref()).expect("known");
            let err = family.check_config(&cfg).expect_err(field).to_string();
            assert!(err.contains(name), "{model_type} {field}: {err}");
        }
        let ok = config(&format!(
            r#"{{"model_type": "roberta", {base}, "pad_token_id": 1}}"#
        ));
        assert!(EncoderFamily::ROBERTA.check_config(&ok).is_ok());
    }

    /// A tensor the encoder does not read is named; heads and buffers are allowed.
    #[test]
    fn unread_tensors_are_named() {
        let cfg = config(r#"{"model_type": "distilbert", "dim": 8, "n_heads": 2, "n_layers": 1}"#);
        let f = EncoderFamily::DISTILBERT;
        let mut names: Vec<String> = f.expected_names(&cfg).into_iter().collect();
        names.push("vocab_projector.bias".into());
        let check = |names: &[String], base: &str| {
            f.check_tensors(names.iter().map(String::as_str), base, &cfg)
        };
        assert!(check(&names, "").is_ok());
        let prefixed: Vec<String> = names.iter().map(|n| format!("distilbert.{n}")).collect();
        assert!(check(&prefixed, "distilbert.").is_ok());
        names.push("transformer.layer.1.ffn.lin1.weight".into());
        names.push("transformer.layer.0.attention.rel_bias".into());
        let err = check(&names, "").expect_err("unread").to_string();
        assert!(
            err.contains("transformer.layer.1.ffn.lin1.weight")
                && err.contains("attention.rel_bias"),
            "{err}"
        );
    }
}
