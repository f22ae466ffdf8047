//! The gateway's metrics keep bounded memory when nobody scrapes `/metrics`: recorded histogram
//! samples wait in a list until an upkeep folds them into buckets, and the gateway runs that
//! upkeep on a timer. Its own test binary, so this process's RSS is the registry's alone.

use std::time::Duration;

use headroom_server::telemetry::{TTFT_SECONDS, Telemetry};

fn rss_bytes() -> i64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: i64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kib * 1024
}

/// Records `rounds` × 100,000 samples, pausing between rounds so a running upkeep can fold them.
async fn record(t: &Telemetry, rounds: usize) {
    let h = t.histogram(TTFT_SECONDS, &[("lane", "text")]);
    for _ in 0..rounds {
        for i in 0..100_000 {
            h.record((i % 1000) as f64 / 1000.0);
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histogram_samples_do_not_pile_up_without_a_scrape() {
    // With the upkeep task: 2,000,000 samples (16 MB if they were kept) leave RSS flat.
    let kept = std::sync::Arc::new(Telemetry::new());
    let upkeep = tokio::spawn(kept.clone().upkeep_loop(Duration::from_millis(10)));
    record(&kept, 2).await; // warm-up: the series, the allocator
    let before = rss_bytes();
    record(&kept, 20).await;
    let with_upkeep = rss_bytes() - before;
    upkeep.abort();
    // Without it (the defect): the same samples pile up until someone scrapes.
    let piling = Telemetry::new();
    let before = rss_bytes();
    record(&piling, 20).await;
    let without_upkeep = rss_bytes() - before;
    eprintln!(
        "RSS growth over 2,000,000 samples: {:+.2} MiB with upkeep, {:+.2} MiB without",
        with_upkeep as f64 / 1048576.0,
        without_upkeep as f64 / 1048576.0
    );
    assert!(
        without_upkeep > 8 << 20,
        "the measurement cannot see the samples pile up ({without_upkeep} bytes)"
    );
    assert!(
        with_upkeep < 2 << 20,
        "RSS grew {with_upkeep} bytes with the upkeep running"
    );
    // A scrape folds them too (what kept memory bounded before only when someone scraped).
    let empty = headroom_gate::GateSnapshot {
        lanes: Vec::new(),
        total_inflight: 0,
        max_inflight_total: None,
        draining: false,
        memory: Vec::new(),
    };
    let text = piling.render(&empty);
    assert!(
        text.contains("headroom_ttft_seconds_count{lane=\"text\"} 2000000"),
        "{text}"
    );
}
