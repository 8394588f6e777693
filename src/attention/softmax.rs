//! Numerically stable, mask-aware softmax in f32.

use candle_core::{DType, Tensor, D};

use crate::error::Result;

/// Softmax over the last dimension, computed in f32 whatever the input dtype, subtracting
/// the row max. `bias` (0 / `-inf` / finite values, broadcastable to `scores`) is added
/// first. Entries at `-inf` get exactly 0; a row that is entirely `-inf` gets all zeros
/// (not NaN, which is what a plain softmax gives there).
///
/// # Shapes
/// - `scores`: `(batch, heads, seq_q, seq_k)` (any rank works; the last dim is normalised)
/// - `bias`: broadcastable to `scores`
/// - returns: same shape as `scores`, f32
pub fn masked_softmax(scores: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    softmax_of(scores, bias, true)
}

/// [`masked_softmax`] of scores that are finite before `bias` (products of finite Q and K):
/// without a bias, no row can be entirely `-inf`, and the GPUs' route skips looking for one.
pub(crate) fn masked_softmax_of_products(scores: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    softmax_of(scores, bias, false)
}

/// `masked_softmax`; `any_dead`: whether `scores` may hold rows entirely `-inf` on their own.
fn softmax_of(scores: &Tensor, bias: Option<&Tensor>, any_dead: bool) -> Result<Tensor> {
    let s = scores.to_dtype(DType::F32)?;
    let s = match bias {
        Some(bias) => s.broadcast_add(&bias.to_dtype(DType::F32)?)?,
        None => s,
    };
    if !s.device().is_cpu() && !s.track_op() {
        return fused(&s, any_dead || bias.is_some());
    }
    // A fully masked row has max = -inf; clamping makes `s - max` = -inf there (so exp = 0)
    // and leaves every finite max unchanged.
    let max = s.max_keepdim(D::Minus1)?.clamp(f32::MIN, f32::MAX)?;
    let e = s.broadcast_sub(&max)?.exp()?;
    // Every row with a visible key holds exp(0) = 1, so its sum is >= 1; a fully masked row
    // sums to 0 and divides by 1 into zeros. A select, not a clamp: its backward gives
    // such rows zero gradients (a clamp to a tiny sum squares into 0 / 0 = NaN there) and
    // leaves the others exact (a clamp at 1 would halve the gradient of a one-key row).
    let sum = e.sum_keepdim(D::Minus1)?;
    let sum = sum.gt(0.0)?.where_cond(&sum, &sum.ones_like()?)?;
    Ok(e.broadcast_div(&sum)?)
}

/// On a GPU, without gradients: candle's one-kernel row softmax (max, exponentials, sum and
/// scaling in one pass over the scores instead of seven); where `dead_rows` may exist, a row
/// entirely `-inf`, which it leaves NaN (its max is `-inf`), set to zeros.
fn fused(s: &Tensor, dead_rows: bool) -> Result<Tensor> {
    let p = candle_nn::ops::softmax_last_dim(&s.contiguous()?)?;
    if !dead_rows {
        return Ok(p);
    }
    let dead = s
        .max_keepdim(D::Minus1)?
        .eq(f32::NEG_INFINITY)?
        .broadcast_as(p.shape())?;
    let zero = Tensor::zeros((), DType::F32, p.device())?.broadcast_as(p.shape())?;
    Ok(dead.where_cond(&zero, &p)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn fully_masked_row_is_zero_not_nan() -> Result<()> {
        let s = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &Device::Cpu)?;
        let inf = f32::NEG_INFINITY;
        let bias = Tensor::new(&[[0f32, inf, 0.], [inf, inf, inf]], &Device::Cpu)?;
        let p: Vec<Vec<f32>> = masked_softmax(&s, Some(&bias))?.to_vec2()?;
        assert_eq!(p[1], vec![0.0, 0.0, 0.0]);
        assert_eq!(p[0][1], 0.0);
        assert!((p[0][0] + p[0][2] - 1.0).abs() < 1e-6);
        Ok(())
    }

    #[test]
    fn fully_masked_row_has_zero_gradients() -> Result<()> {
        let s = candle_core::Var::new(&[[1f32, 2., 3.], [4., 5., 6.]], &Device::Cpu)?;
        let inf = f32::NEG_INFINITY;
        let bias = Tensor::new(&[[0f32, 0., inf], [inf, inf, inf]], &Device::Cpu)?;
        let w = Tensor::new(&[[1f32, -2., 3.], [1., 1., 1.]], &Device::Cpu)?;
        let p = masked_softmax(s.as_tensor(), Some(&bias))?;
        let g = (p * w)?.sum_all()?.backward()?;
        let g: Vec<Vec<f32>> = g.get(s.as_tensor()).expect("grad").to_vec2()?;
        assert_eq!(g[1], vec![0.0, 0.0, 0.0]);
        // Row 0: p = softmax(1, 2) over two keys, d(sum p w)/ds = p (w - p . w).
        let (p0, p1) = (1.0 / (1.0 + 1f32.exp()), 1f32.exp() / (1.0 + 1f32.exp()));
        let pw = p0 - 2.0 * p1;
        assert!((g[0][0] - p0 * (1.0 - pw)).abs() < 1e-6, "{g:?}");
        assert!((g[0][1] - p1 * (-2.0 - pw)).abs() < 1e-6, "{g:?}");
        assert_eq!(g[0][2], 0.0);
        Ok(())
    }

    /// The GPUs' route, run here on the CPU: the unfused softmax's values within f32
    /// rounding, zeros on a fully masked row (masked by the bias, or `-inf` in the scores
    /// themselves, which the public function must expect).
    #[test]
    fn the_fused_route_is_the_same_softmax() -> Result<()> {
        let inf = f32::NEG_INFINITY;
        let s = Tensor::new(
            &[[1f32, 2., 3., -1.], [4., 5., 6., 7.], [0.5, 0., 9., 1.]],
            &Device::Cpu,
        )?;
        let bias = Tensor::new(
            &[[0f32, inf, 0., 0.], [inf, inf, inf, inf], [0., 0., 0., inf]],
            &Device::Cpu,
        )?;
        let dead = Tensor::new(
            &[
                [1f32, inf, 3., -1.],
                [inf, inf, inf, inf],
                [0.5, 0., 9., 1.],
            ],
            &Device::Cpu,
        )?;
        for (s, bias) in [(&s, None), (&s, Some(&bias)), (&dead, None)] {
            let want: Vec<Vec<f32>> = masked_softmax(s, bias)?.to_vec2()?;
            let masked = match bias {
                Some(b) => s.broadcast_add(b)?,
                None => s.clone(),
            };
            let got: Vec<Vec<f32>> = fused(&masked, true)?.to_vec2()?;
            for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                assert!((g - w).abs() <= 1e-6, "{got:?} vs {want:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn large_logits_stay_finite() -> Result<()> {
        let s = Tensor::new(&[[1e4f32, -1e4, 0.0]], &Device::Cpu)?;
        let p: Vec<Vec<f32>> = masked_softmax(&s, None)?.to_vec2()?;
        assert_eq!(p[0], vec![1.0, 0.0, 0.0]);
        Ok(())
    }
}
