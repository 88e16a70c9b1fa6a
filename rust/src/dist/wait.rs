//! Waiting for a peer's word in a shared segment: spin (a peer a few microseconds away), then
//! yield the core (a busy host), then sleep on the word's futex (an idle one), woken by the peer
//! that changes the word. While asleep the waiter checks, every `SLEEP_SLICE`, that the peers it
//! waits for are alive (pidfds: a dead process is seen even as an unreaped zombie), that no peer
//! aborted the group, and its timeout.
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::{DistError, DistResult};

/// Busy-spin this long before yielding.
const SPIN: Duration = Duration::from_micros(20);
/// Yield until this long before sleeping on the futex.
const YIELD: Duration = Duration::from_micros(500);
/// The longest single futex sleep: the period of the liveness and timeout checks.
const SLEEP_SLICE: Duration = Duration::from_millis(10);

/// Sleeps while `word == expected` (at most `timeout`); returns at once if it differs.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid aligned u32 for the call's duration. Not FUTEX_PRIVATE: the word
    // lives in memory shared between processes. Errors (EAGAIN, EINTR, ETIMEDOUT) all mean
    // "look again", which the caller does.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every process sleeping on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: as in `futex_wait`.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// Stores `value` into `word` and wakes its sleepers, if any are registered in `sleepers`.
pub(crate) fn publish(word: &AtomicU32, value: u32, sleepers: &AtomicU32) {
    // SeqCst pairs with the waiter's (increment sleepers, then load the word): either the waiter
    // sees the new value or this load sees the waiter, so no wake-up is lost.
    word.store(value, Ordering::SeqCst);
    if sleepers.load(Ordering::SeqCst) > 0 {
        futex_wake(word);
    }
}

/// The processes a waiter depends on, watched through pidfds (kill(pid, 0) where the kernel has
/// none, which cannot tell an unreaped zombie from a live process).
pub struct Peers {
    watched: Vec<(usize, u32, Option<OwnedFd>)>,
}

impl Peers {
    /// Watches `(rank, pid)` pairs; pid 0 (not known yet) is skipped.
    pub fn new(peers: impl IntoIterator<Item = (usize, u32)>) -> Peers {
        let watched = peers
            .into_iter()
            .filter(|&(_, pid)| pid != 0)
            .map(|(rank, pid)| {
                // SAFETY: pidfd_open returns a new fd or -1.
                let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
                // SAFETY: a non-negative return is a fresh fd this value now owns.
                let fd = (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) });
                (rank, pid, fd)
            })
            .collect();
        Peers { watched }
    }

    pub fn len(&self) -> usize {
        self.watched.len()
    }

    pub fn is_empty(&self) -> bool {
        self.watched.is_empty()
    }

    /// `PeerDied` naming the first watched peer that has exited.
    pub fn check(&self) -> DistResult<()> {
        for (rank, pid, fd) in &self.watched {
            let dead = match fd {
                Some(fd) => {
                    let mut p = libc::pollfd {
                        fd: fd.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd, no wait.
                    unsafe { libc::poll(&mut p, 1, 0) > 0 }
                }
                None => {
                    // SAFETY: signal 0 only checks for existence.
                    let failed = unsafe { libc::kill(*pid as libc::pid_t, 0) } != 0;
                    failed && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
                }
            };
            if dead {
                return Err(DistError::PeerDied {
                    rank: *rank,
                    pid: *pid,
                });
            }
        }
        Ok(())
    }
}

/// Waits until `ready(word)`. `guard` runs before each futex sleep (peers alive, no abort);
/// `timeout` None waits for ever; `what` describes the wait for the timeout's message.
pub(crate) fn wait_until(
    word: &AtomicU32,
    sleepers: &AtomicU32,
    ready: impl Fn(u32) -> bool,
    timeout: Option<Duration>,
    mut guard: impl FnMut() -> DistResult<()>,
    what: impl FnOnce() -> String,
) -> DistResult<()> {
    if ready(word.load(Ordering::Acquire)) {
        return Ok(());
    }
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        spins = spins.wrapping_add(1);
        let elapsed = if spins.is_multiple_of(64) || spins > 4096 {
            start.elapsed()
        } else {
            Duration::ZERO
        };
        if elapsed < SPIN {
            std::hint::spin_loop();
        } else if elapsed < YIELD {
            std::thread::yield_now();
        } else {
            guard()?;
            let slice = match timeout {
                Some(limit) if elapsed >= limit => {
                    return Err(DistError::Timeout(format!(
                        "{} (waited {:.1}s)",
                        what(),
                        elapsed.as_secs_f64()
                    )))
                }
                Some(limit) => SLEEP_SLICE.min(limit - elapsed),
                None => SLEEP_SLICE,
            };
            sleepers.fetch_add(1, Ordering::SeqCst);
            let seen = word.load(Ordering::SeqCst);
            if !ready(seen) {
                futex_wait(word, seen, slice);
            }
            sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        if ready(word.load(Ordering::Acquire)) {
            return Ok(());
        }
    }
}

/// `a` is at or past `b` on a wrapping u32 counter (the two are less than 2^31 apart).
#[inline]
pub(crate) fn reached(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_sleeping_waiter_is_woken_by_the_publisher() {
        let word = Arc::new(AtomicU32::new(0));
        let sleepers = Arc::new(AtomicU32::new(0));
        let (w, s) = (word.clone(), sleepers.clone());
        let waiter = std::thread::spawn(move || {
            wait_until(&w, &s, |v| v == 1, None, || Ok(()), String::new)
        });
        std::thread::sleep(Duration::from_millis(30)); // past spin and yield: asleep
        publish(&word, 1, &sleepers);
        waiter.join().unwrap().unwrap();
    }

    #[test]
    fn a_wait_times_out_naming_what_it_waited_for() {
        let (word, sleepers) = (AtomicU32::new(0), AtomicU32::new(0));
        let err = wait_until(
            &word,
            &sleepers,
            |v| v == 1,
            Some(Duration::from_millis(30)),
            || Ok(()),
            || "rank 1".to_string(),
        )
        .unwrap_err();
        assert!(matches!(err, DistError::Timeout(ref m) if m.starts_with("rank 1")));
    }

    #[test]
    fn a_dead_peer_is_seen_even_unreaped() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let peers = Peers::new([(3, child.id())]);
        std::thread::sleep(Duration::from_millis(100)); // exited, not yet waited for: a zombie
        assert_eq!(
            peers.check(),
            Err(DistError::PeerDied {
                rank: 3,
                pid: child.id()
            })
        );
        child.wait().unwrap();
    }

    #[test]
    fn wrapping_counters_compare_across_the_wrap() {
        assert!(reached(3, u32::MAX - 2));
        assert!(!reached(u32::MAX - 2, 3));
        assert!(reached(7, 7));
    }
}
