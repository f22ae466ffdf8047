//! Drawing the `top` screen. [`render`] paints a [`TopState`] into a frame of any size; [`draw`]
//! does one frame on any backend (a real terminal, or `TestBackend` in tests).

use ratatui::Frame;
use ratatui::Terminal;
use ratatui::backend::Backend;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Gauge, Paragraph, Row, Sparkline, Table};

use crate::state::{GpuView, HISTORY_WINDOW_MS, LanesView, TopState, share};

const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;

/// Draws one frame of `state` on `terminal`.
pub fn draw<B: Backend>(terminal: &mut Terminal<B>, state: &TopState) -> Result<(), B::Error> {
    terminal.draw(|frame| render(frame, state)).map(|_| ())
}

/// Paints the whole screen.
pub fn render(frame: &mut Frame, state: &TopState) {
    let area = frame.area();
    let lanes_height = match &state.lanes {
        LanesView::Off => 0,
        LanesView::Loaded(lanes) => (lanes.len() as u16).max(1) + 3,
        LanesView::Failed(_) => 3,
    };
    let [header, gpus, lanes, status] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Fill(1),
        Constraint::Length(lanes_height),
        Constraint::Length(1),
    ])
    .areas(area);

    let title = format!(
        "headroom top · {} · sort: {} · q quit · s sort",
        state.source,
        state.sort.label()
    );
    frame.render_widget(
        Paragraph::new(title).style(Style::default().add_modifier(Modifier::BOLD)),
        header,
    );

    if state.gpus.is_empty() {
        frame.render_widget(
            Paragraph::new("no samples yet").block(Block::default().borders(Borders::ALL)),
            gpus,
        );
    } else {
        // Each GPU gets room in proportion to what it needs (borders, bar, history, table).
        let weights = state
            .gpus
            .values()
            .map(|g| Constraint::Fill(gpu_rows_needed(g)));
        let areas = Layout::vertical(weights).split(gpus);
        for (gpu, area) in state.gpus.values().zip(areas.iter()) {
            render_gpu(frame, *area, state, gpu);
        }
    }
    if lanes_height > 0 {
        render_lanes(frame, lanes, &state.lanes);
    }
    if let Some(message) = &state.status {
        frame.render_widget(
            Paragraph::new(message.as_str()).style(Style::default().fg(Color::Yellow)),
            status,
        );
    }
}

/// Rows a GPU's box needs to show every process: borders, bar, history label, three rows of
/// sparkline, table header and one row per process.
pub fn gpu_rows_needed(gpu: &GpuView) -> u16 {
    let processes = gpu.latest.processes.len().min(u16::MAX as usize - 8) as u16;
    8 + processes
}

fn render_gpu(frame: &mut Frame, area: Rect, state: &TopState, gpu: &GpuView) {
    let s = &gpu.latest;
    let total = s.total();
    // A card is "GPU N · its name"; host RAM (a pool read from `headroom up`) is named alone.
    let label = if gpu.name == "host RAM" {
        gpu.name.clone()
    } else {
        format!("GPU {} · {}", s.gpu, gpu.name)
    };
    let mut title = format!(
        " {label} · {:.1}/{:.1} GiB ",
        s.used_bytes as f64 / GIB,
        total as f64 / GIB
    );
    if let Some(util) = s.utilization_percent {
        title.push_str(&format!("· util {util}% "));
    }
    let block = Block::default().borders(Borders::ALL).title(title);
    let inner = block.inner(area);
    frame.render_widget(block, area);

    let [bar, spark_label, spark, table] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Length(3),
        Constraint::Fill(1),
    ])
    .areas(inner);

    let ratio = share(s.used_bytes, total).clamp(0.0, 1.0);
    frame.render_widget(
        Gauge::default()
            .ratio(ratio)
            .label(format!(
                "{:.0} / {:.0} MiB ({:.1}%)",
                s.used_bytes as f64 / MIB,
                total as f64 / MIB,
                ratio * 100.0
            ))
            .gauge_style(Style::default().fg(gauge_colour(ratio))),
        bar,
    );

    let (low, high) = gpu
        .history
        .iter()
        .fold((u64::MAX, 0), |(lo, hi), (_, u)| (lo.min(*u), hi.max(*u)));
    let label = if gpu.history.is_empty() {
        "last 60 s: no history".to_string()
    } else {
        format!(
            "last 60 s: min {:.0} MiB, max {:.0} MiB",
            low as f64 / MIB,
            high as f64 / MIB
        )
    };
    frame.render_widget(Paragraph::new(label), spark_label);
    let columns = spark.width as usize;
    frame.render_widget(
        Sparkline::default()
            .data(sparkline_columns(gpu, columns, total))
            .max(total.max(1))
            .style(Style::default().fg(Color::Cyan)),
        spark,
    );

    let rows: Vec<Row> = state
        .sorted_processes(gpu)
        .into_iter()
        .map(|p| {
            Row::new(vec![
                p.pid.to_string(),
                if p.name.is_empty() {
                    "?".into()
                } else {
                    p.name
                },
                format!("{:.0}", p.used_bytes as f64 / MIB),
                format!("{:.1}%", share(p.used_bytes, total) * 100.0),
            ])
        })
        .collect();
    let table_widget = Table::new(
        rows,
        [
            Constraint::Length(8),
            Constraint::Fill(1),
            Constraint::Length(10),
            Constraint::Length(7),
        ],
    )
    .header(
        Row::new(vec!["PID", "NAME", "MiB", "SHARE"])
            .style(Style::default().add_modifier(Modifier::BOLD)),
    );
    frame.render_widget(table_widget, table);
}

/// One value per column: the highest `used` seen in that column's slice of the last 60 s, carried
/// forward through slices without samples; zero before the first sample.
fn sparkline_columns(gpu: &GpuView, columns: usize, total: u64) -> Vec<u64> {
    if columns == 0 {
        return Vec::new();
    }
    let end = gpu.latest.ts_ms;
    let start = end.saturating_sub(HISTORY_WINDOW_MS);
    let span = (end - start).max(1) as f64;
    let mut values: Vec<Option<u64>> = vec![None; columns];
    for (ts, used) in &gpu.history {
        let pos = ((ts.saturating_sub(start)) as f64 / span * columns as f64) as usize;
        let slot = &mut values[pos.min(columns - 1)];
        *slot = Some(slot.map_or(*used, |v| v.max(*used)));
    }
    let mut carried: Option<u64> = None;
    values
        .into_iter()
        .map(|v| {
            if v.is_some() {
                carried = v;
            }
            carried.unwrap_or(0).min(total.max(1))
        })
        .collect()
}

fn gauge_colour(ratio: f64) -> Color {
    if ratio >= 0.9 {
        Color::Red
    } else if ratio >= 0.75 {
        Color::Yellow
    } else {
        Color::Green
    }
}

fn render_lanes(frame: &mut Frame, area: Rect, lanes: &LanesView) {
    let block = Block::default()
        .borders(Borders::ALL)
        .title(" gateway lanes ");
    match lanes {
        LanesView::Off => {}
        LanesView::Failed(reason) => {
            frame.render_widget(
                Paragraph::new(Line::from(format!("unavailable: {reason}")))
                    .style(Style::default().fg(Color::Yellow))
                    .block(block),
                area,
            );
        }
        LanesView::Loaded(lanes) => {
            let of = |v: Option<u64>, max: Option<u64>| match (v, max) {
                (Some(v), Some(m)) => format!("{v}/{m}"),
                (Some(v), None) => v.to_string(),
                (None, _) => "-".into(),
            };
            let rows: Vec<Row> = lanes
                .iter()
                .map(|lane| {
                    Row::new(vec![
                        lane.name.clone(),
                        of(lane.inflight, lane.max_inflight),
                        of(lane.queued, lane.max_queue),
                        of(lane.rejected, None),
                    ])
                })
                .collect();
            let table = Table::new(
                rows,
                [
                    Constraint::Fill(1),
                    Constraint::Length(10),
                    Constraint::Length(10),
                    Constraint::Length(10),
                ],
            )
            .header(
                Row::new(vec!["LANE", "IN-FLIGHT", "QUEUED", "REJECTED"])
                    .style(Style::default().add_modifier(Modifier::BOLD)),
            )
            .block(block);
            frame.render_widget(table, area);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lanes::Lane;
    use headroom_gpu::Sample;
    use headroom_gpu::probe::ProcessMemory;
    use ratatui::backend::TestBackend;

    const GIB_U: u64 = 1 << 30;

    fn screen_text(terminal: &Terminal<TestBackend>) -> String {
        let buffer = terminal.backend().buffer();
        let width = buffer.area.width as usize;
        buffer
            .content()
            .chunks(width)
            .map(|row| {
                let line: String = row.iter().map(|cell| cell.symbol()).collect();
                line.trim_end().to_string()
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn state() -> TopState {
        let mut state = TopState::new("replay demo.jsonl");
        for k in 0..=60u64 {
            // 8 GiB for the first half minute, then 12 GiB.
            let used = if k < 30 { 8 * GIB_U } else { 12 * GIB_U };
            state.push(&Sample {
                ts_ms: 1_000_000 + k * 1000,
                gpu: 0,
                used_bytes: used,
                free_bytes: 24 * GIB_U - used,
                total_bytes: 24 * GIB_U,
                reserved_bytes: 0,
                name: Some("NVIDIA L4".into()),
                utilization_percent: Some(37),
                processes: vec![
                    ProcessMemory {
                        pid: 4242,
                        name: "vllm".into(),
                        used_bytes: used - 2 * GIB_U,
                    },
                    ProcessMemory {
                        pid: 777,
                        name: "whisper".into(),
                        used_bytes: 2 * GIB_U,
                    },
                ],
            });
        }
        state.lanes = LanesView::Loaded(vec![
            Lane {
                name: "audio".into(),
                inflight: Some(2),
                queued: Some(1),
                rejected: Some(5),
                max_inflight: Some(4),
                max_queue: Some(8),
            },
            Lane {
                name: "text".into(),
                inflight: Some(7),
                queued: None,
                rejected: None,
                max_inflight: None,
                max_queue: None,
            },
        ]);
        state
    }

    #[test]
    fn snapshot_of_one_gpu_with_lanes() {
        let mut terminal = Terminal::new(TestBackend::new(72, 20)).expect("terminal");
        draw(&mut terminal, &state()).expect("draw");
        let actual = screen_text(&terminal);
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/snapshots/one_gpu_with_lanes.txt"
        );
        // Review the change, then rerun with HEADROOM_UPDATE_SNAPSHOTS=1 to accept it.
        if std::env::var_os("HEADROOM_UPDATE_SNAPSHOTS").is_some() {
            std::fs::write(path, format!("{actual}\n")).expect("write snapshot");
        }
        let expected = std::fs::read_to_string(path).expect("snapshot file");
        assert_eq!(
            actual.trim_end_matches('\n'),
            expected.trim_end_matches('\n')
        );
    }

    #[test]
    fn sort_key_changes_the_drawn_table() {
        let mut state = state();
        let mut terminal = Terminal::new(TestBackend::new(72, 20)).expect("terminal");
        draw(&mut terminal, &state).expect("draw");
        let text = screen_text(&terminal);
        assert!(text.find("vllm").unwrap() < text.find("whisper").unwrap());
        state.cycle_sort();
        draw(&mut terminal, &state).expect("draw");
        let text = screen_text(&terminal);
        assert!(text.contains("sort: pid"));
        assert!(
            text.find("whisper").unwrap() < text.find("vllm").unwrap(),
            "{text}"
        );
    }

    #[test]
    fn failed_lanes_and_empty_state_draw_without_panicking() {
        let mut state = TopState::new("nvml");
        state.lanes = LanesView::Failed("connection refused".into());
        state.status = Some("no NVIDIA driver: libnvidia-ml.so.1: cannot open".into());
        for (w, h) in [(80, 24), (20, 5), (1, 1)] {
            let mut terminal = Terminal::new(TestBackend::new(w, h)).expect("terminal");
            draw(&mut terminal, &state).expect("draw");
        }
        let mut terminal = Terminal::new(TestBackend::new(80, 12)).expect("terminal");
        draw(&mut terminal, &state).expect("draw");
        let text = screen_text(&terminal);
        assert!(text.contains("no samples yet"));
        assert!(text.contains("unavailable: connection refused"));
        assert!(text.contains("no NVIDIA driver"));
    }

    #[test]
    fn sparkline_columns_show_the_step_in_the_right_half() {
        let state = state();
        let columns = sparkline_columns(&state.gpus[&0], 60, 24 * GIB_U);
        assert_eq!(columns.len(), 60);
        assert_eq!(columns[5], 8 * GIB_U);
        assert_eq!(columns[55], 12 * GIB_U);
        let first_high = columns.iter().position(|v| *v == 12 * GIB_U).unwrap();
        assert!((29..=31).contains(&first_high), "{first_high}");
    }
}
