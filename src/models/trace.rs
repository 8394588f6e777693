//! One forward kept for explanations ([`crate::viz::explain`]): what each layer's attention
//! read and the probabilities it computed, as nodes of candle's graph when gradients are
//! asked for (the gradient of a target with respect to every layer's probabilities).

use candle_core::{DType, Device, Tensor, Var};

use crate::error::Result;

/// What the models' `trace` returns for one sequence.
pub(crate) struct ForwardTrace {
    /// An encoder's last hidden states `(1, seq, hidden)`; a decoder's logits of the last
    /// position `(1, vocab)` f32.
    pub output: Tensor,
    /// Per layer, the attention probabilities `(1, heads, seq, seq)` f32.
    pub attentions: Vec<Tensor>,
    /// With gradients: per layer, the zero variable added to the probabilities where they
    /// multiply `V`, whose gradient is the gradient with respect to them (candle keeps the
    /// gradients of variables only).
    pub probes: Vec<Tensor>,
    /// Per layer, `‖f_h(x_j)‖` `(1, heads, seq)` (see
    /// [`crate::MultiHeadSelfAttention::value_output_norms`]), when asked for.
    pub value_norms: Vec<Tensor>,
}

/// What a trace computes beyond the forward.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TraceOptions {
    /// Make the first layer's input a variable, so that everything after it tracks
    /// gradients (the probabilities included).
    pub grad: bool,
    /// Each layer's value norms.
    pub value_norms: bool,
}

/// A zero variable of the attention probabilities' shape `(1, heads, seq, seq)` f32, when
/// `grad`.
pub(crate) fn probe(
    grad: bool,
    heads: usize,
    seq: usize,
    device: &Device,
) -> Result<Option<Tensor>> {
    if !grad {
        return Ok(None);
    }
    let var = Var::zeros((1, heads, seq, seq), DType::F32, device)?;
    Ok(Some(var.as_tensor().clone()))
}

/// `x` as the start of a graph when `grad` (a fresh variable holding its values).
pub(crate) fn graph_input(x: Tensor, grad: bool) -> Result<Tensor> {
    if grad {
        Ok(Var::from_tensor(&x.detach())?.as_tensor().clone())
    } else {
        Ok(x)
    }
}
