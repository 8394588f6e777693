//! Gradient tensors that the CPU layer op returns to candle's backward, kept per thread and
//! written in place from step to step.
//!
//! Candle adds each gradient a custom op's `bwd` returns into a fresh sum at once and drops
//! it (`backprop.rs`: `or_insert`, then `add`), so once `bwd` has returned, a tensor kept
//! here is referenced by nothing else and can take the next step's gradient. A fresh buffer
//! each step instead costs a page fault per 4 KiB (the `W_qkv` gradient of a 768-wide layer
//! is 7 MB): a third of the time of the product that fills it. `tests/training.rs` checks
//! that gradients of an earlier backward stay as they were after later ones.
//!
//! Only after [`crate::retain_freed_memory`]: with glibc's default trimming, candle's own
//! per-step allocations are paged in again every step anyway, and keeping these buffers
//! shifted its trimming so that a (1, 512, 768) backward took 35 ms instead of 28
//! (27.5 -> 22.6 ms with freed memory retained; docs/performance-archive.md).

use std::cell::RefCell;
use std::sync::Mutex;

use candle_core::{CpuStorage, Device, InplaceOp1, Layout, Shape, Tensor};

use crate::error::{Error, Result};

/// Tensors kept per thread: a layer's `x` and `W_qkv` gradients, for two layer sizes.
const KEEP: usize = 4;

thread_local! {
    static POOL: RefCell<Vec<Tensor>> = const { RefCell::new(Vec::new()) };
}

/// A kept f32 CPU tensor of `len` elements, out of the pool (a new one when none fits).
fn take(len: usize) -> Result<Tensor> {
    let kept = POOL.with(|p| {
        let mut p = p.borrow_mut();
        let at = p.iter().position(|t| t.elem_count() == len);
        at.map(|i| p.remove(i))
    });
    match kept {
        Some(t) => Ok(t),
        None => Ok(Tensor::zeros(len, candle_core::DType::F32, &Device::Cpu)?),
    }
}

/// Puts `t` back, most recently used last; the oldest beyond [`KEEP`] are dropped.
fn give_back(t: Tensor) {
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        p.push(t);
        let extra = p.len().saturating_sub(KEEP);
        p.drain(..extra);
    });
}

/// Runs `f` on two kept buffers of `len.0` and `len.1` floats (their contents are the
/// previous gradients: `f` overwrites them) and returns them as tensors of `shapes`, for
/// `bwd` to hand to candle.
pub(crate) fn two_gradients(
    len: (usize, usize),
    shapes: (&Shape, &Shape),
    f: impl FnOnce(&mut [f32], &mut [f32]) -> Result<()>,
) -> Result<(Tensor, Tensor)> {
    if !crate::memory::freed_memory_retained() {
        let (mut a, mut b) = (vec![0f32; len.0], vec![0f32; len.1]);
        f(&mut a, &mut b)?;
        return Ok((
            Tensor::from_vec(a, shapes.0, &Device::Cpu)?,
            Tensor::from_vec(b, shapes.1, &Device::Cpu)?,
        ));
    }
    let (a, b) = (take(len.0)?, take(len.1)?);
    let run = Write::new(|sa: &mut [f32]| {
        b.inplace_op1(&Write::new(|sb: &mut [f32]| f(sa, sb)))?;
        Ok(())
    });
    let written = a.inplace_op1(&run);
    let out = (a.reshape(shapes.0), b.reshape(shapes.1));
    give_back(a);
    give_back(b);
    written?;
    Ok((out.0?, out.1?))
}

/// Writes a contiguous f32 CPU tensor in place with a closure.
struct Write<F> {
    f: Mutex<Option<F>>,
}

impl<F> Write<F> {
    fn new(f: F) -> Self {
        Self {
            f: Mutex::new(Some(f)),
        }
    }
}

impl<F: FnOnce(&mut [f32]) -> Result<()>> InplaceOp1 for Write<F> {
    fn name(&self) -> &'static str {
        "candle-attention-write-gradient"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let mut run = || -> Result<()> {
            let f = self
                .f
                .lock()
                .map_err(|_| Error::Kernel("a gradient writer is poisoned".into()))?
                .take()
                .ok_or_else(|| Error::Kernel("a gradient writer ran twice".into()))?;
            let (start, end) = layout
                .contiguous_offsets()
                .ok_or_else(|| Error::Kernel("a kept gradient is not contiguous".into()))?;
            match storage {
                CpuStorage::F32(v) => {
                    let s = v
                        .get_mut(start..end)
                        .ok_or_else(|| Error::Kernel("a kept gradient is too short".into()))?;
                    f(s)
                }
                _ => Err(Error::Kernel("a kept gradient is not f32".into())),
            }
        };
        run().map_err(Error::into_candle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_written_and_distinct() -> Result<()> {
        // Tests share the process: this one turns retention on for all of them.
        if !crate::retain_freed_memory() {
            return Ok(()); // not glibc: nothing is kept
        }
        let (s1, s2) = (Shape::from((2, 3)), Shape::from(6));
        let (a, b) = two_gradients((6, 6), (&s1, &s2), |x, y| {
            x.fill(1.0);
            y.fill(2.0);
            Ok(())
        })?;
        assert_eq!(a.dims(), &[2, 3]);
        assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, vec![1.0; 6]);
        assert_eq!(b.to_vec1::<f32>()?, vec![2.0; 6]);
        drop((a, b));
        let (c, d) = two_gradients((6, 6), (&s2, &s2), |x, y| {
            // The previous gradients, in some order.
            assert!(x[0] + y[0] == 3.0);
            x.fill(5.0);
            y.fill(6.0);
            Ok(())
        })?;
        assert_eq!(c.to_vec1::<f32>()?, vec![5.0; 6]);
        assert_eq!(d.to_vec1::<f32>()?, vec![6.0; 6]);
        let failed = two_gradients((3, 4), (&Shape::from(3), &Shape::from(4)), |_, _| {
            Err(Error::Kernel("boom".into()))
        });
        assert!(failed.is_err());
        Ok(())
    }
}
