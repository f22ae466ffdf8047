//! What the night showed: per-lane latency against the lane's idle figure, refusals and whether
//! they carried Retry-After, lost requests, OOM kills, the leak verdict over the quiet gaps'
//! memory floors, text goodput — and the verdicts drawn from them. Written as JSON (stable
//! top-level fields), Markdown and, beside them, the SVG timeline.
//!
//! Latency is the served attempt's (sent → whole answer), so a request refused with Retry-After
//! and served on its retry counts its served attempt; the latency with waits and retries included
//! is reported beside it (`p99_total_s`). Percentiles are nearest-rank over the night's ok
//! requests; the idle figure is the median of the stream's requests sent one at a time on the
//! quiet box.

use std::collections::BTreeMap;

use headroom_gpu::LeakReport;
use serde::Serialize;

use crate::boxes::Mode;
use crate::client::{End, Final, Record};
use crate::cpu::{CpuSample, CpuWindow};
use crate::faults::FaultRecord;
use crate::scenario::{Night, StreamKind};
use crate::watch::{MemSample, PidChange};

/// `p` (0–100) by nearest rank of `values` (any order); `None` when empty.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    Some(v[rank.min(v.len()) - 1])
}

/// One lane (a stream of the night).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LaneReport {
    pub kind: &'static str,
    pub backend: String,
    pub requests: u64,
    pub ok: u64,
    pub refused: u64,
    pub failed: u64,
    pub stopped: u64,
    pub lost: u64,
    pub p50_s: Option<f64>,
    pub p95_s: Option<f64>,
    pub p99_s: Option<f64>,
    /// p99 from the first send to the answer, retries and their waits included.
    pub p99_total_s: Option<f64>,
    pub idle_requests: u64,
    pub idle_p50_s: Option<f64>,
    pub p99_ratio_to_idle: Option<f64>,
    /// The verdict's bound on that ratio (audio lanes).
    pub p99_limit: Option<f64>,
    pub output_tokens: u64,
}

/// One verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    pub name: String,
    pub holds: bool,
    pub detail: String,
}

/// What the run was expected to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Expect {
    /// Every verdict holds (a box under `up`).
    Hold,
    /// The page shows: an OOM kill, audio p99 above 3× idle, or lost requests (the box set up
    /// by hand).
    Page,
}

/// Memory over the night.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryReport {
    pub limit_bytes: Option<u64>,
    /// Whether a memory limit was in force on the pool (a cgroup whose usage could be read).
    pub enforced: bool,
    pub peak_pool_bytes: Option<u64>,
    pub peak_backends_bytes: Option<u64>,
    /// The quiet gaps' floors, one per round that had a whole reading.
    pub floors_bytes: Vec<u64>,
    pub restarts: Vec<PidChange>,
}

/// A backend exit the box reported or the drill saw.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExitReport {
    pub backend: String,
    pub at_s: f64,
    pub how: String,
}

/// An audio lane's slowest served request and what ran while it did: the line to read when its
/// p99 breaks (on a short night the p99 is the slowest request).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlowRequest {
    pub lane: String,
    /// Sent, seconds into the night.
    pub at_s: f64,
    pub secs: f64,
    pub ratio_to_idle: Option<f64>,
    /// Other lanes' requests in flight at any moment of it: lane name and how many.
    pub beside: BTreeMap<String, u64>,
    /// Faults that began from 10 s before it was sent to its answer: kind and target.
    pub faults: Vec<String>,
    /// Backends that exited from 30 s before it was sent to its answer.
    pub exits: Vec<String>,
}

/// Each audio lane's slowest served request of the night, with what overlapped it.
pub fn slowest(
    night: &Night,
    records: &[Record],
    lanes: &BTreeMap<String, LaneReport>,
    faults: &[FaultRecord],
    exits: &[ExitReport],
    night_start_s: f64,
) -> Vec<SlowRequest> {
    let night_records: Vec<&Record> = records.iter().filter(|r| r.round.is_some()).collect();
    let mut out = Vec::new();
    for (i, s) in night.streams.iter().enumerate() {
        if !s.kind.is_audio() {
            continue;
        }
        let Some((r, secs)) = night_records
            .iter()
            .filter(|r| r.stream == i)
            .filter_map(|r| r.served_secs().map(|x| (*r, x)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
        else {
            continue;
        };
        let (from, to) = (r.attempts.last().map_or(0.0, |a| a.start_s), r.ended_s());
        let mut beside = BTreeMap::new();
        for o in &night_records {
            if o.stream != i && o.sent_s() < to && o.ended_s() > from {
                *beside
                    .entry(night.streams[o.stream].name.clone())
                    .or_insert(0) += 1;
            }
        }
        out.push(SlowRequest {
            lane: s.name.clone(),
            at_s: from - night_start_s,
            secs,
            ratio_to_idle: lanes
                .get(&s.name)
                .and_then(|l| l.idle_p50_s)
                .filter(|&i| i > 0.0)
                .map(|i| secs / i),
            beside,
            faults: faults
                .iter()
                .filter(|f| f.at_s >= from - 10.0 && f.at_s <= to)
                .map(|f| {
                    format!(
                        "{} on {} at {:.1} s",
                        f.kind,
                        f.target,
                        f.at_s - night_start_s
                    )
                })
                .collect(),
            exits: exits
                .iter()
                .filter(|e| e.at_s >= from - 30.0 && e.at_s <= to)
                .map(|e| format!("{} at {:.1} s", e.backend, e.at_s - night_start_s))
                .collect(),
        });
    }
    out
}

fn slowest_markdown(r: &Report) -> String {
    if r.slowest.is_empty() {
        return String::new();
    }
    let mut o = String::from(
        "Each audio lane's slowest request, and what ran while it did (other lanes' requests in flight; faults from 10 s before it; backend exits from 30 s before it):\n\n| lane | sent at s | took s | × idle | beside it | faults | exits |\n|---|---|---|---|---|---|---|\n",
    );
    let or_dash = |v: String| if v.is_empty() { "–".to_string() } else { v };
    for x in &r.slowest {
        o.push_str(&format!(
            "| {} | {:.1} | {:.2} | {} | {} | {} | {} |\n",
            x.lane,
            x.at_s,
            x.secs,
            fmt_x(x.ratio_to_idle),
            or_dash(
                x.beside
                    .iter()
                    .map(|(l, n)| format!("{l} ×{n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            or_dash(x.faults.join("; ")),
            or_dash(x.exits.join("; ")),
        ));
    }
    o.push('\n');
    o
}

/// The whole report (`report.json`). Top-level fields are stable: add, never rename.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub schema_version: u32,
    pub tool: &'static str,
    pub mode: Mode,
    pub variant: Option<String>,
    pub box_file: String,
    pub scenario: String,
    pub scenario_file: String,
    pub duration_s: f64,
    /// From the first request of the night to the last answer, seconds.
    pub night_s: f64,
    /// When the night started on the drill's clock (the idle measurement comes before it).
    pub night_start_s: f64,
    pub expect: Expect,
    pub passed: bool,
    pub page_shown: bool,
    pub verdicts: Vec<Verdict>,
    pub oom_kills: Option<u64>,
    pub lost: u64,
    pub refusals: u64,
    pub refusals_without_retry_after: u64,
    pub retries_after_retry_after_served: u64,
    pub leak_verdict: String,
    pub leak: Option<LeakReport>,
    pub leak_reason: String,
    pub text_goodput_tokens_per_second: f64,
    pub lanes: BTreeMap<String, LaneReport>,
    pub memory: MemoryReport,
    pub exits: Vec<ExitReport>,
    pub faults: Vec<FaultRecord>,
    /// Lanes the gateway still counted busy after the night was answered (a leaked slot).
    pub busy_after_night: Vec<String>,
    pub box_details: serde_json::Value,
    pub samples: Vec<MemSample>,
    /// The night in windows of about ten minutes: each lane's median and where the CPU went.
    pub windows: Vec<WindowReport>,
    /// The machine's CPUs (the CPU figures are percentages of one).
    pub cores: usize,
    pub cpu_samples: Vec<CpuSample>,
    /// Each audio lane's slowest request and what ran beside it.
    pub slowest: Vec<SlowRequest>,
}

/// One window of the night (times in seconds into the night).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WindowReport {
    pub from_s: f64,
    pub to_s: f64,
    /// Each lane's median served time over the requests sent in the window (`None`: none ok).
    pub lanes_p50_s: BTreeMap<String, Option<f64>>,
    pub cpu: CpuWindow,
}

/// The night's windows: `cpu_windows` (on the drill's clock, from [`crate::cpu::windows`]) with
/// each lane's median over the requests sent in each.
pub fn windows(
    night: &Night,
    records: &[Record],
    cpu_windows: Vec<CpuWindow>,
    night_start_s: f64,
) -> Vec<WindowReport> {
    cpu_windows
        .into_iter()
        .map(|cpu| {
            let lanes_p50_s = night
                .streams
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let served: Vec<f64> = records
                        .iter()
                        .filter(|r| r.stream == i && r.round.is_some())
                        .filter(|r| r.sent_s() >= cpu.from_s && r.sent_s() < cpu.to_s)
                        .filter_map(Record::served_secs)
                        .collect();
                    (s.name.clone(), percentile(&served, 50.0))
                })
                .collect();
            WindowReport {
                from_s: cpu.from_s - night_start_s,
                to_s: cpu.to_s - night_start_s,
                lanes_p50_s,
                cpu,
            }
        })
        .collect()
}

/// The windows as two Markdown tables: the lanes' medians, then the CPU.
fn windows_markdown(r: &Report) -> String {
    let Some(first) = r.windows.first() else {
        return String::new();
    };
    let span = |w: &WindowReport| {
        if w.to_s - w.from_s >= 120.0 {
            format!("{:.0}–{:.0} min", w.from_s / 60.0, w.to_s / 60.0)
        } else {
            format!("{:.0}–{:.0} s", w.from_s, w.to_s)
        }
    };
    let lanes: Vec<&String> = first.lanes_p50_s.keys().collect();
    let mut o = String::from(
        "## By window of the night\n\nEach lane's median (s) over the requests sent in the window, beside its idle figure:\n\n| into the night |",
    );
    for l in &lanes {
        let idle = r.lanes.get(*l).and_then(|x| x.idle_p50_s);
        o.push_str(&format!(" {l} (idle {}) |", fmt_s(idle)));
    }
    o.push_str(&format!("\n|---|{}\n", "---|".repeat(lanes.len())));
    for w in &r.windows {
        o.push_str(&format!("| {} |", span(w)));
        for l in &lanes {
            o.push_str(&format!(
                " {} |",
                fmt_s(w.lanes_p50_s.get(*l).copied().flatten())
            ));
        }
        o.push('\n');
    }
    let mut names: Vec<&String> = r
        .windows
        .iter()
        .flat_map(|w| w.cpu.percent_of_core.keys())
        .collect();
    names.sort();
    names.dedup();
    o.push_str(&format!(
        "\nWhere the CPU went, % of one core ({} cores: {} % in all); major page faults in brackets; the pool's memory cgroup: its highest charge (what the limit is compared with, file cache included), the file cache in it, and file data read again after the kernel evicted it to stay under the limit:\n\n| into the night |",
        r.cores,
        r.cores * 100
    ));
    for n in &names {
        o.push_str(&format!(" {n} |"));
    }
    o.push_str(" other | iowait | steal | idle | pool charge MiB (file cache) | file read again MiB |\n|---|");
    o.push_str(&"---|".repeat(names.len() + 6));
    o.push('\n');
    let pct = |v: Option<f64>| v.map(|x| format!("{x:.1}")).unwrap_or_else(|| "–".into());
    for w in &r.windows {
        o.push_str(&format!("| {} |", span(w)));
        for n in &names {
            let p = w.cpu.percent_of_core.get(*n).copied();
            let f = w.cpu.major_faults.get(*n).copied().unwrap_or(0);
            o.push_str(&format!(
                " {}{} |",
                pct(p),
                if f > 0 {
                    format!(" ({f})")
                } else {
                    String::new()
                }
            ));
        }
        let mb = |b: Option<u64>| {
            b.map(|b| format!("{:.0}", b as f64 / 1048576.0))
                .unwrap_or_else(|| "–".into())
        };
        o.push_str(&format!(
            " {} | {} | {} | {} | {} ({}) | {} |\n",
            pct(w.cpu.other_percent),
            pct(w.cpu.iowait_percent),
            pct(w.cpu.steal_percent),
            pct(w.cpu.idle_percent),
            mb(w.cpu.cgroup_peak_usage_bytes),
            mb(w.cpu.cgroup_file_bytes),
            mb(w.cpu.cgroup_refault_bytes)
        ));
    }
    o.push('\n');
    o
}

/// Per-lane figures from the records.
pub fn lanes(
    night: &Night,
    backends: &[String],
    records: &[Record],
) -> BTreeMap<String, LaneReport> {
    let mut out = BTreeMap::new();
    for (i, s) in night.streams.iter().enumerate() {
        let idle: Vec<f64> = records
            .iter()
            .filter(|r| r.stream == i && r.round.is_none())
            .filter_map(Record::served_secs)
            .collect();
        let mine: Vec<&Record> = records
            .iter()
            .filter(|r| r.stream == i && r.round.is_some())
            .collect();
        let served: Vec<f64> = mine.iter().filter_map(|r| r.served_secs()).collect();
        let total: Vec<f64> = mine.iter().filter_map(|r| r.total_secs()).collect();
        let count = |f: Final| mine.iter().filter(|r| r.outcome == f).count() as u64;
        let p99 = percentile(&served, 99.0);
        let idle_p50 = percentile(&idle, 50.0);
        out.insert(
            s.name.clone(),
            LaneReport {
                kind: s.kind.as_str(),
                backend: backends.get(i).cloned().unwrap_or_default(),
                requests: mine.len() as u64,
                ok: count(Final::Ok),
                refused: count(Final::Refused),
                failed: count(Final::Failed),
                stopped: count(Final::Stopped),
                lost: count(Final::Lost),
                p50_s: percentile(&served, 50.0),
                p95_s: percentile(&served, 95.0),
                p99_s: p99,
                p99_total_s: percentile(&total, 99.0),
                idle_requests: idle.len() as u64,
                idle_p50_s: idle_p50,
                p99_ratio_to_idle: match (p99, idle_p50) {
                    (Some(p), Some(i)) if i > 0.0 => Some(p / i),
                    _ => None,
                },
                p99_limit: s.p99_vs_idle,
                output_tokens: mine.iter().map(|r| r.tokens()).sum(),
            },
        );
    }
    out
}

/// The counters over the night's requests: (refusals, without Retry-After, refused with
/// Retry-After then served, lost).
pub fn refusal_counts(records: &[Record]) -> (u64, u64, u64, u64) {
    let night = records.iter().filter(|r| r.round.is_some());
    let mut refusals = 0;
    let mut bare = 0;
    let mut served_after = 0;
    let mut lost = 0;
    for r in night {
        let mut told = false;
        for a in r.refusals() {
            refusals += 1;
            match a.end {
                End::Refused {
                    retry_after_s: Some(_),
                    ..
                } => told = true,
                _ => bare += 1,
            }
        }
        if told && r.outcome == Final::Ok {
            served_after += 1;
        }
        if r.outcome == Final::Lost {
            lost += 1;
        }
    }
    (refusals, bare, served_after, lost)
}

/// Text output tokens of ok chat requests per second of the night.
pub fn text_goodput(night: &Night, records: &[Record], night_s: f64) -> f64 {
    let tokens: u64 = records
        .iter()
        .filter(|r| r.round.is_some() && night.streams[r.stream].kind == StreamKind::Chat)
        .map(Record::tokens)
        .sum();
    if night_s > 0.0 {
        tokens as f64 / night_s
    } else {
        0.0
    }
}

/// Everything the verdicts read.
#[derive(Debug, Clone)]
pub struct Evidence<'a> {
    pub mode: Mode,
    pub host_pool: bool,
    pub enforced: bool,
    pub oom_kills: Option<u64>,
    pub lost: u64,
    pub refusals: u64,
    pub refusals_without_retry_after: u64,
    pub leak_verdict: &'a str,
    pub leak_reason: &'a str,
    /// The night's length (its rounds' active parts and gaps), seconds.
    pub night_s: f64,
    pub text_goodput: f64,
    pub lanes: &'a BTreeMap<String, LaneReport>,
    pub left_behind: &'a [u32],
    pub busy_after_night: &'a [String],
}

/// Nights shorter than this cannot tell a slow leak from a backend settling after its first
/// jobs or a restart (rounds of seconds): there an inconclusive floor does not break `no_leak`;
/// a floor that rises like a leak breaks it at any length.
pub const LEAK_JUDGED_FROM_S: f64 = 1800.0;

/// The page shows: an OOM kill, an audio lane's p99 above 3× its idle figure, or lost requests.
pub fn page_shown(e: &Evidence) -> bool {
    e.oom_kills.unwrap_or(0) > 0
        || e.lost > 0
        || e.lanes
            .values()
            .any(|l| l.kind != "chat" && l.p99_ratio_to_idle.is_some_and(|r| r > 3.0))
}

/// The verdicts of a box that should hold.
pub fn verdicts(e: &Evidence) -> Vec<Verdict> {
    let mut v = Vec::new();
    let mut push = |name: &str, holds: bool, detail: String| {
        v.push(Verdict {
            name: name.to_string(),
            holds,
            detail,
        })
    };
    if e.host_pool {
        push(
            "memory_limit_enforced",
            e.enforced,
            if e.enforced {
                "the pool's memory cgroup was read all night".into()
            } else {
                "no memory cgroup limits the pool: an over-commit costs nothing on this box, so OOM kills prove nothing (enable [memory] enforcement)".into()
            },
        );
    }
    push(
        "no_oom_kills",
        e.oom_kills == Some(0),
        match e.oom_kills {
            Some(k) => format!("{k} OOM kill(s) in the pool"),
            None => "the box reports no OOM kill count".into(),
        },
    );
    push(
        "nothing_lost",
        e.lost == 0,
        format!(
            "{} request(s) lost (no answer, a reset, or no answer by the deadline)",
            e.lost
        ),
    );
    for (name, l) in e.lanes {
        let Some(limit) = l.p99_limit else { continue };
        let holds = l.p99_ratio_to_idle.is_some_and(|r| r <= limit);
        push(
            &format!("{name}_p99_within_{limit}x_idle"),
            holds,
            match (l.p99_s, l.idle_p50_s, l.p99_ratio_to_idle) {
                (Some(p), Some(i), Some(r)) => {
                    format!("p99 {p:.2} s = {r:.2}× idle {i:.2} s (limit {limit}×)")
                }
                _ => format!(
                    "{} of {} request(s) ok: no p99 to compare",
                    l.ok, l.requests
                ),
            },
        );
    }
    // Audio that was refused until the client gave up is audio the user never got, even when
    // every refusal was polite: the served requests' latency alone would not show it.
    let unserved: Vec<String> = e
        .lanes
        .iter()
        .filter(|(_, l)| l.kind != "chat")
        .filter(|(_, l)| l.requests > l.ok)
        .map(|(n, l)| format!("{n} {} of {}", l.requests - l.ok, l.requests))
        .collect();
    push(
        "audio_requests_served",
        unserved.is_empty(),
        if unserved.is_empty() {
            "every audio request of the night was served (after its retries)".into()
        } else {
            format!(
                "not served in the end (refused, failed or lost): {}",
                unserved.join(", ")
            )
        },
    );
    push(
        "refusals_carry_retry_after",
        e.refusals_without_retry_after == 0,
        format!(
            "{} of {} refusal(s) without Retry-After",
            e.refusals_without_retry_after, e.refusals
        ),
    );
    let too_short = e.night_s < LEAK_JUDGED_FROM_S && e.leak_verdict == "inconclusive";
    push(
        "no_leak",
        e.leak_verdict == "no_leak" || too_short,
        if too_short {
            format!(
                "inconclusive on a night of {:.0} min, too short to judge (from {:.0} min on it must read no_leak; a rising floor breaks it at any length): {}",
                e.night_s / 60.0,
                LEAK_JUDGED_FROM_S / 60.0,
                e.leak_reason
            )
        } else {
            format!("{}: {}", e.leak_verdict, e.leak_reason)
        },
    );
    push(
        "text_goodput",
        e.text_goodput > 0.0,
        format!(
            "{:.1} output tokens/s of completed text requests",
            e.text_goodput
        ),
    );
    if e.mode == Mode::Up {
        push(
            "nothing_left_running",
            e.left_behind.is_empty(),
            if e.left_behind.is_empty() {
                "every process of the box stopped with up".into()
            } else {
                format!("still running after up stopped: PIDs {:?}", e.left_behind)
            },
        );
        push(
            "no_busy_slots_after_night",
            e.busy_after_night.is_empty(),
            if e.busy_after_night.is_empty() {
                "every lane idle once the night was answered".into()
            } else {
                format!("busy after the night: {}", e.busy_after_night.join(", "))
            },
        );
    }
    v
}

fn fmt_s(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.2}")).unwrap_or_else(|| "–".into())
}

fn fmt_x(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.2}×")).unwrap_or_else(|| "–".into())
}

fn mib(b: Option<u64>) -> String {
    b.map(|x| format!("{:.0} MiB", x as f64 / 1048576.0))
        .unwrap_or_else(|| "–".into())
}

/// The report as Markdown (the SVG is linked as `timeline.svg` beside it).
pub fn markdown(r: &Report) -> String {
    let mut o = String::new();
    let status = match (r.expect, r.passed) {
        (Expect::Hold, true) => "every verdict holds",
        (Expect::Hold, false) => "a verdict is broken",
        (Expect::Page, true) => "the page shows, as expected of this box",
        (Expect::Page, false) => "the page did NOT show",
    };
    o.push_str(&format!(
        "# Drill: {} — {}{}\n\n{status}. Box `{}` ({}), night `{}` of {:.0} s ({:.0} s with its quiet gaps and drains).\n\n",
        r.scenario,
        r.mode.as_str(),
        r.variant.as_deref().map(|v| format!(" ({v})")).unwrap_or_default(),
        r.box_file,
        r.mode.as_str(),
        r.scenario_file,
        r.duration_s,
        r.night_s
    ));
    o.push_str("| verdict | holds | detail |\n|---|---|---|\n");
    for v in &r.verdicts {
        o.push_str(&format!(
            "| {} | {} | {} |\n",
            v.name,
            if v.holds { "yes" } else { "**no**" },
            v.detail
        ));
    }
    o.push_str(&format!(
        "\nOOM kills {} · lost {} · refusals {} ({} without Retry-After) · refused then served after Retry-After {} · leak verdict {} · text goodput {:.1} tokens/s\n\n",
        r.oom_kills.map(|k| k.to_string()).unwrap_or_else(|| "unknown".into()),
        r.lost,
        r.refusals,
        r.refusals_without_retry_after,
        r.retries_after_retry_after_served,
        r.leak_verdict,
        r.text_goodput_tokens_per_second
    ));
    o.push_str("| lane | kind | requests | ok | refused | failed | stopped | lost | p50 s | p95 s | p99 s | p99 with retries s | idle p50 s | p99 / idle |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (name, l) in &r.lanes {
        o.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {}{} |\n",
            l.kind,
            l.requests,
            l.ok,
            l.refused,
            l.failed,
            l.stopped,
            l.lost,
            fmt_s(l.p50_s),
            fmt_s(l.p95_s),
            fmt_s(l.p99_s),
            fmt_s(l.p99_total_s),
            fmt_s(l.idle_p50_s),
            fmt_x(l.p99_ratio_to_idle),
            l.p99_limit
                .map(|x| format!(" (≤ {x}×)"))
                .unwrap_or_default()
        ));
    }
    o.push('\n');
    o.push_str(&slowest_markdown(r));
    o.push_str(&format!(
        "Memory: limit {}{}, pool peak {}, backends' peak {}; quiet-gap floors {}.\n\n",
        mib(r.memory.limit_bytes),
        if r.memory.enforced {
            " (enforced)"
        } else {
            " (not enforced)"
        },
        mib(r.memory.peak_pool_bytes),
        mib(r.memory.peak_backends_bytes),
        r.memory
            .floors_bytes
            .iter()
            .map(|f| format!("{:.0}", *f as f64 / 1048576.0))
            .collect::<Vec<_>>()
            .join(", ")
            + " MiB"
    ));
    if !r.exits.is_empty() {
        o.push_str("Backend exits (s into the night): ");
        let list: Vec<String> = r
            .exits
            .iter()
            .map(|e| {
                format!(
                    "{} at {:.0} s ({})",
                    e.backend,
                    e.at_s - r.night_start_s,
                    e.how
                )
            })
            .collect();
        o.push_str(&list.join("; "));
        o.push_str("\n\n");
    }
    o.push_str("Times are seconds into the night.\n\n| fault | at s | on | what happened |\n|---|---|---|---|\n");
    for f in &r.faults {
        o.push_str(&format!(
            "| {} | {:.0} | {} | {} |\n",
            f.kind,
            f.at_s - r.night_start_s,
            f.target,
            f.outcome
        ));
    }
    o.push('\n');
    o.push_str(&windows_markdown(r));
    o.push_str("![timeline](timeline.svg)\n");
    o
}

/// Two reports (`report.json` as read back) side by side as a Markdown table: the box set up by
/// hand and the box under `up`, say.
pub fn side_by_side_json(a: &serde_json::Value, b: &serde_json::Value) -> String {
    let title = |r: &serde_json::Value| {
        let mode = r["mode"].as_str().unwrap_or("?").to_string();
        match r["variant"].as_str() {
            Some(v) => format!("{mode} ({v})"),
            None => mode,
        }
    };
    let num = |v: &serde_json::Value, d: usize| match v.as_f64() {
        Some(x) => format!("{x:.d$}"),
        None => "–".into(),
    };
    let verdicts = |r: &serde_json::Value| {
        let broken: Vec<String> = r["verdicts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|v| v["holds"] == false)
            .filter_map(|v| v["name"].as_str().map(str::to_string))
            .collect();
        if broken.is_empty() {
            "all hold".to_string()
        } else {
            format!("broken: {}", broken.join(", "))
        }
    };
    let mut o = format!("| | {} | {} |\n|---|---|---|\n", title(a), title(b));
    let mut row = |k: &str, f: &dyn Fn(&serde_json::Value) -> String| {
        o.push_str(&format!("| {k} | {} | {} |\n", f(a), f(b)));
    };
    row("night (s)", &|r| num(&r["night_s"], 0));
    row("verdicts", &verdicts);
    row("page shown", &|r| r["page_shown"].to_string());
    row("oom_kills", &|r| num(&r["oom_kills"], 0));
    row("lost", &|r| num(&r["lost"], 0));
    row("refusals (without Retry-After)", &|r| {
        format!(
            "{} ({})",
            num(&r["refusals"], 0),
            num(&r["refusals_without_retry_after"], 0)
        )
    });
    row("refused, then served after Retry-After", &|r| {
        num(&r["retries_after_retry_after_served"], 0)
    });
    row("leak verdict", &|r| {
        r["leak_verdict"].as_str().unwrap_or("–").to_string()
    });
    row("text goodput (tokens/s)", &|r| {
        num(&r["text_goodput_tokens_per_second"], 1)
    });
    let mut names = std::collections::BTreeSet::new();
    for r in [a, b] {
        if let Some(l) = r["lanes"].as_object() {
            names.extend(l.keys().cloned());
        }
    }
    for n in names {
        row(&n, &|r| {
            let l = &r["lanes"][&n];
            if l.is_null() {
                return "–".into();
            }
            format!(
                "{}/{} ok, lost {}, p99 {} s, idle {} s, {}×",
                num(&l["ok"], 0),
                num(&l["requests"], 0),
                num(&l["lost"], 0),
                num(&l["p99_s"], 2),
                num(&l["idle_p50_s"], 2),
                num(&l["p99_ratio_to_idle"], 2)
            )
        });
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Attempt, End};
    use std::path::Path;

    #[test]
    fn the_slowest_audio_request_is_named_with_what_ran_beside_it() {
        let n = night();
        let records = vec![
            rec(0, None, vec![ok(0.0, 0.4)], Final::Ok),
            // The night starts at 100 s: dictations of 0.4, 0.9 (at 120 s) and 0.5 s.
            rec(0, Some(0), vec![ok(110.0, 0.4)], Final::Ok),
            rec(
                0,
                Some(0),
                vec![refused(119.0, Some(1.0)), ok(120.0, 0.9)],
                Final::Ok,
            ),
            rec(0, Some(1), vec![ok(130.0, 0.5)], Final::Ok),
            // Clean-up requests: one across the slow dictation, one before, one after.
            rec(1, Some(0), vec![ok(115.0, 5.5)], Final::Ok),
            rec(1, Some(0), vec![ok(105.0, 2.0)], Final::Ok),
            rec(1, Some(0), vec![ok(121.0, 3.0)], Final::Ok),
        ];
        let lanes = lanes(&n, &[], &records);
        let fault = |kind: &'static str, at_s: f64| FaultRecord {
            kind,
            at_s,
            end_s: at_s + 1.0,
            target: "pool".into(),
            outcome: String::new(),
            answers: Vec::new(),
        };
        let exit = |at_s: f64| ExitReport {
            backend: "whisper".into(),
            at_s,
            how: "signal 9".into(),
        };
        let s = slowest(
            &n,
            &records,
            &lanes,
            &[fault("co_tenant", 112.0), fault("kill9", 105.0)],
            &[exit(95.0), exit(80.0)],
            100.0,
        );
        // Only audio lanes; the served attempt's time, not the refusal's.
        assert_eq!(s.len(), 1);
        let d = &s[0];
        assert_eq!((d.lane.as_str(), d.at_s, d.secs), ("dictation", 20.0, 0.9));
        assert!((d.ratio_to_idle.unwrap() - 2.25).abs() < 1e-9);
        assert_eq!(d.beside, BTreeMap::from([("cleanup".to_string(), 1)]));
        assert_eq!(d.faults, ["co_tenant on pool at 12.0 s"]);
        assert_eq!(d.exits, ["whisper at -5.0 s"]);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), Some(2.0));
        // Few values: p99 is the slowest.
        assert_eq!(percentile(&[0.3, 2.0, 0.4], 99.0), Some(2.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    fn ok(start: f64, secs: f64) -> Attempt {
        Attempt {
            start_s: start,
            secs,
            end: End::Ok {
                tokens: Some(10),
                first_s: None,
            },
        }
    }

    fn refused(start: f64, ra: Option<f64>) -> Attempt {
        Attempt {
            start_s: start,
            secs: 0.01,
            end: End::Refused {
                status: 503,
                code: None,
                retry_after_s: ra,
            },
        }
    }

    fn rec(stream: usize, round: Option<u32>, attempts: Vec<Attempt>, outcome: Final) -> Record {
        Record {
            stream,
            seq: 0,
            round,
            attempts,
            outcome,
        }
    }

    fn night() -> Night {
        Night::parse(
            r#"
name = "n"
[[stream]]
name = "dictation"
kind = "transcription"
clip = "c.wav"
per_minute = 1
[[stream]]
name = "cleanup"
kind = "chat"
workers = 1
"#,
            Path::new("/"),
        )
        .unwrap()
    }

    fn records() -> Vec<Record> {
        vec![
            // Idle: 0.3, 0.4, 0.5 -> p50 0.4.
            rec(0, None, vec![ok(0.0, 0.3)], Final::Ok),
            rec(0, None, vec![ok(1.0, 0.4)], Final::Ok),
            rec(0, None, vec![ok(2.0, 0.5)], Final::Ok),
            // Night: served 0.4 and 0.5; one refused with Retry-After, then served in 0.5 s
            // after a 2 s wait; one refused bare, given up; one lost.
            rec(0, Some(0), vec![ok(10.0, 0.4)], Final::Ok),
            rec(
                0,
                Some(0),
                vec![refused(11.0, Some(2.0)), ok(13.0, 0.5)],
                Final::Ok,
            ),
            rec(
                0,
                Some(1),
                vec![
                    refused(20.0, None),
                    refused(20.5, None),
                    refused(21.5, None),
                ],
                Final::Refused,
            ),
            rec(
                0,
                Some(1),
                vec![Attempt {
                    start_s: 30.0,
                    secs: 60.0,
                    end: End::Lost {
                        why: "deadline".into(),
                        before_answer: false,
                    },
                }],
                Final::Lost,
            ),
            rec(1, Some(0), vec![ok(10.0, 3.0)], Final::Ok),
        ]
    }

    #[test]
    fn lanes_count_outcomes_and_compare_with_idle() {
        let n = night();
        let l = lanes(&n, &["whisper".into(), "llm".into()], &records());
        let d = &l["dictation"];
        assert_eq!((d.requests, d.ok, d.refused, d.lost), (4, 2, 1, 1));
        assert_eq!(d.idle_requests, 3);
        assert_eq!(d.idle_p50_s, Some(0.4));
        assert_eq!(d.p99_s, Some(0.5));
        let r = d.p99_ratio_to_idle.unwrap();
        assert!((r - 1.25).abs() < 1e-9, "{r}");
        // With the refusal's wait: 11.0 -> 13.5.
        assert!((d.p99_total_s.unwrap() - 2.5).abs() < 1e-9);
        assert_eq!(d.p99_limit, Some(1.5));
        assert_eq!(l["cleanup"].output_tokens, 10);
        assert_eq!(l["cleanup"].backend, "llm");
    }

    #[test]
    fn refusals_are_counted_per_attempt_and_served_retries_per_request() {
        let (refusals, bare, served_after, lost) = refusal_counts(&records());
        assert_eq!((refusals, bare, served_after, lost), (4, 3, 1, 1));
        let g = text_goodput(&night(), &records(), 100.0);
        assert!((g - 0.1).abs() < 1e-9);
    }

    fn evidence<'a>(l: &'a BTreeMap<String, LaneReport>) -> Evidence<'a> {
        Evidence {
            mode: Mode::Up,
            host_pool: true,
            enforced: true,
            oom_kills: Some(0),
            lost: 0,
            refusals: 2,
            refusals_without_retry_after: 0,
            leak_verdict: "no_leak",
            leak_reason: "flat",
            night_s: 3600.0,
            text_goodput: 5.0,
            lanes: l,
            left_behind: &[],
            busy_after_night: &[],
        }
    }

    #[test]
    fn a_clean_night_holds_and_each_failure_is_named() {
        let n = night();
        let recs: Vec<Record> = records()
            .into_iter()
            .filter(|r| r.outcome == Final::Ok)
            .collect();
        let l = lanes(&n, &[], &recs);
        let e = evidence(&l);
        let v = verdicts(&e);
        assert!(v.iter().all(|x| x.holds), "{v:?}");
        assert!(!page_shown(&e));
        let broken = |e: &Evidence| -> Vec<String> {
            verdicts(e)
                .into_iter()
                .filter(|x| !x.holds)
                .map(|x| x.name)
                .collect()
        };
        assert_eq!(
            broken(&Evidence {
                oom_kills: Some(1),
                ..evidence(&l)
            }),
            vec!["no_oom_kills"]
        );
        assert_eq!(
            broken(&Evidence {
                oom_kills: None,
                ..evidence(&l)
            }),
            vec!["no_oom_kills"]
        );
        assert_eq!(
            broken(&Evidence {
                lost: 2,
                ..evidence(&l)
            }),
            vec!["nothing_lost"]
        );
        // An audio lane whose requests were refused until the client gave up.
        let mut refused = l.clone();
        refused.get_mut("dictation").unwrap().requests += 3;
        assert_eq!(broken(&evidence(&refused)), vec!["audio_requests_served"]);
        let mut text = l.clone();
        text.get_mut("cleanup").unwrap().requests += 3;
        assert!(
            broken(&evidence(&text)).is_empty(),
            "text may be refused: it gives way"
        );
        assert_eq!(
            broken(&Evidence {
                refusals_without_retry_after: 1,
                ..evidence(&l)
            }),
            vec!["refusals_carry_retry_after"]
        );
        assert_eq!(
            broken(&Evidence {
                leak_verdict: "inconclusive",
                ..evidence(&l)
            }),
            vec!["no_leak"]
        );
        // A 3-minute night cannot tell: inconclusive holds there, a leak does not.
        assert!(
            broken(&Evidence {
                leak_verdict: "inconclusive",
                night_s: 180.0,
                ..evidence(&l)
            })
            .is_empty()
        );
        assert_eq!(
            broken(&Evidence {
                leak_verdict: "leak",
                night_s: 180.0,
                ..evidence(&l)
            }),
            vec!["no_leak"]
        );
        assert_eq!(
            broken(&Evidence {
                text_goodput: 0.0,
                ..evidence(&l)
            }),
            vec!["text_goodput"]
        );
        assert_eq!(
            broken(&Evidence {
                enforced: false,
                ..evidence(&l)
            }),
            vec!["memory_limit_enforced"]
        );
        assert_eq!(
            broken(&Evidence {
                left_behind: &[42],
                ..evidence(&l)
            }),
            vec!["nothing_left_running"]
        );
        // A slow audio lane.
        let mut slow = l.clone();
        slow.get_mut("dictation").unwrap().p99_ratio_to_idle = Some(1.6);
        assert_eq!(
            broken(&evidence(&slow)),
            vec!["dictation_p99_within_1.5x_idle"]
        );
        assert!(!page_shown(&evidence(&slow)));
        slow.get_mut("dictation").unwrap().p99_ratio_to_idle = Some(3.2);
        assert!(page_shown(&evidence(&slow)));
        // A slow text lane is no page.
        let mut text = l.clone();
        text.get_mut("cleanup").unwrap().p99_ratio_to_idle = Some(9.0);
        assert!(!page_shown(&evidence(&text)));
        assert!(page_shown(&Evidence {
            lost: 1,
            ..evidence(&l)
        }));
        assert!(page_shown(&Evidence {
            oom_kills: Some(1),
            ..evidence(&l)
        }));
    }
}
