//! The box under `headroom up`: the drill starts `headroom up --config BOX` as a child (tied to
//! the drill's life like `up` ties its backends), waits until its gateway answers `/admin/box`
//! with every backend ready, and reads the box from there during the night: each backend's PID
//! and state, the OOM kills the box counted, and the memory cgroup its backends run in (where `up`
//! enforces `capacity`). Clients go through the gateway. Stopping is `up`'s own SIGTERM path;
//! afterwards no process of the box may be left.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::process::{Child, Command};

use crate::DrillError;

/// One backend as `/admin/box` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdminBackend {
    pub name: String,
    pub role: String,
    pub pid: Option<u32>,
    pub state: String,
    pub restarts: u64,
}

/// What the drill reads of `/admin/box`.
#[derive(Debug, Clone, PartialEq)]
pub struct AdminBox {
    pub backends: Vec<AdminBackend>,
    /// OOM kills counted by the box (where `up` enforces its memory limit).
    pub oom_kills: Option<u64>,
    /// The memory cgroup the backends run in, where there is one.
    pub cgroup: Option<PathBuf>,
    pub limit_bytes: Option<u64>,
    pub usage_bytes: Option<u64>,
}

/// The first value under a key named one of `names`, anywhere in `v` (depth first).
fn find_key<'a>(v: &'a serde_json::Value, names: &[&str]) -> Option<&'a serde_json::Value> {
    match v {
        serde_json::Value::Object(map) => {
            for (k, x) in map {
                if names.contains(&k.as_str()) {
                    return Some(x);
                }
            }
            map.values().find_map(|x| find_key(x, names))
        }
        serde_json::Value::Array(items) => items.iter().find_map(|x| find_key(x, names)),
        _ => None,
    }
}

impl AdminBox {
    /// Reads `/admin/box`'s JSON. The enforcement fields are looked for by name wherever they
    /// sit, so the drill reads them as `up` grows them.
    pub fn parse(v: &serde_json::Value) -> Result<AdminBox, String> {
        let list = v
            .get("backends")
            .and_then(|b| b.as_array())
            .ok_or("no `backends` list")?;
        let mut backends = Vec::new();
        for b in list {
            let s = |k: &str| b.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
            backends.push(AdminBackend {
                name: s("name"),
                role: s("role"),
                pid: b.get("pid").and_then(|p| p.as_u64()).map(|p| p as u32),
                state: s("state"),
                restarts: b.get("restarts").and_then(|r| r.as_u64()).unwrap_or(0),
            });
        }
        let top = {
            let mut t = v.clone();
            if let Some(o) = t.as_object_mut() {
                o.remove("backends");
            }
            t
        };
        let oom_kills = find_key(&top, &["oom_kills", "oom_kills_total"]).and_then(|x| x.as_u64());
        let cgroup = find_key(&top, &["cgroup", "cgroup_path"]).and_then(|c| {
            c.as_str()
                .or_else(|| c.get("path").and_then(|p| p.as_str()))
                .map(PathBuf::from)
        });
        let limit_bytes =
            find_key(&top, &["limit_bytes", "memory_limit_bytes"]).and_then(|x| x.as_u64());
        // Under enforcement the pool's reading is the working set (the charge less inactive
        // file cache); the box set up by hand is read the same way.
        let usage_bytes = find_key(&top, &["working_set_bytes"])
            .or_else(|| find_key(&top, &["usage_bytes"]))
            .and_then(|x| x.as_u64());
        Ok(AdminBox {
            backends,
            oom_kills,
            cgroup,
            limit_bytes,
            usage_bytes,
        })
    }

    pub fn all_ready(&self) -> bool {
        !self.backends.is_empty() && self.backends.iter().all(|b| b.state == "ready")
    }
}

/// `headroom up` running a box.
#[derive(Debug)]
pub struct UpBox {
    child: Child,
    pub pid: u32,
    /// `http://ADDR`.
    pub gateway: String,
    pub api_key: Option<String>,
    pub log: PathBuf,
    client: reqwest::Client,
}

/// How `up` ended.
#[derive(Debug, Clone, Serialize)]
pub struct UpStop {
    pub exit: String,
    /// PIDs of the box (from the last `/admin/box`) still alive after `up` stopped.
    pub left_behind: Vec<u32>,
}

impl UpBox {
    /// Starts `exe up --config box_path ARGS…` and waits until the box is ready.
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        exe: &Path,
        box_path: &Path,
        extra_args: &[String],
        gateway: String,
        api_key: Option<String>,
        log_dir: &Path,
        ready_within: Duration,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<UpBox, DrillError> {
        let log = log_dir.join("up.log");
        let out = std::fs::File::create(&log)
            .map_err(|e| DrillError::Environment(format!("{}: {e}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(|e| DrillError::Environment(format!("{}: {e}", log.display())))?;
        let backend_logs = log_dir.join("backends");
        std::fs::create_dir_all(&backend_logs)
            .map_err(|e| DrillError::Environment(format!("{}: {e}", backend_logs.display())))?;
        let mut cmd = match &headroom_up::process::death_tie().setpriv {
            // The drill's death takes `up` with it, and `up`'s takes its backends.
            Some(setpriv) => {
                let mut c = Command::new(setpriv);
                c.args(["--pdeathsig", "KILL", "--"]).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        cmd.arg("up")
            .arg("--config")
            .arg(box_path)
            .arg("--log-dir")
            .arg(&backend_logs)
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .map_err(|e| DrillError::Environment(format!("cannot start {}: {e}", exe.display())))?;
        let pid = child.id().unwrap_or(0);
        progress(&format!(
            "drill: [up] headroom up --config {} (pid {pid}, log {})",
            box_path.display(),
            log.display()
        ));
        let client = reqwest::Client::builder()
            .no_proxy()
            .build()
            .map_err(|e| DrillError::Environment(format!("HTTP client: {e}")))?;
        let mut me = UpBox {
            child,
            pid,
            gateway,
            api_key,
            log,
            client,
        };
        me.wait_ready(ready_within).await?;
        Ok(me)
    }

    async fn wait_ready(&mut self, within: Duration) -> Result<(), DrillError> {
        let until = Instant::now() + within;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                let tail = headroom_up::process::log_tail(&self.log, 6).join(" | ");
                let msg = format!("headroom up exited while starting ({status}): {tail}");
                // `up`'s exit 2 is bad input or an unusable environment, as it is for the drill.
                return Err(if status.code() == Some(2) {
                    DrillError::BadInput(msg)
                } else {
                    DrillError::Box(msg)
                });
            }
            if let Ok(a) = self.admin().await
                && a.all_ready()
            {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(DrillError::Box(format!(
                    "the box under up was not ready within {:?} (log: {})",
                    within,
                    self.log.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn get(&self, path: &str) -> reqwest::RequestBuilder {
        let mut r = self
            .client
            .get(format!("{}{path}", self.gateway))
            .timeout(Duration::from_secs(5));
        if let Some(k) = &self.api_key {
            r = r.bearer_auth(k);
        }
        r
    }

    /// `GET /admin/box`.
    pub async fn admin(&self) -> Result<AdminBox, String> {
        let r = self
            .get("/admin/box")
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !r.status().is_success() {
            return Err(format!("/admin/box answered {}", r.status()));
        }
        let body = r.bytes().await.map_err(|e| e.to_string())?;
        let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        AdminBox::parse(&v)
    }

    /// `GET /admin/lanes` as JSON.
    pub async fn lanes(&self) -> Result<serde_json::Value, String> {
        let r = self
            .get("/admin/lanes")
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !r.status().is_success() {
            return Err(format!("/admin/lanes answered {}", r.status()));
        }
        let body = r.bytes().await.map_err(|e| e.to_string())?;
        serde_json::from_slice(&body).map_err(|e| e.to_string())
    }

    /// `headroom_box_oom_kills_total` from `/metrics`, summed over its labels.
    pub async fn metrics_oom_kills(&self) -> Option<u64> {
        let text = self.get("/metrics").send().await.ok()?.text().await.ok()?;
        metric_sum(&text, "headroom_box_oom_kills_total")
    }

    /// SIGTERM to `up`, its own ordered stop, then checks that no process of the box is left.
    pub async fn stop(mut self, last_pids: &[u32], grace: Duration) -> UpStop {
        use rustix::process::{Pid, Signal, kill_process, test_kill_process};
        if let Some(pid) = Pid::from_raw(self.pid as i32) {
            let _ = kill_process(pid, Signal::TERM);
        }
        let exit = match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(Ok(s)) => s.to_string(),
            Ok(Err(e)) => format!("unknown ({e})"),
            Err(_) => {
                let _ = self.child.start_kill();
                let _ = self.child.wait().await;
                format!("did not stop within {grace:?}; killed")
            }
        };
        // `up` stops its backends before it exits; give the kernel a moment to reap them.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let left_behind = last_pids
            .iter()
            .copied()
            .filter(|&p| Pid::from_raw(p as i32).is_some_and(|pid| test_kill_process(pid).is_ok()))
            .collect();
        UpStop { exit, left_behind }
    }
}

/// The sum of a Prometheus metric's samples in exposition text.
pub fn metric_sum(text: &str, name: &str) -> Option<u64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        let value = rest.rsplit(' ').next()?.parse::<f64>().ok()?;
        *found.get_or_insert(0u64) += value as u64;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_box_reads_backends_and_finds_enforcement_fields_wherever_they_are() {
        let v: serde_json::Value = serde_json::from_str(
            r#"{"probe":"host","capacity_bytes":1073741824,
                "enforce":{"cgroup":"/sys/fs/cgroup/memory/headroom-up-1","version":"v1","oom_kills":2,"limit_bytes":1073741824,"usage_bytes":900000000,"working_set_bytes":800000000},
                "backends":[{"name":"whisper","role":"audio","pid":22272,"state":"ready","restarts":1},
                            {"name":"llm","role":"text","pid":null,"state":"restarting","restarts":0}]}"#,
        )
        .unwrap();
        let a = AdminBox::parse(&v).unwrap();
        assert_eq!(a.backends.len(), 2);
        assert_eq!(a.backends[0].pid, Some(22272));
        assert_eq!(a.backends[0].restarts, 1);
        assert_eq!(a.backends[1].pid, None);
        assert!(!a.all_ready());
        assert_eq!(a.oom_kills, Some(2));
        assert_eq!(
            a.cgroup,
            Some(PathBuf::from("/sys/fs/cgroup/memory/headroom-up-1"))
        );
        assert_eq!(a.limit_bytes, Some(1 << 30));
        assert_eq!(
            a.usage_bytes,
            Some(800_000_000),
            "the working set is the pool's reading"
        );
        // Today's /admin/box (no enforcement): nothing invented.
        let plain: serde_json::Value = serde_json::from_str(
            r#"{"probe":"host","backends":[{"name":"w","role":"audio","pid":1,"state":"ready","restarts":0}]}"#,
        )
        .unwrap();
        let a = AdminBox::parse(&plain).unwrap();
        assert!(a.all_ready());
        assert_eq!((a.oom_kills, a.cgroup), (None, None));
    }

    #[test]
    fn metric_sums_add_labels_and_skip_longer_names() {
        let text = "# TYPE headroom_box_oom_kills_total counter\nheadroom_box_oom_kills_total{backend=\"w\"} 2\nheadroom_box_oom_kills_total{backend=\"llm\"} 1\nheadroom_box_oom_kills_total_x 9\n";
        assert_eq!(metric_sum(text, "headroom_box_oom_kills_total"), Some(3));
        assert_eq!(
            metric_sum("other 1\n", "headroom_box_oom_kills_total"),
            None
        );
    }
}
