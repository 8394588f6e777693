//! One attention problem as the CPU kernels see it: strided f32 views of Q, K, V and the
//! context, the grouped-head mapping, and the mask in structured form.

use std::f32::consts::LOG2_E;

use crate::error::{Error, Result};
use crate::kernels::gemm::matrix::{MatMut, MatRef, SharedOut};

/// Q, K or V: element `(b, h, i, c)` at `data[offset + b * sb + h * sh + i * sr + c]`.
///
/// The head split of a fused `(batch * seq, q + k + v)` projection is such a view (row
/// stride `q + k + v`, head stride `head_dim`), so the kernels read it without a copy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operand<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub sb: usize,
    pub sh: usize,
    pub sr: usize,
}

impl<'a> Operand<'a> {
    /// Rows `row0..row0 + n` of head `h` in batch `b`, `width` columns.
    pub fn mat(
        &self,
        b: usize,
        h: usize,
        row0: usize,
        n: usize,
        width: usize,
    ) -> Result<MatRef<'a>> {
        MatRef::new(
            self.data,
            self.offset + b * self.sb + h * self.sh + row0 * self.sr,
            n,
            width,
            self.sr,
            1,
        )
    }
}

/// Where the context goes: element `(b, h, i, c)` at `offset + b * sb + h * sh + i * sr + c`
/// of a buffer that the attention tasks share (each writes its own rows of its own head).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OutOperand<'a> {
    pub buf: SharedOut<'a>,
    pub offset: usize,
    pub sb: usize,
    pub sh: usize,
    pub sr: usize,
    /// Where the tiled kernel writes each query row's log-sum-exp of its scores (base-2
    /// units, `-inf` for a row that sees no key), `(batch, heads, seq_q)` contiguous: what
    /// the backward recomputes the probabilities from.
    pub lse: Option<SharedOut<'a>>,
}

impl<'a> OutOperand<'a> {
    /// The log-sum-exp slots of rows `i0..i0 + n` of head `h` in batch `b`, when asked for.
    ///
    /// # Safety
    /// No other live view may address these elements (one task per query block).
    pub unsafe fn lse_rows(
        &self,
        p: &Problem<'_>,
        b: usize,
        h: usize,
        i0: usize,
        n: usize,
    ) -> Result<Option<MatMut<'a>>> {
        match &self.lse {
            Some(buf) => Ok(Some(buf.mat_mut(
                (b * p.heads + h) * p.seq_q + i0,
                1,
                n,
                n,
            )?)),
            None => Ok(None),
        }
    }

    /// Rows `row0..row0 + n` of head `h` in batch `b`.
    ///
    /// # Safety
    /// No other live view may address these elements (the kernels hand each
    /// `(batch, head, query block)` to exactly one task).
    pub unsafe fn mat_mut(
        &self,
        b: usize,
        h: usize,
        row0: usize,
        n: usize,
        width: usize,
    ) -> Result<MatMut<'a>> {
        self.buf.mat_mut(
            self.offset + b * self.sb + h * self.sh + row0 * self.sr,
            n,
            width,
            self.sr,
        )
    }
}

/// An additive f32 bias broadcast to `(batch, heads, seq_q, seq_k)` (strides may be 0).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DenseBias<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub strides: [usize; 4],
}

impl DenseBias<'_> {
    /// `row[c] += log2(e) bias[b, h, i, j0 + c]` (the scores are in base-2 units, see
    /// [`Problem::score_scale`]).
    pub fn add_to_row(
        &self,
        row: &mut [f32],
        b: usize,
        h: usize,
        i: usize,
        j0: usize,
    ) -> Result<()> {
        let [sb, sh, sq, sk] = self.strides;
        let start = self.offset + b * sb + h * sh + i * sq + j0 * sk;
        let n = row.len();
        if n == 0 {
            return Ok(());
        }
        let last = start + (n - 1) * sk;
        if last >= self.data.len() {
            return Err(Error::Kernel(format!(
                "mask bias index {last} past its buffer of {}",
                self.data.len()
            )));
        }
        match sk {
            0 => {
                let v = LOG2_E * self.data[start];
                row.iter_mut().for_each(|x| *x += v);
            }
            1 => crate::kernels::simd::add_scaled(row, &self.data[start..start + n], LOG2_E),
            _ => row
                .iter_mut()
                .enumerate()
                .for_each(|(c, x)| *x += LOG2_E * self.data[start + c * sk]),
        }
        Ok(())
    }
}

/// The mask in the form the kernels apply per tile, without a `(seq_q, seq_k)` matrix for
/// the structured parts.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KernelMask<'a> {
    /// Query `i` sees keys `j <= offset + i`.
    pub causal_offset: Option<usize>,
    /// `(batch, seq_k)`: 0 for kept keys, `-inf` for padding (the same in base-2 units).
    pub key_bias: Option<&'a [f32]>,
    /// Per batch, `[first, end)` of the kept keys (keys outside are never visited).
    pub key_range: Option<&'a [(usize, usize)]>,
    /// Keep / bias parts, materialised by the caller.
    pub dense: Option<DenseBias<'a>>,
}

/// Sizes and views of one attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Problem<'a> {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub dk: usize,
    pub dv: usize,
    pub q: Operand<'a>,
    pub k: Operand<'a>,
    pub v: Operand<'a>,
    pub scale: f32,
    pub mask: KernelMask<'a>,
}

impl Problem<'_> {
    /// The factor the kernels apply to `q . k`: the softmax scale times `log2(e)`. The
    /// scores are then in base-2 units and the softmax takes `2^(s - max)`, which is
    /// `exp(scale q . k - max)` without the exponential's multiply by `log2(e)` per element.
    pub fn score_scale(&self) -> f32 {
        self.scale * LOG2_E
    }

    /// The key/value head query head `h` reads.
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.heads / self.kv_heads)
    }

    /// `[first, end)` of the keys that queries `i0..i0 + n` of batch `b` may see at all.
    pub fn key_range(&self, b: usize, i0: usize, n: usize) -> (usize, usize) {
        let (mut first, mut end) = match self.mask.key_range {
            Some(r) => r[b],
            None => (0, self.seq_k),
        };
        if let Some(off) = self.mask.causal_offset {
            end = end.min(off + i0 + n);
        }
        if first > end {
            first = end;
        }
        (first, end)
    }

    /// Applies the mask (in base-2 units) to scores `row` of query `i` (batch `b`, head
    /// `h`) for keys `j0..j0 + row.len()`.
    pub fn mask_row(&self, row: &mut [f32], b: usize, h: usize, i: usize, j0: usize) -> Result<()> {
        if let Some(kb) = self.mask.key_bias {
            let start = b * self.seq_k + j0;
            crate::kernels::simd::add_assign(row, &kb[start..start + row.len()]);
        }
        if let Some(d) = &self.mask.dense {
            d.add_to_row(row, b, h, i, j0)?;
        }
        if let Some(off) = self.mask.causal_offset {
            // Keys j > off + i are hidden.
            let visible = (off + i + 1).saturating_sub(j0);
            if visible < row.len() {
                row[visible..].fill(f32::NEG_INFINITY);
            }
        }
        Ok(())
    }

    /// How many of the queries `i0, i0 + 1, ..` see no key at or after `j` under the causal
    /// part of the mask (0 without one): query `i` sees keys up to `off + i`.
    pub fn causal_hidden_rows(&self, i0: usize, j: usize) -> usize {
        match self.mask.causal_offset {
            Some(off) => j.saturating_sub(off + i0),
            None => 0,
        }
    }

    /// How many of the keys `j0..j0 + cols` query `i` sees under the causal part of the mask
    /// (they come first: a prefix of the range), `cols` without one.
    pub fn causal_visible_keys(&self, i: usize, j0: usize, cols: usize) -> usize {
        match self.mask.causal_offset {
            Some(off) => (off + i + 1).saturating_sub(j0).min(cols),
            None => cols,
        }
    }

    /// Whether the causal part hides some key of `j0..j0 + cols` from one of the queries
    /// `i0..i0 + n` (otherwise the causal mask is a no-op on that tile).
    pub fn causal_cuts(&self, i0: usize, j0: usize, cols: usize) -> bool {
        match self.mask.causal_offset {
            Some(off) => j0 + cols > off + i0 + 1,
            None => false,
        }
    }

    /// Checks that views and sizes fit together before any task starts.
    pub fn validate(&self) -> Result<()> {
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(Error::Kernel(format!(
                "{} heads over {} key/value heads",
                self.heads, self.kv_heads
            )));
        }
        if let Some(kb) = self.mask.key_bias {
            if kb.len() != self.batch * self.seq_k {
                return Err(Error::Kernel("padding bias of the wrong size".into()));
            }
        }
        if let Some(r) = self.mask.key_range {
            if r.len() != self.batch {
                return Err(Error::Kernel("padding ranges of the wrong size".into()));
            }
        }
        Ok(())
    }
}
