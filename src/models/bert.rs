//! A BERT-family encoder assembled from this crate's [`MultiHeadSelfAttention`] and
//! candle-nn parts: embeddings (word + position + token type, LayerNorm), then per layer
//! attention, residual + LayerNorm, feed-forward, residual + LayerNorm. The families of this
//! form (BERT, RoBERTa / XLM-R, DistilBERT) differ only in what [`EncoderFamily`] describes.

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use candle_nn::{Embedding, LayerNorm, Module, VarBuilder};
use rayon::prelude::*;

use crate::attention::explicit::explicit_probed;
use crate::attention::mask::AttentionMask;
use crate::attention::multi_head::MultiHeadSelfAttention;
use crate::attention::projections::linear_in_out;
use crate::error::{Error, Result};
use crate::kernels::cpu_tensor::CpuF32;
use crate::kernels::encoder::embedding::{embed_tokens, EmbeddingTables, WordTable};
use crate::kernels::encoder::feed_forward::{
    FeedForwardTensors, FeedForwardWeight, PackedFeedForward,
};
use crate::kernels::gemm::matrix::HalfRows;
use crate::kernels::gemm::packed::PackedWeight;
use crate::kernels::pool::in_pool;
use crate::models::encoder_family::{EncoderFamily, PositionIds};
use crate::models::encoder_output::EncoderOutput;
use crate::models::hidden_act::Activation;
use crate::models::modern_bert::{ModernBert, ModernBertConfig};
use crate::models::trace::{graph_input, probe, ForwardTrace, TraceOptions};
use crate::weights::checkpoint::Checkpoint;
use crate::weights::config::{AttentionConfig, HfConfig};
use crate::weights::stored::StoredWeight;

/// `LayerNorm` loaded from `weight`/`bias` (or the old `gamma`/`beta`).
fn layer_norm(vb: VarBuilder, size: usize, eps: f64) -> Result<LayerNorm> {
    let (w, b) = if vb.contains_tensor("weight") || !vb.contains_tensor("gamma") {
        (vb.get(size, "weight")?, vb.get(size, "bias")?)
    } else {
        (vb.get(size, "gamma")?, vb.get(size, "beta")?)
    };
    Ok(LayerNorm::new(w, b, eps))
}

/// A dense layer `(out, in)` with bias, checked against the expected sizes.
struct Dense {
    /// `(in, out)`: the checkpoint's `(out, in)` tensor seen transposed, or the panels the
    /// packed feed-forward multiplies by (unpacked for a call on candle's ops).
    weight_t: StoredWeight,
    bias: Tensor,
}

impl Dense {
    /// # Shapes
    /// - `x`: `(batch, seq, in)`; returns `(batch, seq, out)`
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let w = self.weight_t.tensor()?;
        let out = w.dim(1)?;
        Ok(linear_in_out(&x.reshape((b * t, d))?, &w, Some(&self.bias))?.reshape((b, t, out))?)
    }
}

/// The word table.
enum WordEmbeddings {
    Tensor(Embedding),
    /// A half-precision matrix read where the checkpoint is mapped.
    Mapped {
        ckpt: Checkpoint,
        name: String,
    },
}

impl WordEmbeddings {
    /// `(rows, hidden)` of the mapped matrix.
    fn mapped<'a>(ckpt: &'a Checkpoint, name: &str) -> Result<HalfRows<'a>> {
        ckpt.half_matrix(name)?
            .ok_or_else(|| Error::Kernel(format!("{name} is no longer stored in half precision")))
    }

    /// # Shapes
    /// - `ids`: `(batch, seq)`; returns `(batch, seq, hidden)`, f32 when mapped
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (ckpt, name) = match self {
            Self::Tensor(e) => return Ok(e.forward(ids)?),
            Self::Mapped { ckpt, name } => (ckpt, name),
        };
        let m = Self::mapped(ckpt, name)?;
        let (b, t) = ids.dims2()?;
        let ids = ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1::<u32>()?;
        let mut out = vec![0f32; ids.len() * m.cols];
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(m.cols)) {
            if id as usize >= m.rows {
                return Err(Error::input(
                    "input_ids",
                    format!("token ids below the vocabulary size {}", m.rows),
                    format!("id {id}"),
                ));
            }
            m.widen_row(id as usize, row);
        }
        Ok(Tensor::from_vec(out, (b, t, m.cols), &Device::Cpu)?)
    }
}

/// Word + position + token type embeddings, then LayerNorm.
struct BertEmbeddings {
    /// Kept in the checkpoint's half dtype when the model runs in f32 (on the CPU, where the
    /// file is mapped): rows are widened after the lookup (exact), which saves copying and
    /// converting the largest table at load time.
    word: WordEmbeddings,
    position: Embedding,
    /// `None` for a family without token types (DistilBERT).
    token_type: Option<Embedding>,
    norm: LayerNorm,
    /// The longest sequence the position table covers.
    max_positions: usize,
    positions: PositionIds,
    /// The padding id RoBERTa's positions count from.
    pad_token_id: u32,
}

impl BertEmbeddings {
    /// `word_dtype` keeps the word table in the checkpoint's half dtype; `half` (f32 on the
    /// CPU) reads it where the checkpoint is mapped.
    fn load(
        vb: VarBuilder,
        cfg: &HfConfig,
        family: &EncoderFamily,
        word_dtype: Option<DType>,
        half: Option<&Checkpoint>,
    ) -> Result<Self> {
        let d = cfg.hidden_size;
        let table = |name: &str, dtype: Option<DType>| -> Result<Embedding> {
            let vb = vb.pp(name);
            let w = match dtype {
                Some(dtype) => vb.get_unchecked_dtype("weight", dtype)?,
                None => vb.get_unchecked("weight")?,
            };
            let (_n, width) = w.dims2().map_err(|_| Error::ShapeMismatch {
                tensor: format!("{}.weight", vb.prefix()),
                expected: format!("(rows, {d})"),
                found: w.dims().to_vec(),
            })?;
            if width != d {
                return Err(Error::ShapeMismatch {
                    tensor: format!("{}.weight", vb.prefix()),
                    expected: format!("(rows, {d})"),
                    found: w.dims().to_vec(),
                });
            }
            Ok(Embedding::new(w, d))
        };
        let position = table("position_embeddings", None)?;
        let max_positions = family.max_sequence(position.embeddings().dim(0)?, cfg);
        let word_name = format!("{}.word_embeddings.weight", vb.prefix());
        let word = match half.filter(|_| word_dtype.is_some()) {
            Some(ckpt) if ckpt.half_matrix(&word_name)?.is_some_and(|m| m.cols == d) => {
                WordEmbeddings::Mapped {
                    ckpt: ckpt.clone(),
                    name: word_name,
                }
            }
            _ => WordEmbeddings::Tensor(table("word_embeddings", word_dtype)?),
        };
        let token_type = match family.token_types {
            true => Some(table("token_type_embeddings", None)?),
            false => None,
        };
        Ok(Self {
            word,
            position,
            token_type,
            norm: layer_norm(vb.pp("LayerNorm"), d, cfg.layer_norm_eps)?,
            max_positions,
            positions: family.positions,
            pad_token_id: family.pad_token_id(cfg),
        })
    }

    /// Each token's position id.
    ///
    /// # Shapes
    /// - `input_ids`: `(batch, seq)`; returns `(batch, seq)` u32 on its device
    fn position_ids(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        Ok(match self.positions {
            PositionIds::FromZero => Tensor::arange(0u32, t as u32, input_ids.device())?
                .unsqueeze(0)?
                .repeat((b, 1))?,
            PositionIds::AfterPadding => {
                let ids = input_ids
                    .to_dtype(DType::U32)?
                    .flatten_all()?
                    .to_vec1::<u32>()?;
                let p = self.positions.of(&ids, t, self.pad_token_id);
                Tensor::from_vec(p, (b, t), input_ids.device())?
            }
        })
    }

    /// # Shapes
    /// - `input_ids`, `token_type_ids`: `(batch, seq)`; returns `(batch, seq, hidden)`
    fn forward(&self, input_ids: &Tensor, token_type_ids: &Tensor) -> Result<Tensor> {
        let (_b, t) = input_ids.dims2()?;
        if t > self.max_positions {
            return Err(Error::SequenceTooLong {
                len: t,
                max: self.max_positions,
            });
        }
        match self.forward_cpu(input_ids, token_type_ids)? {
            Some(x) => Ok(x),
            None => self.forward_candle(input_ids, token_type_ids),
        }
    }

    /// [`BertEmbeddings::forward`] in candle's ops (any device, dtype, autograd).
    fn forward_candle(&self, input_ids: &Tensor, token_type_ids: &Tensor) -> Result<Tensor> {
        let positions = self.position_ids(input_ids)?; // (b, t)
        let words = self.word.forward(input_ids)?.to_dtype(self.norm_dtype())?; // (b, t, d)
        let pos = self.position.forward(&positions)?; // (b, t, d)
        let x = match &self.token_type {
            Some(table) => ((words + table.forward(token_type_ids)?)? + pos)?,
            None => (words + pos)?,
        };
        Ok(self.norm.forward(&x)?)
    }
}

impl BertEmbeddings {
    /// [`BertEmbeddings::forward`] in one pass per token on the CPU kernels; `None` unless
    /// every table is on the CPU, f32 (the words also f16 or bf16), and tracks no gradient.
    fn forward_cpu(&self, input_ids: &Tensor, token_type_ids: &Tensor) -> Result<Option<Tensor>> {
        let Some(beta) = self.norm.bias() else {
            return Ok(None);
        };
        let word_ok = |w: &Tensor| {
            w.device().is_cpu()
                && [DType::F32, DType::F16, DType::BF16].contains(&w.dtype())
                && !w.track_op()
        };
        let f32_tables = [
            self.token_type.as_ref().map(|t| t.embeddings()),
            Some(self.position.embeddings()),
            Some(self.norm.weight()),
            Some(beta),
        ];
        let eligible = input_ids.device().is_cpu()
            && match &self.word {
                WordEmbeddings::Tensor(e) => word_ok(e.embeddings()),
                WordEmbeddings::Mapped { .. } => true,
            }
            && f32_tables
                .iter()
                .flatten()
                .all(|w| w.device().is_cpu() && w.dtype() == DType::F32 && !w.track_op());
        if !eligible {
            return Ok(None);
        }
        let (b, t) = input_ids.dims2()?;
        if token_type_ids.dims() != input_ids.dims() {
            return Err(Error::input(
                "token_type_ids",
                format!("the shape of input_ids {:?}", input_ids.dims()),
                format!("{:?}", token_type_ids.dims()),
            ));
        }
        let ids_of = |x: &Tensor| -> Result<Vec<u32>> {
            Ok(x.to_dtype(DType::U32)?.flatten_all()?.to_vec1::<u32>()?)
        };
        let ids = ids_of(input_ids)?;
        // A family without token types adds a row of zeros (exact).
        let no_types = vec![0f32; self.norm.weight().dim(0)?];
        let types = match &self.token_type {
            Some(_) => ids_of(token_type_ids)?,
            None => vec![0u32; ids.len()],
        };
        let positions = self.positions.of(&ids, t, self.pad_token_id);
        let (guard, layout);
        let word = match &self.word {
            WordEmbeddings::Mapped { ckpt, name } => {
                WordTable::Half(WordEmbeddings::mapped(ckpt, name)?)
            }
            WordEmbeddings::Tensor(e) => {
                (guard, layout) = e.embeddings().storage_and_layout();
                let Some((start, end)) = layout.contiguous_offsets() else {
                    return Ok(None);
                };
                match &*guard {
                    Storage::Cpu(CpuStorage::F32(v)) => WordTable::F32(&v[start..end]),
                    Storage::Cpu(CpuStorage::F16(v)) => WordTable::F16(&v[start..end]),
                    Storage::Cpu(CpuStorage::BF16(v)) => WordTable::Bf16(&v[start..end]),
                    _ => return Ok(None),
                }
            }
        };
        let ty = match &self.token_type {
            Some(table) => Some(CpuF32::new(table.embeddings(), "token_type_embeddings")?),
            None => None,
        };
        let pos = CpuF32::new(self.position.embeddings(), "position_embeddings")?;
        let token_type = match &ty {
            Some(ty) => ty.contiguous()?,
            None => &no_types,
        };
        let (gamma, beta) = (
            CpuF32::new(self.norm.weight(), "LayerNorm.weight")?,
            CpuF32::new(beta, "LayerNorm.bias")?,
        );
        let out = embed_tokens(
            &EmbeddingTables {
                word,
                token_type,
                position: pos.contiguous()?,
                gamma: &gamma.vector()?,
                beta: &beta.vector()?,
                eps: self.norm.eps() as f32,
            },
            &ids,
            &types,
            &positions,
        )?;
        let d = out.len() / (b * t).max(1);
        Ok(Some(Tensor::from_vec(out, (b, t, d), input_ids.device())?))
    }

    fn norm_dtype(&self) -> DType {
        self.position.embeddings().dtype()
    }
}

/// One transformer layer of a BERT encoder.
pub struct BertLayer {
    attention: MultiHeadSelfAttention,
    attention_norm: LayerNorm,
    intermediate: Dense,
    output: Dense,
    output_norm: LayerNorm,
    activation: Activation,
    /// The feed-forward half on the CPU kernels (f32 weights that track no gradients, exact
    /// GELU); `None` elsewhere.
    packed: Option<PackedFeedForward>,
}

impl BertLayer {
    /// Loads one layer under `vb` with the names of `cfg.model_type`'s family: BERT's
    /// `attention.*`, `intermediate.dense`, `output.dense`, `output.LayerNorm`, or
    /// DistilBERT's `attention.{q,k,v,out}_lin`, `sa_layer_norm`, `ffn.lin1`, `ffn.lin2`,
    /// `output_layer_norm`.
    pub fn load(vb: VarBuilder, cfg: &HfConfig) -> Result<Self> {
        let family = EncoderFamily::of_model_type(cfg.model_type.as_deref())?;
        Self::load_from(vb, cfg, family, None)
    }

    /// [`BertLayer::load`]; with `half`, the checkpoint `vb` reads, whose f16 or bf16
    /// matrices are read where it is mapped (packed on the first long input) when the layer
    /// runs in f32 on the packed kernels: no f32 copy of them is made at load time.
    fn load_from(
        vb: VarBuilder,
        cfg: &HfConfig,
        family: &EncoderFamily,
        half: Option<&Checkpoint>,
    ) -> Result<Self> {
        let d = cfg.hidden_size;
        let attn_cfg = AttentionConfig::new(family.attention_layout, cfg.num_attention_heads);
        let attn_vb = vb.pp(family.attention);
        let attention = match half {
            Some(ckpt) => MultiHeadSelfAttention::load_half_packed(&attn_vb, &attn_cfg, ckpt)?,
            None => None,
        };
        let attention = match attention {
            Some(a) => a,
            None => MultiHeadSelfAttention::load(attn_vb, &attn_cfg)?,
        };
        if attention.hidden_size() != d {
            let query = family
                .attention_layout
                .separate_projections()
                .map_or("query", |p| p[0]);
            return Err(Error::ShapeMismatch {
                tensor: format!("{}.{}.{query}.weight", vb.prefix(), family.attention),
                expected: format!("(_, {d}) for hidden_size {d}"),
                found: vec![
                    attention.num_heads() * attention.head_dim(),
                    attention.hidden_size(),
                ],
            });
        }
        let inter = match cfg.intermediate_size {
            Some(i) => i,
            None => vb.pp(family.intermediate).get_unchecked("weight")?.dim(0)?,
        };
        let attention_norm = layer_norm(vb.pp(family.attention_norm), d, cfg.layer_norm_eps)?;
        let activation = Activation::from_name(&cfg.hidden_act)?;
        let bias = |name: &str, n: usize| vb.pp(name).get(n, "bias");
        let (intermediate_bias, output_bias) =
            (bias(family.intermediate, inter)?, bias(family.output, d)?);
        // The two `(out, in)` matrices: the checkpoint's half-precision bytes where it is
        // mapped when it has them and the kernels will run, as loaded tensors otherwise.
        let half_packed = match half {
            Some(ckpt) if activation == Activation::Gelu && vb.dtype() == DType::F32 => {
                let pack = |n: &str, rows: usize, cols: usize| -> Result<Option<PackedWeight>> {
                    let name = match vb.prefix().as_str() {
                        "" => format!("{n}.weight"),
                        prefix => format!("{prefix}.{n}.weight"),
                    };
                    match ckpt.half_matrix(&name)? {
                        Some(m) if (m.rows, m.cols) == (rows, cols) => {
                            PackedWeight::from_half(ckpt.half_source(vec![name]), &[])
                        }
                        _ => Ok(None),
                    }
                };
                match (
                    pack(family.intermediate, inter, d)?,
                    pack(family.output, d, inter)?,
                ) {
                    (Some(i), Some(o)) => Some([Arc::new(i), Arc::new(o)]),
                    _ => None,
                }
            }
            _ => None,
        };
        let [intermediate, output] = match half_packed {
            Some([i, o]) => [FeedForwardWeight::Packed(i), FeedForwardWeight::Packed(o)],
            None => {
                let w = |name: &str, out: usize, inp: usize| -> Result<FeedForwardWeight> {
                    let w = vb.pp(name).get((out, inp), "weight")?;
                    Ok(FeedForwardWeight::Tensor(w))
                };
                [
                    w(family.intermediate, inter, d)?,
                    w(family.output, d, inter)?,
                ]
            }
        };
        let output_norm = layer_norm(vb.pp(family.output_norm), d, cfg.layer_norm_eps)?;
        let packed = match activation {
            Activation::Gelu => PackedFeedForward::pack(FeedForwardTensors {
                attention_norm: &attention_norm,
                intermediate_weight: intermediate.clone(),
                intermediate_bias: &intermediate_bias,
                output_weight: output.clone(),
                output_bias: &output_bias,
                output_norm: &output_norm,
            })?,
            _ => None,
        };
        // Once packed, the panels are the only copy kept (unpacked for a call on candle's ops).
        let [intermediate, output] = match &packed {
            Some(p) => p.weights().map(|w| StoredWeight::Packed(w.clone())),
            None => {
                let stored = |w: FeedForwardWeight| -> Result<StoredWeight> {
                    Ok(match w {
                        FeedForwardWeight::Packed(p) => StoredWeight::Packed(p),
                        FeedForwardWeight::Tensor(t) => StoredWeight::Tensor(t.t()?), // (in, out)
                    })
                };
                [stored(intermediate)?, stored(output)?]
            }
        };
        let intermediate = Dense {
            weight_t: intermediate,
            bias: intermediate_bias,
        };
        let output = Dense {
            weight_t: output,
            bias: output_bias,
        };
        Ok(Self {
            attention,
            attention_norm,
            intermediate,
            output,
            output_norm,
            activation,
            packed,
        })
    }

    /// The layer's attention module.
    pub fn attention(&self) -> &MultiHeadSelfAttention {
        &self.attention
    }

    /// # Shapes
    /// - `x`: `(batch, seq, hidden)`; returns `(batch, seq, hidden)` and, when asked,
    ///   the weights `(batch, heads, seq, seq)`
    pub fn forward(
        &self,
        x: &Tensor,
        mask: Option<&AttentionMask>,
        need_weights: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.forward_rows(x, mask, need_weights, None)
    }

    /// [`BertLayer::forward`]; `real_rows` (indices into the `batch * seq` rows) lets the
    /// CPU kernels skip the feed-forward on padding rows, whose outputs nothing reads.
    fn forward_rows(
        &self,
        x: &Tensor,
        mask: Option<&AttentionMask>,
        need_weights: bool,
        real_rows: Option<&[usize]>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let attn = self.attention.attend(x, None, mask, need_weights)?;
        if let Some(packed) = &self.packed {
            if let Some(out) = packed.forward(&attn.context, x, real_rows)? {
                return Ok((out, attn.weights));
            }
        }
        let h = self.attention_norm.forward(&(attn.context + x)?)?;
        let ff = self.activation.apply(&self.intermediate.forward(&h)?)?;
        let out = self
            .output_norm
            .forward(&(self.output.forward(&ff)? + h)?)?;
        Ok((out, attn.weights))
    }
}

impl BertLayer {
    /// [`BertLayer::forward`] in candle's differentiable ops (the explicit attention, the
    /// composed LayerNorms), returning the attention probabilities as the graph node the
    /// context is computed from.
    ///
    /// # Shapes
    /// - `x`: `(batch, seq, hidden)`; returns `(batch, seq, hidden)` and `(batch, heads,
    ///   seq, seq)` f32
    fn forward_traced(
        &self,
        x: &Tensor,
        mask: Option<&AttentionMask>,
        probe: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let (q, k, v) = self.attention.project_qkv(x)?;
        let scale = self.attention.score_scale();
        let out = explicit_probed(&q, &k, &v, mask, scale, true, probe)?;
        let probs = out
            .weights
            .ok_or_else(|| Error::Kernel("the explicit attention returned no weights".into()))?;
        let context = self.attention.merge_heads(&out.context)?;
        let norm = |ln: &LayerNorm, x: &Tensor| -> Result<Tensor> {
            let bias = ln
                .bias()
                .ok_or_else(|| Error::config("a BERT LayerNorm without bias"))?;
            Ok(candle_nn::ops::layer_norm_slow(
                x,
                ln.weight(),
                bias,
                ln.eps() as f32,
            )?)
        };
        let h = norm(&self.attention_norm, &(context + x)?)?;
        let ff = self.activation.apply(&self.intermediate.forward(&h)?)?;
        Ok((
            norm(&self.output_norm, &(self.output.forward(&ff)? + h)?)?,
            probs,
        ))
    }
}

/// A BERT-family encoder: BERT (MiniLM, all-MiniLM-L6-v2, bert-base-uncased, ...),
/// RoBERTa, XLM-RoBERTa, CamemBERT and DistilBERT, picked by `model_type`
/// ([`EncoderFamily`]).
pub struct BertEncoder {
    /// The post-norm form's (`None` for ModernBERT).
    embeddings: Option<BertEmbeddings>,
    layers: Vec<BertLayer>,
    /// The pre-norm form (ModernBERT).
    modern: Option<ModernBert>,
    config: HfConfig,
    family: &'static EncoderFamily,
    dtype: DType,
}

impl BertEncoder {
    /// Loads the encoder from a checkpoint root; tensors may sit under the family's base
    /// prefix (`bert.` as in `BertForPreTraining` checkpoints, `roberta.`, `distilbert.`) or
    /// at the top level (as in `BertModel`). The family comes from `cfg.model_type`; a
    /// configuration value it does not implement is an error naming the field.
    pub fn load(vb: VarBuilder, cfg: &HfConfig) -> Result<Self> {
        Self::load_inner(vb, cfg, None, None)
    }

    /// Loads the encoder from a [`Checkpoint`] in `dtype` on `device`. Same result as
    /// [`BertEncoder::load`], but when the checkpoint stores half precision and the model
    /// runs in f32 the word-embedding table stays in half precision (rows are widened
    /// exactly after the lookup): the largest tensor is not converted at load time.
    pub fn load_checkpoint(
        ckpt: &Checkpoint,
        dtype: DType,
        device: &Device,
        cfg: &HfConfig,
    ) -> Result<Self> {
        let family = EncoderFamily::of_model_type(cfg.model_type.as_deref())?;
        family.check_config(cfg)?;
        let words = family.word_table();
        let base = match ckpt.contains(words) {
            false if ckpt.contains(&format!("{}.{words}", family.base_prefix)) => {
                format!("{}.", family.base_prefix)
            }
            _ => String::new(),
        };
        family.check_tensors(ckpt.names(), &base, cfg)?;
        let vb = ckpt.var_builder(dtype, device);
        let word_dtype = ckpt
            .stored_dtype(&format!("{base}{words}"))
            .filter(|d| dtype == DType::F32 && matches!(d, DType::F16 | DType::BF16));
        // Half-precision matrices are read where the file is mapped for f32 on the CPU.
        let half = (dtype == DType::F32 && device.is_cpu()).then_some(ckpt);
        Self::load_inner(vb, cfg, word_dtype, half)
    }

    fn load_inner(
        vb: VarBuilder,
        cfg: &HfConfig,
        word_dtype: Option<DType>,
        half: Option<&Checkpoint>,
    ) -> Result<Self> {
        cfg.validate()?;
        let family = EncoderFamily::of_model_type(cfg.model_type.as_deref())?;
        family.check_config(cfg)?;
        let words = family.word_table();
        let vb = if !vb.contains_tensor(words)
            && vb.contains_tensor(&format!("{}.{words}", family.base_prefix))
        {
            vb.pp(family.base_prefix)
        } else {
            vb
        };
        if family.pre_norm {
            // Its window, rotary bases and norms are read from the parsed file, never guessed.
            let raw = cfg.raw.as_ref().ok_or_else(|| {
                Error::config(
                    "a ModernBERT config needs its config.json as parsed \
                     (HfConfig::from_json / from_file), not one built from fields",
                )
            })?;
            let mcfg = ModernBertConfig::from_raw(raw, cfg)?;
            let dtype = vb.dtype();
            return Ok(Self {
                embeddings: None,
                layers: Vec::new(),
                modern: Some(ModernBert::load(vb, cfg, &mcfg)?),
                config: cfg.clone(),
                family,
                dtype,
            });
        }
        let dtype = vb.dtype();
        // The embeddings and the layers load side by side: each layer converts its tensors
        // and packs them for the kernels (or, from a half-precision file, checks its matrices
        // and reads each page once), which is most of a model's load time.
        let (embeddings, layers) = rayon::join(
            || BertEmbeddings::load(vb.pp("embeddings"), cfg, family, word_dtype, half),
            || {
                (0..cfg.num_hidden_layers)
                    .into_par_iter()
                    .map(|i| {
                        let layer = vb.pp(format!("{}.{i}", family.layers));
                        BertLayer::load_from(layer, cfg, family, half)
                    })
                    .collect::<Result<Vec<_>>>()
            },
        );
        let (embeddings, layers) = (embeddings?, layers?);
        Ok(Self {
            embeddings: Some(embeddings),
            layers,
            modern: None,
            config: cfg.clone(),
            family,
            dtype,
        })
    }

    /// The family the encoder was loaded as.
    pub fn family(&self) -> &'static EncoderFamily {
        self.family
    }

    /// The model config.
    pub fn config(&self) -> &HfConfig {
        &self.config
    }

    /// The layers.
    pub fn layers(&self) -> &[BertLayer] {
        &self.layers
    }

    /// Number of positions the model has.
    pub fn max_positions(&self) -> usize {
        match (&self.embeddings, &self.modern) {
            (Some(e), _) => e.max_positions,
            (None, Some(m)) => m.max_positions(),
            (None, None) => 0,
        }
    }

    /// The post-norm form's embeddings.
    fn embeddings(&self) -> Result<&BertEmbeddings> {
        self.embeddings
            .as_ref()
            .ok_or_else(|| Error::Kernel("a pre-norm encoder has no BERT embeddings".into()))
    }

    /// Dtype of the weights.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Runs the encoder.
    ///
    /// # Shapes
    /// - `input_ids`: `(batch, seq)` integer
    /// - `token_type_ids`: `(batch, seq)`, zeros when `None`
    /// - `attention_mask`: `(batch, seq)` 0/1, 1 = real token
    /// - returns: hidden states `(batch, seq, hidden)`, attentions per layer
    ///   `(batch, heads, seq, seq)` when `output_attentions`
    ///
    /// The rows of padding positions (0 in `attention_mask`) carry no meaning (their keys
    /// are masked, pooling leaves them out); on the CPU in f32 they skip the feed-forward,
    /// so they differ from transformers' (as with text-embeddings-inference's packed rows).
    /// The real tokens' rows do not depend on the padding.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        output_attentions: bool,
    ) -> Result<EncoderOutput> {
        in_pool(|| {
            self.forward_in_pool(input_ids, token_type_ids, attention_mask, output_attentions)
        })
    }

    fn forward_in_pool(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        output_attentions: bool,
    ) -> Result<EncoderOutput> {
        let (b, t) = input_ids.dims2().map_err(|_| {
            Error::input(
                "input_ids",
                "rank 2 (batch, seq)",
                format!("shape {:?}", input_ids.dims()),
            )
        })?;
        if b == 0 || t == 0 {
            return Err(Error::input(
                "input_ids",
                "at least one token",
                format!("shape {:?}", input_ids.dims()),
            ));
        }
        let zeros;
        let token_type_ids = match token_type_ids {
            Some(t) => t,
            None => {
                zeros = input_ids.zeros_like()?;
                &zeros
            }
        };
        let mask = match attention_mask {
            Some(m) => Some(AttentionMask::padding(m)?),
            None => None,
        };
        // The real tokens' rows, for the CPU kernels to skip padding (None: no padding).
        let real_rows: Option<Vec<usize>> = match attention_mask {
            Some(m) if m.device().is_cpu() => {
                let keep: Vec<u8> = m.ne(0u32)?.flatten_all()?.to_vec1()?;
                let real: Vec<usize> = (0..keep.len()).filter(|&i| keep[i] != 0).collect();
                (real.len() < keep.len()).then_some(real)
            }
            _ => None,
        };
        if let Some(modern) = &self.modern {
            return modern.forward(input_ids, attention_mask, output_attentions);
        }
        let mut x = self.embeddings()?.forward(input_ids, token_type_ids)?;
        let mut attentions = output_attentions.then(Vec::new);
        for layer in &self.layers {
            let (next, w) =
                layer.forward_rows(&x, mask.as_ref(), output_attentions, real_rows.as_deref())?;
            x = next;
            if let (Some(all), Some(w)) = (attentions.as_mut(), w) {
                all.push(w);
            }
        }
        Ok(EncoderOutput {
            hidden_states: x,
            attentions,
        })
    }
}

impl BertEncoder {
    /// One sentence through the encoder, kept for explanations: every layer's attention
    /// probabilities and, when asked, its value norms; with `opts.grad` the embeddings'
    /// output is a variable, so that the probabilities are nodes of the graph a target's
    /// gradient flows through.
    ///
    /// # Shapes
    /// - `input_ids`, `token_type_ids`: `(1, seq)`
    pub(crate) fn trace(
        &self,
        input_ids: &Tensor,
        token_type_ids: &Tensor,
        opts: TraceOptions,
    ) -> Result<ForwardTrace> {
        let (b, t) = input_ids.dims2()?;
        if b != 1 || t == 0 {
            return Err(Error::input(
                "input_ids",
                "one sequence of at least one token (1, seq)",
                format!("shape {:?}", input_ids.dims()),
            ));
        }
        if let Some(modern) = &self.modern {
            return modern.trace(input_ids, opts);
        }
        let x = self.embeddings()?.forward(input_ids, token_type_ids)?;
        let mut x = graph_input(x, opts.grad)?;
        let mut attentions = Vec::with_capacity(self.layers.len());
        let (mut value_norms, mut probes) = (Vec::new(), Vec::new());
        for layer in &self.layers {
            if opts.value_norms {
                value_norms.push(layer.attention.value_output_norms(&x.detach())?);
            }
            let p = probe(opts.grad, layer.attention.num_heads(), t, x.device())?;
            let (next, probs) = layer.forward_traced(&x, None, p.as_ref())?;
            attentions.push(probs);
            probes.extend(p);
            x = next;
        }
        Ok(ForwardTrace {
            output: x,
            attentions,
            probes,
            value_norms,
        })
    }
}

/// Mean of the hidden states over real tokens (sentence-transformers' mean pooling).
///
/// # Shapes
/// - `hidden`: `(batch, seq, hidden)`, `attention_mask`: `(batch, seq)` 0/1
/// - returns: `(batch, hidden)` f32
pub fn mean_pool(hidden: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
    let h = hidden.to_dtype(DType::F32)?;
    let m = attention_mask.to_dtype(DType::F32)?.unsqueeze(2)?; // (b, t, 1)
    let sum = h.broadcast_mul(&m)?.sum(1)?; // (b, hidden)
    let count = m.sum(1)?.clamp(1e-9f32, f32::INFINITY)?; // (b, 1)
    Ok(sum.broadcast_div(&count)?)
}

/// [`l2_normalize`]`(`[`mean_pool`]`(hidden, attention_mask))` as rows, in one pass over
/// `hidden` on the CPU; `None` unless `hidden` is f32 on the CPU and tracks no gradient.
///
/// # Shapes
/// - `hidden`: `(batch, seq, hidden)`, `attention_mask`: `(batch, seq)`; returns `batch`
///   rows of `hidden` values
pub(crate) fn mean_pool_unit_rows(
    hidden: &Tensor,
    attention_mask: &Tensor,
) -> Result<Option<Vec<Vec<f32>>>> {
    if !hidden.device().is_cpu() || hidden.dtype() != DType::F32 || hidden.track_op() {
        return Ok(None);
    }
    let (b, t, d) = hidden.dims3()?;
    if attention_mask.dims() != [b, t] {
        return Err(Error::input(
            "attention_mask",
            format!("({b}, {t}) for hidden states {:?}", hidden.dims()),
            format!("{:?}", attention_mask.dims()),
        ));
    }
    let mask = attention_mask
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let hidden = hidden.contiguous()?;
    let view = CpuF32::new(&hidden, "hidden_states")?;
    let h = view.contiguous()?;
    let rows = (0..b)
        .map(|i| {
            let mut sum = vec![0f32; d];
            let mut count = 0f32;
            for j in 0..t {
                let m = mask[i * t + j];
                count += m;
                let row = &h[(i * t + j) * d..(i * t + j + 1) * d];
                for (s, x) in sum.iter_mut().zip(row) {
                    *s += x * m;
                }
            }
            let count = count.max(1e-9);
            sum.iter_mut().for_each(|s| *s /= count);
            let norm = sum.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
            sum.iter_mut().for_each(|s| *s /= norm);
            sum
        })
        .collect();
    Ok(Some(rows))
}

/// Rows scaled to unit L2 norm.
///
/// # Shapes
/// - `x`: `(batch, dim)`; returns `(batch, dim)`
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let norm = x
        .sqr()?
        .sum_keepdim(1)?
        .sqrt()?
        .clamp(1e-12f32, f32::INFINITY)?;
    Ok(x.broadcast_div(&norm)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    use crate::kernels::gemm::packed;

    fn values(shape: &[usize], seed: usize) -> Result<Tensor> {
        let v = crate::kernels::test_values(shape.iter().product(), seed);
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
    }

    /// A half-precision checkpoint read in f32 on the CPU: its matrices and its word table are
    /// read where the checkpoint's bytes are, with the results of the tensors widened by a
    /// `VarBuilder` (within f32 rounding for a short batch, read in place; bit for bit once a
    /// long batch has packed them); the feed-forward's candle route multiplies by the same
    /// values.
    #[test]
    fn half_checkpoint_reads_its_bytes_like_widened_tensors() -> Result<()> {
        let (vocab, d, heads, inter, positions, layers) = (40, 48, 4, 96, 16, 2);
        let cfg: HfConfig = serde_json::from_str(&format!(
            r#"{{"hidden_size": {d}, "num_attention_heads": {heads},
                "num_hidden_layers": {layers}, "intermediate_size": {inter},
                "vocab_size": {vocab}, "max_position_embeddings": {positions},
                "layer_norm_eps": 1e-12, "hidden_act": "gelu"}}"#
        ))
        .map_err(|e| Error::config(e.to_string()))?;
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            ("embeddings.word_embeddings.weight".into(), vec![vocab, d]),
            (
                "embeddings.position_embeddings.weight".into(),
                vec![positions, d],
            ),
            ("embeddings.token_type_embeddings.weight".into(), vec![2, d]),
            ("embeddings.LayerNorm.weight".into(), vec![d]),
            ("embeddings.LayerNorm.bias".into(), vec![d]),
        ];
        for l in 0..layers {
            let p = format!("encoder.layer.{l}");
            for (name, shape) in [
                ("attention.self.query", vec![d, d]),
                ("attention.self.key", vec![d, d]),
                ("attention.self.value", vec![d, d]),
                ("attention.output.dense", vec![d, d]),
                ("intermediate.dense", vec![inter, d]),
                ("output.dense", vec![d, inter]),
            ] {
                shapes.push((format!("{p}.{name}.bias"), vec![shape[0]]));
                shapes.push((format!("{p}.{name}.weight"), shape));
            }
            for norm in ["attention.output.LayerNorm", "output.LayerNorm"] {
                shapes.push((format!("{p}.{norm}.weight"), vec![d]));
                shapes.push((format!("{p}.{norm}.bias"), vec![d]));
            }
        }
        let tensors = shapes
            .into_iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let t = (values(&shape, 100 + i)? * 0.2)?;
                let t = if name.ends_with("LayerNorm.weight") {
                    (t + 1.0)?
                } else {
                    t
                };
                Ok((name, t.to_dtype(DType::F16)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let bytes = safetensors::tensor::serialize(tensors, None)
            .map_err(|e| Error::Kernel(e.to_string()))?;
        let ckpt = Checkpoint::from_bytes(bytes, "tiny-bert-f16.safetensors")?;
        let from_bytes = BertEncoder::load_checkpoint(&ckpt, DType::F32, &Device::Cpu, &cfg)?;
        let widened = BertEncoder::load(ckpt.var_builder(DType::F32, &Device::Cpu), &cfg)?;
        if packed::available() {
            assert!(matches!(
                from_bytes.embeddings()?.word,
                WordEmbeddings::Mapped { .. }
            ));
            for layer in &from_bytes.layers {
                assert!(layer.packed.is_some() && layer.attention.is_fused());
                assert!(matches!(
                    layer.intermediate.weight_t,
                    StoredWeight::Packed(_)
                ));
            }
        }
        let ids = Tensor::new(&[[1u32, 39, 3, 0, 7, 5], [4, 4, 28, 2, 0, 0]], &Device::Cpu)?;
        let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], &Device::Cpu)?;
        // A short batch reads the mapped rows in place (sums in another order: within f32
        // rounding); a long one packs them into the same panels as the widened tensors'
        // (bit for bit from then on).
        let (a, b) = (
            from_bytes.forward(&ids, None, Some(&mask), true)?,
            widened.forward(&ids, None, Some(&mask), true)?,
        );
        let diff = (&a.hidden_states - &b.hidden_states)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-5, "short batch, in place vs widened: {diff}");
        let long = |t: &Tensor| Tensor::cat(&[t, t, t, t], 0);
        let (ids, mask) = (long(&ids)?, long(&mask)?); // 48 rows, 40 of them real
        let (a, b) = (
            from_bytes.forward(&ids, None, Some(&mask), true)?,
            widened.forward(&ids, None, Some(&mask), true)?,
        );
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            Ok(t.flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|v| v.to_bits())
                .collect())
        };
        // Real tokens' rows (the padding rows skip the feed-forward on both).
        let real = |t: &Tensor| -> Result<Vec<u32>> {
            let rows = (0..4)
                .flat_map(|i| {
                    [
                        t.get(2 * i),
                        t.get(2 * i + 1).and_then(|r| r.narrow(0, 0, 4)),
                    ]
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            bits(&Tensor::cat(&rows, 0)?)
        };
        assert_eq!(real(&a.hidden_states)?, real(&b.hidden_states)?);
        for (wa, wb) in a
            .attentions
            .iter()
            .flatten()
            .zip(b.attentions.iter().flatten())
        {
            assert_eq!(bits(wa)?, bits(wb)?);
        }
        let types = ids.zeros_like()?;
        let (ea, eb) = (
            from_bytes.embeddings()?.forward_candle(&ids, &types)?,
            widened.embeddings()?.forward_candle(&ids, &types)?,
        );
        assert_eq!(bits(&ea)?, bits(&eb)?);
        let x = (values(&[2, 3, d], 7)? * 0.5)?;
        let (fa, fb) = (
            from_bytes.layers[1].intermediate.forward(&x)?,
            widened.layers[1].intermediate.forward(&x)?,
        );
        let diff = (fa - fb)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "unpacked panels vs the tensor: {diff}");
        Ok(())
    }

    /// The one-pass CPU embeddings equal candle's composition; both reject an id past the
    /// vocabulary.
    #[test]
    fn cpu_embeddings_equal_candle_ops() -> Result<()> {
        let (vocab, d, positions) = (30, 24, 12);
        let cfg: HfConfig = serde_json::from_str(&format!(
            r#"{{"hidden_size": {d}, "num_attention_heads": 4, "num_hidden_layers": 1,
                "vocab_size": {vocab}, "max_position_embeddings": {positions},
                "layer_norm_eps": 1e-12, "hidden_act": "gelu"}}"#
        ))
        .map_err(|e| Error::config(e.to_string()))?;
        let tensors = HashMap::from([
            (
                "word_embeddings.weight".to_string(),
                values(&[vocab, d], 1)?,
            ),
            (
                "position_embeddings.weight".to_string(),
                values(&[positions, d], 2)?,
            ),
            (
                "token_type_embeddings.weight".to_string(),
                values(&[2, d], 3)?,
            ),
            ("LayerNorm.weight".to_string(), (values(&[d], 4)? + 1.5)?),
            ("LayerNorm.bias".to_string(), values(&[d], 5)?),
        ]);
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
        // The word table as stored in f32, and kept in f16 (a half-precision checkpoint).
        for word_dtype in [None, Some(DType::F16)] {
            let emb =
                BertEmbeddings::load(vb.clone(), &cfg, &EncoderFamily::BERT, word_dtype, None)?;
            let ids = Tensor::new(&[[1u32, 29, 3, 0, 7], [4, 4, 28, 2, 0]], &Device::Cpu)?;
            let types = Tensor::new(&[[0u32, 0, 1, 1, 0], [1, 0, 0, 0, 1]], &Device::Cpu)?;
            let fast = emb
                .forward_cpu(&ids, &types)?
                .ok_or_else(|| Error::Kernel("the CPU path did not run".into()))?;
            let slow = emb.forward_candle(&ids, &types)?;
            assert_eq!(fast.dims(), slow.dims());
            let diff = (fast - slow)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                diff < 1e-5,
                "{word_dtype:?}: CPU path vs candle ops: {diff}"
            );
            let bad = Tensor::new(&[[1u32, vocab as u32]], &Device::Cpu)?;
            let zeros = bad.zeros_like()?;
            assert!(emb.forward_cpu(&bad, &zeros).is_err());
            assert!(emb.forward_candle(&bad, &zeros).is_err());
        }
        Ok(())
    }

    /// The pooled rows equal `l2_normalize(mean_pool(..))`, for a mask with a sentence of no
    /// tokens at all too.
    #[test]
    fn pooled_rows_equal_the_tensor_functions() -> Result<()> {
        let hidden = values(&[3, 5, 16], 7)?;
        let mask = Tensor::new(
            &[[1u32, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]],
            &Device::Cpu,
        )?;
        let rows = mean_pool_unit_rows(&hidden, &mask)?
            .ok_or_else(|| Error::Kernel("the CPU path did not run".into()))?;
        let want = l2_normalize(&mean_pool(&hidden, &mask)?)?.to_vec2::<f32>()?;
        assert_eq!(rows.len(), want.len());
        for (i, (got, want)) in rows.iter().zip(&want).enumerate() {
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 1e-6, "row {i}: {g} vs {w}");
            }
        }
        assert!(rows[2].iter().all(|&v| v == 0.0));
        assert!(mean_pool_unit_rows(&hidden, &mask.narrow(1, 0, 4)?).is_err());
        Ok(())
    }
}
