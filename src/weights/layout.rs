//! Checkpoint layouts: where each real checkpoint family keeps its attention projections.
//!
//! All tensor renaming and re-shaping (PyTorch's packed `in_proj_weight`, GPT-2's transposed
//! `Conv1D` weights) happens here and nowhere else. Every layout yields [`Projections`] in the
//! candle `Linear` convention: weights `(out, in)`, biases `(out,)`.

use std::fmt;
use std::str::FromStr;

use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};

use crate::error::{Error, Result};

/// Every projection size of a layer whose sizes were stated (see `AttentionConfig::sizes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LayerSizes {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub v_head_dim: usize,
    pub bias: bool,
}

/// The checkpoint families whose attention weights this crate loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightLayout {
    /// BERT / RoBERTa / MiniLM: `self.{query,key,value}.{weight,bias}`,
    /// `output.dense.{weight,bias}` under a prefix like `encoder.layer.3.attention`.
    Bert,
    /// DistilBERT: `q_lin`, `k_lin`, `v_lin`, `out_lin`, each with weight and bias, under a
    /// prefix like `transformer.layer.3.attention`.
    DistilBert,
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
    /// Phi-3: `qkv_proj` holding the query, key and value rows one after the other
    /// (`(heads + 2 kv_heads) * head_dim` rows), `o_proj`; the sizes must be stated.
    Phi3,
    /// ModernBERT: `Wqkv` holding the query, key and value rows one after the other, `Wo`;
    /// biases where the checkpoint has them; the sizes must be stated.
    ModernBert,
    /// GPT-NeoX / Pythia: `query_key_value` with each head's query, key and value rows
    /// together (head `h`'s `3 * head_dim` rows, then head `h + 1`'s), `dense`; the sizes
    /// must be stated.
    GptNeoX,
    /// Single-head self-attention: `query`, `key`, `value` (bias optional), no output
    /// projection; `d_k` may differ from `d_v`.
    Single,
}

impl WeightLayout {
    /// Every layout, in the order of their command-line names.
    pub const ALL: [WeightLayout; 9] = [
        WeightLayout::Bert,
        WeightLayout::DistilBert,
        WeightLayout::TorchMha,
        WeightLayout::Gpt2,
        WeightLayout::Llama,
        WeightLayout::Phi3,
        WeightLayout::ModernBert,
        WeightLayout::GptNeoX,
        WeightLayout::Single,
    ];

    /// The command-line name (`bert`, `distilbert`, `torch-mha`, `gpt2`, `llama`, `single`).
    pub fn name(&self) -> &'static str {
        match self {
            WeightLayout::Bert => "bert",
            WeightLayout::DistilBert => "distilbert",
            WeightLayout::TorchMha => "torch-mha",
            WeightLayout::Gpt2 => "gpt2",
            WeightLayout::Llama => "llama",
            WeightLayout::Phi3 => "phi3",
            WeightLayout::ModernBert => "modernbert",
            WeightLayout::GptNeoX => "gpt-neox",
            WeightLayout::Single => "single",
        }
    }

    /// Whether the architecture's attention is causal by construction (GPT-2).
    pub fn is_causal_architecture(&self) -> bool {
        matches!(self, WeightLayout::Gpt2)
    }

    /// Where the layouts that store Q, K, V and `W_O` as four `(out, in)` matrices keep them,
    /// relative to the attention prefix (each with its `weight` and optional `bias`); `None`
    /// for the layouts that pack Q, K and V into one tensor or have no `W_O`.
    pub(crate) fn separate_projections(&self) -> Option<[&'static str; 4]> {
        match self {
            WeightLayout::Bert => Some(["self.query", "self.key", "self.value", "output.dense"]),
            WeightLayout::DistilBert => Some(["q_lin", "k_lin", "v_lin", "out_lin"]),
            WeightLayout::Llama => Some(["q_proj", "k_proj", "v_proj", "o_proj"]),
            WeightLayout::TorchMha
            | WeightLayout::Gpt2
            | WeightLayout::Phi3
            | WeightLayout::ModernBert
            | WeightLayout::GptNeoX
            | WeightLayout::Single => None,
        }
    }

    /// Reads this layout's projections from `vb` (already positioned at the attention prefix).
    pub fn load(&self, vb: &VarBuilder) -> Result<Projections> {
        self.load_sized(vb, None)
    }

    /// Reads this layout's projections; with `sizes`, every tensor is read with its full
    /// shape (a checkpoint's must match) and, on a `VarBuilder` that makes variables (a
    /// `VarMap`), created with candle-nn's default initialisation, as `candle_nn::linear` does.
    pub(crate) fn load_sized(
        &self,
        vb: &VarBuilder,
        sizes: Option<&LayerSizes>,
    ) -> Result<Projections> {
        Ok(self.load_with_packed(vb, sizes)?.0)
    }

    /// [`WeightLayout::load_sized`], and for the layouts that store Q, K and V as one tensor
    /// (`in_proj_weight`, GPT-2's `c_attn`) that tensor as it is stored, so that a trainable
    /// layer multiplies by it without a copy.
    pub(crate) fn load_with_packed(
        &self,
        vb: &VarBuilder,
        sizes: Option<&LayerSizes>,
    ) -> Result<(Projections, Option<PackedQkv>)> {
        let mut packed = None;
        let p = self.load_projections(vb, sizes, &mut packed)?;
        Ok((p, packed))
    }

    fn load_projections(
        &self,
        vb: &VarBuilder,
        sizes: Option<&LayerSizes>,
        packed: &mut Option<PackedQkv>,
    ) -> Result<Projections> {
        let s = sizes.copied();
        // (out, in) of each projection when the sizes are stated.
        let (q_out, k_out, v_out) = match s {
            Some(z) => (
                z.heads * z.head_dim,
                z.kv_heads * z.head_dim,
                z.kv_heads * z.v_head_dim,
            ),
            None => (0, 0, 0),
        };
        let hidden = s.map_or(0, |z| z.hidden);
        let bias = s.is_some_and(|z| z.bias);
        let lin = |vb: &VarBuilder, out: usize, inp: usize, with_bias: bool| {
            linear_named(vb, "weight", "bias", s.map(|_| (out, inp)), with_bias)
        };
        match self {
            WeightLayout::Bert => {
                let sp = vb.pp("self");
                Ok(Projections {
                    q: lin(&sp.pp("query"), q_out, hidden, bias)?,
                    k: lin(&sp.pp("key"), k_out, hidden, bias)?,
                    v: lin(&sp.pp("value"), v_out, hidden, bias)?,
                    o: Some(lin(
                        &vb.pp("output").pp("dense"),
                        hidden,
                        s.map_or(0, |z| z.heads * z.v_head_dim),
                        bias,
                    )?),
                })
            }
            WeightLayout::TorchMha => {
                check_packable(
                    s,
                    "the torch-mha layout packs Q, K and V as `in_proj_weight` (3 x embed_dim, embed_dim)",
                )?;
                let (q, k, v) = if !vb.contains_tensor("in_proj_weight")
                    && vb.contains_tensor("q_proj_weight")
                {
                    // kdim/vdim != embed_dim: separate projections, packed bias.
                    let q = weight(vb, "q_proj_weight", None)?;
                    let k = weight(vb, "k_proj_weight", None)?;
                    let v = weight(vb, "v_proj_weight", None)?;
                    let (dq, dk, dv) = (q.dim(0)?, k.dim(0)?, v.dim(0)?);
                    let bias = opt_bias(vb, "in_proj_bias", dq + dk + dv, None)?;
                    let [bq, bk, bv] = split_bias(bias, [dq, dk, dv])?;
                    (
                        LinearWeights::new(q, bq, full_name(vb, "q_proj_weight")),
                        LinearWeights::new(k, bk, full_name(vb, "k_proj_weight")),
                        LinearWeights::new(v, bv, full_name(vb, "v_proj_weight")),
                    )
                } else {
                    let fresh = s.is_some() && !vb.contains_tensor("in_proj_weight");
                    let w = weight(
                        vb,
                        "in_proj_weight",
                        s.map(|z| Sized::out_in(3 * z.hidden, z.hidden)),
                    )?; // (3d, d)
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
                    let bias = opt_bias(
                        vb,
                        "in_proj_bias",
                        rows,
                        (fresh && bias).then_some(rows / 3),
                    )?;
                    *packed = Some(PackedQkv {
                        weight: w.clone(),
                        transposed: false,
                        bias: bias.clone(),
                        out_in_out: None,
                    });
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
                    o: Some(lin(&vb.pp("out_proj"), hidden, hidden, bias)?),
                })
            }
            WeightLayout::Gpt2 => {
                check_packable(
                    s,
                    "the gpt2 layout packs Q, K and V as `c_attn.weight` (d, 3 x d)",
                )?;
                let c_attn = vb.pp("c_attn");
                let fresh = s.is_some() && !c_attn.contains_tensor("weight");
                let w = weight(
                    &c_attn,
                    "weight",
                    s.map(|z| Sized::in_out(z.hidden, 3 * z.hidden)),
                )?; // Conv1D: (d, 3d)
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
                let bias_c = opt_bias(&c_attn, "bias", 3 * d, (fresh && bias).then_some(d))?;
                *packed = Some(PackedQkv {
                    weight: w.clone(),
                    transposed: true,
                    bias: bias_c.clone(),
                    out_in_out: None,
                });
                // A view (no copy): the projections stay tied to the stored tensor, which
                // an optimizer may update in place.
                let w = w.t()?; // (3d, d)
                let [wq, wk, wv] = split_rows(&w, [d, d, d])?;
                let [bq, bk, bv] = split_bias(bias_c, [d, d, d])?;
                let c_proj = vb.pp("c_proj");
                let fresh_o = s.is_some() && !c_proj.contains_tensor("weight");
                let wo = weight(
                    &c_proj,
                    "weight",
                    s.map(|z| Sized::in_out(z.hidden, z.hidden)),
                )?; // Conv1D: (in, out)
                if let Some(p) = packed.as_mut() {
                    p.out_in_out = Some(wo.clone());
                }
                let wo = wo.t()?; // (out, in), a view
                let bo = opt_bias(
                    &c_proj,
                    "bias",
                    wo.dim(0)?,
                    (fresh_o && bias).then_some(wo.dim(1)?),
                )?;
                let name = full_name(&c_attn, "weight");
                Ok(Projections {
                    q: LinearWeights::new(wq, bq, format!("{name} (query columns)")),
                    k: LinearWeights::new(wk, bk, format!("{name} (key columns)")),
                    v: LinearWeights::new(wv, bv, format!("{name} (value columns)")),
                    o: Some(LinearWeights::new(wo, bo, full_name(&c_proj, "weight"))),
                })
            }
            WeightLayout::DistilBert => Ok(Projections {
                q: lin(&vb.pp("q_lin"), q_out, hidden, bias)?,
                k: lin(&vb.pp("k_lin"), k_out, hidden, bias)?,
                v: lin(&vb.pp("v_lin"), v_out, hidden, bias)?,
                o: Some(lin(
                    &vb.pp("out_lin"),
                    hidden,
                    s.map_or(0, |z| z.heads * z.v_head_dim),
                    bias,
                )?),
            }),
            WeightLayout::Llama => Ok(Projections {
                q: lin(&vb.pp("q_proj"), q_out, hidden, bias)?,
                k: lin(&vb.pp("k_proj"), k_out, hidden, bias)?,
                v: lin(&vb.pp("v_proj"), v_out, hidden, bias)?,
                o: Some(lin(
                    &vb.pp("o_proj"),
                    hidden,
                    s.map_or(0, |z| z.heads * z.v_head_dim),
                    false,
                )?),
            }),
            WeightLayout::GptNeoX => {
                let z = s.filter(|z| z.kv_heads == z.heads).ok_or_else(|| {
                    Error::config(
                        "the gpt-neox layout splits `query_key_value` per head by the stated \
                         sizes (as many key/value heads as query heads): give the hidden size, \
                         heads and head dim",
                    )
                })?;
                let (h, hd) = (z.heads, z.head_dim);
                let qkv = vb.pp("query_key_value");
                let w = weight(&qkv, "weight", Some(Sized::out_in(3 * h * hd, z.hidden)))?;
                let b = opt_bias(&qkv, "bias", 3 * h * hd, None)?;
                // (h, 3, hd, ...): part p of every head, in head order.
                let part = |t: &Tensor, p: usize| -> Result<Tensor> {
                    let rest: Vec<usize> = t.dims()[1..].to_vec();
                    let mut shape = vec![h, 3, hd];
                    shape.extend(&rest);
                    let mut out = vec![h * hd];
                    out.extend(&rest);
                    Ok(t.reshape(shape)?.narrow(1, p, 1)?.reshape(out)?)
                };
                let name = full_name(&qkv, "weight");
                let proj = |p: usize, what: &str| -> Result<LinearWeights> {
                    let bias = b.as_ref().map(|b| part(b, p)).transpose()?;
                    Ok(LinearWeights::new(
                        part(&w, p)?,
                        bias,
                        format!("{name} ({what} rows of each head)"),
                    ))
                };
                Ok(Projections {
                    q: proj(0, "query")?,
                    k: proj(1, "key")?,
                    v: proj(2, "value")?,
                    o: Some(lin(&vb.pp("dense"), hidden, h * z.v_head_dim, false)?),
                })
            }
            WeightLayout::Phi3 | WeightLayout::ModernBert => {
                let (qkv_name, o_name) = match self {
                    WeightLayout::Phi3 => ("qkv_proj", "o_proj"),
                    _ => ("Wqkv", "Wo"),
                };
                let z = s.ok_or_else(|| {
                    Error::config(format!(
                        "the {self} layout splits `{qkv_name}` by the stated sizes: give the \
                         hidden size, heads, kv heads and head dim"
                    ))
                })?;
                let qkv = vb.pp(qkv_name);
                let rows = [q_out, k_out, v_out];
                let w = weight(
                    &qkv,
                    "weight",
                    Some(Sized::out_in(q_out + k_out + v_out, z.hidden)),
                )?; // (q + k + v, hidden)
                let b = opt_bias(&qkv, "bias", q_out + k_out + v_out, None)?;
                let [wq, wk, wv] = split_rows(&w, rows)?;
                let [bq, bk, bv] = split_bias(b, rows)?;
                let name = full_name(&qkv, "weight");
                Ok(Projections {
                    q: LinearWeights::new(wq, bq, format!("{name} (query rows)")),
                    k: LinearWeights::new(wk, bk, format!("{name} (key rows)")),
                    v: LinearWeights::new(wv, bv, format!("{name} (value rows)")),
                    o: Some(lin(&vb.pp(o_name), hidden, z.heads * z.v_head_dim, false)?),
                })
            }
            WeightLayout::Single => Ok(Projections {
                q: lin(&vb.pp("query"), q_out, hidden, bias)?,
                k: lin(&vb.pp("key"), k_out, hidden, bias)?,
                v: lin(&vb.pp("value"), v_out, hidden, bias)?,
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
                let names: Vec<&str> = Self::ALL.iter().map(WeightLayout::name).collect();
                Error::config(format!(
                    "unknown layout `{s}`; expected one of {}",
                    names.join(", ")
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
    /// Wraps a weight and an optional bias.
    ///
    /// # Shapes
    /// - `weight`: `(out, in)`, `bias`: `(out,)`
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
    /// W_Q `(heads * head_dim, hidden)` and its bias.
    pub q: LinearWeights,
    /// W_K `(kv_heads * head_dim, kv_hidden)` and its bias.
    pub k: LinearWeights,
    /// W_V `(kv_heads * v_head_dim, kv_hidden)` and its bias.
    pub v: LinearWeights,
    /// Output projection W_O, absent for single-head attention.
    pub o: Option<LinearWeights>,
}

/// Q, K and V stored as one tensor in the checkpoint, as it is stored.
#[derive(Debug, Clone)]
pub(crate) struct PackedQkv {
    /// `(q + k + v, hidden)`, or `(hidden, q + k + v)` when `transposed` (GPT-2 `Conv1D`).
    pub weight: Tensor,
    pub transposed: bool,
    /// `(q + k + v,)`
    pub bias: Option<Tensor>,
    /// GPT-2's `c_proj.weight` `(in, out)`, as stored.
    pub out_in_out: Option<Tensor>,
}

impl Projections {
    /// Whether any weight or bias tracks gradients (a variable, or computed from one).
    pub fn tracks_gradients(&self) -> bool {
        [&self.q, &self.k, &self.v]
            .into_iter()
            .chain(self.o.as_ref())
            .any(|l| l.weight.track_op() || l.bias.as_ref().is_some_and(Tensor::track_op))
    }
}

/// Sizes stated for a layout that packs Q, K and V into one tensor (`what` names it) must
/// have heads x head_dim = hidden, d_v = d_k and no grouped K/V heads.
fn check_packable(sizes: Option<LayerSizes>, what: &str) -> Result<()> {
    match sizes {
        Some(z)
            if z.kv_heads != z.heads
                || z.heads * z.head_dim != z.hidden
                || z.v_head_dim != z.head_dim =>
        {
            Err(Error::config(format!(
                "{what}: it needs heads x head_dim = hidden ({} x {} vs {}) and no grouped K/V heads",
                z.heads, z.head_dim, z.hidden
            )))
        }
        _ => Ok(()),
    }
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

/// candle-nn's default initialisation of a linear weight `(out, in)` (Kaiming normal over
/// the fan-in, as `candle_nn::linear`), stated for the input width so that GPT-2's
/// transposed `Conv1D` weights get the same distribution.
fn weight_init(inp: usize) -> Init {
    Init::Randn {
        mean: 0.0,
        stdev: (2.0 / inp.max(1) as f64).sqrt(),
    }
}

/// The stated shape of a weight, and its input width (the initialisation's fan-in).
#[derive(Debug, Clone, Copy)]
struct Sized {
    dims: (usize, usize),
    fan_in: usize,
}

impl Sized {
    /// A `(out, in)` weight.
    fn out_in(out: usize, inp: usize) -> Self {
        Self {
            dims: (out, inp),
            fan_in: inp,
        }
    }
    /// A GPT-2 `Conv1D` weight, stored `(in, out)`.
    fn in_out(inp: usize, out: usize) -> Self {
        Self {
            dims: (inp, out),
            fan_in: inp,
        }
    }
}

/// A rank-2 weight: with the dimensions the checkpoint has, or with `shape` (checked, or
/// created where the `VarBuilder` makes variables).
fn weight(vb: &VarBuilder, name: &str, shape: Option<Sized>) -> Result<Tensor> {
    let w = match shape {
        Some(Sized { dims, fan_in }) => vb.get_with_hints(dims, name, weight_init(fan_in))?,
        None => vb
            .get_unchecked(name)
            .map_err(|e| unsized_error(vb, name, e))?,
    };
    if w.rank() != 2 || w.elem_count() == 0 {
        return Err(shape_error(vb, name, "a non-empty rank-2 matrix", &w));
    }
    Ok(w)
}

/// The error of reading a tensor without stated sizes, with the way out for a `VarMap`.
fn unsized_error(vb: &VarBuilder, name: &str, e: candle_core::Error) -> Error {
    // A VarMap cannot hand out a tensor without its shape, whether it holds it or not
    // (candle-nn says so only in its message).
    if e.to_string().contains("VarMap") {
        Error::config(format!(
            "`{}` cannot be read without its shape from this VarBuilder ({e}); state the sizes with \
             `AttentionConfig::with_hidden_size` (a VarMap-backed VarBuilder needs them)",
            full_name(vb, name)
        ))
    } else {
        Error::from(e)
    }
}

/// A bias of `len` entries if the checkpoint has one; created when `create` gives the
/// input width (uniform in `+-1/sqrt(in)`, as `candle_nn::linear` does).
fn opt_bias(
    vb: &VarBuilder,
    name: &str,
    len: usize,
    create: Option<usize>,
) -> Result<Option<Tensor>> {
    if vb.contains_tensor(name) {
        return Ok(Some(vb.get(len, name)?));
    }
    let Some(fan_in) = create else {
        return Ok(None);
    };
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    Ok(Some(vb.get_with_hints(
        len,
        name,
        Init::Uniform {
            lo: -bound,
            up: bound,
        },
    )?))
}

/// `weight` and optional `bias` of one projection; `shape` `(out, in)` when the sizes are
/// stated, `create_bias` for a fresh layer whose layout has biases.
fn linear_named(
    vb: &VarBuilder,
    w: &str,
    b: &str,
    shape: Option<(usize, usize)>,
    create_bias: bool,
) -> Result<LinearWeights> {
    let fresh = shape.is_some() && !vb.contains_tensor(w);
    let weight = weight(vb, w, shape.map(|(o, i)| Sized::out_in(o, i)))?;
    let (out, inp) = weight.dims2()?;
    let bias = opt_bias(vb, b, out, (fresh && create_bias).then_some(inp))?;
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
