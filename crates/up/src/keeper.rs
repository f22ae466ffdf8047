//! Keeping a backend running: restarts with exponential backoff, start failures and crash
//! loops counted into the report.

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_server::admin_box::BackendState;
use tokio::sync::watch;

use crate::budget::mib;
use crate::cgroup::{Exit, exit_reason};
use crate::ctx::{Ctx, stopped};
use crate::launch::{Started, start};

/// A life of a backend shorter than this (from healthy to exit) counts as ended early, and a
/// longer one restarts the backoff from `restart_backoff`.
pub(crate) const STAYED_UP: Duration = Duration::from_secs(60);

/// Lives in a row that ended early (a restart that never got healthy, or an exit within
/// [`STAYED_UP`]) that make a crash loop.
pub const CRASH_LOOP_AFTER: u32 = 3;

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
    let mut backoff = ctx.config.restart_backoff;
    let mut healthy_since = Instant::now();
    let mut early_in_a_row = 0u32;
    let down_state = |in_a_row: u32| {
        if in_a_row >= CRASH_LOOP_AFTER {
            BackendState::CrashLoop
        } else {
            BackendState::Restarting
        }
    };
    loop {
        let exited = tokio::select! {
            status = group.wait() => status,
            _ = stopped(&mut stop) => {
                group.stop(b.stop_grace).await;
                ctx.status.update(&b.name, |r| { r.state = BackendState::Stopped; r.pid = None; });
                return;
            }
        };
        if healthy_since.elapsed() > STAYED_UP {
            backoff = ctx.config.restart_backoff;
            early_in_a_row = 0;
        }
        early_in_a_row += 1;
        let exit = match &ctx.enforced {
            Some(c) => c.judge_exit(exited),
            None => Exit::Other(exit_reason(exited)),
        };
        ctx.say(&format!(
            "up: [{}] {}; restarting in {:.1} s",
            b.name,
            match &exit {
                Exit::OomKilled => format!(
                    "was killed by the kernel's OOM killer: the box's memory cgroup reached its limit of {}",
                    mib(ctx.meter.capacity)
                ),
                Exit::Other(_) => exit.reason(),
            },
            backoff.as_secs_f64()
        ));
        let retry_ms = (backoff + Duration::from_secs(1)).as_millis() as u64;
        ctx.status.update(&b.name, |r| {
            r.state = down_state(early_in_a_row);
            r.pid = None;
            r.retry_after_ms = Some(retry_ms);
            r.last_exit = Some(exit.reason());
        });
        // Whatever the group forked goes with it.
        group.stop(Duration::from_secs(2)).await;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stopped(&mut stop) => {
                    ctx.status.update(&b.name, |r| r.state = BackendState::Stopped);
                    return;
                }
            }
            backoff = (backoff * 2).min(ctx.config.restart_backoff_max);
            ctx.status.update(&b.name, |r| r.restarts += 1);
            let attempt = tokio::select! {
                r = start(&ctx, &b, &args, &env) => r,
                _ = stopped(&mut stop) => {
                    ctx.status.update(&b.name, |r| r.state = BackendState::Stopped);
                    return;
                }
            };
            match attempt {
                Ok(g) => {
                    group = g;
                    break;
                }
                Err(e) => {
                    early_in_a_row += 1;
                    let state = down_state(early_in_a_row);
                    ctx.say(&format!(
                        "up: [{}] restart failed{}: {e}; next try in {:.1} s",
                        b.name,
                        if state == BackendState::CrashLoop {
                            format!(" ({early_in_a_row} in a row: crash loop)")
                        } else {
                            String::new()
                        },
                        backoff.as_secs_f64()
                    ));
                    let retry_ms = (backoff + Duration::from_secs(1)).as_millis() as u64;
                    let reason = one_line(&e.to_string());
                    ctx.status.update(&b.name, |r| {
                        r.state = state;
                        r.start_failures += 1;
                        r.retry_after_ms = Some(retry_ms);
                        r.last_exit = Some(reason);
                    });
                }
            }
        }
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

/// A message on one line (a backend's last log line may bring its own line breaks).
pub(crate) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
