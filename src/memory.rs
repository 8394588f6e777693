//! How much memory the attention weights need, checked before they are allocated.

use crate::error::{Error, Result};

/// Bytes of the f32 attention weights `(batch, heads, seq_q, seq_k)` (`u64::MAX` when the
/// count overflows).
///
/// At `seq = 16384` with 8 heads that is 8.6 GB for one sequence: ask for no weights (the
/// tiled kernel needs memory linear in the sequence), or take them block by block with
/// [`crate::scaled_dot_product_attention_streamed`] /
/// [`crate::MultiHeadSelfAttention::forward_streamed`].
pub fn attention_weights_bytes(batch: usize, heads: usize, seq_q: usize, seq_k: usize) -> u64 {
    [batch, heads, seq_q, seq_k]
        .iter()
        .try_fold(4u64, |acc, &n| acc.checked_mul(n as u64))
        .unwrap_or(u64::MAX)
}

/// Memory the OS says can still be allocated (`MemAvailable` of `/proc/meminfo`), if known.
pub fn available_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Below this, allocations are not checked against the available memory (reading
/// `/proc/meminfo` costs more than a short sequence's whole attention).
const CHECK_ABOVE: u64 = 256 << 20;

/// An [`Error::Memory`] when `bytes` (above 256 MiB) exceed what the machine has available
/// (checked where the OS reports it), instead of an allocation failure that aborts the
/// process.
pub(crate) fn ensure_allocatable(what: &str, bytes: u64) -> Result<()> {
    if bytes <= CHECK_ABOVE {
        return Ok(());
    }
    let too_big = usize::try_from(bytes).is_err() || bytes > isize::MAX as u64;
    let available = available_memory_bytes();
    if too_big || available.is_some_and(|a| bytes > a) {
        return Err(Error::Memory {
            what: what.to_string(),
            needed: bytes,
            available,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_bytes_count_f32_entries() {
        assert_eq!(attention_weights_bytes(1, 8, 16384, 16384), 8_589_934_592);
        assert_eq!(attention_weights_bytes(2, 3, 5, 7), 4 * 2 * 3 * 5 * 7);
        assert_eq!(attention_weights_bytes(usize::MAX, 2, 2, 2), u64::MAX);
    }

    #[test]
    fn impossible_allocations_are_errors() {
        let err = ensure_allocatable("the attention weights", u64::MAX).unwrap_err();
        assert!(err.to_string().contains("attention weights"), "{err}");
        assert!(ensure_allocatable("a little", 1024).is_ok());
    }
}
