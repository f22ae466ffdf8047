//! The night as one SVG on one time axis: each backend's memory, the pool's usage and the
//! co-tenant against the limit (top); every served request's latency as a multiple of its lane's
//! idle figure, with the 1.5× and 3× lines (middle); refusals, stopped streams, failures and lost
//! requests per lane (bottom). Faults are vertical lines through all three, quiet gaps are shaded.
//! Drawn with `headroom-bench`'s SVG building blocks.

use std::fmt::Write as _;

use headroom_bench::svg::{Frame, PALETTE, W, escape, header, nice, polyline};

use crate::client::{End, Final, Record};
use crate::report::Report;

const MIB: f64 = 1048576.0;

/// `points` without the inner points of each run at one height (as drawn, to a tenth of a
/// pixel): the same line, drawn from its corners only. A night samples memory once a second and
/// it is flat most of the time: an hour's timeline drops from about 350 kB to a few tens.
fn flat_runs_thinned(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let level = |p: &(f64, f64)| (p.1 * 10.0).round() as i64;
    points
        .iter()
        .enumerate()
        .filter(|(i, p)| {
            let before = i.checked_sub(1).and_then(|j| points.get(j));
            let after = points.get(i + 1);
            match (before, after) {
                (Some(b), Some(a)) => level(b) != level(p) || level(a) != level(p),
                _ => true,
            }
        })
        .map(|(_, p)| *p)
        .collect()
}

/// Quiet gaps as `(from_s, to_s)` on the drill's clock.
pub type Gaps = [(f64, f64)];

/// The timeline SVG of `report` with its requests and quiet gaps; `streams` names the night's
/// streams in the records' order.
pub fn svg(report: &Report, records: &[Record], gaps: &Gaps, streams: &[String]) -> String {
    let lanes: Vec<&String> = report.lanes.keys().collect();
    let t0 = report.night_start_s;
    let t_end = records
        .iter()
        .filter(|r| r.round.is_some())
        .map(Record::ended_s)
        .chain(report.faults.iter().map(|f| f.end_s))
        .fold(t0 + report.night_s, f64::max);
    let (span, tstep) = nice(t_end - t0);
    let row_h = 14.0;
    let mem = (40.0, 250.0);
    let lat = (290.0, 470.0);
    let ev = (510.0, 510.0 + row_h * lanes.len().max(1) as f64);
    let h = ev.1 + 70.0;
    let mut o = String::new();
    header(
        &mut o,
        h,
        &format!("{} — {}", report.scenario, report.mode.as_str()),
    );
    let frame = |(y0, y1): (f64, f64), ymax: f64| Frame {
        x0: 80.0,
        x1: W - 150.0,
        y0,
        y1,
        xmin: 0.0,
        xmax: span,
        ymax,
    };

    // Memory.
    let samples: Vec<_> = report.samples.iter().filter(|s| s.t_s >= t0).collect();
    let top = samples
        .iter()
        .flat_map(|s| {
            s.backends
                .values()
                .flatten()
                .copied()
                .chain(s.pool_bytes)
                .chain(s.backends_total())
        })
        .chain(report.memory.limit_bytes)
        .fold(0u64, u64::max) as f64
        / MIB;
    let (ymax, ystep) = nice(top * 1.05);
    let f = frame(mem, ymax);
    shade_gaps(&mut o, &f, gaps, t0);
    f.axes(&mut o, tstep, ystep, "", "memory (MiB)");
    let mut legend = Vec::new();
    let names: Vec<&String> = samples
        .first()
        .map(|s| s.backends.keys().collect())
        .unwrap_or_default();
    for (i, name) in names.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        for run in runs(
            samples
                .iter()
                .map(|s| (s.t_s - t0, s.backends.get(*name).copied().flatten())),
        ) {
            let pts: Vec<_> = run
                .iter()
                .map(|(t, b)| (f.x(*t), f.y(*b as f64 / MIB)))
                .collect();
            let _ = writeln!(o, "{}", polyline(&flat_runs_thinned(&pts), colour, false));
        }
        legend.push((colour, name.to_string(), false));
    }
    for run in runs(samples.iter().map(|s| (s.t_s - t0, s.pool_bytes))) {
        let pts: Vec<_> = run
            .iter()
            .map(|(t, b)| (f.x(*t), f.y(*b as f64 / MIB)))
            .collect();
        let _ = writeln!(
            o,
            "{}",
            polyline(&flat_runs_thinned(&pts), "#000000", false)
        );
    }
    if samples.iter().any(|s| s.pool_bytes.is_some()) {
        legend.push(("#000000", "pool (cgroup)".into(), false));
    }
    for run in runs(samples.iter().map(|s| (s.t_s - t0, s.co_tenant_bytes))) {
        let pts: Vec<_> = run
            .iter()
            .map(|(t, b)| (f.x(*t), f.y(*b as f64 / MIB)))
            .collect();
        let _ = writeln!(o, "{}", polyline(&flat_runs_thinned(&pts), "#7f7f7f", true));
    }
    if samples.iter().any(|s| s.co_tenant_bytes.is_some()) {
        legend.push(("#7f7f7f", "co-tenant".into(), true));
    }
    if let Some(limit) = report.memory.limit_bytes {
        let y = f.y(limit as f64 / MIB);
        let _ = writeln!(
            o,
            r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#d62728" stroke-width="2" stroke-dasharray="8 4"/>"##,
            f.x0, f.x1
        );
        legend.push(("#d62728", "limit".into(), true));
    }
    draw_legend(&mut o, &legend, f.x1 + 10.0, mem.0 + 10.0);

    // Latency over idle.
    let idle: Vec<Option<f64>> = lanes.iter().map(|n| report.lanes[*n].idle_p50_s).collect();
    let points: Vec<(usize, f64, f64)> = records
        .iter()
        .filter(|r| r.round.is_some())
        .filter_map(|r| {
            let name = streams.get(r.stream)?;
            let i = lanes.iter().position(|n| *n == name)?;
            let ratio = r.served_secs()? / idle[i].filter(|x| *x > 0.0)?;
            Some((i, r.sent_s() - t0, ratio))
        })
        .collect();
    let rmax = points.iter().map(|p| p.2).fold(4.0, f64::max).min(50.0);
    let (ymax, ystep) = nice(rmax);
    let f = frame(lat, ymax);
    shade_gaps(&mut o, &f, gaps, t0);
    f.axes(&mut o, tstep, ystep, "", "latency ÷ idle p50");
    for (ratio, label) in [(1.5, "1.5×"), (3.0, "3×")] {
        let y = f.y(ratio);
        let _ = writeln!(
            o,
            r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#444" stroke-dasharray="2 3"/><text x="{}" y="{:.1}" fill="#444">{label}</text>"##,
            f.x0,
            f.x1,
            f.x1 + 4.0,
            y + 4.0
        );
    }
    for (i, t, r) in &points {
        let _ = writeln!(
            o,
            r#"<circle cx="{:.1}" cy="{:.1}" r="2.2" fill="{}" fill-opacity="0.7"/>"#,
            f.x(*t),
            f.y(r.min(ymax)),
            PALETTE[i % PALETTE.len()]
        );
    }
    let legend: Vec<(&str, String, bool)> = lanes
        .iter()
        .enumerate()
        .map(|(i, n)| (PALETTE[i % PALETTE.len()], n.to_string(), false))
        .collect();
    draw_legend(&mut o, &legend, f.x1 + 30.0, lat.0 + 10.0);

    // Refusals and losses.
    let f = frame(ev, 1.0);
    shade_gaps(&mut o, &f, gaps, t0);
    let _ = writeln!(
        o,
        r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
        f.x0,
        ev.0,
        f.x1 - f.x0,
        ev.1 - ev.0
    );
    for (i, n) in lanes.iter().enumerate() {
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            f.x0 - 5.0,
            ev.0 + row_h * (i as f64 + 0.8),
            escape(n)
        );
    }
    for r in records.iter().filter(|r| r.round.is_some()) {
        let Some(name) = streams.get(r.stream) else {
            continue;
        };
        let Some(i) = lanes.iter().position(|n| *n == name) else {
            continue;
        };
        let y = ev.0 + row_h * i as f64 + 2.0;
        let mut mark = |t: f64, colour: &str| {
            let _ = writeln!(
                o,
                r#"<rect x="{:.1}" y="{y:.1}" width="2" height="{:.1}" fill="{colour}"/>"#,
                f.x(t - t0) - 1.0,
                row_h - 4.0
            );
        };
        for a in &r.attempts {
            match a.end {
                End::Refused {
                    retry_after_s: Some(_),
                    ..
                } => mark(a.start_s, "#ff7f0e"),
                End::Refused {
                    retry_after_s: None,
                    ..
                } => mark(a.start_s, "#8c564b"),
                End::Stopped { .. } => mark(a.start_s + a.secs, "#1f77b4"),
                _ => {}
            }
        }
        match r.outcome {
            Final::Lost => mark(r.ended_s(), "#d62728"),
            Final::Failed => mark(r.ended_s(), "#9467bd"),
            _ => {}
        }
    }
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">orange: refused with Retry-After · brown: without · blue: stopped · purple: failed · red: lost</text>"#,
        (f.x0 + f.x1) / 2.0,
        ev.1 + 20.0
    );
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time (s) from the night's start, ticks every {} s</text>"#,
        (f.x0 + f.x1) / 2.0,
        ev.1 + 36.0,
        headroom_bench::svg::fmt_tick(tstep)
    );

    // Faults through every panel.
    for (n, fault) in report.faults.iter().enumerate() {
        let x = f.x(fault.at_s - t0);
        let _ = writeln!(
            o,
            r##"<line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{}" stroke="#d62728" stroke-opacity="0.6"/><text x="{:.1}" y="{}" font-size="10" fill="#d62728">{}</text>"##,
            mem.0,
            ev.1,
            x + 2.0,
            mem.0 + 10.0 + 11.0 * (n % 4) as f64,
            escape(fault.kind)
        );
        if fault.kind == "co_tenant" {
            let x1 = f.x(fault.end_s - t0);
            let _ = writeln!(
                o,
                r##"<rect x="{x:.1}" y="{}" width="{:.1}" height="{}" fill="#7f7f7f" fill-opacity="0.08"/>"##,
                mem.0,
                (x1 - x).max(0.5),
                mem.1 - mem.0
            );
        }
    }
    o.push_str("</svg>\n");
    o
}

/// Consecutive points with a value, as separate runs (a gap where the value is missing).
fn runs(points: impl Iterator<Item = (f64, Option<u64>)>) -> Vec<Vec<(f64, u64)>> {
    let mut out = vec![Vec::new()];
    for (t, v) in points {
        match v {
            Some(v) => out.last_mut().expect("never empty").push((t, v)),
            None if !out.last().expect("never empty").is_empty() => out.push(Vec::new()),
            None => {}
        }
    }
    out.retain(|r| !r.is_empty());
    out
}

fn shade_gaps(o: &mut String, f: &Frame, gaps: &Gaps, t0: f64) {
    for (a, b) in gaps {
        let x = f.x(a - t0);
        let w = (f.x(b - t0) - x).max(0.5);
        let _ = writeln!(
            o,
            r##"<rect x="{x:.1}" y="{}" width="{w:.1}" height="{}" fill="#000" fill-opacity="0.05"/>"##,
            f.y0,
            f.y1 - f.y0
        );
    }
}

fn draw_legend(o: &mut String, items: &[(&str, String, bool)], x: f64, y: f64) {
    for (i, (colour, label, dashed)) in items.iter().enumerate() {
        let ly = y + i as f64 * 16.0;
        let _ = writeln!(
            o,
            r#"<line x1="{x}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="2"{}/><text x="{}" y="{}" font-size="11">{}</text>"#,
            x + 18.0,
            if *dashed {
                r#" stroke-dasharray="5 3""#
            } else {
                ""
            },
            x + 22.0,
            ly + 4.0,
            escape(label)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_break_where_a_value_is_missing() {
        let r = runs(
            vec![
                (0.0, Some(1)),
                (1.0, Some(2)),
                (2.0, None),
                (3.0, Some(4)),
                (4.0, None),
            ]
            .into_iter(),
        );
        assert_eq!(r, vec![vec![(0.0, 1), (1.0, 2)], vec![(3.0, 4)]]);
    }

    #[test]
    fn a_flat_run_keeps_its_ends_and_every_corner() {
        let pts = [
            (0.0, 10.0),
            (1.0, 10.0),
            (2.0, 10.02), // the same tenth of a pixel
            (3.0, 10.0),
            (4.0, 12.0),
            (5.0, 12.0),
            (6.0, 12.0),
            (7.0, 10.0),
        ];
        assert_eq!(
            flat_runs_thinned(&pts),
            vec![
                (0.0, 10.0),
                (3.0, 10.0),
                (4.0, 12.0),
                (6.0, 12.0),
                (7.0, 10.0)
            ]
        );
        assert_eq!(flat_runs_thinned(&pts[..1]), vec![(0.0, 10.0)]);
        assert!(flat_runs_thinned(&[]).is_empty());
    }
}
