//! The residual sum `x + y` of a decoder layer on rayon's pool. candle-core's element-wise
//! ops run inputs of 64K values or more on a pool of their own, whose worker spins for ~25,000
//! pauses after each op before parking: on a 2-core machine that spin took a core from the
//! products that follow (~5% of a SmolLM2 prompt's CPU time, two such sums a layer; see
//! docs/performance-archive.md).

use std::mem::MaybeUninit;

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use crate::error::Result;
use crate::kernels::cpu_tensor::CpuF32;

/// Values per task.
const CHUNK: usize = 16 * 1024;

/// `x + y` for two f32 CPU tensors of one shape, contiguous, neither tracking gradients (the
/// same values as candle's add: one f32 sum per element); anything else by candle.
pub(crate) fn add(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let ours = |t: &Tensor| {
        t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous() && !t.track_op()
    };
    if ours(x) && ours(y) && x.dims() == y.dims() {
        let (xv, yv) = (CpuF32::new(x, "x")?, CpuF32::new(y, "y")?);
        let (xs, ys) = (xv.contiguous()?, yv.contiguous()?);
        let mut out = Vec::with_capacity(xs.len());
        let slots = &mut out.spare_capacity_mut()[..xs.len()];
        if xs.len() < 4 * CHUNK {
            sum_into(slots, xs, ys);
        } else {
            slots
                .par_chunks_mut(CHUNK)
                .zip(xs.par_chunks(CHUNK))
                .zip(ys.par_chunks(CHUNK))
                .for_each(|((o, a), b)| sum_into(o, a, b));
        }
        // SAFETY: each of the `xs.len()` slots was written above (the chunks of `slots`,
        // `xs` and `ys` pair up one to one: the three have one length).
        unsafe { out.set_len(xs.len()) };
        return Ok(Tensor::from_vec(out, x.shape(), x.device())?);
    }
    Ok((x + y)?)
}

/// `out[i] = a[i] + b[i]`.
fn sum_into(out: &mut [MaybeUninit<f32>], a: &[f32], b: &[f32]) {
    for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
        o.write(a + b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// candle's sums bit for bit, below and above the pool's threshold; a broadcast or a
    /// strided input goes to candle.
    #[test]
    fn equals_candle_s_add() -> Result<()> {
        let dev = Device::Cpu;
        for n in [7, 4 * CHUNK + 5] {
            let x = Tensor::from_vec(crate::kernels::test_values(n, 1), n, &dev)?;
            let y = Tensor::from_vec(crate::kernels::test_values(n, 2), n, &dev)?;
            let (a, b) = (add(&x, &y)?.to_vec1::<f32>()?, (&x + &y)?.to_vec1::<f32>()?);
            assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
        }
        let x = Tensor::from_vec(crate::kernels::test_values(12, 3), (3, 4), &dev)?;
        let t = x.t()?;
        let (a, b) = (add(&t, &t)?, (&t + &t)?);
        assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
        Ok(())
    }
}
