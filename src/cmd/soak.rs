//! `headroom soak`: the bench workload repeated in rounds with quiet gaps, the per-round idle
//! floor, throughput and queue depth, and the leak verdict (this run and, with `--history`,
//! across runs).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use headroom_bench::soak::{FloorSource, SoakConfig};

use super::bench::{
    EXIT_INTERRUPTED, Format, LoadArgs, ctrl_c_channel, gpu_probe, parse_duration, prepare, runtime,
};

#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    #[command(flatten)]
    pub load: LoadArgs,
    /// Rounds of the same workload.
    #[arg(long, default_value_t = 10)]
    pub rounds: u32,
    /// Quiet gap after each round, where the idle memory floor is taken.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub gap: Duration,
    /// Take the floor from this process's GPU memory instead of the whole device.
    #[arg(long)]
    pub pid: Option<u32>,
    /// Leading rounds left out of the verdict (allocator warm-up).
    #[arg(long, default_value_t = 0)]
    pub warmup_rounds: usize,
    /// Prometheus endpoint polled during rounds for the server's queue depth (a headroom serve
    /// gateway's /metrics, or a vLLM engine's). Sent --api-key / HEADROOM_API_KEY too.
    #[arg(long)]
    pub metrics_url: Option<String>,
    /// SQLite file keeping rounds across invocations.
    #[arg(long)]
    pub history: Option<PathBuf>,
    /// Write the JSON soak report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// What to print on stdout: a table, or the JSON report.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

pub fn run(args: SoakArgs) -> anyhow::Result<ExitCode> {
    let rt = runtime()?;
    rt.block_on(async move {
        let prepared = prepare(&args.load).await?;
        let leak = headroom_gpu::LeakConfig {
            warmup_rounds: args.warmup_rounds,
            ..Default::default()
        };
        let config = SoakConfig {
            run: prepared.run,
            scenario: prepared.meta.scenario,
            url: args.load.url.clone(),
            rounds: args.rounds,
            gap: args.gap,
            gpu_interval: Duration::from_millis(args.load.gpu_interval_ms),
            floor: args.pid.map_or(FloorSource::Device, FloorSource::Process),
            leak,
            history: args.history.clone(),
            sample_file: args.load.samples.clone(),
            metrics_url: args.metrics_url.clone(),
            metrics_api_key: args.load.api_key.clone(),
        };
        let cancel = ctrl_c_channel();
        let total = args.rounds;
        let report = headroom_bench::soak::soak(
            prepared.client,
            config,
            gpu_probe(&args.load),
            cancel,
            |r| {
                eprintln!(
                    "round {}/{}: {} sent, {:.2} ok req/s, queue {}, floor {}",
                    r.round + 1,
                    total,
                    r.requests_sent,
                    r.request_throughput_rps,
                    r.max_in_flight,
                    r.idle_floor_bytes
                        .map(|b| format!("{:.1} MiB", b as f64 / 1048576.0))
                        .unwrap_or_else(|| "–".into())
                )
            },
        )
        .await?;
        if let Some(path) = &args.report {
            std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        match args.format {
            Format::Table => print!("{}", headroom_bench::soak::table(&report)),
            Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        }
        Ok(if report.interrupted {
            ExitCode::from(EXIT_INTERRUPTED)
        } else {
            ExitCode::SUCCESS
        })
    })
}
