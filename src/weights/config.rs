//! Configuration: the attention layer's own [`AttentionConfig`], and [`HfConfig`], which
//! deserializes a Hugging Face `config.json` (BERT, GPT-2 and LLaMA field names) as is.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::weights::layout::{LayerSizes, WeightLayout};

/// How to build a [`crate::MultiHeadSelfAttention`]. Loading a checkpoint reads the sizes
/// (hidden, head dims, kv heads) from its tensors; a fresh layer on a `VarMap`-backed
/// `VarBuilder` needs them stated ([`AttentionConfig::with_hidden_size`]), and stated sizes
/// must agree with a checkpoint's tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionConfig {
    /// Where the projections live in the checkpoint.
    pub layout: WeightLayout,
    /// Number of query heads.
    pub num_heads: usize,
    /// Number of key/value heads (grouped-query attention); `None` reads it from the
    /// checkpoint (`key rows / head_dim`).
    pub num_kv_heads: Option<usize>,
    /// Apply a causal mask in self-attention.
    pub causal: bool,
    /// Multiplier of `Q K^T`; `None` is `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// Input width; when set, the projections are read with their full shapes (created with
    /// candle-nn's default initialisation where the `VarBuilder` makes variables).
    pub hidden_size: Option<usize>,
    /// Query/key width per head; `None` is `hidden_size / num_heads` (the whole
    /// `hidden_size` for [`WeightLayout::Single`]).
    pub head_dim: Option<usize>,
    /// Value width per head; `None` is `head_dim`.
    pub v_head_dim: Option<usize>,
    /// Whether a fresh layer gets biases: `None` follows the layout (Q/K/V and output biases
    /// everywhere but LLaMA; `Some(true)` for LLaMA gives Q/K/V biases as Qwen2 has).
    pub bias: Option<bool>,
}

impl AttentionConfig {
    /// `num_heads` heads of the given layout, non-causal unless the architecture is (GPT-2),
    /// kv heads read from the checkpoint.
    pub fn new(layout: WeightLayout, num_heads: usize) -> Self {
        Self {
            layout,
            num_heads,
            num_kv_heads: None,
            causal: layout.is_causal_architecture(),
            scale: None,
            hidden_size: None,
            head_dim: None,
            v_head_dim: None,
            bias: None,
        }
    }

    /// States the input width, so that the layer can be created fresh on a `VarMap`
    /// (`VarBuilder::from_varmap`), as `candle_nn::linear(in, out, vb)` is.
    pub fn with_hidden_size(mut self, hidden: usize) -> Self {
        self.hidden_size = Some(hidden);
        self
    }

    /// States the query/key width per head (when it is not `hidden / heads`).
    pub fn with_head_dim(mut self, head_dim: usize) -> Self {
        self.head_dim = Some(head_dim);
        self
    }

    /// States the value width per head (when it differs from the query/key width).
    pub fn with_v_head_dim(mut self, v_head_dim: usize) -> Self {
        self.v_head_dim = Some(v_head_dim);
        self
    }

    /// Whether a fresh layer has biases (see [`AttentionConfig::bias`]).
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = Some(bias);
        self
    }

    /// The full projection sizes when the hidden size is stated, checked for consistency.
    pub(crate) fn sizes(&self) -> Result<Option<LayerSizes>> {
        let Some(hidden) = self.hidden_size else {
            return Ok(None);
        };
        let single = self.layout == WeightLayout::Single;
        let heads = if single { 1 } else { self.num_heads };
        if hidden == 0 || heads == 0 {
            return Err(Error::config(format!(
                "a fresh layer needs a positive hidden size and head count, found hidden {hidden}, {heads} heads"
            )));
        }
        let head_dim = match self.head_dim {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(Error::Heads(format!(
                    "{heads} heads do not divide the hidden size {hidden}; state the head dim with `with_head_dim`"
                )))
            }
        };
        let kv_heads = self.num_kv_heads.unwrap_or(heads);
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(Error::Heads(format!(
                "{kv_heads} key/value heads do not divide the {heads} query heads"
            )));
        }
        let v_head_dim = self.v_head_dim.unwrap_or(head_dim);
        if head_dim == 0 || v_head_dim == 0 {
            return Err(Error::config("head dims must be at least 1"));
        }
        let bias = self
            .bias
            .unwrap_or(!matches!(self.layout, WeightLayout::Llama));
        Ok(Some(LayerSizes {
            hidden,
            heads,
            kv_heads,
            head_dim,
            v_head_dim,
            bias,
        }))
    }

    /// Sets the number of key/value heads.
    pub fn with_kv_heads(mut self, kv_heads: usize) -> Self {
        self.num_kv_heads = Some(kv_heads);
        self
    }

    /// Sets causal masking.
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// The attention config of a Hugging Face model config (layout from `model_type`). The
    /// layer holds the projections; what a decoder does around them (rotary embeddings,
    /// Qwen3's and Gemma 3's per-head q/k norms between `project_qkv` and the rotation) is
    /// the caller's, as [`crate::LlamaModel`] does it.
    pub fn from_hf(cfg: &HfConfig) -> Result<Self> {
        let layout = cfg.layout()?;
        let heads = cfg.num_attention_heads;
        // The fused layouts split their rows by the stated sizes.
        let fused = matches!(
            layout,
            WeightLayout::Phi3 | WeightLayout::ModernBert | WeightLayout::GptNeoX
        );
        let gemma = cfg.model_type.as_deref() == Some("gemma3_text");
        Ok(Self {
            layout,
            num_heads: heads,
            num_kv_heads: cfg.num_key_value_heads,
            causal: matches!(
                layout,
                WeightLayout::Gpt2
                    | WeightLayout::Llama
                    | WeightLayout::Phi3
                    | WeightLayout::GptNeoX
            ),
            scale: gemma.then(|| cfg.query_pre_attn_scalar.unwrap_or(256.0).powf(-0.5)),
            hidden_size: fused.then_some(cfg.hidden_size),
            head_dim: cfg.head_dim,
            v_head_dim: None,
            bias: None,
        })
    }
}

fn default_layer_norm_eps() -> f64 {
    1e-12
}
fn default_type_vocab_size() -> usize {
    2
}
fn default_hidden_act() -> String {
    "gelu".to_string()
}
fn default_position_embedding_type() -> String {
    "absolute".to_string()
}

/// A Hugging Face `config.json`, with the BERT field names and the GPT-2 / LLaMA aliases.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct HfConfig {
    /// `bert`, `gpt2`, `llama`, ... (picks the weight layout).
    #[serde(default)]
    pub model_type: Option<String>,
    /// Model width (`n_embd` in GPT-2, `dim` in DistilBERT).
    #[serde(alias = "n_embd", alias = "d_model", alias = "dim")]
    pub hidden_size: usize,
    /// Query heads (`n_head` in GPT-2, `n_heads` in DistilBERT).
    #[serde(alias = "n_head", alias = "n_heads")]
    pub num_attention_heads: usize,
    /// Key/value heads (LLaMA grouped-query attention); absent means `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head dimension when it is not `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Number of transformer layers (`n_layer` in GPT-2, `n_layers` in DistilBERT).
    #[serde(alias = "n_layer", alias = "n_layers")]
    pub num_hidden_layers: usize,
    /// Feed-forward width (`n_inner` in GPT-2, may be null there; `hidden_dim` in
    /// DistilBERT).
    #[serde(default, alias = "n_inner", alias = "hidden_dim")]
    pub intermediate_size: Option<usize>,
    /// Longest sequence the position table covers (`n_positions` in GPT-2).
    #[serde(default, alias = "n_positions")]
    pub max_position_embeddings: Option<usize>,
    /// Vocabulary size.
    #[serde(default)]
    pub vocab_size: Option<usize>,
    /// Number of token types (segment embeddings) in BERT.
    #[serde(default = "default_type_vocab_size")]
    pub type_vocab_size: usize,
    /// LayerNorm epsilon (`layer_norm_epsilon` in GPT-2, `rms_norm_eps` in LLaMA).
    #[serde(
        default = "default_layer_norm_eps",
        alias = "layer_norm_epsilon",
        alias = "rms_norm_eps"
    )]
    pub layer_norm_eps: f64,
    /// Feed-forward activation (`gelu`, `gelu_new`, `relu`, ...; `activation_function` in
    /// GPT-2, `activation` in DistilBERT).
    #[serde(
        default = "default_hidden_act",
        alias = "activation_function",
        alias = "activation"
    )]
    pub hidden_act: String,
    /// BERT position embeddings; only `absolute` is supported by the encoder.
    #[serde(default = "default_position_embedding_type")]
    pub position_embedding_type: String,
    /// Padding token id (RoBERTa's positions count from past it).
    #[serde(default)]
    pub pad_token_id: Option<i64>,
    /// A BERT used as a causal decoder (refused by the encoder).
    #[serde(default)]
    pub is_decoder: bool,
    /// Width of the embeddings when it is not `hidden_size` (ELECTRA, ALBERT; refused by the
    /// encoder unless equal).
    #[serde(default)]
    pub embedding_size: Option<usize>,
    /// Gemma: the attention scale is `query_pre_attn_scalar^-1/2`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// The whole `config.json` as parsed, for the fields of one family only (ModernBERT's);
    /// `None` for a config built from its fields.
    #[serde(skip)]
    pub raw: Option<serde_json::Value>,
}

impl HfConfig {
    /// Reads and validates a `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        read_config_file(path.as_ref(), Self::from_json)
    }

    /// Parses and validates the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let mut cfg: HfConfig =
            serde_json::from_str(text).map_err(|e| Error::config(describe_json_error(text, &e)))?;
        cfg.raw = serde_json::from_str(text).ok();
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks that sizes are positive and heads divide the hidden size.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", Some(self.hidden_size)),
            ("num_attention_heads", Some(self.num_attention_heads)),
            ("num_hidden_layers", Some(self.num_hidden_layers)),
            ("num_key_value_heads", self.num_key_value_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("vocab_size", self.vocab_size),
            ("head_dim", self.head_dim),
        ];
        for (name, value) in positive {
            if value == Some(0) {
                return Err(Error::config(format!(
                    "`{name}` must be at least 1, found 0"
                )));
            }
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(Error::config(format!(
                "`num_attention_heads` = {} does not divide `hidden_size` = {}",
                self.num_attention_heads, self.hidden_size
            )));
        }
        if let Some(kv) = self.num_key_value_heads {
            if !self.num_attention_heads.is_multiple_of(kv) {
                return Err(Error::config(format!(
                    "`num_key_value_heads` = {kv} does not divide `num_attention_heads` = {}",
                    self.num_attention_heads
                )));
            }
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return Err(Error::config(format!(
                "`layer_norm_eps` must be a small positive number, found {}",
                self.layer_norm_eps
            )));
        }
        Ok(())
    }

    /// The weight layout for this `model_type`.
    pub fn layout(&self) -> Result<WeightLayout> {
        match self.model_type.as_deref().unwrap_or("bert") {
            "bert" | "roberta" | "xlm-roberta" | "camembert" | "electra" => Ok(WeightLayout::Bert),
            "distilbert" => Ok(WeightLayout::DistilBert),
            "gpt2" => Ok(WeightLayout::Gpt2),
            "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3_text" => Ok(WeightLayout::Llama),
            "phi3" => Ok(WeightLayout::Phi3),
            "modernbert" => Ok(WeightLayout::ModernBert),
            "gpt_neox" => Ok(WeightLayout::GptNeoX),
            other => Err(Error::config(format!(
                "model_type `{other}` has no known attention layout (bert, distilbert, gpt2, \
                 llama, phi3, modernbert, gpt_neox families)"
            ))),
        }
    }
}

/// Reads a `config.json` and parses it with `parse`; configuration errors name the file.
pub(crate) fn read_config_file<T>(path: &Path, parse: impl FnOnce(&str) -> Result<T>) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|cause| Error::Io {
        path: path.to_path_buf(),
        cause,
    })?;
    parse(&text).map_err(|e| match e {
        Error::Config { message, .. } => Error::Config {
            path: Some(path.to_path_buf()),
            message,
        },
        other => other,
    })
}

/// serde's message for a value of the wrong type or range does not say which field holds
/// it (``invalid value: integer `-3`, expected usize at line 2 column 18``); this names the
/// key written right before the error position.
fn describe_json_error(text: &str, err: &serde_json::Error) -> String {
    let message = err.to_string();
    let about_a_value = ["invalid type", "invalid value", "invalid length"]
        .iter()
        .any(|p| message.starts_with(p));
    if !about_a_value {
        return message;
    }
    match key_before(text, err.line(), err.column()) {
        Some(key) => format!("field `{key}`: {message}"),
        None => message,
    }
}

/// The last `"key":` that starts before `line`/`column` (1-based line, byte column).
fn key_before(text: &str, line: usize, column: usize) -> Option<String> {
    let line_start: usize = text
        .split_inclusive('\n')
        .take(line.saturating_sub(1))
        .map(str::len)
        .sum();
    let mut end = (line_start + column).min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    before.rmatch_indices(':').find_map(|(colon, _)| {
        let key = before[..colon].trim_end().strip_suffix('"')?;
        let open = key.rfind('"')?;
        Some(key[open + 1..].to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bert_gpt2_and_llama_field_names() -> Result<()> {
        let bert: HfConfig = serde_json::from_str(
            r#"{"model_type":"bert","hidden_size":384,"num_attention_heads":12,"num_hidden_layers":6,"intermediate_size":1536,"max_position_embeddings":512}"#,
        )
        .map_err(|e| Error::config(e.to_string()))?;
        assert_eq!(bert.layout()?, WeightLayout::Bert);
        assert!(!AttentionConfig::from_hf(&bert)?.causal);
        let gpt2: HfConfig = serde_json::from_str(
            r#"{"model_type":"gpt2","n_embd":768,"n_head":12,"n_layer":12,"n_positions":1024,"n_inner":null,"layer_norm_epsilon":1e-5,"activation_function":"gelu_new"}"#,
        )
        .map_err(|e| Error::config(e.to_string()))?;
        assert_eq!((gpt2.hidden_size, gpt2.num_attention_heads), (768, 12));
        assert_eq!(gpt2.max_position_embeddings, Some(1024));
        assert!(AttentionConfig::from_hf(&gpt2)?.causal);
        let llama: HfConfig = serde_json::from_str(
            r#"{"model_type":"llama","hidden_size":2048,"num_attention_heads":32,"num_key_value_heads":4,"num_hidden_layers":22,"rms_norm_eps":1e-5}"#,
        )
        .map_err(|e| Error::config(e.to_string()))?;
        assert_eq!(AttentionConfig::from_hf(&llama)?.num_kv_heads, Some(4));
        Ok(())
    }

    #[test]
    fn nonsense_is_rejected() {
        let zero: HfConfig = serde_json::from_str(
            r#"{"hidden_size":384,"num_attention_heads":12,"num_hidden_layers":0}"#,
        )
        .expect("parses");
        assert!(zero
            .validate()
            .unwrap_err()
            .to_string()
            .contains("num_hidden_layers"));
        let odd: HfConfig = serde_json::from_str(
            r#"{"hidden_size":384,"num_attention_heads":7,"num_hidden_layers":2}"#,
        )
        .expect("parses");
        assert!(odd
            .validate()
            .unwrap_err()
            .to_string()
            .contains("does not divide"));
        assert!(serde_json::from_str::<HfConfig>(
            r#"{"hidden_size":-3,"num_attention_heads":1,"num_hidden_layers":1}"#
        )
        .is_err());
    }

    #[test]
    fn json_errors_name_the_field() {
        let text = "{\n  \"num_attention_heads\": 2,\n  \"hidden_size\": -3,\n  \"num_hidden_layers\": 1\n}";
        let err = serde_json::from_str::<HfConfig>(text).expect_err("negative size");
        let message = describe_json_error(text, &err);
        assert!(
            message.starts_with("field `hidden_size`: invalid value"),
            "{message}"
        );
        let text = r#"{"hidden_size":8,"num_hidden_layers":1}"#;
        let err = serde_json::from_str::<HfConfig>(text).expect_err("missing heads");
        assert!(describe_json_error(text, &err).starts_with("missing field `num_attention_heads`"));
    }
}
