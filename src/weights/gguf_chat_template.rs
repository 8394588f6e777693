//! The chat template a GGUF file carries (`tokenizer.chat_template`), with the special
//! tokens its vocabulary names (`tokenizer.ggml.*_token_id`).

use crate::error::{Error, Result};
use crate::text::{ChatTemplate, SPECIAL_TOKENS};
use crate::weights::gguf::GgufFile;

impl ChatTemplate {
    /// The template of a GGUF file (`tokenizer.chat_template`) with the tokens at its
    /// `tokenizer.ggml.{bos,eos,unknown,padding}_token_id` as the special tokens; `None`
    /// when the file has no template.
    pub fn from_gguf(file: &GgufFile) -> Result<Option<Self>> {
        let Some(value) = file.get("tokenizer.chat_template") else {
            return Ok(None);
        };
        let invalid = |reason: String| Error::InvalidGguf {
            path: file.path().to_path_buf(),
            reason,
        };
        let source = value.as_str().ok_or_else(|| {
            invalid(format!(
                "metadata `tokenizer.chat_template` is a {}, not a string",
                value.type_name()
            ))
        })?;
        let mut t = ChatTemplate::new(source)?;
        let tokens = file.get("tokenizer.ggml.tokens").and_then(|v| v.as_array());
        for (name, key) in SPECIAL_TOKENS
            .iter()
            .zip(["bos", "eos", "unknown", "padding"])
        {
            let Some(id) = file
                .get(&format!("tokenizer.ggml.{key}_token_id"))
                .and_then(|v| v.as_u64())
            else {
                continue;
            };
            let token = tokens
                .and_then(|t| t.get(usize::try_from(id).ok()?))
                .and_then(|v| v.as_str())
                .ok_or_else(|| {
                    invalid(format!(
                        "`tokenizer.ggml.{key}_token_id` {id} names no token of `tokenizer.ggml.tokens`"
                    ))
                })?;
            t = t.with_special_token(name, token);
        }
        Ok(Some(t))
    }
}
