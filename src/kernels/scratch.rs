//! Per-thread scratch memory for the attention tasks, reused from call to call (no
//! allocation or zeroing per task).

use std::cell::RefCell;
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

/// Splits `buf` into consecutive slices of the given lengths.
pub(crate) fn split<const N: usize>(mut buf: &mut [f32], lens: [usize; N]) -> [&mut [f32]; N] {
    lens.map(|n| {
        let rest = std::mem::take(&mut buf);
        let (head, tail) = rest.split_at_mut(n.min(rest.len()));
        buf = tail;
        head
    })
}
