//! The night's clock and traffic. The night of `--duration` is cut into the file's rounds; each
//! round has an active part (requests arrive: Poisson streams at random, worker streams back to
//! back, a follower stream right after its leader's answers) and ends in a quiet gap, entered
//! once every request of the round is answered, whose memory floor goes to the leak verdict. A
//! fault at a share of the night fires at the same share of the night's active time, so it always
//! lands while requests are flowing. Before the night, each stream is measured alone on the quiet
//! box (its idle figure).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_bench::arrivals::{Rng, next_gap};

use crate::client::{self, Record, Shape, Target};
use crate::scenario::{Arrivals, Night, Span};

/// When things happen in a night of a given length.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub rounds: u32,
    /// The active part of each round.
    pub active: Duration,
    /// The quiet gap after it.
    pub gap: Duration,
    /// `(round, offset into its active part, fault index)`, in firing order.
    pub faults: Vec<(u32, Duration, usize)>,
}

/// The schedule of `night` over `length`.
pub fn schedule(night: &Night, length: Duration) -> Schedule {
    let rounds = night.rounds.of(length);
    let round = length / rounds;
    let gap = night.gap.of(length).min(round / 2);
    let active = round.saturating_sub(gap);
    let active_total = active.as_secs_f64() * f64::from(rounds);
    let mut faults: Vec<(u32, Duration, usize)> = night
        .faults
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let share = match f.at {
                Span::Share(s) => s,
                Span::Fixed(d) => (d.as_secs_f64() / length.as_secs_f64().max(1e-9)).min(0.999),
            };
            let a = share * active_total;
            let r = ((a / active.as_secs_f64().max(1e-9)) as u32).min(rounds - 1);
            let offset = (a - f64::from(r) * active.as_secs_f64()).max(0.0);
            (r, Duration::from_secs_f64(offset), i)
        })
        .collect();
    faults.sort_by_key(|f| (f.0, f.1));
    Schedule {
        rounds,
        active,
        gap,
        faults,
    }
}

/// What the traffic of one stream needs.
#[derive(Clone)]
pub struct Lane {
    pub index: usize,
    pub target: Target,
    pub shape: Shape,
    pub arrivals: Arrivals,
    pub deadline: Duration,
    pub seq: Arc<AtomicU64>,
    /// Requests the night has sent on this lane so far.
    pub sent: Arc<AtomicU64>,
    /// When each closed-loop client sends next, one entry per client (none for a Poisson
    /// stream): its think time runs on across a quiet gap, as a batch client's does (a client
    /// that thinks 2 minutes does not send again at every round's start).
    pub due: Arc<Mutex<Vec<Option<Instant>>>>,
}

/// When closed-loop client `worker` of `workers` sends first in a round that starts at `start`:
/// when its think time since its last request ends (`due`), or, before its first request,
/// spread over its first think time (or a second) so clients do not start together.
pub fn worker_start(
    due: Option<Instant>,
    start: Instant,
    think: Duration,
    worker: u32,
    workers: u32,
) -> Instant {
    due.unwrap_or_else(|| {
        start
            + think
                .max(Duration::from_secs(1))
                .mul_f64(f64::from(worker) / f64::from(workers.max(1)))
    })
}

/// The lanes sent right after a request of lane `leader`, each with the share of its requests
/// that get one.
fn followers_of(lanes: &[Lane], leader: usize) -> Vec<(Lane, f64)> {
    lanes
        .iter()
        .filter_map(|l| match l.arrivals {
            Arrivals::After { stream, share } if stream == leader => Some((l.clone(), share)),
            _ => None,
        })
        .collect()
}

/// Everything requests write to.
#[derive(Clone)]
pub struct Traffic {
    pub client: reqwest::Client,
    pub clock: Instant,
    pub policy: crate::scenario::ClientPolicy,
    pub records: Arc<Mutex<Vec<Record>>>,
    pub seed: u64,
}

impl Traffic {
    async fn one(&self, lane: &Lane, round: Option<u32>, rng: &mut Rng) -> Record {
        let seq = lane.seq.fetch_add(1, Ordering::Relaxed);
        client::request(
            &self.client,
            &lane.target,
            &lane.shape,
            lane.index,
            seq,
            round,
            self.clock,
            lane.deadline,
            &self.policy,
            rng,
        )
        .await
    }

    /// Sends one request of `lane` in round `round` on its own task, its record kept.
    fn spawn_one(&self, tasks: &mut tokio::task::JoinSet<()>, lane: &Lane, round: u32, seed: u64) {
        lane.sent.fetch_add(1, Ordering::Relaxed);
        let me = self.clone();
        let lane = lane.clone();
        tasks.spawn(async move {
            let rec = me.one(&lane, Some(round), &mut Rng::new(seed)).await;
            me.records.lock().expect("records lock").push(rec);
        });
    }

    /// Sends one request of `lane` and waits for its answer (a closed-loop client's turn);
    /// whether it was served.
    async fn send_in_turn(&self, lane: &Lane, round: u32, rng: &mut Rng) -> bool {
        lane.sent.fetch_add(1, Ordering::Relaxed);
        let rec = self.one(lane, Some(round), rng).await;
        let served = rec.served_secs().is_some();
        self.records.lock().expect("records lock").push(rec);
        served
    }

    /// Sends `n` requests of `lane` one at a time after `warmup` unrecorded ones.
    pub async fn idle(&self, lane: &Lane, warmup: u32, n: u32) {
        let mut rng = Rng::new(self.seed ^ 0x1D1E ^ lane.index as u64);
        for _ in 0..warmup {
            let _ = self.one(lane, None, &mut rng).await;
        }
        for _ in 0..n {
            let r = self.one(lane, None, &mut rng).await;
            self.records.lock().expect("records lock").push(r);
        }
    }

    /// The active part of round `round` for every lane: returns once the last request of the
    /// round is answered. In the `last` round a Poisson lane that has sent nothing yet sends one
    /// request at its start, so a rare stream of a short night is still measured.
    pub async fn round(&self, lanes: &[Lane], round: u32, active: Duration, last: bool) {
        let until = Instant::now() + active;
        let mut tasks = tokio::task::JoinSet::new();
        for lane in lanes {
            let seed = self.seed
                ^ (u64::from(round) << 32)
                ^ (lane.index as u64).wrapping_mul(0x9E37_79B9);
            match lane.arrivals {
                Arrivals::Poisson { per_minute } => {
                    let me = self.clone();
                    let lane = lane.clone();
                    tasks.spawn(async move {
                        let mut rng = Rng::new(seed);
                        let mut inner = tokio::task::JoinSet::new();
                        let mut at = Instant::now();
                        if last && lane.sent.load(Ordering::Relaxed) == 0 {
                            me.spawn_one(&mut inner, &lane, round, rng.next_u64());
                        }
                        loop {
                            at +=
                                Duration::from_secs_f64(next_gap(&mut rng, per_minute / 60.0, 1.0));
                            if at >= until {
                                break;
                            }
                            tokio::time::sleep_until(at.into()).await;
                            me.spawn_one(&mut inner, &lane, round, rng.next_u64());
                        }
                        while inner.join_next().await.is_some() {}
                    });
                }
                Arrivals::Workers { workers, think } => {
                    let followers = followers_of(lanes, lane.index);
                    for w in 0..workers {
                        let me = self.clone();
                        let lane = lane.clone();
                        let followers = followers.clone();
                        tasks.spawn(async move {
                            let mut rng = Rng::new(seed ^ u64::from(w));
                            let slot = w as usize;
                            let stored = lane.due.lock().expect("due lock")[slot];
                            let mut at =
                                worker_start(stored, Instant::now(), think.mean, w, workers);
                            while at < until {
                                tokio::time::sleep_until(at.into()).await;
                                // What was not answered is not answered aloud either.
                                let answered = me.send_in_turn(&lane, round, &mut rng).await;
                                for (follower, share) in &followers {
                                    if answered && rng.unit() < *share {
                                        me.send_in_turn(follower, round, &mut rng).await;
                                    }
                                }
                                at = Instant::now() + think.draw(&mut rng);
                            }
                            lane.due.lock().expect("due lock")[slot] = Some(at);
                        });
                    }
                }
                // Sent by its leader's clients.
                Arrivals::After { .. } => {}
            }
        }
        while tasks.join_next().await.is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn night(extra: &str) -> Night {
        Night::parse(
            &format!(
                r#"
name = "n"
rounds = 8
gap = "2%"
[[stream]]
name = "d"
kind = "chat"
per_minute = 6
{extra}
"#
            ),
            Path::new("/"),
        )
        .unwrap()
    }

    #[test]
    fn a_client_s_think_time_runs_on_across_rounds() {
        let t = Instant::now();
        let s = Duration::from_secs;
        // Before its first request: the second of two clients starts half a think in.
        assert_eq!(worker_start(None, t, s(10), 0, 2), t);
        assert_eq!(worker_start(None, t, s(10), 1, 2), t + s(5));
        // Then when its think ends, whenever the round starts: a client that thinks 135 s
        // and last sent at t does not send again at a round starting at t + 15 s.
        assert_eq!(
            worker_start(Some(t + s(135)), t + s(15), s(135), 0, 1),
            t + s(135)
        );
        // One overdue (its think ended in the quiet gap) sends at once.
        assert!(worker_start(Some(t), t + s(15), s(1), 0, 1) <= t + s(15));
    }

    #[test]
    fn rounds_and_gaps_fill_the_night() {
        let s = schedule(&night(""), Duration::from_secs(3600));
        assert_eq!(s.rounds, 8);
        assert_eq!(s.gap, Duration::from_secs(72));
        assert_eq!(s.active + s.gap, Duration::from_secs(450));
    }

    #[test]
    fn faults_land_at_their_share_of_the_active_time() {
        let n = night(
            r#"
[[fault]]
at = "50%"
kind = "kill9"
backend = "x"
[[fault]]
at = "0%"
kind = "kill9"
backend = "y"
[[fault]]
at = "99%"
kind = "kill9"
backend = "z"
"#,
        );
        let s = schedule(&n, Duration::from_secs(800));
        // 8 rounds of 100 s: 16 s gaps, 84 s active.
        assert_eq!(s.active, Duration::from_secs(84));
        assert_eq!(s.faults[0], (0, Duration::ZERO, 1));
        // Half of 8 × 84 s of active time: the start of round 4.
        assert_eq!(s.faults[1].0, 4);
        assert!(s.faults[1].1 < Duration::from_millis(1));
        let (r, off, i) = s.faults[2];
        assert_eq!((r, i), (7, 2));
        assert!(
            off < s.active,
            "a late fault still fires inside the last active part"
        );
    }

    #[test]
    fn rounds_of_a_set_length_grow_with_the_night_and_never_fall_below_six() {
        let n = Night {
            rounds: crate::scenario::Rounds::Every(Duration::from_secs(300)),
            ..night("")
        };
        let rounds = |secs| schedule(&n, Duration::from_secs(secs)).rounds;
        assert_eq!(rounds(3600), 12);
        assert_eq!(rounds(2400), 8);
        assert_eq!(
            rounds(600),
            6,
            "a short night still gives the leak verdict six"
        );
        assert_eq!(rounds(90), 6);
        let hour = schedule(&n, Duration::from_secs(3600));
        assert_eq!(hour.active + hour.gap, Duration::from_secs(300));
    }

    #[test]
    fn a_gap_never_takes_more_than_half_a_round() {
        let n = night("").clone();
        let n = Night {
            gap: Span::Fixed(Duration::from_secs(100)),
            ..n
        };
        let s = schedule(&n, Duration::from_secs(80));
        assert_eq!(s.gap, Duration::from_secs(5));
    }
}
