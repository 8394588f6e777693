//! Software prefetch of a product's rows a little ahead of the row kernels. One thread's
//! stream of GGUF blocks came in slower than the kernels take it with the hardware
//! prefetchers alone; requesting each row's lines [`AHEAD`] bytes ahead makes the decode
//! faster on both machines measured, and the AVX-512 VNNI 8-bit kernels' [`AHEAD_VNNI`]
//! ahead off AMD only (see [`vnni_ahead`]; the figures: docs/performance-archive.md).

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

/// Bytes ahead of the row being read that the kernels request (the best of 1, 2 and 4 KiB
/// for every type).
pub(crate) const AHEAD: usize = 2048;

/// Bytes ahead for the AVX-512 VNNI 8-bit kernels off AMD (the best of 2-8 KiB).
pub(crate) const AHEAD_VNNI: usize = 4096;

/// Bytes ahead the AVX-512 VNNI 8-bit kernels request: none on AMD, [`AHEAD_VNNI`]
/// elsewhere.
pub(crate) fn vnni_ahead() -> usize {
    if crate::kernels::simd::amd() {
        0
    } else {
        AHEAD_VNNI
    }
}

/// Requests into L1 the cache lines of the `len` bytes `ahead` bytes past `row`, those that
/// lie before `end` (the end of the task's rows): called once per row, it keeps the stream
/// `ahead` bytes ahead of the kernel.
#[inline(always)]
pub(crate) fn rows_ahead(row: *const u8, len: usize, ahead: usize, end: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut at = (row as usize).saturating_add(ahead);
        let stop = at.saturating_add(len).min(end as usize);
        while at < stop {
            // SAFETY: a prefetch is a hint: it reads nothing architecturally and never
            // faults, whatever the address (SSE is part of x86-64).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(at as *const i8) };
            at += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (row, len, ahead, end);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any address range, inside the rows, past them or at the top of the address space,
    /// is only a hint: nothing faults.
    #[test]
    fn any_range_is_a_hint() {
        let rows = vec![7u8; 1000];
        let end = rows.as_ptr_range().end;
        for (at, ahead) in [(0, 0), (0, 4096), (999, 64), (0, usize::MAX - 10)] {
            rows_ahead(rows[at..].as_ptr(), 360, ahead, end);
        }
        rows_ahead(usize::MAX as *const u8, 4096, 4096, usize::MAX as *const u8);
        assert_eq!(rows[999], 7);
    }
}
