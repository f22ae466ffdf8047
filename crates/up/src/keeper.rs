//! Keeping a backend running: restarts with exponential backoff, start failures and crash
//! loops counted into the report.

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_server::admin_box::BackendState;
use tokio::sync::watch;

use crate::UpError;
use crate::boxfile::BackendConfig;
use crate::budget::mib;
use crate::cgroup::{Exit, exit_reason};
use crate::ctx::{Ctx, stopped};
use crate::launch::{Started, start};
use crate::process::Group;
use crate::warmup;

/// A life of a backend shorter than this (from healthy to exit) counts as ended early, and a
/// longer one restarts the backoff from `restart_backoff`.
pub(crate) const STAYED_UP: Duration = Duration::from_secs(60);

/// Lives in a row that ended early (a restart that never got healthy, or an exit within
/// [`STAYED_UP`]) that make a crash loop.
pub(crate) const CRASH_LOOP_AFTER: u32 = 3;

/// The restart schedule of one backend: the wait before the next try (from `restart_backoff`,
/// doubled after each wait up to `restart_backoff_max`, back to the first after a life longer
/// than [`STAYED_UP`]) and the lives in a row that ended early. Pure: the keeper hands in what
/// happened.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Restarts {
    first: Duration,
    max: Duration,
    wait: Duration,
    early_in_a_row: u32,
}

impl Restarts {
    pub(crate) fn new(first: Duration, max: Duration) -> Restarts {
        Restarts {
            first,
            max,
            wait: first,
            early_in_a_row: 0,
        }
    }

    /// The backend exited after `lived` since it was last healthy: the state it is down in.
    pub(crate) fn exited(&mut self, lived: Duration) -> BackendState {
        if lived > STAYED_UP {
            self.wait = self.first;
            self.early_in_a_row = 0;
        }
        self.early_in_a_row += 1;
        down_state(self.early_in_a_row)
    }

    /// The wait is over (the next try begins): the one after it is twice as long, up to the most.
    pub(crate) fn waited(&mut self) {
        self.wait = (self.wait * 2).min(self.max);
    }

    /// A restart did not come up healthy: the state it is down in.
    pub(crate) fn start_failed(&mut self) -> BackendState {
        self.early_in_a_row += 1;
        down_state(self.early_in_a_row)
    }

    /// The wait before the next try.
    pub(crate) fn wait(&self) -> Duration {
        self.wait
    }

    /// The lane's Retry-After while down: the wait and a second for the start.
    pub(crate) fn retry_after_ms(&self) -> u64 {
        (self.wait + Duration::from_secs(1)).as_millis() as u64
    }

    pub(crate) fn early_in_a_row(&self) -> u32 {
        self.early_in_a_row
    }
}

/// How a running backend ended, as the restart line says it: an OOM kill names the cgroup's
/// limit (`capacity`).
pub(crate) fn how_it_exited(exit: &Exit, capacity: u64) -> String {
    match exit {
        Exit::OomKilled => format!(
            "was killed by the kernel's OOM killer: the box's memory cgroup reached its limit of {}",
            mib(capacity)
        ),
        Exit::Other(_) => exit.reason(),
    }
}

/// Restarting, or a crash loop once [`CRASH_LOOP_AFTER`] lives in a row ended early.
fn down_state(early_in_a_row: u32) -> BackendState {
    if early_in_a_row >= CRASH_LOOP_AFTER {
        BackendState::CrashLoop
    } else {
        BackendState::Restarting
    }
}

/// Keeps one backend running: waits for it to exit (restarts it with exponential backoff) or
/// to be told to stop (stops its process group). Every restart attempt is counted as it begins
/// (`restarts`), every one that does not come up healthy as a start failure, and the state says
/// `crash_loop` once [`CRASH_LOOP_AFTER`] lives in a row ended early, with the last exit's
/// reason beside it: a backend that can no longer start is visible at once, not only when a
/// restart succeeds.
pub(crate) async fn keep(ctx: Arc<Ctx>, started: Started, mut stop: watch::Receiver<bool>) {
    let Started {
        backend: b,
        mut group,
        args,
        env,
    } = started;
    let mut restarts = Restarts::new(ctx.config.restart_backoff, ctx.config.restart_backoff_max);
    let mut healthy_since = Instant::now();
    loop {
        let exited = tokio::select! {
            status = group.wait() => status,
            _ = stopped(&mut stop) => {
                group.stop(b.stop_grace).await;
                ctx.status.update(&b.name, |r| { r.state = BackendState::Stopped; r.pid = None; });
                return;
            }
        };
        record_exit(&ctx, &b, &mut restarts, exited, healthy_since.elapsed());
        // Whatever the group forked goes with it.
        group.stop(Duration::from_secs(2)).await;
        match restart_until_up(&ctx, &b, &args, &env, &mut restarts, &mut stop).await {
            Some(g) => group = g,
            None => return,
        }
        warm_after_restart(&ctx, &b).await;
        healthy_since = Instant::now();
        ctx.status.update(&b.name, |r| {
            r.state = BackendState::Ready;
            r.retry_after_ms = None;
        });
        ctx.say(&format!(
            "up: [{}] running again (pid {})",
            b.name, group.pid
        ));
    }
}

/// Runs `b`'s warm-up job once on the process just started again, before its lane is given
/// requests (it answers 503 with Retry-After meanwhile): the first job of a fresh engine pays its
/// first inference (a dictation right after Whisper's `kill -9` took 0.75 s against 0.49 s). A
/// failed warm-up is said and the backend is used anyway: it is healthy.
async fn warm_after_restart(ctx: &Ctx, b: &BackendConfig) {
    let Some(w) = &b.warmup else { return };
    let answer = match warmup::prepare(b, w) {
        Ok(job) => warmup::run(&ctx.client, &job).await,
        Err(e) => Err(e.to_string()),
    };
    ctx.say(&match answer {
        Ok(a) => format!(
            "up: [{}] warmed up again in {:.2} s",
            b.name,
            a.took.as_secs_f64()
        ),
        Err(e) => format!("up: [{}] warm-up after its restart failed: {e}", b.name),
    });
}

/// Says how `b` exited (`exited`, after `lived` since it was healthy) and when it restarts, and
/// puts it in the report as down.
fn record_exit(
    ctx: &Ctx,
    b: &BackendConfig,
    restarts: &mut Restarts,
    exited: Option<std::process::ExitStatus>,
    lived: Duration,
) {
    let down = restarts.exited(lived);
    let exit = match &ctx.enforced {
        Some(c) => c.judge_exit(exited),
        None => Exit::Other(exit_reason(exited)),
    };
    ctx.say(&format!(
        "up: [{}] {}; restarting in {:.1} s",
        b.name,
        how_it_exited(&exit, ctx.meter.capacity),
        restarts.wait().as_secs_f64()
    ));
    let retry_ms = restarts.retry_after_ms();
    ctx.status.update(&b.name, |r| {
        r.state = down;
        r.pid = None;
        r.retry_after_ms = Some(retry_ms);
        r.last_exit = Some(exit.reason());
    });
}

/// Waits out the backoff and starts `b` again, until one start comes up healthy (its group) or
/// the stop flag is set (`None`, the backend reported stopped). Each try is counted as it begins.
async fn restart_until_up(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    args: &[String],
    env: &[(String, String)],
    restarts: &mut Restarts,
    stop: &mut watch::Receiver<bool>,
) -> Option<Group> {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(restarts.wait()) => {}
            _ = stopped(stop) => {
                ctx.status.update(&b.name, |r| r.state = BackendState::Stopped);
                return None;
            }
        }
        restarts.waited();
        ctx.status.update(&b.name, |r| r.restarts += 1);
        let attempt = tokio::select! {
            r = start(ctx, b, args, env) => r,
            _ = stopped(stop) => {
                ctx.status.update(&b.name, |r| r.state = BackendState::Stopped);
                return None;
            }
        };
        match attempt {
            Ok(g) => return Some(g),
            Err(e) => record_start_failure(ctx, b, restarts, &e),
        }
    }
}

/// Says that a restart of `b` failed (`e`) and when the next try is, and counts it in the report.
fn record_start_failure(ctx: &Ctx, b: &BackendConfig, restarts: &mut Restarts, e: &UpError) {
    let state = restarts.start_failed();
    ctx.say(&format!(
        "up: [{}] restart failed{}: {e}; next try in {:.1} s",
        b.name,
        if state == BackendState::CrashLoop {
            format!(" ({} in a row: crash loop)", restarts.early_in_a_row())
        } else {
            String::new()
        },
        restarts.wait().as_secs_f64()
    ));
    let retry_ms = restarts.retry_after_ms();
    let reason = one_line(&e.to_string());
    ctx.status.update(&b.name, |r| {
        r.state = state;
        r.start_failures += 1;
        r.retry_after_ms = Some(retry_ms);
        r.last_exit = Some(reason);
    });
}

/// A message on one line (a backend's last log line may bring its own line breaks).
pub(crate) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use headroom_server::admin_box::BackendState;

    use super::{Restarts, how_it_exited, one_line};
    use crate::cgroup::Exit;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn restarts_double_their_wait_up_to_the_most_and_a_third_early_end_is_a_crash_loop() {
        let mut r = Restarts::new(S, 5 * S);
        // Exits 10 s after it was healthy: early, first in a row.
        assert_eq!(r.exited(10 * S), BackendState::Restarting);
        assert_eq!(r.wait(), S);
        assert_eq!(r.retry_after_ms(), 2000);
        r.waited();
        assert_eq!(r.wait(), 2 * S);
        assert_eq!(r.start_failed(), BackendState::Restarting);
        assert_eq!(r.early_in_a_row(), 2);
        assert_eq!(r.retry_after_ms(), 3000);
        r.waited();
        assert_eq!(r.wait(), 4 * S);
        assert_eq!(r.start_failed(), BackendState::CrashLoop);
        assert_eq!(r.early_in_a_row(), 3);
        r.waited();
        assert_eq!(r.wait(), 5 * S, "capped at restart_backoff_max");
        r.waited();
        assert_eq!(r.wait(), 5 * S);
        // It came up and stayed up 61 s: the schedule starts over.
        assert_eq!(r.exited(61 * S), BackendState::Restarting);
        assert_eq!(r.early_in_a_row(), 1);
        assert_eq!(r.wait(), S);
        // Exactly 60 s is not longer than STAYED_UP: still early.
        assert_eq!(r.exited(60 * S), BackendState::Restarting);
        assert_eq!(r.early_in_a_row(), 2);
        assert_eq!(r.exited(Duration::ZERO), BackendState::CrashLoop);
    }

    #[test]
    fn a_message_is_put_on_one_line() {
        assert_eq!(
            one_line("exited (code 1);\n  Traceback:\n\tKeyError "),
            "exited (code 1); Traceback: KeyError"
        );
    }

    #[test]
    fn an_oom_kill_names_the_cgroups_limit_and_any_other_exit_its_status() {
        assert_eq!(
            how_it_exited(&Exit::OomKilled, 3 * 1024 * 1024 * 1024),
            "was killed by the kernel's OOM killer: the box's memory cgroup reached its limit of 3072.0 MiB"
        );
        assert_eq!(
            how_it_exited(&Exit::Other("exited (exit status: 1)".into()), 1),
            "exited (exit status: 1)"
        );
    }
}
