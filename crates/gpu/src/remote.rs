//! A memory pool read from a running `headroom up`, for the tools that have no NVML to read (top,
//! bench and soak on a CPU box, where the pool is host RAM that only `up` measures): the
//! `/admin/box` document turned into one device, and a probe that fetches the document on a
//! thread of its own and answers every sampler call from the newest answer. The fetch itself is
//! the caller's (this crate knows no HTTP).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::probe::{DeviceSnapshot, GpuProbe, ProbeError, ProcessMemory};

/// The pool of an `/admin/box` document: its `pool` figures (total, used, free as the gateway's
/// memory feed last read them) and one process per backend with a PID (its memory now). A
/// document without `pool` (an older `up`) gives the capacity and the sum of the backends.
pub fn device_from_box(json: &str) -> Result<DeviceSnapshot, String> {
    let doc: Value =
        serde_json::from_str(json).map_err(|e| format!("/admin/box is not JSON: {e}"))?;
    let (Some(backends), Some(capacity)) =
        (doc["backends"].as_array(), doc["capacity_bytes"].as_u64())
    else {
        return Err("not an /admin/box document of headroom up (no backends, no capacity)".into());
    };
    let processes: Vec<ProcessMemory> = backends
        .iter()
        .filter_map(|b| {
            Some(ProcessMemory {
                pid: u32::try_from(b["pid"].as_u64()?).ok()?,
                name: b["name"].as_str().unwrap_or("").to_string(),
                used_bytes: b["current_bytes"].as_u64().unwrap_or(0),
            })
        })
        .collect();
    let pool = &doc["pool"];
    let index = pool["device"].as_u64().unwrap_or(0) as u32;
    let total = pool["total_bytes"].as_u64().unwrap_or(capacity);
    let used = pool["used_bytes"]
        .as_u64()
        .unwrap_or_else(|| processes.iter().map(|p| p.used_bytes).sum());
    let name = match pool["name"].as_str() {
        Some(name) => name.to_string(),
        None if doc["probe"] == "host" => "host RAM".to_string(),
        None => format!("GPU {index}"),
    };
    Ok(DeviceSnapshot {
        index,
        name,
        uuid: String::new(),
        total_bytes: total,
        used_bytes: used,
        free_bytes: pool["free_bytes"]
            .as_u64()
            .unwrap_or(total.saturating_sub(used)),
        reserved_bytes: 0,
        utilization_percent: None,
        mig_enabled: None,
        processes,
    })
}

/// The newest answer: when it came and what it was.
type Latest = (Instant, Result<DeviceSnapshot, String>);

/// A probe over a running `up`'s pool. The document is fetched every `every` on a thread of its
/// own (a slow gateway never stalls a sampler); an answer older than three periods (and a second)
/// is an error, so a gateway that went away shows as probe errors, not as a frozen figure.
pub struct RemotePool {
    latest: Arc<Mutex<Latest>>,
    every: Duration,
    stop: Arc<AtomicBool>,
}

impl RemotePool {
    /// Fetches once (an error here is the reason there is no pool), then keeps fetching every
    /// `every` until dropped.
    pub fn start<F>(fetch: F, every: Duration) -> Result<RemotePool, String>
    where
        F: Fn() -> Result<String, String> + Send + 'static,
    {
        let first = fetch().and_then(|doc| device_from_box(&doc))?;
        let latest = Arc::new(Mutex::new((Instant::now(), Ok(first))));
        let stop = Arc::new(AtomicBool::new(false));
        let (shared, stopped) = (latest.clone(), stop.clone());
        std::thread::Builder::new()
            .name("headroom-remote-pool".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    std::thread::sleep(every);
                    let answer = fetch().and_then(|doc| device_from_box(&doc));
                    *shared.lock().unwrap_or_else(|p| p.into_inner()) = (Instant::now(), answer);
                }
            })
            .map_err(|e| format!("cannot start the pool reader: {e}"))?;
        Ok(RemotePool {
            latest,
            every,
            stop,
        })
    }
}

impl GpuProbe for RemotePool {
    fn snapshot(&self) -> Result<Vec<DeviceSnapshot>, ProbeError> {
        let (at, answer) = self
            .latest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let limit = self.every * 3 + Duration::from_secs(1);
        match answer {
            Ok(_) if at.elapsed() > limit => Err(ProbeError::Remote(format!(
                "no answer for {:.1} s",
                at.elapsed().as_secs_f64()
            ))),
            Ok(device) => Ok(vec![device]),
            Err(e) => Err(ProbeError::Remote(e)),
        }
    }
}

impl Drop for RemotePool {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = r#"{"probe":"host","capacity_bytes":1073741824,"margin_bytes":134217728,
      "text_budget_bytes":1,"pool":{"name":"host RAM","device":0,"total_bytes":1073741824,
      "used_bytes":800000000,"free_bytes":273741824},
      "backends":[{"name":"whisper","pid":22272,"current_bytes":233466880},
                  {"name":"llm","pid":null,"current_bytes":0}]}"#;

    #[test]
    fn a_box_document_is_one_named_device() {
        let d = device_from_box(DOC).unwrap();
        assert_eq!((d.index, d.name.as_str()), (0, "host RAM"));
        assert_eq!(
            (d.total_bytes, d.used_bytes, d.free_bytes),
            (1073741824, 800000000, 273741824)
        );
        // A backend without a process (stopped, restarting) is not a row.
        assert_eq!(d.processes.len(), 1);
        assert_eq!(d.process_used_bytes(22272), Some(233466880));
        // An older up (no pool figures): the capacity and the backends' sum.
        let old: Value = {
            let mut v: Value = serde_json::from_str(DOC).unwrap();
            v.as_object_mut().unwrap().remove("pool");
            v
        };
        let d = device_from_box(&old.to_string()).unwrap();
        assert_eq!((d.name.as_str(), d.used_bytes), ("host RAM", 233466880));
        assert!(device_from_box(r#"{"lanes":[]}"#).is_err());
        assert!(device_from_box("<html>").is_err());
    }

    #[test]
    fn the_probe_answers_from_the_newest_fetch_and_says_when_it_has_none() {
        let answers = Arc::new(Mutex::new(vec![Ok(DOC.to_string())]));
        let source = answers.clone();
        let pool = RemotePool::start(
            move || {
                let mut a = source.lock().unwrap();
                if a.len() > 1 {
                    a.remove(0)
                } else {
                    a[0].clone()
                }
            },
            Duration::from_millis(20),
        )
        .unwrap();
        assert_eq!(pool.snapshot().unwrap()[0].used_bytes, 800000000);
        *answers.lock().unwrap() = vec![Err("connection refused".to_string())];
        std::thread::sleep(Duration::from_millis(100));
        let err = pool.snapshot().unwrap_err();
        assert!(err.to_string().contains("connection refused"), "{err}");
        // No first answer: no probe, with the reason.
        assert!(RemotePool::start(|| Err("HTTP 404".into()), Duration::from_secs(1)).is_err());
    }
}
