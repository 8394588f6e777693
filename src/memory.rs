//! How much memory the attention weights need, checked before they are allocated.

use std::sync::atomic::{AtomicBool, Ordering};

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

/// Whether [`retain_freed_memory`] took effect in this process.
static RETAINED: AtomicBool = AtomicBool::new(false);

/// Freed heap memory glibc keeps for reuse after [`retain_freed_memory`].
const TRIM_THRESHOLD: usize = 256 << 20;
/// Allocations below this come from the heap after [`retain_freed_memory`] (glibc's most).
const MMAP_THRESHOLD: usize = 32 << 20;

/// Makes the C allocator keep freed memory for reuse instead of giving it back to the
/// system, for training loops and long prompts on the CPU; returns whether it took effect (glibc on Linux;
/// `false` elsewhere, where nothing changes).
///
/// A training step with candle allocates every gradient afresh (a zeros tensor and a sum per
/// variable). glibc hands freed memory back to the system once more than ~2x the largest
/// recent allocation is free at the top of its heap, which a step of a 768-wide layer
/// exceeds, so each step pages tens of MB in again; on a small VM that took a fifth of a
/// (1, 512, 768) step. After this call allocations up to 32 MiB come from the heap and up
/// to 256 MiB of freed memory stay with the process (process-wide `mallopt`, like
/// `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=..:glibc.malloc.trim_threshold=..`), and the
/// layer's backward also writes its `x` and `W_qkv` gradients into tensors kept from step to
/// step. Call it once at the start of a training program. A decoder's prefill gains from it
/// too (each of a 512-token prompt's products allocates megabytes afresh: SmolLM2's prefill
/// 10% faster here, `generate` calls it); a few tokens at a time gain nothing.
pub fn retain_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes the allocator's parameters; glibc serialises it
        // with allocations.
        let ok = unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) == 1
        };
        if ok {
            RETAINED.store(true, Ordering::Relaxed);
        }
        ok
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = (TRIM_THRESHOLD, MMAP_THRESHOLD);
        false
    }
}

/// Whether [`retain_freed_memory`] took effect.
pub(crate) fn freed_memory_retained() -> bool {
    RETAINED.load(Ordering::Relaxed)
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
