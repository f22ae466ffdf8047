//! `headroom bench`: flags → a validated load and workload → `headroom_bench::bench` → report on
//! stdout (table or JSON) and in files (JSON, Markdown, SVG). Also holds the flags and plumbing
//! `headroom soak` shares: workload flags, progress display, Ctrl-C, the GPU probe.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use headroom_bench::workload::{self, SpecOverrides};
use headroom_bench::{BenchConfig, Load, Progress, ReportMeta, RequestKind, RunConfig, Slo};
use headroom_gpu::GpuProbe;
use tokio::sync::watch;

/// Exit code of a run stopped by Ctrl-C (after its partial report was written).
pub const EXIT_INTERRUPTED: u8 = 130;

/// Output format on stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

/// Workload and load flags shared by `bench` and `soak`.
#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// Base URL of an OpenAI-compatible server (with or without /v1).
    #[arg(long)]
    pub url: String,
    /// Model name sent in requests (default: the first model /v1/models lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Bearer token for the server.
    #[arg(long, env = "HEADROOM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Closed loop: this many requests in flight, each sent when the previous one ends.
    #[arg(long, conflicts_with = "rate")]
    pub concurrency: Option<u32>,
    /// Open loop: this many requests per second, whatever the server's latency.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Open-loop gap shape: 1 = Poisson, below 1 burstier, above 1 smoother (gamma).
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Requests to send (after warm-up). Default 100 when --duration is not given.
    #[arg(long)]
    pub requests: Option<u64>,
    /// Run length: 30, 30s, 500ms, 2m, 1h.
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Requests sent first and left out of the figures.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Output tokens asked for per request.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Length of generated prompts, in tokens (about one word each).
    #[arg(long, default_value_t = 128)]
    pub input_tokens: u32,
    /// Prompts from a JSONL file (strings, or objects with prompt/text/messages).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Request kind without a scenario: chat, completions, transcription, speech.
    #[arg(long, default_value = "chat")]
    pub kind: String,
    /// Ask for whole answers instead of streams.
    #[arg(long)]
    pub no_stream: bool,
    /// Folder of audio files for transcription requests.
    #[arg(long)]
    pub audio_dir: Option<PathBuf>,
    /// Voice for speech requests.
    #[arg(long, default_value = "alloy")]
    pub voice: String,
    /// TOML scenario file with [[request]] entries (mixed kinds, own loads).
    #[arg(long)]
    pub scenario: Option<PathBuf>,
    /// Per-request time limit.
    #[arg(long, value_parser = parse_duration, default_value = "300s")]
    pub timeout: Duration,
    /// Goodput bounds, e.g. ttft=500,e2e=3s,tpot=50.
    #[arg(long)]
    pub slo: Option<String>,
    /// GPU sampling interval in milliseconds.
    #[arg(long, default_value_t = 50)]
    pub gpu_interval_ms: u64,
    /// Do not sample the GPU.
    #[arg(long)]
    pub no_gpu: bool,
    /// Append GPU samples to this JSON-lines file.
    #[arg(long)]
    pub samples: Option<PathBuf>,
    /// Seed of the open-loop arrival times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub load: LoadArgs,
    /// Rate sweep: offered rates like 1,2,4,8 or `auto`; each step runs --duration or --requests.
    #[arg(long)]
    pub sweep: Option<String>,
    /// Write the JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Write the Markdown summary here.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Write SVG charts (latency-cdf.svg, gpu-memory.svg) into this folder.
    #[arg(long)]
    pub charts: Option<PathBuf>,
    /// What to print on stdout: a table, or the JSON report.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// `30`, `30s`, `500ms`, `2m`, `1h`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    match headroom_plan::units::parse_duration(text, headroom_plan::units::BareNumber::Seconds) {
        Some(d) if !d.is_zero() => Ok(d),
        Some(_) => Err(format!("`{text}` must be positive")),
        None => Err(format!(
            "`{text}` is not a duration (e.g. 30s, 500ms, 2m; units ms, s, m, h)"
        )),
    }
}

/// Everything the load flags turn into.
pub struct Prepared {
    pub run: RunConfig,
    pub meta: ReportMeta,
    pub client: headroom_bench::reqwest::Client,
}

/// Validates the load flags, reads the scenario, checks the target answers and accepts the key.
pub async fn prepare(args: &LoadArgs) -> anyhow::Result<Prepared> {
    let load = match (args.concurrency, args.rate) {
        (_, Some(rate)) => Load::Open {
            rate,
            burstiness: args.burstiness,
        },
        (Some(concurrency), None) => Load::Closed { concurrency },
        (None, None) => Load::Closed { concurrency: 1 },
    };
    load.validate()?;
    if args.requests == Some(0) {
        bail!("--requests must be at least 1");
    }
    let requests = match (args.requests, args.duration) {
        (None, None) => Some(100),
        (r, _) => r,
    };
    if args.gpu_interval_ms < 5 {
        bail!("--gpu-interval-ms must be at least 5");
    }
    let slo = args.slo.as_deref().map(Slo::parse).transpose()?;
    let defaults = workload::SpecDefaults {
        url: args.url.clone(),
        model: args.model.clone().unwrap_or_default(),
        api_key: args.api_key.clone(),
        max_tokens: args.max_tokens,
        input_tokens: args.input_tokens,
        prompts_file: args.prompts.clone(),
        audio_dir: args.audio_dir.clone(),
        voice: args.voice.clone(),
        stream: !args.no_stream,
    };
    let scenario = match &args.scenario {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read scenario {}", path.display()))?;
            let base = path.parent().unwrap_or(Path::new("."));
            workload::parse_scenario(&text, &path.display().to_string(), base, &defaults)?
        }
        None => {
            let kind = RequestKind::parse(&args.kind)?;
            workload::Scenario {
                name: kind.as_str().to_string(),
                specs: vec![workload::build_spec(
                    kind,
                    SpecOverrides::default(),
                    &defaults,
                )?],
            }
        }
    };
    let client = headroom_bench::http_client()?;
    let mut specs = scenario.specs;
    let models = headroom_bench::preflight(&client, &specs).await?;
    if specs.iter().any(|s| s.model.is_empty()) {
        let Some(first) = models.first() else {
            bail!("{} lists no models; pass --model", args.url);
        };
        for s in specs.iter_mut().filter(|s| s.model.is_empty()) {
            s.model = first.clone();
        }
    }
    let model = specs[0].model.clone();
    let meta = ReportMeta {
        scenario: scenario.name,
        url: args.url.clone(),
        model,
        load: headroom_bench::report::load_report(
            load,
            &specs,
            requests,
            args.duration,
            args.warmup,
        ),
        slo,
    };
    let run = RunConfig {
        specs,
        load,
        requests,
        duration: args.duration,
        warmup: args.warmup,
        timeout: args.timeout,
        seed: args.seed,
    };
    Ok(Prepared { run, meta, client })
}

/// How often the pool of a `headroom up` is read from its `/admin/box`.
const BOX_EVERY: Duration = Duration::from_millis(250);

/// The memory to sample: NVML; where there is none, the pool of the `headroom up` at `--url`
/// (its `/admin/box`, with `--api-key`: host RAM on a CPU box); or why neither can be read.
pub fn gpu_probe(load: &LoadArgs) -> Result<Arc<dyn GpuProbe>, String> {
    if load.no_gpu {
        return Err("GPU sampling turned off with --no-gpu".into());
    }
    let no_driver = match headroom_gpu::NvmlProbe::new() {
        Ok(p) => return Ok(Arc::new(p)),
        Err(e) => e.to_string(),
    };
    let base = load.url.trim_end_matches('/');
    let base = base.strip_suffix("/v1").unwrap_or(base);
    super::gateway::Gateway::parse_flag("--url", base)
        .and_then(|g| g.with_api_key(load.api_key.as_deref()))
        .and_then(|g| g.box_pool(BOX_EVERY))
        .map(|pool| Arc::new(pool) as Arc<dyn GpuProbe>)
        .map_err(|e| format!("{no_driver}; and no headroom up pool at --url: {e}"))
}

/// A channel that turns `true` on Ctrl-C.
pub fn ctrl_c_channel() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\nheadroom: interrupted; writing the partial report");
            let _ = tx.send(true);
        }
    });
    rx
}

/// Prints progress to stderr until `done` turns true: a bar redrawn in place on a terminal,
/// a plain line every few seconds otherwise.
pub fn spawn_progress(
    progress: Arc<Progress>,
    duration: Option<Duration>,
    mut done: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let tty = std::io::stderr().is_terminal();
    tokio::spawn(async move {
        let start = Instant::now();
        let every = if tty {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(5)
        };
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = done.wait_for(|d| *d) => break,
            }
            let p = &progress;
            let sent = p.sent.load(Ordering::Relaxed);
            let ok = p.ok.load(Ordering::Relaxed);
            let failed = p.failed.load(Ordering::Relaxed);
            let inflight = p.in_flight.load(Ordering::Relaxed);
            let planned = p.planned.load(Ordering::Relaxed);
            let elapsed = start.elapsed().as_secs_f64();
            let fraction = if planned > 0 {
                (ok + failed) as f64 / planned as f64
            } else if let Some(d) = duration {
                elapsed / d.as_secs_f64()
            } else {
                0.0
            }
            .clamp(0.0, 1.0);
            if tty {
                let filled = (fraction * 30.0) as usize;
                eprint!(
                    "\r[{}{}] {:>3.0}%  sent {sent}  ok {ok}  failed {failed}  in flight {inflight}  {elapsed:.1}s ",
                    "#".repeat(filled),
                    " ".repeat(30 - filled),
                    fraction * 100.0
                );
            } else {
                eprintln!(
                    "progress: {elapsed:.1}s sent {sent} ok {ok} failed {failed} in flight {inflight}"
                );
            }
        }
        if tty {
            eprintln!();
        }
    })
}

/// Builds a multi-thread runtime for a subcommand.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let sweep = args
        .sweep
        .as_deref()
        .map(headroom_bench::parse_sweep)
        .transpose()?;
    if sweep.is_some() && args.load.duration.is_none() && args.load.requests.is_none() {
        bail!("--sweep needs --duration or --requests for each step");
    }
    let rt = runtime()?;
    rt.block_on(async move {
        let mut prepared = prepare(&args.load).await?;
        if sweep.is_some() {
            prepared.meta.load.mode = "sweep".into();
        }
        let cancel = ctrl_c_channel();
        let progress = Arc::new(Progress::default());
        let (done_tx, done_rx) = watch::channel(false);
        let bar = spawn_progress(Arc::clone(&progress), args.load.duration, done_rx);
        let config = BenchConfig {
            run: prepared.run,
            meta: prepared.meta,
            gpu_interval: Duration::from_millis(args.load.gpu_interval_ms),
            sample_file: args.load.samples.clone(),
            sweep,
        };
        let report = headroom_bench::bench(
            prepared.client,
            config,
            gpu_probe(&args.load),
            progress,
            cancel,
        )
        .await;
        let _ = done_tx.send(true);
        let _ = bar.await;
        let report = report?;
        write_outputs(&args, &report)?;
        match args.format {
            Format::Table => print!("{}", headroom_bench::report::table(&report)),
            Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        }
        Ok(if report.interrupted {
            ExitCode::from(EXIT_INTERRUPTED)
        } else {
            ExitCode::SUCCESS
        })
    })
}

fn write_outputs(args: &BenchArgs, report: &headroom_bench::Report) -> anyhow::Result<()> {
    if let Some(path) = &args.report {
        std::fs::write(path, serde_json::to_string_pretty(report)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.markdown {
        std::fs::write(path, headroom_bench::report::markdown(report))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(dir) = &args.charts {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        for (name, svg) in [
            ("latency-cdf.svg", headroom_bench::svg::latency_cdf(report)),
            (
                "gpu-memory.svg",
                headroom_bench::svg::gpu_memory_timeline(report),
            ),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, svg)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("-3s").is_err());
        assert!(parse_duration("3d").is_err());
    }
}
