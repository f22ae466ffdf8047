//! The report: what a run measured, as a JSON document (schema in `report.schema.json`, field
//! names are a stable contract) and as a Markdown summary. Latency figures come from requests
//! whose outcome is `ok`; failures are counted in `outcomes` and never pollute the percentiles.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::client::{Outcome, RequestRecord};
use crate::gpumem::GpuReport;
use crate::runner::RunOutcome;
use crate::stats::{LatencyHistogram, LatencySummary};
use crate::workload::{Load, RequestSpec};

/// The JSON Schema every report validates against.
pub const REPORT_SCHEMA: &str = include_str!("../report.schema.json");

/// Version of the report layout; bumped only for incompatible changes.
pub const SCHEMA_VERSION: u32 = 1;

/// Timeline entries kept in a report.
const MAX_TIMELINE: usize = 5000;
/// CDF points kept per kind.
const MAX_CDF_POINTS: usize = 200;

/// The metric definitions, printed in every report.
pub fn definitions() -> BTreeMap<String, String> {
    [
        ("ttft_ms", "time to first token: request sent -> first streamed event with non-empty content (content, reasoning_content, reasoning or completions text); role-only chunks do not count"),
        ("first_byte_ms", "time to first byte: request sent -> first byte of the response body"),
        ("first_chunk_ms", "time to first chunk: request sent -> first streamed event carrying choices, even an empty or role-only one (what vLLM's bench calls TTFT)"),
        ("itl_ms", "inter-token latency: every gap between two consecutive content-bearing streamed events, over all ok requests"),
        ("tpot_ms", "time per output token: (e2e - ttft) / (output tokens - 1), one value per ok request with at least 2 output tokens"),
        ("e2e_ms", "end-to-end latency: request sent -> end of the response body"),
        ("output_tokens", "usage.completion_tokens when the server reports it, else one per content-bearing event"),
        ("request_throughput_rps", "ok requests / duration_s"),
        ("output_token_throughput_tps", "output tokens of ok requests / duration_s"),
        ("goodput_rps", "ok requests meeting every --slo bound / duration_s"),
        ("rtfx", "seconds of audio transcribed by ok requests / duration_s"),
        ("stale_connection_retries", "requests sent again on a fresh connection because the server had closed the pooled keep-alive connection before the request reached it; each is counted once, by its final outcome"),
        ("outcomes", "ok = 2xx with a well-formed body; http_429/http_503/http_504 by status; other_error = any other status, transport error, timeout or malformed body"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// Counts per outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcomes {
    pub ok: u64,
    pub http_429: u64,
    pub http_503: u64,
    pub http_504: u64,
    pub other_error: u64,
}

impl Outcomes {
    pub fn add(&mut self, o: Outcome) {
        match o {
            Outcome::Ok => self.ok += 1,
            Outcome::Http429 => self.http_429 += 1,
            Outcome::Http503 => self.http_503 += 1,
            Outcome::Http504 => self.http_504 += 1,
            Outcome::OtherError => self.other_error += 1,
        }
    }

    pub fn total(&self) -> u64 {
        self.ok + self.http_429 + self.http_503 + self.http_504 + self.other_error
    }
}

/// Service-level bounds for goodput, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
}

impl Slo {
    /// Parses `ttft=500,e2e=3000,tpot=50` (milliseconds; `ms`/`s` suffixes allowed).
    pub fn parse(text: &str) -> Result<Slo, crate::BenchError> {
        let mut slo = Slo::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part.split_once('=').ok_or_else(|| {
                crate::BenchError::BadInput(format!("--slo: `{part}` is not key=value"))
            })?;
            let ms = parse_ms(value.trim()).ok_or_else(|| {
                crate::BenchError::BadInput(format!("--slo: `{value}` is not a duration"))
            })?;
            match key.trim() {
                "ttft" => slo.ttft_ms = Some(ms),
                "tpot" => slo.tpot_ms = Some(ms),
                "e2e" | "e2el" => slo.e2e_ms = Some(ms),
                other => {
                    return Err(crate::BenchError::BadInput(format!(
                        "--slo: unknown bound `{other}` (ttft, tpot, e2e)"
                    )));
                }
            }
        }
        Ok(slo)
    }

    fn met_by(&self, r: &RequestRecord) -> bool {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let ok_ttft = self
            .ttft_ms
            .is_none_or(|b| r.ttft.or(r.first_byte).is_some_and(|t| ms(t) <= b));
        let ok_tpot = self
            .tpot_ms
            .is_none_or(|b| r.tpot().is_none_or(|t| ms(t) <= b));
        let ok_e2e = self.e2e_ms.is_none_or(|b| ms(r.e2e) <= b);
        ok_ttft && ok_tpot && ok_e2e
    }
}

fn parse_ms(text: &str) -> Option<f64> {
    let (num, factor) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1000.0)
    } else {
        (text, 1.0)
    };
    let v: f64 = num.trim().parse().ok()?;
    (v.is_finite() && v > 0.0).then_some(v * factor)
}

/// The run's load, as configured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// `closed`, `open`, `mixed` or `sweep`.
    pub mode: String,
    pub concurrency: Option<u32>,
    pub rate: Option<f64>,
    pub burstiness: Option<f64>,
    pub requests: Option<u64>,
    pub duration_s: Option<f64>,
    pub warmup_requests: u64,
}

/// Figures of one request kind (scenario entry).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KindReport {
    pub name: String,
    pub kind: String,
    pub stream: bool,
    pub requests: u64,
    pub outcomes: Outcomes,
    pub ttft_ms: LatencySummary,
    pub itl_ms: LatencySummary,
    pub e2e_ms: LatencySummary,
    pub output_tokens: u64,
    pub rtfx: Option<f64>,
    /// Empirical CDF of e2e latency: `[ms, fraction]` points.
    pub e2e_cdf: Vec<[f64; 2]>,
    /// Empirical CDF of TTFT (streamed kinds only).
    pub ttft_cdf: Vec<[f64; 2]>,
}

/// How often one error message was seen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorCount {
    pub message: String,
    pub count: u64,
}

/// One request on the timeline chart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelineEntry {
    pub name: String,
    pub start_ms: f64,
    pub end_ms: f64,
    pub outcome: String,
}

/// One step of a rate sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepStep {
    pub rate: f64,
    pub requests_sent: u64,
    pub duration_s: f64,
    pub request_throughput_rps: f64,
    pub outcomes: Outcomes,
    pub ttft_p50_ms: Option<f64>,
    pub e2e_p50_ms: Option<f64>,
    pub e2e_p99_ms: Option<f64>,
    pub saturated: bool,
}

/// A rate sweep: its steps and the saturation point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepReport {
    pub steps: Vec<SweepStep>,
    /// The highest offered rate the server kept up with (ok throughput ≥ 80 % of offered, at most
    /// 5 % failures); `None` when even the first step was saturated.
    pub saturation_rps: Option<f64>,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub schema_version: u32,
    pub tool: String,
    pub scenario: String,
    pub url: String,
    pub model: String,
    pub started_at_ms: u64,
    pub interrupted: bool,
    pub load: LoadReport,
    pub definitions: BTreeMap<String, String>,
    pub requests_sent: u64,
    pub requests_completed: u64,
    pub duration_s: f64,
    pub outcomes: Outcomes,
    pub request_throughput_rps: f64,
    pub output_token_throughput_tps: f64,
    pub max_in_flight: u64,
    pub slo: Option<Slo>,
    pub goodput_rps: Option<f64>,
    pub rtfx: Option<f64>,
    pub ttft_ms: LatencySummary,
    pub first_byte_ms: LatencySummary,
    pub first_chunk_ms: LatencySummary,
    pub itl_ms: LatencySummary,
    pub tpot_ms: LatencySummary,
    pub e2e_ms: LatencySummary,
    pub by_kind: Vec<KindReport>,
    pub errors: Vec<ErrorCount>,
    /// Requests sent again on a fresh connection because the pooled one had been closed by the
    /// server before the request reached it (not errors: each was answered once).
    pub stale_connection_retries: u64,
    pub gpu: GpuReport,
    pub timeline: Vec<TimelineEntry>,
    pub sweep: Option<SweepReport>,
}

/// What the report needs to know besides the records.
#[derive(Debug, Clone)]
pub struct ReportMeta {
    pub scenario: String,
    pub url: String,
    pub model: String,
    pub load: LoadReport,
    pub slo: Option<Slo>,
}

#[derive(Default)]
struct Hists {
    ttft: LatencyHistogram,
    first_byte: LatencyHistogram,
    first_chunk: LatencyHistogram,
    itl: LatencyHistogram,
    tpot: LatencyHistogram,
    e2e: LatencyHistogram,
}

impl Hists {
    fn add(&mut self, r: &RequestRecord) {
        if let Some(t) = r.ttft {
            self.ttft.record(t);
        }
        if let Some(t) = r.first_byte {
            self.first_byte.record(t);
        }
        if let Some(t) = r.first_chunk {
            self.first_chunk.record(t);
        }
        for &g in &r.itl {
            self.itl.record(g);
        }
        if let Some(t) = r.tpot() {
            self.tpot.record(t);
        }
        self.e2e.record(r.e2e);
    }
}

fn thin_cdf(cdf: Vec<(f64, f64)>) -> Vec<[f64; 2]> {
    let step = cdf.len().div_ceil(MAX_CDF_POINTS).max(1);
    let last = cdf.last().copied();
    let mut out: Vec<[f64; 2]> = cdf.iter().step_by(step).map(|&(v, f)| [v, f]).collect();
    if let Some((v, f)) = last
        && out.last() != Some(&[v, f])
    {
        out.push([v, f]);
    }
    out
}

/// Builds the report of a run.
pub fn build(
    meta: &ReportMeta,
    specs: &[RequestSpec],
    run: &RunOutcome,
    gpu: GpuReport,
    sweep: Option<SweepReport>,
) -> Report {
    let mut all = Hists::default();
    let mut kinds: Vec<(Hists, Outcomes, u64, f64)> = specs
        .iter()
        .map(|_| (Hists::default(), Outcomes::default(), 0, 0.0))
        .collect();
    let mut outcomes = Outcomes::default();
    let mut output_tokens = 0u64;
    let mut good = 0u64;
    let mut audio_seconds = 0.0;
    let mut any_audio = false;
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for r in &run.records {
        outcomes.add(r.outcome);
        let k = &mut kinds[r.spec.min(specs.len().saturating_sub(1))];
        k.1.add(r.outcome);
        if r.outcome != Outcome::Ok {
            let message = r.error.clone().unwrap_or_else(|| r.outcome.as_str().into());
            *errors.entry(message).or_default() += 1;
            continue;
        }
        all.add(r);
        k.0.add(r);
        let tokens = r.output_tokens.unwrap_or(0);
        output_tokens += tokens;
        k.2 += tokens;
        if let Some(a) = r.audio_seconds {
            audio_seconds += a;
            k.3 += a;
            any_audio = true;
        }
        if meta.slo.as_ref().is_some_and(|s| s.met_by(r)) {
            good += 1;
        }
    }
    let secs = run.duration.as_secs_f64().max(1e-9);
    let by_kind = specs
        .iter()
        .zip(kinds)
        .map(|(spec, (h, o, tokens, audio))| KindReport {
            name: spec.name.clone(),
            kind: spec.kind.as_str().to_string(),
            stream: spec.stream,
            requests: o.total(),
            outcomes: o,
            ttft_ms: h.ttft.summary(),
            itl_ms: h.itl.summary(),
            e2e_ms: h.e2e.summary(),
            output_tokens: tokens,
            rtfx: (audio > 0.0).then(|| audio / secs),
            e2e_cdf: thin_cdf(h.e2e.cdf()),
            ttft_cdf: thin_cdf(h.ttft.cdf()),
        })
        .collect();
    let mut errors: Vec<ErrorCount> = errors
        .into_iter()
        .map(|(message, count)| ErrorCount { message, count })
        .collect();
    errors.sort_by_key(|e| std::cmp::Reverse(e.count));
    errors.truncate(10);
    let mut records: Vec<&RequestRecord> = run.records.iter().collect();
    records.sort_by_key(|r| r.started);
    let step = records.len().div_ceil(MAX_TIMELINE).max(1);
    let timeline = records
        .iter()
        .step_by(step)
        .map(|r| TimelineEntry {
            name: specs
                .get(r.spec)
                .map(|s| s.name.clone())
                .unwrap_or_default(),
            start_ms: r.started.as_secs_f64() * 1000.0,
            end_ms: (r.started + r.e2e).as_secs_f64() * 1000.0,
            outcome: r.outcome.as_str().to_string(),
        })
        .collect();
    Report {
        schema_version: SCHEMA_VERSION,
        tool: "headroom bench".into(),
        scenario: meta.scenario.clone(),
        url: meta.url.clone(),
        model: meta.model.clone(),
        started_at_ms: run.started_at_ms,
        interrupted: run.interrupted,
        load: meta.load.clone(),
        definitions: definitions(),
        requests_sent: run.requests_sent,
        requests_completed: run.records.len() as u64,
        duration_s: run.duration.as_secs_f64(),
        request_throughput_rps: outcomes.ok as f64 / secs,
        outcomes,
        output_token_throughput_tps: output_tokens as f64 / secs,
        max_in_flight: run.max_in_flight,
        slo: meta.slo.clone(),
        goodput_rps: meta.slo.as_ref().map(|_| good as f64 / secs),
        rtfx: any_audio.then(|| audio_seconds / secs),
        ttft_ms: all.ttft.summary(),
        first_byte_ms: all.first_byte.summary(),
        first_chunk_ms: all.first_chunk.summary(),
        itl_ms: all.itl.summary(),
        tpot_ms: all.tpot.summary(),
        e2e_ms: all.e2e.summary(),
        by_kind,
        errors,
        stale_connection_retries: run.records.iter().map(|r| r.stale_retries as u64).sum(),
        gpu,
        timeline,
        sweep,
    }
}

/// Describes a load for the report.
pub fn load_report(
    load: Load,
    specs: &[RequestSpec],
    requests: Option<u64>,
    duration: Option<Duration>,
    warmup: u64,
) -> LoadReport {
    let mixed = specs.iter().any(|s| s.load.is_some());
    let (mode, concurrency, rate, burstiness) = match load {
        Load::Closed { concurrency } => ("closed", Some(concurrency), None, None),
        Load::Open { rate, burstiness } => ("open", None, Some(rate), Some(burstiness)),
    };
    LoadReport {
        mode: if mixed { "mixed" } else { mode }.to_string(),
        concurrency,
        rate,
        burstiness,
        requests,
        duration_s: duration.map(|d| d.as_secs_f64()),
        warmup_requests: warmup,
    }
}

fn fmt_ms(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "–".into())
}

fn fmt_bytes(v: Option<u64>) -> String {
    v.map(|b| format!("{:.1} MiB", b as f64 / 1048576.0))
        .unwrap_or_else(|| "–".into())
}

/// The plain-text table printed with `--format table`.
pub fn table(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} against {} ({}){}",
        r.tool,
        r.url,
        r.load.mode,
        if r.interrupted {
            " — interrupted"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "sent {}  completed {}  in {:.2}s  ok {}  429 {}  503 {}  504 {}  other {}",
        r.requests_sent,
        r.requests_completed,
        r.duration_s,
        r.outcomes.ok,
        r.outcomes.http_429,
        r.outcomes.http_503,
        r.outcomes.http_504,
        r.outcomes.other_error
    );
    let _ = writeln!(
        out,
        "throughput {:.2} req/s, {:.1} output tok/s{}{}",
        r.request_throughput_rps,
        r.output_token_throughput_tps,
        r.goodput_rps
            .map(|g| format!(", goodput {g:.2} req/s"))
            .unwrap_or_default(),
        r.rtfx.map(|x| format!(", RTFx {x:.1}")).unwrap_or_default()
    );
    let _ = writeln!(
        out,
        "{:<16}{:>8}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
        "metric (ms)", "count", "mean", "p50", "p90", "p95", "p99", "max"
    );
    for (name, s) in latency_rows(r) {
        let _ = writeln!(
            out,
            "{:<16}{:>8}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
            name,
            s.count,
            fmt_ms(s.mean),
            fmt_ms(s.p50),
            fmt_ms(s.p90),
            fmt_ms(s.p95),
            fmt_ms(s.p99),
            fmt_ms(s.max)
        );
    }
    if r.gpu.available {
        let _ = writeln!(
            out,
            "{}: baseline {}  peak {}  delta {:+.1} MiB",
            r.gpu.label(),
            fmt_bytes(r.gpu.baseline_bytes),
            fmt_bytes(r.gpu.peak_bytes),
            r.gpu.delta_bytes.unwrap_or(0) as f64 / 1048576.0
        );
    } else {
        let _ = writeln!(
            out,
            "GPU memory: not sampled ({})",
            r.gpu.reason.as_deref().unwrap_or("unknown reason")
        );
    }
    if let Some(s) = &r.sweep {
        let _ = writeln!(
            out,
            "sweep saturation point: {}",
            s.saturation_rps
                .map(|x| format!("{x} req/s"))
                .unwrap_or_else(|| "below the first step".into())
        );
    }
    for e in r.errors.iter().take(3) {
        let _ = writeln!(out, "error ×{}: {}", e.count, e.message);
    }
    out
}

fn latency_rows(r: &Report) -> [(&'static str, &LatencySummary); 6] {
    [
        ("ttft", &r.ttft_ms),
        ("first_byte", &r.first_byte_ms),
        ("first_chunk", &r.first_chunk_ms),
        ("itl", &r.itl_ms),
        ("tpot", &r.tpot_ms),
        ("e2e", &r.e2e_ms),
    ]
}

/// The Markdown summary.
pub fn markdown(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# headroom bench: {}\n", r.scenario);
    if r.interrupted {
        let _ = writeln!(out, "**Interrupted** — partial results.\n");
    }
    let _ = writeln!(out, "- URL: `{}`, model `{}`", r.url, r.model);
    let _ = writeln!(
        out,
        "- Load: {} (concurrency {}, rate {}, burstiness {}), warm-up {} requests",
        r.load.mode,
        r.load
            .concurrency
            .map(|c| c.to_string())
            .unwrap_or("–".into()),
        r.load
            .rate
            .map(|c| format!("{c} req/s"))
            .unwrap_or("–".into()),
        r.load
            .burstiness
            .map(|c| c.to_string())
            .unwrap_or("–".into()),
        r.load.warmup_requests
    );
    let _ = writeln!(
        out,
        "- Sent {} requests, {} completed in {:.2} s; {:.2} req/s, {:.1} output tok/s, at most {} in flight\n",
        r.requests_sent,
        r.requests_completed,
        r.duration_s,
        r.request_throughput_rps,
        r.output_token_throughput_tps,
        r.max_in_flight
    );
    let _ = writeln!(
        out,
        "## Outcomes\n\n| ok | http_429 | http_503 | http_504 | other_error |\n|---:|---:|---:|---:|---:|"
    );
    let o = &r.outcomes;
    let _ = writeln!(
        out,
        "| {} | {} | {} | {} | {} |\n",
        o.ok, o.http_429, o.http_503, o.http_504, o.other_error
    );
    let _ = writeln!(
        out,
        "## Latency (ms, ok requests)\n\n| metric | count | mean | p50 | p90 | p95 | p99 | max |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (name, s) in latency_rows(r) {
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} | {} | {} | {} | {} |",
            s.count,
            fmt_ms(s.mean),
            fmt_ms(s.p50),
            fmt_ms(s.p90),
            fmt_ms(s.p95),
            fmt_ms(s.p99),
            fmt_ms(s.max)
        );
    }
    let _ = writeln!(
        out,
        "\n## By request kind\n\n| name | kind | requests | ok | 429 | 503 | 504 | other | TTFT p50 | E2E p50 | E2E p99 | RTFx |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for k in &r.by_kind {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            k.name,
            k.kind,
            k.requests,
            k.outcomes.ok,
            k.outcomes.http_429,
            k.outcomes.http_503,
            k.outcomes.http_504,
            k.outcomes.other_error,
            fmt_ms(k.ttft_ms.p50),
            fmt_ms(k.e2e_ms.p50),
            fmt_ms(k.e2e_ms.p99),
            k.rtfx.map(|x| format!("{x:.1}")).unwrap_or("–".into())
        );
    }
    let _ = writeln!(out, "\n## {}\n", r.gpu.label());
    if r.gpu.available {
        let _ = writeln!(
            out,
            "Sampled every {} ms ({} samples). Baseline {}, peak {}, delta {:+.1} MiB.\n",
            r.gpu.interval_ms,
            r.gpu.samples,
            fmt_bytes(r.gpu.baseline_bytes),
            fmt_bytes(r.gpu.peak_bytes),
            r.gpu.delta_bytes.unwrap_or(0) as f64 / 1048576.0
        );
        if !r.gpu.per_process_peak.is_empty() {
            let _ = writeln!(out, "| pid | process | peak |\n|---:|---|---:|");
            for p in &r.gpu.per_process_peak {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} |",
                    p.pid,
                    p.name,
                    fmt_bytes(Some(p.peak_bytes))
                );
            }
        }
    } else {
        let _ = writeln!(
            out,
            "Not sampled: {}.",
            r.gpu.reason.as_deref().unwrap_or("unknown reason")
        );
    }
    if let Some(s) = &r.sweep {
        let _ = writeln!(
            out,
            "\n## Rate sweep\n\n| offered req/s | sent | ok req/s | 429 | other | E2E p50 | E2E p99 | saturated |\n|---:|---:|---:|---:|---:|---:|---:|---|"
        );
        for st in &s.steps {
            let _ = writeln!(
                out,
                "| {} | {} | {:.2} | {} | {} | {} | {} | {} |",
                st.rate,
                st.requests_sent,
                st.request_throughput_rps,
                st.outcomes.http_429,
                st.outcomes.other_error + st.outcomes.http_503 + st.outcomes.http_504,
                fmt_ms(st.e2e_p50_ms),
                fmt_ms(st.e2e_p99_ms),
                if st.saturated { "yes" } else { "no" }
            );
        }
        let _ = writeln!(
            out,
            "\nSaturation point: {}.",
            s.saturation_rps
                .map(|x| format!("{x} req/s"))
                .unwrap_or_else(|| "below the first step".into())
        );
    }
    if !r.errors.is_empty() {
        let _ = writeln!(out, "\n## Errors\n");
        for e in &r.errors {
            let _ = writeln!(out, "- ×{}: {}", e.count, e.message);
        }
    }
    let _ = writeln!(out, "\n## Definitions\n");
    for (k, v) in &r.definitions {
        let _ = writeln!(out, "- `{k}`: {v}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slo_parses_units_and_rejects_nonsense() {
        let s = Slo::parse("ttft=500,e2e=3s,tpot=40ms").unwrap();
        assert_eq!(s.ttft_ms, Some(500.0));
        assert_eq!(s.e2e_ms, Some(3000.0));
        assert_eq!(s.tpot_ms, Some(40.0));
        assert!(Slo::parse("ttft").is_err());
        assert!(Slo::parse("speed=3").is_err());
        assert!(Slo::parse("ttft=-1").is_err());
    }

    #[test]
    fn outcomes_add_up() {
        let mut o = Outcomes::default();
        for x in [
            Outcome::Ok,
            Outcome::Http429,
            Outcome::Http429,
            Outcome::OtherError,
        ] {
            o.add(x);
        }
        assert_eq!((o.ok, o.http_429, o.other_error, o.total()), (1, 2, 1, 4));
    }
}
