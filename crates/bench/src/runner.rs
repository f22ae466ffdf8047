//! The load driver: closed loops (N workers, each sends when its previous request ends), open
//! loops (arrivals on a Poisson or gamma schedule, sent whatever the server's latency), both at
//! once for mixed scenarios, warm-up requests, a stop by count or duration, and cancellation
//! (Ctrl-C) that keeps what has finished so far.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::arrivals::{Rng, next_gap, schedule};
use crate::client::{Outcome, RequestRecord, execute};
use crate::workload::{Load, RequestSpec};

/// Open-loop schedules longer than this are drawn lazily instead of precomputed.
const MAX_PRECOMPUTED_ARRIVALS: u64 = 5_000_000;

/// One run's settings.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub specs: Vec<RequestSpec>,
    /// Load of the specs that have none of their own.
    pub load: Load,
    /// Requests to send after warm-up (all groups together).
    pub requests: Option<u64>,
    /// Stop issuing after this long.
    pub duration: Option<Duration>,
    /// Requests sent before measuring; not in the report.
    pub warmup: u64,
    /// Per-request limit.
    pub timeout: Duration,
    pub seed: u64,
}

/// Live counters, read by the progress display.
#[derive(Debug, Default)]
pub struct Progress {
    pub sent: AtomicU64,
    pub done: AtomicU64,
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    pub in_flight: AtomicU64,
    pub max_in_flight: AtomicU64,
    /// Requests planned (0 when the run is bounded by time only).
    pub planned: AtomicU64,
    /// Set by the runner when the measured phase begins.
    pub measuring: AtomicBool,
}

/// What a run hands back.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub records: Vec<RequestRecord>,
    pub requests_sent: u64,
    /// From the first measured request to the end of the last one (or the interruption).
    pub duration: Duration,
    /// Wall clock at the start of the measured phase, ms since the Unix epoch.
    pub started_at_ms: u64,
    pub interrupted: bool,
    pub max_in_flight: u64,
}

struct Budget {
    issued: AtomicU64,
    limit: Option<u64>,
    deadline: Option<Instant>,
    stopped: AtomicBool,
}

impl Budget {
    /// The next request number, or `None` when the run is over.
    fn take(&self, check_deadline: bool) -> Option<u64> {
        if self.stopped.load(Ordering::Relaxed) {
            return None;
        }
        if check_deadline && self.deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        let n = self.issued.fetch_add(1, Ordering::Relaxed);
        if self.limit.is_some_and(|l| n >= l) {
            self.issued.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(n)
    }
}

/// Picks specs of a group in proportion to their weights, deterministically.
#[derive(Debug, Clone)]
struct Picker {
    cycle: Vec<usize>,
}

impl Picker {
    fn new(specs: &[RequestSpec], members: &[usize]) -> Self {
        let mut cycle = Vec::new();
        for &i in members {
            for _ in 0..specs[i].weight {
                cycle.push(i);
            }
        }
        Picker { cycle }
    }

    fn pick(&self, n: u64) -> usize {
        self.cycle[(n % self.cycle.len() as u64) as usize]
    }
}

struct Shared {
    client: reqwest::Client,
    specs: Vec<RequestSpec>,
    records: Mutex<Vec<RequestRecord>>,
    progress: Arc<Progress>,
    budget: Budget,
    run_start: Instant,
    timeout: Duration,
}

impl Shared {
    async fn one(&self, spec: usize, seq: u64) {
        self.one_with(&self.client, spec, seq).await
    }

    async fn one_with(&self, client: &reqwest::Client, spec: usize, seq: u64) {
        let p = &self.progress;
        p.sent.fetch_add(1, Ordering::Relaxed);
        let now = p.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        p.max_in_flight.fetch_max(now, Ordering::Relaxed);
        let record = execute(
            client,
            &self.specs[spec],
            spec,
            seq,
            self.run_start,
            self.timeout,
        )
        .await;
        p.in_flight.fetch_sub(1, Ordering::Relaxed);
        p.done.fetch_add(1, Ordering::Relaxed);
        if record.outcome == Outcome::Ok {
            p.ok.fetch_add(1, Ordering::Relaxed);
        } else {
            p.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(record);
    }
}

/// Runs warm-up and the measured phase. `cancel` turning `true` stops issuing and abandons what
/// is in flight; the records finished so far are returned with `interrupted` set.
pub async fn run(
    client: reqwest::Client,
    config: RunConfig,
    progress: Arc<Progress>,
    mut cancel: watch::Receiver<bool>,
) -> RunOutcome {
    let specs = config.specs.clone();
    // Warm-up: sequential batches over every spec, results dropped.
    if config.warmup > 0 {
        let per_batch = match config.load {
            Load::Closed { concurrency } => concurrency.max(1) as u64,
            Load::Open { .. } => 4,
        };
        let mut n = 0;
        let warm_start = Instant::now();
        while n < config.warmup && !*cancel.borrow() {
            let mut set = JoinSet::new();
            for _ in 0..per_batch.min(config.warmup - n) {
                let client = client.clone();
                let spec = specs[(n % specs.len() as u64) as usize].clone();
                let timeout = config.timeout;
                let seq = n;
                set.spawn(async move {
                    execute(&client, &spec, 0, u64::MAX - seq, warm_start, timeout).await
                });
                n += 1;
            }
            tokio::select! {
                _ = set.join_all() => {}
                _ = cancel.wait_for(|c| *c) => {}
            }
        }
    }

    let run_start = Instant::now();
    let started_at_ms = headroom_gpu::sampler::now_ms();
    let shared = Arc::new(Shared {
        client,
        specs: specs.clone(),
        records: Mutex::new(Vec::new()),
        progress: Arc::clone(&progress),
        budget: Budget {
            issued: AtomicU64::new(0),
            limit: config.requests,
            deadline: config.duration.map(|d| run_start + d),
            stopped: AtomicBool::new(*cancel.borrow()),
        },
        run_start,
        timeout: config.timeout,
    });
    progress
        .planned
        .store(config.requests.unwrap_or(0), Ordering::Relaxed);
    progress.measuring.store(true, Ordering::Relaxed);

    // Groups: one per spec with its own load, plus the shared one.
    let shared_members: Vec<usize> = (0..specs.len())
        .filter(|&i| specs[i].load.is_none())
        .collect();
    let mut groups: Vec<(Load, Vec<usize>)> = specs
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.load.map(|l| (l, vec![i])))
        .collect();
    if !shared_members.is_empty() {
        groups.push((config.load, shared_members));
    }
    let single_group = groups.len() == 1;

    let mut drivers = JoinSet::new();
    for (g, (load, members)) in groups.into_iter().enumerate() {
        let picker = Picker::new(&specs, &members);
        match load {
            Load::Closed { concurrency } => {
                // One current-thread runtime per core, each with its own connections: a request
                // and its connection task then share a thread, which costs fewer wake-ups than
                // work stealing and keeps timings tight on a busy machine.
                let threads = std::thread::available_parallelism()
                    .map_or(1, |n| n.get())
                    .min(concurrency as usize)
                    .max(1);
                for t in 0..threads {
                    let workers: Vec<u32> = (0..concurrency)
                        .filter(|w| *w as usize % threads == t)
                        .collect();
                    let shared = Arc::clone(&shared);
                    let picker = picker.clone();
                    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
                    let spawned = std::thread::Builder::new()
                        .name(format!("bench-closed-{t}"))
                        .spawn(move || {
                            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                                .enable_all()
                                .build()
                            else {
                                return;
                            };
                            let client = http_client().unwrap_or_else(|_| shared.client.clone());
                            rt.block_on(async move {
                                let mut set = JoinSet::new();
                                for w in workers {
                                    let shared = Arc::clone(&shared);
                                    let picker = picker.clone();
                                    let client = client.clone();
                                    set.spawn(async move {
                                        let mut local = w as u64;
                                        while let Some(seq) = shared.budget.take(true) {
                                            shared.one_with(&client, picker.pick(local), seq).await;
                                            local += concurrency as u64;
                                        }
                                    });
                                }
                                set.join_all().await;
                            });
                            let _ = done_tx.send(());
                        });
                    if spawned.is_ok() {
                        drivers.spawn(async move {
                            let _ = done_rx.await;
                        });
                    }
                }
            }
            Load::Open { rate, burstiness } => {
                let planned = match (config.duration, config.requests) {
                    (Some(d), _) => Some((rate * d.as_secs_f64()).round() as u64),
                    (None, Some(n)) if single_group => Some(n),
                    _ => None,
                }
                // Beyond this a precomputed schedule is too big to hold; draw gaps as we go.
                .filter(|&n| n <= MAX_PRECOMPUTED_ARRIVALS);
                let seed = config.seed.wrapping_add(g as u64 * 7919);
                let shared = Arc::clone(&shared);
                drivers.spawn(async move {
                    let mut inflight = JoinSet::new();
                    let mut rng = Rng::new(seed);
                    let fixed = planned.map(|n| schedule(n, rate, burstiness, seed));
                    let mut at = Duration::ZERO;
                    let mut i = 0u64;
                    loop {
                        let offset = match &fixed {
                            Some(times) => match times.get(i as usize) {
                                Some(t) => *t,
                                None => break,
                            },
                            None => {
                                let this = at;
                                let gap = next_gap(&mut rng, rate, burstiness);
                                at = at.saturating_add(
                                    Duration::try_from_secs_f64(gap).unwrap_or(Duration::MAX),
                                );
                                this
                            }
                        };
                        let Some(due) = shared.run_start.checked_add(offset) else {
                            break;
                        };
                        tokio::time::sleep_until(due.into()).await;
                        // A precomputed schedule already ends inside the duration.
                        let Some(seq) = shared.budget.take(fixed.is_none()) else {
                            break;
                        };
                        let spec = picker.pick(i);
                        let s = Arc::clone(&shared);
                        inflight.spawn(async move { s.one(spec, seq).await });
                        i += 1;
                        // Reap finished tasks so the set does not grow without bound.
                        while inflight.try_join_next().is_some() {}
                    }
                    inflight.join_all().await;
                });
            }
        }
    }

    let interrupted = tokio::select! {
        _ = async { while drivers.join_next().await.is_some() {} } => false,
        _ = cancel.wait_for(|c| *c) => true,
    };
    if interrupted {
        shared.budget.stopped.store(true, Ordering::Relaxed);
        drivers.abort_all();
        while drivers.join_next().await.is_some() {}
    }
    let duration = run_start.elapsed();
    let records = std::mem::take(&mut *shared.records.lock().unwrap_or_else(|e| e.into_inner()));
    RunOutcome {
        requests_sent: progress.sent.load(Ordering::Relaxed),
        records,
        duration,
        started_at_ms,
        interrupted,
        max_in_flight: progress.max_in_flight.load(Ordering::Relaxed),
    }
}

/// A new HTTP client suited to load generation: large idle pool, no global timeout (each request
/// has its own).
pub fn http_client() -> Result<reqwest::Client, crate::BenchError> {
    reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| crate::BenchError::Environment(format!("HTTP client: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_stops_at_the_limit() {
        let b = Budget {
            issued: AtomicU64::new(0),
            limit: Some(3),
            deadline: None,
            stopped: AtomicBool::new(false),
        };
        let taken: Vec<_> = std::iter::from_fn(|| b.take(true)).collect();
        assert_eq!(taken, vec![0, 1, 2]);
        assert_eq!(b.take(true), None);
    }

    #[test]
    fn picker_follows_weights() {
        let d = crate::workload::SpecDefaults {
            url: "http://x".into(),
            model: "m".into(),
            api_key: None,
            max_tokens: 1,
            input_tokens: 1,
            prompts_file: None,
            audio_dir: None,
            voice: "v".into(),
            stream: true,
        };
        let mut a =
            crate::workload::build_spec(crate::workload::RequestKind::Chat, Default::default(), &d)
                .unwrap();
        a.weight = 3;
        let b = a.clone();
        let mut b = b;
        b.weight = 1;
        let specs = vec![a, b];
        let p = Picker::new(&specs, &[0, 1]);
        let picks: Vec<usize> = (0..8).map(|n| p.pick(n)).collect();
        assert_eq!(picks.iter().filter(|&&i| i == 0).count(), 6);
        assert_eq!(picks.iter().filter(|&&i| i == 1).count(), 2);
    }
}
