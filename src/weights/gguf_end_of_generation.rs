//! The ids that end a generation for a GGUF file's vocabulary, as llama.cpp's
//! end-of-generation set has them: the ids its metadata names, and the end-of-turn tokens
//! it finds by their text (converters often leave `tokenizer.ggml.eot_token_id` out).

use std::collections::BTreeSet;

use crate::weights::gguf::{GgufFile, GgufValue};

/// Metadata keys whose id ends a generation.
const END_KEYS: [&str; 3] = [
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
];

/// Token texts that end a turn or a text in the chat formats llama.cpp knows (its
/// `special_eog_ids` list; its fill-in-the-middle tokens are left out: they end an infill,
/// not a turn).
pub const END_OF_TURN_TEXTS: [&str; 9] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
];

impl GgufFile {
    /// The ids that end a generation, ascending: `tokenizer.ggml.{eos,eot,eom}_token_id`,
    /// and every token of `tokenizer.ggml.tokens` whose text is one of
    /// [`END_OF_TURN_TEXTS`]. Empty for a file with neither.
    pub fn end_of_generation_ids(&self) -> Vec<u32> {
        let mut ids: BTreeSet<u32> = END_KEYS
            .iter()
            .filter_map(|k| self.get(k)?.as_u64())
            .filter_map(|id| u32::try_from(id).ok())
            .collect();
        if let Some(tokens) = self
            .get("tokenizer.ggml.tokens")
            .and_then(GgufValue::as_array)
        {
            for (id, token) in tokens.iter().enumerate() {
                let is_end = token
                    .as_str()
                    .is_some_and(|t| END_OF_TURN_TEXTS.contains(&t));
                if let (true, Ok(id)) = (is_end, u32::try_from(id)) {
                    ids.insert(id);
                }
            }
        }
        ids.into_iter().collect()
    }
}
