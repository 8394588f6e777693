//! `x W^T + b` on f32 slices, the bias fused into the product (the destination starts as
//! the bias rows and the product accumulates onto it), parallel over the rayon pool.

use crate::error::{Error, Result};
use crate::kernels::gemm::matrix::{matmul, MatMut, MatRef, Threads};

/// `dst = x W + b`, `dst` row-major `(n, out)`, for `W` given as `(in, out)` (that is
/// `W^T` of a `(out, in)` checkpoint weight; any strides).
///
/// # Shapes
/// - `x`: `(n, in)`, `w_t`: `(in, out)`, `bias`: `(out,)`, `dst`: `n * out` elements
pub(crate) fn linear_into(
    dst: &mut [f32],
    x: MatRef<'_>,
    w_t: MatRef<'_>,
    bias: Option<&[f32]>,
) -> Result<()> {
    let (n, out) = (x.rows, w_t.cols);
    if dst.len() != n * out || w_t.rows != x.cols {
        return Err(Error::Kernel(format!(
            "linear of ({n}, {}) by ({}, {out}) into {} elements",
            x.cols,
            w_t.rows,
            dst.len()
        )));
    }
    if let Some(b) = bias {
        if b.len() != out {
            return Err(Error::Kernel(format!(
                "bias of {} for {out} outputs",
                b.len()
            )));
        }
        for row in dst.chunks_exact_mut(out.max(1)) {
            row.copy_from_slice(b);
        }
    }
    let threads = rayon::current_num_threads();
    // Below ~1 MFLOP a second thread costs more than it brings.
    let threads = if n * out * x.cols < 1 << 19 {
        Threads::One
    } else {
        Threads::Pool(threads)
    };
    let mut d = MatMut::new(dst, 0, n, out, out)?;
    matmul(&mut d, x, w_t, bias.is_some(), 1.0, threads)
}
