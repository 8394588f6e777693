//! The two products of attention on a tile, `S = scale * Q K^T` and `O (+)= P V`, in one of
//! three ways:
//! - [`Products::Packed`] (CPUs with AVX-512 or AVX2 + FMA): K and V packed once per call (or
//!   per key/value head for long sequences, to keep memory low) into the panels of the
//!   micro-kernels — K^T times [`Problem::score_scale`] in panels of 48 keys, V in panels of
//!   64 value columns — so the products read the query rows in place and stream contiguous
//!   panels, and nothing is repacked;
//! - [`Products::PerTask`] (the same CPUs, few keys): each product packs the keys or values
//!   it reads into this thread's panels (K^T in panels of 32 keys) and runs the
//!   micro-kernels on them, with no packing pass over every head before the tasks start;
//! - [`Products::Strided`]: the `gemm` crate on strided views of Q, K and V (other CPUs, and
//!   key counts where neither packing pays).

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::attend::problem::Problem;
use crate::kernels::gemm::matrix::{matmul, MatMut, MatRef, Threads};
use crate::kernels::gemm::microkernel;
use crate::kernels::gemm::microkernel::{panel_product, Start};
use crate::kernels::gemm::transpose;
use crate::kernels::scratch::{with_panel_scratch, CallBuffer};

/// Keys per K panel; score tiles start at multiples of it.
pub(crate) const KEY_PANEL: usize = 48;
// The keys are transposed into the K panels 8 at a time.
const _: () = assert!(KEY_PANEL.is_multiple_of(transpose::COLUMNS));

/// Value columns per V panel.
///
/// On AVX2 `P V` runs `6 x 16` tiles on these panels, `Q K^T` `4 x 24` tiles on the K
/// panels. Computing the transposed products instead (`S^T = K Q^T`, `O^T += V^T P^T`, so
/// that `P^T` is a 48-column panel and both products take `4 x 24` tiles) would make the
/// second product a few percent faster, about 1% of the whole kernel
/// (docs/performance-archive.md): not worth turning every mask and the online softmax into
/// column form.
const V_PANEL: usize = 64;

/// Keys per K panel of [`Products::PerTask`]: 32 keys are two 16-column strips of the AVX2
/// `6 x 16` tile, where a 48-key panel would leave them a 24-column strip and an 8-column
/// one (4 accumulators, half the multiply-add rate). Attention alone at seq 32, 12 heads of
/// 32, paired runs (AMD Zen 3): 48-key panels took 1.04x the time of 32-key ones.
const TASK_KEY_PANEL: usize = 32;

/// Up to this many keys the products pack per task ([`Packing::PerTask`]). Attention alone
/// (bench `--core`, 12 heads of 64, paired runs, time per-task / `gemm` crate, AMD Zen 3):
/// 0.87 at 32 keys, 0.90 at 64, 1.01 at 128, 0.98 at 256; with 12 heads of 32 at seq 32:
/// 0.86. Above it the `gemm` crate stays until the up-front panels pay.
pub(crate) const PER_TASK_MAX_KEYS: usize = 64;

/// Where the micro-kernels' panels come from, for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Packing {
    /// No panels: [`Products::Strided`].
    None,
    /// Each product packs what it reads: [`Products::PerTask`].
    PerTask,
    /// K and V packed before the tasks run: [`Products::Packed`].
    Upfront,
}

impl Packing {
    /// The packing for `seq_k` keys: up front above `min_upfront` keys, per task up to
    /// [`PER_TASK_MAX_KEYS`], none in between or where the CPU has no micro-kernel.
    pub fn for_keys(seq_k: usize, min_upfront: usize) -> Self {
        if !microkernel::available() {
            Packing::None
        } else if seq_k > min_upfront {
            Packing::Upfront
        } else if seq_k <= PER_TASK_MAX_KEYS {
            Packing::PerTask
        } else {
            Packing::None
        }
    }
}

/// `f32` slots to write into (the view of initialised floats as maybe-uninitialised ones).
pub(crate) fn slots(x: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has the layout of `f32`, and the view only ever gets
    // initialised values written into it, so `x` stays initialised.
    unsafe { &mut *(x as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// One `K^T` panel of `width` columns: column `j < n` of row `c` is `scale` times feature `c`
/// of key `first + j` of `keys`, columns `n..width` are 0.
///
/// # Shapes
/// - `keys`: `(seq_k, dk)` with contiguous rows; `dst`: `dk * width` floats
pub(crate) fn pack_keys(
    keys: &MatRef<'_>,
    (first, n): (usize, usize),
    scale: f32,
    dst: &mut [MaybeUninit<f32>],
    width: usize,
) -> Result<()> {
    // Column j of the panel's row c is feature c of key first + j. Eight keys at a time,
    // transposed in registers: their rows stay in L1 (a wide key stride maps many rows to
    // the same cache sets, so all 48 at once would not) and each row c of the panel gets 8
    // contiguous floats. Measured by perf (AMD Zen 3, 2 threads): packing K took 0.93% of
    // the samples of the MHA forward at seq 512, hidden 768 (1.45% one float at a time),
    // 0.36% of SDPA at seq 4096 (0.57%).
    for j in (0..width).step_by(transpose::COLUMNS) {
        let live = transpose::COLUMNS.min(n.saturating_sub(j));
        let mut rows: [&[f32]; transpose::COLUMNS] = [&[]; transpose::COLUMNS];
        for (t, row) in rows.iter_mut().take(live).enumerate() {
            *row = keys
                .row(first + j + t)
                .ok_or_else(|| Error::Kernel("keys whose features are not contiguous".into()))?;
        }
        let dst = dst.get_mut(j..).ok_or_else(|| too_small("key panel"))?;
        transpose::transpose_scaled(&rows[..live], keys.cols, scale, dst, width)?;
    }
    Ok(())
}

/// One V panel of `width` columns: row `j` holds columns `c0..c0 + n` of value row `j`, then
/// zeros up to column `pad` (the kernels read no further).
///
/// # Shapes
/// - `values`: `(rows, dv)` with contiguous rows; `dst`: `rows * width` floats
pub(crate) fn pack_values(
    values: &MatRef<'_>,
    (c0, n): (usize, usize),
    dst: &mut [MaybeUninit<f32>],
    width: usize,
    pad: usize,
) -> Result<()> {
    for (j, row) in dst.chunks_mut(width).take(values.rows).enumerate() {
        let src = values
            .row(j)
            .and_then(|r| r.get(c0..c0 + n))
            .ok_or_else(|| Error::Kernel("values whose features are not contiguous".into()))?;
        for (d, &x) in row.iter_mut().zip(src) {
            d.write(x);
        }
        for d in row.iter_mut().take(pad).skip(n) {
            d.write(0.0);
        }
    }
    Ok(())
}

/// K and V of some `(batch, kv_head)` groups in panels.
#[derive(Debug)]
pub(crate) struct KvPanels {
    /// First group held (`batch * kv_heads + kv_head`).
    first: usize,
    groups: usize,
    seq_k: usize,
    dk: usize,
    dv: usize,
    /// K panels per group.
    nk: usize,
    /// V panels per group.
    nv: usize,
    /// Group `g`, panel `i`: `(dk, 48)` row-major at `((g * nk + i) * dk) * 48`, times
    /// [`Problem::score_scale`]; the columns past the last key are 0.
    k: CallBuffer,
    /// Group `g`, panel `q`: `(seq_k, 64)` row-major at `((g * nv + q) * seq_k) * 64`.
    v: CallBuffer,
}

impl KvPanels {
    /// Bytes the panels of `groups` groups take.
    pub fn bytes(p: &Problem<'_>, groups: usize) -> usize {
        let nk = p.seq_k.div_ceil(KEY_PANEL);
        let nv = p.dv.div_ceil(V_PANEL);
        4 * groups * (nk * p.dk * KEY_PANEL + nv * p.seq_k * V_PANEL)
    }

    /// Packs groups `first..first + groups` (group = `batch * kv_heads + kv_head`).
    pub fn pack(p: &Problem<'_>, first: usize, groups: usize) -> Result<Self> {
        let (sk, dk, dv) = (p.seq_k, p.dk, p.dv);
        let nk = sk.div_ceil(KEY_PANEL);
        let nv = dv.div_ceil(V_PANEL);
        let k_group = nk * dk * KEY_PANEL;
        let v_group = nv * sk * V_PANEL;
        let scale = p.score_scale();
        // Every element is written below (padding columns with 0), so the buffers are not
        // zeroed first.
        let k = filled(groups * k_group, k_group, |g, dst| {
            let (b, kvh) = ((first + g) / p.kv_heads, (first + g) % p.kv_heads);
            let keys = p.k.mat(b, kvh, 0, sk, dk)?;
            for (i, panel) in dst.chunks_mut(dk * KEY_PANEL).enumerate() {
                let j0 = i * KEY_PANEL;
                pack_keys(&keys, (j0, KEY_PANEL.min(sk - j0)), scale, panel, KEY_PANEL)?;
            }
            Ok(())
        })?;
        let v = filled(groups * v_group, v_group, |g, dst| {
            let (b, kvh) = ((first + g) / p.kv_heads, (first + g) % p.kv_heads);
            let values = p.v.mat(b, kvh, 0, sk, dv)?;
            for (q, panel) in dst.chunks_mut(sk * V_PANEL).enumerate() {
                let c0 = q * V_PANEL;
                pack_values(&values, (c0, V_PANEL.min(dv - c0)), panel, V_PANEL, V_PANEL)?;
            }
            Ok(())
        })?;
        Ok(Self {
            first,
            groups,
            seq_k: sk,
            dk,
            dv,
            nk,
            nv,
            k,
            v,
        })
    }

    fn local(&self, p: &Problem<'_>, b: usize, h: usize) -> Result<usize> {
        let g = b * p.kv_heads + p.kv_head(h);
        g.checked_sub(self.first)
            .filter(|&l| l < self.groups)
            .ok_or_else(|| Error::Kernel(format!("key/value group {g} is not packed")))
    }
}

/// How a task computes its tile products.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Products<'a> {
    Packed(&'a KvPanels),
    PerTask,
    Strided,
}

impl<'a> Products<'a> {
    /// The products for `packing`, reading `kv` where K and V were packed up front. Per-task
    /// panels fall back to the `gemm` crate on a CPU without micro-kernels, so that
    /// [`Products::PerTask`] (whose products call them unchecked) never exists there.
    pub fn new(packing: Packing, kv: Option<&'a KvPanels>) -> Self {
        match (kv, packing) {
            (Some(kv), _) => Products::Packed(kv),
            (None, Packing::PerTask) if microkernel::available() => Products::PerTask,
            (None, _) => Products::Strided,
        }
    }
}

/// A vector of `n` floats (reusing an earlier call's buffer) whose chunks of `chunk` are
/// written in parallel by `fill(index, chunk)`, which must write every element of its chunk.
fn filled(
    n: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) -> Result<()> + Sync,
) -> Result<CallBuffer> {
    let mut out = CallBuffer::with_capacity(n);
    if chunk > 0 {
        out.spare_capacity_mut()[..n]
            .par_chunks_mut(chunk)
            .enumerate()
            .try_for_each(|(g, dst)| fill(g, dst))?;
    }
    // SAFETY: every chunk was written in full by `fill` (its contract; the callers' loops
    // cover each panel's keys and padding), and `n` is within the capacity.
    unsafe { out.set_len(n) };
    Ok(out)
}

fn too_small(what: &str) -> Error {
    Error::Kernel(format!("{what} buffer too small for its tile"))
}

impl Products<'_> {
    /// Score tiles start at multiples of this key index.
    pub fn key_align(&self) -> usize {
        match self {
            Products::Packed(_) => KEY_PANEL,
            Products::PerTask | Products::Strided => 1,
        }
    }

    /// `s[r * ld + c] = score_scale * q_{i0 + r} . k_{j0 + c}` (base-2 units, see
    /// [`Problem::score_scale`]) for `r < n`, `c < hi - j0`;
    /// `j0` is a multiple of [`Products::key_align`].
    #[allow(clippy::too_many_arguments)]
    pub fn scores(
        &self,
        p: &Problem<'_>,
        b: usize,
        h: usize,
        i0: usize,
        n: usize,
        (j0, hi): (usize, usize),
        s: &mut [f32],
        ld: usize,
    ) -> Result<()> {
        let cols = hi - j0;
        if n == 0 || cols == 0 {
            return Ok(());
        }
        if s.len() < (n - 1) * ld + cols || cols > ld || hi > p.seq_k {
            return Err(too_small("scores"));
        }
        match self {
            Products::Strided => {
                let q = p.q.mat(b, h, i0, n, p.dk)?;
                let k = p.k.mat(b, p.kv_head(h), j0, cols, p.dk)?;
                let mut sm = MatMut::new(s, 0, n, cols, ld)?;
                matmul(&mut sm, q, k.t(), false, p.score_scale(), Threads::One)
            }
            Products::PerTask => {
                let dk = p.dk;
                let q = p.q.mat(b, h, i0, n, dk)?;
                let keys = p.k.mat(b, p.kv_head(h), j0, cols, dk)?;
                let scale = p.score_scale();
                with_panel_scratch(dk * TASK_KEY_PANEL, |panel| {
                    for c0 in (0..cols).step_by(TASK_KEY_PANEL) {
                        let width = TASK_KEY_PANEL.min(cols - c0);
                        pack_keys(&keys, (c0, width), scale, slots(panel), TASK_KEY_PANEL)?;
                        // SAFETY: the micro-kernels run (`Products::new` makes `PerTask` only
                        // then); `q` views n rows of dk floats at stride q.rs (checked by
                        // `mat`), the panel holds dk x 32 floats, and s n rows of at least
                        // `c0 + width` columns at stride ld (checked above); s is a distinct
                        // buffer.
                        unsafe {
                            panel_product::<TASK_KEY_PANEL>(
                                n,
                                dk,
                                q.ptr(),
                                q.rs,
                                panel.as_ptr(),
                                width,
                                s.as_mut_ptr().add(c0),
                                ld,
                                Start::Zero,
                            )
                        };
                    }
                    Ok(())
                })
            }
            Products::Packed(kv) => {
                let g = kv.local(p, b, h)?;
                let dk = kv.dk;
                if j0 % KEY_PANEL != 0 {
                    return Err(Error::Kernel("unaligned score tile".into()));
                }
                // The query rows in place (the scale is in the K panels).
                let q = p.q.mat(b, h, i0, n, dk)?;
                let (qp, lda) = (q.ptr(), q.rs);
                let mut j = j0;
                while j < hi {
                    let i = j / KEY_PANEL;
                    let width = KEY_PANEL.min(hi - j);
                    // Under a causal mask the first rows may see no key of this panel: their
                    // scores are left as they are (the mask overwrites them with -inf, as
                    // it does every hidden key of a tile that crosses the diagonal).
                    let r0 = p.causal_hidden_rows(i0, j).min(n);
                    if r0 == n {
                        j += width;
                        continue;
                    }
                    let at = (g * kv.nk + i) * dk * KEY_PANEL;
                    let panel =
                        kv.k.get(at..at + dk * KEY_PANEL)
                            .ok_or_else(|| too_small("key panel"))?;
                    // SAFETY: the micro-kernels run (the panels exist only then); `q` views n
                    // rows of dk floats at stride lda (checked by `mat`), the panel holds
                    // dk x 48, and s n rows of at least `j - j0 + width` columns at stride ld
                    // (checked above); s is a distinct buffer; rows r0..n of each are a part
                    // of them (r0 < n).
                    unsafe {
                        panel_product::<KEY_PANEL>(
                            n - r0,
                            dk,
                            qp.add(r0 * lda),
                            lda,
                            panel.as_ptr(),
                            width,
                            s.as_mut_ptr().add(r0 * ld + j - j0),
                            ld,
                            Start::Zero,
                        )
                    };
                    j += width;
                }
                Ok(())
            }
        }
    }

    /// `o (=|+=) P V[lo..lo + cols]` with `P` the `(n, cols)` rows of `pm` at stride `ldp`.
    #[allow(clippy::too_many_arguments)]
    pub fn weighted_values(
        &self,
        p: &Problem<'_>,
        b: usize,
        h: usize,
        pm: &[f32],
        ldp: usize,
        n: usize,
        (lo, cols): (usize, usize),
        o: &mut MatMut<'_>,
        accumulate: bool,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if pm.len() < (n - 1) * ldp + cols || lo + cols > p.seq_k || o.rows < n || o.cols < p.dv {
            return Err(too_small("weights"));
        }
        match self {
            Products::Strided => {
                let pmat = MatRef::new(pm, 0, n, cols, ldp, 1)?;
                let v = p.v.mat(b, p.kv_head(h), lo, cols, p.dv)?;
                matmul(o, pmat, v, accumulate, 1.0, Threads::One)
            }
            Products::PerTask => {
                let dv = p.dv;
                let values = p.v.mat(b, p.kv_head(h), lo, cols, dv)?;
                with_panel_scratch(cols * V_PANEL, |panel| {
                    for c0 in (0..dv).step_by(V_PANEL) {
                        let width = V_PANEL.min(dv - c0);
                        let pad = width.next_multiple_of(16).min(V_PANEL);
                        pack_values(&values, (c0, width), slots(panel), V_PANEL, pad)?;
                        value_panel_product(pm, ldp, n, cols, panel, (c0, width), o, accumulate)?;
                    }
                    Ok(())
                })
            }
            Products::Packed(kv) => {
                let g = kv.local(p, b, h)?;
                let sk = kv.seq_k;
                for q in 0..kv.nv {
                    let width = V_PANEL.min(kv.dv - q * V_PANEL);
                    let at = ((g * kv.nv + q) * sk + lo) * V_PANEL;
                    let panel =
                        kv.v.get(at..at + cols * V_PANEL)
                            .ok_or_else(|| too_small("value panel"))?;
                    value_panel_product(
                        pm,
                        ldp,
                        n,
                        cols,
                        panel,
                        (q * V_PANEL, width),
                        o,
                        accumulate,
                    )?;
                }
                Ok(())
            }
        }
    }
}

/// `o[.., c0..c0 + width] (=|+=) P V` for one V panel: `P` the `(n, cols)` rows of `pm` at
/// stride `ldp`, the panel `cols` rows of [`V_PANEL`] floats.
#[allow(clippy::too_many_arguments)]
fn value_panel_product(
    pm: &[f32],
    ldp: usize,
    n: usize,
    cols: usize,
    panel: &[f32],
    (c0, width): (usize, usize),
    o: &mut MatMut<'_>,
    accumulate: bool,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    if pm.len() < (n - 1) * ldp + cols
        || panel.len() < cols * V_PANEL
        || width > V_PANEL
        || o.rows < n
        || c0 + width > o.cols
    {
        return Err(too_small("value panel"));
    }
    // SAFETY: the micro-kernels run (panels exist only then); pm holds n rows of `cols` floats
    // at stride ldp, the panel `cols` rows of 64 floats (zero past `width` as far as the
    // kernels read), and o n rows with columns c0..c0 + width writable (all checked above); o
    // does not overlap pm or the panel.
    unsafe {
        panel_product::<V_PANEL>(
            n,
            cols,
            pm.as_ptr(),
            ldp,
            panel.as_ptr(),
            width,
            o.as_mut_ptr().add(c0),
            o.rs,
            if accumulate {
                Start::Accumulate
            } else {
                Start::Zero
            },
        )
    };
    Ok(())
}
