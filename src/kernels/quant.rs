//! Quantized weights as ggml stores them (GGUF files): the block formats and their exact
//! dequantization ([`blocks`]).

pub(crate) mod blocks;
