//! `headroom top`: a live view of GPU memory (per GPU a memory bar, 60 s of history and the
//! processes holding memory) and, with `--gateway`, the lanes of a running `headroom serve`.
//! `--once` prints one snapshot (text or JSON) for scripts; `--replay` plays a sample file back;
//! `--record FILE --duration D` samples into a file without a screen (used by
//! `scripts/device-check.sh`). The screen itself is drawn by `headroom-top`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use headroom_gpu::{
    GpuProbe, NvmlProbe, Sample, Sampler, SamplerConfig, read_samples, sampler::now_ms,
};
use headroom_top::{LanesView, TopState, gpu_rows_needed, render};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};

use super::gateway::Gateway;

/// How often the screen is redrawn.
const FRAME: Duration = Duration::from_millis(100);
/// How often the gateway's lanes are fetched.
const LANES_EVERY: Duration = Duration::from_secs(1);
/// How often the pool of a `headroom up` is read from its `/admin/box` (its backends' figures move
/// every 250 ms; the sampler re-reads the newest answer in between).
const BOX_EVERY: Duration = Duration::from_millis(250);

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnceFormat {
    Text,
    Json,
}

#[derive(Debug, clap::Args)]
pub struct TopArgs {
    /// Print one snapshot and exit (for scripts and non-terminals).
    #[arg(long)]
    pub once: bool,
    /// Output format of --once.
    #[arg(long, value_enum, default_value = "text")]
    pub format: OnceFormat,
    /// Play back a sample file (JSON lines written by the sampler) instead of reading the GPU.
    #[arg(long, value_name = "FILE")]
    pub replay: Option<PathBuf>,
    /// Replay speed factor; 0 shows the whole file at once.
    #[arg(long, default_value_t = 1.0, value_name = "FACTOR")]
    pub speed: f64,
    /// Sampling interval, e.g. 50ms, 20ms, 1s (5ms at the least).
    #[arg(long, default_value = "50ms", value_parser = parse_duration)]
    pub interval: Duration,
    /// Base URL of a running `headroom serve` whose lanes to show (reads /admin/lanes).
    #[arg(long, value_name = "URL")]
    pub gateway: Option<String>,
    /// API key for --gateway (sent as `Authorization: Bearer KEY`; required off loopback).
    #[arg(long, env = "HEADROOM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Append every sample to FILE (sample-file format).
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,
    /// Stop after this long. With --record, samples into the file without a screen.
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
}

pub fn run(args: TopArgs) -> anyhow::Result<ExitCode> {
    if args.interval < headroom_gpu::sampler::MIN_INTERVAL {
        bail!(
            "--interval {:?} is too short; the sampler polls every {:?} at the fastest",
            args.interval,
            headroom_gpu::sampler::MIN_INTERVAL
        );
    }
    if !(args.speed.is_finite() && args.speed >= 0.0) {
        bail!("--speed must be a number >= 0");
    }
    let gateway = args
        .gateway
        .as_deref()
        .map(|url| Gateway::parse(url)?.with_api_key(args.api_key.as_deref()))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    if args.replay.is_some() && args.record.is_some() {
        bail!("--record samples the GPU; it cannot be combined with --replay");
    }
    if args.once {
        return once(&args, gateway.as_ref());
    }
    if let Some(path) = &args.record
        && let Some(duration) = args.duration
    {
        return record_headless(path, args.interval, duration, gateway.as_ref());
    }
    if !std::io::stdout().is_terminal() {
        bail!(
            "top needs a terminal; use --once (optionally --format json), or --record FILE --duration D"
        );
    }
    match &args.replay {
        Some(path) => interactive_replay(path, args.speed, gateway, args.duration),
        None => interactive_live(&args, gateway),
    }
}

/// The memory to show: NVML, or where there is none and `--gateway` names a `headroom up`, the
/// pool it measures (host RAM on a CPU box, read from its `/admin/box`). With it, its source and
/// the names of its devices. Otherwise one line saying why neither can be read.
fn open_probe(gateway: Option<&Gateway>) -> anyhow::Result<Opened> {
    let no_driver = match NvmlProbe::new() {
        Ok(p) => return Ok(opened(Arc::new(p), "nvml")),
        Err(e) => e,
    };
    let Some(gateway) = gateway else {
        return Err(anyhow::Error::new(no_driver)
            .context("cannot read the GPU (use --replay FILE to view a recording)"));
    };
    match gateway.box_pool(BOX_EVERY) {
        Ok(pool) => Ok(opened(Arc::new(pool), "box")),
        Err(e) => bail!(
            "cannot read the GPU ({no_driver}) nor the pool of a headroom up at the gateway ({e}); use --replay FILE to view a recording"
        ),
    }
}

/// A probe, where its readings come from (`nvml`, `box`), and its devices' names.
struct Opened {
    probe: Arc<dyn GpuProbe>,
    source: &'static str,
    names: std::collections::BTreeMap<u32, String>,
}

fn opened(probe: Arc<dyn GpuProbe>, source: &'static str) -> Opened {
    let names = probe
        .snapshot()
        .map(|devices| devices.into_iter().map(|d| (d.index, d.name)).collect())
        .unwrap_or_default();
    Opened {
        probe,
        source,
        names,
    }
}

fn once(args: &TopArgs, gateway: Option<&Gateway>) -> anyhow::Result<ExitCode> {
    let mut state = match &args.replay {
        Some(path) => {
            let samples = read_samples(path)?;
            let mut state = TopState::new(format!("replay {}", path.display()));
            samples.iter().for_each(|s| state.push(s));
            state
        }
        None => {
            let Opened { probe, source, .. } = open_probe(gateway)?;
            let devices = probe.snapshot().context("cannot read the memory")?;
            let ts = now_ms();
            let mut state = TopState::new(source);
            for device in &devices {
                let mut sample = Sample::from_device(ts, device);
                sample.name = Some(device.name.clone());
                state.push(&sample);
            }
            state
        }
    };
    if let Some(gateway) = gateway {
        // A gateway that was asked for and does not answer is an unusable environment.
        state.lanes = LanesView::Loaded(gateway.fetch_lanes().map_err(anyhow::Error::msg)?);
    }
    match args.format {
        OnceFormat::Json => println!("{}", serde_json::to_string_pretty(&state.to_json())?),
        OnceFormat::Text => print!("{}", render_text(&state)?),
    }
    Ok(ExitCode::SUCCESS)
}

/// The screen drawn into an off-screen buffer, as plain text lines.
fn render_text(state: &TopState) -> anyhow::Result<String> {
    let width = 100u16;
    let gpu_rows: usize = state
        .gpus
        .values()
        .map(|g| gpu_rows_needed(g) as usize)
        .sum();
    let lane_rows = match &state.lanes {
        LanesView::Off => 0,
        LanesView::Loaded(lanes) => lanes.len().max(1) + 3,
        LanesView::Failed(_) => 3,
    };
    let height = (1 + gpu_rows.max(3) + lane_rows + 1).min(u16::MAX as usize) as u16;
    let mut terminal = Terminal::new(TestBackend::new(width, height))?;
    terminal.draw(|frame| draw(frame, state))?;
    let buffer = terminal.backend().buffer();
    let mut out = String::new();
    for row in buffer.content().chunks(width as usize) {
        let line: String = row.iter().map(|c| c.symbol()).collect();
        out.push_str(line.trim_end());
        out.push('\n');
    }
    Ok(format!("{}\n", out.trim_end_matches('\n')))
}

/// Draws the screen; with `--color never` or `NO_COLOR` every cell keeps its text and loses its
/// colour (bold and other modifiers stay: they are not colour).
fn draw(frame: &mut ratatui::Frame, state: &TopState) {
    render(frame, state);
    if !super::color_enabled() {
        for cell in frame.buffer_mut().content.iter_mut() {
            cell.fg = ratatui::style::Color::Reset;
            cell.bg = ratatui::style::Color::Reset;
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .thread_name("headroom-sampler")
        .build()
        .context("cannot start the sampler runtime")
}

fn record_headless(
    path: &Path,
    interval: Duration,
    duration: Duration,
    gateway: Option<&Gateway>,
) -> anyhow::Result<ExitCode> {
    let probe = open_probe(gateway)?.probe;
    let rt = runtime()?;
    let config = SamplerConfig::new(interval).with_file(path.to_path_buf());
    let run = rt.block_on(async {
        let sampler = Sampler::start(probe, config)?;
        tokio::time::sleep(duration).await;
        sampler.stop().await
    })?;
    let stats = run.stats;
    let wanted = duration.as_secs_f64() / interval.as_secs_f64() + 1.0;
    eprintln!(
        "recorded {} samples in {} ticks to {} ({:.0}% of the requested rate, {} missed ticks, {} probe errors{})",
        stats.samples,
        stats.ticks,
        path.display(),
        100.0 * stats.ticks as f64 / wanted,
        stats.missed_ticks,
        stats.probe_errors,
        stats
            .last_probe_error
            .map(|e| format!(", last: {e}"))
            .unwrap_or_default()
    );
    Ok(ExitCode::SUCCESS)
}

/// Fetches lanes on a thread of its own so a slow gateway never stalls the screen.
fn spawn_lanes_fetcher(
    gateway: Gateway,
) -> mpsc::Receiver<Result<Vec<headroom_top::Lane>, String>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        loop {
            if tx.send(gateway.fetch_lanes()).is_err() {
                break;
            }
            std::thread::sleep(LANES_EVERY);
        }
    });
    rx
}

enum Control {
    Quit,
    Continue,
}

/// Waits up to `timeout` for a key; q, Esc and Ctrl-C quit, s cycles the sort order.
fn handle_keys(state: &mut TopState, timeout: Duration) -> anyhow::Result<Control> {
    if event::poll(timeout)?
        && let Event::Key(key) = event::read()?
        && key.kind == KeyEventKind::Press
    {
        match key.code {
            KeyCode::Char('q') | KeyCode::Esc => return Ok(Control::Quit),
            KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => {
                return Ok(Control::Quit);
            }
            KeyCode::Char('s') => state.cycle_sort(),
            _ => {}
        }
    }
    Ok(Control::Continue)
}

/// Live view. Without a driver it still runs when there are gateway lanes to show, with the
/// reason on the status line; with nothing to show it exits with the reason.
fn interactive_live(args: &TopArgs, gateway: Option<Gateway>) -> anyhow::Result<ExitCode> {
    let probe = match open_probe(gateway.as_ref()) {
        Ok(opened) => Ok(opened),
        Err(err) if gateway.is_some() && args.record.is_none() => Err(format!("{err:#}")),
        Err(err) => return Err(err),
    };
    let rt = runtime()?;
    let mut state = TopState::new(match &probe {
        Ok(opened) => format!("{} every {:?}", opened.source, args.interval),
        Err(_) => "no memory probe".to_string(),
    });
    let sampler = match probe {
        Ok(Opened { probe, names, .. }) => {
            state.names = names;
            let mut config = SamplerConfig::new(args.interval);
            if let Some(path) = &args.record {
                config = config.with_file(path.clone());
            }
            let _guard = rt.enter();
            Ok(Sampler::start(probe, config)?)
        }
        Err(reason) => Err(reason),
    };
    let lanes = gateway.map(spawn_lanes_fetcher);
    let started = Instant::now();
    let mut terminal = ratatui::try_init().context("cannot open the terminal")?;
    let mut seen_ms = 0u64;
    let outcome = (|| -> anyhow::Result<()> {
        loop {
            match &sampler {
                Ok(sampler) => {
                    for sample in sampler.since(seen_ms + 1) {
                        seen_ms = seen_ms.max(sample.ts_ms);
                        state.push(&sample);
                    }
                    state.status = sampler
                        .stats()
                        .last_probe_error
                        .map(|e| format!("probe: {e}"));
                }
                Err(reason) => state.status = Some(reason.clone()),
            }
            if let Some(rx) = &lanes {
                while let Ok(result) = rx.try_recv() {
                    state.lanes = match result {
                        Ok(lanes) => LanesView::Loaded(lanes),
                        Err(e) => LanesView::Failed(e),
                    };
                }
            }
            terminal.draw(|frame| draw(frame, &state))?;
            if args.duration.is_some_and(|d| started.elapsed() >= d) {
                return Ok(());
            }
            if let Control::Quit = handle_keys(&mut state, FRAME)? {
                return Ok(());
            }
        }
    })();
    ratatui::restore();
    if let Ok(sampler) = sampler {
        rt.block_on(sampler.stop())?;
    }
    outcome?;
    Ok(ExitCode::SUCCESS)
}

fn interactive_replay(
    path: &Path,
    speed: f64,
    gateway: Option<Gateway>,
    duration: Option<Duration>,
) -> anyhow::Result<ExitCode> {
    let samples = read_samples(path)?;
    let lanes = gateway.map(spawn_lanes_fetcher);
    let mut state = TopState::new(format!("replay {} ×{speed}", path.display()));
    let first_ms = samples.first().map(|s| s.ts_ms).unwrap_or(0);
    let started = Instant::now();
    let mut next = 0usize;
    let mut terminal = ratatui::try_init().context("cannot open the terminal")?;
    let outcome = (|| -> anyhow::Result<()> {
        loop {
            let reached_ms = if speed == 0.0 {
                u64::MAX
            } else {
                first_ms.saturating_add((started.elapsed().as_secs_f64() * 1000.0 * speed) as u64)
            };
            while next < samples.len() && samples[next].ts_ms <= reached_ms {
                state.push(&samples[next]);
                next += 1;
            }
            if next == samples.len() {
                state.status = Some(format!("end of replay: {} samples", samples.len()));
            }
            if let Some(rx) = &lanes {
                while let Ok(result) = rx.try_recv() {
                    state.lanes = match result {
                        Ok(lanes) => LanesView::Loaded(lanes),
                        Err(e) => LanesView::Failed(e),
                    };
                }
            }
            terminal.draw(|frame| draw(frame, &state))?;
            if duration.is_some_and(|d| started.elapsed() >= d) {
                return Ok(());
            }
            if let Control::Quit = handle_keys(&mut state, FRAME)? {
                return Ok(());
            }
        }
    })();
    ratatui::restore();
    outcome?;
    Ok(ExitCode::SUCCESS)
}

/// `20ms`, `1.5s`, `2m`, or a bare number of milliseconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    match headroom_plan::units::parse_duration(text, headroom_plan::units::BareNumber::Milliseconds)
    {
        Some(d) if !d.is_zero() && d <= Duration::from_secs(7 * 86_400) => Ok(d),
        Some(_) => Err(format!("'{}' is out of range", text.trim())),
        None => Err(format!(
            "'{}' is not a duration (e.g. 50ms, 2s, 1m; units ms, s, m, h)",
            text.trim()
        )),
    }
}
