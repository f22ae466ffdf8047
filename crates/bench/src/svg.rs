//! SVG charts written by hand (no plotting dependency): the latency CDF per request kind, and GPU
//! memory over time with the request timeline under it on the same time axis. The building blocks
//! (header, frame and axes, polyline, nice ticks) are public: `headroom drill`'s timeline uses them.

use std::fmt::Write as _;

use crate::report::Report;

/// Width of every chart.
pub const W: f64 = 760.0;
/// Series colours, in order.
pub const PALETTE: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
];

/// Escapes text for XML content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// The SVG head: size, white background and the centred title.
pub fn header(out: &mut String, h: f64, title: &str) {
    let _ = writeln!(
        out,
        r#"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif" font-size="12">
<rect x="0" y="0" width="{W}" height="{h}" fill="white"/>
<text x="{}" y="20" text-anchor="middle" font-size="15">{}</text>"#,
        W / 2.0,
        escape(title)
    );
}

/// A "nice" upper bound and tick step for an axis ending at `max`.
pub fn nice(max: f64) -> (f64, f64) {
    if !(max.is_finite() && max > 0.0) {
        return (1.0, 0.2);
    }
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| s * 5.0 >= max)
        .unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

/// A tick label: whole numbers bare, others with up to two decimals.
pub fn fmt_tick(v: f64) -> String {
    if v.abs() >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}

/// A plotting area in pixels (`x0..x1`, `y0..y1`) and the data ranges it shows.
pub struct Frame {
    pub x0: f64,
    pub x1: f64,
    pub y0: f64,
    pub y1: f64,
    pub xmax: f64,
    pub ymax: f64,
    pub xmin: f64,
}

impl Frame {
    pub fn x(&self, v: f64) -> f64 {
        self.x0 + (v - self.xmin) / (self.xmax - self.xmin).max(1e-12) * (self.x1 - self.x0)
    }
    pub fn y(&self, v: f64) -> f64 {
        self.y1 - v / self.ymax.max(1e-12) * (self.y1 - self.y0)
    }
    /// Frame, grid, tick labels and axis titles.
    pub fn axes(&self, out: &mut String, xstep: f64, ystep: f64, xlabel: &str, ylabel: &str) {
        let _ = writeln!(
            out,
            r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
            self.x0,
            self.y0,
            self.x1 - self.x0,
            self.y1 - self.y0
        );
        let mut v = (self.xmin / xstep).ceil() * xstep;
        while v <= self.xmax + 1e-9 {
            let x = self.x(v);
            let _ = writeln!(
                out,
                r##"<line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
                self.y0,
                self.y1,
                self.y1 + 15.0,
                fmt_tick(v)
            );
            v += xstep;
        }
        let mut v = 0.0;
        while v <= self.ymax + 1e-9 && ystep > 0.0 {
            let y = self.y(v);
            let _ = writeln!(
                out,
                r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                self.x0,
                self.x1,
                self.x0 - 5.0,
                y + 4.0,
                fmt_tick(v)
            );
            v += ystep;
        }
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            (self.x0 + self.x1) / 2.0,
            self.y1 + 32.0,
            escape(xlabel)
        );
        let _ = writeln!(
            out,
            r#"<text x="15" y="{:.1}" text-anchor="middle" transform="rotate(-90 15 {:.1})">{}</text>"#,
            (self.y0 + self.y1) / 2.0,
            (self.y0 + self.y1) / 2.0,
            escape(ylabel)
        );
    }
}

/// A line through `points` (pixels).
pub fn polyline(points: &[(f64, f64)], colour: &str, dashed: bool) -> String {
    let pts: Vec<String> = points
        .iter()
        .map(|(x, y)| format!("{x:.1},{y:.1}"))
        .collect();
    format!(
        r#"<polyline fill="none" stroke="{colour}" stroke-width="2"{} points="{}"/>"#,
        if dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        },
        pts.join(" ")
    )
}

/// Latency CDF per request kind: E2E solid, TTFT dashed.
pub fn latency_cdf(report: &Report) -> String {
    let h = 440.0;
    let mut out = String::new();
    header(&mut out, h, &format!("Latency CDF — {}", report.scenario));
    let xmax_raw = report
        .by_kind
        .iter()
        .flat_map(|k| k.e2e_cdf.iter().chain(k.ttft_cdf.iter()))
        .map(|p| p[0])
        .fold(0.0, f64::max);
    let (xmax, xstep) = nice(xmax_raw);
    let f = Frame {
        x0: 70.0,
        x1: W - 190.0,
        y0: 40.0,
        y1: h - 50.0,
        xmin: 0.0,
        xmax,
        ymax: 1.0,
    };
    f.axes(
        &mut out,
        xstep,
        0.2,
        "latency (ms)",
        "fraction of ok requests",
    );
    let mut legend = 0;
    for (i, k) in report.by_kind.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        for (cdf, dashed, label) in [(&k.e2e_cdf, false, "e2e"), (&k.ttft_cdf, true, "ttft")] {
            if cdf.is_empty() {
                continue;
            }
            let mut pts = vec![(f.x(0.0), f.y(0.0))];
            let mut prev = 0.0;
            for p in cdf {
                pts.push((f.x(p[0]), f.y(prev)));
                pts.push((f.x(p[0]), f.y(p[1])));
                prev = p[1];
            }
            let _ = writeln!(out, "{}", polyline(&pts, colour, dashed));
            let ly = 50.0 + legend as f64 * 18.0;
            let _ = writeln!(
                out,
                r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="2"{}/><text x="{}" y="{}">{} {}</text>"#,
                W - 180.0,
                W - 155.0,
                if dashed {
                    r#" stroke-dasharray="6 4""#
                } else {
                    ""
                },
                W - 150.0,
                ly + 4.0,
                escape(&k.name),
                label
            );
            legend += 1;
        }
    }
    if legend == 0 {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">no successful requests</text>"#,
            (f.x0 + f.x1) / 2.0,
            (f.y0 + f.y1) / 2.0
        );
    }
    out.push_str("</svg>\n");
    out
}

fn outcome_colour(outcome: &str) -> &'static str {
    match outcome {
        "ok" => "#2ca02c",
        "http_429" => "#ff7f0e",
        "http_503" | "http_504" => "#9467bd",
        _ => "#d62728",
    }
}

/// GPU memory over time (top) and one lane per request kind with every request as a bar (bottom).
pub fn gpu_memory_timeline(report: &Report) -> String {
    let names: Vec<&str> = report.by_kind.iter().map(|k| k.name.as_str()).collect();
    let lane_h = 16.0;
    let mem_top = 40.0;
    let mem_bottom = 260.0;
    let lanes_top = mem_bottom + 45.0;
    let lanes_bottom = lanes_top + lane_h * names.len().max(1) as f64;
    let h = lanes_bottom + 60.0;
    let mut out = String::new();
    header(
        &mut out,
        h,
        &format!("{} and requests — {}", report.gpu.label(), report.scenario),
    );
    let series = &report.gpu.series;
    let tmin = series
        .first()
        .map(|p| p.t_ms as f64 / 1000.0)
        .unwrap_or(0.0)
        .min(0.0);
    let tmax_raw = series
        .iter()
        .map(|p| p.t_ms as f64 / 1000.0)
        .chain(report.timeline.iter().map(|t| t.end_ms / 1000.0))
        .fold(report.duration_s, f64::max);
    let (tspan, tstep) = nice(tmax_raw - tmin);
    let tmax = tmin + tspan;
    let mib = |b: u64| b as f64 / 1048576.0;
    let ymax_raw = series.iter().map(|p| mib(p.used_bytes)).fold(0.0, f64::max);
    let (ymax, ystep) = nice(ymax_raw);
    let mem = Frame {
        x0: 80.0,
        x1: W - 30.0,
        y0: mem_top,
        y1: mem_bottom,
        xmin: tmin,
        xmax: tmax,
        ymax,
    };
    mem.axes(&mut out, tstep, ystep, "time (s)", "used (MiB)");
    if report.gpu.available && !series.is_empty() {
        let pts: Vec<(f64, f64)> = series
            .iter()
            .map(|p| (mem.x(p.t_ms as f64 / 1000.0), mem.y(mib(p.used_bytes))))
            .collect();
        let _ = writeln!(out, "{}", polyline(&pts, "#1f77b4", false));
        if let Some(b) = report.gpu.baseline_bytes {
            let y = mem.y(mib(b));
            let _ = writeln!(
                out,
                r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#888" stroke-dasharray="3 3"/><text x="{}" y="{:.1}" fill="#555">baseline</text>"##,
                mem.x0,
                mem.x1,
                mem.x0 + 4.0,
                y - 4.0
            );
        }
    } else {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">GPU memory not sampled: {}</text>"#,
            (mem.x0 + mem.x1) / 2.0,
            (mem.y0 + mem.y1) / 2.0,
            escape(report.gpu.reason.as_deref().unwrap_or("unknown reason"))
        );
    }
    let lanes = Frame {
        x0: mem.x0,
        x1: mem.x1,
        y0: lanes_top,
        y1: lanes_bottom,
        xmin: tmin,
        xmax: tmax,
        ymax: 1.0,
    };
    let _ = writeln!(
        out,
        r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
        lanes.x0,
        lanes.y0,
        lanes.x1 - lanes.x0,
        lanes.y1 - lanes.y0
    );
    for (i, name) in names.iter().enumerate() {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            lanes.x0 - 5.0,
            lanes_top + lane_h * (i as f64 + 0.7),
            escape(name)
        );
    }
    for t in &report.timeline {
        let lane = names.iter().position(|n| *n == t.name).unwrap_or(0);
        let x = lanes.x(t.start_ms / 1000.0);
        let w = (lanes.x(t.end_ms / 1000.0) - x).max(0.5);
        let _ = writeln!(
            out,
            r#"<rect x="{x:.1}" y="{:.1}" width="{w:.1}" height="{:.1}" fill="{}" fill-opacity="0.35"/>"#,
            lanes_top + lane_h * lane as f64 + 2.0,
            lane_h - 4.0,
            outcome_colour(&t.outcome)
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">requests by kind (green ok, orange 429, purple 503/504, red other errors); time (s)</text>"#,
        (lanes.x0 + lanes.x1) / 2.0,
        lanes_bottom + 20.0
    );
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_handles_markup() {
        assert_eq!(escape("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }

    #[test]
    fn nice_axes_cover_the_maximum() {
        for max in [0.3, 7.0, 12.0, 250.0, 1234.5] {
            let (top, step) = nice(max);
            assert!(top >= max && top <= max * 2.6, "{max} -> {top}");
            assert!((top / step).round() <= 10.0);
        }
    }
}
