//! Float buffers whose first element sits on a 64-byte boundary, for the packed panels the
//! micro-kernels load a whole cache line at a time: from the allocator's 16-byte alignment
//! every AVX-512 load of a panel row would straddle two lines (measured 5-15% slower
//! kernels, see docs/performance.md).

use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};

/// Floats per 64 bytes.
const LINE: usize = 16;

/// `len` floats starting on a 64-byte boundary (zeroed, or written through
/// [`UninitFloats`]); a clone starts on a boundary too.
#[derive(Debug, Default)]
pub(crate) struct AlignedFloats {
    buf: Vec<f32>,
    start: usize,
    len: usize,
}

impl Clone for AlignedFloats {
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(self.len);
        copy.copy_from_slice(self);
        copy
    }
}

impl AlignedFloats {
    pub fn zeroed(len: usize) -> Self {
        let buf = vec![0f32; len + LINE - 1];
        let start = line_start(buf.as_ptr());
        Self { buf, start, len }
    }
}

/// The index of the first float at or after `p` on a 64-byte boundary.
fn line_start<T>(p: *const T) -> usize {
    let misaligned = (p as usize % 64) / std::mem::size_of::<f32>();
    (LINE - misaligned) % LINE
}

/// `len` floats starting on a 64-byte boundary, not yet written (no pass over memory that
/// the caller is about to fill anyway): write them through [`UninitFloats::slots`], then
/// [`UninitFloats::assume_init`].
pub(crate) struct UninitFloats {
    buf: Vec<MaybeUninit<f32>>,
    start: usize,
    len: usize,
}

impl UninitFloats {
    pub fn new(len: usize) -> Self {
        let mut buf = Vec::with_capacity(len + LINE - 1);
        buf.resize_with(len + LINE - 1, MaybeUninit::uninit);
        let start = line_start(buf.as_ptr());
        Self { buf, start, len }
    }

    /// The `len` slots.
    pub fn slots(&mut self) -> &mut [MaybeUninit<f32>] {
        &mut self.buf[self.start..self.start + self.len]
    }

    /// The floats, once written.
    ///
    /// # Safety
    /// Every one of the `len` slots has been written.
    pub unsafe fn assume_init(self) -> AlignedFloats {
        let Self { buf, start, len } = self;
        let mut buf = std::mem::ManuallyDrop::new(buf);
        // The padding before `start` and after `len` is never read, but a `Vec<f32>` must
        // hold initialized floats: zero it (at most 2 x 15 floats).
        let (head, rest) = buf.split_at_mut(start);
        for slot in head.iter_mut().chain(&mut rest[len..]) {
            slot.write(0.0);
        }
        let (ptr, n, cap) = (buf.as_mut_ptr(), buf.len(), buf.capacity());
        // SAFETY: `MaybeUninit<f32>` has `f32`'s layout; every element is now initialized
        // (the caller's slots, and the padding just above); the allocation is moved, not
        // copied, and `buf` is not dropped.
        let buf = unsafe { Vec::from_raw_parts(ptr.cast::<f32>(), n, cap) };
        AlignedFloats { buf, start, len }
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

    /// Written through its slots, it holds what was written, on a line.
    #[test]
    fn uninit_floats_hold_what_was_written() {
        for len in [0, 1, 15, 16, 17, 1000] {
            let mut u = UninitFloats::new(len);
            for (i, s) in u.slots().iter_mut().enumerate() {
                s.write(i as f32);
            }
            // SAFETY: every slot was written just above.
            let a = unsafe { u.assume_init() };
            assert_eq!(a.len(), len);
            assert!(a.iter().enumerate().all(|(i, &v)| v == i as f32));
            if len > 0 {
                assert_eq!(a.as_ptr() as usize % 64, 0);
            }
        }
    }

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
            if len > 0 {
                assert_eq!(b.as_ptr() as usize % 64, 0, "a clone on a line too");
            }
        }
    }
}
