//! Assemblies of the crate's attention with candle-nn: the BERT encoder ([`bert`]) and its
//! sentence embeddings ([`embedder`], [`batching`]), the LLaMA-family decoder ([`llama`])
//! with rotary embeddings ([`rope`]) and its cache ([`kv_cache`]), and where a model's
//! files come from ([`resolver`]: a directory or the Hugging Face hub).

pub(crate) mod architecture;
pub(crate) mod batching;
pub(crate) mod bert;
pub(crate) mod decode_step;
pub(crate) mod decoder_family;
pub(crate) mod embedder;
pub(crate) mod encoder_family;
pub(crate) mod encoder_output;
pub(crate) mod hidden_act;
pub(crate) mod kv_cache;
pub(crate) mod llama;
pub(crate) mod modern_bert;
pub(crate) mod pooling;
pub(crate) mod resolver;
pub(crate) mod rope;
pub(crate) mod trace;
