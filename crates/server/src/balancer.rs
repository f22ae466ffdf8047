//! Signals for a stock load balancer in front of several boxes: the box's load figure (from the
//! gate, see `headroom_gate::load`), refreshed on a timer together with which lanes can serve;
//! HAProxy's agent-check protocol on an optional TCP listener (`[balancer] agent_listen`), and
//! Envoy's ORCA `endpoint-load-metrics` response header (`[balancer] load_header`). Each box stays
//! the authority on its own admission; these only help the balancer choose the box with room.
//!
//! Every answer is read from the last refreshed [`Signal`]: the agent and the header never wait
//! on an upstream or take the gate's lock.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderValue;
use headroom_gate::{BoxLoad, box_load};
use serde::Serialize;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::state::AppState;

/// What the balancer is told, refreshed every `interval`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Signal {
    pub load: BoxLoad,
    /// Requests admitted per second over the last refresh.
    pub rps: f64,
    /// The highest KV-cache usage any engine behind the box reports.
    pub kv_cache_usage: Option<f64>,
    /// Lanes with no usable upstream right now (down, or ejected by passive health).
    pub unservable_lanes: Vec<String>,
    /// Lanes in all.
    pub lanes: usize,
    /// Seconds since the refresh this signal came from.
    #[serde(skip)]
    pub at: Option<Instant>,
}

impl Signal {
    fn initial() -> Signal {
        Signal {
            load: BoxLoad {
                figure: 0.0,
                lanes: 0.0,
                busiest_lane: 0.0,
                memory: 0.0,
                audio_busy: false,
                queued: 0,
                inflight: 0,
                draining: false,
                parts: Vec::new(),
            },
            rps: 0.0,
            kv_cache_usage: None,
            unservable_lanes: Vec::new(),
            lanes: 0,
            at: None,
        }
    }

    /// One line of HAProxy's agent-check protocol: `drain` while shutting down, `down#why` when
    /// no lane can serve, else `up ready W%` (`up` and `ready` undo an earlier `down`/`drain`).
    pub(crate) fn agent_line(&self) -> String {
        if self.load.draining {
            return "drain#shutting down\n".to_string();
        }
        if self.lanes > 0 && self.unservable_lanes.len() == self.lanes {
            return format!(
                "down#no lane can serve ({})\n",
                self.unservable_lanes.join(", ")
            );
        }
        format!("up ready {}%\n", self.load.weight_percent())
    }

    /// The ORCA load report in Envoy's TEXT form: `TEXT key=value,…` with the box figure as
    /// `application_utilization`, admitted requests per second as `rps_fractional`, and the parts
    /// as `named_metrics.*`.
    pub(crate) fn orca_value(&self) -> String {
        let mut fields = vec![
            format!("application_utilization={:.4}", self.load.figure),
            format!("rps_fractional={:.3}", self.rps),
            format!("named_metrics.lanes={:.4}", self.load.lanes),
            format!("named_metrics.memory={:.4}", self.load.memory),
            format!("named_metrics.queue_depth={}", self.load.queued),
            format!("named_metrics.inflight={}", self.load.inflight),
            format!(
                "named_metrics.audio_busy={}",
                u8::from(self.load.audio_busy)
            ),
        ];
        if let Some(kv) = self.kv_cache_usage {
            fields.push(format!("named_metrics.kv_cache_usage={kv:.4}"));
        }
        format!("TEXT {}", fields.join(","))
    }
}

/// The shared, last refreshed signal, and its ORCA header value built at the refresh (every
/// response carries it when `[balancer] load_header` is on: it is cloned, never formatted, per
/// response).
#[derive(Debug)]
pub(crate) struct Signals {
    current: Mutex<Signal>,
    orca: Mutex<Option<HeaderValue>>,
}

impl Default for Signals {
    fn default() -> Self {
        let signal = Signal::initial();
        Signals {
            orca: Mutex::new(orca_header(&signal)),
            current: Mutex::new(signal),
        }
    }
}

/// The ORCA header value of a signal (`None` if it were no valid header value).
fn orca_header(signal: &Signal) -> Option<HeaderValue> {
    HeaderValue::from_str(&signal.orca_value()).ok()
}

impl Signals {
    pub(crate) fn get(&self) -> Signal {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The last refresh's ORCA header value.
    pub(crate) fn orca(&self) -> Option<HeaderValue> {
        self.orca.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, signal: Signal) {
        let orca = orca_header(&signal);
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = signal;
        *self.orca.lock().unwrap_or_else(|p| p.into_inner()) = orca;
    }
}

/// The lanes the gate yields to (audio): their work makes the box "audio busy".
fn yield_targets(s: &AppState) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for lane in &s.core.config.lanes {
        for t in &lane.spec.yield_to {
            if !out.contains(t) {
                out.push(t.clone());
            }
        }
    }
    out
}

/// Refreshes the signal every `interval`, forever: the load figure from the gate's snapshot, the
/// admitted rate, and which lanes can serve (each upstream's `/health`, with the interval as its
/// timeout, and passive health).
pub(crate) async fn signal_loop(s: Arc<AppState>) {
    let interval = s.core.config.balancer.interval;
    let targets = yield_targets(&s);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Option<(Instant, u64)> = None;
    let mut rps = 0.0;
    loop {
        tick.tick().await;
        let readiness = crate::readiness::lane_readiness(&s, interval).await;
        let snapshot = s.core.gate.snapshot();
        let now = Instant::now();
        let admitted: u64 = snapshot.lanes.iter().map(|l| l.admitted).sum();
        if let Some((then, before)) = last {
            let dt = now.saturating_duration_since(then).as_secs_f64();
            if dt > 0.0 {
                let sample = admitted.saturating_sub(before) as f64 / dt;
                rps = 0.5 * rps + 0.5 * sample;
            }
        }
        last = Some((now, admitted));
        let kv_cache_usage = snapshot
            .lanes
            .iter()
            .flat_map(|l| l.upstreams.iter().filter_map(|u| u.kv_cache_usage))
            .reduce(f64::max);
        let unservable_lanes = readiness
            .iter()
            .filter(|l| !l.ready)
            .map(|l| l.name.clone())
            .collect();
        s.balancer.set(Signal {
            load: box_load(&snapshot, &targets),
            rps,
            kv_cache_usage,
            unservable_lanes,
            lanes: readiness.len(),
            at: Some(now),
        });
    }
}

/// Binds the agent-check listener.
pub(crate) async fn bind_agent(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Answers HAProxy's agent checks: each connection gets one line, then the socket is closed.
pub(crate) async fn agent_loop(listener: TcpListener, s: Arc<AppState>) {
    loop {
        let Ok((mut socket, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let line = s.balancer.get().agent_line();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(2), async {
                let _ = socket.write_all(line.as_bytes()).await;
                let _ = socket.shutdown().await;
            })
            .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signal(figure: f64) -> Signal {
        let mut s = Signal::initial();
        s.load.figure = figure;
        s.lanes = 2;
        s
    }

    #[test]
    fn agent_lines_follow_haproxys_protocol() {
        assert_eq!(signal(0.0).agent_line(), "up ready 100%\n");
        assert_eq!(signal(0.25).agent_line(), "up ready 75%\n");
        // A full box keeps a sliver of weight: 0 % would take it out like `drain`.
        assert_eq!(signal(1.0).agent_line(), "up ready 1%\n");
        let mut draining = signal(0.2);
        draining.load.draining = true;
        assert_eq!(draining.agent_line(), "drain#shutting down\n");
        let mut one_down = signal(0.2);
        one_down.unservable_lanes = vec!["audio".into()];
        assert_eq!(
            one_down.agent_line(),
            "up ready 80%\n",
            "another lane still serves"
        );
        one_down.unservable_lanes.push("text".into());
        assert_eq!(
            one_down.agent_line(),
            "down#no lane can serve (audio, text)\n"
        );
    }

    #[test]
    fn orca_text_has_the_fields_envoy_reads() {
        let mut s = signal(0.5);
        s.rps = 12.25;
        s.kv_cache_usage = Some(0.3);
        s.load.queued = 3;
        let v = s.orca_value();
        assert!(v.starts_with("TEXT "), "{v}");
        let fields: Vec<&str> = v["TEXT ".len()..].split(',').collect();
        assert!(fields.contains(&"application_utilization=0.5000"), "{v}");
        assert!(fields.contains(&"rps_fractional=12.250"), "{v}");
        assert!(
            fields.contains(&"named_metrics.kv_cache_usage=0.3000"),
            "{v}"
        );
        assert!(fields.contains(&"named_metrics.queue_depth=3"), "{v}");
    }

    #[test]
    fn the_orca_header_is_built_at_the_refresh() {
        let signals = Signals::default();
        assert_eq!(
            signals.orca().unwrap(),
            Signal::initial().orca_value().as_str()
        );
        let mut s = signal(0.5);
        s.rps = 3.0;
        signals.set(s.clone());
        assert_eq!(signals.orca().unwrap(), s.orca_value().as_str());
    }
}
