//! A LLaMA-family GGUF file seen with the Hugging Face names and layout: the one place where
//! llama.cpp's names (`blk.N.attn_q.weight`), metadata keys (`llama.attention.head_count`)
//! and its rotary row order are turned into transformers' (`model.layers.N.self_attn.
//! q_proj.weight`, `num_attention_heads`, rows in `rotate_half` order), as transformers
//! does when it loads a GGUF file (`gguf_file=`), so that the model code is the one that
//! loads safetensors checkpoints.
//!
//! - [`hf_config`]: the metadata as a `config.json` value;
//! - [`GgufLlamaWeights`]: a `VarBuilder` backend that hands out each tensor dequantized
//!   (exactly as gguf-py does), with llama.cpp's permutation of the query and key rows
//!   undone for the `llama` architecture (its converter permutes them for GPT-J-style
//!   rotation; transformers reverses it at load).

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use serde_json::{json, Map, Value};

use crate::error::{Error, Result};
use crate::weights::checkpoint::of_shape;
use crate::weights::gguf::GgufFile;

/// The architectures this crate runs, as `general.architecture` names them, with the
/// `model_type` transformers gives them.
const ARCHITECTURES: [(&str, &str); 8] = [
    ("llama", "llama"),
    ("mistral", "mistral"),
    ("qwen2", "qwen2"),
    ("qwen3", "qwen3"),
    ("gemma3", "gemma3_text"),
    ("phi3", "phi3"),
    ("gpt2", "gpt2"),
    ("gptneox", "gpt_neox"),
];

/// Whether the architecture's layers have LayerNorms (`attention.layer_norm_epsilon`, with
/// biases), not RMSNorms.
fn layer_norms(arch: &str) -> bool {
    matches!(arch, "gpt2" | "gptneox")
}

/// The file's architecture (`general.architecture`), checked to be one this crate runs.
pub(crate) fn architecture(file: &GgufFile) -> Result<&'static str> {
    let arch = file.require_str("general.architecture")?;
    ARCHITECTURES
        .iter()
        .find(|(a, _)| *a == arch)
        .map(|(a, _)| *a)
        .ok_or_else(|| Error::UnsupportedGguf {
            path: file.path().to_path_buf(),
            what: format!("architecture `{arch}`"),
            supported: ARCHITECTURES.map(|(a, _)| a).join(", "),
        })
}

/// Whether llama.cpp's converter permuted the file's query and key rows for its rotation
/// (architectures `llama` and `mistral`).
pub(crate) fn rows_permuted(file: &GgufFile) -> Result<bool> {
    Ok(matches!(architecture(file)?, "llama" | "mistral"))
}

/// llama.cpp's tensor of per-frequency rope divisors (LLaMA 3.1's scaling).
const ROPE_FREQS: &str = "rope_freqs.weight";

/// The per-frequency rope divisors a file stores (`rope_freqs.weight`, as llama.cpp's
/// converter writes LLaMA 3.1's scaling), `None` when it has none.
pub(crate) fn rope_freqs(file: &GgufFile) -> Result<Option<Vec<f32>>> {
    if file.tensor_info(ROPE_FREQS).is_err() {
        return Ok(None);
    }
    let t = file.dequantize(ROPE_FREQS, &candle_core::Device::Cpu)?;
    Ok(Some(t.flatten_all()?.to_vec1::<f32>()?))
}
/// The metadata of a LLaMA-family file as the `config.json` transformers builds from it.
pub(crate) fn hf_config(file: &GgufFile) -> Result<Value> {
    let arch = architecture(file)?;
    let key = |k: &str| format!("{arch}.{k}");
    let usize_of = |k: &str| -> Result<u64> { file.require_u64(&key(k)) };
    let heads = usize_of("attention.head_count")?;
    let hidden = usize_of("embedding_length")?;
    let embed = file.tensor_info("token_embd.weight")?;
    let vocab = match embed.ggml_dims.as_slice() {
        [d, v] if *d as u64 == hidden => *v,
        dims => {
            return Err(Error::InvalidGguf {
                path: file.path().to_path_buf(),
                reason: format!("token_embd.weight has dims {dims:?}, expected [{hidden}, vocab]"),
            })
        }
    };
    let mut cfg = Map::new();
    let model_type = ARCHITECTURES
        .iter()
        .find(|(a, _)| *a == arch)
        .map_or(arch, |(_, t)| *t);
    cfg.insert("model_type".into(), json!(model_type));
    cfg.insert("hidden_size".into(), json!(hidden));
    cfg.insert(
        "intermediate_size".into(),
        json!(usize_of("feed_forward_length")?),
    );
    cfg.insert("num_attention_heads".into(), json!(heads));
    let kv_heads = match file.get(&key("attention.head_count_kv")) {
        Some(v) => v.as_u64().ok_or_else(|| Error::InvalidGguf {
            path: file.path().to_path_buf(),
            reason: format!("`{}` is not an integer", key("attention.head_count_kv")),
        })?,
        None => heads,
    };
    cfg.insert("num_key_value_heads".into(), json!(kv_heads));
    cfg.insert("num_hidden_layers".into(), json!(usize_of("block_count")?));
    cfg.insert("vocab_size".into(), json!(vocab));
    let eps = match layer_norms(arch) {
        true => "attention.layer_norm_epsilon",
        false => "attention.layer_norm_rms_epsilon",
    };
    cfg.insert("rms_norm_eps".into(), json!(file.require_f64(&key(eps))?));
    if let Some(v) = file.get(&key("context_length")).and_then(|v| v.as_u64()) {
        cfg.insert("max_position_embeddings".into(), json!(v));
    }
    let head_dim = match file
        .get(&key("attention.key_length"))
        .and_then(|v| v.as_u64())
    {
        Some(hd) => hd,
        None => hidden / heads.max(1),
    };
    cfg.insert("head_dim".into(), json!(head_dim));
    let theta = match file.get(&key("rope.freq_base")) {
        Some(v) => v.as_f64().unwrap_or(10_000.0),
        None => 10_000.0,
    };
    cfg.insert("rope_theta".into(), json!(theta));
    if let Some(rot) = file
        .get(&key("rope.dimension_count"))
        .and_then(|v| v.as_u64())
    {
        if rot != head_dim {
            cfg.insert(
                "partial_rotary_factor".into(),
                json!(rot as f64 / head_dim as f64),
            );
        }
    }
    let scaling = file.get(&key("rope.scaling.type")).and_then(|v| v.as_str());
    match scaling {
        None | Some("none") => {}
        Some("linear") => {
            let factor = file.require_f64(&key("rope.scaling.factor"))?;
            cfg.insert(
                "rope_scaling".into(),
                json!({"type": "linear", "factor": factor}),
            );
        }
        Some(other) => {
            return Err(Error::UnsupportedGguf {
                path: file.path().to_path_buf(),
                what: format!("rope scaling `{other}`"),
                supported: "none, linear".into(),
            })
        }
    }
    if file.tensor_info(ROPE_FREQS).is_ok() && scaling.is_some_and(|s| s != "none") {
        return Err(Error::UnsupportedGguf {
            path: file.path().to_path_buf(),
            what: format!("`{ROPE_FREQS}` together with a rope scaling type"),
            supported: "one or the other".into(),
        });
    }
    // Phi-3's converter writes 0 for "no window".
    if let Some(w) = file
        .get(&key("attention.sliding_window"))
        .and_then(|v| v.as_u64())
        .filter(|&w| w > 0)
    {
        cfg.insert("sliding_window".into(), json!(w));
    }
    if let Some(v) = file
        .get(&key("use_parallel_residual"))
        .and_then(|v| v.as_bool())
    {
        cfg.insert("use_parallel_residual".into(), json!(v));
    }
    if let Some(v) = file
        .get(&key("rope.freq_base_swa"))
        .and_then(|v| v.as_f64())
    {
        cfg.insert("rope_local_base_freq".into(), json!(v));
    }
    if let Some(v) = file
        .get(&key("rope.scaling.original_context_length"))
        .and_then(|v| v.as_u64())
    {
        cfg.insert("original_max_position_embeddings".into(), json!(v));
    }
    cfg.insert(
        "tie_word_embeddings".into(),
        json!(file.tensor_info("output.weight").is_err()),
    );
    if arch == "gemma3" {
        // What transformers' `Gemma3TextConfig` defaults to where the file says nothing
        // (the sliding pattern, the local rotary base, `query_pre_attn_scalar`).
        cfg.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
    }
    for (hf, gguf) in [
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
    ] {
        if let Some(id) = file.get(gguf).and_then(|v| v.as_u64()) {
            cfg.insert(hf.into(), json!(id));
        }
    }
    Ok(Value::Object(cfg))
}

/// Where GPT-2's and GPT-NeoX's files keep a layer's query, key or value: `attn_qkv`'s
/// rows in three equal blocks (llama.cpp's converter reorders GPT-NeoX's per-head rows so):
/// the fused name and the block.
pub(crate) fn fused_qkv_part(hf: &str, arch: &str) -> Option<(String, usize)> {
    if !layer_norms(arch) {
        return None;
    }
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (stem, what) = rest.rsplit_once('.')?;
    let part = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        .iter()
        .position(|p| *p == stem)?;
    matches!(what, "weight" | "bias").then(|| (format!("blk.{layer}.attn_qkv.{what}"), part))
}

/// The GGUF tensor a Hugging Face name is read from (the fused one for GPT-2's and
/// GPT-NeoX's query, key and value).
pub(crate) fn gguf_source(hf: &str, arch: &str) -> Option<String> {
    match fused_qkv_part(hf, arch) {
        Some((name, _)) => Some(name),
        None => gguf_name_in(hf, arch),
    }
}

/// The GGUF name of a Hugging Face tensor name of a `arch` file: Gemma 3 keeps its four
/// layer norms under their own names; every other name as [`gguf_name`].
pub(crate) fn gguf_name_in(hf: &str, arch: &str) -> Option<String> {
    let layer_part = hf
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'));
    if let (Some((layer, rest)), "gemma3") = (layer_part, arch) {
        let gemma = [
            ("post_attention_layernorm.", "post_attention_norm."),
            ("pre_feedforward_layernorm.", "ffn_norm."),
            ("post_feedforward_layernorm.", "post_ffw_norm."),
        ];
        if let Some((h, g)) = gemma.iter().find(|(h, _)| rest.starts_with(h)) {
            let layer: usize = layer.parse().ok()?;
            let suffix = &rest[h.len()..];
            return (suffix == "weight").then(|| format!("blk.{layer}.{g}{suffix}"));
        }
    }
    gguf_name(hf)
}

/// The GGUF name of a Hugging Face LLaMA tensor name, `None` for names the format lacks.
pub(crate) fn gguf_name(hf: &str) -> Option<String> {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.embed_positions.weight", "position_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("model.norm.bias", "output_norm.bias"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return Some((*g).to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let parts = [
        ("input_layernorm.", "attn_norm."),
        ("self_attn.q_proj.", "attn_q."),
        ("self_attn.k_proj.", "attn_k."),
        ("self_attn.v_proj.", "attn_v."),
        ("self_attn.o_proj.", "attn_output."),
        ("self_attn.q_norm.", "attn_q_norm."),
        ("self_attn.k_norm.", "attn_k_norm."),
        ("self_attn.qkv_proj.", "attn_qkv."),
        ("mlp.gate_up_proj.", "ffn_up."),
        ("post_attention_layernorm.", "ffn_norm."),
        ("mlp.gate_proj.", "ffn_gate."),
        ("mlp.up_proj.", "ffn_up."),
        ("mlp.down_proj.", "ffn_down."),
    ];
    let (h, g) = parts.iter().find(|(h, _)| rest.starts_with(h))?;
    let suffix = &rest[h.len()..];
    matches!(suffix, "weight" | "bias").then(|| format!("blk.{layer}.{g}{suffix}"))
}

/// The tensors of a LLaMA-family GGUF file under their Hugging Face names, dequantized.
pub(crate) struct GgufLlamaWeights {
    file: GgufFile,
    /// `general.architecture`.
    arch: &'static str,
    /// Query and key heads whose rows llama.cpp permuted (`llama` architecture), `None`
    /// when the rows are in transformers' order.
    permuted: Option<(usize, usize)>,
}

impl GgufLlamaWeights {
    /// The backend of `file`; `cfg` is its [`hf_config`].
    pub fn new(file: GgufFile, cfg: &Value) -> Result<Self> {
        let permuted = rows_permuted(&file)?;
        let heads = cfg["num_attention_heads"].as_u64().unwrap_or(1) as usize;
        let kv_heads = cfg["num_key_value_heads"].as_u64().unwrap_or(heads as u64) as usize;
        Ok(Self {
            permuted: permuted.then_some((heads, kv_heads)),
            arch: architecture(&file)?,
            file,
        })
    }

    fn load(&self, hf: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        if let Some((fused, part)) = fused_qkv_part(hf, self.arch) {
            let t = self.file.dequantize(&fused, &Device::Cpu)?;
            let rows = t.dim(0)? / 3;
            let t = t.narrow(0, part * rows, rows)?.contiguous()?;
            return Ok(t.to_dtype(dtype)?.to_device(device)?);
        }
        let Some(name) = gguf_name_in(hf, self.arch) else {
            return Err(Error::MissingTensor {
                name: hf.to_string(),
                total: 0,
                available: Vec::new(),
                prefix: String::new(),
                listed: false,
            });
        };
        let t = self.file.dequantize(&name, &Device::Cpu)?;
        let t = match (self.permuted, name.rsplit('.').nth(1)) {
            (Some((heads, _)), Some("attn_q")) => unpermute_rows(&t, heads)?,
            (Some((_, kv_heads)), Some("attn_k")) => unpermute_rows(&t, kv_heads)?,
            // llama.cpp stores Gemma's norms as `1 + w`; transformers subtracts the 1 again.
            _ if self.arch == "gemma3" && name.ends_with("norm.weight") => (t - 1.0)?,
            _ => t,
        };
        Ok(t.to_dtype(dtype)?.to_device(device)?)
    }
}

/// llama.cpp's query/key row permutation undone (transformers' `reverse_permute_weights`):
/// for each row of the result, the stored row it is. Per head, row `s * hd / 2 + j` of the
/// result is row `2 j + s` of the stored one. The tensors here and the blocks of
/// `crate::weights::quantized` are reordered by it.
pub(crate) fn unpermuted_order(rows: usize, heads: usize) -> Result<Vec<usize>> {
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(Error::Heads(format!(
            "{rows} query/key rows do not split into {heads} heads of an even size"
        )));
    }
    let hd = rows / heads;
    Ok((0..heads)
        .flat_map(|h| (0..2).flat_map(move |s| (0..hd / 2).map(move |j| h * hd + 2 * j + s)))
        .collect())
}

/// [`unpermuted_order`] applied to the rows of `t`.
///
/// # Shapes
/// - `t`: `(heads * head_dim, in)` or `(heads * head_dim,)`; returns the same shape
fn unpermute_rows(t: &Tensor, heads: usize) -> Result<Tensor> {
    let order: Vec<u32> = unpermuted_order(t.dim(0)?, heads)?
        .into_iter()
        .map(|r| r as u32)
        .collect();
    let order = Tensor::new(order.as_slice(), t.device())?;
    Ok(t.index_select(&order, 0)?)
}

impl SimpleBackend for GgufLlamaWeights {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.load(name, dtype, dev).map_err(Error::into_candle)?;
        of_shape(t, &s, || match gguf_source(name, self.arch) {
            Some(g) => format!("{g} (`{name}`)"),
            None => name.to_string(),
        })
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.load(name, dtype, dev).map_err(Error::into_candle)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        gguf_source(name, self.arch).is_some_and(|g| self.file.tensor_info(&g).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_llama_cpp_names() {
        assert_eq!(
            gguf_name("model.layers.11.self_attn.q_proj.weight").as_deref(),
            Some("blk.11.attn_q.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.mlp.down_proj.weight").as_deref(),
            Some("blk.0.ffn_down.weight")
        );
        assert_eq!(
            gguf_name("model.layers.2.self_attn.k_proj.bias").as_deref(),
            Some("blk.2.attn_k.bias")
        );
        assert_eq!(
            gguf_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
        assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
        assert_eq!(gguf_name("model.layers.0.mlp.up_proj.scale"), None);
    }

    #[test]
    fn an_unsupported_architecture_is_named() -> Result<()> {
        use crate::kernels::quant::blocks::QuantType;
        let mut bytes =
            crate::weights::gguf::tests::build(&[("w", &[32], QuantType::Q8_0, vec![0u8; 34])]);
        // The architecture's value "llama" becomes "bloom" (same length).
        let at = bytes
            .windows(5)
            .position(|w| w == b"llama")
            .ok_or_else(|| Error::Kernel("no architecture in the test file".into()))?;
        bytes[at..at + 5].copy_from_slice(b"bloom");
        let file = GgufFile::from_bytes(bytes, "bloom.gguf")?;
        let e = hf_config(&file)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("bloom.gguf")
                && e.contains("`bloom`")
                && e.contains("llama, mistral, qwen2, qwen3, gemma3, phi3, gpt2, gptneox"),
            "{e}"
        );
        Ok(())
    }

    #[test]
    fn unpermuting_inverts_llama_cpp_permutation() -> Result<()> {
        // llama.cpp: w.reshape(heads, 2, hd/2, in).swapaxes(1, 2): stored row h*hd + 2j + s
        // holds original row h*hd + s*hd/2 + j.
        let (heads, hd, inp) = (3, 8, 2);
        let rows = heads * hd;
        let orig: Vec<f32> = (0..rows * inp).map(|i| i as f32).collect();
        let mut stored = vec![0f32; rows * inp];
        for h in 0..heads {
            for j in 0..hd / 2 {
                for s in 0..2 {
                    let (dst, src) = (h * hd + 2 * j + s, h * hd + s * hd / 2 + j);
                    stored[dst * inp..(dst + 1) * inp]
                        .copy_from_slice(&orig[src * inp..(src + 1) * inp]);
                }
            }
        }
        let t = Tensor::from_vec(stored, (rows, inp), &Device::Cpu)?;
        let back: Vec<f32> = unpermute_rows(&t, heads)?.flatten_all()?.to_vec1()?;
        assert_eq!(back, orig);
        Ok(())
    }
}
