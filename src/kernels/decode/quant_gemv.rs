//! `y = W x` for a weight kept as a GGUF file stores it (ggml blocks), one input row at a
//! time, every block read once per product: with AVX-512 (or AVX2 + FMA + F16C) the block
//! types of real files are unpacked in registers and summed as they are read
//! (`quant_gemv_avx512`, `quant_gemv_avx2`); otherwise each
//! task dequantizes four rows at a time into its scratch (exactly, as gguf-py does) and
//! multiplies them with the f32 matrix-vector kernel, giving the sums the same weight
//! dequantized to f32 would give, bit for bit. Opted in ([`set_int8_activations`]), the
//! same block types are multiplied with `x` quantized to 8 bits instead (`quant_gemv_vnni`,
//! `quant_gemv_int8_avx2`), as llama.cpp does. Weights of one input width stacked along the
//! outputs (Q, K and V; a gate and its up projection) run as one pass over the threads.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};
use crate::kernels::activation::silu_times_in_place;
use crate::kernels::decode::gemv::{dot_rows, task_len_per, ROWS_PER_TASK};
use crate::kernels::decode::keep_warm;
use crate::kernels::decode::quant_gemv_avx2::Avx2;
use crate::kernels::decode::quant_gemv_avx512::{self, Avx512};
use crate::kernels::decode::quant_gemv_int8_avx2::Int8Avx2;
use crate::kernels::decode::quant_gemv_vnni::Vnni;
use crate::kernels::decode::row_kernels::{rows_in_runs, RowKernels};
use crate::kernels::quant::activations::QuantizedX;
use crate::kernels::quant::blocks::{self, QuantType};
use crate::kernels::scratch::with_scratch;

/// Whether GGUF products of a few rows quantize `x` to 8 bits ([`set_int8_activations`]).
static INT8_ACTIVATIONS: AtomicBool = AtomicBool::new(false);

/// Opts in to (or out of) 8-bit activations in the products of GGUF weights
/// on the CPU, as llama.cpp computes them: each product quantizes `x` once into blocks of 32
/// signed bytes with a scale each, and the weight's integers meet them in AVX-512 VNNI
/// dot-product instructions, or AVX2's byte multiply-adds. Faster where the unpacking, not
/// the memory, bounds a product (most of all with AVX2); not exact: the greedy tokens may
/// leave the f32 model's after a few (see `docs/guide/gguf.md`). Process-wide; off by
/// default. In decode steps every block type has 8-bit kernels with AVX-512 VNNI and with
/// AVX2 + FMA + F16C; CPUs without AVX2 stay exact. Prompts of more than a few
/// rows are 8-bit with AVX-512 VNNI, every integer block type (K-quants too) in one matrix
/// product (faster than the f32 micro-kernels, see docs/performance.md), and exact elsewhere. On
/// CUDA the same switch picks candle's quantized kernels (which round the activations to 8
/// bits) over the exact default there: the blocks dequantized on the device, then an f32
/// product. Metal always takes candle's kernels (see `docs/guide/features.md`).
pub fn set_int8_activations(on: bool) {
    INT8_ACTIVATIONS.store(on, Ordering::Relaxed);
}

/// Whether [`set_int8_activations`] is on.
pub fn int8_activations() -> bool {
    INT8_ACTIVATIONS.load(Ordering::Relaxed)
}

/// Rows dequantized together (the f32 kernel's group of rows).
const GROUP: usize = 4;

/// Tasks a thread per product: fewer, longer streams of blocks than the dense kernels' 4
/// (measured: docs/performance-archive.md).
const TASKS_PER_THREAD: usize = 2;

/// `bytes` (whole blocks of `ty`) dequantized into `out`: gguf-py's values, as
/// [`blocks::dequantize`] makes them, unpacked 16 at a time in registers where the AVX-512
/// row kernels take `ty` (the packed prompt products dequantize every weight on each call);
/// `false`, writing nothing, when the sizes do not agree.
pub(crate) fn dequantize(ty: QuantType, bytes: &[u8], out: &mut [f32]) -> bool {
    quant_gemv_avx512::dequantize(ty, bytes, out) || blocks::dequantize(ty, bytes, out)
}

/// The 8-bit row kernels a type runs on: AVX-512 VNNI (up to 4 rows of `x` per unpacked
/// pair of blocks) or AVX2 (up to 2 per block).
#[derive(Clone, Copy)]
enum Int8Rows {
    Vnni,
    Avx2,
}

impl Int8Rows {
    /// `ys[nx j + i] = W[j] x_i` for the whole `ty` rows in `rows` and the quantized rows
    /// `xq` (`nx` of them); `false` when the kernel refuses them.
    fn run(self, ty: QuantType, rows: &[u8], xq: &[QuantizedX], ys: &mut [f32]) -> bool {
        match self {
            Self::Vnni => rows_in_runs::<Vnni>(ty, rows, xq, xq.len(), ys),
            Self::Avx2 => rows_in_runs::<Int8Avx2>(ty, rows, xq, xq.len(), ys),
        }
    }
}

/// `ys[nx j + i] = W[j] x_i` for the whole `ty` rows `W` in `rows` and the `nx` rows of `xs`
/// on this CPU's row kernels (AVX-512, else AVX2 + FMA + F16C, both capped by
/// `CANDLE_ATTENTION_ISA`), each block unpacked once for up to 4 (AVX-512) or 2 (AVX2) rows
/// of `x` at a time; `false` when the CPU or type has none (rows dequantized into scratch).
fn kernel_rows(ty: QuantType, rows: &[u8], xs: &[f32], nx: usize, ys: &mut [f32]) -> bool {
    if Avx512::supports(ty) {
        rows_in_runs::<Avx512>(ty, rows, xs, nx, ys)
    } else if Avx2::supports(ty) {
        rows_in_runs::<Avx2>(ty, rows, xs, nx, ys)
    } else {
        false
    }
}

/// Checks a tree that sums each of `L` vectors of `L` lanes into lane `i` of its result: each
/// lane is its vector's sum, and the same bits whatever the other vectors hold (the rows
/// reduced together, or padding zeros, do not change a row's sum).
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) fn check_sum_tree<const L: usize>(tree: impl Fn(&[[f32; L]; L]) -> [f32; L]) {
    let lanes = |i: usize| -> [f32; L] {
        std::array::from_fn(|k| ((i * L + k) as f32 * 0.37).sin() * 10f32.powi(k as i32 % 5))
    };
    let v: [[f32; L]; L] = std::array::from_fn(lanes);
    let all = tree(&v);
    for (i, &got) in all.iter().enumerate() {
        let want: f64 = v[i].iter().map(|&x| f64::from(x)).sum();
        let size: f64 = v[i].iter().map(|&x| f64::from(x.abs())).sum();
        assert!(
            (f64::from(got) - want).abs() <= 1e-6 * size,
            "{i}: {got} vs {want}"
        );
        let mut alone = [[0f32; L]; L];
        alone[i] = v[i];
        assert_eq!(tree(&alone)[i].to_bits(), got.to_bits(), "{i}");
    }
}

/// `y[j] = sum_k W[j, k] x[k] (+ bias[j])` for `W` `(y.len(), x.len())` stored as `ty` rows
/// in `data` (one weight of [`quant_gemv_parts`]; the tests' reference).
#[cfg(test)]
pub(crate) fn quant_gemv(
    ty: QuantType,
    data: &[u8],
    x: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<()> {
    if bias.is_some_and(|b| b.len() != y.len()) {
        return Err(Error::Kernel(format!(
            "a bias of {:?} values for {} outputs",
            bias.map(<[f32]>::len),
            y.len()
        )));
    }
    quant_gemv_parts(&[(ty, data)], x, y)?;
    if let Some(b) = bias {
        for (yv, bv) in y.iter_mut().zip(b) {
            *yv += bv;
        }
    }
    Ok(())
}

/// [`quant_gemv`] for weights of one input width stacked along the outputs (`parts`: each
/// weight's type and rows; Q, K and V, or a gate and its up projection), in one pass over the
/// threads: `y` holds the parts' outputs one after the other (one row of `x`: the tests'
/// form of [`quant_gemv_parts_rows`]).
#[cfg(test)]
pub(crate) fn quant_gemv_parts(
    parts: &[(QuantType, &[u8])],
    x: &[f32],
    y: &mut [f32],
) -> Result<()> {
    quant_gemv_parts_rows(parts, x, x.len(), y)
}

/// [`quant_gemv_parts`] for the `xs.len() / inp` rows of `xs` at once, `y` `(rows, outputs)`:
/// one pass over the threads, each weight row read once for all of them (the sums are the
/// same bits as row by row).
pub(crate) fn quant_gemv_parts_rows(
    parts: &[(QuantType, &[u8])],
    xs: &[f32],
    inp: usize,
    y: &mut [f32],
) -> Result<()> {
    let nx = rows_in(xs, inp)?;
    let mut shaped = Vec::with_capacity(parts.len());
    for &(ty, data) in parts {
        let (row_bytes, rows) = row_shape(ty, data, inp)?;
        shaped.push((ty, data, row_bytes, rows));
    }
    let out: usize = shaped.iter().map(|p| p.3).sum();
    if out * nx != y.len() {
        return Err(Error::Kernel(format!(
            "products of {out} rows by {nx} x {inp} inputs into {} outputs",
            y.len()
        )));
    }
    if nx == 1 {
        return product(&shaped, xs, 1, y, int8_activations());
    }
    // The tasks write `(outputs, rows)`; turned into `(rows, outputs)` at the end.
    let mut yt = vec![0f32; y.len()];
    product(&shaped, xs, nx, &mut yt, int8_activations())?;
    transpose_into(&yt, nx, y);
    Ok(())
}

/// The number of rows of `inp` values in `xs`; an error when it is no whole number.
fn rows_in(xs: &[f32], inp: usize) -> Result<usize> {
    if inp == 0 || !xs.len().is_multiple_of(inp) {
        return Err(Error::Kernel(format!(
            "{} input values are no whole rows of {inp}",
            xs.len()
        )));
    }
    Ok(xs.len() / inp)
}

/// `y[i][j] = yt[j][i]` for `yt` `(n, nx)` into `y` `(nx, n)`.
fn transpose_into(yt: &[f32], nx: usize, y: &mut [f32]) {
    let n = yt.len() / nx.max(1);
    for (j, col) in yt.chunks_exact(nx).enumerate() {
        for (i, &v) in col.iter().enumerate() {
            y[i * n + j] = v;
        }
    }
}

/// `y[j] = silu(W_g[j] x) * (W_u[j] x)` ([`silu_times_in_place`]) for a gate
/// and an up projection of the same shape, `(y.len(), x.len())`, stored as `gate.0` and
/// `up.0` rows: each task multiplies its rows of both and combines them, one pass over the
/// threads for the MLP's first half.
#[cfg(test)]
pub(crate) fn quant_gemv_gated(
    gate: (QuantType, &[u8]),
    up: (QuantType, &[u8]),
    x: &[f32],
    y: &mut [f32],
) -> Result<()> {
    quant_gemv_gated_rows(gate, up, x, x.len(), y)
}

/// [`quant_gemv_gated`] for the `xs.len() / inp` rows of `xs` at once, `y` `(rows,
/// outputs)`: one pass over the threads, each weight row read once for all of them.
pub(crate) fn quant_gemv_gated_rows(
    gate: (QuantType, &[u8]),
    up: (QuantType, &[u8]),
    xs: &[f32],
    inp: usize,
    y: &mut [f32],
) -> Result<()> {
    let nx = rows_in(xs, inp)?;
    let out = y.len() / nx;
    if out * nx != y.len() {
        return Err(Error::Kernel(format!("{} outputs for {nx} rows", y.len())));
    }
    let ((gt, gd), (ut, ud)) = (gate, up);
    let (grb, gate_rows) = row_shape(gt, gd, inp)?;
    let (urb, up_rows) = row_shape(ut, ud, inp)?;
    if (gate_rows, up_rows) != (out, out) {
        return Err(Error::Kernel(format!(
            "a gate of {gate_rows} rows and an up projection of {up_rows} into {out} outputs"
        )));
    }
    let int8 = int8_activations();
    let int8_kernel = |ty: QuantType| int8_row_kernel(ty, int8);
    let xq = quantized_for([gt, ut], xs, inp, int8);
    let len = task_len_per(out, GROUP, ROWS_PER_TASK, TASKS_PER_THREAD);
    let x = Rows { xs, nx };
    let work = |(c, ys): (usize, &mut [f32])| -> Result<()> {
        let j0 = c * len;
        rows_of(gt, gd, grb, x, int8_kernel(gt).zip(xq.as_deref()), j0, ys)?;
        // The up projection's rows: on the stack for a decode step's task.
        let (mut stack, mut heap) = ([0f32; ROWS_PER_TASK], Vec::new());
        let u: &mut [f32] = match stack.get_mut(..ys.len()) {
            Some(u) => u,
            None => {
                heap.resize(ys.len(), 0f32);
                &mut heap
            }
        };
        rows_of(ut, ud, urb, x, int8_kernel(ut).zip(xq.as_deref()), j0, u)?;
        silu_times_in_place(ys, u);
        Ok(())
    };
    // The tasks write `(outputs, rows)` (in `y` itself for one row).
    let mut yt = if nx == 1 {
        Vec::new()
    } else {
        vec![0f32; y.len()]
    };
    let target: &mut [f32] = if nx == 1 { y } else { &mut yt };
    if 2 * out * inp * nx < 1 << 16 {
        target.chunks_mut(len * nx).enumerate().try_for_each(work)?;
    } else {
        keep_warm::for_each_chunk(target, len * nx, |c, ys| work((c, ys)))?;
    }
    if nx > 1 {
        transpose_into(&yt, nx, y);
    }
    Ok(())
}

/// `nx` input rows, one after the other in `xs`.
#[derive(Clone, Copy)]
struct Rows<'a> {
    xs: &'a [f32],
    nx: usize,
}

/// `(bytes a row, rows)` of a `ty` weight in `data` for inputs of `inp` values; an error when
/// `data` is no whole number of such rows.
fn row_shape(ty: QuantType, data: &[u8], inp: usize) -> Result<(usize, usize)> {
    ty.bytes_of(inp)
        .filter(|&rb| rb > 0 && data.len().is_multiple_of(rb))
        .map(|rb| (rb, data.len() / rb))
        .ok_or_else(|| {
            Error::Kernel(format!(
                "{} bytes of {ty} are no whole rows of {inp} values",
                data.len()
            ))
        })
}

/// Each row of `xs` (rows of `inp`) quantized to 8 bits, once for a pass, where `int8` and
/// one of `types` has an 8-bit kernel on this CPU.
fn quantized_for(
    types: impl IntoIterator<Item = QuantType>,
    xs: &[f32],
    inp: usize,
    int8: bool,
) -> Option<Vec<QuantizedX>> {
    if !types
        .into_iter()
        .any(|ty| int8_row_kernel(ty, int8).is_some())
    {
        return None;
    }
    xs.chunks_exact(inp.max(1)).map(QuantizedX::new).collect()
}

/// The 8-bit row kernels for `ty` where `int8` and this CPU has them: AVX-512 VNNI, else
/// AVX2.
fn int8_row_kernel(ty: QuantType, int8: bool) -> Option<Int8Rows> {
    if !int8 {
        None
    } else if Vnni::supports(ty) {
        Some(Int8Rows::Vnni)
    } else if Int8Avx2::supports(ty) {
        Some(Int8Rows::Avx2)
    } else {
        None
    }
}

/// [`quant_gemv_parts`] for sizes checked (`parts`: type, bytes, a row's bytes, rows), with
/// 8-bit activations where `int8` and this CPU and type have them.
fn product(
    parts: &[(QuantType, &[u8], usize, usize)],
    xs: &[f32],
    nx: usize,
    y: &mut [f32],
    int8: bool,
) -> Result<()> {
    let inp = xs.len() / nx.max(1);
    // 8-bit activations: AVX-512 VNNI, else AVX2 (`None`: exact).
    let int8_kernel = |ty: QuantType| int8_row_kernel(ty, int8);
    let xq = quantized_for(parts.iter().map(|p| p.0), xs, inp, int8);
    // The tasks: each part's rows in runs of `len` (`y` is `(outputs, nx)`).
    let mut tasks = Vec::new();
    let mut rest = y;
    // One run length for all the parts, from their rows together: stacked Q, K and V make
    // ~5 tasks on 2 threads, not 4 for each (the K and V ones of 48 rows, ~17 KB each).
    let len = task_len_per(
        parts.iter().map(|p| p.3).sum(),
        GROUP,
        ROWS_PER_TASK,
        TASKS_PER_THREAD,
    );
    for &(ty, data, row_bytes, rows) in parts {
        let (mine, others) = rest.split_at_mut(rows * nx);
        rest = others;
        for (c, ys) in mine.chunks_mut(len * nx).enumerate() {
            tasks.push((ty, data, row_bytes, c * len, ys));
        }
    }
    let x = Rows { xs, nx };
    let work =
        |(ty, data, row_bytes, j0, ys): &mut (QuantType, &[u8], usize, usize, &mut [f32])| {
            rows_of(
                *ty,
                data,
                *row_bytes,
                x,
                int8_kernel(*ty).zip(xq.as_deref()),
                *j0,
                ys,
            )
        };
    let total: usize = parts.iter().map(|p| p.3).sum();
    if total * inp * nx < 1 << 16 {
        tasks.iter_mut().try_for_each(work)
    } else {
        keep_warm::for_each_chunk(&mut tasks, 1, |_, t| t.iter_mut().try_for_each(work))
    }
}

/// `ys[nx r + i] = W[j0 + r] x_i` for the `ty` rows of `row_bytes` each in `data` and the
/// `nx` rows of `x`: with the 8-bit kernel and each `x_i` quantized where given, else on the
/// row kernels, else four rows at a time dequantized into scratch.
fn rows_of(
    ty: QuantType,
    data: &[u8],
    row_bytes: usize,
    x: Rows<'_>,
    int8: Option<(Int8Rows, &[QuantizedX])>,
    j0: usize,
    ys: &mut [f32],
) -> Result<()> {
    let Rows { xs, nx } = x;
    let inp = xs.len() / nx.max(1);
    let count = ys.len() / nx.max(1);
    let mine = data
        .get(j0 * row_bytes..(j0 + count) * row_bytes)
        .ok_or_else(|| Error::Kernel(format!("{ty} rows {j0}..{} past the weight", j0 + count)))?;
    if let Some((kernel, xq)) = int8 {
        // 8-bit activations (opted in): each row's integers against each `x_i` quantized,
        // each block unpacked once for up to 4 (VNNI) or 2 (AVX2) rows of `x`.
        if !kernel.run(ty, mine, xq, ys) {
            return Err(Error::Kernel(format!(
                "{ty}: the 8-bit kernel refused its rows"
            )));
        }
    } else if !kernel_rows(ty, mine, xs, nx, ys) {
        if Avx512::supports(ty) || Avx2::supports(ty) {
            return Err(Error::Kernel(format!(
                "{ty}: the row kernel refused its rows"
            )));
        }
        with_scratch(GROUP * inp + GROUP, |rows| {
            let (rows, dots) = rows.split_at_mut(GROUP * inp);
            for (g, yg) in ys.chunks_mut(GROUP * nx).enumerate() {
                let first = j0 + g * GROUP;
                let n = yg.len() / nx;
                let at = first * row_bytes;
                let w = &mut rows[..n * inp];
                if !blocks::dequantize(ty, &data[at..at + n * row_bytes], w) {
                    return Err(Error::Kernel(format!(
                        "{ty} rows {first}.. do not dequantize"
                    )));
                }
                for (i, x) in xs.chunks_exact(inp).enumerate() {
                    dot_rows(w, x, &mut dots[..n]);
                    for (r, &v) in dots[..n].iter().enumerate() {
                        yg[r * nx + i] = v;
                    }
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::decode::gemv::gemv;
    use crate::kernels::decode::row_kernels::{row_dot, rows_dots};
    use crate::kernels::quant::blocks::tests::ggml;
    use crate::kernels::quant::row_kinds::ROW_KERNEL_TYPES;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    /// The vector dequantization gives the scalar one's values bit for bit, on blocks from
    /// candle's quantizer and on arbitrary bytes (any scale, NaN as NaN); sizes that do not
    /// agree write nothing.
    #[test]
    fn dequantize_equals_the_scalar_values() -> candle_core::Result<()> {
        for ty in ROW_KERNEL_TYPES {
            let (rows, cols) = (5, 768);
            let quantized =
                crate::kernels::quant::blocks::tests::quantized_bytes(ty, rows, cols, 4);
            let mut state = 0x9E37_79B9_7F4A_7C15u64;
            let arbitrary: Vec<u8> = (0..quantized.len())
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            for bytes in [quantized, arbitrary] {
                let (mut fast, mut slow) = (vec![0f32; rows * cols], vec![1f32; rows * cols]);
                assert!(dequantize(ty, &bytes, &mut fast));
                assert!(blocks::dequantize(ty, &bytes, &mut slow));
                for (i, (a, b)) in fast.iter().zip(&slow).enumerate() {
                    assert!(
                        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                        "{ty} {i}: {a} {b}"
                    );
                }
            }
            let mut short = vec![7f32; 31];
            assert!(!dequantize(ty, &[0u8; 4], &mut short));
            assert!(short.iter().all(|&v| v == 7.0));
        }
        Ok(())
    }

    /// Every row kernel (AVX-512, AVX2 + FMA + F16C) makes each value of a row of arbitrary
    /// bytes exactly as gguf-py does: the row times a unit vector is that value of
    /// `blocks::dequantize` (zeros of either sign equal), for every type it takes, on rows
    /// whose values are all finite.
    fn row_kernels_make_each_value_exactly(which: usize) {
        type Supports = fn(QuantType) -> bool;
        type RowDot = fn(QuantType, &[u8], &[f32]) -> Option<f32>;
        // AVX-512 both with every type's scales held in memory and without (the CPU's
        // vendor picks one).
        let kernels: [(&str, Supports, RowDot, Option<bool>); 3] = [
            (
                "avx512 held",
                <Avx512 as RowKernels>::supports,
                row_dot::<Avx512>,
                Some(true),
            ),
            (
                "avx512",
                <Avx512 as RowKernels>::supports,
                row_dot::<Avx512>,
                Some(false),
            ),
            (
                "avx2",
                <Avx2 as RowKernels>::supports,
                row_dot::<Avx2>,
                None,
            ),
        ];
        let kernels = [kernels[which]];
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut byte = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        };
        for (name, supports, row_dot, hold) in kernels {
            let _hold = hold.map(quant_gemv_avx512::HoldAll::set);
            // 512 values: whole 8-block steps of the 32-value kernels; 416 (13 blocks): one
            // step, then five blocks alone.
            let widths = |ty: QuantType| {
                if ty.block_values() == 256 {
                    vec![512]
                } else {
                    vec![512, 416]
                }
            };
            for (ty, cols) in ROW_KERNEL_TYPES
                .into_iter()
                .flat_map(|ty| widths(ty).into_iter().map(move |c| (ty, c)))
            {
                assert!(
                    supports(ty),
                    "{ty}: built for this CPU's kernels, running without them"
                );
                let Some(row_bytes) = ty.bytes_of(cols) else {
                    panic!("{ty}: {cols} values are no whole blocks");
                };
                let mut checked = 0;
                for _ in 0..200 {
                    let row: Vec<u8> = (0..row_bytes).map(|_| byte()).collect();
                    let mut w = vec![0f32; cols];
                    assert!(blocks::dequantize(ty, &row, &mut w));
                    if !w.iter().all(|v| v.is_finite()) {
                        continue;
                    }
                    let mut x = vec![0f32; cols];
                    for k in 0..cols {
                        x[k] = 1.0;
                        let got = row_dot(ty, &row, &x);
                        x[k] = 0.0;
                        assert_eq!(got, Some(w[k]), "{name} {ty} {cols}: value {k}");
                    }
                    checked += 1;
                    if checked == 3 {
                        break;
                    }
                }
                assert_eq!(checked, 3, "{name} {ty} {cols}: too few finite rows");
            }
        }
    }

    #[test]
    #[cfg_attr(
        not(isa_avx512),
        ignore = "needs AVX-512, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn row_kernels_make_each_value_exactly_avx512_held() {
        row_kernels_make_each_value_exactly(0)
    }

    #[test]
    #[cfg_attr(
        not(isa_avx512),
        ignore = "needs AVX-512, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn row_kernels_make_each_value_exactly_avx512() {
        row_kernels_make_each_value_exactly(1)
    }

    #[test]
    #[cfg_attr(
        not(isa_avx2),
        ignore = "needs AVX2 + FMA + F16C, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn row_kernels_make_each_value_exactly_avx2() {
        row_kernels_make_each_value_exactly(2)
    }

    /// Each row kernel's dot product (AVX-512, AVX2 + FMA + F16C) against the same weight
    /// dequantized (gguf-py's values), summed in f64: within f32 rounding of the sum of
    /// magnitudes, for every type it takes, on any CPU that runs it; a row of the wrong size
    /// has no kernel.
    fn row_dots_equal_the_dequantized_weight_s(which: usize) -> candle_core::Result<()> {
        #[cfg(target_arch = "x86_64")]
        for ty in ROW_KERNEL_TYPES {
            use crate::kernels::simd::{isa, Isa};
            assert_eq!(
                <Avx512 as RowKernels>::supports(ty),
                matches!(isa(), Isa::Avx512),
                "{ty}: kernel"
            );
        }
        type Supports = fn(QuantType) -> bool;
        type RowDot = fn(QuantType, &[u8], &[f32]) -> Option<f32>;
        // AVX-512 with every type's scales held and without, whatever the CPU's vendor.
        let kernels: [(Supports, RowDot, Option<bool>); 3] = [
            (
                <Avx512 as RowKernels>::supports,
                row_dot::<Avx512>,
                Some(true),
            ),
            (
                <Avx512 as RowKernels>::supports,
                row_dot::<Avx512>,
                Some(false),
            ),
            (<Avx2 as RowKernels>::supports, row_dot::<Avx2>, None),
        ];
        let kernels = [kernels[which]];
        for (supports, row_dot, hold) in kernels {
            let avx512 = hold.is_some();
            let _hold = hold.map(quant_gemv_avx512::HoldAll::set);
            for ty in ROW_KERNEL_TYPES {
                assert!(
                    supports(ty),
                    "{ty}: built for this CPU's kernels, running without them"
                );
                let (rows, cols) = (9, 768);
                let w = crate::kernels::test_values(rows * cols, 11);
                let q =
                    QTensor::quantize(&Tensor::from_vec(w, (rows, cols), &Device::Cpu)?, ggml(ty))?;
                let bytes = q.data()?;
                let mut deq = vec![0f32; rows * cols];
                assert!(blocks::dequantize(ty, &bytes, &mut deq));
                let x = crate::kernels::test_values(cols, 2);
                let row_bytes = bytes.len() / rows;
                for r in 0..rows {
                    let got = row_dot(ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &x)
                        .ok_or_else(|| candle_core::Error::Msg(format!("{ty}: no kernel")))?;
                    let w = &deq[r * cols..(r + 1) * cols];
                    let want: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mag: f64 = w
                        .iter()
                        .zip(&x)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                    assert!(
                        (got as f64 - want).abs() <= mag * 1e-6,
                        "{ty} row {r}: {got} vs {want}"
                    );
                }
                assert!(row_dot(ty, &bytes[..row_bytes - 1], &x).is_none());
                // Several rows of `x` at once: each sum the same bits as that row alone, for
                // every count of rows the kernels take and a row stride of the output above it.
                let xs = crate::kernels::test_values(4 * cols, 5);
                let alone: Vec<Vec<f32>> = (0..rows)
                    .map(|r| {
                        xs.chunks_exact(cols)
                            .map(|x| row_dot(ty, &bytes[r * row_bytes..(r + 1) * row_bytes], x))
                            .collect::<Option<Vec<f32>>>()
                            .unwrap_or_default()
                    })
                    .collect();
                type Rows = fn(QuantType, &[u8], &[f32], &mut [f32], usize) -> bool;
                let multi: &[Rows] = if avx512 {
                    &[
                        rows_dots::<Avx512, 1>,
                        rows_dots::<Avx512, 2>,
                        rows_dots::<Avx512, 3>,
                        rows_dots::<Avx512, 4>,
                    ]
                } else {
                    &[rows_dots::<Avx2, 1>, rows_dots::<Avx2, 2>]
                };
                for (k, dots) in multi.iter().enumerate() {
                    let nx = k + 1;
                    let ldo = nx + 1;
                    let mut ys = vec![f32::NAN; rows * ldo];
                    assert!(
                        dots(ty, &bytes, &xs[..nx * cols], &mut ys, ldo),
                        "{ty}: {nx} rows"
                    );
                    for r in 0..rows {
                        for i in 0..nx {
                            let (got, want) = (ys[r * ldo + i], alone[r][i]);
                            assert_eq!(got.to_bits(), want.to_bits(), "{ty} ({r}, {i}) of {nx}");
                        }
                        assert!(ys[r * ldo + nx].is_nan(), "{ty}: wrote past its rows");
                    }
                    // An output too short for the rows is refused.
                    let mut short = vec![0f32; (rows - 1) * ldo + nx - 1];
                    let refused =
                        !multi[0](ty, &bytes, &xs[..cols], &mut short[..(rows - 1) * ldo], ldo);
                    assert!(refused, "{ty}: a short output");
                }
                // Each weight exactly as gguf-py makes it: the dot with a unit vector is that
                // one value, with no rounding of its own.
                let mut e = vec![0f32; cols];
                for r in 0..2 {
                    let row = &bytes[r * row_bytes..(r + 1) * row_bytes];
                    for k in 0..cols {
                        e[k] = 1.0;
                        let got = row_dot(ty, row, &e)
                            .ok_or_else(|| candle_core::Error::Msg(format!("{ty}: no kernel")))?;
                        e[k] = 0.0;
                        let want = deq[r * cols + k];
                        assert!(got == want, "{ty} ({r}, {k}): {got} vs {want}");
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    #[cfg_attr(
        not(isa_avx512),
        ignore = "needs AVX-512, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn row_dots_equal_the_dequantized_weight_s_avx512_held() -> candle_core::Result<()> {
        row_dots_equal_the_dequantized_weight_s(0)
    }

    #[test]
    #[cfg_attr(
        not(isa_avx512),
        ignore = "needs AVX-512, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn row_dots_equal_the_dequantized_weight_s_avx512() -> candle_core::Result<()> {
        row_dots_equal_the_dequantized_weight_s(1)
    }

    #[test]
    #[cfg_attr(
        not(isa_avx2),
        ignore = "needs AVX2 + FMA + F16C, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn row_dots_equal_the_dequantized_weight_s_avx2() -> candle_core::Result<()> {
        row_dots_equal_the_dequantized_weight_s(2)
    }

    /// The product on the blocks equals the f32 kernel's on the dequantized weight (bit for
    /// bit where it runs that kernel, within rounding where the fused kernels sum in their
    /// own order), for every type and for sizes that leave partial tasks and groups.
    #[test]
    fn equals_the_f32_product_of_the_dequantized_weight() -> candle_core::Result<()> {
        // Every block type.
        let types = QuantType::ALL.into_iter().filter(|t| t.block_values() > 1);
        for (ty, g) in types.map(|t| (t, ggml(t))) {
            for (out, inp) in [(7usize, 256usize), (301, 512), (1030, 256)] {
                let w = crate::kernels::test_values(out * inp, 3);
                let wt = Tensor::from_vec(w, (out, inp), &Device::Cpu)?;
                let q = QTensor::quantize(&wt, g)?;
                let bytes = q.data()?;
                let mut deq = vec![0f32; out * inp];
                assert!(blocks::dequantize(ty, &bytes, &mut deq));
                let x = crate::kernels::test_values(inp, 9);
                let bias = crate::kernels::test_values(out, 4);
                let (mut want, mut got) = (vec![0f32; out], vec![f32::NAN; out]);
                gemv(&deq, &x, Some(&bias), &mut want).map_err(crate::Error::into_candle)?;
                quant_gemv(ty, &bytes, &x, Some(&bias), &mut got)
                    .map_err(crate::Error::into_candle)?;
                for (j, (a, b)) in got.iter().zip(&want).enumerate() {
                    if <Avx512 as RowKernels>::supports(ty) || <Avx2 as RowKernels>::supports(ty) {
                        // Summed in another order: within f32 rounding of the magnitudes.
                        let row = &deq[j * inp..(j + 1) * inp];
                        let mag: f32 = row.iter().zip(&x).map(|(w, v)| (w * v).abs()).sum();
                        let tol = (mag + bias[j].abs()) * 1e-6;
                        assert!((a - b).abs() <= tol, "{ty} {out}x{inp} row {j}: {a} vs {b}");
                    } else {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{ty} {out}x{inp} row {j}: {a} vs {b}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Weights of different types and row counts stacked in one product: each part's
    /// outputs equal its own product bit for bit (the same row kernels on the same rows);
    /// parts whose rows do not fit the outputs or the input width are errors.
    #[test]
    fn stacked_parts_equal_their_own_products() -> candle_core::Result<()> {
        let inp = 512;
        let x = crate::kernels::test_values(inp, 3);
        let mut parts = Vec::new();
        for (i, (ty, rows)) in [
            (QuantType::Q4_1, 200),
            (QuantType::Q8_0, 72),
            (QuantType::Q6K, 130),
        ]
        .into_iter()
        .enumerate()
        {
            let w = crate::kernels::test_values(rows * inp, 10 + i);
            let q = QTensor::quantize(&Tensor::from_vec(w, (rows, inp), &Device::Cpu)?, ggml(ty))?;
            parts.push((ty, q.data()?.to_vec(), rows));
        }
        let mut want = Vec::new();
        for (ty, bytes, rows) in &parts {
            let mut y = vec![0f32; *rows];
            quant_gemv(*ty, bytes, &x, None, &mut y).map_err(crate::Error::into_candle)?;
            want.extend(y);
        }
        let stacked: Vec<(QuantType, &[u8])> =
            parts.iter().map(|(ty, b, _)| (*ty, b.as_slice())).collect();
        let mut got = vec![f32::NAN; want.len()];
        quant_gemv_parts(&stacked, &x, &mut got).map_err(crate::Error::into_candle)?;
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert!(quant_gemv_parts(&stacked, &x, &mut got[1..]).is_err());
        assert!(quant_gemv_parts(&stacked, &x[..480], &mut got).is_err());
        let torn = [(QuantType::Q4_1, &parts[0].1[..parts[0].1.len() - 1])];
        assert!(quant_gemv_parts(&torn, &x, &mut got[..199]).is_err());
        Ok(())
    }

    /// The gated product equals `silu` of the gate's own product times the up projection's,
    /// bit for bit, for a gate and up of different types over several tasks; shapes that do
    /// not fit are errors.
    #[test]
    fn gated_product_is_silu_of_the_gate_times_the_up() -> candle_core::Result<()> {
        let (out, inp) = (700, 256);
        let x = crate::kernels::test_values(inp, 5);
        let mut weights = Vec::new();
        for (i, ty) in [QuantType::Q4K, QuantType::Q5_0].into_iter().enumerate() {
            let w = crate::kernels::test_values(out * inp, 20 + i);
            let q = QTensor::quantize(&Tensor::from_vec(w, (out, inp), &Device::Cpu)?, ggml(ty))?;
            weights.push((ty, q.data()?.to_vec()));
        }
        let (mut g, mut u) = (vec![0f32; out], vec![0f32; out]);
        let (gate, up) = (
            (weights[0].0, &weights[0].1[..]),
            (weights[1].0, &weights[1].1[..]),
        );
        quant_gemv(gate.0, gate.1, &x, None, &mut g).map_err(crate::Error::into_candle)?;
        quant_gemv(up.0, up.1, &x, None, &mut u).map_err(crate::Error::into_candle)?;
        let mut got = vec![f32::NAN; out];
        quant_gemv_gated(gate, up, &x, &mut got).map_err(crate::Error::into_candle)?;
        for j in 0..out {
            let want = crate::kernels::activation::silu(g[j]) * u[j];
            assert_eq!(got[j].to_bits(), want.to_bits(), "row {j}");
        }
        assert!(quant_gemv_gated(gate, up, &x, &mut got[1..]).is_err());
        assert!(quant_gemv_gated(gate, (up.0, &up.1[1..]), &x, &mut got).is_err());
        Ok(())
    }

    /// With 8-bit activations (where this CPU has them): every type's product within the
    /// quantization of `x` of the exact one (`sum |w| dx / 2` a block, `dx = max|x| / 127`),
    /// rows split over tasks as the exact path splits them; the bias added.
    #[test]
    fn int8_products_stay_within_the_quantization_of_x() -> candle_core::Result<()> {
        for ty in ROW_KERNEL_TYPES {
            let (out, inp) = (301usize, if ty.block_values() == 256 { 768 } else { 576 });
            let w = crate::kernels::test_values(out * inp, 5);
            let q = QTensor::quantize(&Tensor::from_vec(w, (out, inp), &Device::Cpu)?, ggml(ty))?;
            let bytes = q.data()?;
            let mut deq = vec![0f32; out * inp];
            assert!(blocks::dequantize(ty, &bytes, &mut deq));
            let x = crate::kernels::test_values(inp, 7);
            let bias = crate::kernels::test_values(out, 4);
            let row_bytes = bytes.len() / out;
            let mut got = vec![f32::NAN; out];
            product(&[(ty, &bytes, row_bytes, out)], &x, 1, &mut got, true)
                .map_err(crate::Error::into_candle)?;
            for (g, b) in got.iter_mut().zip(&bias) {
                *g += b;
            }
            for (j, g) in got.iter().enumerate() {
                let row = &deq[j * inp..(j + 1) * inp];
                let exact: f64 = row
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    + bias[j] as f64;
                let bound: f64 = row
                    .chunks(32)
                    .zip(x.chunks(32))
                    .map(|(wb, xb)| {
                        let dx = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                        wb.iter().map(|v| v.abs() as f64).sum::<f64>() * dx / 2.0
                    })
                    .sum();
                let mag: f64 = row
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                assert!(
                    (*g as f64 - exact).abs() <= bound + mag * 1e-5,
                    "{ty} row {j}: {g} vs {exact}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn sizes_that_do_not_fit_are_errors() {
        let mut y = vec![0f32; 2];
        assert!(quant_gemv(QuantType::Q8_0, &[0u8; 34], &[0f32; 32], None, &mut y).is_err());
        assert!(quant_gemv(QuantType::Q8_0, &[0u8; 68], &[0f32; 31], None, &mut y).is_err());
        assert!(quant_gemv(QuantType::Q8_0, &[0u8; 68], &[0f32; 32], None, &mut y).is_ok());
    }
}
