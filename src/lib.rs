//! # candle-attention
//!
//! Self-attention layers for [Candle](https://github.com/huggingface/candle) that load
//! pretrained projection weights in the layouts real checkpoints use (BERT, PyTorch
//! `nn.MultiheadAttention`, GPT-2, LLaMA) and match PyTorch.
//!
//! - [`scaled_dot_product_attention`]: `softmax(Q K^T / sqrt(d_k) + mask) V`, grouped K/V
//!   heads, softmax in f32, fully masked rows give zeros (never NaN). On the CPU it runs
//!   tiled kernels (online softmax, memory linear in the sequence length without weights);
//!   [`scaled_dot_product_attention_explicit`] is the reference composition of candle ops,
//!   [`scaled_dot_product_attention_streamed`] hands out the weights block by block.
//! - [`self_attention_cost`] / [`MultiHeadSelfAttention::cost`]: parameters and FLOPs.
//! - [`AttentionMask`]: causal, padding (1 = keep), boolean keep/block, additive bias.
//! - [`SingleHeadSelfAttention`] and [`MultiHeadSelfAttention`] built with a `VarBuilder`
//!   from a [`WeightLayout`]; both implement [`candle_core::Module`].
//! - [`Checkpoint`]: safetensors files with errors that name what is wrong.
//! - Training: a layer built on variables (a fresh one on a `VarMap` with
//!   [`AttentionConfig::with_hidden_size`], or a checkpoint's tensors as `Var`s) is
//!   differentiable end to end, gradients reaching the variables in their checkpoint layout;
//!   on the CPU in f32 its forward and backward run on the kernels (FlashAttention-2-style
//!   backward, memory linear in the sequence). [`dispatch`] tells which implementation runs
//!   a call.
//! - Models: [`BertEncoder`] (sentence embeddings with [`Embedder`]) and [`LlamaModel`]
//!   (safetensors directories, or one GGUF file with [`LlamaModel::from_gguf`]: weights kept
//!   in their blocks, the tokenizer from [`TextEncoder::from_gguf`]).
//! - [`viz`]: attention dumps, heatmaps (terminal, SVG), the HTML page, and explanations
//!   beside the raw weights ([`viz::Explanation`]: attention rollout, gradient-weighted
//!   relevance through the differentiable forward, value-weighted norms).
//!
//! Three uses, in short (the README has more):
//!
//! Load a pretrained layer (see the example below the threading note) and run it; train a
//! fresh one on a `VarMap` with candle-nn's optimizers:
//!
//! ```
//! use candle_attention::{AttentionConfig, MultiHeadSelfAttention, WeightLayout};
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{AdamW, Optimizer, VarBuilder, VarMap};
//!
//! # fn main() -> candle_attention::Result<()> {
//! let (device, vm) = (Device::Cpu, VarMap::new());
//! let vb = VarBuilder::from_varmap(&vm, DType::F32, &device);
//! // nn.MultiheadAttention's names (attn.in_proj_weight, ...), candle-nn's initialisation.
//! let cfg = AttentionConfig::new(WeightLayout::TorchMha, 4).with_hidden_size(32);
//! let attn = MultiHeadSelfAttention::load(vb.pp("attn"), &cfg)?;
//! let mut opt = AdamW::new_lr(vm.all_vars(), 1e-2)?;
//! let x = Tensor::randn(0f32, 1.0, (2, 6, 32), &device)?; // (batch, seq, hidden)
//! let loss = |attn: &MultiHeadSelfAttention| -> candle_attention::Result<Tensor> {
//!     Ok(attn.forward(&x, None)?.context.sqr()?.mean_all()?)
//! };
//! let before = loss(&attn)?.to_scalar::<f32>()?;
//! for _ in 0..5 {
//!     opt.backward_step(&loss(&attn)?)?; // gradients reach the VarMap's variables
//! }
//! assert!(loss(&attn)?.to_scalar::<f32>()? < before);
//! # Ok(()) }
//! ```
//!
//! Decode step by step with the KV cache (here a tiny random LLaMA with grouped K/V heads;
//! `LlamaModel::from_dir` loads a real checkpoint):
//!
//! ```
//! use candle_attention::{argmax_ids, LlamaConfig, LlamaModel};
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//!
//! # fn main() -> candle_attention::Result<()> {
//! let cfg = LlamaConfig::from_json(
//!     r#"{"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
//!         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
//!         "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
//!         "max_position_embeddings": 128, "tie_word_embeddings": true}"#,
//! )?;
//! let (device, vm) = (Device::Cpu, VarMap::new());
//! let model = LlamaModel::load(VarBuilder::from_varmap(&vm, DType::F32, &device), &cfg)?;
//! let mut caches = model.new_caches(64); // one per layer, grown by doubling past 64
//! let prompt = Tensor::new(&[[1u32, 5, 9]], &device)?; // (batch, seq)
//! let mut next = argmax_ids(&model.forward_last(&prompt, &mut caches)?)?[0];
//! for _ in 0..8 {
//!     let step = Tensor::new(&[[next]], &device)?; // one token, positions from the cache
//!     next = argmax_ids(&model.forward_last(&step, &mut caches)?)?[0];
//! }
//! assert_eq!(caches[0].len(), 3 + 8);
//! # Ok(()) }
//! ```
//!
//! CPU kernels run on rayon's global pool (`RAYON_NUM_THREADS` threads). A call made from
//! outside the pool is handed over to it while the caller sleeps (~10-15 µs per call,
//! measured on a 2-core VM: ~4% of a sentence-scale layer). The models' forward calls
//! (`BertEncoder::forward`, `LlamaModel::forward` and `forward_last`) move onto the pool
//! themselves, once per call; a layer called on its own pays it per kernel. A
//! latency-bound program that calls from one thread can make that thread one of the pool's
//! workers once at start-up, as OpenMP does with its main thread, so that calls start and
//! end on it:
//!
//! ```no_run
//! # fn main() -> Result<(), rayon::ThreadPoolBuildError> {
//! // Once, before any rayon call (the global pool is built once).
//! rayon::ThreadPoolBuilder::new().use_current_thread().build_global()?;
//! # Ok(()) }
//! ```
//!
//! ```no_run
//! use candle_attention::{AttentionConfig, Checkpoint, MultiHeadSelfAttention, WeightLayout};
//! use candle_core::{DType, Device, Tensor};
//!
//! # fn main() -> candle_attention::Result<()> {
//! let device = Device::Cpu;
//! let ckpt = Checkpoint::open("weights/model.safetensors")?;
//! let vb = ckpt.var_builder(DType::F32, &device);
//! let cfg = AttentionConfig::new(WeightLayout::Bert, 12);
//! let attn = MultiHeadSelfAttention::load(vb.pp("encoder.layer.0.attention"), &cfg)?;
//! let x = Tensor::randn(0f32, 1., (1, 8, 384), &device)?;
//! let out = attn.forward_with_weights(&x, None)?;
//! assert_eq!(out.context.dims(), &[1, 8, 384]);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod attention;
mod device;
mod error;
mod kernels;
mod memory;
mod models;
mod text;
pub mod viz;
mod weights;

pub use attention::cost::{self_attention_cost, AttentionCost};
pub use attention::dispatch;
pub use attention::mask::{AttentionMask, MaskPart};
pub use attention::multi_head::MultiHeadSelfAttention;
pub use attention::output::AttentionOutput;
pub use attention::path::AttentionPath;
pub use attention::sdpa::{
    scaled_dot_product_attention, scaled_dot_product_attention_explicit,
    scaled_dot_product_attention_on, scaled_dot_product_attention_streamed, SdpaOptions,
};
pub use attention::single_head::SingleHeadSelfAttention;
pub use attention::softmax::masked_softmax;
pub use device::{parse_dtype, select_device};
pub use error::{Error, Result};
pub use kernels::attend::WeightsBlock;
pub use kernels::decode::quant_gemv::{int8_activations, set_int8_activations};
pub use kernels::quant::blocks::QuantType;
pub use memory::{attention_weights_bytes, available_memory_bytes, retain_freed_memory};
pub use models::architecture::Architecture;
pub use models::batching::{into_length_sorted_batches, length_sorted_batches, padding_tokens};
pub use models::bert::{l2_normalize, mean_pool, BertEncoder, BertLayer};
pub use models::decoder_family::{DecoderFamily, WindowRule};
pub use models::embedder::Embedder;
pub use models::encoder_family::{EncoderFamily, PositionIds};
pub use models::encoder_output::EncoderOutput;
pub use models::hidden_act::Activation;
pub use models::kv_cache::KvCache;
pub use models::llama::{argmax_ids, LlamaConfig, LlamaModel};
pub use models::pooling::{Pooling, PoolingMode};
pub use models::resolver::{
    default_model_dir, Model, ModelFiles, ModelResolver, DEFAULT_MODEL_NAME,
};
pub use models::rope::{RopeConfig, RopeLayout, RopeScaling, RotaryEmbedding};
pub use text::{ChatMessage, ChatTemplate, EncodedBatch, EncodedText, TextEncoder};
pub use weights::checkpoint::Checkpoint;
pub use weights::config::{AttentionConfig, HfConfig};
pub use weights::gguf::{GgufFile, GgufTensorInfo, GgufValue};
pub use weights::gguf_end_of_generation::END_OF_TURN_TEXTS;
pub use weights::layout::{LinearWeights, Projections, WeightLayout};

/// The README's code examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The guide's code examples (`docs/guide/`), compiled and run as doctests.
#[cfg(doctest)]
pub mod guide_doctests {
    /// `docs/guide/library.md`
    #[doc = include_str!("../docs/guide/library.md")]
    pub struct Library;
    /// `docs/guide/training.md`
    #[doc = include_str!("../docs/guide/training.md")]
    pub struct Training;
}
