//! Quantized weights as ggml stores them (GGUF files): the block formats and their exact
//! dequantization ([`blocks`]), and their integers with a scale and offset per group
//! ([`integer_form`]).

pub(crate) mod activations;
pub(crate) mod blocks;
pub(crate) mod integer_form;
pub(crate) mod row_kinds;
