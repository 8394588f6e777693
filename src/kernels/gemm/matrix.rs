//! Strided f32 matrix views and the matrix multiply on them (the `gemm` crate, the same
//! AVX-512 / AVX2 / NEON kernels candle's CPU backend uses).
//!
//! A view never owns its data. [`MatRef`] borrows a slice and checks on construction that
//! every element it can address lies inside it; [`MatMut`] does the same for a mutable
//! slice, or is built from a [`SharedOut`] by a caller that guarantees disjoint writes.

use std::marker::PhantomData;

use crate::error::{Error, Result};
use crate::kernels::widen::widen_half_bytes;

/// Largest offset `(rows - 1) * rs + (cols - 1) * cs` a view addresses, `None` when empty.
fn last_offset(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<usize> {
    if rows == 0 || cols == 0 {
        return None;
    }
    Some((rows - 1) * rs + (cols - 1) * cs)
}

fn out_of_bounds(what: &str, offset: usize, rows: usize, cols: usize, len: usize) -> Error {
    Error::Kernel(format!(
        "{what} view of {rows}x{cols} at offset {offset} runs past its buffer of {len} elements"
    ))
}

/// A row-major `(rows, cols)` matrix of little-endian f16 or bf16 values, as a checkpoint
/// stores it (the bytes are usually the file's memory map).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HalfRows<'a> {
    pub bytes: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    /// bf16 rather than f16.
    pub bf16: bool,
}

impl HalfRows<'_> {
    /// Row `r` widened to f32 (exact) into `out` (`cols` values).
    pub fn widen_row(&self, r: usize, out: &mut [f32]) {
        let row = &self.bytes[2 * r * self.cols..2 * (r + 1) * self.cols];
        widen_half_bytes(row, self.bf16, out);
    }
}

/// Half-precision `(out_i, in)` matrices stacked along their outputs that stay where they are
/// stored (a checkpoint's file map): the kernels borrow them again on each use instead of
/// holding a copy.
pub(crate) trait HalfSource: Send + Sync + std::fmt::Debug {
    /// The matrices, in the order they are stacked.
    fn parts(&self) -> Result<Vec<HalfRows<'_>>>;
}

/// A read-only `(rows, cols)` matrix whose element `(i, j)` is `data[offset + i * rs + j * cs]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MatRef<'a> {
    ptr: *const f32,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
    _data: PhantomData<&'a [f32]>,
}

// SAFETY: a `MatRef` is a shared borrow of f32 data (like `&[f32]`), which is Send and Sync.
unsafe impl Send for MatRef<'_> {}
// SAFETY: see above.
unsafe impl Sync for MatRef<'_> {}

impl<'a> MatRef<'a> {
    /// A view into `data`, checked to stay inside it.
    pub fn new(
        data: &'a [f32],
        offset: usize,
        rows: usize,
        cols: usize,
        rs: usize,
        cs: usize,
    ) -> Result<Self> {
        if let Some(last) = last_offset(rows, cols, rs, cs) {
            if offset + last >= data.len() {
                return Err(out_of_bounds("input", offset, rows, cols, data.len()));
            }
        }
        Ok(Self {
            // `wrapping_add` so an empty view at the end of its buffer stays well defined.
            ptr: data.as_ptr().wrapping_add(offset),
            rows,
            cols,
            rs,
            cs,
            _data: PhantomData,
        })
    }

    /// A row-major `(rows, cols)` matrix filling `data` from its start.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Result<Self> {
        Self::new(data, 0, rows, cols, cols, 1)
    }

    /// Element `(i, j)`, `None` outside the view.
    pub fn get(&self, i: usize, j: usize) -> Option<f32> {
        if i >= self.rows || j >= self.cols {
            return None;
        }
        // SAFETY: in bounds by construction (checked against the borrowed slice).
        Some(unsafe { *self.ptr.add(i * self.rs + j * self.cs) })
    }

    /// Pointer to element `(0, 0)`; every element of the view is readable through it for
    /// the view's lifetime.
    pub fn ptr(&self) -> *const f32 {
        self.ptr
    }

    /// Row `i` as a slice when the columns are contiguous (`cs == 1`).
    pub fn row(&self, i: usize) -> Option<&'a [f32]> {
        if i >= self.rows || (self.cs != 1 && self.cols > 1) {
            return None;
        }
        // SAFETY: the constructor checked that every element of every row is inside the
        // borrowed slice, and `i < rows`; the columns are contiguous.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.add(i * self.rs), self.cols) })
    }

    /// Columns `start..start + n` (no copy).
    pub fn columns(self, start: usize, n: usize) -> Result<Self> {
        if start + n > self.cols {
            return Err(Error::Kernel(format!(
                "columns {start}..{} of a {}-column view",
                start + n,
                self.cols
            )));
        }
        Ok(Self {
            ptr: self.ptr.wrapping_add(start * self.cs),
            cols: n,
            ..self
        })
    }

    /// Rows `start..start + n` (`start + n <= rows`, checked by the caller).
    fn rows_range(self, start: usize, n: usize) -> Self {
        Self {
            ptr: self.ptr.wrapping_add(start * self.rs),
            rows: n,
            ..self
        }
    }

    /// Columns `start..start + n` (`start + n <= cols`, checked by the caller).
    fn cols_range(self, start: usize, n: usize) -> Self {
        Self {
            ptr: self.ptr.wrapping_add(start * self.cs),
            cols: n,
            ..self
        }
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// A writable `(rows, cols)` matrix; element `(i, j)` at `ptr + i * rs + j * cs`.
#[derive(Debug)]
pub(crate) struct MatMut<'a> {
    ptr: *mut f32,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
    _data: PhantomData<&'a mut [f32]>,
}

impl<'a> MatMut<'a> {
    /// A view into `data`, checked to stay inside it.
    pub fn new(
        data: &'a mut [f32],
        offset: usize,
        rows: usize,
        cols: usize,
        rs: usize,
    ) -> Result<Self> {
        if let Some(last) = last_offset(rows, cols, rs, 1) {
            if offset + last >= data.len() {
                return Err(out_of_bounds("output", offset, rows, cols, data.len()));
            }
        }
        Ok(Self {
            ptr: data.as_mut_ptr().wrapping_add(offset),
            rows,
            cols,
            rs,
            cs: 1,
            _data: PhantomData,
        })
    }

    /// Pointer to element `(0, 0)`: `rows` rows of `cols` writable floats at stride `rs`.
    pub fn as_mut_ptr(&mut self) -> *mut f32 {
        self.ptr
    }

    /// Row `i` as a mutable slice.
    pub fn row_mut(&mut self, i: usize) -> Option<&mut [f32]> {
        if i >= self.rows {
            return None;
        }
        // SAFETY: in bounds by construction (columns are contiguous, `cs == 1`), and `&mut
        // self` makes this the only live reference into the view.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * self.rs), self.cols) })
    }
}

/// An output buffer that several threads write to at once, each to its own disjoint set of
/// elements (one attention task per `(batch, head, query block)`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SharedOut<'a> {
    ptr: *mut f32,
    len: usize,
    _data: PhantomData<&'a mut [f32]>,
}

// SAFETY: writers only ever touch disjoint elements (see `SharedOut::mat_mut`), so sharing
// the pointer between threads is sound.
unsafe impl Send for SharedOut<'_> {}
// SAFETY: see above.
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    pub fn new(data: &'a mut [f32]) -> Self {
        Self {
            ptr: data.as_mut_ptr(),
            len: data.len(),
            _data: PhantomData,
        }
    }

    /// A mutable row-major view (`cs == 1`) into the shared buffer, bounds-checked.
    ///
    /// # Safety
    /// While the returned view lives, no other view may address any of its elements.
    pub unsafe fn mat_mut(
        &self,
        offset: usize,
        rows: usize,
        cols: usize,
        rs: usize,
    ) -> Result<MatMut<'a>> {
        if let Some(last) = last_offset(rows, cols, rs, 1) {
            if offset + last >= self.len {
                return Err(out_of_bounds("shared output", offset, rows, cols, self.len));
            }
        }
        Ok(MatMut {
            ptr: self.ptr.wrapping_add(offset),
            rows,
            cols,
            rs,
            cs: 1,
            _data: PhantomData,
        })
    }
}

/// How many threads a matrix multiply may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Threads {
    /// The calling thread only (inside an already parallel attention task).
    One,
    /// Up to this many threads of the rayon pool.
    Pool(usize),
}

/// `dst = beta * lhs @ rhs`, or `dst += beta * lhs @ rhs` when `accumulate`.
///
/// # Shapes
/// - `dst`: `(m, n)`, `lhs`: `(m, k)`, `rhs`: `(k, n)`
pub(crate) fn matmul(
    dst: &mut MatMut<'_>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    accumulate: bool,
    beta: f32,
    threads: Threads,
) -> Result<()> {
    if dst.rows != lhs.rows || dst.cols != rhs.cols || lhs.cols != rhs.rows {
        return Err(Error::Kernel(format!(
            "matmul of ({}, {}) by ({}, {}) into ({}, {})",
            lhs.rows, lhs.cols, rhs.rows, rhs.cols, dst.rows, dst.cols
        )));
    }
    let n_threads = match threads {
        Threads::Pool(n) => n.min(rayon::current_num_threads()).max(1),
        Threads::One => 1,
    };
    let (m, n, k) = (dst.rows, dst.cols, lhs.cols);
    if n_threads == 1 || m * n * k < SPLIT_ABOVE {
        // SAFETY: the views were bounds-checked when built and their shapes agree (above);
        // `dst` is borrowed mutably, and a `MatMut` never aliases a `MatRef` (the borrow
        // checker keeps them apart; `SharedOut` callers guarantee disjointness).
        unsafe { gemm_into(dst.ptr, dst.rs, dst.cs, lhs, rhs, accumulate, beta) };
        return Ok(());
    }
    // One part per thread along the longer side of `dst`, each a single-threaded product:
    // faster than the `gemm` crate's own threads here (docs/performance-archive.md).
    let (rows, align) = if m >= n { (true, 8) } else { (false, 16) };
    let len = if rows { m } else { n };
    let part = len.div_ceil(n_threads).div_ceil(align) * align;
    let (ptr, rs, cs) = (dst.ptr as usize, dst.rs, dst.cs);
    rayon::scope(|scope| {
        for i0 in (0..len).step_by(part) {
            let cnt = part.min(len - i0);
            let (l, r, off) = if rows {
                (lhs.rows_range(i0, cnt), rhs, i0 * rs)
            } else {
                (lhs, rhs.cols_range(i0, cnt), i0 * cs)
            };
            scope.spawn(move |_| {
                // SAFETY: `dst` is borrowed mutably for the whole scope, and the parts are
                // disjoint row or column ranges of it (`off` within its bounds).
                unsafe { gemm_into((ptr as *mut f32).add(off), rs, cs, l, r, accumulate, beta) };
            });
        }
    });
    Ok(())
}

/// Below this many multiply-adds a product runs on one thread.
const SPLIT_ABOVE: usize = 1 << 21;

/// `dst = beta * lhs @ rhs` (or `+=`) on this thread, `dst` `(lhs.rows, rhs.cols)` at
/// `(rs, cs)` from `ptr`.
///
/// # Safety
/// `ptr` addresses that many writable elements that nothing else reads or writes during the
/// call, and none of them aliases `lhs` or `rhs` (views bounds-checked when built).
unsafe fn gemm_into(
    ptr: *mut f32,
    rs: usize,
    cs: usize,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    accumulate: bool,
    beta: f32,
) {
    gemm::gemm(
        lhs.rows,
        rhs.cols,
        lhs.cols,
        ptr,
        cs as isize,
        rs as isize,
        accumulate,
        lhs.ptr,
        lhs.cs as isize,
        lhs.rs as isize,
        rhs.ptr,
        rhs.cs as isize,
        rhs.rs as isize,
        1.0,
        beta,
        false,
        false,
        false,
        gemm::Parallelism::None,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_refuse_to_run_past_their_buffer() {
        let data = vec![0f32; 6];
        assert!(MatRef::new(&data, 0, 2, 3, 3, 1).is_ok());
        assert!(MatRef::new(&data, 1, 2, 3, 3, 1).is_err());
        assert!(MatRef::new(&data, 6, 0, 3, 3, 1).is_ok());
    }

    #[test]
    fn matmul_of_strided_views() -> Result<()> {
        // lhs (2, 3) row-major, rhs = transpose of a (2, 3) row-major matrix.
        let a = [1f32, 2., 3., 4., 5., 6.];
        let b = [1f32, 0., 1., 0., 1., 0.];
        let mut c = vec![0f32; 4];
        let mut dst = MatMut::new(&mut c, 0, 2, 2, 2)?;
        let lhs = MatRef::row_major(&a, 2, 3)?;
        let rhs = MatRef::row_major(&b, 2, 3)?.t();
        matmul(&mut dst, lhs, rhs, false, 2.0, Threads::One)?;
        assert_eq!(c, vec![8., 4., 20., 10.]);
        Ok(())
    }

    #[test]
    fn products_split_over_threads_equal_one_thread() -> Result<()> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .map_err(|e| Error::Kernel(e.to_string()))?;
        // Taller than wide (split by rows), wider than tall (by columns), a transposed lhs.
        for (m, n, k, lhs_t) in [(300, 70, 130, false), (40, 1000, 90, true)] {
            assert!(m * n * k >= SPLIT_ABOVE);
            let a: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
            let b: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 13) as f32 - 6.0).collect();
            let lhs = if lhs_t {
                MatRef::row_major(&a, k, m)?.t()
            } else {
                MatRef::row_major(&a, m, k)?
            };
            let rhs = MatRef::row_major(&b, k, n)?;
            let mut one = vec![1f32; m * n];
            let mut split = vec![1f32; m * n];
            for accumulate in [false, true] {
                matmul(
                    &mut MatMut::new(&mut one, 0, m, n, n)?,
                    lhs,
                    rhs,
                    accumulate,
                    0.5,
                    Threads::One,
                )?;
                pool.install(|| {
                    matmul(
                        &mut MatMut::new(&mut split, 0, m, n, n)?,
                        lhs,
                        rhs,
                        accumulate,
                        0.5,
                        Threads::Pool(3),
                    )
                })?;
                assert_eq!(one, split, "({m}, {n}, {k}) accumulate {accumulate}");
            }
        }
        Ok(())
    }
}
