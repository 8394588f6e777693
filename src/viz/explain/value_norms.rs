//! Attention weighted by what each key carries (Kobayashi et al. 2020): `‖α_ij f_h(x_j)‖`,
//! how much key `j` actually moves query `i` in head `h`. Heads that park their weight on
//! `[CLS]` or `[SEP]` move little, because those tokens' transformed values are small.

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// `‖α_ij f_h(x_j)‖ = α_ij ‖f_h(x_j)‖` for every head, query and key (zero wherever the
/// weight is, masked keys included).
///
/// # Shapes
/// - `attentions`: `(heads, seq_q, seq_k)`, `value_norms`: `(heads, seq_k)` (see
///   [`crate::MultiHeadSelfAttention::value_output_norms`])
/// - returns: `(heads, seq_q, seq_k)` f32
pub fn weighted_value_norms(attentions: &Tensor, value_norms: &Tensor) -> Result<Tensor> {
    let (h, _, sk) = attentions.dims3()?;
    if value_norms.dims() != [h, sk] {
        return Err(Error::input(
            "value_norms",
            format!("(heads, seq_k) = ({h}, {sk})"),
            format!("{:?}", value_norms.dims()),
        ));
    }
    let n = value_norms.to_dtype(DType::F32)?.unsqueeze(1)?; // (h, 1, sk)
    Ok(attentions.to_dtype(DType::F32)?.broadcast_mul(&n)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn weights_times_each_keys_norm() -> Result<()> {
        let a = Tensor::new(&[[[0.5f32, 0.5, 0.], [0.1, 0.2, 0.7]]], &Device::Cpu)?; // (1, 2, 3)
        let n = Tensor::new(&[[2f32, 10., 1.]], &Device::Cpu)?;
        let w = weighted_value_norms(&a, &n)?.to_vec3::<f32>()?;
        assert_eq!(w[0], vec![vec![1.0, 5.0, 0.0], vec![0.2, 2.0, 0.7]]);
        assert!(weighted_value_norms(&a, &n.narrow(1, 0, 2)?).is_err());
        Ok(())
    }
}
