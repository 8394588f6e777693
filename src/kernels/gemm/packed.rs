//! `x W + b` with `W` packed once, for the projections of the CPU fast path.
//!
//! A general matrix multiply repacks its right-hand side on every call; a layer's weights
//! never change, so they are packed once into panels of 48 output columns, each stored
//! `(in, 48)` contiguous and zero padded. The micro-kernels ([`crate::kernels::gemm::microkernel`]) then
//! compute 8 rows x 48 columns at a time (AVX-512) or 4 rows x 24 columns (AVX2 + FMA),
//! reading each panel as one contiguous stream, with the bias loaded into the accumulators
//! (no separate pass). Work is split over `(row block, panel)` tasks on the rayon pool.
//!
//! Packing needs AVX-512F or AVX2 + FMA at run time; [`PackedWeight::pack`] returns `None`
//! elsewhere and callers keep the plain matrix (the `gemm` crate path).
//!
//! A weight given as half-precision rows where a checkpoint is mapped
//! ([`PackedWeight::from_half`]) is packed on its first product of more than
//! [`half_rows_product::MOST_ROWS`] rows; shorter inputs read the rows in place
//! ([`half_rows_product`]), so a model that only ever sees short inputs never allocates its
//! panels (most of its load time, and most of its memory).

use std::sync::{Arc, OnceLock};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::activation::gelu_erf_in_place;
use crate::kernels::aligned::{AlignedFloats, UninitFloats};
use crate::kernels::gemm::half_rows_product;
use crate::kernels::gemm::matrix::{HalfRows, HalfSource, MatRef};
use crate::kernels::gemm::microkernel::{self, panel_product, Start};
use crate::kernels::gemm::transpose;
use crate::kernels::scratch::with_scratch;

/// Output columns per panel (3 AVX-512 registers, or two 4 x 24 AVX2 tiles).
const PANEL: usize = 48;
const _: () = assert!(PANEL.is_multiple_of(transpose::COLUMNS));

/// Bytes per memory page (the smallest, x86-64's and most others').
const PAGE: usize = 4096;
/// Rows per task: a block of activations stays in L2 while the panels stream by (128
/// measured faster than 256 and 64, see docs/performance-archive.md).
const MB: usize = 128;

/// One panel: columns `col..col + width` of the weight.
#[derive(Debug, Clone, Copy)]
struct Panel {
    col: usize,
    width: usize,
}

/// A `(k, n)` weight (the `(in, out)` form of a `(out, in)` checkpoint matrix) in panels.
///
/// Column ranges given as `splits` at packing time never share a panel, so each range can
/// be multiplied on its own (cross-attention computes Q from one input and K, V from
/// another).
#[derive(Debug, Clone)]
pub(crate) struct PackedWeight {
    k: usize,
    n: usize,
    panels: Vec<Panel>,
    /// Panel `p` at `p * k * PANEL`, `(k, PANEL)` row-major, on a cache-line boundary: set
    /// when packed from f32, on first need when packed from `half`.
    data: OnceLock<AlignedFloats>,
    /// The half-precision rows the panels are packed from, where they are stored.
    half: Option<Arc<dyn HalfSource>>,
    /// Column ranges `[start, end)` (from `splits`), each with its first and end panel.
    segments: Vec<(usize, usize, usize, usize)>,
}

/// Whether this CPU runs the packed kernels.
pub(crate) fn available() -> bool {
    microkernel::available()
}

impl PackedWeight {
    /// Packs `w` `(k, n)`; `splits` are column indices (increasing, inside `0..n`) where
    /// segments start. `None` when the CPU has neither AVX-512 nor AVX2 + FMA.
    pub fn pack(w: MatRef<'_>, splits: &[usize]) -> Option<Self> {
        let packed = Self::empty(w.rows, w.cols, splits, None)?;
        let k = packed.k;
        let mut data = AlignedFloats::zeroed(packed.panels.len() * k * PANEL);
        for (p, panel) in packed.panels.iter().enumerate() {
            let dst = &mut data[p * k * PANEL..(p + 1) * k * PANEL];
            // Read along the source's contiguous side (a checkpoint's `(out, in)` rows, seen
            // through the transposed view, are the panel's columns).
            if w.rs == 1 {
                for j in 0..panel.width {
                    for kk in 0..k {
                        dst[kk * PANEL + j] = w.get(kk, panel.col + j)?;
                    }
                }
            } else {
                for kk in 0..k {
                    let row = &mut dst[kk * PANEL..kk * PANEL + panel.width];
                    for (j, d) in row.iter_mut().enumerate() {
                        *d = w.get(kk, panel.col + j)?;
                    }
                }
            }
        }
        let _ = packed.data.set(data);
        Some(packed)
    }

    /// Packs the `(in, out)` form of a `(n, k)` weight whose rows `rows(first, count, out)`
    /// writes (all `count` rows of `k` values, row-major, into a buffer holding whatever an
    /// earlier call left; false when it cannot): the panels are
    /// filled on the pool, each from its own rows, with no whole f32 copy of the weight
    /// besides the panels. `Ok(None)` when the CPU has neither AVX-512 nor AVX2 + FMA.
    pub fn pack_rows(
        k: usize,
        n: usize,
        rows: &(dyn Fn(usize, usize, &mut [f32]) -> bool + Sync),
    ) -> Result<Option<Self>> {
        let Some(packed) = Self::empty(k, n, &[], None) else {
            return Ok(None);
        };
        let _ = packed.data.set(packed.fill(rows)?);
        Ok(Some(packed))
    }

    /// The panels of the weight whose rows `rows` writes (as for [`PackedWeight::pack_rows`]),
    /// each filled on the pool from its own rows.
    fn fill(
        &self,
        rows: &(dyn Fn(usize, usize, &mut [f32]) -> bool + Sync),
    ) -> Result<AlignedFloats> {
        let k = self.k;
        // Every float is written below (the panels tile the buffer, a narrow panel's unused
        // columns as zeros): no zeroing pass first. (A scale of 1 leaves the values as
        // they are.)
        let mut data = UninitFloats::new(self.panels.len() * k * PANEL);
        data.slots()
            .par_chunks_mut((k * PANEL).max(1))
            .zip(&self.panels)
            .try_for_each(|(dst, panel)| {
                with_scratch(panel.width * k, |w| {
                    if !rows(panel.col, panel.width, w) {
                        return Err(Error::Kernel(format!(
                            "rows {}..{} of a ({}, {k}) weight",
                            panel.col,
                            panel.col + panel.width,
                            self.n
                        )));
                    }
                    // Eight rows at a time become eight columns of the panel (in registers);
                    // the columns past the panel's width, zeros.
                    for g in (0..PANEL).step_by(transpose::COLUMNS) {
                        let live = transpose::COLUMNS.min(panel.width.saturating_sub(g));
                        let mut eight: [&[f32]; transpose::COLUMNS] = [&[]; transpose::COLUMNS];
                        for (t, row) in eight.iter_mut().enumerate().take(live) {
                            *row = &w[(g + t) * k..(g + t + 1) * k];
                        }
                        transpose::transpose_scaled(&eight[..live], k, 1.0, &mut dst[g..], PANEL)?;
                    }
                    Ok(())
                })
            })?;
        // SAFETY: each of the `panels.len()` chunks of `k * PANEL` slots had all its `k`
        // lines of `PANEL` written above (an error returned before this).
        Ok(unsafe { data.assume_init() })
    }

    /// The `(in, out)` form of half-precision `(out, in)` matrices stacked along their
    /// outputs (a checkpoint's Q, K and V rows, where its file is mapped), packed on first
    /// need, each value widened exactly (no f32 copy of the matrices is made). `Ok(None)`
    /// when the CPU has neither AVX-512 nor AVX2 + FMA; an error when the parts' input
    /// widths differ or their bytes do not hold them.
    pub fn from_half(source: Arc<dyn HalfSource>, splits: &[usize]) -> Result<Option<Self>> {
        let parts = source.parts()?;
        let (k, n) = half_dims(&parts)?;
        // One byte of each page read now, while the model loads (layers in parallel, beside
        // the tokenizer), rather than a page fault per page in the first product.
        let touched = parts.iter().fold(0u8, |acc, p| {
            p.bytes.iter().step_by(PAGE).fold(acc, |a, &b| a ^ b)
        });
        std::hint::black_box(touched);
        Ok(Self::empty(k, n, splits, Some(source)))
    }

    /// The panels, packed from the half-precision rows on the first call for such a weight.
    fn panel_data(&self) -> Result<&AlignedFloats> {
        if let Some(data) = self.data.get() {
            return Ok(data);
        }
        let Some(source) = &self.half else {
            return Err(Error::Kernel("a packed weight without its panels".into()));
        };
        let parts = source.parts()?;
        let rows = stacked_rows(&parts, self.k, self.n)?;
        let k = self.k.max(1);
        let widen = |first: usize, count: usize, out: &mut [f32]| {
            let Some(these) = rows.get(first..first + count) else {
                return false;
            };
            for (&(part, r), dst) in these.iter().zip(out.chunks_exact_mut(k)) {
                parts[part].widen_row(r, dst);
            }
            true
        };
        // On the pool: this runs inside a forward, not beside the other layers' loading.
        let data = self.fill(&widen)?;
        // Two threads racing here both pack; the first one's panels are kept.
        Ok(self.data.get_or_init(|| data))
    }

    /// Panels for a `(k, n)` weight split at `splits`, their data not yet filled.
    fn empty(
        k: usize,
        n: usize,
        splits: &[usize],
        half: Option<Arc<dyn HalfSource>>,
    ) -> Option<Self> {
        if !available() {
            return None;
        }
        let mut bounds = vec![0];
        bounds.extend(splits.iter().copied().filter(|&s| s > 0 && s < n));
        bounds.push(n);
        let mut panels = Vec::new();
        let mut segments = Vec::new();
        for seg in bounds.windows(2) {
            let first = panels.len();
            let mut col = seg[0];
            while col < seg[1] {
                let width = PANEL.min(seg[1] - col);
                panels.push(Panel { col, width });
                col += width;
            }
            segments.push((seg[0], seg[1], first, panels.len()));
        }
        Some(Self {
            k,
            n,
            data: OnceLock::new(),
            half,
            panels,
            segments,
        })
    }

    /// Number of column ranges (one more than the splits inside `0..n`).
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// `(k, n)` = `(in, out)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.k, self.n)
    }

    /// The weight back as a `(k, n)` row-major matrix (from the half-precision rows when
    /// they are not packed yet: unpacking does not pack).
    pub fn unpack(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.k * self.n];
        let data = match (self.data.get(), &self.half) {
            (Some(data), _) => data,
            (None, Some(source)) => {
                let parts = source.parts()?;
                let mut widened = vec![0f32; self.k];
                for (c, (part, r)) in stacked_rows(&parts, self.k, self.n)?
                    .into_iter()
                    .enumerate()
                {
                    parts[part].widen_row(r, &mut widened);
                    for (kk, &v) in widened.iter().enumerate() {
                        out[kk * self.n + c] = v;
                    }
                }
                return Ok(out);
            }
            (None, None) => self.panel_data()?,
        };
        for (p, panel) in self.panels.iter().enumerate() {
            let src = &data[p * self.k * PANEL..(p + 1) * self.k * PANEL];
            for kk in 0..self.k {
                out[kk * self.n + panel.col..kk * self.n + panel.col + panel.width]
                    .copy_from_slice(&src[kk * PANEL..kk * PANEL + panel.width]);
            }
        }
        Ok(out)
    }

    /// Columns `[start, end)` of segments `first..end` (as given by the `splits`).
    pub fn segment_columns(&self, segments: std::ops::Range<usize>) -> Result<(usize, usize)> {
        let first = self.segments.get(segments.start);
        let last = segments
            .end
            .checked_sub(1)
            .and_then(|i| self.segments.get(i));
        match (first, last) {
            (Some(f), Some(l)) if segments.start < segments.end => Ok((f.0, l.1)),
            _ => Err(Error::Kernel(format!(
                "segments {segments:?} of a weight packed in {}",
                self.segments.len()
            ))),
        }
    }
}

/// `(k, n)` = `(in, sum of outs)` of half-precision parts, checked to share their input width
/// and to be held by their bytes.
fn half_dims(parts: &[HalfRows<'_>]) -> Result<(usize, usize)> {
    let k = parts.first().map_or(0, |p| p.cols);
    for (i, part) in parts.iter().enumerate() {
        if part.cols != k || part.bytes.len() != 2 * part.rows * part.cols {
            return Err(Error::Kernel(format!(
                "half matrix {i} of {}x{} in {} bytes, packed with input width {k}",
                part.rows,
                part.cols,
                part.bytes.len()
            )));
        }
    }
    Ok((k, parts.iter().map(|p| p.rows).sum()))
}

/// `(part, row)` of each of the `n` output columns of parts stacked along their outputs,
/// checked to still be the `(k, n)` weight they were.
fn stacked_rows(parts: &[HalfRows<'_>], k: usize, n: usize) -> Result<Vec<(usize, usize)>> {
    if half_dims(parts)? != (k, n) {
        return Err(Error::Kernel(format!(
            "half-precision rows no longer a ({k}, {n}) weight"
        )));
    }
    Ok(parts
        .iter()
        .enumerate()
        .flat_map(|(i, p)| (0..p.rows).map(move |r| (i, r)))
        .collect())
}

/// Raw output pointer shared by the tasks (each writes its own rows x panel columns).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: tasks write disjoint elements (distinct (row block, panel) pairs).
unsafe impl Send for OutPtr {}
// SAFETY: see above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// What a task does to its block of outputs right after computing it (still in cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Epilogue {
    /// Nothing: `x W + b`.
    None,
    /// The exact GELU: `gelu(x W + b)`.
    GeluErf,
}

/// `x W[:, cols] + b` for the columns of `segments`: returns `(m, cols)` row-major.
///
/// # Shapes
/// - `x`: `(m, k)` with contiguous rows (`cs == 1`)
/// - `bias`: the `(n,)` bias of the whole weight (the segments' part is used)
/// - returns: `m * cols` values, `cols` = the segments' width
pub(crate) fn linear(
    x: MatRef<'_>,
    w: &PackedWeight,
    segments: std::ops::Range<usize>,
    bias: Option<&[f32]>,
) -> Result<Vec<f32>> {
    linear_then(x, w, segments, bias, Epilogue::None)
}

/// [`linear`], then `epilogue` on each task's block of outputs.
pub(crate) fn linear_then(
    x: MatRef<'_>,
    w: &PackedWeight,
    segments: std::ops::Range<usize>,
    bias: Option<&[f32]>,
    epilogue: Epilogue,
) -> Result<Vec<f32>> {
    let (c0, c1) = w.segment_columns(segments.clone())?;
    let (m, cols) = (x.rows, c1 - c0);
    if x.cols != w.k || (x.cs != 1 && x.cols > 1) {
        return Err(Error::Kernel(format!(
            "packed linear of ({m}, {}) (column stride {}) by ({}, {})",
            x.cols, x.cs, w.k, w.n
        )));
    }
    if let Some(b) = bias {
        if b.len() != w.n {
            return Err(Error::Kernel(format!(
                "bias of {} for {} outputs",
                b.len(),
                w.n
            )));
        }
    }
    let finish = |row: &mut [f32]| {
        if epilogue == Epilogue::GeluErf {
            gelu_erf_in_place(row);
        }
    };
    if let (None, Some(source), true) = (w.data.get(), &w.half, m <= half_rows_product::MOST_ROWS) {
        if let Some(out) = half_rows_product::linear(x, &source.parts()?, c0..c1, bias, &finish)? {
            return Ok(out);
        }
    }
    let data = w.panel_data()?;
    let p0 = w.segments[segments.start].2;
    let p1 = w.segments[segments.end - 1].3;
    let mut out: Vec<f32> = Vec::with_capacity(m * cols);
    let ptr = OutPtr(out.as_mut_ptr());
    let (lda, k) = (x.rs, w.k);
    let blocks = m.div_ceil(MB).max(1);
    let tasks = blocks * (p1 - p0);
    let run = |t: usize| {
        let (blk, p) = (t / (p1 - p0), p0 + t % (p1 - p0));
        let r0 = blk * MB;
        let rows = MB.min(m - r0);
        let panel = w.panels[p];
        let col = panel.col - c0;
        // SAFETY: `x` is a bounds-checked (m, k) view with contiguous rows; the panel
        // holds k x PANEL floats; the task writes rows r0..r0+rows, columns
        // col..col+width of the (m, cols) output, which no other task touches, and
        // every element of the output is written by exactly one task (the panels tile
        // the columns, the blocks tile the rows) before `set_len`.
        unsafe {
            panel_product::<PANEL>(
                rows,
                k,
                x.ptr().add(r0 * lda),
                lda,
                data.as_ptr().add(p * k * PANEL),
                panel.width,
                ptr.get().add(r0 * cols + col),
                cols,
                match bias {
                    Some(b) => Start::Bias(b.as_ptr().add(panel.col)),
                    None => Start::Zero,
                },
            )
        }
        if epilogue != Epilogue::None {
            for r in r0..r0 + rows {
                // SAFETY: the same block of the output this task just wrote, and only it.
                let block = unsafe {
                    std::slice::from_raw_parts_mut(ptr.get().add(r * cols + col), panel.width)
                };
                finish(block);
            }
        }
    };
    if m > 0 && cols > 0 {
        if tasks == 1 || rayon::current_num_threads() == 1 || m * k * cols < 1 << 18 {
            (0..tasks).for_each(run);
        } else {
            (0..tasks).into_par_iter().with_max_len(1).for_each(run);
        }
    }
    // SAFETY: every one of the m * cols elements was written above.
    unsafe { out.set_len(m * cols) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kernels::test_values as values;

    /// Half-precision matrices held by the test, as a checkpoint's map would hold them.
    #[derive(Debug)]
    struct OwnedHalf {
        bytes: Vec<Vec<u8>>,
        rows: Vec<usize>,
        cols: usize,
        bf16: bool,
    }

    impl HalfSource for OwnedHalf {
        fn parts(&self) -> Result<Vec<HalfRows<'_>>> {
            Ok(self
                .bytes
                .iter()
                .zip(&self.rows)
                .map(|(b, &rows)| HalfRows {
                    bytes: b,
                    rows,
                    cols: self.cols,
                    bf16: self.bf16,
                })
                .collect())
        }
    }

    /// Half-precision `(out, in)` parts stacked along their outputs give the products and the
    /// matrix of their exact f32 values, transposed and concatenated (f16 and bf16, a split
    /// inside a panel, parts that end inside a panel): read in place for a few rows, packed
    /// on the first longer input into the same panels as the f32 values.
    #[test]
    #[cfg_attr(
        not(isa_avx2),
        ignore = "needs AVX2 + FMA + F16C, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn half_rows_multiply_like_their_f32_values() -> Result<()> {
        assert!(
            available(),
            "built for this CPU's kernels, running without them"
        );
        let k = 70;
        let outs = [37usize, 20, 61];
        let n: usize = outs.iter().sum();
        let bias = values(n, 4);
        for bf16 in [false, true] {
            let mut bytes = Vec::new();
            let mut f32_rows = Vec::new(); // (out, in) of all parts, exact values
            for (i, &rows) in outs.iter().enumerate() {
                let v = values(rows * k, 10 + i);
                let (b, wide) = crate::kernels::test_half(&v, bf16);
                f32_rows.extend(wide);
                bytes.push(b);
            }
            let source = OwnedHalf {
                bytes,
                rows: outs.to_vec(),
                cols: k,
                bf16,
            };
            let half = PackedWeight::from_half(Arc::new(source), &[outs[0]])?
                .ok_or_else(|| Error::Kernel("no micro-kernel on this CPU".into()))?;
            let full = PackedWeight::pack(MatRef::row_major(&f32_rows, n, k)?.t(), &[outs[0]])
                .ok_or_else(|| Error::Kernel("no micro-kernel on this CPU".into()))?;
            assert_eq!(half.segment_count(), 2);
            assert_eq!(half.unpack()?, full.unpack()?, "bf16 {bf16}");
            assert!(half.data.get().is_none(), "unpacking packed the panels");
            for (m, segments) in [
                (3, 0..2),
                (9, 1..2),
                (half_rows_product::MOST_ROWS + 1, 0..2),
            ] {
                let xs = values(m * k, 5);
                let x = MatRef::row_major(&xs, m, k)?;
                let got = linear(x, &half, segments.clone(), Some(&bias))?;
                let want = linear(x, &full, segments.clone(), Some(&bias))?;
                for (g, w) in got.iter().zip(&want) {
                    // Sums in another order: a few ulp of the larger terms.
                    let tol = 2e-6 * w.abs().max(1.0);
                    assert!((g - w).abs() <= tol, "bf16 {bf16} m {m}: {g} vs {w}");
                }
                // Short inputs never pack (where they can be read in place); longer ones do.
                let packed = m > half_rows_product::MOST_ROWS || !half_rows_product::available();
                assert_eq!(half.data.get().is_some(), packed, "m {m}");
            }
            let data = half.data.get().map(|d| d.to_vec());
            assert_eq!(data.as_deref(), full.data.get().map(|d| &d[..]));
            assert_eq!(half.unpack()?, full.unpack()?, "bf16 {bf16}, packed");
        }
        let short = OwnedHalf {
            bytes: vec![vec![0u8; 10]],
            rows: vec![2],
            cols: 3,
            bf16: false,
        };
        assert!(PackedWeight::from_half(Arc::new(short), &[]).is_err());
        Ok(())
    }

    /// Panels filled from rows on demand are the panels of the whole matrix; a fill that
    /// fails is an error.
    #[test]
    #[cfg_attr(
        not(isa_avx2),
        ignore = "needs AVX2 + FMA + F16C, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn packing_from_rows_equals_packing_the_matrix() -> Result<()> {
        assert!(
            available(),
            "built for this CPU's kernels, running without them"
        );
        let (n, k) = (101, 70); // (out, in): a last panel of 5 columns
        let w = values(n * k, 6);
        let rows = |first: usize, count: usize, out: &mut [f32]| {
            out.copy_from_slice(&w[first * k..(first + count) * k]);
            true
        };
        let from_rows = PackedWeight::pack_rows(k, n, &rows)?
            .ok_or_else(|| Error::Kernel("no micro-kernel on this CPU".into()))?;
        let whole = PackedWeight::pack(MatRef::row_major(&w, n, k)?.t(), &[])
            .ok_or_else(|| Error::Kernel("no micro-kernel on this CPU".into()))?;
        assert_eq!(
            from_rows.data.get().map(|d| &d[..]),
            whole.data.get().map(|d| &d[..])
        );
        assert_eq!(from_rows.dims(), (k, n));
        let failing = |_: usize, _: usize, _: &mut [f32]| false;
        assert!(PackedWeight::pack_rows(k, n, &failing).is_err());
        Ok(())
    }

    #[test]
    #[cfg_attr(
        not(isa_avx2),
        ignore = "needs AVX2 + FMA + F16C, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn packed_linear_equals_a_plain_product() -> Result<()> {
        assert!(
            available(),
            "built for this CPU's kernels, running without them"
        );
        // Sizes that exercise every edge: rows not a multiple of 8, columns not a multiple
        // of 48 or 16, a split inside a panel, depth over several depth blocks (KC).
        for (m, k, n, split) in [
            (19, 300, 101, 37),
            (8, 5, 48, 48),
            (3, 129, 16, 0),
            (33, 64, 200, 96),
            (11, 1100, 60, 48),
        ] {
            let x = values(m * k, 1);
            let w = values(k * n, 2);
            let bias = values(n, 3);
            let packed = PackedWeight::pack(MatRef::row_major(&w, k, n)?, &[split])
                .ok_or_else(|| Error::Kernel("no micro-kernel on this CPU".into()))?;
            assert_eq!(packed.unpack()?, w);
            let xm = MatRef::row_major(&x, m, k)?;
            let nseg = if split == 0 || split == n { 1 } else { 2 };
            let all = linear(xm, &packed, 0..nseg, Some(&bias))?;
            for i in 0..m {
                for j in 0..n {
                    let expected: f32 =
                        bias[j] + (0..k).map(|t| x[i * k + t] * w[t * n + j]).sum::<f32>();
                    let got = all[i * n + j];
                    assert!(
                        (got - expected).abs() <= 1e-4,
                        "({i}, {j}): {got} vs {expected}"
                    );
                }
            }
            if nseg == 2 {
                let tail = linear(xm, &packed, 1..2, None)?;
                let nt = n - split;
                for i in 0..m {
                    for j in 0..nt {
                        let expected: f32 = (0..k)
                            .map(|t| x[i * k + t] * w[t * n + split + j])
                            .sum::<f32>();
                        assert!((tail[i * nt + j] - expected).abs() <= 1e-4);
                    }
                }
            }
        }
        Ok(())
    }
}
