//! The feed-forward activations configs name (`hidden_act`, `hidden_activation`), shared by
//! the encoders and the decoders.

use candle_core::Tensor;

use crate::error::{Error, Result};

/// The feed-forward activations BERT-family configs name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `gelu`: the exact, erf-based GELU.
    Gelu,
    /// `gelu_new`, `gelu_pytorch_tanh`, `gelu_fast`: the tanh approximation.
    GeluTanh,
    /// `relu`
    Relu,
    /// `silu` / `swish`
    Silu,
}

impl Activation {
    /// Parses a config's `hidden_act`.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "gelu" => Ok(Self::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Self::GeluTanh),
            "relu" => Ok(Self::Relu),
            "silu" | "swish" => Ok(Self::Silu),
            other => Err(Error::config(format!("unsupported hidden_act `{other}`"))),
        }
    }

    pub(crate) fn apply(&self, xs: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Gelu => xs.gelu_erf()?,
            Self::GeluTanh => xs.gelu()?,
            Self::Relu => xs.relu()?,
            Self::Silu => xs.silu()?,
        })
    }
}
