//! Gradients of attention on the CPU, FlashAttention-2 style: memory linear in the sequence
//! length (the `(seq_q, seq_k)` probabilities exist one `(q, k)` tile at a time).
//!
//! Two passes. The first, over `(batch, head, query block)`, computes each query row's
//! log-sum-exp of its scores (base-2 units, as the forward kernels score) and
//! `D = rowsum(dO * O)`. The second, over `(batch, kv head, key chunk)`, walks the chunk's
//! key blocks and, for each, every query block of the group's query heads that sees it:
//! recomputes `P = 2^(S - lse)`, then `dV += P^T dO`, `dP = dO V^T`, `dS = P * (dP - D)`,
//! `dK += scale dS^T Q`, `dQ += scale dS K`. A task owns the dK and dV rows of its keys and
//! the dQ rows of its group's query heads, so no two tasks write the same element. When
//! there are fewer `(batch, kv head)` groups than threads, each group's keys are cut into
//! chunks of about equal work; every chunk but the first adds into a dQ partial of its own,
//! summed into dQ at the end.
//!
//! Where the CPU has the micro-kernels, S, dP and dQ run on panels of the key block packed
//! once per block (K^T times the score scale, V^T, K) and read by every query tile of the
//! group's heads; dV and dK, whose left operands are transposed tiles, stay on the `gemm`
//! crate. A (1, 512, 768, 12) training step: 1-2% faster in six alternating pairs.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::attend::problem::{Operand, Problem};
use crate::kernels::attend::tile_products::{pack_keys, pack_values, slots};
use crate::kernels::gemm::matrix::{matmul, MatMut, MatRef, Threads};
use crate::kernels::gemm::microkernel::{self, panel_product, Start};
use crate::kernels::scratch::{split, with_scratch, TrainingBuffer};
use crate::kernels::simd;

/// Tile sizes of the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tiles {
    /// Query rows per tile.
    q: usize,
    /// Keys per tile.
    k: usize,
    /// S, dP and dQ on micro-kernel panels where the CPU has them (else the `gemm` crate).
    panels: bool,
}

/// 256 query rows by 256 keys, as the forward ([`crate::kernels::attend::tiled::Blocks`]): every product is
/// at least head-dim deep (256 for dK and dV), and the two score tiles with the blocks' K,
/// V, dK, dV, Q, dO and dQ (~1 MiB at head dim 64) stay in L2. Measured faster than 128 or
/// 64 query rows.
const TILES: Tiles = Tiles {
    q: 256,
    k: 256,
    panels: true,
};

/// Floats per piece when the dQ partials are summed.
const REDUCE_PIECE: usize = 1 << 14;

/// Gradients of `O = softmax(scale * Q K^T + mask) V` given dO.
/// Returns (dq, dk, dv), contiguous: dq (batch, heads, seq_q, dk), dk (batch, kv_heads, seq_k, dk),
/// dv (batch, kv_heads, seq_k, dv).
///
/// A query row that sees no key (empty key range, or every key at `-inf`) gets zero
/// gradients; masked keys get probability exactly 0.
///
/// # Shapes
/// - `p.q`: `(batch, heads, seq_q, d_k)`, `p.k`: `(batch, kv_heads, seq_k, d_k)`,
///   `p.v`: `(batch, kv_heads, seq_k, d_v)` (strided views)
/// - `o`, `d_o`: `(batch, heads, seq_q, d_v)` (strided views, the forward's context and its
///   gradient)
///
/// `lse`, when given, is each query row's log-sum-exp as the forward's tiled kernel wrote it
/// (`(batch, heads, seq_q)`, base-2 units); otherwise a first pass over the keys computes it.
pub(crate) fn attention_backward(
    p: &Problem<'_>,
    o: Operand<'_>,
    d_o: Operand<'_>,
    lse: Option<&[f32]>,
) -> Result<(TrainingBuffer, TrainingBuffer, TrainingBuffer)> {
    backward_with(p, o, d_o, lse, TILES, rayon::current_num_threads())
}

/// [`attention_backward`] with the given tiles, cutting keys for `threads` threads.
fn backward_with(
    p: &Problem<'_>,
    o: Operand<'_>,
    d_o: Operand<'_>,
    given_lse: Option<&[f32]>,
    tiles: Tiles,
    threads: usize,
) -> Result<(TrainingBuffer, TrainingBuffer, TrainingBuffer)> {
    p.validate()?;
    if tiles.q == 0 || tiles.k == 0 {
        return Err(Error::Kernel(format!("backward tiles of {tiles:?}")));
    }
    // Buffers kept from earlier steps (fresh memory pages in at a cost), zeroed.
    let zeroed = |n| {
        let mut b = TrainingBuffer::new(n);
        b.fill(0.0);
        b
    };
    let mut grad_q = zeroed(p.batch * p.heads * p.seq_q * p.dk);
    let mut grad_k = zeroed(p.batch * p.kv_heads * p.seq_k * p.dk);
    let mut grad_v = zeroed(p.batch * p.kv_heads * p.seq_k * p.dv);
    if p.batch * p.heads * p.seq_q == 0 || p.seq_k == 0 {
        // No query, or no key for any query: every gradient is 0.
        return Ok((grad_q, grad_k, grad_v));
    }
    let (lse, dsum) = row_statistics(p, o, d_o, given_lse, tiles, threads)?;
    let stats = RowStats {
        lse: &lse,
        dsum: &dsum,
    };
    key_pass(
        p,
        d_o,
        stats,
        tiles,
        threads,
        &mut grad_q,
        &mut grad_k,
        &mut grad_v,
    )?;
    Ok((grad_q, grad_k, grad_v))
}

/// Per query row, `(batch, heads, seq_q)` row-major.
#[derive(Debug, Clone, Copy)]
struct RowStats<'a> {
    /// Log-sum-exp of the masked scores in base-2 units, `-inf` for a row that sees no key.
    lse: &'a [f32],
    /// `D = rowsum(dO * O)`.
    dsum: &'a [f32],
}

/// The [`RowStats`] of every query row, tasks over `(batch, head, query block)`.
fn row_statistics(
    p: &Problem<'_>,
    o: Operand<'_>,
    d_o: Operand<'_>,
    given_lse: Option<&[f32]>,
    tiles: Tiles,
    threads: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let rows = p.batch * p.heads * p.seq_q;
    let mut lse = match given_lse {
        Some(l) if l.len() == rows => l.to_vec(),
        Some(l) => {
            return Err(Error::Kernel(format!(
                "{} log-sum-exps for {rows} query rows",
                l.len()
            )))
        }
        None => vec![0f32; rows],
    };
    let known = given_lse.is_some();
    let mut dsum = vec![0f32; rows];
    // Smaller query blocks when there are too few to go round.
    let mut bq = tiles.q;
    while bq > 8 && p.batch * p.heads * p.seq_q.div_ceil(bq) < 4 * threads {
        bq /= 2;
    }
    let mut tasks = Vec::with_capacity(p.batch * p.heads * p.seq_q.div_ceil(bq));
    let heads = lse.chunks_mut(p.seq_q).zip(dsum.chunks_mut(p.seq_q));
    for (bh, (l, d)) in heads.enumerate() {
        for (qb, (l, d)) in l.chunks_mut(bq).zip(d.chunks_mut(bq)).enumerate() {
            tasks.push((bh / p.heads, bh % p.heads, qb * bq, l, d));
        }
    }
    tasks
        .into_par_iter()
        .with_max_len(1)
        .try_for_each(|(b, h, i0, l, d)| {
            row_block_statistics(p, o, d_o, tiles.k, b, h, i0, l, d, known)
        })?;
    Ok((lse, dsum))
}

/// Log-sum-exp (into `lse`) and `D` (into `dsum`) of queries `i0..i0 + lse.len()` of head
/// `h` in batch `b`, over key tiles of `bk`.
#[allow(clippy::too_many_arguments)]
fn row_block_statistics(
    p: &Problem<'_>,
    o: Operand<'_>,
    d_o: Operand<'_>,
    bk: usize,
    b: usize,
    h: usize,
    i0: usize,
    lse: &mut [f32],
    dsum: &mut [f32],
    lse_known: bool,
) -> Result<()> {
    let n = lse.len();
    let om = o.mat(b, h, i0, n, p.dv)?;
    let gm = d_o.mat(b, h, i0, n, p.dv)?;
    for (r, d) in dsum.iter_mut().enumerate() {
        let (Some(orow), Some(grow)) = (om.row(r), gm.row(r)) else {
            return Err(Error::Kernel(format!("row {r} of O or dO")));
        };
        *d = orow.iter().zip(grow).map(|(a, g)| a * g).sum();
    }
    if lse_known {
        return Ok(());
    }
    let (first, end) = p.key_range(b, i0, n);
    with_scratch(n * bk + n, |buf| {
        // `lse` holds the running sums until the end.
        let [s, m] = split(buf, [n * bk, n]);
        m.fill(f32::NEG_INFINITY);
        lse.fill(0.0);
        for j0 in (first..end).step_by(bk) {
            let cols = bk.min(end - j0);
            scores(p, b, h, i0, n, j0, cols, s, bk)?;
            for r in 0..n {
                let row = &mut s[r * bk..r * bk + cols];
                p.mask_row(row, b, h, i0 + r, j0)?;
                let tile_max = simd::row_max(row);
                if tile_max == f32::NEG_INFINITY {
                    // Every key of this tile is hidden from this query.
                    continue;
                }
                if tile_max > m[r] {
                    if m[r] != f32::NEG_INFINITY {
                        lse[r] *= simd::exp2(m[r] - tile_max);
                    }
                    m[r] = tile_max;
                }
                lse[r] += simd::exp2_shifted_sum(row, m[r]);
            }
        }
        for (l, &m) in lse.iter_mut().zip(m.iter()) {
            // The sum is at least 1 (the maximum's own term) wherever a key was seen.
            *l = if *l > 0.0 {
                m + l.log2()
            } else {
                f32::NEG_INFINITY
            };
        }
        Ok(())
    })
}

/// `s = scale log2(e) Q K^T` for queries `i0..i0 + n` of head `h` in batch `b` and keys
/// `j0..j0 + cols`: `(n, cols)` at row stride `ld`, in base-2 units.
#[allow(clippy::too_many_arguments)]
fn scores(
    p: &Problem<'_>,
    b: usize,
    h: usize,
    i0: usize,
    n: usize,
    j0: usize,
    cols: usize,
    s: &mut [f32],
    ld: usize,
) -> Result<()> {
    let q = p.q.mat(b, h, i0, n, p.dk)?;
    let k = p.k.mat(b, p.kv_head(h), j0, cols, p.dk)?;
    let mut sm = MatMut::new(s, 0, n, cols, ld)?;
    matmul(&mut sm, q, k.t(), false, p.score_scale(), Threads::One)
}

/// One task of the second pass: keys `keys.0..keys.1` of key/value head `kv_head` in batch
/// `b`, against every query of the group's query heads.
struct KeyTask<'a> {
    b: usize,
    kv_head: usize,
    keys: (usize, usize),
    /// dK rows of the keys, `(keys.1 - keys.0, d_k)`.
    grad_k: &'a mut [f32],
    /// dV rows of the keys, `(keys.1 - keys.0, d_v)`.
    grad_v: &'a mut [f32],
    /// dQ of the group's query heads, or a partial of it, `(heads / kv_heads, seq_q, d_k)`.
    grad_q: &'a mut [f32],
}

/// `buf` cut into `n` consecutive pieces of `size` floats (the last ones shorter or empty
/// when `buf` runs out).
fn pieces(mut buf: &mut [f32], size: usize, n: usize) -> Vec<&mut [f32]> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let rest = std::mem::take(&mut buf);
        let (head, tail) = rest.split_at_mut(size.min(rest.len()));
        out.push(head);
        buf = tail;
    }
    out
}

/// Where batch `b`'s keys are cut into `chunks` chunks of about equal work (at multiples
/// of `bk` from its first kept key): `chunks + 1` increasing bounds from 0 to `seq_k`.
fn key_cuts(p: &Problem<'_>, b: usize, bk: usize, chunks: usize) -> Vec<usize> {
    let (first, end) = p.key_range(b, 0, p.seq_q);
    // Work of the key block at `j`: the query rows that see its first key.
    let work = |j: usize| p.seq_q - p.causal_hidden_rows(0, j).min(p.seq_q);
    let total: usize = (first..end).step_by(bk).map(work).sum();
    let mut cuts = vec![0];
    let mut done = 0;
    for j in (first..end).step_by(bk) {
        // Cut `c` goes before the first block past `c / chunks` of the work.
        if done > 0 && cuts.len() < chunks && done * chunks >= total * cuts.len() {
            cuts.push(j);
        }
        done += work(j);
    }
    while cuts.len() < chunks {
        cuts.push(end);
    }
    cuts.push(p.seq_k);
    cuts
}

/// The second pass: dQ, dK and dV, tasks over `(batch, kv head, key chunk)`.
#[allow(clippy::too_many_arguments)]
fn key_pass(
    p: &Problem<'_>,
    d_o: Operand<'_>,
    stats: RowStats<'_>,
    tiles: Tiles,
    threads: usize,
    grad_q: &mut [f32],
    grad_k: &mut [f32],
    grad_v: &mut [f32],
) -> Result<()> {
    let groups = p.batch * p.kv_heads;
    let per_group = p.heads / p.kv_heads;
    // Key chunks per group, so that every thread has a task.
    let chunks = if groups < threads {
        threads.div_ceil(groups)
    } else {
        1
    };
    let q_size = per_group * p.seq_q * p.dk;
    let mut partials = vec![0f32; groups * (chunks - 1) * q_size];
    let mut tasks = Vec::with_capacity(groups * chunks);
    let group_q = pieces(grad_q, q_size, groups);
    let group_partials = pieces(&mut partials, (chunks - 1) * q_size, groups);
    let group_k = pieces(grad_k, p.seq_k * p.dk, groups);
    let group_v = pieces(grad_v, p.seq_k * p.dv, groups);
    let per_group_bufs = group_q
        .into_iter()
        .zip(group_partials)
        .zip(group_k.into_iter().zip(group_v));
    for (g, ((gq, gpart), (gk, gv))) in per_group_bufs.enumerate() {
        let (b, kv_head) = (g / p.kv_heads, g % p.kv_heads);
        let cuts = key_cuts(p, b, tiles.k, chunks);
        let dq_bufs = std::iter::once(gq).chain(pieces(gpart, q_size, chunks - 1));
        let (mut gk, mut gv) = (gk, gv);
        for (w, dq_buf) in cuts.windows(2).zip(dq_bufs) {
            let keys = (w[0], w[1]);
            let (k_rows, k_rest) = std::mem::take(&mut gk).split_at_mut((w[1] - w[0]) * p.dk);
            let (v_rows, v_rest) = std::mem::take(&mut gv).split_at_mut((w[1] - w[0]) * p.dv);
            (gk, gv) = (k_rest, v_rest);
            tasks.push(KeyTask {
                b,
                kv_head,
                keys,
                grad_k: k_rows,
                grad_v: v_rows,
                grad_q: dq_buf,
            });
        }
    }
    tasks
        .into_par_iter()
        .with_max_len(1)
        .try_for_each(|t| key_task(p, d_o, stats, tiles, t))?;
    if chunks > 1 && q_size > 0 {
        // dQ += the partials of the other chunks, group by group.
        let parts = partials.par_chunks(q_size * (chunks - 1));
        grad_q
            .par_chunks_mut(q_size)
            .zip(parts)
            .for_each(|(dq, parts)| {
                dq.par_chunks_mut(REDUCE_PIECE)
                    .enumerate()
                    .for_each(|(c, piece)| {
                        let at = c * REDUCE_PIECE;
                        for part in parts.chunks(q_size) {
                            if let Some(src) = part.get(at..at + piece.len()) {
                                simd::add_assign(piece, src);
                            }
                        }
                    });
            });
    }
    Ok(())
}

/// Adds the task's keys' contributions to dK and dV and its queries' to its dQ buffer.
fn key_task(
    p: &Problem<'_>,
    d_o: Operand<'_>,
    stats: RowStats<'_>,
    tiles: Tiles,
    t: KeyTask<'_>,
) -> Result<()> {
    let KeyTask {
        b,
        kv_head,
        keys: (k0, k1),
        grad_k,
        grad_v,
        grad_q,
    } = t;
    let (first, end) = p.key_range(b, 0, p.seq_q);
    let (lo, hi) = (k0.max(first), k1.min(end));
    if lo >= hi {
        return Ok(());
    }
    let (bq, bk, dk, dv) = (tiles.q, tiles.k, p.dk, p.dv);
    let per_group = p.heads / p.kv_heads;
    // With micro-kernels, S, dP and dQ run on panels of the key block packed once and
    // read by every query tile of the group's heads: K^T (times the score scale) and V^T
    // in panels of 64 keys, K in panels of 64 features.
    let mut panels = (tiles.panels && microkernel::available()).then(|| KeyPanels::new(bk, dk, dv));
    with_scratch(2 * bq * bk, |buf| {
        // `s`: S, then P; `ds`: dP, then dS; both `(n, cols)` at row stride bk.
        let [s, ds] = split(buf, [bq * bk, bq * bk]);
        for j0 in (lo..hi).step_by(bk) {
            let cols = bk.min(hi - j0);
            let kj = p.k.mat(b, kv_head, j0, cols, dk)?;
            let vj = p.v.mat(b, kv_head, j0, cols, dv)?;
            if let Some(kp) = panels.as_mut() {
                kp.pack(&kj, &vj, p.score_scale())?;
            }
            let mut gkj = MatMut::new(grad_k, (j0 - k0) * dk, cols, dk, dk)?;
            let mut gvj = MatMut::new(grad_v, (j0 - k0) * dv, cols, dv, dv)?;
            // The queries that see key j0 (every one without a causal mask); the others see
            // no key of this block.
            let q_first = p.causal_hidden_rows(0, j0).min(p.seq_q);
            for hq in 0..per_group {
                let h = kv_head * per_group + hq;
                let row0 = (b * p.heads + h) * p.seq_q;
                for i0 in (q_first..p.seq_q).step_by(bq) {
                    let n = bq.min(p.seq_q - i0);
                    let qi = p.q.mat(b, h, i0, n, dk)?;
                    let goi = d_o.mat(b, h, i0, n, dv)?;
                    // P = 2^(S + mask - lse), (n, cols); exactly 0 where masked.
                    match &panels {
                        Some(kp) => kp.scores(&qi, s, bk)?,
                        None => scores(p, b, h, i0, n, j0, cols, s, bk)?,
                    }
                    for r in 0..n {
                        let row = &mut s[r * bk..r * bk + cols];
                        p.mask_row(row, b, h, i0 + r, j0)?;
                        let lse = stats.lse[row0 + i0 + r];
                        if lse == f32::NEG_INFINITY {
                            row.fill(0.0);
                        } else {
                            simd::exp2_shifted_sum(row, lse);
                        }
                    }
                    let pm = MatRef::new(s, 0, n, cols, bk, 1)?;
                    // dV_j += P^T dO_i, (cols, dv)
                    matmul(&mut gvj, pm.t(), goi, true, 1.0, Threads::One)?;
                    // dP = dO_i V_j^T, (n, cols)
                    match &panels {
                        Some(kp) => kp.probs_grad(&goi, ds, bk)?,
                        None => {
                            let mut dpm = MatMut::new(ds, 0, n, cols, bk)?;
                            matmul(&mut dpm, goi, vj.t(), false, 1.0, Threads::One)?;
                        }
                    }
                    // dS = scale P * (dP - D): the gradient of the natural-units score,
                    // times the scale that dK and dQ carry.
                    let scale = p.scale;
                    for r in 0..n {
                        let d = stats.dsum[row0 + i0 + r];
                        let prow = &s[r * bk..r * bk + cols];
                        for (x, &pv) in ds[r * bk..r * bk + cols].iter_mut().zip(prow) {
                            *x = scale * (pv * (*x - d));
                        }
                    }
                    let dsm = MatRef::new(ds, 0, n, cols, bk, 1)?;
                    // dK_j += scale dS^T Q_i, (cols, dk)
                    matmul(&mut gkj, dsm.t(), qi, true, 1.0, Threads::One)?;
                    // dQ_i += scale dS K_j, (n, dk)
                    let at = (hq * p.seq_q + i0) * dk;
                    match &panels {
                        Some(kp) => kp.query_grad(ds, bk, n, cols, grad_q, at)?,
                        None => {
                            let mut gqi = MatMut::new(grad_q, at, n, dk, dk)?;
                            matmul(&mut gqi, dsm, kj, true, 1.0, Threads::One)?;
                        }
                    }
                }
            }
        }
        Ok(())
    })
}

/// Keys per panel of [`KeyPanels`] (the `6 x 64` micro-kernel tile).
const KEY_BLOCK_PANEL: usize = 64;

/// One key block's K^T, V^T and K in micro-kernel panels (a task's, reused block by
/// block).
struct KeyPanels {
    dk: usize,
    dv: usize,
    /// Keys in the packed block.
    cols: usize,
    /// `ceil(bk / 64)` panels `(dk, 64)`: K^T times the score scale, 0 past the last key.
    kt: Vec<f32>,
    /// `ceil(bk / 64)` panels `(dv, 64)`: V^T.
    vt: Vec<f32>,
    /// `ceil(dk / 64)` panels `(cols, 64)`: K's features, 0 past the last one.
    k: Vec<f32>,
    bk: usize,
}

impl KeyPanels {
    fn new(bk: usize, dk: usize, dv: usize) -> Self {
        let np = bk.div_ceil(KEY_BLOCK_PANEL);
        Self {
            dk,
            dv,
            cols: 0,
            kt: vec![0.0; np * dk * KEY_BLOCK_PANEL],
            vt: vec![0.0; np * dv * KEY_BLOCK_PANEL],
            k: vec![0.0; dk.div_ceil(KEY_BLOCK_PANEL) * bk * KEY_BLOCK_PANEL],
            bk,
        }
    }

    /// Packs the block's keys `kj` and values `vj` (`cols <= bk` rows each).
    fn pack(&mut self, kj: &MatRef<'_>, vj: &MatRef<'_>, score_scale: f32) -> Result<()> {
        const W: usize = KEY_BLOCK_PANEL;
        let cols = kj.rows;
        if cols > self.bk || vj.rows != cols || kj.cols != self.dk || vj.cols != self.dv {
            return Err(Error::Kernel("a key block larger than its panels".into()));
        }
        self.cols = cols;
        let (dk, dv) = (self.dk, self.dv);
        for (i, c0) in (0..cols).step_by(W).enumerate() {
            let w = W.min(cols - c0);
            let kt = &mut self.kt[i * dk * W..(i + 1) * dk * W];
            pack_keys(kj, (c0, w), score_scale, slots(kt), W)?;
            let vt = &mut self.vt[i * dv * W..(i + 1) * dv * W];
            pack_keys(vj, (c0, w), 1.0, slots(vt), W)?;
        }
        for (i, f0) in (0..dk).step_by(W).enumerate() {
            let w = W.min(dk - f0);
            let k = &mut self.k[i * cols * W..(i + 1) * cols * W];
            pack_values(kj, (f0, w), slots(k), W, W)?;
        }
        Ok(())
    }

    /// `out (=) a @ panels` over the block's keys: `a` `(n, depth)` at row stride `lda`,
    /// `panels` of `(depth, 64)`, `out` `(n, cols)` at row stride `ld`.
    fn over_keys(
        &self,
        a: &MatRef<'_>,
        panels: &[f32],
        depth: usize,
        out: &mut [f32],
        ld: usize,
    ) -> Result<()> {
        const W: usize = KEY_BLOCK_PANEL;
        let (n, cols) = (a.rows, self.cols);
        if n == 0 || cols == 0 {
            return Ok(());
        }
        if a.cols != depth
            || (a.cs != 1 && depth > 1)
            || cols > ld
            || out.len() < (n - 1) * ld + cols
        {
            return Err(Error::Kernel(
                "a key-block product that does not fit".into(),
            ));
        }
        for (i, c0) in (0..cols).step_by(W).enumerate() {
            let w = W.min(cols - c0);
            let panel = &panels[i * depth * W..(i + 1) * depth * W];
            // SAFETY: the micro-kernels run (`KeyPanels` exists only then); `a` views n rows
            // of `depth` contiguous floats at stride a.rs (bounds-checked when built), the
            // panel holds depth x 64 floats, `out` n rows of c0 + w <= ld columns (checked
            // above), and `out` is a buffer of its own.
            unsafe {
                panel_product::<W>(
                    n,
                    depth,
                    a.ptr(),
                    a.rs,
                    panel.as_ptr(),
                    w,
                    out.as_mut_ptr().add(c0),
                    ld,
                    Start::Zero,
                );
            }
        }
        Ok(())
    }

    /// `s = score_scale Q_i K_j^T`, `(n, cols)` at row stride `ld`.
    fn scores(&self, qi: &MatRef<'_>, s: &mut [f32], ld: usize) -> Result<()> {
        self.over_keys(qi, &self.kt, self.dk, s, ld)
    }

    /// `dp = dO_i V_j^T`, `(n, cols)` at row stride `ld`.
    fn probs_grad(&self, goi: &MatRef<'_>, dp: &mut [f32], ld: usize) -> Result<()> {
        self.over_keys(goi, &self.vt, self.dv, dp, ld)
    }

    /// `dQ_i += dS K_j` into `grad_q[at..]` (`(n, dk)` rows of dk), `dS` `(n, cols)` at row
    /// stride `ld`.
    fn query_grad(
        &self,
        ds: &[f32],
        ld: usize,
        n: usize,
        cols: usize,
        grad_q: &mut [f32],
        at: usize,
    ) -> Result<()> {
        const W: usize = KEY_BLOCK_PANEL;
        let dk = self.dk;
        if n == 0 || cols == 0 || dk == 0 {
            return Ok(());
        }
        if cols != self.cols || ds.len() < (n - 1) * ld + cols || grad_q.len() < at + n * dk {
            return Err(Error::Kernel("a dQ product that does not fit".into()));
        }
        for (i, f0) in (0..dk).step_by(W).enumerate() {
            let w = W.min(dk - f0);
            let panel = &self.k[i * cols * W..(i + 1) * cols * W];
            // SAFETY: the micro-kernels run; `ds` holds n rows of `cols` floats at stride
            // `ld`, the panel cols x 64 floats, `grad_q[at..]` n rows of dk >= f0 + w floats
            // (all checked above), initialised (accumulated into), and distinct from both.
            unsafe {
                panel_product::<W>(
                    n,
                    cols,
                    ds.as_ptr(),
                    ld,
                    panel.as_ptr(),
                    w,
                    grad_q.as_mut_ptr().add(at + f0),
                    dk,
                    Start::Accumulate,
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The backward (default tiles, small tiles, keys cut into chunks) against gradients
    //! computed in f64 from the definition.
    use super::*;
    use crate::kernels::attend::problem::{DenseBias, KernelMask, OutOperand};
    use crate::kernels::attend::tests::values;
    use crate::kernels::gemm::matrix::SharedOut;

    #[derive(Default)]
    struct Case {
        b: usize,
        h: usize,
        kvh: usize,
        sq: usize,
        sk: usize,
        dk: usize,
        dv: usize,
        causal: Option<usize>,
        /// Kept keys per batch row (a contiguous range).
        ranges: Option<Vec<(usize, usize)>>,
        /// A `(batch, seq_k)` key bias hiding every key with `(j + b) % 5 == 2`.
        holes: bool,
        /// A dense `(batch, 1, seq_q, seq_k)` bias (broadcast over heads) with `-inf` holes,
        /// and query 3 of the last batch row hidden from every key.
        dense: bool,
        /// Q, K, V read out of a fused `(batch * seq, q | k | v)` buffer and O, dO out of
        /// `(batch, seq, heads * d_v)` (needs `sq == sk`).
        fused: bool,
    }

    /// Logical inputs, contiguous: q `(b, h, sq, dk)`, k `(b, kvh, sk, dk)`, v `(b, kvh, sk,
    /// dv)`, dO `(b, h, sq, dv)`; key bias `(b, sk)`, dense bias `(b, sq, sk)`.
    struct Inputs {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        d_o: Vec<f32>,
        key_bias: Option<Vec<f32>>,
        dense: Option<Vec<f32>>,
    }

    impl Inputs {
        fn new(c: &Case, seed: u64) -> Self {
            let key_bias = c.holes.then(|| {
                (0..c.b * c.sk)
                    .map(|x| {
                        let (b, j) = (x / c.sk, x % c.sk);
                        if (j + b) % 5 == 2 {
                            f32::NEG_INFINITY
                        } else {
                            0.0
                        }
                    })
                    .collect()
            });
            let dense = c.dense.then(|| {
                let mut d = values(c.b * c.sq * c.sk, seed + 4);
                for (x, v) in d.iter_mut().enumerate() {
                    if x % 7 == 3 {
                        *v = f32::NEG_INFINITY;
                    }
                }
                let row = ((c.b - 1) * c.sq + 3) * c.sk;
                d[row..row + c.sk].fill(f32::NEG_INFINITY);
                d
            });
            Self {
                q: values(c.b * c.h * c.sq * c.dk, seed),
                k: values(c.b * c.kvh * c.sk * c.dk, seed + 1),
                v: values(c.b * c.kvh * c.sk * c.dv, seed + 2),
                d_o: values(c.b * c.h * c.sq * c.dv, seed + 3),
                key_bias,
                dense,
            }
        }
    }

    /// (O, dQ, dK, dV) in f64 from the definition, laid out like `Inputs`, and which
    /// query rows `(b, h, sq)` and key rows `(b, kvh, sk)` the mask hides from everything.
    fn reference(c: &Case, x: &Inputs, scale: f64) -> ([Vec<f64>; 4], Vec<bool>, Vec<bool>) {
        let mut blind_q = vec![true; c.b * c.h * c.sq];
        let mut unseen_k = vec![true; c.b * c.kvh * c.sk];
        let mut o = vec![0f64; c.b * c.h * c.sq * c.dv];
        let mut dq = vec![0f64; c.b * c.h * c.sq * c.dk];
        let mut dk = vec![0f64; c.b * c.kvh * c.sk * c.dk];
        let mut dv = vec![0f64; c.b * c.kvh * c.sk * c.dv];
        for b in 0..c.b {
            for h in 0..c.h {
                let g = b * c.kvh + h / (c.h / c.kvh);
                for i in 0..c.sq {
                    let qi = ((b * c.h + h) * c.sq + i) * c.dk;
                    let oi = ((b * c.h + h) * c.sq + i) * c.dv;
                    let kj = |j: usize| (g * c.sk + j) * c.dk;
                    let vj = |j: usize| (g * c.sk + j) * c.dv;
                    // Natural-units scores with the mask added.
                    let s: Vec<f64> = (0..c.sk)
                        .map(|j| {
                            let hidden = c.causal.is_some_and(|off| j > off + i)
                                || c.ranges.as_ref().is_some_and(|r| j < r[b].0 || j >= r[b].1);
                            if hidden {
                                return f64::NEG_INFINITY;
                            }
                            let dot: f64 = (0..c.dk)
                                .map(|t| x.q[qi + t] as f64 * x.k[kj(j) + t] as f64)
                                .sum();
                            let kb = x.key_bias.as_ref().map_or(0.0, |kb| kb[b * c.sk + j]);
                            let db = x
                                .dense
                                .as_ref()
                                .map_or(0.0, |d| d[(b * c.sq + i) * c.sk + j]);
                            scale * dot + kb as f64 + db as f64
                        })
                        .collect();
                    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    if m == f64::NEG_INFINITY {
                        continue;
                    }
                    blind_q[(b * c.h + h) * c.sq + i] = false;
                    let e: Vec<f64> = s.iter().map(|&v| (v - m).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    let pr: Vec<f64> = e.iter().map(|v| v / sum).collect();
                    for d in 0..c.dv {
                        o[oi + d] = (0..c.sk).map(|j| pr[j] * x.v[vj(j) + d] as f64).sum();
                    }
                    let dp: Vec<f64> = (0..c.sk)
                        .map(|j| {
                            (0..c.dv)
                                .map(|d| x.d_o[oi + d] as f64 * x.v[vj(j) + d] as f64)
                                .sum()
                        })
                        .collect();
                    let rs: f64 = (0..c.sk).map(|j| pr[j] * dp[j]).sum();
                    for j in 0..c.sk {
                        if s[j] > f64::NEG_INFINITY {
                            unseen_k[g * c.sk + j] = false;
                        }
                        let ds = pr[j] * (dp[j] - rs);
                        for t in 0..c.dk {
                            dq[qi + t] += scale * ds * x.k[kj(j) + t] as f64;
                            dk[kj(j) + t] += scale * ds * x.q[qi + t] as f64;
                        }
                        for d in 0..c.dv {
                            dv[vj(j) + d] += pr[j] * x.d_o[oi + d] as f64;
                        }
                    }
                }
            }
        }
        ([o, dq, dk, dv], blind_q, unseen_k)
    }

    /// Close to the reference (relative to its largest element), finite, and exactly 0 in
    /// the rows of `width` elements that `hidden` flags (keys no query sees, queries that
    /// see no key).
    fn close(what: &str, got: &[f32], want: &[f64], hidden: &[bool], width: usize) {
        assert_eq!(got.len(), want.len(), "{what}");
        let largest = want.iter().fold(0f64, |a, &b| a.max(b.abs()));
        let tol = 1e-4 * largest.max(1e-3);
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(g.is_finite(), "{what}[{i}]: {g}");
            assert!(
                (g as f64 - w).abs() <= tol,
                "{what}[{i}]: {g} vs {w} (tol {tol})"
            );
            if hidden[i / width] {
                assert_eq!(g, 0.0, "{what}[{i}]");
            }
        }
    }

    /// `data` `(b, heads, t, d)` written into `dst` at `offset + b * sb + h * sh + i * sr`.
    #[allow(clippy::too_many_arguments)]
    fn scatter(
        dst: &mut [f32],
        data: &[f32],
        (b, heads, t, d): (usize, usize, usize, usize),
        offset: usize,
        (sb, sh, sr): (usize, usize, usize),
    ) {
        for x in 0..b * heads * t {
            let (bb, h, i) = (x / (heads * t), x / t % heads, x % t);
            let at = offset + bb * sb + h * sh + i * sr;
            dst[at..at + d].copy_from_slice(&data[x * d..(x + 1) * d]);
        }
    }

    /// The backward on `c` with its default tiles, with small tiles, and with the keys cut
    /// into chunks, against the f64 reference.
    fn check(c: &Case, seed: u64, what: &str) -> Result<()> {
        let x = Inputs::new(c, seed);
        let scale = 1.0 / (c.dk as f64).sqrt();
        let ([o64, want_q, want_k, want_v], blind_q, unseen_k) = reference(c, &x, scale);
        let o: Vec<f32> = o64.iter().map(|&v| v as f32).collect();
        let contiguous = |data, t, h, d| Operand {
            data,
            offset: 0,
            sb: h * t * d,
            sh: t * d,
            sr: d,
        };
        // The fused layouts: Q | K | V per row, after `LEAD` unused floats; O and dO
        // `(batch, seq, heads * d_v)`.
        const LEAD: usize = 3;
        let width = c.h * c.dk + c.kvh * c.dk + c.kvh * c.dv;
        let t = c.sq;
        let mut fused = vec![f32::NAN; LEAD + c.b * t * width];
        let mut o_rows = vec![f32::NAN; c.b * t * c.h * c.dv];
        let mut do_rows = o_rows.clone();
        if c.fused {
            assert_eq!(c.sq, c.sk, "{what}: fused needs seq_q == seq_k");
            let (q_at, k_at, v_at) = (LEAD, LEAD + c.h * c.dk, LEAD + (c.h + c.kvh) * c.dk);
            let qkv = (t * width, c.dk, width);
            scatter(&mut fused, &x.q, (c.b, c.h, t, c.dk), q_at, qkv);
            scatter(&mut fused, &x.k, (c.b, c.kvh, t, c.dk), k_at, qkv);
            let v_strides = (t * width, c.dv, width);
            scatter(&mut fused, &x.v, (c.b, c.kvh, t, c.dv), v_at, v_strides);
            let od = (c.b, c.h, t, c.dv);
            let o_strides = (t * c.h * c.dv, c.dv, c.h * c.dv);
            scatter(&mut o_rows, &o, od, 0, o_strides);
            scatter(&mut do_rows, &x.d_o, od, 0, o_strides);
        }
        let fused_op = |offset, sh| Operand {
            data: &fused,
            offset,
            sb: t * width,
            sh,
            sr: width,
        };
        let rows_op = |data| Operand {
            data,
            offset: 0,
            sb: t * c.h * c.dv,
            sh: c.dv,
            sr: c.h * c.dv,
        };
        let (q, k, v, o_op, do_op) = if c.fused {
            (
                fused_op(LEAD, c.dk),
                fused_op(LEAD + c.h * c.dk, c.dk),
                fused_op(LEAD + (c.h + c.kvh) * c.dk, c.dv),
                rows_op(&o_rows),
                rows_op(&do_rows),
            )
        } else {
            (
                contiguous(&x.q, c.sq, c.h, c.dk),
                contiguous(&x.k, c.sk, c.kvh, c.dk),
                contiguous(&x.v, c.sk, c.kvh, c.dv),
                contiguous(&o, c.sq, c.h, c.dv),
                contiguous(&x.d_o, c.sq, c.h, c.dv),
            )
        };
        let p = Problem {
            batch: c.b,
            heads: c.h,
            kv_heads: c.kvh,
            seq_q: c.sq,
            seq_k: c.sk,
            dk: c.dk,
            dv: c.dv,
            q,
            k,
            v,
            scale: scale as f32,
            mask: KernelMask {
                causal_offset: c.causal,
                key_bias: x.key_bias.as_deref(),
                key_range: c.ranges.as_deref(),
                dense: x.dense.as_deref().map(|data| DenseBias {
                    data,
                    offset: 0,
                    strides: [c.sq * c.sk, 0, c.sk, 1],
                }),
            },
        };
        // The log-sum-exps the forward's tiled kernel writes.
        let mut lse = vec![f32::NAN; c.b * c.h * c.sq];
        let mut ctx = vec![0f32; c.b * c.h * c.sq * c.dv];
        crate::kernels::attend::run(
            &p,
            &OutOperand {
                buf: SharedOut::new(&mut ctx),
                offset: 0,
                sb: c.h * c.sq * c.dv,
                sh: c.sq * c.dv,
                sr: c.dv,
                lse: Some(SharedOut::new(&mut lse)),
            },
            crate::kernels::attend::WeightsMode::Skip,
        )?;
        let small = |panels| Tiles {
            q: 16,
            k: 32,
            panels,
        };
        let chunked = |panels| Tiles {
            q: 24,
            k: 40,
            panels,
        };
        let runs = [
            ("default", attention_backward(&p, o_op, do_op, None)?),
            (
                "small tiles",
                backward_with(&p, o_op, do_op, None, small(true), 1)?,
            ),
            (
                "keys in chunks",
                backward_with(&p, o_op, do_op, None, chunked(true), 7)?,
            ),
            (
                "the gemm crate's products",
                backward_with(&p, o_op, do_op, None, chunked(false), 7)?,
            ),
            (
                "the gemm crate's products, small tiles",
                backward_with(&p, o_op, do_op, None, small(false), 1)?,
            ),
            (
                "the forward's log-sum-exp",
                attention_backward(&p, o_op, do_op, Some(&lse))?,
            ),
        ];
        for (how, (dq, dk, dv)) in &runs {
            close(&format!("{what}, {how}: dq"), dq, &want_q, &blind_q, c.dk);
            close(&format!("{what}, {how}: dk"), dk, &want_k, &unseen_k, c.dk);
            close(&format!("{what}, {how}: dv"), dv, &want_v, &unseen_k, c.dv);
        }
        Ok(())
    }

    #[test]
    fn gradients_equal_the_definition() -> Result<()> {
        let cases = [
            // Grouped heads, d_k != d_v, seq_q != seq_k, one tile.
            Case {
                b: 2,
                h: 4,
                kvh: 2,
                sq: 9,
                sk: 13,
                dk: 8,
                dv: 20,
                ..Case::default()
            },
            // Causal with an offset over several key tiles, one kv head.
            Case {
                b: 1,
                h: 2,
                kvh: 1,
                sq: 70,
                sk: 600,
                dk: 24,
                dv: 16,
                causal: Some(530),
                ..Case::default()
            },
            // Causal self-attention out of a fused buffer, grouped heads, padding ranges
            // with a batch row that keeps no key.
            Case {
                b: 2,
                h: 4,
                kvh: 2,
                sq: 300,
                sk: 300,
                dk: 16,
                dv: 8,
                causal: Some(0),
                ranges: Some(vec![(3, 280), (0, 0)]),
                fused: true,
                ..Case::default()
            },
            // A key bias with holes and a dense bias (one query sees no key), tiny heads.
            Case {
                b: 2,
                h: 2,
                kvh: 1,
                sq: 33,
                sk: 700,
                dk: 5,
                dv: 3,
                holes: true,
                dense: true,
                ranges: Some(vec![(50, 651), (0, 700)]),
                ..Case::default()
            },
            // Long causal self-attention, fused, with key holes.
            Case {
                b: 1,
                h: 1,
                kvh: 1,
                sq: 517,
                sk: 517,
                dk: 32,
                dv: 40,
                causal: Some(0),
                holes: true,
                fused: true,
                ..Case::default()
            },
            // Heads wider than one 64-float panel (K in two panels for dQ, V^T deeper than
            // 128), keys not a multiple of the panel.
            Case {
                b: 1,
                h: 2,
                kvh: 1,
                sq: 90,
                sk: 301,
                dk: 72,
                dv: 130,
                ..Case::default()
            },
        ];
        for (n, c) in cases.iter().enumerate() {
            check(c, 10 * n as u64 + 1, &format!("case {n}"))?;
        }
        Ok(())
    }

    #[test]
    fn key_chunks_cover_the_keys_with_balanced_work() {
        let q = values(64, 1);
        let op = Operand {
            data: &q,
            offset: 0,
            sb: 0,
            sh: 0,
            sr: 0,
        };
        let ranges = [(10, 900)];
        let p = Problem {
            batch: 1,
            heads: 1,
            kv_heads: 1,
            seq_q: 1000,
            seq_k: 1000,
            dk: 1,
            dv: 1,
            q: op,
            k: op,
            v: op,
            scale: 1.0,
            mask: KernelMask {
                causal_offset: Some(0),
                key_range: Some(&ranges),
                ..KernelMask::default()
            },
        };
        let cuts = key_cuts(&p, 0, 100, 2);
        // Under the causal mask the early keys are seen by more queries: the first chunk
        // has fewer keys.
        assert_eq!(cuts.len(), 3);
        assert_eq!((cuts[0], cuts[2]), (0, 1000));
        assert!(
            cuts[1] > 10 && cuts[1] < 455 && (cuts[1] - 10).is_multiple_of(100),
            "{cuts:?}"
        );
        // More chunks than blocks: the extra ones are empty.
        let cuts = key_cuts(&p, 0, 500, 4);
        assert_eq!(cuts, vec![0, 510, 900, 900, 1000]);
    }
}
