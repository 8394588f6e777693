//! A model call run on a thread of rayon's pool instead of the caller's.
//!
//! A parallel iterator started outside the pool hands its work to the pool and puts the
//! caller to sleep until the work is done, then wakes it (a futex wait and a wake-up): about
//! 15 us on this VM, paid by every matrix-vector product of a decode step (~200 a token).
//! Started on a pool thread, the same iterator runs on that thread while the others steal
//! from it, and its end is a spin. So a whole forward call moves onto the pool once and pays
//! the hand-over once (see docs/performance-archive.md).

/// Runs `f` on a thread of rayon's global pool (on this one when it is one already).
pub(crate) fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    // `scope`'s body runs on a pool thread when called from outside the pool.
    rayon::scope(|_| f())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_on_a_pool_thread_and_returns_its_value() {
        let (on_pool, v) = in_pool(|| (rayon::current_thread_index().is_some(), 7));
        assert!(on_pool);
        assert_eq!(v, 7);
        // Nested: stays on the same thread.
        let same = in_pool(|| {
            let outer = rayon::current_thread_index();
            in_pool(|| rayon::current_thread_index() == outer)
        });
        assert!(same);
    }
}
