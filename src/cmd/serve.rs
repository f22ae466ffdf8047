//! `headroom serve`: reads the gateway configuration, builds the GPU probe when a lane needs one,
//! and runs `headroom-server` until SIGTERM or Ctrl-C, then drains within the grace period
//! (SIGHUP is ignored, a closed stderr only drops log lines: [`super::signals`]).

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use headroom_gpu::GpuProbe;
use headroom_server::stderr::line;
use headroom_server::{EXAMPLE_CONFIG, Gateway, ServeConfig, ServeSettings};

use super::signals::Signals;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Gateway configuration file (TOML). See --print-example-config.
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "print_example_config"
    )]
    pub config: Option<PathBuf>,
    /// Print a commented example configuration with every key and exit.
    #[arg(long)]
    pub print_example_config: bool,
    /// Listen address, overriding the file's `listen` (port 0 picks a free port).
    #[arg(long, value_name = "HOST:PORT")]
    pub listen: Option<SocketAddr>,
    /// Validate the configuration and exit without serving.
    #[arg(long)]
    pub check: bool,
}

/// The GPU probe for lanes that admit on free GPU memory and for the GPU-memory gauge: NVML,
/// loaded at run time. Without a driver, lanes that need it are refused at start unless they say
/// `gpu_fail_open = true`.
fn gpu_probe() -> Result<Arc<dyn GpuProbe>, String> {
    headroom_gpu::NvmlProbe::new()
        .map(|p| Arc::new(p) as Arc<dyn GpuProbe>)
        .map_err(|e| e.to_string())
}

pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    if args.print_example_config {
        print!("{EXAMPLE_CONFIG}");
        return Ok(ExitCode::SUCCESS);
    }
    let path = args.config.context("--config FILE is required")?;
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read config {}", path.display()))?;
    let mut config =
        ServeSettings::from_toml(&text).with_context(|| format!("config {}", path.display()))?;
    for note in &config.notes {
        line(&format!(
            "headroom: note: config {}: {note}",
            path.display()
        ));
    }
    // Tokenizer paths in the file are relative to the file.
    let base = path.parent().unwrap_or(std::path::Path::new("."));
    for lane in &mut config.lanes {
        if let Some(t) = &lane.tokenizer_path
            && t.is_relative()
        {
            lane.tokenizer_path = Some(base.join(t));
        }
    }
    if let Some(listen) = args.listen {
        if !listen.ip().is_loopback() && config.api_keys.is_empty() {
            anyhow::bail!(
                "listen address {listen} is not loopback, so API keys are required (set api_keys in the config)"
            );
        }
        config.listen = listen;
    }
    // A host pool is built by the gateway itself from `[memory]`; NVML is opened here.
    let host_pool = config.memory.probe == headroom_server::ProbeKind::Host;
    let probe = match gpu_probe() {
        _ if host_pool => None,
        Ok(p) => Some(p),
        Err(reason) => {
            for lane in &config.lanes {
                if let Some(need) = &lane.spec.gpu
                    && !need.fail_open
                {
                    anyhow::bail!(
                        "lane `{}` admits on free GPU memory (gpu_memory_*), but the GPU cannot be read ({reason}); remove those keys or set gpu_fail_open = true",
                        lane.spec.name
                    );
                }
            }
            None
        }
    };
    // Tokenizers are loaded here, so `--check` reads them too.
    let config = ServeConfig::build(config)?;
    if args.check {
        println!(
            "config {} is valid: {} lane(s)",
            path.display(),
            config.lanes.len()
        );
        return Ok(ExitCode::SUCCESS);
    }
    // One worker thread (the default) is a current-thread runtime: the thread that accepts also
    // drives every connection's I/O, timers and tasks, with no work-stealing scheduler between
    // them. Blocking work (tokenizer counts, GPU reads) goes to the blocking pool either way.
    let mut builder = if config.worker_threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(config.worker_threads);
        b
    };
    let runtime = builder
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let signals = {
        let _in_runtime = runtime.enter();
        Signals::install().context("cannot install the signal handlers")?
    };
    runtime.block_on(serve(config, probe, signals))?;
    Ok(ExitCode::SUCCESS)
}

/// Raises the soft open-file limit to the hard one (a gateway holds a socket per client and per
/// upstream connection) and says so when it changed.
pub(crate) fn raise_open_file_limit(who: &str) {
    match headroom_server::listen::slots::raise_open_file_limit() {
        Ok((Some(before), Some(after))) if before != after => {
            eprintln!(
                "headroom {who}: open-file limit raised from {before} to {after} (the hard limit)"
            )
        }
        Ok(_) => {}
        Err(e) => eprintln!("headroom {who}: the open-file limit could not be raised ({e})"),
    }
}

async fn serve(
    config: ServeConfig,
    probe: Option<Arc<dyn GpuProbe>>,
    signals: Signals,
) -> anyhow::Result<()> {
    raise_open_file_limit("serve");
    let addr = config.listen;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    let lanes: Vec<String> = config.lanes.iter().map(|l| l.spec.name.clone()).collect();
    let grace = config.shutdown_grace;
    let gateway = Gateway::from_config(config, probe)?;
    {
        // A closed stdout is no reason not to serve.
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening on {bound}").and_then(|()| out.flush());
    }
    line(&format!(
        "headroom serve: lanes {}; SIGTERM drains for up to {} s",
        lanes.join(", "),
        grace.as_secs()
    ));
    gateway
        .serve(listener, async move {
            signals.stop_requested("headroom serve").await;
            line("headroom serve: shutting down, draining in-flight work");
        })
        .await?;
    line("headroom serve: stopped");
    Ok(())
}
