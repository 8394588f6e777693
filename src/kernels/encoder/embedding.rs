//! BERT's input embeddings on the CPU in f32: per token the word, token type and position
//! rows summed and layer-normalised in one pass (candle's composition takes three lookups,
//! a widening of the half-precision word rows, two adds and a LayerNorm, each a pass over
//! memory with its own allocation).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kernels::encoder::layer_norm::add_layer_norm_row;
use crate::kernels::gemm::matrix::HalfRows;

/// Tokens per task.
const TOKENS_PER_TASK: usize = 32;

/// The word table `(vocab, hidden)` row-major, in its stored precision (a half-precision
/// checkpoint keeps it so: rows are widened exactly as they are looked up).
#[derive(Clone, Copy)]
pub(crate) enum WordTable<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
    /// f16 or bf16 bytes where the checkpoint holds them (its map).
    Half(HalfRows<'a>),
}

impl WordTable<'_> {
    fn len(&self) -> usize {
        match self {
            WordTable::F32(w) => w.len(),
            WordTable::F16(w) => w.len(),
            WordTable::Bf16(w) => w.len(),
            WordTable::Half(m) => m.rows * m.cols,
        }
    }

    /// `out = row id` (`out.len()` values per row).
    fn row_into(&self, id: usize, out: &mut [f32]) {
        let d = out.len();
        match self {
            WordTable::F32(w) => out.copy_from_slice(&w[id * d..(id + 1) * d]),
            WordTable::F16(w) => w[id * d..(id + 1) * d].convert_to_f32_slice(out),
            WordTable::Bf16(w) => w[id * d..(id + 1) * d].convert_to_f32_slice(out),
            WordTable::Half(m) => m.widen_row(id, out),
        }
    }
}

/// The three tables and the LayerNorm: `(rows, hidden)` row-major, f32 but for the words.
pub(crate) struct EmbeddingTables<'a> {
    pub word: WordTable<'a>,
    pub token_type: &'a [f32],
    pub position: &'a [f32],
    pub gamma: &'a [f32],
    pub beta: &'a [f32],
    pub eps: f32,
}

/// `LN(word[id] + type[tt] + position[p])` for every token (sums in that order, as
/// `(words + types) + positions`), each token's position id given (`0..seq` for BERT,
/// counted from past the padding id for RoBERTa).
///
/// # Shapes
/// - `ids`, `types`, `positions`: `(batch * seq,)` row-major `(batch, seq)`; returns
///   `(batch * seq, hidden)`
pub(crate) fn embed_tokens(
    tables: &EmbeddingTables<'_>,
    ids: &[u32],
    types: &[u32],
    positions: &[u32],
) -> Result<Vec<f32>> {
    let d = tables.gamma.len();
    if d == 0
        || tables.beta.len() != d
        || [
            tables.word.len(),
            tables.token_type.len(),
            tables.position.len(),
        ]
        .iter()
        .any(|n| n % d != 0)
        || matches!(tables.word, WordTable::Half(m) if m.cols != d || m.bytes.len() != 2 * m.rows * m.cols)
    {
        return Err(Error::Kernel(format!(
            "embedding tables of {} / {} / {} values for a hidden size of {d}",
            tables.word.len(),
            tables.token_type.len(),
            tables.position.len()
        )));
    }
    let (vocab, n_types, n_pos) = (
        tables.word.len() / d,
        tables.token_type.len() / d,
        tables.position.len() / d,
    );
    if ids.len() != types.len() || ids.len() != positions.len() {
        return Err(Error::input(
            "token_type_ids and position ids",
            format!("as many as input_ids ({})", ids.len()),
            format!("{} and {}", types.len(), positions.len()),
        ));
    }
    if let Some(&p) = positions.iter().find(|&&p| p as usize >= n_pos) {
        return Err(Error::SequenceTooLong {
            len: p as usize + 1,
            max: n_pos,
        });
    }
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::input(
            "input_ids",
            format!("token ids below the vocabulary size {vocab}"),
            format!("id {id}"),
        ));
    }
    if let Some(&tt) = types.iter().find(|&&tt| tt as usize >= n_types) {
        return Err(Error::input(
            "token_type_ids",
            format!("ids below the number of token types {n_types}"),
            format!("id {tt}"),
        ));
    }
    let mut out = vec![0f32; ids.len() * d];
    out.par_chunks_mut(TOKENS_PER_TASK * d)
        .enumerate()
        .try_for_each(|(task, chunk)| {
            for (j, row) in chunk.chunks_exact_mut(d).enumerate() {
                let i = task * TOKENS_PER_TASK + j;
                let (id, tt, p) = (ids[i] as usize, types[i] as usize, positions[i] as usize);
                tables.word.row_into(id, row);
                let ty = &tables.token_type[tt * d..(tt + 1) * d];
                for (o, t) in row.iter_mut().zip(ty) {
                    *o += t;
                }
                let pos = &tables.position[p * d..(p + 1) * d];
                add_layer_norm_row(row, pos, tables.gamma, tables.beta, tables.eps)?;
            }
            Ok::<(), Error>(())
        })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kernels::test_values as values;

    /// Every token equals the definition in f64, with the word table in f32, f16 and bf16;
    /// out-of-range ids and sequences are errors.
    #[test]
    fn equals_the_definition_and_checks_ids() -> Result<()> {
        let (d, vocab, n_types, n_pos) = (37, 50, 2, 9);
        let (ty, pos) = (values(n_types * d, 2), values(n_pos * d, 3));
        let word32 = values(vocab * d, 1);
        let word16: Vec<f16> = word32.iter().map(|&v| f16::from_f32(v)).collect();
        let wordb16: Vec<bf16> = word32.iter().map(|&v| bf16::from_f32(v)).collect();
        let widened = [
            word32.clone(),
            word16.iter().map(|v| v.to_f32()).collect(),
            wordb16.iter().map(|v| v.to_f32()).collect(),
            word16.iter().map(|v| v.to_f32()).collect(),
            wordb16.iter().map(|v| v.to_f32()).collect(),
        ];
        let bytes =
            |bits: Vec<u16>| -> Vec<u8> { bits.iter().flat_map(|b| b.to_le_bytes()).collect() };
        let bytes16 = bytes(word16.iter().map(|v| v.to_bits()).collect());
        let bytesb16 = bytes(wordb16.iter().map(|v| v.to_bits()).collect());
        fn mapped(bytes: &[u8], bf16: bool, rows: usize, cols: usize) -> HalfRows<'_> {
            HalfRows {
                bytes,
                rows,
                cols,
                bf16,
            }
        }
        let tables = [
            WordTable::F32(&word32),
            WordTable::F16(&word16),
            WordTable::Bf16(&wordb16),
            WordTable::Half(mapped(&bytes16, false, vocab, d)),
            WordTable::Half(mapped(&bytesb16, true, vocab, d)),
        ];
        for (word_table, word) in tables.into_iter().zip(&widened) {
            check(word_table, word, &ty, &pos, d)?;
        }
        Ok(())
    }

    fn check(
        word_table: WordTable<'_>,
        word: &[f32],
        ty: &[f32],
        pos: &[f32],
        d: usize,
    ) -> Result<()> {
        let (vocab, n_types) = (word.len() / d, ty.len() / d);
        let gamma: Vec<f32> = values(d, 4).iter().map(|g| g + 1.5).collect();
        let beta = values(d, 5);
        let tables = EmbeddingTables {
            word: word_table,
            token_type: ty,
            position: pos,
            gamma: &gamma,
            beta: &beta,
            eps: 1e-12,
        };
        // 40 sequences of 7 tokens: more than one task.
        let seq = 7;
        let ids: Vec<u32> = (0..40 * seq).map(|i| (i * 13 % vocab) as u32).collect();
        let types: Vec<u32> = (0..40 * seq).map(|i| (i % 3 == 0) as u32).collect();
        // Any position ids, not only 0..seq (RoBERTa counts from past its padding id).
        let n_pos = pos.len() / d;
        let positions: Vec<u32> = (0..40 * seq)
            .map(|i| ((i * 5 + 3) % n_pos) as u32)
            .collect();
        let got = embed_tokens(&tables, &ids, &types, &positions)?;
        for i in 0..ids.len() {
            let (id, tt, p) = (ids[i] as usize, types[i] as usize, positions[i] as usize);
            let s: Vec<f64> = (0..d)
                .map(|j| (word[id * d + j] + ty[tt * d + j] + pos[p * d + j]) as f64)
                .collect();
            let mean = s.iter().sum::<f64>() / d as f64;
            let var = s.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
            for j in 0..d {
                let want = (s[j] - mean) / (var + 1e-12).sqrt() * gamma[j] as f64 + beta[j] as f64;
                let e = (got[i * d + j] as f64 - want).abs();
                assert!(e < 1e-5 * (1.0 + want.abs()), "token {i} [{j}]: {e}");
            }
        }
        assert!(embed_tokens(&tables, &[vocab as u32], &[0], &[0]).is_err());
        assert!(embed_tokens(&tables, &[0], &[n_types as u32], &[0]).is_err());
        let ten: Vec<u32> = (0..10).collect();
        assert!(matches!(
            embed_tokens(&tables, &[0; 10], &[0; 10], &ten),
            Err(Error::SequenceTooLong { len: 10, max: 9 })
        ));
        assert!(embed_tokens(&tables, &[0; 4], &[0; 3], &[0, 1, 0, 1]).is_err());
        Ok(())
    }
}
