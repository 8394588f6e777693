//! Attention that hands out the weights: per `(batch, head, query block)` the full score
//! rows `(q_block, seq_k)` are computed straight into their destination, normalised in
//! place (f32, max subtracted) and multiplied by V into the context.
//!
//! The destination is either the `(batch, heads, seq_q, seq_k)` weights tensor (no copy
//! between the score product, the softmax and the returned weights) or a per-block buffer
//! handed to a callback ([`attention_streamed`]), whose memory does not grow with `seq_q`.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::attend::problem::{OutOperand, Problem};
use crate::kernels::attend::tile_products::{KvPanels, Packing, Products};
use crate::kernels::gemm::matrix::MatMut;
use crate::kernels::scratch::with_scratch;
use crate::kernels::simd;

/// Query rows per block for `seq_k` keys: a block of scores stays within ~256 KiB of L2.
pub(crate) fn rows_per_block(p: &Problem<'_>, threads: usize) -> usize {
    let by_cache = (65_536 / p.seq_k.max(1)).clamp(8, 128);
    let mut q = by_cache;
    while q > 8 && p.batch * p.heads * p.seq_q.div_ceil(q) < 4 * threads {
        q /= 2;
    }
    q
}

/// Queries `i0..i0 + n` against keys `first..end` in one go: scores into `s` (row stride
/// `ld`; key `j` at column `c0 + j - j0`, `j0` = `first` rounded down to the products'
/// alignment), normalised in place, context `P V` into `o`. Columns of keys before `first`
/// may hold scores afterwards (callers that return the rows clear them).
///
/// Shared by the weights kernels and the tiled kernel's single-tile case, so that the
/// paths with and without weights give bit-identical contexts whenever the keys fit in
/// one tile.
#[allow(clippy::too_many_arguments)]
pub(crate) fn softmax_block(
    p: &Problem<'_>,
    prods: Products<'_>,
    o: &mut MatMut<'_>,
    s: &mut [f32],
    ld: usize,
    c0: usize,
    b: usize,
    h: usize,
    i0: usize,
    n: usize,
    (first, end): (usize, usize),
    mut lse: Option<&mut MatMut<'_>>,
) -> Result<()> {
    let cols = end - first;
    let want_lse = lse.is_some();
    let mut put_lse = |r: usize, v: f32| {
        if let Some(row) = lse.as_mut().and_then(|l| l.row_mut(0)) {
            row[r] = v;
        }
    };
    if cols == 0 {
        for r in 0..n {
            if let Some(row) = o.row_mut(r) {
                row.fill(0.0);
            }
            put_lse(r, f32::NEG_INFINITY);
        }
        return Ok(());
    }
    let align = prods.key_align();
    let j0 = first / align * align;
    if c0 + end - j0 > ld || s.len() < c0 {
        return Err(Error::Kernel(format!(
            "score rows of {ld} for keys {j0}..{end} at column {c0}"
        )));
    }
    // S = scale log2(e) Q K^T, (n, end - j0), in base-2 units: the softmax takes 2^(s - max)
    prods.scores(p, b, h, i0, n, (j0, end), &mut s[c0..], ld)?;
    let off = c0 + first - j0;
    let masked =
        p.causal_cuts(i0, first, cols) || p.mask.key_bias.is_some() || p.mask.dense.is_some();
    for r in 0..n {
        let row = &mut s[r * ld + off..r * ld + off + cols];
        if masked {
            p.mask_row(row, b, h, i0 + r, first)?;
        }
        let m = simd::row_max(row);
        if m == f32::NEG_INFINITY {
            // A query whose keys are all hidden: zero weights, zero context.
            row.fill(0.0);
            put_lse(r, f32::NEG_INFINITY);
            continue;
        }
        // One pass (powers, sum and bounds) where no mask put -inf in the row.
        let one_pass = if masked {
            None
        } else {
            // `m` is the row maximum: no score is above it, and the one pass takes scores
            // down to `127 - 2 = 125` units below it.
            simd::exp2_shifted_sum_bounded(row, m, 2.0)
        };
        let sum = match one_pass {
            Some(sum) => sum,
            None => {
                if !masked {
                    // The one pass refused the row (scores spanning more than 125 base-2
                    // units) after overwriting it: its scores again.
                    let at = c0 + r * ld;
                    prods.scores(p, b, h, i0 + r, 1, (j0, end), &mut s[at..], ld)?;
                }
                simd::exp2_shifted_sum(&mut s[r * ld + off..r * ld + off + cols], m)
            }
        };
        let row = &mut s[r * ld + off..r * ld + off + cols];
        simd::scale(row, 1.0 / sum);
        if want_lse {
            // Only the backward pass reads it (a log per row and head otherwise).
            put_lse(r, m + sum.log2());
        }
    }
    // context = P V, (n, dv)
    prods.weighted_values(p, b, h, &s[off..], ld, n, (first, cols), o, false)
}

/// One block: weights of queries `i0..i0 + n` into `w` (`(n, seq_k)`, row-major, every
/// element written) and their context into `out`.
#[allow(clippy::too_many_arguments)]
fn block(
    p: &Problem<'_>,
    prods: Products<'_>,
    out: &OutOperand<'_>,
    w: &mut [f32],
    b: usize,
    h: usize,
    i0: usize,
    n: usize,
) -> Result<()> {
    let sk = p.seq_k;
    if w.len() != n * sk {
        return Err(Error::Kernel(format!(
            "weights block of {} elements for {n} x {sk}",
            w.len()
        )));
    }
    let (first, end) = p.key_range(b, i0, n);
    let j0 = first / prods.key_align() * prods.key_align();
    // SAFETY: this block is the only one that handles rows i0..i0+n of head h in batch b.
    let mut o = unsafe { out.mat_mut(b, h, i0, n, p.dv)? };
    softmax_block(p, prods, &mut o, w, sk, j0, b, h, i0, n, (first, end), None)?;
    // Keys outside [first, end) are hidden from every query of the block.
    for r in 0..n {
        w[r * sk..r * sk + first].fill(0.0);
        w[r * sk + end..(r + 1) * sk].fill(0.0);
    }
    Ok(())
}

/// Weights `(batch, heads, seq_q, seq_k)` into `weights` and the context into `out`. Every
/// element of `weights` is initialised when this returns `Ok` (it may start uninitialised).
///
/// Each block is computed in its thread's scratch (in cache, reused from block to block),
/// then written to `weights` once with streaming stores: the destination is never read, so
/// its cache lines are not fetched from memory before being overwritten (the weights are
/// the largest thing attention writes: 12.6 MB for 12 heads at seq 512).
pub(crate) fn attention_with_weights(
    p: &Problem<'_>,
    out: &OutOperand<'_>,
    weights: &mut [MaybeUninit<f32>],
    packing: Packing,
) -> Result<()> {
    p.validate()?;
    let (sq, sk) = (p.seq_q, p.seq_k);
    if weights.len() != p.batch * p.heads * sq * sk {
        return Err(Error::Kernel("weights buffer of the wrong size".into()));
    }
    if sq == 0 || sk == 0 {
        return Ok(());
    }
    let rows = rows_per_block(p, rayon::current_num_threads());
    let kv = if packing == Packing::Upfront {
        Some(KvPanels::pack(p, 0, p.batch * p.kv_heads)?)
    } else {
        None
    };
    let prods = Products::new(packing, kv.as_ref());
    weights
        .par_chunks_mut(sq * sk)
        .enumerate()
        .try_for_each(|(bh, per_head)| {
            let (b, h) = (bh / p.heads, bh % p.heads);
            per_head
                .par_chunks_mut(rows * sk)
                .enumerate()
                .try_for_each(|(qb, w)| {
                    let n = w.len() / sk;
                    with_scratch(n * sk, |wb| {
                        block(p, prods, out, wb, b, h, qb * rows, n)?;
                        // Every element of `w` must be written: the caller relies on it.
                        if simd::copy_streaming(w, wb) != w.len() {
                            return Err(Error::Kernel("weights block not fully written".into()));
                        }
                        Ok(())
                    })
                })
        })
}

/// The weights of one block of queries, as the streaming calls hand them out.
#[derive(Debug, Clone, Copy)]
pub struct WeightsBlock<'a> {
    /// Batch row.
    pub batch: usize,
    /// Query head.
    pub head: usize,
    /// First query of the block.
    pub query_start: usize,
    /// Keys per row (`seq_k`).
    pub seq_k: usize,
    /// `(rows, seq_k)` row-major: `weights[r * seq_k + j]` is what query `query_start + r`
    /// gives key `j`.
    pub weights: &'a [f32],
}

impl WeightsBlock<'_> {
    /// Number of queries in the block.
    pub fn rows(&self) -> usize {
        self.weights.len().checked_div(self.seq_k).unwrap_or(0)
    }
}

/// Context into `out`; the weights go block by block to `on_block`, in order of batch, head
/// and query. Blocks are computed a wave at a time in parallel (one buffer per block of the
/// wave), and K and V are packed one key/value head at a time, so memory stays
/// `O(threads * rows * seq_k + seq_k * d)`.
pub(crate) fn attention_streamed(
    p: &Problem<'_>,
    out: &OutOperand<'_>,
    packing: Packing,
    on_block: &mut dyn FnMut(WeightsBlock<'_>) -> Result<()>,
) -> Result<()> {
    p.validate()?;
    let (sq, sk) = (p.seq_q, p.seq_k);
    if sq == 0 || sk == 0 {
        return Ok(());
    }
    let rows = rows_per_block(p, rayon::current_num_threads());
    let nqb = sq.div_ceil(rows);
    let per_group = p.heads / p.kv_heads;
    let wave = rayon::current_num_threads().max(1) * 2;
    let mut buffers: Vec<Vec<f32>> = Vec::new();
    for g in 0..p.batch * p.kv_heads {
        let (b, kvh) = (g / p.kv_heads, g % p.kv_heads);
        let kv = if packing == Packing::Upfront {
            Some(KvPanels::pack(p, g, 1)?)
        } else {
            None
        };
        let prods = Products::new(packing, kv.as_ref());
        // The group's heads in order, each query block in order.
        let tasks = per_group * nqb;
        let locate = |t: usize| {
            let (hh, qb) = (t / nqb, t % nqb);
            let i0 = qb * rows;
            (kvh * per_group + hh, i0, rows.min(sq - i0))
        };
        let mut start = 0;
        while start < tasks {
            let count = wave.min(tasks - start);
            while buffers.len() < count {
                buffers.push(vec![0.0; rows * sk]);
            }
            buffers[..count]
                .par_iter_mut()
                .enumerate()
                .try_for_each(|(i, buf)| {
                    let (h, i0, n) = locate(start + i);
                    block(p, prods, out, &mut buf[..n * sk], b, h, i0, n)
                })?;
            for (i, buf) in buffers[..count].iter().enumerate() {
                let (h, i0, n) = locate(start + i);
                on_block(WeightsBlock {
                    batch: b,
                    head: h,
                    query_start: i0,
                    seq_k: sk,
                    weights: &buf[..n * sk],
                })?;
            }
            start += count;
        }
    }
    Ok(())
}
