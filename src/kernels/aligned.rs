//! Buffers whose first element sits on a 64-byte boundary, for data the kernels load a whole
//! cache line at a time: the micro-kernels' packed panels (f32) and the 8-bit kernels'
//! quantized `x` (bytes). From the allocator's 16-byte alignment most such loads would
//! straddle two lines (see docs/performance-archive.md).

use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};

/// The element types of aligned buffers: plain values whose size divides 64 and whose zero
/// is `Default`.
pub(crate) trait Element: Copy + Default + 'static {}
impl Element for f32 {}
impl Element for i8 {}

/// `len` values starting on a 64-byte boundary (zeroed, or written through [`Uninit`]); a
/// clone starts on a boundary too.
#[derive(Debug, Default)]
pub(crate) struct Aligned<T: Element> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

/// Packed panels of the micro-kernels.
pub(crate) type AlignedFloats = Aligned<f32>;
/// A quantized `x` of the 8-bit kernels.
pub(crate) type Lines = Aligned<i8>;

/// Values of `T` per 64 bytes.
const fn line<T>() -> usize {
    64 / std::mem::size_of::<T>()
}

impl<T: Element> Clone for Aligned<T> {
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(self.len);
        copy.copy_from_slice(self);
        copy
    }
}

impl<T: Element> Aligned<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        let buf = vec![T::default(); len + line::<T>() - 1];
        let start = line_start(buf.as_ptr());
        Self { buf, start, len }
    }
}

/// The index of the first value at or after `p` (aligned to its type) on a 64-byte boundary.
fn line_start<T>(p: *const T) -> usize {
    let misaligned = (p as usize % 64) / std::mem::size_of::<T>();
    (line::<T>() - misaligned) % line::<T>()
}

/// `len` values starting on a 64-byte boundary, not yet written (no pass over memory that
/// the caller is about to fill anyway): write them through [`Uninit::slots`], then
/// [`Uninit::assume_init`].
pub(crate) struct Uninit<T: Element> {
    buf: Vec<MaybeUninit<T>>,
    start: usize,
    len: usize,
}

/// Packed panels, not yet written.
pub(crate) type UninitFloats = Uninit<f32>;

impl<T: Element> Uninit<T> {
    pub fn new(len: usize) -> Self {
        let mut buf = Vec::with_capacity(len + line::<T>() - 1);
        buf.resize_with(len + line::<T>() - 1, MaybeUninit::uninit);
        let start = line_start(buf.as_ptr());
        Self { buf, start, len }
    }

    /// The `len` slots.
    pub fn slots(&mut self) -> &mut [MaybeUninit<T>] {
        &mut self.buf[self.start..self.start + self.len]
    }

    /// The values, once written.
    ///
    /// # Safety
    /// Every one of the `len` slots has been written.
    pub unsafe fn assume_init(self) -> Aligned<T> {
        let Self { buf, start, len } = self;
        let mut buf = std::mem::ManuallyDrop::new(buf);
        // The padding before `start` and after `len` is never read, but a `Vec<T>` must
        // hold initialized values: zero it (less than two lines).
        let (head, rest) = buf.split_at_mut(start);
        for slot in head.iter_mut().chain(&mut rest[len..]) {
            slot.write(T::default());
        }
        let (ptr, n, cap) = (buf.as_mut_ptr(), buf.len(), buf.capacity());
        // SAFETY: `MaybeUninit<T>` has `T`'s layout; every element is now initialized
        // (the caller's slots, and the padding just above); the allocation is moved, not
        // copied, and `buf` is not dropped.
        let buf = unsafe { Vec::from_raw_parts(ptr.cast::<T>(), n, cap) };
        Aligned { buf, start, len }
    }
}

impl<T: Element> Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<T: Element> DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
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

    /// Bytes too (the 8-bit kernels' `x`): on a line, zeros, a clone on a line.
    #[test]
    fn byte_lines_start_on_a_line() {
        for len in [0, 1, 63, 64, 65, 640] {
            let mut a = Lines::zeroed(len);
            assert_eq!(a.len(), len);
            assert!(a.iter().all(|&v| v == 0));
            if len > 0 {
                assert_eq!(a.as_ptr() as usize % 64, 0);
                a[len - 1] = 7;
                let b = a.clone();
                assert_eq!(&b[..], &a[..]);
                assert_eq!(b.as_ptr() as usize % 64, 0);
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
