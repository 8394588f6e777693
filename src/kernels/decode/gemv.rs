//! `y = W x + b` for one input row (a decode step): the rows of `W` split among the
//! threads, each output a dot product in independent lanes. Reading `W` is the whole
//! cost; the `gemm` crate's path for one row read it at 14.6 GB/s where this reads it at
//! 20.7 GB/s (49152 x 576, 2 threads, see docs/performance-archive.md).

use crate::error::{Error, Result};
use crate::kernels::decode::f16_kernels;
use crate::kernels::decode::gemv_avx512;
use crate::kernels::widen::Load16;

/// Independent partial sums per dot product (one AVX-512 vector, two AVX2 ones); 32 and 64
/// measured no faster.
const LANES: usize = 16;

/// Most outputs per task (the gated kernel keeps one task's up-projection on the stack).
pub(crate) const ROWS_PER_TASK: usize = 256;
/// Tasks per thread: equal tasks, so that a 576-row product on two threads does not run as
/// 256 + 256 | 64 (see docs/performance-archive.md).
const TASKS_PER_THREAD: usize = 4;

/// Outputs per task for `n` outputs: `n / (threads * TASKS_PER_THREAD)` rounded up to a
/// multiple of `align`, between `align` and `most`.
pub(crate) fn task_len(n: usize, align: usize, most: usize) -> usize {
    task_len_per(n, align, most, TASKS_PER_THREAD)
}

/// [`task_len`] for `per_thread` tasks a thread.
pub(crate) fn task_len_per(n: usize, align: usize, most: usize, per_thread: usize) -> usize {
    let tasks = rayon::current_num_threads().max(1) * per_thread.max(1);
    n.div_ceil(tasks)
        .div_ceil(align)
        .max(1)
        .saturating_mul(align)
        .min(most.max(align))
}

/// A weight element the kernels widen to f32 as they read it (f32 sums; the scalar
/// widening is [`Load16::to_f32`]).
pub(crate) trait Widen: Load16 {
    /// Whether the portable loops of [`gemv`] read four rows at a time (measured faster for
    /// f32, slower for bf16: see docs/performance-archive.md).
    const FOUR_ROWS: bool = false;

    /// `sum a[i] b[i]` by a kernel of this type's own, where it has one.
    fn dot_special(_a: &[Self], _b: &[f32]) -> Option<f32> {
        None
    }

    /// `ys += x W[:, j0..]` (see [`add_columns`]) by a kernel of this type's own.
    fn add_columns_special(
        _w: &[Self],
        _x: &[f32],
        _out: usize,
        _j0: usize,
        _ys: &mut [f32],
    ) -> bool {
        false
    }
}

impl Widen for half::f16 {
    /// The hardware conversion (F16C / AVX-512F): the compiler cannot vectorise the
    /// scalar one.
    fn dot_special(a: &[Self], b: &[f32]) -> Option<f32> {
        crate::kernels::decode::f16_kernels::dot(a, b)
    }

    fn add_columns_special(w: &[Self], x: &[f32], out: usize, j0: usize, ys: &mut [f32]) -> bool {
        crate::kernels::decode::f16_kernels::add_columns(w, x, out, j0, ys)
    }
}

impl Widen for f32 {
    const FOUR_ROWS: bool = true;
}

impl Widen for half::bf16 {}

/// `y[j] = dot(W[j], x) + b[j]` for `W` `(out, in)` row-major, f32 or bf16.
///
/// # Shapes
/// - `w`: `out * in` values, `x`: `in`, `bias`: `out`, `y`: `out`
pub(crate) fn gemv<T: Widen>(
    w: &[T],
    x: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<()> {
    let (out, inp) = check(w.len(), x, bias, y)?;
    let len = task_len(out, 4, ROWS_PER_TASK);
    let work = |(c, ys): (usize, &mut [f32])| {
        let j0 = c * len;
        dot_rows(&w[j0 * inp..(j0 + ys.len()) * inp], x, ys);
        if let Some(b) = bias {
            for (yv, bv) in ys.iter_mut().zip(&b[j0..]) {
                *yv += bv;
            }
        }
    };
    if out * inp < 1 << 16 {
        y.chunks_mut(len).enumerate().for_each(work);
    } else {
        crate::kernels::decode::keep_warm::for_each_chunk(y, len, |c, ys| {
            work((c, ys));
            Ok(())
        })?;
    }
    Ok(())
}

/// `(out, in)` when `weights` values, `x`, `bias` and `y` fit together.
fn check(weights: usize, x: &[f32], bias: Option<&[f32]>, y: &[f32]) -> Result<(usize, usize)> {
    let (out, inp) = (y.len(), x.len());
    if weights != out * inp || bias.is_some_and(|b| b.len() != out) {
        return Err(Error::Kernel(format!(
            "matrix-vector product of {weights} weights by {inp} inputs into {out} outputs"
        )));
    }
    Ok((out, inp))
}

/// `sum a[i] b[i]`, with the widest vectors the CPU has.
fn dot<T: Widen>(a: &[T], b: &[f32]) -> f32 {
    if let Some(v) = T::dot_special(a, b) {
        return v;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let (avx512, avx2) = wide_vectors();
        if avx512 {
            // SAFETY: the CPU has AVX-512F (checked by `wide_vectors`).
            return unsafe { dot_avx512(a, b) };
        }
        if avx2 {
            // SAFETY: the CPU has AVX2 (checked by `wide_vectors`).
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_lanes(a, b)
}

/// `ys[r] = dot(W[r], x)` for the rows of a block `w` (`ys.len()` rows of `x.len()`):
/// four rows at a time where [`Widen::FOUR_ROWS`] (four independent streams keep more reads
/// in flight than one), else row by row.
pub(crate) fn dot_rows<T: Widen>(w: &[T], x: &[f32], ys: &mut [f32]) {
    if gemv_avx512::dot_rows(w, x, ys) {
        return;
    }
    let inp = x.len();
    if !T::FOUR_ROWS {
        for (r, yv) in ys.iter_mut().enumerate() {
            *yv = dot(&w[r * inp..(r + 1) * inp], x);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let (avx512, avx2) = wide_vectors();
        if avx512 {
            // SAFETY: the CPU has AVX-512F (checked by `wide_vectors`).
            return unsafe { dot_rows_avx512(w, x, ys) };
        }
        if avx2 {
            // SAFETY: the CPU has AVX2 (checked by `wide_vectors`).
            return unsafe { dot_rows_avx2(w, x, ys) };
        }
    }
    dot_rows_lanes(w, x, ys);
}

/// [`dot_rows_lanes`] compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_rows_avx512<T: Widen>(w: &[T], x: &[f32], ys: &mut [f32]) {
    dot_rows_lanes(w, x, ys);
}

/// [`dot_rows_lanes`] compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2 (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_rows_avx2<T: Widen>(w: &[T], x: &[f32], ys: &mut [f32]) {
    dot_rows_lanes(w, x, ys);
}

#[inline(always)]
fn dot_rows_lanes<T: Widen>(w: &[T], x: &[f32], ys: &mut [f32]) {
    let inp = x.len();
    let quads = ys.len() / 4;
    for q in 0..quads {
        let base = 4 * q * inp;
        let r = |i: usize| &w[base + i * inp..base + (i + 1) * inp];
        let (r0, r1, r2, r3) = (r(0), r(1), r(2), r(3));
        let mut acc = [[0f32; LANES]; 4];
        let xs = x.chunks_exact(LANES);
        let tail_x = xs.remainder();
        for ((((a, b), c), d), xv) in r0
            .chunks_exact(LANES)
            .zip(r1.chunks_exact(LANES))
            .zip(r2.chunks_exact(LANES))
            .zip(r3.chunks_exact(LANES))
            .zip(xs)
        {
            for k in 0..LANES {
                acc[0][k] += a[k].to_f32() * xv[k];
                acc[1][k] += b[k].to_f32() * xv[k];
                acc[2][k] += c[k].to_f32() * xv[k];
                acc[3][k] += d[k].to_f32() * xv[k];
            }
        }
        let t0 = inp - tail_x.len();
        for (i, row) in [r0, r1, r2, r3].iter().enumerate() {
            let tail: f32 = row[t0..]
                .iter()
                .zip(tail_x)
                .map(|(a, b)| a.to_f32() * b)
                .sum();
            ys[4 * q + i] = acc[i].iter().sum::<f32>() + tail;
        }
    }
    for r in 4 * quads..ys.len() {
        ys[r] = dot_lanes(&w[r * inp..(r + 1) * inp], x);
    }
}

/// Whether this CPU runs AVX-512F and AVX2 loops here, under the crate's cap
/// (`CANDLE_ATTENTION_ISA`, [`crate::kernels::simd::isa`]).
#[cfg(target_arch = "x86_64")]
fn wide_vectors() -> (bool, bool) {
    use crate::kernels::simd::{isa, Isa};
    let isa = isa();
    (
        isa == Isa::Avx512,
        matches!(isa, Isa::Avx512 | Isa::Avx2) && is_x86_feature_detected!("avx2"),
    )
}

/// [`dot_lanes`] compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512<T: Widen>(a: &[T], b: &[f32]) -> f32 {
    dot_lanes(a, b)
}

/// [`dot_lanes`] compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2 (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2<T: Widen>(a: &[T], b: &[f32]) -> f32 {
    dot_lanes(a, b)
}

/// `sum a[i] b[i]` in [`LANES`] lanes (vectorised by the compiler), then the tail.
#[inline(always)]
fn dot_lanes<T: Widen>(a: &[T], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x.to_f32() * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..LANES {
            acc[k] += x[k].to_f32() * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y = x W + b` for weights stored `(in, out)` row-major (the transposed form), f32, bf16
/// or f16: each task adds `x[k] W[k, :]` over a stretch of `k` into a partial sum, and the
/// partial sums are added at the end.
pub(crate) fn gemv_t<T: Widen>(
    w: &[T],
    x: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<()> {
    let (out, inp) = check(w.len(), x, bias, y)?;
    match bias {
        Some(b) => y.copy_from_slice(b),
        None => y.fill(0.0),
    }
    if inp == 0 {
        return Ok(());
    }
    // Each task streams a contiguous stretch of rows into a partial sum of its own (column
    // blocks would read every row in pieces, at the weight's row stride).
    let rows = task_len(inp, 4, usize::MAX);
    let mut partials = vec![0f32; inp.div_ceil(rows) * out];
    let add = |(t, acc): (usize, &mut [f32])| {
        let (r0, r1) = (t * rows, ((t + 1) * rows).min(inp));
        add_rows(&w[r0 * out..r1 * out], &x[r0..r1], acc);
    };
    if out * inp < 1 << 16 {
        partials.chunks_mut(out).enumerate().for_each(add);
    } else {
        crate::kernels::decode::keep_warm::for_each_chunk(&mut partials, out, |t, acc| {
            add((t, acc));
            Ok(())
        })?;
    }
    for p in partials.chunks_exact(out) {
        for (yv, pv) in y.iter_mut().zip(p) {
            *yv += pv;
        }
    }
    Ok(())
}

/// `acc += x W` for the `x.len()` rows of `W` (`acc.len()` columns each), the rows read in
/// order, with the widest vectors the CPU has.
pub(crate) fn add_rows<T: Widen>(w: &[T], x: &[f32], acc: &mut [f32]) {
    if !gemv_avx512::add_rows(w, x, acc) {
        add_columns(w, x, acc.len(), 0, acc);
    }
}

/// `ys += x W[:, j0..j0 + ys.len()]` for `W` `(in, out)`, with the widest vectors the CPU
/// has.
fn add_columns<T: Widen>(w: &[T], x: &[f32], out: usize, j0: usize, ys: &mut [f32]) {
    if T::add_columns_special(w, x, out, j0, ys) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let (avx512, avx2) = wide_vectors();
        if avx512 {
            // SAFETY: the CPU has AVX-512F (checked by `wide_vectors`).
            return unsafe { add_columns_avx512(w, x, out, j0, ys) };
        }
        if avx2 {
            // SAFETY: the CPU has AVX2 (checked by `wide_vectors`).
            return unsafe { add_columns_avx2(w, x, out, j0, ys) };
        }
    }
    add_columns_lanes(w, x, out, j0, ys);
}

/// [`add_columns_lanes`] compiled for AVX-512.
///
/// # Safety
/// The CPU has AVX-512F (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_columns_avx512<T: Widen>(w: &[T], x: &[f32], out: usize, j0: usize, ys: &mut [f32]) {
    add_columns_lanes(w, x, out, j0, ys);
}

/// [`add_columns_lanes`] compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2 (this function's target features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn add_columns_avx2<T: Widen>(w: &[T], x: &[f32], out: usize, j0: usize, ys: &mut [f32]) {
    add_columns_lanes(w, x, out, j0, ys);
}

/// One row of `W` at a time, added to all of `ys` (vectorised by the compiler).
#[inline(always)]
fn add_columns_lanes<T: Widen>(w: &[T], x: &[f32], out: usize, j0: usize, ys: &mut [f32]) {
    let n = ys.len();
    for (k, &xk) in x.iter().enumerate() {
        for (yv, wv) in ys.iter_mut().zip(&w[k * out + j0..k * out + j0 + n]) {
            *yv += xk * wv.to_f32();
        }
    }
}

/// A contiguous CPU weight in one of the types the kernels read.
enum CpuWeight<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    F16(&'a [half::f16]),
}

impl<'a> CpuWeight<'a> {
    /// The values of a contiguous CPU tensor; `None` for other storage, dtypes, or f16 on a
    /// CPU without the hardware conversion.
    fn of(storage: &'a candle_core::Storage, layout: &candle_core::Layout) -> Option<Self> {
        use candle_core::{CpuStorage, Storage};
        let (s, e) = layout.contiguous_offsets()?;
        match storage {
            Storage::Cpu(CpuStorage::F32(v)) => Some(Self::F32(&v[s..e])),
            Storage::Cpu(CpuStorage::BF16(v)) => Some(Self::Bf16(&v[s..e])),
            Storage::Cpu(CpuStorage::F16(v)) if f16_kernels::available() => {
                Some(Self::F16(&v[s..e]))
            }
            _ => None,
        }
    }
}

/// `x` as f32 values when it is one row on the CPU and neither it nor the weights track
/// gradients: the case of the one-row kernels.
fn one_row_input(
    x: &candle_core::Tensor,
    weights: &[&candle_core::Tensor],
    biases: &[Option<&candle_core::Tensor>],
) -> Result<Option<Vec<f32>>> {
    use candle_core::{DType, Tensor, D};
    let inp = x.dim(D::Minus1)?;
    let tracks = x.track_op()
        || weights.iter().any(|w| w.track_op())
        || biases.iter().flatten().any(|b| Tensor::track_op(b));
    if x.elem_count() != inp
        || !x.device().is_cpu()
        || tracks
        || !weights.iter().all(|w| w.is_contiguous())
    {
        return Ok(None);
    }
    Ok(Some(x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?))
}

fn bias_values(bias: Option<&candle_core::Tensor>) -> Result<Option<Vec<f32>>> {
    Ok(bias
        .map(|b| b.to_dtype(candle_core::DType::F32)?.to_vec1())
        .transpose()?)
}

/// `y` (the rows of `x`, `out` values each) as a tensor of `x`'s shape with its last
/// dimension `out`, in `x`'s dtype.
pub(crate) fn output_like(
    x: &candle_core::Tensor,
    y: Vec<f32>,
    out: usize,
) -> Result<candle_core::Tensor> {
    let mut shape = x.dims().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = out;
    }
    Ok(candle_core::Tensor::from_vec(y, shape, x.device())?.to_dtype(x.dtype())?)
}

/// `x W^T + b` for `W` `(out, in)` (`rows`) or `x W + b` for `W` `(in, out)`, on the
/// matrix-vector kernels when `x` is one row on the CPU, nothing tracks gradients and `W`
/// is a contiguous f32 or bf16 tensor, or f16 on a CPU with the hardware conversion
/// (AVX-512F, or AVX2 + F16C + FMA); `None` otherwise (the caller multiplies).
///
/// # Shapes
/// - `x`: `(..., in)` holding one row; returns `(..., out)` in `x`'s dtype
pub(crate) fn one_row_linear(
    x: &candle_core::Tensor,
    w: &candle_core::Tensor,
    bias: Option<&candle_core::Tensor>,
    rows: bool,
) -> Result<Option<candle_core::Tensor>> {
    let Some(xs) = one_row_input(x, &[w], &[bias])? else {
        return Ok(None);
    };
    let (a, b) = w.dims2()?;
    let (out, w_in) = if rows { (a, b) } else { (b, a) };
    if w_in != xs.len() {
        return Ok(None);
    }
    let bs = bias_values(bias)?;
    let bs = bs.as_deref();
    let mut y = vec![0f32; out];
    {
        let (guard, layout) = w.storage_and_layout();
        let Some(weight) = CpuWeight::of(&guard, layout) else {
            return Ok(None);
        };
        match (weight, rows) {
            (CpuWeight::F32(v), true) => gemv(v, &xs, bs, &mut y)?,
            (CpuWeight::F32(v), false) => gemv_t(v, &xs, bs, &mut y)?,
            (CpuWeight::Bf16(v), true) => gemv(v, &xs, bs, &mut y)?,
            (CpuWeight::Bf16(v), false) => gemv_t(v, &xs, bs, &mut y)?,
            (CpuWeight::F16(v), true) => gemv(v, &xs, bs, &mut y)?,
            (CpuWeight::F16(v), false) => gemv_t(v, &xs, bs, &mut y)?,
        }
    }
    let out = y.len();
    Ok(Some(output_like(x, y, out)?))
}

/// `silu(x W_g^T + b_g) * (x W_u^T + b_u)`, the gated half of a SwiGLU MLP, for one input
/// row in one pass over the threads (each task takes the same rows of both weights); `None`
/// where [`one_row_linear`] would be `None` or the weights differ in dtype.
///
/// # Shapes
/// - `x`: `(..., in)` holding one row; `W_g`, `W_u`: `(out, in)`; returns `(..., out)` in
///   `x`'s dtype
pub(crate) fn one_row_gated(
    x: &candle_core::Tensor,
    gate: (&candle_core::Tensor, Option<&candle_core::Tensor>),
    up: (&candle_core::Tensor, Option<&candle_core::Tensor>),
) -> Result<Option<candle_core::Tensor>> {
    let Some(xs) = one_row_input(x, &[gate.0, up.0], &[gate.1, up.1])? else {
        return Ok(None);
    };
    let (out, w_in) = gate.0.dims2()?;
    if w_in != xs.len() || up.0.dims2()? != (out, w_in) {
        return Ok(None);
    }
    let (bg, bu) = (bias_values(gate.1)?, bias_values(up.1)?);
    let biases = (bg.as_deref(), bu.as_deref());
    let mut y = vec![0f32; out];
    {
        let (gg, gl) = gate.0.storage_and_layout();
        let (ug, ul) = up.0.storage_and_layout();
        let (Some(wg), Some(wu)) = (CpuWeight::of(&gg, gl), CpuWeight::of(&ug, ul)) else {
            return Ok(None);
        };
        match (wg, wu) {
            (CpuWeight::F32(g), CpuWeight::F32(u)) => gemv_gated(g, u, &xs, biases, &mut y)?,
            (CpuWeight::Bf16(g), CpuWeight::Bf16(u)) => gemv_gated(g, u, &xs, biases, &mut y)?,
            (CpuWeight::F16(g), CpuWeight::F16(u)) => gemv_gated(g, u, &xs, biases, &mut y)?,
            _ => return Ok(None),
        }
    }
    let out = y.len();
    Ok(Some(output_like(x, y, out)?))
}

/// `y[j] = silu(dot(W_g[j], x) + b_g[j]) * (dot(W_u[j], x) + b_u[j])` with
/// `silu(g) = g / (1 + e^-g)`.
///
/// # Shapes
/// - `wg`, `wu`: `out * in` values, `x`: `in`, biases: `out`, `y`: `out`
pub(crate) fn gemv_gated<T: Widen>(
    wg: &[T],
    wu: &[T],
    x: &[f32],
    (bg, bu): (Option<&[f32]>, Option<&[f32]>),
    y: &mut [f32],
) -> Result<()> {
    let (_, inp) = check(wg.len(), x, bg, y)?;
    check(wu.len(), x, bu, y)?;
    let len = task_len(y.len(), 4, ROWS_PER_TASK);
    let work = |(c, ys): (usize, &mut [f32])| {
        let (j0, n) = (c * len, ys.len());
        let mut ups = [0f32; ROWS_PER_TASK];
        let ups = &mut ups[..n];
        dot_rows(&wg[j0 * inp..(j0 + n) * inp], x, ys);
        dot_rows(&wu[j0 * inp..(j0 + n) * inp], x, ups);
        for (j, (yv, uv)) in ys.iter_mut().zip(ups.iter()).enumerate() {
            let g = *yv + bg.map_or(0.0, |b| b[j0 + j]);
            let u = *uv + bu.map_or(0.0, |b| b[j0 + j]);
            *yv = g / (1.0 + (-g).exp()) * u;
        }
    };
    if 2 * y.len() * inp < 1 << 16 {
        y.chunks_mut(len).enumerate().for_each(work);
    } else {
        crate::kernels::decode::keep_warm::for_each_chunk(y, len, |c, ys| {
            work((c, ys));
            Ok(())
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generic loops' vector widths follow the crate's instruction-set cap (CI runs the
    /// unit tests under `CANDLE_ATTENTION_ISA=avx2` and `scalar`).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn widths_follow_the_isa_cap() {
        use crate::kernels::simd::{isa, Isa};
        let (avx512, avx2) = wide_vectors();
        assert_eq!(avx512, isa() == Isa::Avx512);
        assert_eq!(avx2, isa() != Isa::Scalar);
    }

    /// `n` values `((i * mul) % m - off) / div`: small multiples of `1 / div`.
    fn pattern(n: usize, mul: usize, m: usize, off: f32, div: f32) -> Vec<f32> {
        (0..n).map(|i| ((i * mul % m) as f32 - off) / div).collect()
    }

    /// `w` `(out, inp)` row-major as `(inp, out)` row-major.
    fn transposed(w: &[f32], out: usize, inp: usize) -> Vec<f32> {
        let mut wt = vec![0f32; out * inp];
        for j in 0..out {
            for k in 0..inp {
                wt[k * out + j] = w[j * inp + k];
            }
        }
        wt
    }

    #[test]
    fn equals_the_definition() -> Result<()> {
        for (out, inp) in [(3, 5), (300, 37), (1000, 576)] {
            let w = pattern(out * inp, 31, 17, 8.0, 9.0);
            let x = pattern(inp, 7, 11, 5.0, 4.0);
            let b: Vec<f32> = (0..out).map(|i| i as f32 / 100.0).collect();
            let mut y = vec![f32::NAN; out];
            gemv(&w, &x, Some(&b), &mut y)?;
            for j in 0..out {
                let want: f64 = (0..inp)
                    .map(|i| w[j * inp + i] as f64 * x[i] as f64)
                    .sum::<f64>()
                    + b[j] as f64;
                assert!(
                    (y[j] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "{out}x{inp} row {j}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn half_and_transposed_forms_equal_the_f32_one() -> Result<()> {
        let (out, inp) = (700, 600);
        let w = pattern(out * inp, 31, 17, 8.0, 8.0);
        let x = pattern(inp, 7, 11, 5.0, 4.0);
        let b: Vec<f32> = (0..out).map(|i| i as f32 / 64.0).collect();
        let mut want = vec![0f32; out];
        gemv(&w, &x, Some(&b), &mut want)?;
        // Exactly representable in both half formats (multiples of 1/8 up to 1).
        let wb: Vec<half::bf16> = w.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let wt = transposed(&w, out, inp);
        let mut got = vec![f32::NAN; out];
        let close = |got: &[f32], what: &str| {
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-3 * (1.0 + w.abs()), "{what}: {g} vs {w}");
            }
        };
        gemv(&wb, &x, Some(&b), &mut got)?;
        close(&got, "bf16 rows");
        gemv_t(&wt, &x, Some(&b), &mut got)?;
        close(&got, "f32 transposed");
        let wtb: Vec<half::bf16> = wt.iter().map(|&v| half::bf16::from_f32(v)).collect();
        gemv_t(&wtb, &x, Some(&b), &mut got)?;
        close(&got, "bf16 transposed");
        // f16: the hardware conversion where the CPU has it, the scalar one elsewhere.
        let wh: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
        gemv(&wh, &x, Some(&b), &mut got)?;
        close(&got, "f16 rows");
        let wth: Vec<half::f16> = wt.iter().map(|&v| half::f16::from_f32(v)).collect();
        gemv_t(&wth, &x, Some(&b), &mut got)?;
        close(&got, "f16 transposed");
        Ok(())
    }

    #[test]
    fn gated_rows_equal_silu_of_gate_times_up() -> Result<()> {
        let (out, inp) = (300, 70);
        let wg = pattern(out * inp, 31, 17, 8.0, 9.0);
        let wu = pattern(out * inp, 13, 19, 9.0, 7.0);
        let x = pattern(inp, 7, 11, 5.0, 4.0);
        let (bg, bu): (Vec<f32>, Vec<f32>) = (0..out)
            .map(|i| (i as f32 / 50.0 - 3.0, 1.0 - i as f32 / 80.0))
            .unzip();
        for biases in [(None, None), (Some(&bg[..]), Some(&bu[..]))] {
            let mut y = vec![f32::NAN; out];
            gemv_gated(&wg, &wu, &x, biases, &mut y)?;
            for j in 0..out {
                let dot = |w: &[f32]| -> f64 {
                    (0..inp)
                        .map(|k| f64::from(w[j * inp + k]) * f64::from(x[k]))
                        .sum()
                };
                let g = dot(&wg) + biases.0.map_or(0.0, |b| f64::from(b[j]));
                let u = dot(&wu) + biases.1.map_or(0.0, |b| f64::from(b[j]));
                let want = g / (1.0 + (-g).exp()) * u;
                assert!(
                    (f64::from(y[j]) - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "row {j}"
                );
            }
        }
        Ok(())
    }

    /// The portable loops (what AVX2 and other CPUs run; AVX-512 ones take
    /// `gemv_avx512`) equal the definition too.
    #[test]
    fn portable_loops_equal_the_definition() {
        let (out, inp) = (7, 53);
        let w = pattern(out * inp, 31, 17, 8.0, 8.0);
        let x = pattern(inp, 7, 11, 5.0, 4.0);
        let want: Vec<f32> = (0..out)
            .map(|j| (0..inp).map(|k| w[j * inp + k] * x[k]).sum())
            .collect();
        let close = |got: &[f32], what: &str| {
            for (g, v) in got.iter().zip(&want) {
                assert!((g - v).abs() < 1e-4 * (1.0 + v.abs()), "{what}: {g} vs {v}");
            }
        };
        let mut ys = vec![f32::NAN; out];
        dot_rows_lanes(&w, &x, &mut ys);
        close(&ys, "four rows");
        let single: Vec<f32> = (0..out)
            .map(|j| dot_lanes(&w[j * inp..(j + 1) * inp], &x))
            .collect();
        close(&single, "one row");
        let wt = transposed(&w, out, inp);
        ys.fill(0.0);
        add_columns_lanes(&wt, &x, out, 0, &mut ys);
        close(&ys, "columns");
    }
}
