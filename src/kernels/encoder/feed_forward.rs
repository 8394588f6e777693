//! The rest of a BERT layer after its attention, on the CPU kernels (f32):
//! `h = LN(context + x)`, `y = LN(W2 gelu(W1 h + b1) + b2 + h)`.
//!
//! Both weights are packed once ([`PackedWeight`]: at load time, or on first need for a
//! half-precision checkpoint's, which short inputs read in place); the bias and the exact
//! GELU are applied by each task to the block it has just computed, and the residual adds
//! are fused into the LayerNorms ([`add_layer_norm_in_place`]): three passes over memory
//! instead of candle's eight ops, each allocating its result.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_nn::LayerNorm;

use crate::error::Result;
use crate::kernels::cpu_tensor::CpuF32;
use crate::kernels::encoder::layer_norm::add_layer_norm_in_place;
use crate::kernels::gemm::matrix::MatRef;
use crate::kernels::gemm::packed::{self, linear, linear_then, Epilogue, PackedWeight};

/// Rows of the intermediate activations computed at a time (1024 x 1536 floats = 6 MiB
/// for MiniLM; still 4 row blocks of the packed product per panel).
const CHUNK_ROWS: usize = 1024;

/// A LayerNorm's parameters as plain vectors.
#[derive(Debug, Clone)]
struct Norm {
    gamma: Vec<f32>,
    beta: Vec<f32>,
    eps: f32,
}

impl Norm {
    fn from(ln: &LayerNorm) -> Result<Option<Self>> {
        let Some(bias) = ln.bias() else {
            return Ok(None);
        };
        Ok(Some(Self {
            gamma: CpuF32::new(ln.weight(), "LayerNorm.weight")?
                .vector()?
                .into_owned(),
            beta: CpuF32::new(bias, "LayerNorm.bias")?.vector()?.into_owned(),
            eps: ln.eps() as f32,
        }))
    }
}

/// A BERT layer's feed-forward half, packed for the CPU micro-kernels.
#[derive(Debug, Clone)]
pub(crate) struct PackedFeedForward {
    attention_norm: Norm,
    intermediate: Arc<PackedWeight>,
    intermediate_bias: Vec<f32>,
    output: Arc<PackedWeight>,
    output_bias: Vec<f32>,
    output_norm: Norm,
}

/// A feed-forward weight as loaded: the checkpoint's `(out, in)` tensor, or already packed
/// (its `(in, out)` form, packed from the checkpoint's bytes).
#[derive(Debug, Clone)]
pub(crate) enum FeedForwardWeight {
    Tensor(Tensor),
    Packed(Arc<PackedWeight>),
}

/// The tensors of the feed-forward half, as the checkpoint holds them.
pub(crate) struct FeedForwardTensors<'a> {
    pub attention_norm: &'a LayerNorm,
    /// `(inter, hidden)`
    pub intermediate_weight: FeedForwardWeight,
    pub intermediate_bias: &'a Tensor,
    /// `(hidden, inter)`
    pub output_weight: FeedForwardWeight,
    pub output_bias: &'a Tensor,
    pub output_norm: &'a LayerNorm,
}

impl PackedFeedForward {
    /// Packs the weights; `None` where the kernels do not apply: not f32 on the CPU, a
    /// tensor that tracks gradients (a variable an optimizer updates: no stale copy), a
    /// LayerNorm without bias, or a CPU without the micro-kernels.
    pub fn pack(t: FeedForwardTensors<'_>) -> Result<Option<Self>> {
        let weights = [&t.intermediate_weight, &t.output_weight]
            .into_iter()
            .filter_map(|w| match w {
                FeedForwardWeight::Tensor(w) => Some(w),
                FeedForwardWeight::Packed(_) => None,
            });
        let tensors: Vec<&Tensor> = [
            t.attention_norm.weight(),
            t.intermediate_bias,
            t.output_bias,
            t.output_norm.weight(),
        ]
        .into_iter()
        .chain(weights)
        .collect();
        let eligible = packed::available()
            && tensors
                .iter()
                .all(|w| w.device().is_cpu() && w.dtype() == DType::F32 && !w.track_op())
            && [t.attention_norm, t.output_norm]
                .iter()
                .all(|n| n.bias().is_some_and(|b| !b.track_op()));
        if !eligible {
            return Ok(None);
        }
        let (Some(attention_norm), Some(output_norm)) =
            (Norm::from(t.attention_norm)?, Norm::from(t.output_norm)?)
        else {
            return Ok(None);
        };
        let pack = |w: FeedForwardWeight, name: &'static str| -> Result<_> {
            Ok(match w {
                FeedForwardWeight::Packed(p) => Some(p),
                FeedForwardWeight::Tensor(w) => {
                    let w = CpuF32::new(&w, name)?;
                    // (out, in) as stored; the kernels take (in, out).
                    PackedWeight::pack(w.matrix()?.t(), &[]).map(Arc::new)
                }
            })
        };
        let (Some(intermediate), Some(output)) = (
            pack(t.intermediate_weight, "intermediate.dense.weight")?,
            pack(t.output_weight, "output.dense.weight")?,
        ) else {
            return Ok(None);
        };
        let vector = |b: &Tensor, name: &'static str| -> Result<Vec<f32>> {
            Ok(CpuF32::new(b, name)?.vector()?.into_owned())
        };
        Ok(Some(Self {
            attention_norm,
            intermediate_bias: vector(t.intermediate_bias, "intermediate.dense.bias")?,
            intermediate,
            output_bias: vector(t.output_bias, "output.dense.bias")?,
            output,
            output_norm,
        }))
    }

    /// The packed `(hidden, inter)` and `(inter, hidden)` weights.
    pub fn weights(&self) -> [&Arc<PackedWeight>; 2] {
        [&self.intermediate, &self.output]
    }

    /// `LN(W2 gelu(W1 h + b1) + b2 + h)` with `h = LN(context + x)`; `None` when an input
    /// is not an f32 CPU tensor or tracks gradients (the caller runs candle's ops).
    ///
    /// `real_rows` (indices into the `batch * seq` rows) skips the feed-forward on padding:
    /// the other rows come out as `h` (nothing reads them: they are masked as keys and
    /// left out of pooling).
    ///
    /// # Shapes
    /// - `context`, `x`: `(batch, seq, hidden)`; returns `(batch, seq, hidden)`
    pub fn forward(
        &self,
        context: &Tensor,
        x: &Tensor,
        real_rows: Option<&[usize]>,
    ) -> Result<Option<Tensor>> {
        let ok = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32 && !t.track_op();
        if !ok(context) || !ok(x) || context.dims() != x.dims() {
            return Ok(None);
        }
        let (b, t, d) = x.dims3()?;
        if self.intermediate.dims().0 != d {
            return Ok(None);
        }
        let rows = b * t;
        let (context, x) = (context.contiguous()?, x.contiguous()?);
        let mut h = CpuF32::new(&context, "context")?.contiguous()?.to_vec();
        {
            let x = CpuF32::new(&x, "x")?;
            let n = &self.attention_norm;
            add_layer_norm_in_place(&mut h, x.contiguous()?, &n.gamma, &n.beta, n.eps)?;
        }
        let y = match real_rows {
            Some(real) if real.len() < rows && real.iter().all(|&r| r < rows) => {
                let mut hr = Vec::with_capacity(real.len() * d);
                for &r in real {
                    hr.extend_from_slice(&h[r * d..(r + 1) * d]);
                }
                let yr = self.rows(hr)?;
                let mut y = h;
                for (i, &r) in real.iter().enumerate() {
                    y[r * d..(r + 1) * d].copy_from_slice(&yr[i * d..(i + 1) * d]);
                }
                y
            }
            _ => self.rows(h)?,
        };
        Ok(Some(Tensor::from_vec(y, (b, t, d), x.device())?))
    }

    /// `LN(W2 gelu(W1 h + b1) + b2 + h)` for the rows of `h` `(rows, hidden)`.
    fn rows(&self, h: Vec<f32>) -> Result<Vec<f32>> {
        let (d, inter) = self.intermediate.dims();
        let rows = h.len() / d.max(1);
        // Rows in chunks, so the (rows, inter) intermediate stays a few MiB for any batch.
        let mut y = Vec::with_capacity(rows * d);
        for r0 in (0..rows).step_by(CHUNK_ROWS) {
            let n = CHUNK_ROWS.min(rows - r0);
            let hm = MatRef::row_major(&h[r0 * d..(r0 + n) * d], n, d)?;
            let g = linear_then(
                hm,
                &self.intermediate,
                0..1,
                Some(&self.intermediate_bias),
                Epilogue::GeluErf,
            )?;
            y.extend(linear(
                MatRef::row_major(&g, n, inter)?,
                &self.output,
                0..1,
                Some(&self.output_bias),
            )?);
        }
        let n = &self.output_norm;
        add_layer_norm_in_place(&mut y, &h, &n.gamma, &n.beta, n.eps)?;
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Module};

    fn values(shape: &[usize], seed: usize, scale: f32) -> Result<Tensor> {
        let v = crate::kernels::test_values(shape.iter().product(), seed);
        let v: Vec<f32> = v.into_iter().map(|x| x * scale).collect();
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
    }

    /// The packed half equals candle's ops (`linear`, `gelu_erf`, `LayerNorm`) on the same
    /// tensors, with rows that are not a multiple of any tile and a width not one of 48.
    #[test]
    #[cfg_attr(
        not(isa_avx2),
        ignore = "needs AVX2 + FMA + F16C, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn equals_candle_ops() -> Result<()> {
        assert!(
            packed::available(),
            "built for this CPU's kernels, running without them"
        );
        let (b, t, d, inter) = (3, 7, 40, 100);
        let ln = |seed| -> Result<LayerNorm> {
            Ok(LayerNorm::new(
                (values(&[d], seed, 0.5)? + 1.0)?,
                values(&[d], seed + 1, 0.2)?,
                1e-12,
            ))
        };
        let (n1, n2) = (ln(1)?, ln(3)?);
        let (w1, b1) = (values(&[inter, d], 5, 0.3)?, values(&[inter], 6, 0.1)?);
        let (w2, b2) = (values(&[d, inter], 7, 0.2)?, values(&[d], 8, 0.1)?);
        let packed = PackedFeedForward::pack(FeedForwardTensors {
            attention_norm: &n1,
            intermediate_weight: FeedForwardWeight::Tensor(w1.clone()),
            intermediate_bias: &b1,
            output_weight: FeedForwardWeight::Tensor(w2.clone()),
            output_bias: &b2,
            output_norm: &n2,
        })?
        .ok_or_else(|| crate::Error::Kernel("not packed".into()))?;
        let (context, x) = (values(&[b, t, d], 9, 1.0)?, values(&[b, t, d], 10, 2.0)?);
        let got = packed
            .forward(&context, &x, None)?
            .ok_or_else(|| crate::Error::Kernel("not run".into()))?;
        let h = n1.forward(&(&context + &x)?)?;
        let g = h
            .broadcast_matmul(&w1.t()?)?
            .broadcast_add(&b1)?
            .gelu_erf()?;
        let y = g.broadcast_matmul(&w2.t()?)?.broadcast_add(&b2)?;
        let want = n2.forward(&(y + &h)?)?;
        let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "packed vs candle: {diff}");
        // Only some rows: those equal the full computation, the others are `h`.
        let real = [0usize, 2, 3, 7, 20];
        let some = packed
            .forward(&context, &x, Some(&real))?
            .ok_or_else(|| crate::Error::Kernel("not run".into()))?
            .reshape((b * t, d))?;
        let (full, h2) = (want.reshape((b * t, d))?, h.reshape((b * t, d))?);
        for r in 0..b * t {
            let expect = if real.contains(&r) { &full } else { &h2 };
            let diff = (some.get(r)? - expect.get(r)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff < 1e-4, "row {r}: {diff}");
        }
        // Inputs that track gradients go back to candle's ops.
        let var = candle_core::Var::from_tensor(&x)?;
        assert!(packed.forward(&context, var.as_tensor(), None)?.is_none());
        Ok(())
    }
}
