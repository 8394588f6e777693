//! Keeps the rayon pool's other threads awake between the short parallel calls of a decode
//! step: after a call each of them runs a job that spins (for at most [`SPIN`]) until the
//! next call begins, so that call does not wait for a sleeping thread to be woken. A step
//! makes ~150 such calls a few tens of microseconds apart, and waking a parked thread took
//! a comparable time (see docs/performance.md).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Longest a thread spins waiting for the next call.
const SPIN: Duration = Duration::from_micros(200);

/// Counts the calls begun; a spinner stops when it moves.
static CALLS: AtomicU64 = AtomicU64::new(0);

/// Runs `f` (a parallel call) and then leaves the other threads spinning for the next one.
pub(crate) fn run<R>(f: impl FnOnce() -> R) -> R {
    let threads = rayon::current_num_threads();
    if threads < 2 {
        return f();
    }
    CALLS.fetch_add(1, Ordering::Release);
    let out = f();
    let call = CALLS.load(Ordering::Acquire);
    for _ in 1..threads {
        rayon::spawn(move || spin_until_next(call));
    }
    out
}

thread_local! {
    /// Whether this thread is inside a spinner (one met while spinning returns at once).
    static SPINNING: Cell<bool> = const { Cell::new(false) };
}

/// Spins until a call after `call` begins or [`SPIN`] has passed, running any rayon work
/// that arrives meanwhile (other parallel code must not wait for the spin to end).
fn spin_until_next(call: u64) {
    if SPINNING.with(Cell::get) {
        return;
    }
    SPINNING.with(|s| s.set(true));
    let start = Instant::now();
    while CALLS.load(Ordering::Acquire) == call && start.elapsed() < SPIN {
        if rayon::yield_now().is_none() {
            break;
        }
        std::hint::spin_loop();
    }
    SPINNING.with(|s| s.set(false));
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

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
                let s: u64 = run(|| (0..1000u64).into_par_iter().map(|x| x + i).sum());
                assert_eq!(s, 499_500 + 1000 * i);
                let (a, b) = rayon::join(|| i * 2, || i * 3);
                assert_eq!(a + b, 5 * i);
            }
        });
    }
}
