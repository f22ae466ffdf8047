//! `headroom doctor --metrics URL [--metrics URL …] [--interval 10s]`: reads each `/metrics`
//! endpoint (a headroom gateway, vLLM or llama.cpp) twice, an interval apart, and prints what
//! `headroom_doctor::live` finds wrong, each finding with its figures and the setting to change.
//! The only I/O of the live diagnosis lives here: bounded HTTP GETs to the given addresses.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use headroom_doctor::live::{LiveDiagnosis, Snapshot, Thresholds, diagnose_live};
use serde::Serialize;

/// Largest `/metrics` body read (a gateway's is a few KiB; vLLM's tens of KiB).
const MAX_BODY_BYTES: usize = 8 << 20;
/// Longest wait for one reading.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest interval accepted.
const MAX_INTERVAL: Duration = Duration::from_secs(3600);

/// What one endpoint gave.
#[derive(Debug, Serialize)]
struct Endpoint {
    url: String,
    #[serde(flatten)]
    diagnosis: LiveDiagnosis,
}

/// `--interval`: a positive duration (`10s`, `500ms`, a bare number of seconds) up to an hour.
pub fn parse_interval(text: &str) -> Result<Duration, String> {
    let d = headroom_plan::units::parse_duration(text, headroom_plan::units::BareNumber::Seconds)
        .ok_or_else(|| format!("`{text}` is not a duration (use e.g. 10s, 500ms, 1m)"))?;
    if d.is_zero() || d > MAX_INTERVAL {
        return Err(format!("`{text}` must be above 0 and at most 1h"));
    }
    Ok(d)
}

/// Checks and completes a metrics address: http on any host, `/metrics` when no path is given.
fn metrics_url(raw: &str) -> anyhow::Result<String> {
    let url = reqwest::Url::parse(raw).with_context(|| {
        format!("`{raw}` is not a URL (use e.g. http://127.0.0.1:8080/metrics)")
    })?;
    if url.scheme() != "http" {
        bail!("`{raw}`: only http:// metrics addresses are supported");
    }
    if url.host_str().is_none() {
        bail!("`{raw}` has no host");
    }
    let mut url = url;
    if url.path() == "/" || url.path().is_empty() {
        url.set_path("/metrics");
    }
    Ok(url.to_string())
}

async fn fetch(client: &reqwest::Client, url: &str, key: Option<&str>) -> anyhow::Result<String> {
    let mut req = client.get(url);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let mut resp = tokio::time::timeout(FETCH_TIMEOUT, req.send())
        .await
        .with_context(|| format!("{url} did not answer within {}s", FETCH_TIMEOUT.as_secs()))?
        .with_context(|| format!("cannot read {url}"))?;
    let status = resp.status();
    if !status.is_success() {
        bail!(
            "{url} answered {status}{}",
            if status.as_u16() == 401 || status.as_u16() == 403 {
                " (pass --api-key or HEADROOM_API_KEY)"
            } else if status.as_u16() == 404 {
                " (llama.cpp serves /metrics only with --metrics)"
            } else {
                ""
            }
        );
    }
    let mut body = Vec::new();
    loop {
        let chunk = tokio::time::timeout(FETCH_TIMEOUT, resp.chunk())
            .await
            .with_context(|| format!("{url} stopped sending"))?
            .with_context(|| format!("reading {url}"))?;
        let Some(chunk) = chunk else { break };
        if body.len() + chunk.len() > MAX_BODY_BYTES {
            bail!("{url}: the metrics body is larger than {MAX_BODY_BYTES} bytes");
        }
        body.extend_from_slice(&chunk);
    }
    String::from_utf8(body).with_context(|| format!("{url}: the metrics body is not UTF-8"))
}

fn parse(url: &str, text: &str) -> anyhow::Result<Snapshot> {
    Snapshot::parse(text).with_context(|| format!("{url}: cannot read its metrics"))
}

/// Reads every endpoint twice, `interval` apart, and diagnoses each.
async fn diagnose_all(
    urls: &[String],
    interval: Duration,
    key: Option<&str>,
) -> anyhow::Result<Vec<Endpoint>> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(5))
        .build()
        .context("building the HTTP client")?;
    let mut first = Vec::with_capacity(urls.len());
    for url in urls {
        first.push(parse(url, &fetch(&client, url, key).await?)?);
    }
    let started = tokio::time::Instant::now();
    tokio::time::sleep(interval).await;
    let mut out = Vec::with_capacity(urls.len());
    for (url, before) in urls.iter().zip(&first) {
        let after = parse(url, &fetch(&client, url, key).await?)?;
        // The readings' real distance (later reads of several endpoints come later).
        let elapsed = started.elapsed().max(interval);
        out.push(Endpoint {
            url: url.clone(),
            diagnosis: diagnose_live(before, &after, elapsed, &Thresholds::default()),
        });
    }
    Ok(out)
}

pub fn run(
    urls: &[String],
    interval: Duration,
    key: Option<&str>,
    json: bool,
) -> anyhow::Result<std::process::ExitCode> {
    let urls: Vec<String> = urls
        .iter()
        .map(|u| metrics_url(u))
        .collect::<anyhow::Result<_>>()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let endpoints = runtime.block_on(diagnose_all(&urls, interval, key))?;
    let text = if json {
        let mut s = serde_json::to_string_pretty(&serde_json::json!({
            "interval_seconds": interval.as_secs_f64(),
            "endpoints": endpoints,
            "findings": endpoints.iter().map(|e| e.diagnosis.findings.len()).sum::<usize>(),
        }))?;
        s.push('\n');
        s
    } else {
        table(&endpoints)
    };
    std::io::stdout()
        .lock()
        .write_all(text.as_bytes())
        .context("writing the report")?;
    Ok(std::process::ExitCode::SUCCESS)
}

fn table(endpoints: &[Endpoint]) -> String {
    let paint = super::doctor::Paint::for_stdout();
    let mut s = String::new();
    for e in endpoints {
        let d = &e.diagnosis;
        s.push_str(&format!(
            "headroom doctor: {} — {} metrics over {:.1} s: {}\n",
            e.url,
            d.source.as_str(),
            d.interval_seconds,
            d.verdict()
        ));
        for (i, f) in d.findings.iter().enumerate() {
            let head = format!(
                "{}. {}{}",
                i + 1,
                f.cause.as_str(),
                f.lane
                    .as_deref()
                    .map(|l| format!(" (lane {l})"))
                    .unwrap_or_default()
            );
            s.push_str(&format!("\n{}\n", paint.cause(&head, i == 0)));
            let nums: Vec<String> = f
                .numbers
                .iter()
                .map(|(k, v)| format!("{k}={}", short(*v)))
                .collect();
            s.push_str(&format!("   figures:  {}\n", nums.join("  ")));
            s.push_str(&format!("   {}      {}\n", paint.fix("fix:"), f.fix));
        }
        if !d.figures.is_empty() {
            let figs: Vec<String> = d
                .figures
                .iter()
                .map(|(k, v)| format!("{k}={}", short(*v)))
                .collect();
            s.push_str(&format!("\n   measured: {}\n", figs.join("  ")));
        }
        for n in &d.not_judged {
            s.push_str(&format!("   not judged: {n}\n"));
        }
        s.push('\n');
    }
    s
}

fn short(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_intervals() {
        assert_eq!(
            metrics_url("http://127.0.0.1:8080").unwrap(),
            "http://127.0.0.1:8080/metrics"
        );
        assert_eq!(
            metrics_url("http://127.0.0.1:8080/custom").unwrap(),
            "http://127.0.0.1:8080/custom"
        );
        assert!(metrics_url("ftp://x/metrics").is_err());
        assert!(metrics_url("not a url").is_err());
        assert_eq!(parse_interval("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_interval("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_interval("0s").is_err());
        assert!(parse_interval("2h").is_err());
        assert!(parse_interval("soon").is_err());
    }
}
