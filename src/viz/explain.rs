//! Explanations beside the raw weights: attention rollout ([`rollout`]), gradient-weighted
//! relevance through this crate's differentiable forward ([`relevance`]) and value-weighted
//! norms ([`value_norms`]), for one sentence of an encoder or a decoder.
//!
//! [`Explanation`] serializes to the `"explain"` object of `attention_dump --format json`:
//! `{"method": "rollout", "matrix"}`, `{"method": "grad", "target": "cosine", "against",
//! "value", "matrix"}` (decoders: `"target": "logit", "token_id"`), `{"method": "norm",
//! "norms"}`; matrices are `(seq, seq)` over the model's tokens (or words), f32 at full
//! precision.

pub mod relevance;
pub mod rollout;
pub mod value_norms;

use candle_core::{Device, IndexOp, Tensor};
use serde::ser::{Serialize, SerializeMap, Serializer};

use crate::error::{Error, Result};
use crate::models::bert::{l2_normalize, mean_pool, BertEncoder};
use crate::models::llama::LlamaModel;
use crate::models::trace::{ForwardTrace, TraceOptions};
use crate::text::{EncodedText, TextEncoder};
use crate::viz::words::{aggregate, word_groups};

use relevance::gradient_relevance;
use rollout::attention_rollout;
use value_norms::weighted_value_norms;

/// What to explain with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExplainMethod {
    /// Attention rollout (Abnar & Zuidema 2020).
    Rollout,
    /// Gradient-weighted relevance (Chefer, Gur & Wolf 2021).
    Grad,
    /// `‖α_ij f_h(x_j)‖` per layer and head (Kobayashi et al. 2020).
    Norm,
}

impl ExplainMethod {
    /// `rollout`, `grad` or `norm`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "rollout" => Ok(Self::Rollout),
            "grad" => Ok(Self::Grad),
            "norm" => Ok(Self::Norm),
            other => Err(Error::input(
                "--explain",
                "rollout, grad or norm",
                format!("`{other}`"),
            )),
        }
    }

    /// The name `parse` takes.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Rollout => "rollout",
            Self::Grad => "grad",
            Self::Norm => "norm",
        }
    }
}

/// The scalar a gradient explanation differentiates.
#[derive(Debug, Clone, PartialEq)]
pub enum GradTarget {
    /// An encoder: the cosine similarity of the sentence's embedding (the model's mean
    /// pooling, L2-normalised, as `embed` computes it) and that of `against`.
    Cosine {
        /// The text compared with.
        against: String,
    },
    /// A decoder: the logit of `token_id` after the last position.
    Logit {
        /// The token whose logit is differentiated.
        token_id: u32,
    },
}

/// One sentence's explanation.
#[derive(Debug, Clone, PartialEq)]
pub enum Explanation {
    /// Attention rollout.
    Rollout {
        /// `(seq, seq)`: row `i` = how much output position `i` draws from input token `j`.
        matrix: Vec<Vec<f32>>,
    },
    /// Gradient-weighted relevance.
    Grad {
        /// What was differentiated.
        target: GradTarget,
        /// The target's value.
        value: f32,
        /// `(seq, seq)` relevance of input token `j` to position `i`.
        matrix: Vec<Vec<f32>>,
    },
    /// Value-weighted norms.
    Norm {
        /// `[layers][heads][seq][seq]`: `‖α_ij f_h(x_j)‖`.
        norms: Vec<Vec<Vec<Vec<f32>>>>,
        /// `[layers][heads][seq]`: `‖f_h(x_j)‖`, of which the norms are the weights' multiples
        /// (`None` once word pieces are merged, where that no longer holds). Not in the JSON.
        value_norms: Option<Vec<Vec<Vec<f32>>>>,
    },
}

impl Serialize for Explanation {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        match self {
            Self::Rollout { matrix } => {
                map.serialize_entry("method", "rollout")?;
                map.serialize_entry("matrix", matrix)?;
            }
            Self::Grad {
                target,
                value,
                matrix,
            } => {
                map.serialize_entry("method", "grad")?;
                match target {
                    GradTarget::Cosine { against } => {
                        map.serialize_entry("target", "cosine")?;
                        map.serialize_entry("against", against)?;
                    }
                    GradTarget::Logit { token_id } => {
                        map.serialize_entry("target", "logit")?;
                        map.serialize_entry("token_id", token_id)?;
                    }
                }
                map.serialize_entry("value", value)?;
                map.serialize_entry("matrix", matrix)?;
            }
            Self::Norm { norms, .. } => {
                map.serialize_entry("method", "norm")?;
                map.serialize_entry("norms", norms)?;
            }
        }
        map.end()
    }
}

impl Explanation {
    /// Explains one sentence of an encoder. `against` is the text a gradient explanation
    /// compares the sentence with (required for [`ExplainMethod::Grad`], an error without
    /// it); its embedding is computed without gradients, so the gradients run through the
    /// sentence's forward only.
    pub fn encoder(
        encoder: &BertEncoder,
        text: &TextEncoder,
        item: &EncodedText,
        method: ExplainMethod,
        against: Option<&str>,
        device: &Device,
    ) -> Result<Self> {
        let ids = Tensor::new(item.ids.as_slice(), device)?.unsqueeze(0)?; // (1, seq)
        let types = Tensor::new(item.type_ids.as_slice(), device)?.unsqueeze(0)?;
        let against =
            match (method, against) {
                (ExplainMethod::Grad, None) => return Err(Error::input(
                    "--against",
                    "the text to compare with: an encoder's gradient explanation differentiates \
                     the cosine similarity of the sentence's and that text's embeddings",
                    "none",
                )),
                (ExplainMethod::Grad, Some(a)) => Some(a),
                _ => None,
            };
        let opts = TraceOptions {
            grad: against.is_some(),
            value_norms: method == ExplainMethod::Norm,
        };
        let trace = encoder.trace(&ids, &types, opts)?;
        let Some(against) = against else {
            return Self::without_gradients(method, &trace);
        };
        let mask = ids.ones_like()?;
        let mine = l2_normalize(&mean_pool(&trace.output, &mask)?)?; // (1, hidden)
        let other = text.encode_batch(&[against], device)?;
        let theirs = encoder.forward(
            &other.input_ids,
            Some(&other.token_type_ids),
            Some(&other.attention_mask),
            false,
        )?;
        let theirs = l2_normalize(&mean_pool(&theirs.hidden_states, &other.attention_mask)?)?;
        let y = (mine * theirs.detach())?.sum_all()?;
        let target = GradTarget::Cosine {
            against: against.to_string(),
        };
        Self::with_gradients(&trace, &y, target)
    }

    /// Explains a decoder's prompt `ids`. A gradient explanation differentiates the logit
    /// of `target_token` after the last position (default: the greedy next token).
    pub fn decoder(
        model: &LlamaModel,
        ids: &[u32],
        method: ExplainMethod,
        target_token: Option<u32>,
        device: &Device,
    ) -> Result<Self> {
        let ids = Tensor::new(ids, device)?.unsqueeze(0)?; // (1, seq)
        let opts = TraceOptions {
            grad: method == ExplainMethod::Grad,
            value_norms: method == ExplainMethod::Norm,
        };
        let trace = model.trace(&ids, opts)?;
        if method != ExplainMethod::Grad {
            return Self::without_gradients(method, &trace);
        }
        let logits = trace.output.i(0)?; // (vocab,)
        let vocab = logits.dim(0)?;
        let token_id = match target_token {
            Some(t) if (t as usize) < vocab => t,
            Some(t) => {
                return Err(Error::input(
                    "--target-token",
                    format!("a token id below the vocabulary size {vocab}"),
                    format!("{t}"),
                ))
            }
            None => logits.argmax(0)?.to_scalar::<u32>()?,
        };
        let y = logits.i(token_id as usize)?;
        Self::with_gradients(&trace, &y, GradTarget::Logit { token_id })
    }

    fn without_gradients(method: ExplainMethod, trace: &ForwardTrace) -> Result<Self> {
        let heads = per_layer(&trace.attentions)?;
        match method {
            ExplainMethod::Rollout => Ok(Self::Rollout {
                matrix: attention_rollout(&heads)?.to_vec2()?,
            }),
            ExplainMethod::Norm => {
                let norms = heads
                    .iter()
                    .zip(&trace.value_norms)
                    .map(|(a, n)| Ok(weighted_value_norms(a, &n.i(0)?)?.to_vec3()?))
                    .collect::<Result<Vec<_>>>()?;
                let value_norms = trace
                    .value_norms
                    .iter()
                    .map(|n| Ok(n.i(0)?.to_vec2()?))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Self::Norm {
                    norms,
                    value_norms: Some(value_norms),
                })
            }
            ExplainMethod::Grad => Err(Error::Kernel(
                "a gradient explanation needs its target".into(),
            )),
        }
    }

    fn with_gradients(trace: &ForwardTrace, y: &Tensor, target: GradTarget) -> Result<Self> {
        let value = y.to_scalar::<f32>()?;
        let grads = y.backward()?;
        let heads = per_layer(&trace.attentions)?;
        if trace.probes.len() != heads.len() {
            return Err(Error::Kernel("a gradient trace without its probes".into()));
        }
        let g = trace
            .probes
            .iter()
            .zip(&heads)
            .map(|(p, h)| match grads.get(p) {
                Some(g) => Ok(g.i(0)?),
                // No path from this layer's weights to the target: zero relevance.
                None => Ok(h.zeros_like()?),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::Grad {
            target,
            value,
            matrix: gradient_relevance(&heads, &g)?.to_vec2()?,
        })
    }

    /// `"rollout"`, `"grad"` or `"norm"`.
    pub fn method(&self) -> ExplainMethod {
        match self {
            Self::Rollout { .. } => ExplainMethod::Rollout,
            Self::Grad { .. } => ExplainMethod::Grad,
            Self::Norm { .. } => ExplainMethod::Norm,
        }
    }

    /// The same explanation over words: a word's value as a key is the sum over its pieces,
    /// as a query the mean over its pieces (as [`crate::viz::AttentionDump::into_words`]).
    pub fn into_words(self, item: &EncodedText) -> Self {
        let groups = word_groups(item);
        match self {
            Self::Rollout { matrix } => Self::Rollout {
                matrix: aggregate(&matrix, &groups),
            },
            Self::Grad {
                target,
                value,
                matrix,
            } => Self::Grad {
                target,
                value,
                matrix: aggregate(&matrix, &groups),
            },
            Self::Norm { norms, .. } => Self::Norm {
                norms: norms
                    .iter()
                    .map(|heads| heads.iter().map(|m| aggregate(m, &groups)).collect())
                    .collect(),
                value_norms: None,
            },
        }
    }

    /// The matrix a person is shown: rollout's and grad's own; for norms, layer `layer`
    /// (default the last) and head `head` (default the mean over heads).
    pub fn view(&self, layer: Option<usize>, head: Option<usize>) -> Vec<Vec<f32>> {
        match self {
            Self::Rollout { matrix } | Self::Grad { matrix, .. } => matrix.clone(),
            Self::Norm { norms, .. } => {
                let Some(heads) = layer.and_then(|l| norms.get(l)).or_else(|| norms.last()) else {
                    return Vec::new();
                };
                match head.and_then(|h| heads.get(h)) {
                    Some(m) => m.clone(),
                    None => mean_of(heads),
                }
            }
        }
    }

    /// A header naming the method and, for grad, its target.
    pub fn title(&self, layer: Option<usize>, head: Option<usize>) -> String {
        match self {
            Self::Rollout { .. } => "attention rollout (Abnar & Zuidema 2020)".to_string(),
            Self::Grad { target, value, .. } => {
                let what = match target {
                    GradTarget::Cosine { against } => {
                        format!("cosine similarity with \"{against}\"")
                    }
                    GradTarget::Logit { token_id } => format!("logit of token {token_id}"),
                };
                format!(
                    "gradient-weighted relevance (Chefer et al. 2021) of the {what} = {value:.4}"
                )
            }
            Self::Norm { norms, .. } => {
                let l = layer
                    .filter(|&l| l < norms.len())
                    .unwrap_or(norms.len().saturating_sub(1));
                let h = match head {
                    Some(h) => format!("head {h}"),
                    None => "mean over heads".to_string(),
                };
                format!("value-weighted norms |a f(x)| (Kobayashi et al. 2020), layer {l}, {h}")
            }
        }
    }
}

/// Each layer's `(heads, seq, seq)` from `(1, heads, seq, seq)`.
fn per_layer(attentions: &[Tensor]) -> Result<Vec<Tensor>> {
    attentions.iter().map(|a| Ok(a.detach().i(0)?)).collect()
}

fn mean_of(heads: &[Vec<Vec<f32>>]) -> Vec<Vec<f32>> {
    let n = heads.len().max(1) as f32;
    let Some(first) = heads.first() else {
        return Vec::new();
    };
    let mut out = vec![vec![0f32; first.first().map_or(0, Vec::len)]; first.len()];
    for m in heads {
        for (o, r) in out.iter_mut().zip(m) {
            for (x, v) in o.iter_mut().zip(r) {
                *x += v / n;
            }
        }
    }
    out
}

/// Input tokens ranked by their value in row `row` of `matrix`, largest first.
pub fn ranking(tokens: &[String], matrix: &[Vec<f32>], row: usize) -> Vec<(String, f32)> {
    let Some(r) = matrix.get(row) else {
        return Vec::new();
    };
    let mut ranked: Vec<(String, f32)> = tokens.iter().cloned().zip(r.iter().copied()).collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    ranked
}
