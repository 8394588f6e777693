//! The contract each instruction set's GGUF row kernels fulfil ([`RowKernels`]), and the one
//! driver over it: the sizes checked, the CPU's features checked, and the rows of `x` taken
//! in runs of as many as one unpacked block serves.

use crate::kernels::quant::activations::{self, QuantizedX};
use crate::kernels::quant::blocks::QuantType;
use crate::kernels::quant::row_kinds;

/// Rows of `x` in a form row kernels read: f32 values one row after another, or rows
/// quantized to 8 bits.
pub(crate) trait XRows {
    /// `(values a row of x, bytes a weight row)` when `rows` (whole rows of `ty`), `r` rows
    /// in `self` and `out` (row stride `ldo`, `r` values a weight row) fit together.
    fn shape(
        &self,
        ty: QuantType,
        rows: &[u8],
        r: usize,
        out: &[f32],
        ldo: usize,
    ) -> Option<(usize, usize)>;

    /// Rows `first..first + take` of the `nx` here (empty when out of range).
    fn part(&self, nx: usize, first: usize, take: usize) -> &Self;
}

impl XRows for [f32] {
    fn shape(
        &self,
        ty: QuantType,
        rows: &[u8],
        r: usize,
        out: &[f32],
        ldo: usize,
    ) -> Option<(usize, usize)> {
        row_kinds::rows_dots_shape(ty, rows, self, r, out, ldo)
    }

    fn part(&self, nx: usize, first: usize, take: usize) -> &Self {
        let inp = self.len() / nx.max(1);
        self.get(first * inp..(first + take) * inp).unwrap_or(&[])
    }
}

impl XRows for [QuantizedX] {
    fn shape(
        &self,
        ty: QuantType,
        rows: &[u8],
        r: usize,
        out: &[f32],
        ldo: usize,
    ) -> Option<(usize, usize)> {
        let row_bytes = activations::rows_dots_shape(ty, rows, self, r, out, ldo)?;
        Some((self.first()?.qs.len(), row_bytes))
    }

    fn part(&self, _nx: usize, first: usize, take: usize) -> &Self {
        self.get(first..first + take).unwrap_or(&[])
    }
}

/// One instruction set's row kernels: `out[ldo j + r] = sum_k W[j, k] x_r[k]` for the whole
/// weight rows `j` of a matrix in blocks and `R` rows of `x`, each block unpacked once for
/// all of them, each sum the same bits as for that row of `x` alone.
pub(crate) trait RowKernels {
    /// Rows of `x` as the kernels read them.
    type Rows: XRows + ?Sized;

    /// The most rows of `x` one unpacked block serves.
    const MOST_ROWS: usize;

    /// Whether this CPU has the instruction set's features, not capped below it by
    /// `CANDLE_ATTENTION_ISA`.
    fn cpu_runs() -> bool;

    /// Whether this CPU runs these kernels for `ty`: [`RowKernels::cpu_runs`], and a type
    /// the row kernels take.
    fn supports(ty: QuantType) -> bool {
        Self::cpu_runs() && row_kinds::ROW_KERNEL_TYPES.contains(&ty)
    }

    /// The products once checked; `false`, writing nothing, for a type without a kernel.
    ///
    /// # Safety
    /// [`RowKernels::supports`] is true for `ty`; [`XRows::shape`] gave `(inp, row_bytes)`
    /// for these `rows`, `R` rows of `xs` and `out` with `ldo`.
    unsafe fn rows_dots_checked<const R: usize>(
        ty: QuantType,
        rows: &[u8],
        row_bytes: usize,
        xs: &Self::Rows,
        inp: usize,
        out: &mut [f32],
        ldo: usize,
    ) -> bool;
}

/// [`RowKernels`]' products for `R` rows of `xs`: `false`, writing nothing, when this CPU or
/// type has no kernel in `K` or the sizes do not fit.
pub(crate) fn rows_dots<K: RowKernels, const R: usize>(
    ty: QuantType,
    rows: &[u8],
    xs: &K::Rows,
    out: &mut [f32],
    ldo: usize,
) -> bool {
    let shape = xs.shape(ty, rows, R, out, ldo);
    let Some((inp, row_bytes)) = shape.filter(|_| K::supports(ty)) else {
        return false;
    };
    // SAFETY: `supports` holds for `ty` and `shape` checked these sizes.
    unsafe { K::rows_dots_checked::<R>(ty, rows, row_bytes, xs, inp, out, ldo) }
}

/// `ys[nx j + i] = W[j] x_i` for the whole `ty` rows `W` in `rows` and the `nx` rows of
/// `xs`, up to [`RowKernels::MOST_ROWS`] rows of `x` per unpacked block; `false` at the first
/// run the kernels refuse.
pub(crate) fn rows_in_runs<K: RowKernels>(
    ty: QuantType,
    rows: &[u8],
    xs: &K::Rows,
    nx: usize,
    ys: &mut [f32],
) -> bool {
    let mut first = 0;
    while first < nx {
        let take = K::MOST_ROWS.min(nx - first);
        let x = xs.part(nx, first, take);
        let Some(y) = ys.get_mut(first..) else {
            return false;
        };
        let done = match take {
            4 => rows_dots::<K, 4>(ty, rows, x, y, nx),
            3 => rows_dots::<K, 3>(ty, rows, x, y, nx),
            2 => rows_dots::<K, 2>(ty, rows, x, y, nx),
            _ => rows_dots::<K, 1>(ty, rows, x, y, nx),
        };
        if !done {
            return false;
        }
        first += take;
    }
    true
}

/// One row's product, the tests' form: `None` when this CPU or type has no kernel in `K`
/// or the sizes do not fit.
#[cfg(test)]
pub(crate) fn row_dot<K: RowKernels>(ty: QuantType, row: &[u8], x: &K::Rows) -> Option<f32> {
    let mut out = [0f32];
    rows_dots::<K, 1>(ty, row, x, &mut out, 1).then_some(out[0])
}
