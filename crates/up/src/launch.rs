//! Starting one backend: spawning it in its group, waiting until it is healthy, and stopping the
//! ones started so far.

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_server::admin_box::BackendState;

use crate::UpError;
use crate::boxfile::BackendConfig;
use crate::ctx::Ctx;
use crate::process::{self, Group};
use crate::warmup;

/// A backend started during bring-up, with what it was started with (kept for restarts).
pub(crate) struct Started {
    pub(crate) backend: BackendConfig,
    /// Its process group.
    pub(crate) group: Group,
    /// The arguments added to the box file's.
    pub(crate) args: Vec<String>,
    /// The environment added to the box file's.
    pub(crate) env: Vec<(String, String)>,
}

/// Stops every backend started so far, the last started first, each by its process group.
pub(crate) async fn stop_all_started(ctx: &Ctx, started: &mut Vec<Started>) {
    while let Some(Started {
        backend: b,
        group: mut g,
        ..
    }) = started.pop()
    {
        g.stop(b.stop_grace).await;
        ctx.status.update(&b.name, |r| {
            r.state = BackendState::Stopped;
            r.pid = None;
        });
    }
}

/// Spawns a backend, makes it a member of the pool and waits until it is healthy.
pub(crate) async fn start(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    args: &[String],
    env: &[(String, String)],
) -> Result<Group, UpError> {
    // A crash loop stays visible while the next attempt runs (it may wait ready_timeout).
    ctx.status.update(&b.name, |r| {
        if r.state != BackendState::CrashLoop {
            r.state = BackendState::Starting;
        }
    });
    let procs = ctx.enforced.as_ref().map(|c| c.cgroup().procs_file());
    let log = ctx.log_path(&b.name);
    let mut group = process::spawn_in(b, args, env, &ctx.config.dir, &log, procs.as_deref())?;
    ctx.meter.join(&b.upstream(), group.pid);
    ctx.pauses.adopt(&ctx.status, &b.name, group.pid);
    ctx.say(&format!(
        "up: [{}] started pid {} ({} {}), waiting for {}{}",
        b.name,
        group.pid,
        b.command.display(),
        b.expanded_args()
            .into_iter()
            .chain(args.iter().cloned())
            .collect::<Vec<_>>()
            .join(" "),
        b.upstream(),
        b.health
    ));
    let took = match wait_healthy(ctx, b, &mut group).await {
        Ok(t) => t,
        Err(e) => {
            group.stop(b.stop_grace).await;
            ctx.status.update(&b.name, |r| {
                r.state = BackendState::Failed;
                r.pid = None;
            });
            return Err(e);
        }
    };
    ctx.say(&format!(
        "up: [{}] healthy after {:.1} s",
        b.name,
        took.as_secs_f64()
    ));
    Ok(group)
}

/// Polls `b`'s health URL every 200 ms until it answers (the time it took), the backend exits,
/// or `ready_timeout` passes.
pub(crate) async fn wait_healthy(
    ctx: &Ctx,
    b: &BackendConfig,
    group: &mut Group,
) -> Result<Duration, UpError> {
    let url = format!("{}{}", b.upstream(), b.health);
    let begin = Instant::now();
    loop {
        if let Some(status) = group.reap() {
            return Err(UpError::Backend {
                backend: b.name.clone(),
                what: format!(
                    "{} before it became healthy; last log line: {}",
                    ctx.how_it_ended(status),
                    last_line(group)
                ),
            });
        }
        if warmup::healthy(&ctx.client, &url, Duration::from_secs(2)).await {
            return Ok(begin.elapsed());
        }
        if begin.elapsed() > b.ready_timeout {
            return Err(UpError::Backend {
                backend: b.name.clone(),
                what: format!(
                    "did not become healthy at {url} within {} s (ready_timeout); last log line: {}",
                    b.ready_timeout.as_secs(),
                    last_line(group)
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The last line of a backend's log, or where its (empty) log is.
pub(crate) fn last_line(group: &Group) -> String {
    group
        .log_tail(1)
        .pop()
        .unwrap_or_else(|| format!("(empty; see {})", group.log.display()))
}
