//! The CPU kernels' worker threads: one persistent pool (rayon-core) whose idle threads park on
//! a condition variable, instead of threads spawned and joined on every call (and left to
//! compete with torch's OpenMP threads). A call with `n` shares runs one on the calling thread
//! and the others on `n - 1` pool workers; the pool is rebuilt only when a call asks for a
//! different count (torch's thread count changed).
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rayon_core::{ThreadPool, ThreadPoolBuilder};

/// The kernels' workers (`Workers::run_shares`).
pub(crate) static WORKERS: Workers = Workers::new();

pub(crate) struct Workers {
    pool: Mutex<Option<Arc<ThreadPool>>>,
}

impl Workers {
    pub(crate) const fn new() -> Self {
        Self {
            pool: Mutex::new(None),
        }
    }

    /// A pool of `workers` threads (>= 1), shared by every call asking for that many.
    fn pool(&self, workers: usize) -> Option<Arc<ThreadPool>> {
        let mut held = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pool) = held.as_ref() {
            if pool.current_num_threads() == workers {
                return Some(Arc::clone(pool));
            }
        }
        let built = ThreadPoolBuilder::new()
            .num_threads(workers)
            .thread_name(|i| format!("pagedllm-cpu-{i}"))
            .build()
            .ok()
            .map(Arc::new);
        if built.is_some() {
            held.clone_from(&built);
        }
        built
    }

    /// Runs `task` on every share: the last on the calling thread, the others on pool workers;
    /// returns when all have finished. Without a pool (no thread could be started) the caller
    /// runs them all.
    pub(crate) fn run_shares<T: Send>(&self, mut shares: Vec<T>, task: impl Fn(T) + Sync) {
        let Some(mine) = shares.pop() else { return };
        let pool = if shares.is_empty() {
            None
        } else {
            self.pool(shares.len())
        };
        let Some(pool) = pool else {
            shares.into_iter().for_each(&task);
            task(mine);
            return;
        };
        let task = &task;
        pool.in_place_scope(|scope| {
            for share in shares {
                scope.spawn(move |_| task(share));
            }
            task(mine);
        });
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
    use std::sync::Mutex;
    use std::thread::{self, ThreadId};

    use super::Workers;

    /// The thread that ran each share of one call with `n` shares.
    fn threads_of(workers: &Workers, n: usize) -> Vec<ThreadId> {
        let seen = Mutex::new(vec![None; n]);
        workers.run_shares((0..n).collect(), |i| {
            let mut seen = seen.lock().unwrap();
            assert!(seen[i].is_none(), "share {i} ran twice");
            seen[i] = Some(thread::current().id());
        });
        seen.into_inner()
            .unwrap()
            .into_iter()
            .map(Option::unwrap)
            .collect()
    }

    /// The threads of the pool the workers hold now.
    fn pool_threads(workers: &Workers) -> HashSet<ThreadId> {
        let held = workers.pool.lock().unwrap().clone().expect("a pool");
        held.broadcast(|_| thread::current().id())
            .into_iter()
            .collect()
    }

    #[test]
    fn every_share_runs_once_the_last_on_the_caller_the_others_on_workers() {
        let workers = Workers::new();
        let ran = threads_of(&workers, 4);
        assert_eq!(ran[3], thread::current().id());
        let pool = pool_threads(&workers);
        assert_eq!(pool.len(), 3, "n shares: n - 1 workers");
        assert!(
            ran[..3].iter().all(|t| pool.contains(t)),
            "{ran:?} {pool:?}"
        );
    }

    #[test]
    fn workers_persist_across_calls_and_are_rebuilt_for_another_count() {
        let workers = Workers::new();
        threads_of(&workers, 3);
        let first = pool_threads(&workers);
        let ran = threads_of(&workers, 3);
        assert_eq!(pool_threads(&workers), first, "the same parked workers");
        assert!(ran[..2].iter().all(|t| first.contains(t)));
        threads_of(&workers, 2);
        let other = pool_threads(&workers);
        assert_eq!(other.len(), 1);
        assert!(other.is_disjoint(&first), "another count: a new pool");
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
