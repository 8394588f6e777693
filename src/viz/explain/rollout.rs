//! Attention rollout (Abnar & Zuidema 2020): how much each output position draws from each
//! input token through every layer, following the attention and the residual stream.

use candle_core::{DType, Device, Tensor, D};

use crate::error::{Error, Result};

/// `R = Â_L ... Â_2 Â_1` with `Â_l = mean over heads of A_l, plus I`, each row divided by
/// its sum: row `i` of `R` is how much output position `i` draws from input token `j`
/// (rows sum to 1).
///
/// # Shapes
/// - `attentions`: one `(heads, seq, seq)` per layer, the first layer first
/// - returns: `(seq, seq)` f32
pub fn attention_rollout(attentions: &[Tensor]) -> Result<Tensor> {
    let mut rollout: Option<Tensor> = None;
    for a in attentions {
        let a_hat = with_residual(a)?;
        rollout = Some(match rollout {
            None => a_hat,
            Some(r) => a_hat.matmul(&r)?, // the later layer on the left
        });
    }
    rollout.ok_or_else(|| Error::input("attentions", "at least one layer", "none"))
}

/// `mean_h(A) + I`, rows normalised to sum 1.
///
/// # Shapes
/// - `a`: `(heads, seq, seq)`; returns `(seq, seq)` f32
fn with_residual(a: &Tensor) -> Result<Tensor> {
    let (_h, sq, sk) = a.dims3()?;
    if sq != sk {
        return Err(Error::input(
            "attentions",
            "square (heads, seq, seq) self-attention",
            format!("shape {:?}", a.dims()),
        ));
    }
    let mean = a.to_dtype(DType::F32)?.mean(0)?; // (seq, seq)
    let m = (mean + Tensor::eye(sq, DType::F32, a.device())?)?;
    let sums = m.sum_keepdim(D::Minus1)?;
    Ok(m.broadcast_div(&sums)?)
}

/// The `(n, n)` identity on the CPU in f32 (for callers building relevance).
pub(crate) fn identity(n: usize) -> Result<Tensor> {
    Ok(Tensor::eye(n, DType::F32, &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows sum to 1; one layer gives `(mean_h A + I) / 2` for row-stochastic `A`; the
    /// second layer multiplies on the left.
    #[test]
    fn rows_sum_to_one_and_layers_compose_on_the_left() -> Result<()> {
        let a1 = Tensor::new(
            &[
                [[1f32, 0., 0.], [0.5, 0.5, 0.], [0.2, 0.3, 0.5]],
                [[0., 1., 0.], [0., 1., 0.], [0., 0., 1.]],
            ],
            &Device::Cpu,
        )?;
        let a2 = Tensor::new(
            &[
                [[0.1f32, 0.2, 0.7], [0.3, 0.3, 0.4], [1., 0., 0.]],
                [[0.5, 0.5, 0.], [0., 0., 1.], [0.2, 0.2, 0.6]],
            ],
            &Device::Cpu,
        )?;
        let one = attention_rollout(std::slice::from_ref(&a1))?;
        let expected = ((a1.mean(0)? + identity(3)?)? * 0.5)?;
        let diff = (&one - &expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6);
        let two = attention_rollout(&[a1.clone(), a2.clone()])?;
        let want = ((a2.mean(0)? + identity(3)?)? * 0.5)?.matmul(&expected)?;
        let diff = (&two - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6);
        for row in two.to_vec2::<f32>()? {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
        assert!(attention_rollout(&[]).is_err());
        Ok(())
    }
}
