//! Gradient-weighted relevance (Chefer, Gur & Wolf, ICCV 2021, the generic rule for
//! self-attention): the attention weighted by how much a target's gradient says it matters,
//! propagated through the layers with the residual stream.

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};
use crate::viz::explain::rollout::identity;

/// `R = I`; for each layer from the first to the last, `Ā = mean over heads of
/// max(0, G ⊙ A)` and `R ← R + Ā R`, where `A` are the layer's attention probabilities and
/// `G = dy/dA` the gradient of a scalar target `y`. Row `i` of `R` is how much input token
/// `j` contributes to position `i`'s representation (the identity is each token's own).
///
/// # Shapes
/// - `attentions`, `grads`: one `(heads, seq, seq)` per layer each, the first layer first
/// - returns: `(seq, seq)` f32 on the CPU
pub fn gradient_relevance(attentions: &[Tensor], grads: &[Tensor]) -> Result<Tensor> {
    if attentions.is_empty() || attentions.len() != grads.len() {
        return Err(Error::input(
            "grads",
            format!("one per layer ({} layers)", attentions.len()),
            format!("{}", grads.len()),
        ));
    }
    let (_, seq, _) = attentions[0].dims3()?;
    let mut r = identity(seq)?;
    for (a, g) in attentions.iter().zip(grads) {
        if a.dims() != g.dims() || a.dims() != [a.dim(0)?, seq, seq] {
            return Err(Error::input(
                "grads",
                format!("the shape of the attention, (heads, {seq}, {seq})"),
                format!("{:?} and {:?}", a.dims(), g.dims()),
            ));
        }
        let (a, g) = (
            a.to_dtype(DType::F32)?.to_device(r.device())?,
            g.to_dtype(DType::F32)?.to_device(r.device())?,
        );
        let a_bar = (g * a)?.relu()?.mean(0)?; // (seq, seq)
        r = (&r + a_bar.matmul(&r)?)?;
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// One layer: `I + Ā`; negative products count as zero; two layers compose.
    #[test]
    fn one_layer_is_identity_plus_the_positive_mean() -> Result<()> {
        let a = Tensor::new(
            &[[[0.6f32, 0.4], [0.3, 0.7]], [[1., 0.], [0.5, 0.5]]],
            &Device::Cpu,
        )?;
        let g = Tensor::new(
            &[[[1f32, -1.], [2., 0.5]], [[-3., 4.], [1., 1.]]],
            &Device::Cpu,
        )?;
        let r = gradient_relevance(std::slice::from_ref(&a), std::slice::from_ref(&g))?;
        // max(0, g * a) per head, then the mean: [[0.3, 0], [0.55, 0.425]].
        let want = [[1.3f32, 0.0], [0.55, 1.425]];
        for (row, w) in r.to_vec2::<f32>()?.iter().zip(want) {
            for (x, y) in row.iter().zip(w) {
                assert!((x - y).abs() < 1e-6, "{x} vs {y}");
            }
        }
        let two = gradient_relevance(&[a.clone(), a.clone()], &[g.clone(), g.clone()])?;
        let a_bar = Tensor::new(&[[0.3f32, 0.0], [0.55, 0.425]], &Device::Cpu)?;
        let want = (&r + a_bar.matmul(&r)?)?;
        assert!((two - want)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
        assert!(gradient_relevance(&[a], &[]).is_err());
        Ok(())
    }
}
