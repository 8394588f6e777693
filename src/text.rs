//! Text front-end on the `tokenizers` crate: sentences in, token ids, masks and the
//! token-level metadata (strings, character offsets, word ids) out.

use std::path::Path;

use candle_core::{Device, Tensor};
use tokenizers::{Tokenizer, TruncationParams};

use crate::error::{Error, Result};

mod chat;
mod token_text;

pub(crate) use chat::SPECIAL as SPECIAL_TOKENS;
pub use chat::{ChatMessage, ChatTemplate};
pub use token_text::display_label;

/// One encoded text (or text pair), before padding.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedText {
    /// The input text (the first text of a pair).
    pub text: String,
    /// Token ids, special tokens included.
    pub ids: Vec<u32>,
    /// Token strings (`[CLS]`, `the`, `##ing`, ...).
    pub tokens: Vec<String>,
    /// Each token's text as the tokenizer decodes it (` the`, `ing`; special tokens kept):
    /// concatenated, the decoded text of `ids`. Empty unless the encoder was asked for it
    /// ([`TextEncoder::with_token_text`]).
    pub token_text: Vec<String>,
    /// Segment of each token: 0 for the first text, 1 for the second of a pair.
    pub type_ids: Vec<u32>,
    /// Byte offsets `(start, end)` of each token in its text (`(0, 0)` for special tokens).
    pub offsets: Vec<(usize, usize)>,
    /// Index of the word each token belongs to (`None` for special tokens).
    pub word_ids: Vec<Option<u32>>,
    /// Whether each token is a special token.
    pub special: Vec<bool>,
}

impl EncodedText {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// A batch padded to its longest member.
///
/// # Shapes
/// - `input_ids`, `token_type_ids`: `(batch, seq)` u32
/// - `attention_mask`: `(batch, seq)` u8, 1 = real token, 0 = padding
#[derive(Debug, Clone)]
pub struct EncodedBatch {
    /// Token ids, padded with the tokenizer's pad id.
    pub input_ids: Tensor,
    /// Segment ids (0, and 1 for a pair's second text), padded with 0.
    pub token_type_ids: Tensor,
    /// 1 = real token, 0 = padding.
    pub attention_mask: Tensor,
    /// Each member unpadded.
    pub items: Vec<EncodedText>,
}

/// A `tokenizer.json` ready to encode sentences for a model with `max_positions` positions.
#[derive(Clone)]
pub struct TextEncoder {
    tokenizer: Tokenizer,
    max_positions: Option<usize>,
    truncate: bool,
    /// Whether encodings carry [`EncodedText::token_text`].
    token_text: bool,
    pad_id: u32,
    /// The ids of the special added tokens (`[CLS]`, `<|im_start|>`, ...).
    special_ids: std::collections::HashSet<u32>,
}

impl std::fmt::Debug for TextEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextEncoder")
            .field("max_positions", &self.max_positions)
            .field("truncate", &self.truncate)
            .finish()
    }
}

impl TextEncoder {
    /// Loads a `tokenizer.json`. The file's own padding and truncation settings are
    /// dropped: batches are padded to their longest member, and over-long texts are an
    /// error unless [`TextEncoder::with_truncation`] asks otherwise.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|cause| Error::Io {
            path: path.to_path_buf(),
            cause,
        })?;
        let tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| {
            Error::Tokenizer(format!(
                "{} is not a valid tokenizer.json: {e}",
                path.display()
            ))
        })?;
        Self::from_tokenizer(tokenizer)
    }

    /// Wraps a built tokenizer (padding and truncation dropped, as for a file).
    pub(crate) fn from_tokenizer(mut tokenizer: Tokenizer) -> Result<Self> {
        let pad_id = tokenizer
            .get_padding()
            .map(|p| p.pad_id)
            .or_else(|| tokenizer.token_to_id("[PAD]"))
            .or_else(|| tokenizer.token_to_id("<pad>"))
            .unwrap_or(0);
        tokenizer
            .with_truncation(None)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        tokenizer.with_padding(None);
        let special_ids = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        Ok(Self {
            tokenizer,
            max_positions: None,
            truncate: false,
            token_text: false,
            pad_id,
            special_ids,
        })
    }

    /// Whether encodings carry each token's decoded text ([`EncodedText::token_text`]; off
    /// by default: it decodes every prefix of the ids, about a tenth of a small encoder's
    /// forward, which sentence embeddings do without).
    pub fn with_token_text(mut self, on: bool) -> Self {
        self.token_text = on;
        self
    }

    /// [`TextEncoder::with_token_text`] on a held encoder.
    pub fn set_token_text(&mut self, on: bool) {
        self.token_text = on;
    }

    /// The model's position table size: longer encodings are an error (or truncated).
    pub fn with_max_positions(mut self, max_positions: usize) -> Result<Self> {
        self.max_positions = Some(max_positions);
        self.configure_truncation()?;
        Ok(self)
    }

    /// Truncate encodings to the model's positions instead of failing.
    pub fn with_truncation(mut self, truncate: bool) -> Result<Self> {
        self.truncate = truncate;
        self.configure_truncation()?;
        Ok(self)
    }

    fn configure_truncation(&mut self) -> Result<()> {
        let params = match (self.truncate, self.max_positions) {
            (true, Some(max)) => Some(TruncationParams {
                max_length: max,
                ..Default::default()
            }),
            _ => None,
        };
        self.tokenizer
            .with_truncation(params)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(())
    }

    /// The underlying `tokenizers::Tokenizer`.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Encodes one text with special tokens.
    pub fn encode(&self, text: &str) -> Result<EncodedText> {
        self.encode_inner(text, None, true)
    }

    /// Encodes one text with no special tokens added: a chat template's output
    /// ([`ChatTemplate::render`]), which writes its own (those in the text are still read
    /// as the tokens they name).
    pub fn encode_as_is(&self, text: &str) -> Result<EncodedText> {
        self.encode_inner(text, None, false)
    }

    /// Encodes a sentence pair (`[CLS] a [SEP] b [SEP]`, `type_ids` 0 then 1).
    pub fn encode_pair(&self, a: &str, b: &str) -> Result<EncodedText> {
        self.encode_inner(a, Some(b), true)
    }

    /// Encodes several texts and pads them to the longest.
    pub fn encode_batch(&self, texts: &[&str], device: &Device) -> Result<EncodedBatch> {
        let items = texts
            .iter()
            .map(|t| self.encode(t))
            .collect::<Result<Vec<_>>>()?;
        self.pad(items, device)
    }

    /// Encodes several sentence pairs and pads them to the longest.
    pub fn encode_pair_batch(
        &self,
        pairs: &[(&str, &str)],
        device: &Device,
    ) -> Result<EncodedBatch> {
        let items = pairs
            .iter()
            .map(|(a, b)| self.encode_pair(a, b))
            .collect::<Result<Vec<_>>>()?;
        self.pad(items, device)
    }

    /// Pads encoded texts to the longest one.
    pub fn pad(&self, items: Vec<EncodedText>, device: &Device) -> Result<EncodedBatch> {
        if items.is_empty() {
            return Err(Error::Tokenizer("no text to encode".to_string()));
        }
        let b = items.len();
        let t = items.iter().map(EncodedText::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(b * t);
        let mut types = Vec::with_capacity(b * t);
        let mut mask = Vec::with_capacity(b * t);
        for item in &items {
            let pad = t - item.len();
            ids.extend(
                item.ids
                    .iter()
                    .copied()
                    .chain(std::iter::repeat_n(self.pad_id, pad)),
            );
            types.extend(
                item.type_ids
                    .iter()
                    .copied()
                    .chain(std::iter::repeat_n(0, pad)),
            );
            mask.extend(std::iter::repeat_n(1u8, item.len()).chain(std::iter::repeat_n(0, pad)));
        }
        Ok(EncodedBatch {
            input_ids: Tensor::from_vec(ids, (b, t), device)?,
            token_type_ids: Tensor::from_vec(types, (b, t), device)?,
            attention_mask: Tensor::from_vec(mask, (b, t), device)?,
            items,
        })
    }

    fn encode_inner(&self, text: &str, pair: Option<&str>, special: bool) -> Result<EncodedText> {
        for t in std::iter::once(text).chain(pair) {
            if t.trim().is_empty() {
                return Err(Error::Tokenizer(if t.is_empty() {
                    "the text is empty".to_string()
                } else {
                    "the text holds only whitespace".to_string()
                }));
            }
        }
        let tokenizer = &self.tokenizer;
        let enc = match pair {
            None => tokenizer.encode(text, special),
            Some(b) => tokenizer.encode((text, b), special),
        }
        .map_err(|e| Error::Tokenizer(format!("cannot encode {text:?}: {e}")))?;
        if let Some(max) = self.max_positions {
            if enc.len() > max {
                return Err(Error::SequenceTooLong {
                    len: enc.len(),
                    max,
                });
            }
        }
        let ids = enc.get_ids();
        let token_text = match self.token_text {
            true => token_text::token_texts(ids.len(), |k| {
                tokenizer
                    .decode(&ids[..k], false)
                    .map_err(|e| Error::Tokenizer(format!("cannot decode {text:?}'s tokens: {e}")))
            })?,
            false => Vec::new(),
        };
        Ok(EncodedText {
            text: text.to_string(),
            ids: ids.to_vec(),
            tokens: enc.get_tokens().to_vec(),
            token_text,
            type_ids: enc.get_type_ids().to_vec(),
            offsets: enc.get_offsets().to_vec(),
            word_ids: enc.get_word_ids().to_vec(),
            // The tokens the tokenizer adds, and the special added tokens read from the text
            // (a chat template writes its own, which the mask alone leaves out).
            special: enc
                .get_special_tokens_mask()
                .iter()
                .zip(enc.get_ids())
                .map(|(&s, id)| s == 1 || self.special_ids.contains(id))
                .collect(),
        })
    }
}
