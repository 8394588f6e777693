//! The tokenizer a GGUF file describes in its metadata (`tokenizer.ggml.*`), built as the
//! `tokenizer.json` transformers builds from the same file (`gguf_file=`), so that a prompt
//! gets the same ids: a byte-level BPE (`tokenizer.ggml.model = gpt2`: GPT-2, SmolLM,
//! Qwen2, LLaMA-3 vocabularies) with the file's merges; GPT-2's split, or the split of the
//! vocabulary family `tokenizer.ggml.pre` names where transformers knows one; the tokens the
//! file marks as control as special added tokens, the user-defined ones as added tokens;
//! BOS first when `tokenizer.ggml.add_bos_token` says so. Or a SentencePiece BPE
//! (`tokenizer.ggml.model = llama`: LLaMA-1/2, Mistral, TinyLlama vocabularies), as
//! transformers' `LlamaTokenizer`, with the file's merges or the ones its scores imply; for
//! a Gemma file (`general.architecture` `gemma`, `gemma2`, `gemma3`), as its
//! `GemmaTokenizer`.

use ahash::AHashMap;
use serde_json::{json, Map, Value};

use tokenizers::Tokenizer;

use crate::error::{Error, Result};
use crate::text::TextEncoder;
use crate::weights::gguf::{GgufFile, GgufValue};

impl TextEncoder {
    /// The tokenizer a GGUF file describes in its metadata, built as transformers builds it
    /// from the same file (`gguf_file=`): byte-level BPE vocabularies (`tokenizer.ggml.model`
    /// `gpt2`) and SentencePiece BPE ones (`llama`); others are an [`Error::UnsupportedGguf`].
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
    let invalid = |reason: String| Error::InvalidGguf {
        path: file.path().to_path_buf(),
        reason,
    };
    let model = file.require_str("tokenizer.ggml.model")?;
    if model != "gpt2" && model != "llama" {
        return Err(Error::UnsupportedGguf {
            path: file.path().to_path_buf(),
            what: format!("tokenizer model `{model}` (tokenizer.ggml.model)"),
            supported: "gpt2 (byte-level BPE), llama (SentencePiece BPE)".to_string(),
        });
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
        Some(_) => Some(strings("tokenizer.ggml.merges")?),
        None => None,
    };
    let types: Vec<i64> = match file.get("tokenizer.ggml.token_type") {
        Some(GgufValue::Array(a)) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        _ => Vec::new(),
    };
    let merge_pair = |m: &&str| match m.split_once(' ') {
        Some((a, b)) => Ok(json!([a, b])),
        None => Err(invalid(format!("merge `{m}` is not two tokens"))),
    };
    let special_id = |key: &str| -> Result<Option<(u64, &str)>> {
        match file.get(key).and_then(GgufValue::as_u64) {
            Some(id) => match tokens.get(id as usize) {
                Some(t) => Ok(Some((id, *t))),
                None => Err(invalid(format!("{key} {id} is outside the vocabulary"))),
            },
            None => Ok(None),
        }
    };
    let bos = special_id("tokenizer.ggml.bos_token_id")?;
    let flag = |key: &str| file.get(key).and_then(GgufValue::as_bool);
    let arch = file.get("general.architecture").and_then(GgufValue::as_str);
    let (parts, add_bos) =
        if model == "llama" && matches!(arch, Some("gemma" | "gemma2" | "gemma3")) {
            let file_merges: Option<Vec<Value>> = merges
                .as_ref()
                .map(|m| m.iter().map(merge_pair).collect::<Result<_>>())
                .transpose()?;
            let named = [
                special_id("tokenizer.ggml.unknown_token_id")?,
                bos,
                special_id("tokenizer.ggml.eos_token_id")?,
                special_id("tokenizer.ggml.padding_token_id")?,
            ];
            (
                gemma(&tokens, &types, file_merges, &named),
                flag("tokenizer.ggml.add_bos_token").unwrap_or(true),
            )
        } else if model == "gpt2" {
            let merges = merges.ok_or_else(|| Error::UnsupportedGguf {
                path: file.path().to_path_buf(),
                what: "a byte-level vocabulary without `tokenizer.ggml.merges`".into(),
                supported: String::new(),
            })?;
            let merges: Vec<Value> = merges.iter().map(merge_pair).collect::<Result<_>>()?;
            let pre = file.get("tokenizer.ggml.pre").and_then(GgufValue::as_str);
            (
                byte_level(&tokens, &types, merges, pre),
                flag("tokenizer.ggml.add_bos_token").unwrap_or(false),
            )
        } else {
            let merges: Vec<Value> = match merges {
                Some(m) => m.iter().map(merge_pair).collect::<Result<_>>()?,
                None => {
                    let scores: Vec<f64> = match file.get("tokenizer.ggml.scores") {
                        Some(GgufValue::Array(a)) => {
                            a.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect()
                        }
                        _ => return Err(invalid(
                            "a SentencePiece vocabulary without `tokenizer.ggml.scores` or merges"
                                .into(),
                        )),
                    };
                    merges_from_scores(&tokens, &scores)
                        .into_iter()
                        .map(|(a, b)| json!([a, b]))
                        .collect()
                }
            };
            let named = [
                special_id("tokenizer.ggml.unknown_token_id")?,
                bos,
                special_id("tokenizer.ggml.eos_token_id")?,
            ];
            let mut parts = sentencepiece(&tokens, &types, merges, &named);
            if arch == Some("phi3") {
                // transformers' `phi3_tokenizer`: the prefix and the spaces by the normalizer.
                parts.normalizer = json!({"type": "Sequence", "normalizers": [
                    {"type": "Prepend", "prepend": "\u{2581}"},
                    {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
                ]});
                parts.pre_tokenizer = Value::Null;
            }
            // transformers' GGUF loader adds BOS to a SentencePiece vocabulary that does not say.
            (parts, flag("tokenizer.ggml.add_bos_token").unwrap_or(true))
        };
    let post_processor = match (add_bos, bos) {
        (true, Some((id, bos))) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [id], "tokens": [bos]}},
        }),
        _ => Value::Null,
    };
    let Parts {
        added,
        normalizer,
        pre_tokenizer,
        decoder,
        model,
    } = parts;
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": decoder,
        "model": model,
    }))
}

/// The parts of a `tokenizer.json` that depend on the vocabulary's kind.
struct Parts {
    added: Vec<Value>,
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    model: Value,
}

/// A SentencePiece vocabulary's added tokens: the control and `named` ones special, the
/// user-defined ones that `keep` accepts not.
fn sentencepiece_added(
    tokens: &[&str],
    types: &[i64],
    named: &[Option<(u64, &str)>],
    keep: impl Fn(&str) -> bool,
) -> Vec<Value> {
    let mut added = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        let kind = types.get(id).copied().unwrap_or(1);
        let is_named = named.iter().flatten().any(|&(n, _)| n as usize == id);
        if kind == CONTROL || is_named {
            added.push(added_token(id, t, true));
        } else if kind == USER_DEFINED && keep(t) {
            added.push(added_token(id, t, false));
        }
    }
    added
}

fn added_token(id: usize, content: &str, special: bool) -> Value {
    json!({
        "id": id, "content": content, "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": special,
    })
}

/// A byte-level BPE (`gpt2`): tokens spelled in GPT-2's byte alphabet, GPT-2's split or the
/// family's `pre`.
fn byte_level(tokens: &[&str], types: &[i64], merges: Vec<Value>, pre: Option<&str>) -> Parts {
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
    let mut added = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        let kind = types.get(id).copied().unwrap_or(1);
        // A control token spelled outside the byte alphabet is a llama.cpp mislabel that
        // transformers skips.
        let special = kind == CONTROL && t.chars().all(|c| alphabet.contains(&c));
        let user = kind == USER_DEFINED && vocab.contains_key(*t);
        if special || user {
            added.push(added_token(id, t, special));
        }
    }
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let pre_tokenizer = match pre.and_then(split_of) {
        Some(split) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]}),
        None => byte_level(true),
    };
    Parts {
        added,
        normalizer: Value::Null,
        pre_tokenizer,
        decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        model: json!({
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        }),
    }
}

/// A SentencePiece BPE (`llama`), as transformers' `LlamaTokenizer` builds it: the tokens
/// as spelled, `▁` for spaces with one prepended to the text (Metaspace, "first"), byte
/// fallback for characters outside the vocabulary (the model has no unknown token: every
/// byte has one); `named` (unknown, BOS, EOS) and the control tokens special, the
/// user-defined ones added.
fn sentencepiece(
    tokens: &[&str],
    types: &[i64],
    merges: Vec<Value>,
    named: &[Option<(u64, &str)>],
) -> Parts {
    let mut vocab = Map::new();
    for (id, t) in tokens.iter().enumerate() {
        vocab.insert(t.to_string(), json!(id));
    }
    Parts {
        added: sentencepiece_added(tokens, types, named, |_| true),
        normalizer: Value::Null,
        pre_tokenizer: json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false}),
        decoder: json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]}),
        model: json!({
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        }),
    }
}

/// Gemma's vocabulary as transformers' GGUF loader builds it (its `gemma_tokenizer` and
/// `GemmaTokenizer`): runs of spaces respelled as runs of `▁`, spaces turned into `▁` by
/// the normalizer (no prefix), a BPE whose merges, where the file has none, are every split
/// of every token ordered by the token's position (not its score), `<unk>` as the unknown
/// token, byte fallback; control tokens and the `named` ones special, user-defined ones added
/// (looked up in their stored spelling).
fn gemma(
    tokens: &[&str],
    types: &[i64],
    merges: Option<Vec<Value>>,
    named: &[Option<(u64, &str)>],
) -> Parts {
    // Python's `str.strip()` whitespace: Unicode's and the separators U+001C..U+001F.
    let blank = |t: &str| {
        t.chars()
            .all(|c| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
    };
    let respelled: Vec<String> = tokens
        .iter()
        .map(|t| match t.contains(' ') && blank(t) {
            true => "\u{2581}".repeat(t.chars().count()),
            false => t.to_string(),
        })
        .collect();
    let mut vocab = Map::new();
    for (id, t) in respelled.iter().enumerate() {
        vocab.insert(t.clone(), json!(id));
    }
    let merges = merges.unwrap_or_else(|| {
        let spelled: Vec<&str> = respelled.iter().map(String::as_str).collect();
        let by_position: Vec<f64> = (0..spelled.len()).map(|i| -(i as f64)).collect();
        merges_from_scores(&spelled, &by_position)
            .into_iter()
            .map(|(a, b)| json!([a, b]))
            .collect()
    });
    // A user-defined token is looked up in its stored spelling (respelled ones drop out).
    let added = sentencepiece_added(tokens, types, named, |t| vocab.contains_key(t));
    Parts {
        added,
        normalizer: json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}),
        pre_tokenizer: json!({"type": "Split", "pattern": {"String": " "},
                              "behavior": "MergedWithPrevious", "invert": false}),
        decoder: json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]}),
        model: json!({
            "type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        }),
    }
}

/// The merges a SentencePiece vocabulary implies, as transformers derives them for a file
/// without `tokenizer.ggml.merges` (`generate_merges` with the scores): every split of every
/// token into two tokens of the vocabulary, each token's splits by the ids of their halves,
/// then all by score, longer left and right halves first, stably.
fn merges_from_scores<'a>(tokens: &[&'a str], scores: &[f64]) -> Vec<(&'a str, &'a str)> {
    // Python dicts: a repeated token keeps its first position and its last id and score.
    let mut order: Vec<&str> = Vec::new();
    let mut id: AHashMap<&str, usize> = AHashMap::with_capacity(tokens.len());
    let mut score: AHashMap<&str, f64> = AHashMap::with_capacity(tokens.len());
    for (i, &t) in tokens.iter().enumerate() {
        if id.insert(t, i).is_none() {
            order.push(t);
        }
        score.insert(t, scores.get(i).copied().unwrap_or(0.0));
    }
    // (left, right, score, left's and right's lengths in characters).
    let mut merges: Vec<(&str, &str, f64, usize, usize)> = Vec::new();
    for &t in &order {
        let (s, total) = (score[t], t.chars().count());
        let mut local: Vec<(usize, usize, &str, &str, usize)> = t
            .char_indices()
            .skip(1)
            .enumerate()
            .filter_map(|(n, (k, _))| {
                let (l, r) = (&t[..k], &t[k..]);
                Some((*id.get(l)?, *id.get(r)?, l, r, n + 1))
            })
            .collect();
        local.sort_unstable_by_key(|&(il, ir, ..)| (il, ir));
        merges.extend(
            local
                .into_iter()
                .map(|(_, _, l, r, lc)| (l, r, s, lc, total - lc)),
        );
    }
    // Descending and stable, as Python's `sorted(..., reverse=True)`.
    merges.sort_by(|a, b| b.2.total_cmp(&a.2).then(b.3.cmp(&a.3)).then(b.4.cmp(&a.4)));
    merges.into_iter().map(|(l, r, ..)| (l, r)).collect()
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
