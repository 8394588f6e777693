//! The two products of attention on a tile, `S = scale * Q K^T` and `O (+)= P V`, in one of
//! two ways:
//! - [`Products::Packed`] (CPUs with AVX-512 or AVX2 + FMA): K and V packed once per call (or
//!   per key/value head for long sequences, to keep memory low) into the panels of the
//!   micro-kernels — K^T in panels of 48 keys, V in panels of 64 value columns — and the
//!   scaled query rows copied once per task, so the products stream contiguous panels and
//!   never repack;
//! - [`Products::Strided`] (other CPUs): the `gemm` crate on strided views of Q, K and V.

use rayon::prelude::*;

use super::matrix::{matmul, MatMut, MatRef, Threads};
use super::microkernel::{panel_product, Start};
use super::problem::Problem;
use crate::error::{Error, Result};

/// Keys per K panel; score tiles start at multiples of it.
pub(crate) const KEY_PANEL: usize = 48;
/// Value columns per V panel.
const V_PANEL: usize = 64;

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
    /// Group `g`, panel `i`: `(dk, 48)` row-major at `((g * nk + i) * dk) * 48`.
    k: Vec<f32>,
    /// Group `g`, panel `q`: `(seq_k, 64)` row-major at `((g * nv + q) * seq_k) * 64`.
    v: Vec<f32>,
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
        let mut k = vec![0f32; groups * nk * dk * KEY_PANEL];
        let mut v = vec![0f32; groups * nv * sk * V_PANEL];
        let k_group = nk * dk * KEY_PANEL;
        let v_group = nv * sk * V_PANEL;
        if k_group > 0 {
            k.par_chunks_mut(k_group)
                .enumerate()
                .try_for_each(|(g, dst)| -> Result<()> {
                    let (b, kvh) = ((first + g) / p.kv_heads, (first + g) % p.kv_heads);
                    for i in 0..nk {
                        let j0 = i * KEY_PANEL;
                        let n = KEY_PANEL.min(sk - j0);
                        let keys = p.k.mat(b, kvh, j0, n, dk)?;
                        let panel = &mut dst[i * dk * KEY_PANEL..(i + 1) * dk * KEY_PANEL];
                        for j in 0..n {
                            let row = keys.row(j).unwrap_or(&[]);
                            for (c, &x) in row.iter().enumerate() {
                                panel[c * KEY_PANEL + j] = x;
                            }
                        }
                    }
                    Ok(())
                })?;
        }
        if v_group > 0 {
            v.par_chunks_mut(v_group)
                .enumerate()
                .try_for_each(|(g, dst)| -> Result<()> {
                    let (b, kvh) = ((first + g) / p.kv_heads, (first + g) % p.kv_heads);
                    let values = p.v.mat(b, kvh, 0, sk, dv)?;
                    for j in 0..sk {
                        let row = values.row(j).unwrap_or(&[]);
                        for (q, chunk) in row.chunks(V_PANEL).enumerate() {
                            let at = (q * sk + j) * V_PANEL;
                            dst[at..at + chunk.len()].copy_from_slice(chunk);
                        }
                    }
                    Ok(())
                })?;
        }
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
    Strided,
}

fn too_small(what: &str) -> Error {
    Error::Kernel(format!("{what} buffer too small for its tile"))
}

impl Products<'_> {
    /// Score tiles start at multiples of this key index.
    pub fn key_align(&self) -> usize {
        match self {
            Products::Packed(_) => KEY_PANEL,
            Products::Strided => 1,
        }
    }

    /// Floats of per-task query scratch for `n` rows.
    pub fn q_scratch(&self, p: &Problem<'_>, n: usize) -> usize {
        match self {
            Products::Packed(_) => n * p.dk,
            Products::Strided => 0,
        }
    }

    /// Copies the query rows times [`Problem::score_scale`] `i0..i0 + n` of head `h` into `qs` (packed products).
    pub fn prepare_queries(
        &self,
        p: &Problem<'_>,
        b: usize,
        h: usize,
        i0: usize,
        n: usize,
        qs: &mut [f32],
    ) -> Result<()> {
        if let Products::Packed(_) = self {
            let dk = p.dk;
            let q = p.q.mat(b, h, i0, n, dk)?;
            if qs.len() < n * dk {
                return Err(too_small("query"));
            }
            let scale = p.score_scale();
            for r in 0..n {
                let src = q.row(r).unwrap_or(&[]);
                for (d, &x) in qs[r * dk..(r + 1) * dk].iter_mut().zip(src) {
                    *d = x * scale;
                }
            }
        }
        Ok(())
    }

    /// `s[r * ld + c] = score_scale * q_{i0 + r} . k_{j0 + c}` (base-2 units, see
    /// [`Problem::score_scale`]) for `r < n`, `c < hi - j0`;
    /// `j0` is a multiple of [`Products::key_align`], `qs` comes from
    /// [`Products::prepare_queries`].
    #[allow(clippy::too_many_arguments)]
    pub fn scores(
        &self,
        p: &Problem<'_>,
        b: usize,
        h: usize,
        i0: usize,
        n: usize,
        (j0, hi): (usize, usize),
        qs: &[f32],
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
            Products::Packed(kv) => {
                let g = kv.local(p, b, h)?;
                let dk = kv.dk;
                if j0 % KEY_PANEL != 0 || qs.len() < n * dk {
                    return Err(Error::Kernel("unaligned or unprepared score tile".into()));
                }
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
                    // SAFETY: the micro-kernels run (the panels exist only then); qs holds
                    // n rows of dk floats, the panel dk x 48, and s n rows of at least
                    // `j - j0 + width` columns at stride ld (checked above), distinct buffers;
                    // rows r0..n of each are a part of them (r0 < n).
                    unsafe {
                        panel_product::<KEY_PANEL>(
                            n - r0,
                            dk,
                            qs.as_ptr().add(r0 * dk),
                            dk,
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
            Products::Packed(kv) => {
                let g = kv.local(p, b, h)?;
                let sk = kv.seq_k;
                for q in 0..kv.nv {
                    let width = V_PANEL.min(kv.dv - q * V_PANEL);
                    let at = ((g * kv.nv + q) * sk + lo) * V_PANEL;
                    let panel =
                        kv.v.get(at..at + cols * V_PANEL)
                            .ok_or_else(|| too_small("value panel"))?;
                    // SAFETY: the micro-kernels run; pm holds n rows of `cols` floats at
                    // stride ldp, the panel rows lo..lo+cols, and o n rows of dv writable
                    // floats (all checked above); o does not overlap pm or the panel.
                    unsafe {
                        panel_product::<V_PANEL>(
                            n,
                            cols,
                            pm.as_ptr(),
                            ldp,
                            panel.as_ptr(),
                            width,
                            o.as_mut_ptr().add(q * V_PANEL),
                            o.rs,
                            if accumulate {
                                Start::Accumulate
                            } else {
                                Start::Zero
                            },
                        )
                    };
                }
                Ok(())
            }
        }
    }
}
