//! Which model a `config.json` describes: one of the encoder families
//! ([`EncoderFamily`]) or a LLaMA-family decoder, read from its `model_type` before anything
//! else, so that an architecture the crate does not implement is one error listing those it
//! does (not a missing field of another family's config).

use std::path::Path;

use crate::error::{Error, Result};
use crate::models::decoder_family::decoder_model_types;
use crate::models::encoder_family::{supported_model_types, EncoderFamily};
use crate::weights::config::read_config_file;

/// What a `config.json` describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// A post-norm encoder ([`crate::BertEncoder`]).
    Encoder(&'static EncoderFamily),
    /// A rotary pre-norm decoder ([`crate::LlamaModel`]: LLaMA, Mistral, Qwen2, Qwen3,
    /// Gemma 3, Phi-3).
    Decoder,
}

impl Architecture {
    /// The architecture of a `model_type` (`None`, as in old BERT configs: BERT).
    pub fn of_model_type(model_type: Option<&str>) -> Result<Self> {
        if let Ok(family) = EncoderFamily::of_model_type(model_type) {
            return Ok(Self::Encoder(family));
        }
        match model_type {
            Some(t) if decoder_model_types().contains(&t) => Ok(Self::Decoder),
            other => Err(Error::config(format!(
                "model_type `{}` is not supported; supported: encoders {}; decoders {}",
                other.unwrap_or("bert"),
                supported_model_types(),
                decoder_model_types().join(", ")
            ))),
        }
    }

    /// The architecture a `config.json` file describes.
    pub fn of_config_file(path: impl AsRef<Path>) -> Result<Self> {
        read_config_file(path.as_ref(), |text| {
            let raw: serde_json::Value =
                serde_json::from_str(text).map_err(|e| Error::config(e.to_string()))?;
            let model_type = match raw.get("model_type") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.as_str()),
                Some(other) => {
                    return Err(Error::config(format!(
                        "`model_type` must be a string, found {other}"
                    )))
                }
            };
            Self::of_model_type(model_type)
        })
    }

    /// Whether it is an encoder.
    pub fn is_encoder(&self) -> bool {
        matches!(self, Self::Encoder(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_architectures_list_the_supported_ones() -> Result<()> {
        assert_eq!(
            Architecture::of_model_type(Some("roberta"))?,
            Architecture::Encoder(&EncoderFamily::ROBERTA)
        );
        assert_eq!(
            Architecture::of_model_type(Some("qwen2"))?,
            Architecture::Decoder
        );
        let err = Architecture::of_model_type(Some("mamba"))
            .expect_err("not implemented")
            .to_string();
        assert!(
            err.contains("mamba") && err.contains("distilbert") && err.contains("mistral"),
            "{err}"
        );
        Ok(())
    }
}
