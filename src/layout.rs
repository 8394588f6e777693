//! Checkpoint layouts: where each real checkpoint family keeps its attention projections.
//!
//! All tensor renaming and re-shaping (PyTorch's packed `in_proj_weight`, GPT-2's transposed
//! `Conv1D` weights) happens here and nowhere else. Every layout yields [`Projections`] in the
//! candle `Linear` convention: weights `(out, in)`, biases `(out,)`.

use std::fmt;
use std::str::FromStr;

use candle_core::Tensor;
use candle_nn::VarBuilder;

use crate::error::{Error, Result};

/// The checkpoint families whose attention weights this crate loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightLayout {
    /// BERT / RoBERTa / MiniLM: `self.{query,key,value}.{weight,bias}`,
    /// `output.dense.{weight,bias}` under a prefix like `encoder.layer.3.attention`.
    Bert,
    /// PyTorch `nn.MultiheadAttention`: packed `in_proj_weight (3d, d)`, `in_proj_bias (3d)`
    /// (or `q_proj_weight`/`k_proj_weight`/`v_proj_weight` when `kdim`/`vdim` differ),
    /// `out_proj.{weight,bias}`.
    TorchMha,
    /// GPT-2: `c_attn.weight (d, 3d)` and `c_proj.weight (d, d)` stored transposed
    /// (`Conv1D`), with biases.
    Gpt2,
    /// LLaMA / Mistral / Qwen2: `q_proj`, `k_proj`, `v_proj` (`kv_heads * head_dim` rows),
    /// `o_proj`; biases used when present.
    Llama,
    /// Single-head self-attention: `query`, `key`, `value` (bias optional), no output
    /// projection; `d_k` may differ from `d_v`.
    Single,
}

impl WeightLayout {
    /// Every layout, in the order of their command-line names.
    pub const ALL: [WeightLayout; 5] = [
        WeightLayout::Bert,
        WeightLayout::TorchMha,
        WeightLayout::Gpt2,
        WeightLayout::Llama,
        WeightLayout::Single,
    ];

    /// The command-line name (`bert`, `torch-mha`, `gpt2`, `llama`, `single`).
    pub fn name(&self) -> &'static str {
        match self {
            WeightLayout::Bert => "bert",
            WeightLayout::TorchMha => "torch-mha",
            WeightLayout::Gpt2 => "gpt2",
            WeightLayout::Llama => "llama",
            WeightLayout::Single => "single",
        }
    }

    /// Whether the architecture's attention is causal by construction (GPT-2).
    pub fn is_causal_architecture(&self) -> bool {
        matches!(self, WeightLayout::Gpt2)
    }

    /// Reads this layout's projections from `vb` (already positioned at the attention prefix).
    pub fn load(&self, vb: &VarBuilder) -> Result<Projections> {
        match self {
            WeightLayout::Bert => {
                let s = vb.pp("self");
                Ok(Projections {
                    q: linear(&s.pp("query"))?,
                    k: linear(&s.pp("key"))?,
                    v: linear(&s.pp("value"))?,
                    o: Some(linear(&vb.pp("output").pp("dense"))?),
                })
            }
            WeightLayout::TorchMha => {
                let (q, k, v) = if !vb.contains_tensor("in_proj_weight")
                    && vb.contains_tensor("q_proj_weight")
                {
                    // kdim/vdim != embed_dim: separate projections, packed bias.
                    let q = weight(vb, "q_proj_weight")?;
                    let k = weight(vb, "k_proj_weight")?;
                    let v = weight(vb, "v_proj_weight")?;
                    let (dq, dk, dv) = (q.dim(0)?, k.dim(0)?, v.dim(0)?);
                    let bias = opt_bias(vb, "in_proj_bias", dq + dk + dv)?;
                    let [bq, bk, bv] = split_bias(bias, [dq, dk, dv])?;
                    (
                        LinearWeights::new(q, bq, full_name(vb, "q_proj_weight")),
                        LinearWeights::new(k, bk, full_name(vb, "k_proj_weight")),
                        LinearWeights::new(v, bv, full_name(vb, "v_proj_weight")),
                    )
                } else {
                    let w = weight(vb, "in_proj_weight")?; // (3d, d)
                    let rows = w.dim(0)?;
                    if rows % 3 != 0 {
                        return Err(shape_error(
                            vb,
                            "in_proj_weight",
                            "(3 * embed_dim, embed_dim)",
                            &w,
                        ));
                    }
                    let d = rows / 3;
                    let bias = opt_bias(vb, "in_proj_bias", rows)?;
                    let [wq, wk, wv] = split_rows(&w, [d, d, d])?;
                    let [bq, bk, bv] = split_bias(bias, [d, d, d])?;
                    let name = full_name(vb, "in_proj_weight");
                    (
                        LinearWeights::new(wq, bq, format!("{name} (query rows)")),
                        LinearWeights::new(wk, bk, format!("{name} (key rows)")),
                        LinearWeights::new(wv, bv, format!("{name} (value rows)")),
                    )
                };
                Ok(Projections {
                    q,
                    k,
                    v,
                    o: Some(linear_named(&vb.pp("out_proj"), "weight", "bias")?),
                })
            }
            WeightLayout::Gpt2 => {
                let c_attn = vb.pp("c_attn");
                let w = weight(&c_attn, "weight")?; // Conv1D: (d, 3d)
                let cols = w.dim(1)?;
                if cols % 3 != 0 || cols / 3 != w.dim(0)? {
                    return Err(shape_error(
                        &c_attn,
                        "weight",
                        "(d, 3 * d) (GPT-2 Conv1D, stored transposed)",
                        &w,
                    ));
                }
                let d = cols / 3;
                let w = w.t()?.contiguous()?; // (3d, d)
                let bias = opt_bias(&c_attn, "bias", 3 * d)?;
                let [wq, wk, wv] = split_rows(&w, [d, d, d])?;
                let [bq, bk, bv] = split_bias(bias, [d, d, d])?;
                let c_proj = vb.pp("c_proj");
                let wo = weight(&c_proj, "weight")?; // Conv1D: (in, out)
                let wo = wo.t()?.contiguous()?; // (out, in)
                let bo = opt_bias(&c_proj, "bias", wo.dim(0)?)?;
                let name = full_name(&c_attn, "weight");
                Ok(Projections {
                    q: LinearWeights::new(wq, bq, format!("{name} (query columns)")),
                    k: LinearWeights::new(wk, bk, format!("{name} (key columns)")),
                    v: LinearWeights::new(wv, bv, format!("{name} (value columns)")),
                    o: Some(LinearWeights::new(wo, bo, full_name(&c_proj, "weight"))),
                })
            }
            WeightLayout::Llama => Ok(Projections {
                q: linear(&vb.pp("q_proj"))?,
                k: linear(&vb.pp("k_proj"))?,
                v: linear(&vb.pp("v_proj"))?,
                o: Some(linear(&vb.pp("o_proj"))?),
            }),
            WeightLayout::Single => Ok(Projections {
                q: linear(&vb.pp("query"))?,
                k: linear(&vb.pp("key"))?,
                v: linear(&vb.pp("value"))?,
                o: None,
            }),
        }
    }
}

impl fmt::Display for WeightLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WeightLayout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let norm = s.to_ascii_lowercase().replace('_', "-");
        Self::ALL
            .into_iter()
            .find(|l| l.name() == norm)
            .ok_or_else(|| {
                Error::config(format!(
                    "unknown layout `{s}`; expected one of bert, torch-mha, gpt2, llama, single"
                ))
            })
    }
}

/// One projection in the candle `Linear` convention.
#[derive(Debug, Clone)]
pub struct LinearWeights {
    /// `(out, in)`
    pub weight: Tensor,
    /// `(out,)`
    pub bias: Option<Tensor>,
    /// Where the weight came from (checkpoint name), for error messages.
    pub name: String,
}

impl LinearWeights {
    /// Wraps a weight `(out, in)` and an optional bias `(out,)`.
    pub fn new(weight: Tensor, bias: Option<Tensor>, name: impl Into<String>) -> Self {
        Self {
            weight,
            bias,
            name: name.into(),
        }
    }

    /// `(out, in)` of the weight.
    pub fn dims(&self) -> Result<(usize, usize)> {
        Ok(self.weight.dims2()?)
    }
}

/// The attention projections of one layer, in the candle `Linear` convention.
#[derive(Debug, Clone)]
pub struct Projections {
    pub q: LinearWeights,
    pub k: LinearWeights,
    pub v: LinearWeights,
    /// Output projection W_O, absent for single-head attention.
    pub o: Option<LinearWeights>,
}

fn full_name(vb: &VarBuilder, name: &str) -> String {
    let p = vb.prefix();
    if p.is_empty() {
        name.to_string()
    } else {
        format!("{p}.{name}")
    }
}

fn shape_error(vb: &VarBuilder, name: &str, expected: &str, t: &Tensor) -> Error {
    Error::ShapeMismatch {
        tensor: full_name(vb, name),
        expected: expected.to_string(),
        found: t.dims().to_vec(),
    }
}

/// A rank-2 weight read with the dimensions the checkpoint has.
fn weight(vb: &VarBuilder, name: &str) -> Result<Tensor> {
    let w = vb.get_unchecked(name)?;
    if w.rank() != 2 || w.elem_count() == 0 {
        return Err(shape_error(vb, name, "a non-empty rank-2 matrix", &w));
    }
    Ok(w)
}

/// A bias of `len` entries if the checkpoint has one.
fn opt_bias(vb: &VarBuilder, name: &str, len: usize) -> Result<Option<Tensor>> {
    if !vb.contains_tensor(name) {
        return Ok(None);
    }
    Ok(Some(vb.get(len, name)?))
}

fn linear(vb: &VarBuilder) -> Result<LinearWeights> {
    linear_named(vb, "weight", "bias")
}

fn linear_named(vb: &VarBuilder, w: &str, b: &str) -> Result<LinearWeights> {
    let weight = weight(vb, w)?;
    let bias = opt_bias(vb, b, weight.dim(0)?)?;
    Ok(LinearWeights::new(weight, bias, full_name(vb, w)))
}

fn split_rows(w: &Tensor, rows: [usize; 3]) -> Result<[Tensor; 3]> {
    Ok([
        w.narrow(0, 0, rows[0])?,
        w.narrow(0, rows[0], rows[1])?,
        w.narrow(0, rows[0] + rows[1], rows[2])?,
    ])
}

fn split_bias(b: Option<Tensor>, rows: [usize; 3]) -> Result<[Option<Tensor>; 3]> {
    Ok(match b {
        None => [None, None, None],
        Some(b) => split_rows(&b, rows)?.map(Some),
    })
}
