//! Exact attention in memory linear in the sequence length: tiles of queries against tiles
//! of keys with an online (running max / running sum) softmax, FlashAttention-style, on the
//! CPU. The `(seq_q, seq_k)` matrix never exists; each task keeps one `(q_block, k_block)`
//! score tile and one `(q_block, d_v)` accumulator.
//!
//! Tasks are `(batch, head, query block)`, run in parallel on the rayon pool, heaviest
//! first. Causal masks end each task's key loop at the diagonal (blocks above it are never
//! computed); on the tiles that cross it, both products run by groups of rows, each group
//! over the keys its last row sees, and each row's softmax over the keys that row sees, as
//! an unmasked row (the keys past them get weight 0, with no mask pass). Padding
//! ranges skip the padded keys.
//! When the keys fit in one tile (up to 512) the task computes the whole softmax at once,
//! with the same code as the weights kernel, so both paths give the same bits.
//!
//! Each row's running reference is an integer (the first tile's maximum, rounded up) that
//! moves only when a tile's scores rise more than [`LAZY_HEADROOM`] above it (on a tile that
//! a mask cuts, as soon as they rise above it). So the rescaling factor is an exact power of
//! two and almost never needed, and an unmasked tile takes one pass per row
//! ([`simd::exp2_shifted_sum_bounded`]: the powers, their sum and the range check together)
//! instead of a maximum pass, a power pass and a rescaling of the accumulator. A row the
//! one pass refuses has its scores computed again and takes the full path.

use std::ops::Range;

use rayon::prelude::*;

use crate::error::Result;
use crate::kernels::attend::problem::{OutOperand, Problem};
use crate::kernels::attend::rows::{rows_per_block, softmax_block};
use crate::kernels::attend::tile_products::{KvPanels, Packing, Products, KEY_PANEL};
use crate::kernels::gemm::matrix::MatMut;
use crate::kernels::scratch::{split, with_scratch};
use crate::kernels::simd;

/// Rows per product on a tile that crosses the causal diagonal (a multiple of the
/// micro-kernels' 4 and 6 rows).
const DIAGONAL_ROWS: usize = 24;

/// How far (base-2 units, rounded to the nearest integer) a tile's scores may rise above a
/// row's reference before the reference moves: the tiles in between add weights of up to
/// `2^8.5 ~ 362` instead of 1, which f32 carries with the same relative precision, and the
/// accumulator is rescaled only when a row's scores jump by more (rare after the first
/// tile). The one pass then takes scores down to `127 - 8 = 119` units below the reference.
const LAZY_HEADROOM: f32 = 8.0;

/// Packed K and V above this size are packed one key/value head at a time (the heads then
/// run one after the other, each with all threads), so memory stays linear and small.
const UPFRONT_PANEL_BYTES: usize = 32 << 20;

/// Tile sizes of the tiled kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Blocks {
    /// Query rows per task.
    pub q: usize,
    /// Keys per score tile.
    pub k: usize,
}

impl Blocks {
    /// Tiles for a problem of these sizes: a `(q, k)` score tile plus the K and V panels it
    /// reads stay in a core's L2 cache, and there are enough tasks to feed every thread.
    /// `align`: score tiles start at multiples of it.
    pub fn for_problem(p: &Problem<'_>, threads: usize, align: usize) -> Self {
        if p.seq_k <= 512 {
            // One tile of keys: the same row blocks as the weights kernel.
            return Self {
                q: rows_per_block(p, threads),
                k: p.seq_k.max(1),
            };
        }
        let k = (256 / align).max(1) * align;
        let mut q = 256;
        // Smaller query blocks when there are too few tasks to go round.
        while q > 16 && p.batch * p.heads * p.seq_q.div_ceil(q) < 4 * threads {
            q /= 2;
        }
        Self { q, k }
    }
}

/// Context of every query (no weights), written to `out`; `packing`: how the products reach
/// the micro-kernels (AVX-512 or AVX2 + FMA), if at all.
///
/// # Shapes
/// - `p.q`: `(batch, heads, seq_q, d_k)`, `p.k`: `(batch, kv_heads, seq_k, d_k)`,
///   `p.v`: `(batch, kv_heads, seq_k, d_v)` (strided views)
/// - `out`: `(batch, heads, seq_q, d_v)` (strided view)
pub(crate) fn attention_tiled(
    p: &Problem<'_>,
    out: &OutOperand<'_>,
    packing: Packing,
) -> Result<()> {
    p.validate()?;
    let threads = rayon::current_num_threads();
    let groups = p.batch * p.kv_heads;
    if packing != Packing::Upfront {
        let blocks = Blocks::for_problem(p, threads, 1);
        return run_groups(p, out, blocks, Products::new(packing, None), 0..groups);
    }
    let blocks = Blocks::for_problem(p, threads, KEY_PANEL);
    if KvPanels::bytes(p, groups) <= UPFRONT_PANEL_BYTES {
        let kv = KvPanels::pack(p, 0, groups)?;
        return run_groups(p, out, blocks, Products::Packed(&kv), 0..groups);
    }
    for g in 0..groups {
        let kv = KvPanels::pack(p, g, 1)?;
        run_groups(p, out, blocks, Products::Packed(&kv), g..g + 1)?;
    }
    Ok(())
}

/// Every task of the heads of key/value groups `groups` (group = `batch * kv_heads +
/// kv_head`).
fn run_groups(
    p: &Problem<'_>,
    out: &OutOperand<'_>,
    blocks: Blocks,
    prods: Products<'_>,
    groups: Range<usize>,
) -> Result<()> {
    let per_group = p.heads / p.kv_heads;
    let nqb = p.seq_q.div_ceil(blocks.q);
    let pairs = groups.len() * per_group;
    let tasks = pairs * nqb;
    // Task t: the heaviest query blocks (last ones, under a causal mask) first.
    let run = |t: usize| -> Result<()> {
        let qb = nqb - 1 - t / pairs;
        let pair = t % pairs;
        let g = groups.start + pair / per_group;
        let (b, kvh) = (g / p.kv_heads, g % p.kv_heads);
        let h = kvh * per_group + pair % per_group;
        let i0 = qb * blocks.q;
        let n = blocks.q.min(p.seq_q - i0);
        task(p, out, blocks, prods, b, h, i0, n)
    };
    if tasks <= 1 || rayon::current_num_threads() == 1 {
        (0..tasks).try_for_each(run)
    } else {
        (0..tasks).into_par_iter().with_max_len(1).try_for_each(run)
    }
}

/// Queries `i0..i0 + n` of head `h` in batch `b`.
#[allow(clippy::too_many_arguments)]
fn task(
    p: &Problem<'_>,
    out: &OutOperand<'_>,
    blocks: Blocks,
    prods: Products<'_>,
    b: usize,
    h: usize,
    i0: usize,
    n: usize,
) -> Result<()> {
    let dv = p.dv;
    let (first, end) = p.key_range(b, i0, n);
    let align = prods.key_align();
    // A tile starts at a multiple of `align` at or before its first key.
    let ld = blocks.k + align;
    let sizes = [n * ld, n * dv, n, n, n];
    with_scratch(sizes.iter().sum(), |buf| {
        // `wide[r]` is 1 once row r's scores spanned more than the one pass takes: its
        // later tiles go straight to the full path instead of being computed twice.
        let [s, acc, m, l, wide] = split(buf, sizes);
        if end - first <= blocks.k {
            // One tile: softmax of the whole rows, as the weights kernel does.
            // SAFETY: this task is the only one that handles rows i0..i0+n of head h in b.
            let mut o = unsafe { out.mat_mut(b, h, i0, n, dv)? };
            // SAFETY: as above, these rows' log-sum-exp slots are this task's alone.
            let mut lse = unsafe { out.lse_rows(p, b, h, i0, n)? };
            let range = (first, end);
            return softmax_block(p, prods, &mut o, s, ld, 0, b, h, i0, n, range, lse.as_mut());
        }
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        wide.fill(0.0);
        acc.fill(0.0);
        let masked_parts = p.mask.key_bias.is_some() || p.mask.dense.is_some();
        let mut j0 = first / align * align;
        while j0 < end {
            let hi = (j0 + blocks.k).min(end);
            let lo = first.max(j0);
            let (off, cols) = (lo - j0, hi - lo);
            // S = scale log2(e) Q K^T for keys j0..hi, (n, hi - j0) at stride ld (base 2); on
            // a tile that crosses the causal diagonal, each group of rows up to the keys its
            // last row sees (the columns past them are never read unmasked).
            for (r, rows, seen) in row_groups(p, i0, n, lo, cols) {
                prods.scores(p, b, h, i0 + r, rows, (j0, lo + seen), &mut s[r * ld..], ld)?;
            }
            // A causal cut alone (no other mask) leaves each row a prefix of the tile's keys:
            // the keys past it get weight 0 and the prefix is an unmasked row.
            let cut = !masked_parts && p.causal_cuts(i0, lo, cols);
            for r in 0..n {
                let seen = if cut {
                    p.causal_visible_keys(i0 + r, lo, cols)
                } else {
                    cols
                };
                s[r * ld + off + seen..r * ld + off + cols].fill(0.0);
                if seen == 0 {
                    // Every key of this tile is hidden from this query: nothing to add.
                    continue;
                }
                if !masked_parts && wide[r] == 0.0 {
                    let row = &mut s[r * ld + off..r * ld + off + seen];
                    if m[r] == f32::NEG_INFINITY {
                        // The row's first tile: the reference is its maximum, rounded up.
                        let tile_max = simd::row_max(row);
                        if tile_max > m[r] {
                            m[r] = tile_max.ceil();
                        }
                    }
                    // One pass, unless the row outgrew its reference.
                    if m[r].is_finite() {
                        if let Some(sum) = simd::exp2_shifted_sum_bounded(row, m[r], LAZY_HEADROOM)
                        {
                            l[r] += sum;
                            continue;
                        }
                        // The pass overwrote the row: its scores again, for the full pass.
                        prods.scores(p, b, h, i0 + r, 1, (j0, lo + seen), &mut s[r * ld..], ld)?;
                        let row = &s[r * ld + off..r * ld + off + seen];
                        // Wide: spanning more than the one pass's window below the
                        // reference the row will have.
                        let low = row.iter().fold(f32::INFINITY, |a, &b| a.min(b));
                        let floor = LAZY_HEADROOM - simd::ONE_PASS_SPAN;
                        if low < m[r].max(simd::row_max(row)) + floor {
                            wide[r] = 1.0;
                        }
                    }
                }
                let row = &mut s[r * ld + off..r * ld + off + seen];
                if masked_parts {
                    p.mask_row(row, b, h, i0 + r, lo)?;
                }
                let tile_max = simd::row_max(row);
                if tile_max > m[r] {
                    // A new reference: the next integer up, so the rescaling factor is a
                    // power of two (exact) and the bounded pass can take it.
                    let m_new = tile_max.ceil();
                    if m[r] != f32::NEG_INFINITY {
                        let alpha = simd::exp2(m[r] - m_new);
                        l[r] *= alpha;
                        simd::scale(&mut acc[r * dv..(r + 1) * dv], alpha);
                    }
                    m[r] = m_new;
                }
                if m[r] == f32::NEG_INFINITY {
                    // Every key so far is hidden from this query: nothing to add.
                    row.fill(0.0);
                    continue;
                }
                l[r] += simd::exp2_shifted_sum(row, m[r]);
            }
            // acc += P V, (n, dv); on a tile that crosses the causal diagonal, by groups of
            // rows, each over the keys its last row can see (the weights past them are 0).
            for (r, rows, seen) in row_groups(p, i0, n, lo, cols) {
                let mut accm = MatMut::new(acc, r * dv, rows, dv, dv)?;
                let pm = &s[r * ld + off..];
                prods.weighted_values(p, b, h, pm, ld, rows, (lo, seen), &mut accm, true)?;
            }
            j0 = hi;
        }
        // SAFETY: this task is the only one that handles rows i0..i0+n of head h in b.
        let mut o = unsafe { out.mat_mut(b, h, i0, n, dv)? };
        // SAFETY: as above, these rows' log-sum-exp slots are this task's alone.
        if let Some(mut lse) = unsafe { out.lse_rows(p, b, h, i0, n)? } {
            if let Some(row) = lse.row_mut(0) {
                for (r, v) in row.iter_mut().enumerate() {
                    // The sum holds the reference's own term wherever a key was seen.
                    *v = if l[r] > 0.0 {
                        m[r] + l[r].log2()
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
        }
        for r in 0..n {
            let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
            let src = &acc[r * dv..(r + 1) * dv];
            if let Some(dst) = o.row_mut(r) {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = s * inv;
                }
            }
        }
        Ok(())
    })
}

/// The groups of rows `(first row, rows, keys seen)` of queries `i0..i0 + n` on the tile of
/// keys `lo..lo + cols`: all rows at once over every key, unless the causal diagonal crosses
/// the tile; then groups of [`DIAGONAL_ROWS`], each over the keys its last row sees (groups
/// that see none are left out).
fn row_groups<'a>(
    p: &'a Problem<'_>,
    i0: usize,
    n: usize,
    lo: usize,
    cols: usize,
) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
    let group = if p.causal_cuts(i0, lo, cols) {
        DIAGONAL_ROWS
    } else {
        n.max(1)
    };
    (0..n).step_by(group).filter_map(move |r| {
        let rows = group.min(n - r);
        let seen = p.causal_visible_keys(i0 + r + rows - 1, lo, cols);
        (seen > 0).then_some((r, rows, seen))
    })
}
