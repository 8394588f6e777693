//! Length-sorted batching, the way real embedders batch a corpus (sentence-transformers,
//! text-embeddings-inference): sentences of similar length share a batch, so a batch pads
//! little, and results go back to their input positions.

use crate::error::{Error, Result};

/// Groups item indices into batches of at most `batch_size`, longest items first (ties
/// keep input order), so each batch pads to a length close to its members'.
///
/// Every index in `0..lengths.len()` appears exactly once.
pub fn length_sorted_batches(lengths: &[usize], batch_size: usize) -> Result<Vec<Vec<usize>>> {
    if batch_size == 0 {
        return Err(Error::config("the batch size must be at least 1"));
    }
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    // Stable: equal lengths keep their input order, so the plan is deterministic.
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]));
    Ok(order.chunks(batch_size).map(<[usize]>::to_vec).collect())
}

/// `items` moved into the batches of [`length_sorted_batches`]: each batch's input
/// positions, and its items in the same order.
pub fn into_length_sorted_batches<T>(
    items: Vec<T>,
    len: impl Fn(&T) -> usize,
    batch_size: usize,
) -> Result<Vec<(Vec<usize>, Vec<T>)>> {
    let lengths: Vec<usize> = items.iter().map(len).collect();
    let mut slots: Vec<Option<T>> = items.into_iter().map(Some).collect();
    length_sorted_batches(&lengths, batch_size)?
        .into_iter()
        .map(|batch| {
            let members = batch
                .iter()
                .map(|&i| {
                    slots[i]
                        .take()
                        .ok_or_else(|| Error::config("a batch plan listed an item twice"))
                })
                .collect::<Result<Vec<_>>>()?;
            Ok((batch, members))
        })
        .collect()
}

/// Padded positions a plan computes: `sum over batches of (members * longest - real)`.
pub fn padding_tokens(lengths: &[usize], batches: &[Vec<usize>]) -> usize {
    batches
        .iter()
        .map(|b| {
            let longest = b.iter().map(|&i| lengths[i]).max().unwrap_or(0);
            b.iter().map(|&i| longest - lengths[i]).sum::<usize>()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_once_longest_first() -> Result<()> {
        let lengths = [5, 12, 3, 12, 7, 1, 9];
        let plan = length_sorted_batches(&lengths, 3)?;
        assert_eq!(plan, vec![vec![1, 3, 6], vec![4, 0, 2], vec![5]]);
        let mut seen: Vec<usize> = plan.concat();
        seen.sort_unstable();
        assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>());
        Ok(())
    }

    #[test]
    fn sorting_pads_less_than_input_order() -> Result<()> {
        let lengths: Vec<usize> = (0..100).map(|i| 3 + (i * 37) % 61).collect();
        let sorted = length_sorted_batches(&lengths, 8)?;
        let in_order: Vec<Vec<usize>> = (0..100)
            .collect::<Vec<_>>()
            .chunks(8)
            .map(<[usize]>::to_vec)
            .collect();
        assert!(padding_tokens(&lengths, &sorted) * 4 < padding_tokens(&lengths, &in_order));
        Ok(())
    }

    #[test]
    fn items_move_into_their_batches() -> Result<()> {
        let words = vec!["ccc", "a", "bbbb", "dd"];
        let batches = into_length_sorted_batches(words, |w| w.len(), 3)?;
        assert_eq!(
            batches,
            vec![
                (vec![2, 0, 3], vec!["bbbb", "ccc", "dd"]),
                (vec![1], vec!["a"])
            ]
        );
        Ok(())
    }

    #[test]
    fn empty_input_and_zero_batch() {
        assert!(length_sorted_batches(&[], 4).is_ok_and(|p| p.is_empty()));
        assert!(length_sorted_batches(&[1, 2], 0).is_err());
    }
}
