//! Everything named after a file on disk: safetensors checkpoints with loud errors
//! ([`checkpoint`]), the renaming of each checkpoint layout's tensors ([`layout`]), GPT-2's
//! and GPT-NeoX's checkpoints under LLaMA's names ([`decoder_names`]),
//! `config.json` as is ([`config`]), GGUF files with their metadata and quantized tensors
//! ([`gguf`]) and a LLaMA-family file under the Hugging Face names ([`gguf_layout`]) with
//! its tokenizer ([`gguf_tokenizer`]), chat template ([`gguf_chat_template`]) and the ids
//! that end a generation ([`gguf_end_of_generation`]), a file's bytes on 2 MB pages
//! ([`huge_pages`]), the
//! form a loaded projection is kept in for the device that multiplies by it ([`stored`]),
//! and a GGUF weight kept in its blocks ([`quantized`]; on CUDA, one row times its blocks
//! by candle's f32-activation kernels: `cuda_gemv`, with the `cuda` feature).

pub(crate) mod checkpoint;
pub(crate) mod config;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_gemv;
pub(crate) mod decoder_names;
pub(crate) mod gguf;
pub(crate) mod gguf_chat_template;
pub(crate) mod gguf_end_of_generation;
pub(crate) mod gguf_layout;
pub(crate) mod gguf_tokenizer;
pub(crate) mod huge_pages;
pub(crate) mod layout;
pub(crate) mod quantized;
pub(crate) mod stored;
