//! The cap on request-body bytes held in memory at once, across every request
//! (`max_body_memory`). A request reserves its body's declared size before a byte of it is read
//! (a body of unknown size reserves as it arrives), and gives the reservation back when the
//! request ends. Past the cap a request waits, within a bound, for others to end; the reading of
//! its body never starts before it holds room for it, so uploads refused or queued cannot pile up
//! on the heap. Also the machine's memory size, which the default cap is sized to.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::sync::Notify;
use tokio::time::Instant;

/// The gateway's body-memory budget.
pub(crate) struct BodyMemory {
    cap: u64,
    held: AtomicU64,
    waiting: AtomicUsize,
    freed: Notify,
}

impl BodyMemory {
    pub(crate) fn new(cap: u64) -> BodyMemory {
        BodyMemory {
            cap,
            held: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            freed: Notify::new(),
        }
    }

    pub(crate) fn cap(&self) -> u64 {
        self.cap
    }

    #[cfg(test)]
    /// Bytes reserved now.
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Takes `bytes` if they fit under the cap.
    fn try_take(&self, bytes: u64) -> bool {
        let mut now = self.held.load(Ordering::Relaxed);
        loop {
            if now.saturating_add(bytes) > self.cap {
                return false;
            }
            match self.held.compare_exchange_weak(
                now,
                now + bytes,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(seen) => now = seen,
            }
        }
    }

    /// An empty reservation, to grow as a body arrives.
    pub(crate) fn empty(&self) -> Reserved<'_> {
        Reserved {
            memory: self,
            bytes: 0,
        }
    }

    /// Waits until `bytes` fit, at most until `until`. `false` when they did not in time.
    async fn take(&self, bytes: u64, until: Instant) -> bool {
        if self.try_take(bytes) {
            return true;
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let took = async {
            loop {
                let freed = self.freed.notified();
                let mut freed = std::pin::pin!(freed);
                freed.as_mut().enable();
                if self.try_take(bytes) {
                    return true;
                }
                if tokio::time::timeout_at(until, freed).await.is_err() {
                    return self.try_take(bytes);
                }
            }
        }
        .await;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        took
    }
}

/// Bytes of the budget held by one request; given back on drop.
pub(crate) struct Reserved<'a> {
    memory: &'a BodyMemory,
    bytes: u64,
}

impl Reserved<'_> {
    /// Reserves `more` bytes, waiting at most until `until`. `false` when they did not fit in
    /// time (or never can: more than the whole cap).
    pub(crate) async fn grow(&mut self, more: u64, until: Instant) -> bool {
        if more == 0 {
            return true;
        }
        if self.bytes.saturating_add(more) > self.memory.cap {
            return false;
        }
        if !self.memory.take(more, until).await {
            return false;
        }
        self.bytes += more;
        true
    }

    /// Whether `more` bytes fit without waiting; reserves them if they do.
    pub(crate) fn try_grow(&mut self, more: u64) -> bool {
        if more == 0 {
            return true;
        }
        if !self.memory.try_take(more) {
            return false;
        }
        self.bytes += more;
        true
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        self.memory.held.fetch_sub(self.bytes, Ordering::AcqRel);
        if self.memory.waiting.load(Ordering::Acquire) > 0 {
            self.memory.freed.notify_waiters();
        }
    }
}

/// The machine's memory (`MemTotal` of `/proc/meminfo`), when it can be read.
pub(crate) fn mem_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_reservation_waits_for_room_and_gives_up_at_its_bound() {
        let m = BodyMemory::new(100);
        let soon = || Instant::now() + Duration::from_millis(50);
        let mut a = m.empty();
        assert!(a.grow(70, soon()).await);
        let mut b = m.empty();
        assert!(!b.grow(40, soon()).await, "70 + 40 is over 100");
        assert!(!b.grow(101, soon()).await, "over the whole cap never fits");
        assert_eq!(m.held(), 70);
        // Room made while it waits lets it through.
        let waiter = async {
            let mut c = m.empty();
            let ok = c.grow(40, Instant::now() + Duration::from_secs(5)).await;
            (ok, c.bytes())
        };
        let freer = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(a);
        };
        let ((ok, bytes), ()) = tokio::join!(waiter, freer);
        assert!(ok);
        assert_eq!(bytes, 40);
        assert_eq!(m.held(), 0, "every reservation given back");
    }
}
