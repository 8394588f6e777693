//! The parallel calls of a decode step: ~150 a token, a few tens of microseconds apart.
//!
//! After a call the pool's other threads stay awake, spinning (for at most [`SPIN`]) until
//! the next call begins, so that call does not wait for a parked thread to be woken; while
//! they spin they run any rayon work that arrives, so other parallel code never waits on
//! them. A call made on a pool thread is handed to them through one shared slot (a job, a
//! task counter and a count of the threads inside it), not through rayon's deques and
//! latches: they take its tasks from a counter as the caller does, and the caller's wait
//! at the end is a spin on that count. Calls off the pool, or while another call holds the
//! slot, go through rayon as before (see docs/performance-archive.md).

use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::error::{Error, Result};

/// Longest a thread spins waiting for the next call.
const SPIN: Duration = Duration::from_micros(200);

/// A task of a call: runs task `i` (`i < n`).
type Task<'a> = dyn Fn(usize) + Sync + 'a;

/// The one call handed to spinning threads at a time.
struct Slot {
    /// `(call << CALL_SHIFT) | CLOSED? | threads inside`: a thread joins only an open call,
    /// and the caller returns only when the call is closed and no thread is inside.
    state: AtomicU64,
    /// Set while a caller owns the slot.
    busy: AtomicBool,
    /// The call's tasks, claimed one at a time.
    next: AtomicUsize,
    /// The call's task count and job, written by its caller before it opens the call.
    job: UnsafeCell<(usize, Option<*const Task<'static>>)>,
    /// Set when a task panicked on a spinning thread.
    panicked: AtomicBool,
}

// SAFETY: `job` is written only by the caller that owns the slot (`busy`), before it opens
// the call (a release store of `state`), and read only by threads that joined that open
// call (an acquire CAS on `state`); the caller does not return (so the job it points to
// outlives them) until every thread that joined has left.
unsafe impl Sync for Slot {}

const INSIDE: u64 = (1 << 16) - 1;
const CLOSED: u64 = 1 << 16;
const CALL_SHIFT: u32 = 17;

static SLOT: Slot = Slot {
    state: AtomicU64::new(CLOSED),
    busy: AtomicBool::new(false),
    next: AtomicUsize::new(0),
    job: UnsafeCell::new((0, None)),
    panicked: AtomicBool::new(false),
};

/// Spinners spawned and not yet ended (queued ones too, so that a call made just after a
/// spawn does not spawn again).
static SPINNERS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Whether this thread is inside a spinner (one met while spinning returns at once).
    static SPINNING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f(c, chunk)` for each chunk `c` of `len` values of `data` (the last may be
/// shorter), on the pool's threads, and then leaves the others spinning for the next call.
/// A chunk's error is returned (the first recorded where several fail); a task that panics
/// on a spinning thread makes the call an error, one that panics on this thread or under
/// rayon (when the slot is held) panics here (unless a spinner nested in one of this
/// thread's tasks ran it).
///
/// The slot is one for the process: a spinning thread of one rayon pool may run tasks of a
/// call made in another.
pub(crate) fn for_each_chunk<T: Send>(
    data: &mut [T],
    len: usize,
    f: impl Fn(usize, &mut [T]) -> Result<()> + Sync,
) -> Result<()> {
    let len = len.max(1);
    let threads = rayon::current_num_threads();
    if threads < 2 || data.len() <= len {
        return data
            .chunks_mut(len)
            .enumerate()
            .try_for_each(|(c, d)| f(c, d));
    }
    if rayon::current_thread_index().is_some() {
        if let Some(out) = run_shared(data, len, &f, threads) {
            return out;
        }
    }
    let out = data
        .par_chunks_mut(len)
        .enumerate()
        .try_for_each(|(c, d)| f(c, d));
    top_up(threads);
    out
}

/// Spawns spinners until `threads - 1` are spawned besides this thread's own.
fn top_up(threads: usize) {
    let own = usize::from(SPINNING.with(Cell::get));
    // Each spawn counted first (one CAS), so that callers at once spawn no more between them.
    while SPINNERS
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n.saturating_sub(own) < threads - 1).then_some(n + 1)
        })
        .is_ok()
    {
        rayon::spawn(spin_until_next);
    }
}

/// Runs the chunks of `data` here and on every spinning thread that joins, through the
/// slot; `None`, running nothing, when another call holds it.
fn run_shared<T: Send>(
    data: &mut [T],
    len: usize,
    f: &(impl Fn(usize, &mut [T]) -> Result<()> + Sync),
    threads: usize,
) -> Option<Result<()>> {
    let total = data.len();
    let n = total.div_ceil(len);
    let base = SendPtr(data.as_mut_ptr());
    let first_error = Mutex::new(None);
    let task = |c: usize| {
        let start = c * len;
        let end = (start + len).min(total);
        // SAFETY: each `c < n` is claimed once (`next`), so the chunks are disjoint views
        // of `data`, which this call borrows mutably until every task is done.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.at(start), end - start) };
        if let Err(e) = f(c, chunk) {
            let mut first = first_error.lock().unwrap_or_else(PoisonError::into_inner);
            first.get_or_insert(e);
        }
    };
    let task: &Task<'_> = &task;
    // SAFETY: the lifetime is erased only while the call is open or a thread is inside it;
    // `owned`, declared after `task` and `first_error`, is dropped before them (on unwinding
    // too), and its drop closes the call and waits for those threads.
    let task: *const Task<'static> = unsafe { std::mem::transmute(task) };
    let owned = Owned::take(n)?;
    SLOT.panicked.store(false, Ordering::Relaxed);
    SLOT.next.store(0, Ordering::Relaxed);
    // SAFETY: no thread is inside a call (the last owner waited for them) and this call
    // owns the slot.
    unsafe { *SLOT.job.get() = (n, Some(task)) };
    let call = (SLOT.state.load(Ordering::Relaxed) >> CALL_SHIFT).wrapping_add(1);
    SLOT.state.store(call << CALL_SHIFT, Ordering::Release);
    // Spinners spawned now join this call once they start.
    top_up(threads);
    claim_tasks(n, task);
    drop(owned);
    if SLOT.panicked.load(Ordering::Acquire) {
        return Some(Err(Error::Kernel(
            "a decode task panicked on another thread".into(),
        )));
    }
    Some(
        match first_error
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
        {
            Some(e) => Err(e),
            None => Ok(()),
        },
    )
}

/// The slot while this thread's call of `n` tasks owns it.
struct Owned {
    n: usize,
}

impl Owned {
    /// The slot for a call of `n` tasks, where no other call holds it.
    fn take(n: usize) -> Option<Self> {
        // An `Owned` made and dropped would free a slot some other call holds: made only
        // once the slot is taken.
        let taken = SLOT
            .busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok();
        if taken {
            Some(Owned { n })
        } else {
            None
        }
    }
}

impl Drop for Owned {
    /// Closes the call, waits for every thread inside it to leave, and frees the slot (on
    /// unwinding too, so that no thread runs a task whose caller has returned).
    fn drop(&mut self) {
        SLOT.state.fetch_or(CLOSED, Ordering::AcqRel);
        if std::thread::panicking() {
            // The tasks not yet begun are skipped by the threads inside.
            SLOT.next.fetch_max(self.n, Ordering::Relaxed);
        }
        while SLOT.state.load(Ordering::Acquire) & INSIDE != 0 {
            std::hint::spin_loop();
        }
        SLOT.busy.store(false, Ordering::Release);
    }
}

/// Runs tasks of the open call until none is left.
fn claim_tasks(n: usize, task: *const Task<'static>) {
    loop {
        let i = SLOT.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            return;
        }
        // SAFETY: the call is open or this thread is counted inside it, so its caller has
        // not returned and `task` is alive.
        unsafe { (*task)(i) };
    }
}

/// Joins the open call if it is not `seen`: runs its tasks and leaves. Returns the call
/// joined.
fn join_open_call(seen: u64) -> Option<u64> {
    let mut state = SLOT.state.load(Ordering::Acquire);
    loop {
        let call = state >> CALL_SHIFT;
        if state & CLOSED != 0 || call == seen || state & INSIDE == INSIDE {
            return None;
        }
        match SLOT.state.compare_exchange_weak(
            state,
            state + 1,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => break,
            Err(now) => state = now,
        }
    }
    // SAFETY: joined an open call, so its caller wrote the job before opening it and waits
    // for this thread to leave before returning.
    let (n, task) = unsafe { *SLOT.job.get() };
    let ran = task.map(|task| catch_unwind(AssertUnwindSafe(|| claim_tasks(n, task))));
    if matches!(ran, Some(Err(_))) {
        SLOT.panicked.store(true, Ordering::Release);
    }
    SLOT.state.fetch_sub(1, Ordering::AcqRel);
    Some(state >> CALL_SHIFT)
}

/// Spins until [`SPIN`] has passed with no call, joining each call that opens meanwhile
/// (the one open when it starts too) and running any rayon work that arrives (other
/// parallel code must not wait for the spin).
fn spin_until_next() {
    if SPINNING.with(Cell::get) {
        SPINNERS.fetch_sub(1, Ordering::AcqRel);
        return;
    }
    SPINNING.with(|s| s.set(true));
    let mut seen = u64::MAX;
    let mut since = Instant::now();
    let mut polls = 0u32;
    loop {
        if let Some(call) = join_open_call(seen) {
            seen = call;
            since = Instant::now();
            continue;
        }
        polls = polls.wrapping_add(1);
        // Reading the clock costs a call's worth of polls; once in 64 is enough.
        if polls.is_multiple_of(64) && since.elapsed() >= SPIN {
            break;
        }
        if rayon::yield_now().is_none() {
            break;
        }
        std::hint::spin_loop();
    }
    SPINNING.with(|s| s.set(false));
    SPINNERS.fetch_sub(1, Ordering::AcqRel);
}

/// A pointer into the data of a call, shared by its tasks.
#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);

// SAFETY: the tasks write disjoint chunks of the data behind it (see `run_shared`).
unsafe impl<T: Send> Sync for SendPtr<T> {}
// SAFETY: as for `Sync`: each task reaches only its own chunk through the pointer.
unsafe impl<T: Send> Send for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer `i` values on.
    ///
    /// # Safety
    /// `i` is within the data it points into.
    unsafe fn at(&self, i: usize) -> *mut T {
        self.0.add(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Calls in a row, with other parallel work between them (which the spinners run as it
    /// arrives), all give their results.
    #[test]
    fn calls_and_other_work_run_through_spinners() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("a pool of three threads");
        pool.install(|| {
            for i in 0..200u64 {
                let mut v: Vec<u64> = (0..1000).collect();
                for_each_chunk(&mut v, 37, |c, d| {
                    for (j, x) in d.iter_mut().enumerate() {
                        *x += i + (c * 37 + j) as u64;
                    }
                    Ok(())
                })
                .expect("no task fails");
                assert!(v.iter().enumerate().all(|(j, &x)| x == 2 * j as u64 + i));
                let (a, b) = rayon::join(|| i * 2, || i * 3);
                assert_eq!(a + b, 5 * i);
            }
        });
    }

    /// Calls from several threads at once (two on the pool, contending for the slot, one
    /// outside it) each run every chunk of their own data once, whichever threads take them.
    #[test]
    fn every_chunk_runs_once_from_any_caller() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool of two threads");
        let check = |who: &str| {
            for n in [1usize, 2, 5, 64, 1000] {
                let mut v = vec![0u32; n];
                for_each_chunk(&mut v, 3, |_, d| {
                    d.iter_mut().for_each(|x| *x += 1);
                    Ok(())
                })
                .expect("no task fails");
                let wrong: Vec<_> = v.iter().enumerate().filter(|(_, &x)| x != 1).collect();
                assert!(wrong.is_empty(), "{who}, {n} values: {wrong:?}");
            }
        };
        std::thread::scope(|s| {
            s.spawn(|| pool.install(|| (0..2000).for_each(|_| check("first"))));
            s.spawn(|| pool.install(|| (0..2000).for_each(|_| check("second"))));
            s.spawn(|| (0..500).for_each(|_| check("outside")));
        });
    }

    /// A claim while another call holds the slot fails and leaves the slot held; it is free
    /// again once the holder is done.
    #[test]
    fn a_held_slot_stays_held() {
        let held = loop {
            if let Some(held) = Owned::take(1) {
                break held;
            }
            std::thread::yield_now();
        };
        assert!(Owned::take(1).is_none());
        assert!(
            SLOT.busy.load(Ordering::Acquire),
            "a failed claim freed the slot"
        );
        drop(held);
        let again = loop {
            if let Some(again) = Owned::take(1) {
                break again;
            }
            std::thread::yield_now();
        };
        drop(again);
    }

    /// A task that panics on a spinning thread makes the call an error, not a hang, and the
    /// calls after it run.
    #[test]
    fn a_panic_on_another_thread_is_an_error() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool of two threads");
        pool.install(|| {
            let caller = std::thread::current().id();
            let mut errors = 0;
            // Other tests' calls may hold the slot for a while.
            for _ in 0..5000 {
                let mut v = vec![0u8; 8];
                // Through rayon (no thread spinning) the panic itself comes back.
                let out = catch_unwind(AssertUnwindSafe(|| {
                    for_each_chunk(&mut v, 1, |_, _| {
                        if std::thread::current().id() != caller {
                            panic!("a task on another thread");
                        }
                        // Slow enough for a spinning thread to join.
                        std::thread::sleep(std::time::Duration::from_micros(50));
                        Ok(())
                    })
                }));
                errors += usize::from(matches!(out, Ok(Err(Error::Kernel(_)))));
                let mut w = vec![0u8; 64];
                for_each_chunk(&mut w, 2, |_, d| {
                    d.fill(1);
                    Ok(())
                })
                .expect("no task fails");
                assert!(w.iter().all(|&x| x == 1));
                if errors > 0 {
                    break;
                }
            }
            assert!(errors > 0, "no task ran on a spinning thread in 5000 calls");
        });
    }

    /// A task's error is the call's, and the slot is free again after it.
    #[test]
    fn an_error_is_returned_and_the_next_call_runs() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool of two threads");
        pool.install(|| {
            for _ in 0..50 {
                let mut v = vec![0u8; 64];
                let err = for_each_chunk(&mut v, 4, |c, _| {
                    if c == 7 {
                        Err(Error::Kernel("chunk 7".into()))
                    } else {
                        Ok(())
                    }
                });
                assert!(matches!(err, Err(Error::Kernel(m)) if m == "chunk 7"));
                let mut w = vec![0u8; 64];
                for_each_chunk(&mut w, 4, |c, d| {
                    d.fill(c as u8);
                    Ok(())
                })
                .expect("no task fails");
                assert!(w.iter().enumerate().all(|(j, &x)| x as usize == j / 4));
            }
        });
    }
}
