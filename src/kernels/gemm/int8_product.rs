//! The opt-in 8-bit-activation product of a prompt's rows by GGUF weights (llama.cpp's
//! precision, not exact; [`crate::kernels::decode::quant_gemv::set_int8_activations`]): the
//! weights' integers ([`integer_form`]) meet `x` quantized to signed bytes in AVX-512 VNNI
//! instructions (`vpdpbusd`: 64 byte products a register), and each group of 32 (or 16)
//! values is scaled once, in f32:
//!
//! `y[i][j] = sum_g dx[i][g] s[g][j] (sum_{k in g} q[k][j] qx[i][k]) + sx[i][g] m[g][j]`
//!
//! with `sx[i][g] = dx[i][g] sum_{k in g} qx[i][k]`. `x` is quantized per 32 values as the
//! decode steps' 8-bit products do ([`QuantizedX`](crate::kernels::decode::quant_gemv_vnni)),
//! so the error against the f32 product is the quantization of `x` alone.
//!
//! The weights are packed per call, like the f32 prompt products' panels, into panels of
//! 48 output columns: per group, the integers as `(group / 4, 48, 4)` bytes (a register
//! holds 4 consecutive values of 16 columns), then the 48 scales and the 48 offsets.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::aligned::{AlignedFloats, UninitFloats};
#[cfg(target_arch = "x86_64")]
use crate::kernels::gemm::packed::OutPtr;
use crate::kernels::quant::blocks::QuantType;
use crate::kernels::quant::integer_form::{group_values, integer_row};

/// Registers of 16 columns per panel.
const NC: usize = 3;
/// Output columns per panel.
const PANEL: usize = 16 * NC;
/// Rows per micro-kernel call.
const MR: usize = 4;
/// Rows per task (a block of `x`'s bytes stays in L2 while the panels go by).
const MB: usize = 128;

/// Whether this CPU runs these products: AVX-512 with VNNI, the instruction set not capped.
pub(crate) fn available() -> bool {
    crate::kernels::simd::avx512_vnni()
}

/// One weight of a stack: its type, its bytes (`rows` rows of `cols` values) and `rows`.
pub(crate) type Part<'a> = (QuantType, &'a [u8], usize);

/// `x` `(rows, cols)` quantized per 32 values, with its per-group factors.
struct QuantizedRows {
    qs: Vec<i8>,
    /// `dx[i][g]`: the scale of the 32-value block holding group `g` of row `i`.
    dx: Vec<f32>,
    /// `sx[i][g] = dx[i][g] * sum of group g's bytes`.
    sx: Vec<f32>,
}

impl QuantizedRows {
    fn new(xs: &[f32], cols: usize, group: usize) -> Self {
        let rows = xs.len() / cols;
        let groups = cols / group;
        let mut out = Self {
            qs: vec![0; xs.len()],
            dx: vec![0.0; rows * groups],
            sx: vec![0.0; rows * groups],
        };
        out.qs
            .par_chunks_mut(cols)
            .zip(out.dx.par_chunks_mut(groups))
            .zip(out.sx.par_chunks_mut(groups))
            .zip(xs.par_chunks(cols))
            .for_each(|(((q, dx), sx), x)| {
                for (b, (xb, qb)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
                    let (d, _) = crate::kernels::quant::activations::quantize_block(xb, qb);
                    let per = 32 / group;
                    for h in 0..per {
                        let part = &qb[h * group..(h + 1) * group];
                        let sum: i32 = part.iter().map(|&v| i32::from(v)).sum();
                        dx[b * per + h] = d;
                        sx[b * per + h] = d * sum as f32;
                    }
                }
            });
        out
    }
}

/// Words (f32 or 4 bytes of integers) of one group of a panel.
fn group_words(group: usize) -> usize {
    group * PANEL / 4 + 2 * PANEL
}

/// The stacked weights `parts` (each `(rows_p, cols)`) as panels of `(cols, 48)` columns in
/// groups of `group`; `None` when a part has no integer form or its bytes do not fit.
fn pack(parts: &[Part<'_>], cols: usize, group: usize) -> Option<(AlignedFloats, usize)> {
    let n: usize = parts.iter().map(|p| p.2).sum();
    let panels = n.div_ceil(PANEL);
    let groups = cols / group;
    let panel_words = groups * group_words(group);
    let mut data = UninitFloats::new(panels * panel_words);
    let row_bytes: Vec<usize> = parts
        .iter()
        .map(|p| p.0.bytes_of(cols))
        .collect::<Option<_>>()?;
    // Output column `j`'s part and bytes.
    let row = |j: usize| {
        let mut start = 0;
        for (&(ty, bytes, rows), &rb) in parts.iter().zip(&row_bytes) {
            if j < start + rows {
                return bytes
                    .get((j - start) * rb..(j - start + 1) * rb)
                    .map(|b| (ty, b));
            }
            start += rows;
        }
        None
    };
    let ok = data
        .slots()
        .par_chunks_mut(panel_words.max(1))
        .enumerate()
        .all(|(p, slots)| {
            // Zeroed by the task that fills it, just before (a narrow panel's unused columns
            // stay zero), rather than the whole buffer by the calling thread alone.
            for slot in slots.iter_mut() {
                slot.write(0.0);
            }
            // SAFETY: every slot of this chunk was written just above.
            let panel = unsafe {
                std::slice::from_raw_parts_mut(slots.as_mut_ptr().cast::<f32>(), slots.len())
            };
            let width = PANEL.min(n - p * PANEL);
            fill_panel(panel, width, cols, group, |c| row(p * PANEL + c))
        });
    // SAFETY: with `ok`, every chunk's task ran and zeroed all its slots (`all` stops early
    // only on a `false`); without it the slots are dropped unread.
    ok.then(|| (unsafe { data.assume_init() }, panels))
}

/// One panel of `width` columns whose rows `row(c)` gives (its type and bytes), in groups of
/// `group`: the rows in integer form first, then the panel written in order. `false` when a
/// row has no integer form or does not fit. Kept out of line: inlined into its caller, it
/// compiled slower (a 20-token 8-bit Q8_0 prompt 39.7 -> 42.8 ms).
#[inline(never)]
fn fill_panel<'a>(
    panel: &mut [f32],
    width: usize,
    cols: usize,
    group: usize,
    row: impl Fn(usize) -> Option<(QuantType, &'a [u8])>,
) -> bool {
    let groups = cols / group;
    let mut q = vec![0u8; width * cols];
    let (mut s, mut m) = (vec![0f32; width * groups], vec![0f32; width * groups]);
    for (c, ((qc, sc), mc)) in q
        .chunks_exact_mut(cols)
        .zip(s.chunks_exact_mut(groups))
        .zip(m.chunks_exact_mut(groups))
        .enumerate()
    {
        match row(c) {
            Some((ty, bytes)) if integer_row(ty, bytes, group, qc, sc, mc) => {}
            _ => return false,
        }
    }
    for (g, words) in panel.chunks_exact_mut(group_words(group)).enumerate() {
        let (ints, scales) = words.split_at_mut(group * PANEL / 4);
        for (t, line) in ints.chunks_exact_mut(PANEL).enumerate() {
            let at = g * group + 4 * t;
            for (word, qc) in line.iter_mut().zip(q.chunks_exact(cols)) {
                let four = [qc[at], qc[at + 1], qc[at + 2], qc[at + 3]];
                *word = f32::from_bits(u32::from_le_bytes(four));
            }
        }
        let (sw, mw) = scales.split_at_mut(PANEL);
        for c in 0..width {
            sw[c] = s[c * groups + g];
            mw[c] = m[c * groups + g];
        }
    }
    true
}

/// `x W_p^T` `(rows, sum of the parts' rows)` for `rows` f32 input rows `xs` of `cols`
/// values and weights `parts` stacked along the outputs, with `x` quantized to 8 bits;
/// `Ok(None)` when this CPU has no such kernels or a part has no integer form (a float type).
pub(crate) fn product(
    parts: &[Part<'_>],
    cols: usize,
    xs: &[f32],
    rows: usize,
) -> Result<Option<Vec<f32>>> {
    if !available() || cols == 0 || !cols.is_multiple_of(32) || rows == 0 {
        return Ok(None);
    }
    if xs.len() != rows * cols {
        return Err(Error::Kernel(format!(
            "8-bit product of {} values as ({rows}, {cols})",
            xs.len()
        )));
    }
    let Some(groups_of) = parts
        .iter()
        .map(|p| group_values(p.0))
        .collect::<Option<Vec<_>>>()
    else {
        return Ok(None);
    };
    let group = groups_of.into_iter().min().unwrap_or(32);
    Ok(multiply(parts, cols, xs, rows, group))
}

/// [`product`] once checked, in groups of `group`; `None` when a part's bytes do not fit.
#[cfg(not(target_arch = "x86_64"))]
fn multiply(_: &[Part<'_>], _: usize, _: &[f32], _: usize, _: usize) -> Option<Vec<f32>> {
    None
}

/// [`product`] once checked, in groups of `group`; `None` when a part's bytes do not fit.
#[cfg(target_arch = "x86_64")]
fn multiply(
    parts: &[Part<'_>],
    cols: usize,
    xs: &[f32],
    rows: usize,
    group: usize,
) -> Option<Vec<f32>> {
    if !available() || xs.len() != rows * cols || !cols.is_multiple_of(group) {
        return None;
    }
    let (data, panels) = pack(parts, cols, group)?;
    let x = QuantizedRows::new(xs, cols, group);
    let n: usize = parts.iter().map(|p| p.2).sum();
    let groups = cols / group;
    let panel_words = groups * group_words(group);
    let mut out: Vec<f32> = Vec::with_capacity(rows * n);
    let ptr = OutPtr(out.as_mut_ptr());
    let blocks = rows.div_ceil(MB);
    let run = |t: usize| {
        let (blk, p) = (t / panels, t % panels);
        let (r0, width) = (blk * MB, PANEL.min(n - p * PANEL));
        let r1 = (r0 + MB).min(rows);
        for r in (r0..r1).step_by(MR) {
            let tile_rows = MR.min(r1 - r);
            // SAFETY: `available` checked the features; `x` holds `rows` rows of `cols`
            // bytes and `groups` factors each, the panel `panel_words` words; the tile
            // writes rows r..r+tile_rows, columns p*PANEL..+width of the (rows, n) output,
            // which no other task touches, and the tasks tile the whole output before
            // `set_len`.
            unsafe {
                let at = Tile {
                    groups,
                    qx: x.qs.as_ptr().add(r * cols),
                    ldx: cols,
                    dx: x.dx.as_ptr().add(r * groups),
                    sx: x.sx.as_ptr().add(r * groups),
                    panel: data.as_ptr().add(p * panel_words),
                    out: ptr.get().add(r * n + p * PANEL),
                    ldo: n,
                    width,
                };
                tile_of(tile_rows, group, at);
            }
        }
    };
    (0..blocks * panels)
        .into_par_iter()
        .with_max_len(1)
        .for_each(run);
    // SAFETY: every one of the rows * n elements was written above.
    unsafe { out.set_len(rows * n) };
    Some(out)
}

/// Where a tile reads and writes (see [`tile`]).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Tile {
    groups: usize,
    qx: *const i8,
    ldx: usize,
    dx: *const f32,
    sx: *const f32,
    panel: *const f32,
    out: *mut f32,
    ldo: usize,
    width: usize,
}

/// [`tile`] for `rows` (1..=4) rows and groups of `group` (16 or 32).
///
/// # Safety
/// As [`tile`].
#[cfg(target_arch = "x86_64")]
unsafe fn tile_of(rows: usize, group: usize, at: Tile) {
    macro_rules! go {
        ($r:literal, $g:literal) => {
            tile::<$r, $g>(at)
        };
    }
    match (rows, group == 16) {
        (1, false) => go!(1, 32),
        (2, false) => go!(2, 32),
        (3, false) => go!(3, 32),
        (_, false) => go!(4, 32),
        (1, true) => go!(1, 16),
        (2, true) => go!(2, 16),
        (3, true) => go!(3, 16),
        (_, true) => go!(4, 16),
    }
}

/// `R` rows of the output, the panel's `width` columns: `out[r][c] = sum over the groups`
/// as in the module's formula.
///
/// # Safety
/// AVX-512 F and VNNI; in `at`: `qx` addresses `R` rows of `groups * G` readable bytes (row stride
/// `ldx`), `dx` and `sx` `R` rows of `groups` floats (row stride `groups`), `panel` a
/// 64-byte-aligned panel of `groups` groups of `G`, `out` `R` rows of `width <= 48`
/// writable floats (row stride `ldo`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
unsafe fn tile<const R: usize, const G: usize>(at: Tile) {
    let Tile {
        groups,
        qx,
        ldx,
        dx,
        sx,
        panel,
        out,
        ldo,
        width,
    } = at;
    let gw = group_words(G);
    let mut acc = [[_mm512_setzero_ps(); NC]; R];
    for g in 0..groups {
        let base = panel.add(g * gw);
        let mut ints = [[_mm512_setzero_si512(); NC]; R];
        for t in 0..G / 4 {
            let mut w = [_mm512_setzero_si512(); NC];
            for (c, wc) in w.iter_mut().enumerate() {
                *wc = _mm512_load_si512(base.add((t * NC + c) * 16) as *const _);
            }
            for (r, row) in ints.iter_mut().enumerate() {
                let four = (qx.add(r * ldx + g * G + 4 * t) as *const i32).read_unaligned();
                let xb = _mm512_set1_epi32(four);
                for (acc_i, &wc) in row.iter_mut().zip(&w) {
                    *acc_i = _mm512_dpbusd_epi32(*acc_i, wc, xb);
                }
            }
        }
        let scales = base.add(G * PANEL / 4);
        let offsets = scales.add(PANEL);
        for (r, (row, sums)) in acc.iter_mut().zip(&ints).enumerate() {
            let d = _mm512_set1_ps(*dx.add(r * groups + g));
            let sm = _mm512_set1_ps(*sx.add(r * groups + g));
            for (c, (a, &s)) in row.iter_mut().zip(sums).enumerate() {
                let f = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_load_ps(scales.add(16 * c)));
                *a = _mm512_fmadd_ps(f, d, *a);
                *a = _mm512_fmadd_ps(_mm512_load_ps(offsets.add(16 * c)), sm, *a);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (c, &a) in row.iter().enumerate() {
            let lo = 16 * c;
            if lo >= width {
                break;
            }
            let mask: __mmask16 = if width - lo >= 16 {
                0xFFFF
            } else {
                (1u16 << (width - lo)) - 1
            };
            _mm512_mask_storeu_ps(out.add(r * ldo + lo), mask, a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::blocks::{dequantize, tests::quantized_bytes};

    /// The same formula in f64 from the integer forms and the quantized `x`.
    fn reference(parts: &[Part<'_>], cols: usize, xs: &[f32], group: usize) -> Vec<f64> {
        let x = QuantizedRows::new(xs, cols, group);
        let rows = xs.len() / cols;
        let groups = cols / group;
        let mut weights = Vec::new();
        for &(ty, bytes, n) in parts {
            let rb = ty.bytes_of(cols).unwrap_or(0);
            for j in 0..n {
                let (mut q, mut s, mut m) =
                    (vec![0u8; cols], vec![0f32; groups], vec![0f32; groups]);
                assert!(integer_row(
                    ty,
                    &bytes[j * rb..(j + 1) * rb],
                    group,
                    &mut q,
                    &mut s,
                    &mut m
                ));
                weights.push((q, s, m));
            }
        }
        let mut y = Vec::new();
        for i in 0..rows {
            for (q, s, m) in &weights {
                let mut v = 0f64;
                for g in 0..groups {
                    let ints: i64 = (g * group..(g + 1) * group)
                        .map(|k| i64::from(q[k]) * i64::from(x.qs[i * cols + k]))
                        .sum();
                    let (d, sm) = (x.dx[i * groups + g] as f64, x.sx[i * groups + g] as f64);
                    v += d * s[g] as f64 * ints as f64 + sm * m[g] as f64;
                }
                y.push(v);
            }
        }
        y
    }

    /// Parts of mixed types (groups of 32 with one of 16), odd widths and row counts on
    /// every tile edge: the kernels' sums equal the formula's, and stay within the
    /// quantization of `x` of the exact f32 product.
    #[test]
    #[cfg_attr(
        not(isa_vnni),
        ignore = "needs AVX-512 VNNI, absent here or capped by CANDLE_ATTENTION_ISA"
    )]
    fn products_follow_the_formula_and_the_exact_product() -> Result<()> {
        assert!(
            available(),
            "built for this CPU's kernels, running without them"
        );
        let cols = 512;
        for types in [
            vec![QuantType::Q4_1, QuantType::Q8_0, QuantType::Q5_0],
            vec![
                QuantType::Q4K,
                QuantType::Q6K,
                QuantType::Q5_1,
                QuantType::Q4_0,
            ],
            vec![QuantType::Q3K, QuantType::Q2K, QuantType::Q5K],
        ] {
            let counts = [50, 16, 77, 3];
            let owned: Vec<Vec<u8>> = types
                .iter()
                .zip(counts)
                .enumerate()
                .map(|(i, (&ty, n))| quantized_bytes(ty, n, cols, i + 1))
                .collect();
            let parts: Vec<Part<'_>> = types
                .iter()
                .zip(counts)
                .zip(&owned)
                .map(|((&ty, n), b)| (ty, b.as_slice(), n))
                .collect();
            let n: usize = parts.iter().map(|p| p.2).sum();
            let group = types
                .iter()
                .filter_map(|&t| group_values(t))
                .min()
                .unwrap_or(32);
            for rows in [1, 3, 4, 9, 130, 261] {
                let xs: Vec<f32> = crate::kernels::test_values(rows * cols, rows)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * (1.0 + (i % 5) as f32))
                    .collect();
                let got = product(&parts, cols, &xs, rows)?.expect("VNNI");
                assert_eq!(got.len(), rows * n);
                let want = reference(&parts, cols, &xs, group);
                // The exact product, and how far quantizing x may move it.
                let mut dense = Vec::new();
                for &(ty, bytes, _) in &parts {
                    let mut w = vec![0f32; bytes.len() / ty.block_bytes() * ty.block_values()];
                    assert!(dequantize(ty, bytes, &mut w));
                    dense.extend(w);
                }
                let xq = QuantizedRows::new(&xs, cols, 32);
                for i in 0..rows {
                    for j in 0..n {
                        let (g, w) = (got[i * n + j], want[i * n + j]);
                        let scale: f64 = (0..cols)
                            .map(|k| (dense[j * cols + k] as f64 * xs[i * cols + k] as f64).abs())
                            .sum::<f64>()
                            + 1e-6;
                        assert!(
                            (g as f64 - w).abs() <= 1e-5 * scale,
                            "{types:?} rows {rows} ({i}, {j}): {g} vs formula {w}"
                        );
                        let exact: f64 = (0..cols)
                            .map(|k| dense[j * cols + k] as f64 * xs[i * cols + k] as f64)
                            .sum();
                        let bound: f64 = (0..cols)
                            .map(|k| {
                                dense[j * cols + k].abs() as f64
                                    * xq.dx[i * (cols / 32) + k / 32] as f64
                                    / 2.0
                            })
                            .sum::<f64>()
                            + 1e-4 * scale;
                        assert!(
                            (g as f64 - exact).abs() <= bound,
                            "{types:?} rows {rows} ({i}, {j}): {g} vs exact {exact}, bound {bound}"
                        );
                    }
                }
            }
        }
        // A float part: no integer form, the caller's exact path.
        let f = quantized_bytes(QuantType::F16, 2, cols, 1);
        let xs = vec![0.5f32; 5 * cols];
        assert!(product(&[(QuantType::F16, &f, 2)], cols, &xs, 5)?.is_none());
        // Bytes that do not hold the rows.
        let q = quantized_bytes(QuantType::Q4_0, 2, cols, 1);
        assert!(product(&[(QuantType::Q4_0, &q, 3)], cols, &xs, 5)?.is_none());
        assert!(product(&[(QuantType::Q4_0, &q, 2)], cols, &xs[1..], 5).is_err());
        Ok(())
    }
}
