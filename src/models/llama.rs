//! A rotary pre-norm decoder (LLaMA, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3) on this crate's
//! attention: token embeddings, per layer RMSNorm, attention with rotary embeddings and a KV
//! cache, RMSNorm, gated MLP, then a final RMSNorm and the language-model head (tied to the
//! embeddings or separate). What the families add (q/k norms, `(1 + w)` norms around both
//! halves, scaled embeddings, fused projections, per-layer windows and rotary bases) is
//! described by [`DecoderFamily`]. Loads `config.json` and `model.safetensors` with the
//! Hugging Face names (`model.layers.N.self_attn.q_proj.weight`, ...).

use std::path::Path;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, RmsNorm, VarBuilder};
use serde::Deserialize;
use serde_json::Value;

use crate::attention::explicit::explicit_probed;
use crate::attention::mask::AttentionMask;
use crate::attention::multi_head::MultiHeadSelfAttention;
use crate::attention::projections::{fused_bias, LayerProjections};
use crate::attention::sdpa::{scaled_dot_product_attention, SdpaOptions};
use crate::error::{Error, Result};
use crate::kernels::decode::gemv::{one_row_gated, one_row_linear};
use crate::kernels::pool::in_pool;
use crate::kernels::residual;
use crate::kernels::rms_norm::rms_norm;
use crate::kernels::widen;
use crate::models::decode_step::{DecodeStep, StepAttention, StepNorms};
use crate::models::decoder_family::{DecoderFamily, NormKind, WindowRule};
use crate::models::hidden_act::Activation;
use crate::models::kv_cache::KvCache;
use crate::models::rope::{RopeConfig, RopeLayout, RopeScaling, RotaryEmbedding};
use crate::models::trace::{graph_input, probe, ForwardTrace, TraceOptions};
use crate::weights::checkpoint::refuse_unread;
use crate::weights::config::{read_config_file, AttentionConfig};
use crate::weights::decoder_names::RenamedWeights;
use crate::weights::gguf::GgufFile;
use crate::weights::gguf_layout;
use crate::weights::layout::WeightLayout;
use crate::weights::quantized::QuantWeight;

/// The field of `generation_config.json` read here.
#[derive(Deserialize)]
struct GenerationConfig {
    #[serde(default)]
    eos_token_id: Option<Value>,
}

/// The ids of a config's one id or list of ids (entries that are not token ids left out).
fn ids_of(v: Option<&Value>) -> Vec<u32> {
    let id = |v: &Value| v.as_u64().and_then(|x| u32::try_from(x).ok());
    match v {
        Some(Value::Array(a)) => a.iter().filter_map(id).collect(),
        Some(one) => id(one).into_iter().collect(),
        None => Vec::new(),
    }
}

fn default_rms_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".to_string()
}

fn llama_family() -> &'static DecoderFamily {
    &DecoderFamily::LLAMA
}

/// The decoder fields of a Hugging Face `config.json` (LLaMA, Mistral, Qwen2, Qwen3,
/// Gemma 3 text, Phi-3 names).
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    /// `llama`, `mistral`, `qwen2`, `qwen3`, `gemma3_text` or `phi3`.
    #[serde(default)]
    pub model_type: Option<String>,
    /// What the family's layers have beside LLaMA's (from `model_type`).
    #[serde(skip, default = "llama_family")]
    pub family: &'static DecoderFamily,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's gate and up projections.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Grouped K/V heads; absent means `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Tokens in the vocabulary (rows of the embedding).
    pub vocab_size: usize,
    /// RMSNorm's epsilon (default 1e-6).
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    /// Features per head where it is not `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// The output head is the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Mistral: a query sees its last `sliding_window` keys, itself included.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Qwen2: whether `sliding_window` applies (to the layers from `max_window_layers` on).
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Qwen2: the first layer index the sliding window applies to.
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// Gemma 3: `full_attention` or `sliding_attention` per layer.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Gemma 3 without `layer_types`: every `sliding_window_pattern`-th layer is global.
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    /// Gemma: the attention scale is `query_pre_attn_scalar^-1/2` (not `head_dim^-1/2`).
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// GPT-NeoX: the attention and the MLP both read the layer's input and add to it
    /// (`None`: the family's default).
    #[serde(default)]
    pub use_parallel_residual: Option<bool>,
    /// Longest context the model was trained for.
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    /// One id or a list.
    #[serde(default)]
    pub eos_token_id: Option<Value>,
    /// The ids that end a generation where the model's files name them apart from
    /// `eos_token_id`, used instead of it: `generation_config.json`'s `eos_token_id` beside
    /// a directory's `config.json` (as transformers' `generate` uses it), a GGUF file's
    /// [`GgufFile::end_of_generation_ids`] (as llama.cpp stops); `None`: `eos_token_id`.
    #[serde(skip)]
    pub generation_end_ids: Option<Vec<u32>>,
    /// Beginning-of-sequence id(s), as the config holds them.
    #[serde(default)]
    pub bos_token_id: Option<Value>,
    /// The MLP's activation (`silu`).
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// The rotary configuration (from `rope_theta` / `rope_scaling` / `rope_parameters`,
    /// `head_dim`, `partial_rotary_factor`); Gemma 3's global layers'.
    #[serde(skip_deserializing, default = "RopeConfig::placeholder")]
    pub rope: RopeConfig,
    /// Gemma 3's sliding layers' rotation (`rope_parameters.sliding_attention`, or
    /// `rope_local_base_freq`); `None`: every layer uses [`LlamaConfig::rope`].
    #[serde(skip)]
    pub rope_local: Option<RopeConfig>,
}

impl LlamaConfig {
    /// Reads and checks a `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        read_config_file(path.as_ref(), Self::from_json)
    }

    /// The configuration of a LLaMA-family GGUF file, from its metadata (the `config.json`
    /// transformers builds when it loads the file).
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let mut cfg = Self::from_value(gguf_layout::hf_config(file)?)?;
        let ends = file.end_of_generation_ids();
        cfg.generation_end_ids = (!ends.is_empty()).then_some(ends);
        if let Some(factors) = gguf_layout::rope_freqs(file)? {
            // LLaMA 3.1's scaling as llama.cpp stores it: a divisor per frequency.
            cfg.rope.scaling = RopeScaling::Factors { factors };
            cfg.rope.validate()?;
        }
        Ok(cfg)
    }

    /// Parses and checks the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let raw: Value = serde_json::from_str(text).map_err(|e| Error::config(e.to_string()))?;
        Self::from_value(raw)
    }

    fn from_value(mut raw: Value) -> Result<Self> {
        // The family first: another family's config lacks (or renames) LLaMA's fields.
        let kind = raw.get("model_type").and_then(Value::as_str);
        let family = DecoderFamily::of_model_type(kind)?;
        family.normalize_config(&mut raw);
        let mut cfg: Self =
            serde_json::from_value(raw.clone()).map_err(|e| Error::config(e.to_string()))?;
        cfg.family = family;
        family.check_config(&raw, &cfg.hidden_act)?;
        for (name, v) in [
            ("hidden_size", cfg.hidden_size),
            ("num_attention_heads", cfg.num_attention_heads),
            ("num_hidden_layers", cfg.num_hidden_layers),
            ("vocab_size", cfg.vocab_size),
            ("intermediate_size", cfg.intermediate_size),
        ] {
            if v == 0 {
                return Err(Error::config(format!("`{name}` must be at least 1")));
            }
        }
        if family.window == WindowRule::LayerTypes {
            let (global, local) = two_bases(&raw)?;
            cfg.rope = RopeConfig::from_hf_json(&global, RopeLayout::Half)?;
            cfg.rope_local = Some(RopeConfig::from_hf_json(&local, RopeLayout::Half)?);
        } else {
            cfg.rope = RopeConfig::from_hf_json(&raw, RopeLayout::Half)?;
        }
        if let Some(types) = &cfg.layer_types {
            if types.len() != cfg.num_hidden_layers {
                return Err(Error::config(format!(
                    "`layer_types` has {} entries for {} layers",
                    types.len(),
                    cfg.num_hidden_layers
                )));
            }
        }
        if cfg
            .query_pre_attn_scalar
            .is_some_and(|s| !(s.is_finite() && s > 0.0))
        {
            return Err(Error::config("`query_pre_attn_scalar` must be positive"));
        }
        Ok(cfg)
    }

    /// The MLP's activation.
    pub(crate) fn activation(&self) -> Result<Activation> {
        Activation::from_name(&self.hidden_act)
    }

    /// The multiplier of `Q K^T` where it is not `head_dim^-1/2` (Gemma's
    /// `query_pre_attn_scalar^-1/2`, 256 by default).
    pub fn attention_scale(&self) -> Option<f64> {
        match self.family.window {
            WindowRule::LayerTypes => Some(self.query_pre_attn_scalar.unwrap_or(256.0).powf(-0.5)),
            _ => self.query_pre_attn_scalar.map(|s| s.powf(-0.5)),
        }
    }

    /// Whether layer `i` is one of Gemma 3's sliding layers (which rotate with
    /// [`LlamaConfig::rope_local`]).
    fn is_sliding_layer(&self, i: usize) -> bool {
        match &self.layer_types {
            Some(types) => types.get(i).is_some_and(|t| t == "sliding_attention"),
            None => {
                let pattern = self.sliding_window_pattern.unwrap_or(6).max(1);
                !(i + 1).is_multiple_of(pattern)
            }
        }
    }

    /// The rotation of layer `i`.
    pub fn rope_of(&self, i: usize) -> &RopeConfig {
        match &self.rope_local {
            Some(local) if self.is_sliding_layer(i) => local,
            _ => &self.rope,
        }
    }

    /// The ids that end a generation, ascending: `generation_end_ids` where the files name
    /// them, else [`LlamaConfig::eos_ids`].
    pub fn end_of_generation_ids(&self) -> Vec<u32> {
        let mut ids = match &self.generation_end_ids {
            Some(ids) => ids.clone(),
            None => self.eos_ids(),
        };
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Reads `generation_config.json`'s `eos_token_id` (one id or a list; entries that are
    /// not token ids left out) from `dir` into `generation_end_ids`, if the file is there and
    /// has one. A file that is not JSON is an error naming it (transformers logs it and goes
    /// on with `config.json`'s).
    pub fn read_generation_config(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let path = dir.as_ref().join("generation_config.json");
        if !path.exists() {
            return Ok(());
        }
        let gen: GenerationConfig = read_config_file(&path, |text| {
            serde_json::from_str(text).map_err(|e| Error::config(e.to_string()))
        })?;
        if let Some(ids) = gen.eos_token_id {
            self.generation_end_ids = Some(ids_of(Some(&ids)));
        }
        Ok(())
    }

    /// The end-of-sequence ids of `config.json`.
    pub fn eos_ids(&self) -> Vec<u32> {
        ids_of(self.eos_token_id.as_ref())
    }

    /// The sliding window of layer `i`, if it has one.
    pub fn window_of(&self, i: usize) -> Option<usize> {
        match self.family.window {
            WindowRule::FromMaxWindowLayers => {
                let from = self.max_window_layers.unwrap_or(0);
                (self.use_sliding_window && i >= from)
                    .then_some(self.sliding_window)
                    .flatten()
            }
            WindowRule::Always => self.sliding_window,
            WindowRule::LayerTypes => self
                .is_sliding_layer(i)
                .then_some(self.sliding_window)
                .flatten(),
            WindowRule::Never => None,
        }
    }
}

/// Gemma 3's two rotations as two configs of the usual form: `rope_parameters` keyed by layer
/// type (transformers 5), or `rope_theta` (global, default 1e6, with `rope_scaling`) and
/// `rope_local_base_freq` (sliding, default 1e4, unscaled).
fn two_bases(raw: &Value) -> Result<(Value, Value)> {
    let with = |params: Option<Value>, theta: Option<f64>, keep_scaling: bool| {
        let mut v = raw.clone();
        if let Some(obj) = v.as_object_mut() {
            obj.remove("rope_parameters");
            if !keep_scaling {
                obj.remove("rope_scaling");
            }
            if let Some(p) = params {
                obj.insert("rope_parameters".into(), p);
            }
            if let Some(t) = theta {
                obj.insert("rope_theta".into(), t.into());
            }
        }
        v
    };
    let by_type = raw
        .get("rope_parameters")
        .filter(|p| p.get("full_attention").is_some());
    if let Some(p) = by_type {
        let part = |key: &str| {
            p.get(key)
                .cloned()
                .ok_or_else(|| Error::config(format!("`rope_parameters` has no `{key}` entry")))
        };
        return Ok((
            with(Some(part("full_attention")?), None, false),
            with(Some(part("sliding_attention")?), None, false),
        ));
    }
    let theta = |key: &str, default: f64| raw.get(key).and_then(Value::as_f64).unwrap_or(default);
    Ok((
        with(None, Some(theta("rope_theta", 1e6)), true),
        with(None, Some(theta("rope_local_base_freq", 1e4)), false),
    ))
}

impl RopeConfig {
    /// Stands in until `LlamaConfig::from_json` fills the real one.
    fn placeholder() -> Self {
        Self {
            theta: 10_000.0,
            head_dim: 2,
            rotary_dim: 2,
            scaling: RopeScaling::Default,
            layout: RopeLayout::Half,
        }
    }
}

/// `x W^T + b`; for one input row on the CPU (a decode step) a matrix-vector product split
/// over the threads (f32, or f16 / bf16 widened to f32), which reads the weight faster than
/// a one-row matrix multiply. A GGUF weight of a block type stays in its blocks.
#[derive(Debug, Clone)]
enum Proj {
    Dense(Linear),
    Quant(QuantWeight),
}

impl Proj {
    /// The weight `(out, in)` under `vb` (`weight`, and `bias` when present), kept in its
    /// blocks when `quant` holds it in a block type.
    fn load(vb: &VarBuilder, inp: usize, out: usize, quant: Option<&GgufFile>) -> Result<Self> {
        // A weight in blocks stays in them (one with a bias, GPT-2's and GPT-NeoX's, is
        // dequantized: the blocks' kernels add none).
        if let Some(file) = quant.filter(|_| !vb.contains_tensor("bias")) {
            let hf = format!("{}.weight", vb.prefix());
            let stored = gguf_layout::gguf_name(&hf).filter(|n| file.tensor_info(n).is_ok());
            if let Some(name) = stored {
                if let Some(q) = QuantWeight::from_gguf(file, &name, out, inp)? {
                    return Ok(Self::Quant(q.on(vb.device())?));
                }
            }
        }
        let w = vb.get((out, inp), "weight")?;
        let b = if vb.contains_tensor("bias") {
            Some(vb.get(out, "bias")?)
        } else {
            None
        };
        Ok(Self::Dense(Linear::new(w, b)))
    }

    /// # Shapes
    /// - `x`: `(..., in)`; returns `(..., out)`
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dense = match self {
            Self::Quant(q) => return q.forward(x),
            Self::Dense(l) => l,
        };
        let (w, b) = (dense.weight(), dense.bias());
        if let Some(y) = one_row_linear(x, w, b, true)? {
            return Ok(y);
        }
        if x.dtype() != w.dtype() {
            // f32 activations, half-precision weights (the CPU computes in f32): the weight
            // widened once for all the rows.
            let b = b.map(|b| b.to_dtype(x.dtype())).transpose()?;
            return Ok(Linear::new(widen::to_f32(w)?, b).forward(x)?);
        }
        Ok(dense.forward(x)?)
    }
}

/// The token embeddings: a table, or a GGUF matrix in its blocks (rows dequantized as they
/// are looked up).
#[derive(Debug, Clone)]
enum Embed {
    Dense(Embedding),
    Quant(QuantWeight),
}

impl Embed {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(e) => Ok(e.forward(ids)?),
            Self::Quant(q) => q.rows_of(ids),
        }
    }
}

/// The attention projections of a GGUF file's layer under `vb` (`...self_attn`) kept in their
/// blocks, llama.cpp's rotary row order undone (also as the decode step reads them, on the
/// CPU); `None` when one of them is stored in a float type (the dense path loads those).
///
/// `stacked`: this layer's Q, K and V already in their rotary order
/// ([`stacked_attention_inputs`]), else read and reordered here.
fn quantized_attention(
    file: &GgufFile,
    vb: &VarBuilder,
    cfg: &LlamaConfig,
    stacked: Option<[QuantWeight; 3]>,
) -> Result<Option<(LayerProjections, Option<StepAttention>)>> {
    let (d, heads) = (cfg.hidden_size, cfg.num_attention_heads);
    let kv_heads = cfg.num_key_value_heads.unwrap_or(heads);
    let hd = cfg.rope.head_dim;
    let Some(o) = stored_weight(file, vb, "o_proj", d, heads * hd)? else {
        return Ok(None);
    };
    let [q, k, v] = match stacked {
        Some(qkv) => qkv,
        None => {
            let Some([q, k, v]) = stored_qkv(file, vb, cfg)? else {
                return Ok(None);
            };
            if gguf_layout::rows_permuted(file)? {
                [q.unpermuted_rows(heads)?, k.unpermuted_rows(kv_heads)?, v]
            } else {
                [q, k, v]
            }
        }
    };
    // On CUDA and Metal the blocks also go to the device (`QuantWeight::forward_on_device`).
    let device = vb.device();
    let (q, k, v, o) = (q.on(device)?, k.on(device)?, v.on(device)?, o.on(device)?);
    let bias = |proj: &str, n: usize| -> Result<Option<Tensor>> {
        let vb = vb.pp(proj);
        Ok(if vb.contains_tensor("bias") {
            Some(vb.get(n, "bias")?.to_dtype(DType::F32)?)
        } else {
            None
        })
    };
    let parts = [
        (bias("q_proj", heads * hd)?, heads * hd),
        (bias("k_proj", kv_heads * hd)?, kv_heads * hd),
        (bias("v_proj", kv_heads * hd)?, kv_heads * hd),
    ];
    let qkv_bias = fused_bias(parts, DType::F32, device)?;
    let o_bias = bias("o_proj", d)?;
    let step = if device.is_cpu() {
        let values = |b: &Option<Tensor>| b.as_ref().map(|b| b.to_vec1::<f32>()).transpose();
        Some(StepAttention {
            qkv: [q.clone(), k.clone(), v.clone()],
            qkv_bias: values(&qkv_bias)?,
            o: o.clone(),
            o_bias: values(&o_bias)?,
            heads,
            kv_heads,
            head_dim: hd,
        })
    } else {
        None
    };
    let projections =
        LayerProjections::quantized([q, k, v], qkv_bias, Some((o, o_bias)), heads, kv_heads)?;
    Ok(Some((projections, step)))
}

/// The matrix `proj` of the attention under `vb` as stored in `file`, when in blocks.
fn stored_weight(
    file: &GgufFile,
    vb: &VarBuilder,
    proj: &str,
    rows: usize,
    cols: usize,
) -> Result<Option<QuantWeight>> {
    let hf = format!("{}.{proj}.weight", vb.prefix());
    match gguf_layout::gguf_name(&hf) {
        Some(name) if file.tensor_info(&name).is_ok() => {
            QuantWeight::from_gguf(file, &name, rows, cols)
        }
        _ => Ok(None),
    }
}

/// Q, K and V of the attention under `vb` as stored (llama.cpp's row order), when all three
/// are in blocks.
fn stored_qkv(
    file: &GgufFile,
    vb: &VarBuilder,
    cfg: &LlamaConfig,
) -> Result<Option<[QuantWeight; 3]>> {
    let (d, heads) = (cfg.hidden_size, cfg.num_attention_heads);
    let kv = cfg.num_key_value_heads.unwrap_or(heads) * cfg.rope.head_dim;
    Ok(
        match (
            stored_weight(file, vb, "q_proj", heads * cfg.rope.head_dim, d)?,
            stored_weight(file, vb, "k_proj", kv, d)?,
            stored_weight(file, vb, "v_proj", kv, d)?,
        ) {
            (Some(q), Some(k), Some(v)) => Some([q, k, v]),
            _ => None,
        },
    )
}

/// Every layer's Q, K and V (llama.cpp's rotary order undone) in one buffer on 2 MB pages,
/// each layer's three one after another ([`QuantWeight::stacked`]): a decode step reads them
/// as one stream, and off the 4 KB pages the reordered copies had. `None` unless every
/// layer's three are in blocks.
fn stacked_attention_inputs(
    file: &GgufFile,
    model: &VarBuilder,
    cfg: &LlamaConfig,
) -> Result<Option<Vec<[QuantWeight; 3]>>> {
    let heads = cfg.num_attention_heads;
    let kv_heads = cfg.num_key_value_heads.unwrap_or(heads);
    let permuted = gguf_layout::rows_permuted(file)?;
    let mut groups = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        let vb = model.pp(format!("layers.{i}")).pp("self_attn");
        let Some([q, k, v]) = stored_qkv(file, &vb, cfg)? else {
            return Ok(None);
        };
        let order = |h: usize| permuted.then_some(h);
        groups.push(vec![(q, order(heads)), (k, order(kv_heads)), (v, None)]);
    }
    QuantWeight::stacked(&groups)?
        .into_iter()
        .map(|g| {
            <[QuantWeight; 3]>::try_from(g)
                .map_err(|_| Error::Kernel("a stacked layer without its three parts".into()))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// A layer's attention as `cfg` describes it; sizes stated, so that every projection is
/// read with its full shape.
fn attention_config(cfg: &LlamaConfig) -> AttentionConfig {
    let heads = cfg.num_attention_heads;
    let layout = match cfg.family.fused_projections {
        true => WeightLayout::Phi3,
        false => WeightLayout::Llama,
    };
    let mut acfg = AttentionConfig::new(layout, heads)
        .with_kv_heads(cfg.num_key_value_heads.unwrap_or(heads))
        .with_causal(true)
        .with_hidden_size(cfg.hidden_size)
        .with_head_dim(cfg.rope.head_dim);
    acfg.scale = cfg.attention_scale();
    acfg
}

/// `down(act(gate(x)) * up(x))`: SiLU (SwiGLU) or GELU (GeGLU).
#[derive(Debug, Clone)]
struct Mlp {
    /// `None`: a plain MLP, `down(act(up(x)))` (GPT-2, GPT-NeoX).
    gate: Option<Proj>,
    up: Proj,
    down: Proj,
    activation: Activation,
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &LlamaConfig, quant: Option<&GgufFile>) -> Result<Self> {
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (gate, up) = if cfg.family.fused_projections {
            // Phi-3's `gate_up_proj` (2 inter, hidden): the gate's rows, then the up's.
            let w = vb.pp("gate_up_proj").get((2 * i, d), "weight")?;
            let half = |from: usize| -> Result<Proj> {
                Ok(Proj::Dense(Linear::new(
                    w.narrow(0, from, i)?.contiguous()?,
                    None,
                )))
            };
            (Some(half(0)?), half(i)?)
        } else if cfg.family.gated_mlp {
            (
                Some(Proj::load(&vb.pp("gate_proj"), d, i, quant)?),
                Proj::load(&vb.pp("up_proj"), d, i, quant)?,
            )
        } else {
            (None, Proj::load(&vb.pp("up_proj"), d, i, quant)?)
        };
        Ok(Self {
            gate,
            up,
            down: Proj::load(&vb.pp("down_proj"), i, d, quant)?,
            activation: cfg.activation()?,
        })
    }

    /// Gate, up and down when all three are kept in their blocks.
    fn quantized(&self) -> Option<[QuantWeight; 3]> {
        match (&self.gate, &self.up, &self.down) {
            (Some(Proj::Quant(g)), Proj::Quant(u), Proj::Quant(d)) => {
                Some([g.clone(), u.clone(), d.clone()])
            }
            _ => None,
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let Some(gate_proj) = &self.gate else {
            let h = self.activation.apply(&self.up.forward(x)?)?;
            return self.down.forward(&h);
        };
        if self.activation != Activation::Silu {
            let g = self.activation.apply(&gate_proj.forward(x)?)?;
            return self.down.forward(&(g * self.up.forward(x)?)?);
        }
        // A decode step on dense weights: both halves in one pass over the threads.
        if let (Proj::Dense(gate), Proj::Dense(up)) = (gate_proj, &self.up) {
            let (g, u) = ((gate.weight(), gate.bias()), (up.weight(), up.bias()));
            if let Some(h) = one_row_gated(x, g, u)? {
                return self.down.forward(&h);
            }
        }
        // Blocks on the CPU: silu and the product in one pass over the values.
        if let (Proj::Quant(gate), Proj::Quant(up)) = (gate_proj, &self.up) {
            if let Some(h) = QuantWeight::forward_gated(gate, up, x)? {
                return self.down.forward(&h);
            }
        }
        let g = candle_nn::ops::silu(&gate_proj.forward(x)?)?;
        self.down.forward(&(g * self.up.forward(x)?)?)
    }
}

/// The causal sliding window of `w` keys for `t` queries at positions `offset..offset + t`
/// over the keys `0..offset + t` (Mistral's).
fn window_mask(t: usize, offset: usize, w: usize, device: &Device) -> Result<AttentionMask> {
    let total = offset + t;
    let keep: Vec<u8> = (0..t)
        .flat_map(|i| (0..total).map(move |j| u8::from(j <= offset + i && j + w > offset + i)))
        .collect();
    AttentionMask::keep(&Tensor::from_vec(keep, (t, total), device)?)
}

/// A layer's norm: RMSNorm, or LayerNorm with a bias (GPT-2, GPT-NeoX).
#[derive(Debug, Clone)]
enum Norm {
    Rms(RmsNorm),
    Layer(LayerNorm),
}

impl Norm {
    /// # Shapes
    /// - `x`: `(..., hidden)`; returns the same
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Norm::Rms(n) => rms_norm(n, x),
            Norm::Layer(n) => Ok(n.forward(x)?),
        }
    }

    /// [`Norm::forward`] in candle's differentiable ops.
    fn forward_diff(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Norm::Rms(n) => Ok(n.forward_diff(x)?),
            Norm::Layer(n) => {
                let bias = n
                    .bias()
                    .ok_or_else(|| Error::config("a LayerNorm without bias"))?;
                Ok(candle_nn::ops::layer_norm_slow(
                    x,
                    n.weight(),
                    bias,
                    n.eps() as f32,
                )?)
            }
        }
    }

    fn rms(&self) -> Option<&RmsNorm> {
        match self {
            Norm::Rms(n) => Some(n),
            Norm::Layer(_) => None,
        }
    }
}

/// One decoder layer.
#[derive(Debug, Clone)]
struct DecoderLayer {
    input_norm: Norm,
    attn: MultiHeadSelfAttention,
    /// Per-head norms of the queries and keys before the rotation (Qwen3, Gemma 3).
    qk_norms: Option<(RmsNorm, RmsNorm)>,
    /// Norms of the attention's and the MLP's outputs before their residual adds (Gemma).
    out_norms: Option<(RmsNorm, RmsNorm)>,
    /// The MLP's input norm.
    post_norm: Norm,
    mlp: Mlp,
    /// The attention and the MLP both read the layer's input (GPT-NeoX).
    parallel: bool,
    window: Option<usize>,
    /// Which of the model's rotations the layer uses (Gemma 3's sliding layers: the local
    /// one); `None`: none (GPT-2's learned positions).
    rope: Option<usize>,
    /// The decode step's weights: a GGUF layer on the CPU (f32 hidden states).
    step: Option<DecodeStep>,
}

impl DecoderLayer {
    /// `x` `(batch, seq, hidden)` at positions `cache.len()..`; the cache grows by `seq`.
    /// With `need_weights`, also the attention weights `(batch, heads, seq, keys)`.
    fn forward(
        &self,
        x: &Tensor,
        rope: Option<&RotaryEmbedding>,
        cache: &mut KvCache,
        need_weights: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (_, t, _) = x.dims3()?;
        let offset = cache.len();
        // The attention runs in its weights' dtype; the rest of the layer in `x`'s.
        let h = self.input_norm.forward(x)?.to_dtype(self.attn.dtype())?;
        let (q, k, v) = self.attn.project_qkv(&h)?;
        let (q, k) = self.norm_qk(q, k, false)?;
        let (q, k) = match rope {
            Some(r) => (r.apply(&q, offset)?, r.apply(&k, offset)?), // (b, h|kvh, t, hd)
            None => (q, k),
        };
        let (k_all, v_all) = cache.append(&k, &v)?; // (b, kvh, offset + t, hd)
        let total = offset + t;
        let (k_all, v_all, mask) = match self.window {
            // One query: only its last `window` keys, no mask needed.
            Some(w) if t == 1 && total > w => (
                k_all.narrow(2, total - w, w)?,
                v_all.narrow(2, total - w, w)?,
                None,
            ),
            Some(w) if total > w => (k_all, v_all, Some(window_mask(t, offset, w, x.device())?)),
            _ if t == 1 => (k_all, v_all, None),
            _ => (
                k_all,
                v_all,
                Some(AttentionMask::causal_with_offset(offset)),
            ),
        };
        let opts = SdpaOptions {
            scale: self.attn.scale(),
            need_weights,
        };
        let out = scaled_dot_product_attention(&q, &k_all, &v_all, mask.as_ref(), opts)?;
        let attn = self.attn.merge_heads(&out.context)?.to_dtype(x.dtype())?; // context (b, h, t, vhd)
        let attn = match &self.out_norms {
            Some((after_attn, _)) => rms_norm(after_attn, &attn)?,
            None => attn,
        };
        if self.parallel {
            // transformers' GPT-NeoX: `mlp_output + attn_output + hidden_states`.
            let m = self.mlp.forward(&self.post_norm.forward(x)?)?;
            return Ok((residual::add(&(m + attn)?, x)?, out.weights));
        }
        let x = residual::add(x, &attn)?;
        let m = self.mlp.forward(&self.post_norm.forward(&x)?)?;
        let m = match &self.out_norms {
            Some((_, after_mlp)) => rms_norm(after_mlp, &m)?,
            None => m,
        };
        Ok((residual::add(&x, &m)?, out.weights))
    }

    /// The per-head norms of `q` `(b, h, t, hd)` and `k` `(b, kvh, t, hd)`, where the family
    /// has them (`diff`: in candle's differentiable ops).
    fn norm_qk(&self, q: Tensor, k: Tensor, diff: bool) -> Result<(Tensor, Tensor)> {
        let Some((qn, kn)) = &self.qk_norms else {
            return Ok((q, k));
        };
        let norm = |n: &RmsNorm, x: Tensor| -> Result<Tensor> {
            let x = x.contiguous()?;
            Ok(match diff {
                true => n.forward_diff(&x)?,
                false => rms_norm(n, &x)?,
            })
        };
        Ok((norm(qn, q)?, norm(kn, k)?))
    }
}

impl DecoderLayer {
    /// A fresh prompt `x` `(1, seq, hidden)` through the layer in candle's differentiable ops
    /// (no cache, the explicit attention, the composed norms and rotary embedding): the
    /// output, the attention probabilities `(1, heads, seq, seq)` f32 as the graph node the
    /// context is computed from, and the normed input the attention read.
    fn forward_traced(
        &self,
        x: &Tensor,
        rope: Option<&RotaryEmbedding>,
        probe: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (_, t, _) = x.dims3()?;
        let h = self
            .input_norm
            .forward_diff(x)?
            .to_dtype(self.attn.dtype())?;
        let (q, k, v) = self.attn.project_qkv(&h)?;
        let (q, k) = self.norm_qk(q, k, true)?;
        let (q, k) = match rope {
            Some(r) => (r.apply(&q, 0)?, r.apply(&k, 0)?),
            None => (q, k),
        };
        let mask = match self.window {
            Some(w) if t > w => window_mask(t, 0, w, x.device())?,
            _ => AttentionMask::causal(),
        };
        let scale = self.attn.score_scale();
        let out = explicit_probed(&q, &k, &v, Some(&mask), scale, true, probe)?;
        let probs = out
            .weights
            .ok_or_else(|| Error::Kernel("the explicit attention returned no weights".into()))?;
        let attn = self.attn.merge_heads(&out.context)?.to_dtype(x.dtype())?;
        let attn = match &self.out_norms {
            Some((after_attn, _)) => after_attn.forward_diff(&attn)?,
            None => attn,
        };
        if self.parallel {
            let m = self.mlp.forward(&self.post_norm.forward_diff(x)?)?;
            return Ok((((m + attn)? + x)?, probs, h));
        }
        let x = (x + attn)?;
        let m = self.mlp.forward(&self.post_norm.forward_diff(&x)?)?;
        let m = match &self.out_norms {
            Some((_, after_mlp)) => after_mlp.forward_diff(&m)?,
            None => m,
        };
        Ok(((x + m)?, probs, h))
    }
}

/// A LLaMA-family causal language model.
///
/// With f16 / bf16 weights on the CPU the weights and the KV cache stay in the half format
/// (half the bytes read per token) while the hidden states, norms and MLP activations are
/// f32; on other devices everything runs in the weights' dtype.
#[derive(Debug, Clone)]
pub struct LlamaModel {
    cfg: LlamaConfig,
    /// The dtype of the hidden states: f32 on the CPU, the weights' elsewhere.
    compute: DType,
    embed: Embed,
    /// The embeddings' multiplier (Gemma's `sqrt(hidden_size)`, rounded to f32).
    embed_scale: Option<f64>,
    /// GPT-2's learned position table `(positions, hidden)`.
    positions: Option<Embedding>,
    layers: Vec<DecoderLayer>,
    norm: Norm,
    /// `(vocab, hidden)`: the embedding matrix when tied.
    lm_head: Proj,
    /// The global rotation, and Gemma 3's local one.
    ropes: Vec<RotaryEmbedding>,
}

impl LlamaModel {
    /// Loads the model under `vb` (the checkpoint's root: `model.embed_tokens.weight`, ...).
    pub fn load(vb: VarBuilder, cfg: &LlamaConfig) -> Result<Self> {
        Self::load_from(vb, cfg, None)
    }

    /// [`LlamaModel::load`]; with `quant` (the GGUF file behind `vb`), the matrices stored
    /// in block types stay in their blocks: on the CPU read from the file's map by this
    /// crate's kernels, on CUDA and Metal copied to the device for candle's quantized ones.
    fn load_from(vb: VarBuilder, cfg: &LlamaConfig, quant: Option<&GgufFile>) -> Result<Self> {
        let d = cfg.hidden_size;
        // On the CPU the hidden states, norms and MLP activations are f32 whatever the
        // weights' dtype (the kernels widen half-precision weights as they read them).
        let compute = if vb.device().is_cpu() {
            DType::F32
        } else {
            vb.dtype()
        };
        let family = cfg.family;
        let rms_of = |vb: VarBuilder, n: usize| -> Result<RmsNorm> {
            // Ones for a fresh variable, as `candle_nn::rms_norm` makes it (Gemma's `1 + w`:
            // zeros).
            let init = candle_nn::Init::Const(if family.norm_plus_one { 0.0 } else { 1.0 });
            let w = vb.get_with_hints(n, "weight", init)?.to_dtype(compute)?;
            // Gemma scales by `1 + w`, computed in f32 as transformers does.
            let w = match family.norm_plus_one {
                true => (w.to_dtype(DType::F32)? + 1.0)?.to_dtype(compute)?,
                false => w,
            };
            Ok(RmsNorm::new(w, cfg.rms_norm_eps))
        };
        let norm_of = |vb: VarBuilder| -> Result<Norm> {
            Ok(match family.norm {
                NormKind::Rms => Norm::Rms(rms_of(vb, d)?),
                NormKind::Layer => {
                    let w = vb.get_with_hints(d, "weight", candle_nn::Init::Const(1.0))?;
                    let b = vb.get_with_hints(d, "bias", candle_nn::Init::Const(0.0))?;
                    Norm::Layer(LayerNorm::new(
                        w.to_dtype(compute)?,
                        b.to_dtype(compute)?,
                        cfg.rms_norm_eps,
                    ))
                }
            })
        };
        let rms = |vb: VarBuilder| rms_of(vb, d);
        let m = vb.pp("model");
        let embed_proj = Proj::load(&m.pp("embed_tokens"), d, cfg.vocab_size, quant)?;
        let embed = match &embed_proj {
            Proj::Quant(q) => Embed::Quant(q.clone()),
            Proj::Dense(l) => Embed::Dense(Embedding::new(l.weight().clone(), d)),
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        // On the CPU, every layer's Q, K and V in one buffer on 2 MB pages.
        let mut stacked = match quant {
            Some(file) if vb.device().is_cpu() => stacked_attention_inputs(file, &m, cfg)?,
            _ => None,
        }
        .map(Vec::into_iter);
        for i in 0..cfg.num_hidden_layers {
            let l = m.pp(format!("layers.{i}"));
            let acfg = attention_config(cfg);
            let qkv = stacked.as_mut().and_then(Iterator::next);
            let quantized = match quant {
                Some(file) => quantized_attention(file, &l.pp("self_attn"), cfg, qkv)?,
                None => None,
            };
            let (attn, step_attn) = match quantized {
                Some((p, step)) => (MultiHeadSelfAttention::from_projections(p, &acfg), step),
                None => (
                    MultiHeadSelfAttention::load(l.pp("self_attn"), &acfg)?,
                    None,
                ),
            };
            let input_norm = norm_of(l.pp("input_layernorm"))?;
            // Gemma's `post_attention_layernorm` norms the attention's output; the MLP's
            // input norm is its `pre_feedforward_layernorm`.
            let (post_norm, out_norms) = match family.sandwich_norms {
                true => (
                    norm_of(l.pp("pre_feedforward_layernorm"))?,
                    Some((
                        rms(l.pp("post_attention_layernorm"))?,
                        rms(l.pp("post_feedforward_layernorm"))?,
                    )),
                ),
                false => (norm_of(l.pp("post_attention_layernorm"))?, None),
            };
            let qk_norms = match family.qk_norm {
                true => {
                    let a = l.pp("self_attn");
                    let hd = cfg.rope.head_dim;
                    Some((rms_of(a.pp("q_norm"), hd)?, rms_of(a.pp("k_norm"), hd)?))
                }
                false => None,
            };
            let mlp = Mlp::load(l.pp("mlp"), cfg, quant)?;
            let parallel = cfg
                .use_parallel_residual
                .unwrap_or(family.parallel_residual);
            // The step is a faster route to the same values: weights it refuses take the
            // tensor path (which reports what does not fit when it runs).
            let step = match (
                step_attn,
                mlp.quantized(),
                input_norm.rms(),
                post_norm.rms(),
            ) {
                (Some(a), Some(m), Some(input), Some(post))
                    if compute == DType::F32 && family.steps_in_one_pass() && !parallel =>
                {
                    let norms = StepNorms {
                        input,
                        post,
                        qk: qk_norms.as_ref(),
                        out: out_norms.as_ref(),
                    };
                    DecodeStep::new(norms, a, m, mlp.activation, cfg.attention_scale()).ok()
                }
                _ => None,
            };
            let rope =
                (!family.learned_positions).then(|| usize::from(cfg.rope_of(i) != &cfg.rope));
            layers.push(DecoderLayer {
                input_norm,
                attn,
                qk_norms,
                out_norms,
                post_norm,
                mlp,
                parallel,
                window: cfg.window_of(i),
                rope,
                step,
            });
            let head_dim = layers[i].attn.head_dim();
            if head_dim != cfg.rope.head_dim {
                return Err(Error::config(format!(
                    "layer {i}: the projections give heads of {head_dim} features, the config {}",
                    cfg.rope.head_dim
                )));
            }
        }
        let norm = norm_of(m.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings && !vb.contains_tensor("lm_head.weight") {
            embed_proj
        } else {
            Proj::load(&vb.pp("lm_head"), d, cfg.vocab_size, quant)?
        };
        let table = cfg.max_position_embeddings.unwrap_or(2048).min(1 << 16);
        let mut ropes = Vec::new();
        if !family.learned_positions {
            ropes.push(RotaryEmbedding::new(cfg.rope.clone(), table, vb.device())?);
            if let Some(local) = &cfg.rope_local {
                ropes.push(RotaryEmbedding::new(local.clone(), table, vb.device())?);
            }
        }
        let positions = match family.learned_positions {
            true => {
                let w = m.pp("embed_positions").get_unchecked("weight")?;
                let (_, width) = w.dims2()?;
                if width != d {
                    return Err(Error::ShapeMismatch {
                        tensor: "model.embed_positions.weight".into(),
                        expected: format!("(positions, {d})"),
                        found: w.dims().to_vec(),
                    });
                }
                Some(Embedding::new(w, d))
            }
            false => None,
        };
        // transformers keeps `sqrt(hidden)` as an f32 tensor (cast to the weights' dtype).
        let embed_scale = family
            .embed_scale
            .then(|| ((d as f64).sqrt() as f32) as f64);
        Ok(Self {
            cfg: cfg.clone(),
            compute,
            embed,
            embed_scale,
            positions,
            layers,
            norm,
            lm_head,
            ropes,
        })
    }

    /// Loads `config.json` and `model.safetensors` (or the shards a
    /// `model.safetensors.index.json` names) from a directory, with `generation_config.json`'s
    /// end-of-sequence ids if it is there.
    pub fn from_dir(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let mut cfg = LlamaConfig::from_file(dir.join("config.json"))?;
        cfg.read_generation_config(dir)?;
        let ckpt = crate::Checkpoint::open(dir.join("model.safetensors"))?;
        Self::from_checkpoint(&ckpt, &cfg, dtype, device)
    }

    /// [`LlamaModel::load`] from a checkpoint, whose every tensor must be one the model reads
    /// (an error names the others: a checkpoint of another form would give wrong outputs).
    pub fn from_checkpoint(
        ckpt: &crate::Checkpoint,
        cfg: &LlamaConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let family = cfg.family;
        let Some(renaming) = family.renaming else {
            let tied = cfg.tie_word_embeddings && !ckpt.contains("lm_head.weight");
            family.check_tensors(ckpt.names(), cfg.num_hidden_layers, tied)?;
            return Self::load(ckpt.var_builder(dtype, device), cfg);
        };
        let heads = cfg.num_attention_heads;
        let weights = RenamedWeights::new(ckpt.clone(), renaming, heads, cfg.rope.head_dim);
        let vb = VarBuilder::from_backend(Box::new(weights), dtype, device.clone());
        let tied = cfg.tie_word_embeddings && !vb.contains_tensor("lm_head.weight");
        // Every tensor of the checkpoint is the source of one the model reads (or a buffer).
        let names: std::collections::BTreeSet<&str> = ckpt.names().collect();
        let expected = family.expected_names(cfg.num_hidden_layers, tied);
        let read = renaming.sources(expected.iter(), &names);
        let unread: Vec<&str> = names.into_iter().filter(|n| !read.contains(*n)).collect();
        refuse_unread(&family.describe(cfg.num_hidden_layers), unread)?;
        Self::load(vb, cfg)
    }

    /// Loads a LLaMA-family model (architectures `llama`, `mistral`, `qwen2`) from one GGUF
    /// file: the configuration from its metadata, llama.cpp's rotary row order undone, and
    /// the weights as transformers dequantizes them (`gguf_file=`). The matrices stored in
    /// block types stay in their blocks: on the CPU read from the file's bytes in memory by
    /// this crate's kernels (the same values as the dequantized weight's), on CUDA and Metal
    /// copied to the device as stored: CUDA dequantizes them there for each product (exact;
    /// candle's quantized kernels, which round the activations to 8 bits as llama.cpp does,
    /// with [`crate::set_int8_activations`]), Metal multiplies them with candle's quantized
    /// kernels; float matrices and norms are loaded in `dtype`. On the CPU, a decode step
    /// (one token, batch 1) through layers whose matrices are all in blocks runs on plain
    /// f32 buffers instead of tensor ops: the same values, bit for bit.
    pub fn from_gguf(path: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        Self::from_gguf_file(&GgufFile::open_for(path, device)?, dtype, device)
    }

    /// [`LlamaModel::from_gguf`] from a file already open (its bytes shared, not read
    /// again: open the file once for the model and its tokenizer).
    pub fn from_gguf_file(file: &GgufFile, dtype: DType, device: &Device) -> Result<Self> {
        let raw = gguf_layout::hf_config(file)?;
        let cfg = LlamaConfig::from_gguf(file)?;
        // Every tensor of the file is one the model reads.
        let arch = gguf_layout::architecture(file)?;
        let tied = file.tensor_info("output.weight").is_err();
        let read: std::collections::BTreeSet<String> = cfg
            .family
            .expected_names(cfg.num_hidden_layers, tied)
            .iter()
            .filter_map(|n| gguf_layout::gguf_source(n, arch))
            .collect();
        let unread: Vec<&str> = file
            .tensors()
            .iter()
            .map(|t| t.name.as_str())
            .filter(|n| !read.contains(*n) && *n != "rope_freqs.weight")
            .collect();
        refuse_unread(&cfg.family.describe(cfg.num_hidden_layers), unread)?;
        let weights = gguf_layout::GgufLlamaWeights::new(file.clone(), &raw)?;
        let vb = VarBuilder::from_backend(Box::new(weights), dtype, device.clone());
        Self::load_from(vb, &cfg, Some(file))
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// One empty cache per layer, with room for `capacity` positions.
    pub fn new_caches(&self, capacity: usize) -> Vec<KvCache> {
        (0..self.layers.len())
            .map(|_| KvCache::new(capacity))
            .collect()
    }

    /// The logits of every position of `ids`, which continue what `caches` hold (empty
    /// caches: a prompt's prefill; one id: a decode step). The caches grow by `seq`.
    ///
    /// # Shapes
    /// - `ids`: `(batch, seq)` u32; returns `(batch, seq, vocab)` f32
    pub fn forward(&self, ids: &Tensor, caches: &mut [KvCache]) -> Result<Tensor> {
        in_pool(|| {
            let h = self.hidden_states(ids, caches)?;
            Ok(self.lm_head.forward(&h)?.to_dtype(DType::F32)?)
        })
    }

    /// The logits of the last position only (what generation needs after a prefill).
    ///
    /// # Shapes
    /// - `ids`: `(batch, seq)`; returns `(batch, vocab)` f32
    pub fn forward_last(&self, ids: &Tensor, caches: &mut [KvCache]) -> Result<Tensor> {
        in_pool(|| {
            let h = self.hidden_states(ids, caches)?;
            let (_, t, _) = h.dims3()?;
            let last = h.narrow(1, t - 1, 1)?.squeeze(1)?; // (b, hidden)
            Ok(self.lm_head.forward(&last)?.to_dtype(DType::F32)?)
        })
    }

    fn hidden_states(&self, ids: &Tensor, caches: &mut [KvCache]) -> Result<Tensor> {
        Ok(self.run_layers(ids, caches, false)?.0)
    }

    /// Every layer's attention weights over `ids` (a fresh prompt, causal, and within the
    /// sliding window where the model has one).
    ///
    /// # Shapes
    /// - `ids`: `(batch, seq)`; returns one `(batch, heads, seq, seq)` f32 tensor per layer
    pub fn attentions(&self, ids: &Tensor) -> Result<Vec<Tensor>> {
        let (_, t) = ids.dims2()?;
        let mut caches = self.new_caches(t.max(1));
        self.run_layers(ids, &mut caches, true)?
            .1
            .into_iter()
            .map(|w| w.ok_or_else(|| Error::Kernel("no attention weights returned".into())))
            .collect()
    }

    /// The final norm's output `(batch, seq, hidden)` and, when `weights`, each layer's
    /// attention weights.
    fn run_layers(
        &self,
        ids: &Tensor,
        caches: &mut [KvCache],
        weights: bool,
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        if caches.len() != self.layers.len() {
            return Err(Error::input(
                "caches",
                format!("one per layer ({})", self.layers.len()),
                format!("{}", caches.len()),
            ));
        }
        let (_, t) = ids.dims2()?;
        if t == 0 {
            return Err(Error::input(
                "ids",
                "at least one token",
                "an empty sequence",
            ));
        }
        let offset = caches.first().map_or(0, KvCache::len);
        let mut x = self.embed_tokens(ids, offset)?; // (b, t, hidden)
        if !weights {
            if let Some(out) = self.decode_step(&x, caches)? {
                return Ok((self.norm.forward(&out)?, Vec::new()));
            }
        }
        let mut all = Vec::with_capacity(if weights { self.layers.len() } else { 0 });
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let rope = layer.rope.map(|r| &self.ropes[r]);
            let (next, w) = layer.forward(&x, rope, cache, weights)?;
            x = next;
            if weights {
                all.push(w);
            }
        }
        Ok((self.norm.forward(&x)?, all))
    }

    /// One token's hidden state `x` `(1, 1, hidden)` through every layer on the decode step's
    /// path ([`DecodeStep`]), where every layer has one; `Ok(None)` otherwise.
    fn decode_step(&self, x: &Tensor, caches: &mut [KvCache]) -> Result<Option<Tensor>> {
        let (b, t, d) = x.dims3()?;
        let steps: Option<Vec<&DecodeStep>> = self.layers.iter().map(|l| l.step.as_ref()).collect();
        let Some(steps) = steps.filter(|_| (b, t) == (1, 1) && x.device().is_cpu()) else {
            return Ok(None);
        };
        let mut h: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let position = caches.first().map_or(0, KvCache::len);
        // Each rotation's angles at this position (Gemma 3: the global and the local one).
        let angles = self
            .ropes
            .iter()
            .map(|r| r.row(position))
            .collect::<Result<Vec<_>>>()?;
        for ((step, layer), cache) in steps.into_iter().zip(&self.layers).zip(caches.iter_mut()) {
            let Some(r) = layer.rope else {
                return Err(Error::Kernel(
                    "a decode step for a layer without rotation".into(),
                ));
            };
            step.forward(&mut h, (&self.ropes[r], &angles[r]), cache, layer.window)?;
        }
        Ok(Some(Tensor::from_vec(h, (1, 1, d), x.device())?))
    }

    /// The model without its decode step's path (every step through the tensor ops), for
    /// comparing the two.
    #[cfg(test)]
    pub(crate) fn without_decode_step(mut self) -> Self {
        for l in &mut self.layers {
            l.step = None;
        }
        self
    }

    /// Whether every layer has a decode step's path.
    #[cfg(test)]
    pub(crate) fn has_decode_step(&self) -> bool {
        self.layers.iter().all(|l| l.step.is_some())
    }

    /// The model with Q/K/V and output biases (Qwen2's) added to every layer's quantized
    /// attention on both paths, for tests (the GGUF fixtures with biases have float weights).
    #[cfg(test)]
    pub(crate) fn with_biases(mut self) -> Result<Self> {
        let acfg = attention_config(&self.cfg);
        for (i, l) in self.layers.iter_mut().enumerate() {
            let Some(step) = &mut l.step else {
                continue;
            };
            let a = step.attention().clone();
            let n = (a.heads + 2 * a.kv_heads) * a.head_dim;
            let qkv: Vec<f32> = (0..n)
                .map(|j| ((j * 7 + i) % 13) as f32 / 13.0 - 0.5)
                .collect();
            let o: Vec<f32> = (0..a.o.dims().0)
                .map(|j| ((j * 5 + i) % 11) as f32 / 22.0 - 0.25)
                .collect();
            let tensor = |v: &[f32]| Tensor::new(v, &Device::Cpu);
            let p = LayerProjections::quantized(
                a.qkv.clone(),
                Some(tensor(&qkv)?),
                Some((a.o.clone(), Some(tensor(&o)?))),
                a.heads,
                a.kv_heads,
            )?;
            l.attn = MultiHeadSelfAttention::from_projections(p, &acfg);
            step.set_biases(qkv, o);
        }
        Ok(self)
    }

    /// The model with a sliding window of `w` keys in every layer (Mistral's), for tests.
    #[cfg(test)]
    pub(crate) fn with_window(mut self, w: usize) -> Self {
        for l in &mut self.layers {
            l.window = Some(w);
        }
        self
    }

    /// A fresh prompt `ids` `(1, seq)` kept for explanations: the last position's logits
    /// `(1, vocab)`, every layer's attention probabilities and, when asked, its value norms
    /// (of the normed input the attention reads); with `opts.grad` the embeddings are a
    /// variable, so that the probabilities are nodes of the graph a logit's gradient flows
    /// through.
    pub(crate) fn trace(&self, ids: &Tensor, opts: TraceOptions) -> Result<ForwardTrace> {
        let (b, t) = ids.dims2()?;
        if b != 1 || t == 0 {
            return Err(Error::input(
                "ids",
                "one sequence of at least one token (1, seq)",
                format!("shape {:?}", ids.dims()),
            ));
        }
        let x = self.embed_tokens(ids, 0)?; // (1, t, hidden)
        let mut x = graph_input(x, opts.grad)?;
        let mut attentions = Vec::with_capacity(self.layers.len());
        let (mut value_norms, mut probes) = (Vec::new(), Vec::new());
        for layer in &self.layers {
            let p = probe(opts.grad, layer.attn.num_heads(), t, x.device())?;
            let rope = layer.rope.map(|r| &self.ropes[r]);
            let (next, probs, h) = layer.forward_traced(&x, rope, p.as_ref())?;
            if opts.value_norms {
                value_norms.push(layer.attn.value_output_norms(&h.detach())?);
            }
            attentions.push(probs);
            probes.extend(p);
            x = next;
        }
        let last = self
            .norm
            .forward_diff(&x)?
            .narrow(1, t - 1, 1)?
            .squeeze(1)?; // (1, hidden)
        Ok(ForwardTrace {
            output: self.lm_head.forward(&last)?.to_dtype(DType::F32)?,
            attentions,
            probes,
            value_norms,
        })
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The embeddings of `ids` at positions `offset..` in the compute dtype, scaled where the
    /// family scales them, plus the learned positions' rows where it has them.
    ///
    /// # Shapes
    /// - `ids`: `(batch, seq)`; returns `(batch, seq, hidden)`
    fn embed_tokens(&self, ids: &Tensor, offset: usize) -> Result<Tensor> {
        let x = self.embed.forward(ids)?;
        let x = match self.embed_scale {
            // In the embeddings' dtype, then widened (transformers multiplies in it).
            Some(s) => (x * s)?.to_dtype(self.compute)?,
            None => x.to_dtype(self.compute)?,
        };
        let Some(table) = &self.positions else {
            return Ok(x);
        };
        let (_, t) = ids.dims2()?;
        let max = table.embeddings().dim(0)?;
        if offset + t > max {
            return Err(Error::SequenceTooLong {
                len: offset + t,
                max,
            });
        }
        let pos = Tensor::arange(offset as u32, (offset + t) as u32, ids.device())?;
        let rows = table.forward(&pos)?.to_dtype(self.compute)?; // (t, hidden)
        Ok(x.broadcast_add(&rows)?)
    }
}

/// The index of the largest logit of each row.
///
/// # Shapes
/// - `logits`: `(batch, vocab)`; returns `batch` ids
pub fn argmax_ids(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
}
