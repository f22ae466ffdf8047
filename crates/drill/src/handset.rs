//! The box set up by hand: the same engines as the box file names, started the way a user who
//! follows an article or the engines' own docs would — each engine on its port, the text engine
//! with a fixed share of the pool (the article's `--gpu-memory-utilization 0.45`, turned into the
//! engine's own flags by the same arithmetic `up` uses) or with flags the user wrote, clients
//! straight to the engines, nothing measured, no gateway. A user with a service manager restarts
//! an engine that dies (`Restart=on-failure`), and so does this box: it is not made worse on
//! purpose. Every engine runs inside one memory cgroup limited to the box's `capacity`, like the
//! box under `up`, so an over-commit costs the same on both.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_up::boxfile::{BackendConfig, BoxConfig, Engine, ProbeKind, Role, resolve_model};
use headroom_up::process::{self, Group};
use serde::Deserialize;
use tokio::sync::watch;

use crate::DrillError;
use crate::limit::MemoryLimit;

/// The hand-set file (`--hand-set FILE`): how the user started the engines.
#[derive(Debug, Clone, PartialEq)]
pub struct HandSetPlan {
    /// Restart an engine that exits, after `restart_delay` (a service manager's job).
    pub restart: bool,
    pub restart_delay: Duration,
    /// The text engine's memory: a share of the pool, or the user's own flags.
    pub text: TextChoice,
    /// Arguments appended to a backend's own, by backend name (after the text choice's flags).
    pub extra_args: BTreeMap<String, Vec<String>>,
    /// Why the user chose this, for the report.
    pub rationale: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TextChoice {
    /// A fixed share of the pool's capacity (the article's 0.45).
    Share(f64),
    /// Flags as written (an empty list: the engine's defaults).
    Args(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlan {
    #[serde(default)]
    restart: Option<bool>,
    #[serde(default)]
    restart_delay: Option<String>,
    #[serde(default)]
    rationale: Option<String>,
    #[serde(default)]
    text: Option<RawText>,
    #[serde(default)]
    args: BTreeMap<String, Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawText {
    #[serde(default)]
    share: Option<f64>,
    #[serde(default)]
    args: Option<Vec<String>>,
}

impl HandSetPlan {
    pub fn load(path: &Path) -> Result<HandSetPlan, DrillError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| DrillError::BadInput(format!("cannot read {}: {e}", path.display())))?;
        HandSetPlan::parse(&text)
            .map_err(|e| DrillError::BadInput(format!("{}: {e}", path.display())))
    }

    pub fn parse(text: &str) -> Result<HandSetPlan, String> {
        let raw: RawPlan = toml::from_str(text).map_err(|e| {
            e.to_string()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        })?;
        let text = match raw.text {
            None => TextChoice::Args(Vec::new()),
            Some(RawText {
                share: Some(s),
                args: None,
            }) => {
                if !(s.is_finite() && s > 0.0 && s <= 1.0) {
                    return Err("`text.share`: give a share above 0 and at most 1".into());
                }
                TextChoice::Share(s)
            }
            Some(RawText {
                share: None,
                args: Some(a),
            }) => TextChoice::Args(a),
            Some(_) => {
                return Err("`text`: give exactly one of `share` and `args`".into());
            }
        };
        let restart_delay = match raw.restart_delay {
            None => Duration::from_secs(1),
            Some(t) => {
                headroom_plan::units::parse_duration(&t, headroom_plan::units::BareNumber::Seconds)
                    .ok_or_else(|| format!("`restart_delay`: `{t}` is not a duration"))?
            }
        };
        Ok(HandSetPlan {
            restart: raw.restart.unwrap_or(true),
            restart_delay,
            text,
            extra_args: raw.args,
            rationale: raw.rationale.unwrap_or_default(),
        })
    }

    /// The text engine's arguments (appended to its own) and environment under this plan.
    pub fn text_flags(
        &self,
        config: &BoxConfig,
        backend: &BackendConfig,
    ) -> Result<(Vec<String>, Env), DrillError> {
        match &self.text {
            TextChoice::Args(a) => Ok((a.clone(), Vec::new())),
            TextChoice::Share(s) => share_flags(config, backend, *s),
        }
    }
}

/// The share of the pool the article gives the text engine (`--gpu-memory-utilization 0.45`).
pub const ARTICLE_SHARE: f64 = 0.45;

/// The text engine's arguments and environment for a fixed `share` of the pool's capacity, as a
/// user who sizes it by hand gives them: llama.cpp's context and slots by the same arithmetic
/// `up` uses for that budget, with llama-server's prompt cache left on; vLLM's memory share (on
/// a GPU) or KV cache space (on the CPU).
pub fn share_flags(
    config: &BoxConfig,
    backend: &BackendConfig,
    share: f64,
) -> Result<(Vec<String>, Env), DrillError> {
    let plan = backend.text.as_ref().ok_or_else(|| {
        DrillError::BadInput(format!(
            "backend `{}` has no text model to size",
            backend.name
        ))
    })?;
    let capacity = config.memory.capacity.ok_or_else(|| {
        DrillError::BadInput("the box file's [memory] has no capacity to take a share of".into())
    })?;
    let budget = (capacity as f64 * share) as u64;
    let gpu = config.memory.probe == ProbeKind::Nvml;
    match backend.engine {
        Engine::LlamaCpp => {
            let model = resolve_model(&config.dir, &plan.model)
                .map_err(|e| DrillError::BadInput(e.to_string()))?;
            let shape = headroom_up::flags::llamacpp_model(Path::new(&model))
                .map_err(|e| DrillError::BadInput(e.to_string()))?;
            let flags =
                headroom_up::flags::llamacpp_flags(&shape, plan, budget, gpu).map_err(|e| {
                    DrillError::BadInput(format!("text share {share}: {}", e.message()))
                })?;
            // A user sizing the engine by hand keeps llama-server's prompt cache (up turns
            // it off): the flags are the context and slots alone.
            Ok((without_prompt_cache_off(flags.args), flags.env))
        }
        Engine::Vllm if gpu => Ok((
            vec!["--gpu-memory-utilization".into(), format!("{share}")],
            Vec::new(),
        )),
        Engine::Vllm => {
            let gib = (budget >> 30).max(1);
            Ok((
                Vec::new(),
                vec![("VLLM_CPU_KVCACHE_SPACE".into(), gib.to_string())],
            ))
        }
        _ => Err(DrillError::BadInput(format!(
            "backend `{}`: a share is turned into llama.cpp or vLLM flags only; give `text.args`",
            backend.name
        ))),
    }
}

/// Environment variables added to an engine's.
pub type Env = Vec<(String, String)>;

/// A death the drill saw: an engine's main process ended.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Exit {
    pub backend: String,
    pub at_s: f64,
    /// `signal 9`, `exit 1`.
    pub how: String,
}

struct Engine1 {
    config: BackendConfig,
    args: Vec<String>,
    env: Vec<(String, String)>,
    pid: Arc<Mutex<Option<u32>>>,
}

/// The running engines.
pub struct HandSetBox {
    pub plan: HandSetPlan,
    limit: Arc<dyn MemoryLimit>,
    pids: BTreeMap<String, Arc<Mutex<Option<u32>>>>,
    roles: BTreeMap<String, Role>,
    upstreams: BTreeMap<String, String>,
    pub exits: Arc<Mutex<Vec<Exit>>>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// What the text engine was started with (for the report).
    pub text_flags: Vec<String>,
}

impl std::fmt::Debug for HandSetBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandSetBox")
            .field("pids", &self.pids)
            .finish()
    }
}

/// `backend` started through `sh`, which first moves itself into the limit, then becomes the
/// engine (same PID, so the group, the death tie and the memory are the engine's).
fn inside(backend: &BackendConfig, procs: &Path, extra: &[String]) -> BackendConfig {
    let mut args = vec![
        "-c".to_string(),
        "echo $$ > \"$0\" && exec \"$@\"".to_string(),
        procs.display().to_string(),
        backend.command.display().to_string(),
    ];
    args.extend(backend.expanded_args());
    args.extend(extra.iter().cloned());
    // `{port}` is filled in already, so spawning expands nothing more.
    BackendConfig {
        command: PathBuf::from("sh"),
        args,
        ..backend.clone()
    }
}

async fn healthy(client: &reqwest::Client, url: &str, within: Duration) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if let Ok(r) = client.get(url).timeout(Duration::from_secs(2)).send().await
            && r.status().is_success()
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    false
}

fn describe_exit(status: Option<std::process::ExitStatus>) -> String {
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exit {c}"),
            (None, Some(sig)) => format!("signal {sig}"),
            _ => "ended".into(),
        },
        None => "ended (status unknown)".into(),
    }
}

impl HandSetBox {
    /// Starts every engine of `config` inside `limit`, waits until each answers its health
    /// route, and keeps restarting those that exit (when the plan says so) until stopped.
    pub async fn start(
        config: &BoxConfig,
        plan: HandSetPlan,
        limit: Arc<dyn MemoryLimit>,
        log_dir: &Path,
        night_start: Instant,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<HandSetBox, DrillError> {
        let client = reqwest::Client::builder()
            .no_proxy()
            .build()
            .map_err(|e| DrillError::Environment(format!("HTTP client: {e}")))?;
        let (stop, stop_rx) = watch::channel(false);
        let exits = Arc::new(Mutex::new(Vec::new()));
        let mut engines = Vec::new();
        let mut text_flags = Vec::new();
        for b in &config.backends {
            if b.audio_vllm.is_some() {
                return Err(DrillError::BadInput(format!(
                    "backend `{}` is an audio vLLM: the box set up by hand does not size one",
                    b.name
                )));
            }
            process::check_command(b, &config.dir)
                .map_err(|e| DrillError::BadInput(e.to_string()))?;
            process::check_port_free(&b.name, b.port)
                .map_err(|e| DrillError::BadInput(e.to_string()))?;
            let (mut args, env) = if b.role == Role::Text {
                let (a, e) = plan.text_flags(config, b)?;
                text_flags = a.clone();
                (a, e)
            } else {
                (Vec::new(), Vec::new())
            };
            if let Some(extra) = plan.extra_args.get(&b.name) {
                args.extend(extra.iter().cloned());
            }
            engines.push(Engine1 {
                config: b.clone(),
                args,
                env,
                pid: Arc::new(Mutex::new(None)),
            });
        }
        let mut tasks = Vec::new();
        let mut pids = BTreeMap::new();
        for e in engines {
            let name = e.config.name.clone();
            progress(&format!(
                "drill: [hand-set] starting {name} on port {} {}",
                e.config.port,
                e.args.join(" ")
            ));
            let group = spawn_inside(&e, limit.as_ref(), config, log_dir)?;
            *e.pid.lock().expect("pid lock") = Some(group.pid);
            let url = format!("{}{}", e.config.upstream(), e.config.health);
            if !healthy(&client, &url, e.config.ready_timeout).await {
                return Err(DrillError::Box(format!(
                    "the hand-set {name} did not answer {url} within {:?}; its log: {}",
                    e.config.ready_timeout,
                    group.log_tail(5).join(" | ")
                )));
            }
            pids.insert(name.clone(), Arc::clone(&e.pid));
            tasks.push(tokio::spawn(keep(
                e,
                group,
                plan.clone(),
                Arc::clone(&limit),
                config.clone(),
                log_dir.to_path_buf(),
                Arc::clone(&exits),
                stop_rx.clone(),
                night_start,
            )));
        }
        Ok(HandSetBox {
            plan,
            limit,
            roles: config
                .backends
                .iter()
                .map(|b| (b.name.clone(), b.role))
                .collect(),
            upstreams: config
                .backends
                .iter()
                .map(|b| (b.name.clone(), b.upstream()))
                .collect(),
            pids,
            exits,
            stop,
            tasks,
            text_flags,
        })
    }

    pub fn upstream(&self, backend: &str) -> Option<&str> {
        self.upstreams.get(backend).map(String::as_str)
    }

    pub fn pid(&self, backend: &str) -> Option<u32> {
        *self.pids.get(backend)?.lock().expect("pid lock")
    }

    pub fn backends(&self) -> Vec<(String, Role, Option<u32>)> {
        self.roles
            .iter()
            .map(|(n, r)| (n.clone(), *r, self.pid(n)))
            .collect()
    }

    pub fn limit(&self) -> &Arc<dyn MemoryLimit> {
        &self.limit
    }

    /// Stops every engine (SIGTERM to its group, its grace, then SIGKILL).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

fn spawn_inside(
    e: &Engine1,
    limit: &dyn MemoryLimit,
    config: &BoxConfig,
    log_dir: &Path,
) -> Result<Group, DrillError> {
    let wrapped = inside(&e.config, &limit.procs_file(), &e.args);
    let log = log_dir.join(format!("{}.log", e.config.name));
    process::spawn(&wrapped, &[], &e.env, &config.dir, &log)
        .map_err(|err| DrillError::Box(format!("the hand-set {}: {err}", e.config.name)))
}

/// Watches one engine: records its exits and restarts it while the box runs.
#[allow(clippy::too_many_arguments)]
async fn keep(
    e: Engine1,
    mut group: Group,
    plan: HandSetPlan,
    limit: Arc<dyn MemoryLimit>,
    config: BoxConfig,
    log_dir: PathBuf,
    exits: Arc<Mutex<Vec<Exit>>>,
    mut stop: watch::Receiver<bool>,
    night_start: Instant,
) {
    loop {
        tokio::select! {
            status = group.wait() => {
                let how = describe_exit(status);
                exits.lock().expect("exits lock").push(Exit {
                    backend: e.config.name.clone(),
                    at_s: night_start.elapsed().as_secs_f64(),
                    how,
                });
                *e.pid.lock().expect("pid lock") = None;
                // What is left of its group goes too, as a service manager would do.
                group.stop(Duration::from_secs(2)).await;
                if !plan.restart {
                    let _ = stop.changed().await;
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(plan.restart_delay) => {}
                    _ = stop.changed() => return,
                }
                match spawn_inside(&e, limit.as_ref(), &config, &log_dir) {
                    Ok(g) => {
                        *e.pid.lock().expect("pid lock") = Some(g.pid);
                        group = g;
                    }
                    Err(_) => {
                        let _ = stop.changed().await;
                        return;
                    }
                }
            }
            _ = stop.changed() => {
                group.stop(e.config.stop_grace).await;
                return;
            }
        }
    }
}

/// `args` without `up`'s `--cache-ram 0`.
fn without_prompt_cache_off(args: Vec<String>) -> Vec<String> {
    let off = headroom_up::flags::PROMPT_CACHE_OFF;
    let mut out = Vec::with_capacity(args.len());
    let mut i = 0;
    while i < args.len() {
        if args[i] == off[0] && args.get(i + 1).map(String::as_str) == Some(off[1]) {
            i += 2;
            continue;
        }
        out.push(args[i].clone());
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hand_set_engine_keeps_llama_server_s_prompt_cache() {
        let args: Vec<String> = ["-c", "12288", "--parallel", "4", "--cache-ram", "0"]
            .map(String::from)
            .to_vec();
        assert_eq!(
            without_prompt_cache_off(args),
            ["-c", "12288", "--parallel", "4"]
                .map(String::from)
                .to_vec()
        );
        // A value the user chose is theirs.
        let chosen: Vec<String> = ["--cache-ram", "512"].map(String::from).to_vec();
        assert_eq!(without_prompt_cache_off(chosen.clone()), chosen);
    }

    #[test]
    fn a_plan_takes_a_share_or_flags_but_not_both() {
        let p = HandSetPlan::parse("[text]\nshare = 0.45\n").unwrap();
        assert_eq!(p.text, TextChoice::Share(0.45));
        assert!(p.restart, "a service manager restarts engines by default");
        let p = HandSetPlan::parse("restart = false\n[text]\nargs = [\"-c\", \"4096\"]\n").unwrap();
        assert_eq!(p.text, TextChoice::Args(vec!["-c".into(), "4096".into()]));
        assert!(!p.restart);
        assert!(HandSetPlan::parse("[text]\nshare = 0.45\nargs = []\n").is_err());
        assert!(HandSetPlan::parse("[text]\nshare = 1.5\n").is_err());
        assert!(HandSetPlan::parse("surprise = 1\n").is_err());
    }

    #[test]
    fn the_example_plan_parses() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/cpu-box.hand-set.toml");
        let p = HandSetPlan::load(&path).unwrap();
        assert_eq!(p.text, TextChoice::Share(0.45));
        assert!(p.restart && !p.rationale.is_empty());
    }

    #[test]
    fn an_engine_is_wrapped_to_join_the_limit_first_and_keep_its_pid() {
        let config = BoxConfig::parse(
            "[memory]\nprobe = \"host\"\ncapacity = \"1GiB\"\n[[backends]]\nname = \"llm\"\nrole = \"text\"\nengine = \"llamacpp\"\ncommand = \"/venv/bin/python\"\nargs = [\"server.py\", \"--port\", \"{port}\"]\nport = 19601\nmodel = \"m.gguf\"\n[serve]\nlisten = \"127.0.0.1:19690\"\n",
            Path::new("/"),
        )
        .unwrap();
        let b = &config.backends[0];
        let w = inside(
            b,
            Path::new("/cg/cgroup.procs"),
            &["-c".into(), "8192".into()],
        );
        assert_eq!(w.command, PathBuf::from("sh"));
        assert_eq!(
            w.expanded_args(),
            vec![
                "-c",
                "echo $$ > \"$0\" && exec \"$@\"",
                "/cg/cgroup.procs",
                "/venv/bin/python",
                "server.py",
                "--port",
                "19601",
                "-c",
                "8192"
            ]
        );
    }
}
