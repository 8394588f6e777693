//! The tokenizer a GGUF file describes in its metadata (`tokenizer.ggml.*`), built as the
//! `tokenizer.json` transformers builds from the same file (`gguf_file=`), so that a prompt
//! gets the same ids: a byte-level BPE (`tokenizer.ggml.model = gpt2`: GPT-2, SmolLM,
//! Qwen2, LLaMA-3 vocabularies) with the file's merges; GPT-2's split, or the split of the
//! vocabulary family `tokenizer.ggml.pre` names where transformers knows one; the tokens the
//! file marks as control as special added tokens, the user-defined ones as added tokens;
//! BOS first when `tokenizer.ggml.add_bos_token` says so.

use serde_json::{json, Map, Value};

use tokenizers::Tokenizer;

use crate::error::{Error, Result};
use crate::text::TextEncoder;
use crate::weights::gguf::{GgufFile, GgufValue};

impl TextEncoder {
    /// The tokenizer a GGUF file describes in its metadata, built as transformers builds it
    /// from the same file (`gguf_file=`): byte-level BPE vocabularies (`tokenizer.ggml.model`
    /// `gpt2`); others are an [`Error::UnsupportedGguf`].
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let json = tokenizer_json(file)?;
        let tokenizer = Tokenizer::from_bytes(json.to_string().as_bytes()).map_err(|e| {
            Error::Tokenizer(format!(
                "the tokenizer of {} does not build: {e}",
                file.path().display()
            ))
        })?;
        Self::from_tokenizer(tokenizer)
    }
}

/// GGUF token types (llama.cpp's `llama_token_type`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split of a `tokenizer.ggml.pre` family, as transformers' GGUF loader maps it
/// (`GGUF_PRE_TOKENIZER_SPLITS`); `None`: GPT-2's byte-level split.
fn split_of(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "qwen35" => QWEN35_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

/// GPT-2's byte-to-character map (`bytes_to_unicode`): printable bytes stand for
/// themselves, the others for the characters from U+0100 on.
fn byte_chars() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            next += 1;
            next - 1
        };
        map[b as usize] = char::from_u32(c).unwrap_or('\u{FFFD}');
    }
    map
}

/// The `tokenizer.json` document of the file's tokenizer.
pub(crate) fn tokenizer_json(file: &GgufFile) -> Result<Value> {
    let unsupported = |what: String, supported: &str| Error::UnsupportedGguf {
        path: file.path().to_path_buf(),
        what,
        supported: supported.to_string(),
    };
    let invalid = |reason: String| Error::InvalidGguf {
        path: file.path().to_path_buf(),
        reason,
    };
    let model = file.require_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(unsupported(
            format!("tokenizer model `{model}` (tokenizer.ggml.model)"),
            "gpt2 (byte-level BPE)",
        ));
    }
    let strings = |key: &str| -> Result<Vec<&str>> {
        let arr = file
            .require(key)?
            .as_array()
            .ok_or_else(|| invalid(format!("`{key}` should be an array of strings")))?;
        arr.iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| invalid(format!("`{key}` holds a {}", v.type_name())))
            })
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = match file.get("tokenizer.ggml.merges") {
        Some(_) => strings("tokenizer.ggml.merges")?,
        None => {
            return Err(unsupported(
                "a byte-level vocabulary without `tokenizer.ggml.merges`".into(),
                "",
            ))
        }
    };
    let types: Vec<i64> = match file.get("tokenizer.ggml.token_type") {
        Some(GgufValue::Array(a)) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        _ => Vec::new(),
    };
    let chars = byte_chars();
    let alphabet: std::collections::HashSet<char> = chars.iter().copied().collect();
    let spell = |t: &str| -> String {
        if t.chars().all(|c| alphabet.contains(&c)) {
            t.to_string()
        } else {
            t.bytes().map(|b| chars[b as usize]).collect()
        }
    };
    let mut vocab = Map::new();
    for (id, t) in tokens.iter().enumerate() {
        vocab.insert(spell(t), json!(id));
    }
    let merges: Vec<Value> = merges
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok(json!([a, b])),
            None => Err(invalid(format!("merge `{m}` is not two tokens"))),
        })
        .collect::<Result<_>>()?;
    let mut added = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        let kind = types.get(id).copied().unwrap_or(1);
        // A control token spelled outside the byte alphabet is a llama.cpp mislabel that
        // transformers skips.
        let special = kind == CONTROL && t.chars().all(|c| alphabet.contains(&c));
        let user = kind == USER_DEFINED && vocab.contains_key(*t);
        if special || user {
            added.push(json!({
                "id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special,
            }));
        }
    }
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let pre = file.get("tokenizer.ggml.pre").and_then(GgufValue::as_str);
    let pre_tokenizer = match pre.and_then(split_of) {
        Some(split) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]}),
        None => byte_level(true),
    };
    let add_bos = file
        .get("tokenizer.ggml.add_bos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(false);
    let post_processor = match (
        add_bos,
        file.get("tokenizer.ggml.bos_token_id")
            .and_then(GgufValue::as_u64),
    ) {
        (true, Some(id)) => {
            let bos = tokens
                .get(id as usize)
                .ok_or_else(|| invalid(format!("bos token id {id} is outside the vocabulary")))?;
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {*bos: {"id": bos, "ids": [id], "tokens": [bos]}},
            })
        }
        _ => Value::Null,
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_alphabet_is_gpt2s() {
        let c = byte_chars();
        assert_eq!(c[b'A' as usize], 'A');
        assert_eq!(c[b' ' as usize], '\u{120}'); // 'Ġ'
        assert_eq!(c[b'\n' as usize], '\u{10A}'); // 'Ċ'
        assert_eq!(c[0], '\u{100}');
        let distinct: std::collections::HashSet<char> = c.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}
