//! The ids that end a generation for a GGUF file's vocabulary, as llama.cpp's
//! end-of-generation set has them (`llama_vocab_is_eog`, llama-cpp-python 0.3.36's): the ids
//! its metadata names, and the end-of-turn tokens it finds by their text (converters often
//! leave `tokenizer.ggml.eot_token_id` out). Its fill-in-the-middle tokens, which it also
//! stops at, are left out: they end an infill, not a turn.

use std::collections::BTreeSet;

use crate::weights::gguf::{GgufFile, GgufValue};

/// Metadata keys whose id ends a generation.
const END_KEYS: [&str; 3] = [
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
];

/// Token texts that end a turn or a text in the chat formats llama.cpp knows.
pub const END_OF_TURN_TEXTS: [&str; 20] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
];

impl GgufFile {
    /// The ids that end a generation, ascending: `tokenizer.ggml.{eos,eot,eom}_token_id`
    /// (those inside `tokenizer.ggml.tokens`, when the file has it), and the token of each
    /// text of [`END_OF_TURN_TEXTS`] in the vocabulary (the last of a repeated text, as
    /// llama.cpp's map from text to id keeps it); then llama.cpp's two exceptions: `<|end|>`
    /// is no end beside `<|return|>` and `<|call|>` (gpt-oss) or `<|call|>` / `<|calls|>`
    /// and `<|flush|>`, and `</s>` none beside `<|tool_response>` (Gemma 4). Empty for a
    /// file with neither ids nor such tokens.
    pub fn end_of_generation_ids(&self) -> Vec<u32> {
        let tokens: Option<Vec<&str>> = self
            .get("tokenizer.ggml.tokens")
            .and_then(GgufValue::as_array)
            .map(|t| t.iter().map(|v| v.as_str().unwrap_or_default()).collect());
        let in_vocab = |id: u64| tokens.as_ref().is_none_or(|t| id < t.len() as u64);
        let mut ids: BTreeSet<u32> = END_KEYS
            .iter()
            .filter_map(|k| self.get(k)?.as_u64())
            .filter(|&id| in_vocab(id))
            .filter_map(|id| u32::try_from(id).ok())
            .collect();
        let Some(tokens) = tokens else {
            return ids.into_iter().collect();
        };
        // The last id of each text (every one starts with `<`, `_` or `[`).
        let mut last: [Option<u32>; END_OF_TURN_TEXTS.len()] = [None; END_OF_TURN_TEXTS.len()];
        for (id, &t) in tokens.iter().enumerate() {
            if !matches!(t.as_bytes().first(), Some(b'<' | b'_' | b'[')) {
                continue;
            }
            if let Some(i) = END_OF_TURN_TEXTS.iter().position(|&e| e == t) {
                last[i] = u32::try_from(id).ok();
            }
        }
        ids.extend(last.into_iter().flatten());
        let text = |id: u32| tokens.get(id as usize).copied().unwrap_or_default();
        let has = |t: &str| ids.iter().any(|&id| text(id) == t);
        let call = has("<|call|>") || has("<|calls|>");
        let drop_end = call && (has("<|return|>") || has("<|flush|>"));
        let drop_s = has("<|tool_response>");
        ids.retain(|&id| {
            let t = text(id);
            let dropped = (drop_end && t == "<|end|>") || (drop_s && t == "</s>");
            !dropped
        });
        ids.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scan's first-byte filter lets every end-of-turn text through.
    #[test]
    fn every_text_starts_with_a_byte_the_scan_looks_at() {
        for t in END_OF_TURN_TEXTS {
            assert!(matches!(t.as_bytes()[0], b'<' | b'_' | b'['), "{t}");
        }
    }
}
