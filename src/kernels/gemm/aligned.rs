//! Float buffers whose first element sits on a 64-byte boundary, for the packed panels the
//! micro-kernels load a whole cache line at a time: from the allocator's 16-byte alignment
//! every AVX-512 load of a panel row would straddle two lines (measured 5-15% slower
//! kernels, see docs/performance.md).

use std::ops::{Deref, DerefMut};

/// Floats per 64 bytes.
const LINE: usize = 16;

/// `len` zeroed floats starting on a 64-byte boundary.
#[derive(Debug, Clone, Default)]
pub(crate) struct AlignedFloats {
    buf: Vec<f32>,
    start: usize,
    len: usize,
}

impl AlignedFloats {
    pub fn zeroed(len: usize) -> Self {
        let buf = vec![0f32; len + LINE - 1];
        let misaligned = (buf.as_ptr() as usize % 64) / std::mem::size_of::<f32>();
        let start = (LINE - misaligned) % LINE;
        Self { buf, start, len }
    }
}

impl Deref for AlignedFloats {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl DerefMut for AlignedFloats {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_line_and_holds_len_zeros() {
        for len in [0, 1, 15, 16, 17, 1000] {
            let mut a = AlignedFloats::zeroed(len);
            assert_eq!(a.len(), len);
            assert!(a.iter().all(|&v| v == 0.0));
            if len > 0 {
                assert_eq!(a.as_ptr() as usize % 64, 0);
                a[len - 1] = 1.0;
            }
            let b = a.clone();
            assert_eq!(&b[..], &a[..]);
        }
    }
}
