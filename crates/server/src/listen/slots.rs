//! Client connections against the open-file limit. Each connection holds a slot that says since
//! when it has stood idle (waiting for a request, its head whole or not); past a cap below the
//! limit each new connection closes the longest-idle one, so new clients (health probes, admin,
//! real requests) keep being answered while idle or slowloris connections fill the table. Part
//! of the limit stays in reserve for the connections to upstreams and for files. What happened
//! is said on stderr at most once a minute, with counts.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::closed::Closed;
use crate::telemetry::Telemetry;

/// Longest the accept loop waits for a connection to end when it can take no new one.
const ROOM_WAIT: Duration = Duration::from_millis(100);
/// Least time between two lines about the limit on stderr.
const SAY_EVERY: Duration = Duration::from_secs(60);

/// The soft limit on open files (`RLIMIT_NOFILE`), or `None` when there is none.
pub(crate) fn open_file_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// Raises the soft open-file limit to the hard one; returns the soft limit before and after.
/// A gateway holds a socket per client and per upstream connection, and a soft limit of 1,024
/// (the usual default) is reached by a thousand idle clients.
pub fn raise_open_file_limit() -> std::io::Result<(Option<u64>, Option<u64>)> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let now = getrlimit(Resource::Nofile);
    if now.current == now.maximum {
        return Ok((now.current, now.current));
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: now.maximum,
            maximum: now.maximum,
        },
    )?;
    Ok((now.current, getrlimit(Resource::Nofile).current))
}

/// Whether an accept failed for want of a file descriptor.
pub(super) fn out_of_descriptors(e: &std::io::Error) -> bool {
    use rustix::io::Errno;
    let code = e.raw_os_error();
    code == Some(Errno::MFILE.raw_os_error()) || code == Some(Errno::NFILE.raw_os_error())
}

/// One connection's slot.
#[derive(Default)]
pub(crate) struct Slot {
    /// Milliseconds (from the table's start, plus one) since which the connection stands idle;
    /// 0 while it serves a request.
    idle_since: AtomicU64,
    shed: AtomicBool,
    waker: AtomicWaker,
}

impl Slot {
    /// The connection waits for a request from `now` on.
    pub(crate) fn idle(&self, slots: &Slots, now: Instant) {
        let ms = now.saturating_duration_since(slots.start).as_millis() as u64 + 1;
        self.idle_since.store(ms, Ordering::Relaxed);
    }

    /// The connection serves a request.
    pub(crate) fn busy(&self) {
        self.idle_since.store(0, Ordering::Relaxed);
    }

    /// Whether the connection is to close to make room; registers `waker` to be told.
    pub(crate) fn shed(&self, waker: &std::task::Waker) -> bool {
        self.waker.register(waker);
        self.shed.load(Ordering::Acquire)
    }
}

#[derive(Default)]
struct Table {
    slots: Vec<Option<Arc<Slot>>>,
    free: Vec<usize>,
}

/// Counts since the last line said.
struct Said {
    at: Option<Instant>,
    shed: u64,
    waited: u64,
}

/// Every client connection's slot, and the caps derived from the open-file limit.
pub(crate) struct Slots {
    start: Instant,
    limit: Option<u64>,
    /// From this many open connections on, each new one closes the longest-idle one.
    soft_cap: usize,
    /// At this many, no new connection is taken until one ends.
    hard_cap: usize,
    open: AtomicUsize,
    table: Mutex<Table>,
    ended: Notify,
    said: Mutex<Said>,
}

impl Slots {
    /// Caps for a process allowed `limit` open files: an eighth of them (at least 32) kept
    /// from client connections, half of that reserve never taken by them at all.
    pub(crate) fn new(limit: Option<u64>) -> Slots {
        let (soft_cap, hard_cap) = match limit {
            None => (usize::MAX, usize::MAX),
            Some(limit) => {
                let limit = usize::try_from(limit).unwrap_or(usize::MAX);
                let reserve = (limit / 8).max(32);
                (
                    limit.saturating_sub(reserve).max(1),
                    limit.saturating_sub(reserve / 2).max(2),
                )
            }
        };
        Slots {
            start: Instant::now(),
            limit,
            soft_cap,
            hard_cap,
            open: AtomicUsize::new(0),
            table: Mutex::new(Table::default()),
            ended: Notify::new(),
            said: Mutex::new(Said {
                at: None,
                shed: 0,
                waited: 0,
            }),
        }
    }

    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// A slot for a new connection, idle from now; freed when the returned guard drops.
    pub(crate) fn take(self: &Arc<Slots>) -> Held {
        let slot = Arc::new(Slot::default());
        slot.idle(self, Instant::now());
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let index = match table.free.pop() {
            Some(i) => {
                table.slots[i] = Some(slot.clone());
                i
            }
            None => {
                table.slots.push(Some(slot.clone()));
                table.slots.len() - 1
            }
        };
        drop(table);
        self.open.fetch_add(1, Ordering::Relaxed);
        Held {
            slots: self.clone(),
            index,
            slot,
        }
    }

    /// Makes room for one more connection when the table is at its soft cap, then waits (within
    /// a bound) while it is at the hard cap.
    pub(crate) async fn make_room(&self, telemetry: &Telemetry) {
        if self.open() >= self.soft_cap {
            self.shed_longest_idle(telemetry);
        }
        if self.open() >= self.hard_cap {
            self.wait_for_room().await;
        }
    }

    /// After an accept failed for want of a descriptor: closes the longest-idle connection and
    /// waits (within a bound) for a connection to end.
    pub(crate) async fn out_of_descriptors(&self, telemetry: &Telemetry) {
        self.shed_longest_idle(telemetry);
        self.wait_for_room().await;
    }

    async fn wait_for_room(&self) {
        self.note(0, 1);
        let _ = tokio::time::timeout(ROOM_WAIT, self.ended.notified()).await;
    }

    /// Tells the connection idle the longest (and not told yet) to close. `false` when none is
    /// idle.
    fn shed_longest_idle(&self, telemetry: &Telemetry) -> bool {
        let table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let oldest = table
            .slots
            .iter()
            .flatten()
            .filter(|s| !s.shed.load(Ordering::Relaxed))
            .filter_map(|s| {
                let since = s.idle_since.load(Ordering::Relaxed);
                (since > 0).then_some((since, s))
            })
            .min_by_key(|(since, _)| *since)
            .map(|(_, s)| s.clone());
        drop(table);
        let Some(slot) = oldest else {
            return false;
        };
        slot.shed.store(true, Ordering::Release);
        slot.waker.wake();
        telemetry.connection_closed(Closed::Shed);
        self.note(1, 0);
        true
    }

    /// Counts what happened and says it on stderr, at most once a minute.
    fn note(&self, shed: u64, waited: u64) {
        let mut said = self.said.lock().unwrap_or_else(|e| e.into_inner());
        said.shed += shed;
        said.waited += waited;
        let now = Instant::now();
        if said.at.is_some_and(|at| now.duration_since(at) < SAY_EVERY) {
            return;
        }
        let limit = self.limit.map_or("no limit".to_string(), |l| l.to_string());
        let since = if said.at.is_some() {
            "in the last minute or more"
        } else {
            "so far"
        };
        crate::stderr::line(&format!(
            "headroom serve: {} client connections near the open-file limit ({limit}); {since}: \
             {} longest-idle connection(s) closed to take new ones, {} pause(s) of the accept \
             loop with no idle connection to close (said at most once a minute; \
             headroom_connections_closed_total{{reason=\"shed\"}} counts every one)",
            self.open(),
            said.shed,
            said.waited
        ));
        *said = Said {
            at: Some(now),
            shed: 0,
            waited: 0,
        };
    }
}

/// A connection's hold on its slot.
pub(crate) struct Held {
    slots: Arc<Slots>,
    index: usize,
    slot: Arc<Slot>,
}

impl Held {
    pub(crate) fn slot(&self) -> &Slot {
        &self.slot
    }

    pub(crate) fn slots(&self) -> &Slots {
        &self.slots
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut table = self.slots.table.lock().unwrap_or_else(|e| e.into_inner());
        table.slots[self.index] = None;
        table.free.push(self.index);
        drop(table);
        self.slots.open.fetch_sub(1, Ordering::Relaxed);
        self.slots.ended.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_longest_idle_connection_is_shed_and_busy_ones_never_are() {
        let slots = Arc::new(Slots::new(Some(64)));
        assert_eq!((slots.soft_cap, slots.hard_cap), (32, 48));
        let telemetry = Telemetry::new();
        let a = slots.take();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let b = slots.take();
        let c = slots.take();
        c.slot().busy();
        assert_eq!(slots.open(), 3);
        assert!(slots.shed_longest_idle(&telemetry));
        assert!(
            a.slot().shed.load(Ordering::Relaxed),
            "the oldest idle goes first"
        );
        assert!(!b.slot().shed.load(Ordering::Relaxed));
        assert!(slots.shed_longest_idle(&telemetry));
        assert!(b.slot().shed.load(Ordering::Relaxed));
        assert!(
            !slots.shed_longest_idle(&telemetry),
            "a busy connection stays"
        );
        drop((a, b));
        assert_eq!(slots.open(), 1);
        let d = slots.take();
        assert_eq!(d.index, 1, "freed slots are reused");
        assert!(Slots::new(None).soft_cap == usize::MAX);
    }
}
