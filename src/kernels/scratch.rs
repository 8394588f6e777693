//! Memory reused from call to call: per-thread scratch for the attention tasks (no
//! allocation or zeroing per task), and the call-wide buffers of the K and V panels
//! ([`CallBuffer`]), so that a long-sequence call does not page in fresh memory each time.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::sync::Mutex;
use std::thread::LocalKey;

use crate::error::Result;

thread_local! {
    /// A task's scores, accumulators and running statistics.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The panels a task's products pack for themselves (taken while the task holds
    /// [`SCRATCH`]).
    static PANELS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on `n` floats of this thread's scratch. The contents are left over from earlier
/// tasks: callers write every element before they read it.
pub(crate) fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32]) -> Result<R>) -> Result<R> {
    with_buffer(&SCRATCH, n, f)
}

/// [`with_scratch`] for the products' panels: a second buffer, so that a task can hold both.
pub(crate) fn with_panel_scratch<R>(
    n: usize,
    f: impl FnOnce(&mut [f32]) -> Result<R>,
) -> Result<R> {
    with_buffer(&PANELS, n, f)
}

fn with_buffer<R>(
    key: &'static LocalKey<RefCell<Vec<f32>>>,
    n: usize,
    f: impl FnOnce(&mut [f32]) -> Result<R>,
) -> Result<R> {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < n {
                buf.resize(n, 0.0);
            }
            f(&mut buf[..n])
        }
        // Re-entered on this thread (no kernel does that today): a buffer of its own.
        Err(_) => f(&mut vec![0.0; n]),
    })
}

/// Call-wide buffers kept for the next call, each of at most [`RETAINED_BYTES`].
static RETAINED: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());
/// Most bytes of one kept buffer: the packed K or V of a long-sequence call (the panels of
/// a call are at most 32 MiB together, see `flash::UPFRONT_PANEL_BYTES`).
const RETAINED_BYTES: usize = 32 << 20;
/// Most buffers kept (a call packs K and V).
const RETAINED_BUFFERS: usize = 2;

/// An empty vector of floats taken from the buffers an earlier call gave back, and given
/// back when dropped (kept if it is at most [`RETAINED_BYTES`] and fewer than
/// [`RETAINED_BUFFERS`] are kept, else freed).
///
/// Freshly allocated memory is paged in on first write: at seq 4096 (8 heads of 64) the
/// 16 MiB of K and V panels cost ~4,000 page faults per call, a few percent of the call,
/// because the allocator hands memory that large back to the system when it is freed.
#[derive(Debug, Default)]
pub(crate) struct CallBuffer(Vec<f32>);

impl CallBuffer {
    /// An empty buffer with room for at least `n` floats: the smallest kept one that is
    /// large enough, else a new allocation.
    pub fn with_capacity(n: usize) -> Self {
        let kept = RETAINED
            .lock()
            .ok()
            .and_then(|mut pool| take_kept(&mut pool, n));
        let mut buf = kept.unwrap_or_default();
        buf.clear();
        buf.reserve(n);
        Self(buf)
    }
}

/// The smallest buffer of `pool` with room for `n` floats, removed from it.
fn take_kept(pool: &mut Vec<Vec<f32>>, n: usize) -> Option<Vec<f32>> {
    let fit = (0..pool.len())
        .filter(|&i| pool[i].capacity() >= n)
        .min_by_key(|&i| pool[i].capacity())?;
    Some(pool.swap_remove(fit))
}

/// Puts `buf` in `pool` if it is small enough and the pool has room; else frees it.
fn keep(pool: &mut Vec<Vec<f32>>, buf: Vec<f32>) {
    let bytes = buf.capacity() * std::mem::size_of::<f32>();
    if bytes > 0 && bytes <= RETAINED_BYTES && pool.len() < RETAINED_BUFFERS {
        pool.push(buf);
    }
}

impl Deref for CallBuffer {
    type Target = Vec<f32>;
    fn deref(&self) -> &Vec<f32> {
        &self.0
    }
}

impl DerefMut for CallBuffer {
    fn deref_mut(&mut self) -> &mut Vec<f32> {
        &mut self.0
    }
}

impl Drop for CallBuffer {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.0);
        if let Ok(mut pool) = RETAINED.lock() {
            keep(&mut pool, buf);
        }
    }
}

/// Splits `buf` into consecutive slices of the given lengths.
pub(crate) fn split<const N: usize>(mut buf: &mut [f32], lens: [usize; N]) -> [&mut [f32]; N] {
    lens.map(|n| {
        let rest = std::mem::take(&mut buf);
        let (head, tail) = rest.split_at_mut(n.min(rest.len()));
        buf = tail;
        head
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_buffers_are_reused_smallest_first_and_bounded() {
        let mut pool = Vec::new();
        keep(&mut pool, Vec::with_capacity(1000));
        keep(&mut pool, Vec::with_capacity(100));
        // Full: a third buffer is freed, not kept.
        keep(&mut pool, Vec::with_capacity(500));
        assert_eq!(pool.len(), RETAINED_BUFFERS);
        let small = take_kept(&mut pool, 50).map(|b| b.capacity());
        assert!(small.is_some_and(|c| (100..1000).contains(&c)), "{small:?}");
        assert!(take_kept(&mut pool, 5000).is_none());
        let large = take_kept(&mut pool, 101).map(|b| b.capacity());
        assert!(large.is_some_and(|c| c >= 1000), "{large:?}");
        assert!(pool.is_empty());
        // Larger than a kept buffer may be, or empty: freed.
        keep(&mut pool, Vec::with_capacity(RETAINED_BYTES / 4 + 1));
        keep(&mut pool, Vec::new());
        assert!(pool.is_empty());
        keep(&mut pool, Vec::with_capacity(RETAINED_BYTES / 4));
        assert_eq!(pool.len(), 1);
    }

    #[test]
    fn a_call_buffer_is_empty_with_the_room_asked_for() {
        for n in [0, 7, 4096, 100_000] {
            let mut buf = CallBuffer::with_capacity(n);
            assert!(buf.is_empty());
            assert!(buf.capacity() >= n);
            buf.extend(std::iter::repeat_n(1.0, n));
            drop(buf);
            // A kept buffer comes back empty, whatever it held.
            let again = CallBuffer::with_capacity(n);
            assert!(again.is_empty() && again.capacity() >= n);
        }
    }
}

/// Buffers of the differentiable layer kept for later steps (see [`TrainingBuffer`]).
static TRAINING: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());
/// Most buffers kept for training steps: a layer saves its projection and context for the
/// backward, which adds their two gradients.
const TRAINING_BUFFERS: usize = 8;
/// Most bytes of one kept training buffer.
const TRAINING_BYTES: usize = 128 << 20;

/// `n` floats (contents left over from an earlier use: write before reading) taken from the
/// buffers earlier training steps gave back, and given back when dropped. A training step
/// allocates the same few large buffers every time; fresh memory is paged in on first write,
/// which on a small VM costs as much as the arithmetic at sentence scale.
#[derive(Debug)]
pub(crate) struct TrainingBuffer(Vec<f32>);

impl TrainingBuffer {
    pub fn new(n: usize) -> Self {
        let kept = TRAINING
            .lock()
            .ok()
            .and_then(|mut pool| take_kept(&mut pool, n));
        let mut buf = kept.unwrap_or_default();
        if buf.len() < n {
            buf.resize(n, 0.0);
        }
        buf.truncate(n);
        Self(buf)
    }
}

impl Deref for TrainingBuffer {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl DerefMut for TrainingBuffer {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

impl Drop for TrainingBuffer {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.0);
        let bytes = buf.capacity() * std::mem::size_of::<f32>();
        if let Ok(mut pool) = TRAINING.lock() {
            if bytes > 0 && bytes <= TRAINING_BYTES && pool.len() < TRAINING_BUFFERS {
                pool.push(buf);
            }
        }
    }
}
