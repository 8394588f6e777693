//! Bytes on 64-byte-aligned lines: the 8-bit kernels read a quantized `x` 64 bytes at a
//! time, and from a `Vec<i8>` (aligned as the allocator chose, 16 bytes here) most such
//! loads split across two cache lines; aligned, the 8-bit decode was ~1% faster (see
//! docs/performance.md).

use std::ops::{Deref, DerefMut};

/// One cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Line([i8; 64]);

/// `len` bytes starting on a 64-byte boundary (zeros past `len` to the line's end).
#[derive(Debug, Clone, Default)]
pub(crate) struct Lines {
    lines: Vec<Line>,
    len: usize,
}

impl Lines {
    /// `len` zero bytes.
    pub(crate) fn zeroed(len: usize) -> Self {
        Self {
            lines: vec![Line([0; 64]); len.div_ceil(64)],
            len,
        }
    }
}

impl Deref for Lines {
    type Target = [i8];

    fn deref(&self) -> &[i8] {
        // SAFETY: `Line` is `repr(C)` over `[i8; 64]` (size 64, no padding), so the lines
        // are `64 * lines.len() >= len` initialized bytes one after another.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<i8>(), self.len) }
    }
}

impl DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [i8] {
        // SAFETY: as in `deref`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<i8>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Aligned, of the length asked, zeroed, and writable.
    #[test]
    fn lines_are_aligned_bytes() {
        for len in [0, 1, 63, 64, 65, 576, 1536] {
            let mut b = Lines::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % 64, 0);
            assert!(b.iter().all(|&v| v == 0));
            if let Some(last) = b.last_mut() {
                *last = -3;
            }
            let c = b.clone();
            assert_eq!(c.last(), (len > 0).then_some(&-3));
        }
    }
}
