//! The CPU kernels' worker threads: one persistent pool of our own threads, instead of threads
//! spawned and joined on every call (and left to compete with torch's OpenMP threads). A call
//! with `n` shares runs one on the calling thread and the others on `n - 1` workers.
//!
//! A worker that has finished a share may keep polling for the next call for
//! `PAGEDLLM_CPU_SPIN_US` (yielding its core to any other runnable thread between polls) before
//! it parks on a condition variable; the default is 0 (park at once): on the busy 2-core machine
//! a 2 ms poll made the 8-stream decode step no faster (benches/RESULTS.md, "multi-row products
//! on integer panels"). Either way the caller closes a call once its own share is done and runs
//! the shares no worker has started, so a parked worker never holds a product up.
use std::cell::{Cell, UnsafeCell};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, TryLockError};
use std::thread;
use std::time::{Duration, Instant};

/// How long an idle worker polls for the next call before it parks (`PAGEDLLM_CPU_SPIN_US`,
/// default 0: park at once).
fn spin() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var("PAGEDLLM_CPU_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        Duration::from_micros(us)
    })
}

/// The kernels' workers (`Workers::run_shares`).
pub(crate) static WORKERS: Workers = Workers::new();

pub(crate) struct Workers {
    /// The pool, grown to the most helpers a call has asked for; held by one call at a time.
    pool: Mutex<Option<Pool>>,
}

/// One call's task, `task(i)` on worker `i` for `i` below the call's helper count (`Shared::
/// epoch`). Borrowed from the calling frame, which waits until every helper has finished with it
/// (`Pool::run`); the lifetime is erased to store it.
type Job = *const (dyn Fn(usize) + Sync + 'static);
/// The low bits of `Shared::epoch` hold the call's helper count, the rest count the calls.
const HELPER_BITS: u32 = 16;
/// `Shared::gate`: open (helpers may join) and the call number's shift.
const GATE_OPEN: u64 = 1 << 31;
const GATE_CALL: u32 = 32;
const GATE_IN: u64 = GATE_OPEN - 1;

struct Shared {
    /// Changed once per call, after `job` is written: the call's number and its helper count
    /// (`HELPER_BITS`), so that a worker not in the call never reads `job`.
    epoch: AtomicU64,
    /// The current call's task (written only while no helper of the previous call reads it:
    /// the previous gate closed with no helper in).
    job: UnsafeCell<Job>,
    /// Who may still join the current call: its number (high 32 bits, `GATE_CALL`), whether it
    /// is open (`GATE_OPEN`) and how many helpers are in it (the low bits). The caller closes it
    /// once its own share is done and runs the shares of helpers that have not joined (a parked
    /// or descheduled worker), then waits only for those in.
    gate: AtomicU64,
    /// Set by a helper whose share panicked; the caller panics in turn.
    panicked: AtomicBool,
    /// Workers parked on `wake` (or about to).
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

// SAFETY: `job` is written by the one caller holding the pool while no worker reads it (the
// previous call's gate is closed with no helper in, and a helper reads `job` only after joining
// through the gate of the call it saw), published by the release store of
// `epoch` and read after its acquire load; the task it points to is `Sync`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

struct Pool {
    shared: Arc<Shared>,
    threads: Vec<thread::JoinHandle<()>>,
}

thread_local! {
    /// Set on a pool worker, and on a caller while it runs a call's shares: a nested call runs
    /// its shares inline instead of waiting on workers that are busy with the outer one.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

impl Pool {
    fn new() -> Self {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(&|_: usize| {}),
            gate: AtomicU64::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        Pool {
            shared,
            threads: Vec::new(),
        }
    }

    /// Starts workers until there are `helpers` (false if a thread could not be started).
    fn grow(&mut self, helpers: usize) -> bool {
        while self.threads.len() < helpers {
            let index = self.threads.len();
            let shared = Arc::clone(&self.shared);
            let seen = shared.epoch.load(Ordering::Acquire);
            let started = thread::Builder::new()
                .name(format!("pagedllm-cpu-{index}"))
                .spawn(move || worker(&shared, index, seen));
            match started {
                Ok(handle) => self.threads.push(handle),
                Err(_) => return false,
            }
        }
        true
    }

    /// `task(i)` on worker `i` for `i < helpers` while the caller runs `mine`; then the caller
    /// closes the call and runs `task(i)` itself for every `i` (the task must do nothing for a
    /// share a helper has taken); returns when all have finished (re-raising a helper's panic).
    fn run(&self, helpers: usize, task: &(dyn Fn(usize) + Sync), mine: impl FnOnce()) {
        let shared = &*self.shared;
        // SAFETY: only the lifetime is erased; `Wait` below does not return (nor unwind) before
        // every helper has finished with the task.
        let task: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(task) };
        shared.panicked.store(false, Ordering::Relaxed);
        // SAFETY: no worker reads `job` now (see `Shared`).
        unsafe { *shared.job.get() = task };
        let calls = (shared.epoch.load(Ordering::Relaxed) >> HELPER_BITS) + 1;
        shared.gate.store(
            u64::from(calls as u32) << GATE_CALL | GATE_OPEN,
            Ordering::SeqCst,
        );
        shared
            .epoch
            .store(calls << HELPER_BITS | helpers as u64, Ordering::SeqCst);
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _held = lock(&shared.lock);
            shared.wake.notify_all();
        }
        /// Waits for the helpers, also when `mine` unwinds.
        struct Wait<'a>(&'a Shared);
        impl Drop for Wait<'_> {
            fn drop(&mut self) {
                self.0.gate.fetch_and(!GATE_OPEN, Ordering::AcqRel);
                let mut polls = 0u32;
                while self.0.gate.load(Ordering::Acquire) & GATE_IN != 0 {
                    polls += 1;
                    if polls.is_multiple_of(64) {
                        thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
            }
        }
        let wait = Wait(shared);
        mine();
        shared.gate.fetch_and(!GATE_OPEN, Ordering::AcqRel);
        for i in 0..helpers {
            task_ref(task, i);
        }
        drop(wait);
        if shared.panicked.load(Ordering::Relaxed) {
            panic!("a CPU kernel worker panicked");
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _held = lock(&self.shared.lock);
            self.shared.wake.notify_all();
        }
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `task(i)` through the erased pointer of the caller's own frame.
fn task_ref(task: *const (dyn Fn(usize) + Sync + 'static), i: usize) {
    // SAFETY: called by `Pool::run` only, while the task it was given is borrowed.
    unsafe { (*task)(i) }
}

/// Joins the call numbered in `epoch` if its gate is still open.
fn join(shared: &Shared, epoch: u64) -> bool {
    let call = u64::from((epoch >> HELPER_BITS) as u32) << GATE_CALL | GATE_OPEN;
    let mut gate = shared.gate.load(Ordering::Acquire);
    loop {
        if gate & !GATE_IN != call {
            return false;
        }
        match shared
            .gate
            .compare_exchange_weak(gate, gate + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return true,
            Err(now) => gate = now,
        }
    }
}

/// A worker's loop: poll for a call that includes it (`SPIN`, then park), run its share.
fn worker(shared: &Shared, index: usize, mut seen: u64) {
    INSIDE.with(|inside| inside.set(true));
    loop {
        let mut since = Instant::now();
        let mut polls = 0u32;
        loop {
            if shared.stop.load(Ordering::Acquire) {
                return;
            }
            let epoch = shared.epoch.load(Ordering::Acquire);
            if epoch != seen {
                seen = epoch;
                if (index as u64) < epoch & ((1 << HELPER_BITS) - 1) && join(shared, epoch) {
                    // SAFETY: published by the release store of `epoch` (see `Shared`); the
                    // caller waits for the helpers in before the task's frame ends.
                    let task = unsafe { &**shared.job.get() };
                    if panic::catch_unwind(AssertUnwindSafe(|| task(index))).is_err() {
                        shared.panicked.store(true, Ordering::Relaxed);
                    }
                    shared.gate.fetch_sub(1, Ordering::Release);
                }
                since = Instant::now();
                polls = 0;
                continue;
            }
            polls += 1;
            if !polls.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            if since.elapsed() >= spin() {
                break;
            }
            // leave the core to any other runnable thread (torch's, another process's)
            thread::yield_now();
        }
        let mut held = lock(&shared.lock);
        shared.sleepers.fetch_add(1, Ordering::SeqCst);
        while shared.epoch.load(Ordering::SeqCst) == seen && !shared.stop.load(Ordering::SeqCst) {
            held = shared.wake.wait(held).unwrap_or_else(|e| e.into_inner());
        }
        shared.sleepers.fetch_sub(1, Ordering::SeqCst);
        drop(held);
    }
}

impl Workers {
    pub(crate) const fn new() -> Self {
        Self {
            pool: Mutex::new(None),
        }
    }

    /// Runs `task` on every share: the last on the calling thread, the others on pool workers
    /// (those a worker has not started when the caller's own is done, the caller runs too: a
    /// parked or descheduled worker holds no call up); returns when all have finished. The caller runs them all when there is one share, when
    /// it is itself running a share (a nested call), when another call holds the workers, or
    /// when no worker thread could be started.
    pub(crate) fn run_shares<T: Send>(&self, mut shares: Vec<T>, task: impl Fn(T) + Sync) {
        let Some(mine) = shares.pop() else { return };
        let helpers = shares.len();
        let held = if helpers == 0 || helpers >= 1 << HELPER_BITS || INSIDE.with(Cell::get) {
            None
        } else {
            match self.pool.try_lock() {
                Ok(held) => Some(held),
                Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            }
        };
        let Some(mut held) = held else {
            shares.into_iter().for_each(&task);
            task(mine);
            return;
        };
        let pool = held.get_or_insert_with(Pool::new);
        if !pool.grow(helpers) {
            drop(held);
            shares.into_iter().for_each(&task);
            task(mine);
            return;
        }
        let slots: Vec<Mutex<Option<T>>> =
            shares.into_iter().map(|s| Mutex::new(Some(s))).collect();
        let task = &task;
        let theirs = |i: usize| {
            if let Some(share) = lock(&slots[i]).take() {
                task(share);
            }
        };
        INSIDE.with(|inside| inside.set(true));
        struct Outside;
        impl Drop for Outside {
            fn drop(&mut self) {
                INSIDE.with(|inside| inside.set(false));
            }
        }
        let _outside = Outside;
        pool.run(helpers, &theirs, || task(mine));
    }

    /// Runs `task(i)` for every `i` in `0..items`, each claimed in turn by whichever of the
    /// calling thread and up to `threads - 1` workers is free: a thread that another process
    /// slows down takes fewer items rather than holding the others up at the end of the call
    /// (fixed shares make every call as slow as its slowest thread). Returns when all have run.
    pub(crate) fn run_claimed(&self, threads: usize, items: usize, task: impl Fn(usize) + Sync) {
        let next = AtomicUsize::new(0);
        let claim = || loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= items {
                return;
            }
            task(i);
        };
        let helpers = threads.min(items).saturating_sub(1);
        self.run_shares(vec![(); helpers + 1], |()| claim());
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::thread::{self, ThreadId};

    use super::Workers;

    /// The thread that ran each share of one call with `n` shares (the caller's, the last,
    /// waits until the workers have run theirs: else it would run those not yet joined).
    fn threads_of(workers: &Workers, n: usize) -> Vec<ThreadId> {
        let seen = Mutex::new(vec![None; n]);
        let done = AtomicUsize::new(0);
        workers.run_shares((0..n).collect(), |i| {
            if i == n - 1 {
                while done.load(Ordering::Acquire) < n - 1 {
                    thread::yield_now();
                }
            }
            let mut seen = seen.lock().unwrap();
            assert!(seen[i].is_none(), "share {i} ran twice");
            seen[i] = Some(thread::current().id());
            done.fetch_add(1, Ordering::Release);
        });
        seen.into_inner()
            .unwrap()
            .into_iter()
            .map(Option::unwrap)
            .collect()
    }

    #[test]
    fn every_share_runs_once_the_last_on_the_caller_the_others_on_workers() {
        let workers = Workers::new();
        let ran = threads_of(&workers, 4);
        let me = thread::current().id();
        assert_eq!(ran[3], me);
        let others: HashSet<_> = ran[..3].iter().collect();
        assert_eq!(others.len(), 3, "n shares: n - 1 workers, {ran:?}");
        assert!(!others.contains(&me));
    }

    #[test]
    fn workers_persist_across_calls_and_fewer_shares_take_some_of_them() {
        let workers = Workers::new();
        let first: HashSet<_> = threads_of(&workers, 3)[..2].iter().copied().collect();
        let again: HashSet<_> = threads_of(&workers, 3)[..2].iter().copied().collect();
        assert_eq!(again, first, "the same workers");
        let fewer = threads_of(&workers, 2);
        assert!(first.contains(&fewer[0]), "{fewer:?} {first:?}");
        let more: HashSet<_> = threads_of(&workers, 4)[..3].iter().copied().collect();
        assert!(first.is_subset(&more), "grown, not rebuilt");
    }

    #[test]
    fn every_claimed_item_runs_exactly_once() {
        let workers = Workers::new();
        for (threads, items) in [(1, 5), (2, 1), (2, 37), (3, 1000), (4, 0)] {
            let ran = Mutex::new(vec![0; items]);
            workers.run_claimed(threads, items, |i| ran.lock().unwrap()[i] += 1);
            assert_eq!(
                ran.into_inner().unwrap(),
                vec![1; items],
                "{threads} threads"
            );
        }
    }

    #[test]
    fn many_back_to_back_calls_run_every_item_once() {
        // the workers poll between calls: no call is missed or run twice
        let workers = Workers::new();
        let total = AtomicUsize::new(0);
        for call in 0..2000 {
            workers.run_claimed(3, 1 + call % 5, |_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        }
        let expected: usize = (0..2000).map(|c| 1 + c % 5).sum();
        assert_eq!(total.into_inner(), expected);
    }

    #[test]
    fn a_nested_call_runs_inline_on_the_share_that_makes_it() {
        let workers = Workers::new();
        let ran = Mutex::new(Vec::new());
        workers.run_claimed(2, 2, |outer| {
            let me = thread::current().id();
            workers.run_claimed(2, 3, |inner| {
                assert_eq!(thread::current().id(), me, "inline");
                ran.lock().unwrap().push((outer, inner));
            });
        });
        let mut ran = ran.into_inner().unwrap();
        ran.sort_unstable();
        assert_eq!(ran, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]);
    }

    #[test]
    fn a_panicking_share_panics_the_caller_and_the_pool_still_works() {
        // share 0 is a worker's, or the caller's if the worker has not joined in time
        let workers = Workers::new();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            workers.run_shares(vec![0, 1], |i| {
                if i == 0 {
                    panic!("a share fails");
                }
            });
        }));
        assert!(outcome.is_err());
        assert_eq!(threads_of(&workers, 2).len(), 2);
    }

    #[test]
    fn a_slow_thread_takes_fewer_claimed_items() {
        // the caller sleeps on each item it takes: the worker, free, takes most of them
        let workers = Workers::new();
        let caller = thread::current().id();
        let by_caller = Mutex::new(0);
        workers.run_claimed(2, 40, |_| {
            if thread::current().id() == caller {
                *by_caller.lock().unwrap() += 1;
                thread::sleep(std::time::Duration::from_millis(25));
            }
        });
        let by_caller = by_caller.into_inner().unwrap();
        assert!(
            by_caller < 20,
            "the slow caller ran {by_caller} of 40 items"
        );
    }

    #[test]
    fn one_share_runs_on_the_caller_without_a_pool() {
        let workers = Workers::new();
        assert_eq!(threads_of(&workers, 1), vec![thread::current().id()]);
        assert!(workers.pool.lock().unwrap().is_none());
    }
}
