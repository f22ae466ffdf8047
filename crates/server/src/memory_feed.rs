//! The memory feed: the sampler of memory admission. A dedicated OS thread (so a probe that
//! hangs stalls only itself, never a request or a runtime worker) reads the probe every
//! `sample_interval`, turns each device
//! into a [`MemoryReading`] (the pool's free figure and each upstream's measured use) and pushes
//! it into the gate. It also sets the memory gauge and saves learned needs to the calibration
//! file; [`load_learned`] reads them back at start.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use headroom_gate::{Gate, LearnedNeed, MemoryReading};
use headroom_gpu::{
    Calibration, CalibrationError, DeviceSnapshot, GpuProbe, HostPool, LearnedLane,
    TREE_WALK_EVERY, TreeCache, tree_listens, url_listener, url_port,
};
use tokio::time::Instant;

use crate::config::memory::{MemoryConfig, ProbeKind};
use crate::telemetry::{GPU_MEMORY_USED_BYTES, Telemetry};

/// How often the listening processes of the watched upstreams are looked up again.
const RESOLVE_EVERY: Duration = Duration::from_secs(1);
/// How often learned needs are written to the calibration file (when they changed).
const SAVE_EVERY: Duration = Duration::from_secs(2);
/// The feed thread's name (tests check that probe calls happen only there).
pub const FEED_THREAD: &str = "headroom-memory";
/// The thread that finds the processes listening on the watched upstreams' ports. Scanning
/// every `/proc/*/fd` can take a while on a busy machine, so it never delays a reading.
pub(crate) const WATCH_THREAD: &str = "headroom-watch";

/// What the feed reads and where it pushes.
pub(crate) struct FeedSetup {
    pub probe: Arc<dyn GpuProbe>,
    /// The host pool whose members the feed keeps up to date (the watched upstreams).
    pub pool: Option<HostPool>,
    pub memory: MemoryConfig,
    /// Upstreams (as configured) whose use is measured: the watch list and the upstreams of
    /// lanes that admit on memory.
    pub owners: Vec<String>,
    /// Lanes with `learn = true`: (index, name).
    pub learn_lanes: Vec<(usize, String)>,
    pub gate: Gate,
    pub telemetry: Arc<Telemetry>,
    /// Where the name of each device read is kept for the page and the admin routes.
    pub names: Arc<crate::pools::PoolNames>,
}

/// The running feed; dropping it stops the thread after its current probe call.
pub(crate) struct MemoryFeed {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    interval: Duration,
}

impl MemoryFeed {
    /// Starts the thread and waits for its first reading (at most `stale_after`, so a probe
    /// that hangs from the start delays start-up by that much and no more).
    pub(crate) fn start(setup: FeedSetup) -> std::io::Result<MemoryFeed> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let wait = setup.memory.stale_after;
        let interval = setup.memory.sample_interval;
        let roots = Arc::new(Mutex::new(HashMap::new()));
        let (urls, found, pool, watch_stop) = (
            setup.owners.clone(),
            roots.clone(),
            setup.pool.clone(),
            stop.clone(),
        );
        // Resolve once before the first reading, then keep resolving on the side.
        let mut added = HashSet::new();
        resolve(&urls, &found, pool.as_ref(), &mut added);
        std::thread::Builder::new()
            .name(WATCH_THREAD.into())
            .spawn(move || {
                while !watch_stop.load(Ordering::Relaxed) {
                    std::thread::sleep(RESOLVE_EVERY);
                    resolve(&urls, &found, pool.as_ref(), &mut added);
                }
            })?;
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(FEED_THREAD.into())
            .spawn(move || run(setup, roots, &flag, first_tx))?;
        let _ = first_rx.recv_timeout(wait);
        Ok(MemoryFeed {
            stop,
            thread: Some(thread),
            interval,
        })
    }

    /// Stops the thread and waits for it, unless the probe hangs: then it is left to finish its
    /// call on its own (it holds nothing but the probe).
    pub(crate) fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let Some(t) = self.thread.take() else { return };
        // The last save happens on the way out: give a healthy probe a few periods to finish.
        let until = std::time::Instant::now() + 4 * self.interval + Duration::from_millis(100);
        while !t.is_finished() && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(2));
        }
        if t.is_finished() {
            let _ = t.join();
        }
    }
}

impl Drop for MemoryFeed {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

type Roots = Arc<Mutex<HashMap<String, u32>>>;

/// Finds the process tree of each upstream and keeps the host pool's members in step. A member
/// of the pool that the feed did not add is the supervisor's (`up` names each backend it started
/// by its upstream URL): its root is taken as it is and never replaced or removed here. The others
/// are the processes listening on the upstream's port: the one found before is kept while its
/// tree still listens (only its file descriptors are read), and only otherwise is every process
/// searched.
fn resolve(urls: &[String], roots: &Roots, pool: Option<&HostPool>, added: &mut HashSet<String>) {
    for url in urls {
        let managed = pool
            .filter(|_| !added.contains(url))
            .and_then(|p| p.member(url));
        let found = managed.or_else(|| {
            let before = roots
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(url)
                .copied();
            let port = url_port(url).ok()?;
            before
                .filter(|pid| tree_listens(*pid, port))
                .or_else(|| url_listener(url).ok())
        });
        if let (Some(pool), None) = (pool, managed) {
            match found {
                Some(pid) => {
                    if pool.member(url) != Some(pid) {
                        pool.set_member(url, pid);
                    }
                    added.insert(url.clone());
                }
                None => {
                    pool.remove_member(url);
                    added.remove(url);
                }
            }
        }
        let mut roots = roots.lock().unwrap_or_else(|p| p.into_inner());
        match found {
            Some(pid) => roots.insert(url.clone(), pid),
            None => roots.remove(url),
        };
    }
}

fn run(setup: FeedSetup, roots: Roots, stop: &AtomicBool, first: std::sync::mpsc::Sender<()>) {
    let interval = setup.memory.sample_interval;
    let mut saved: HashMap<usize, LearnedNeed> = HashMap::new();
    let mut last_save = std::time::Instant::now();
    let mut next = std::time::Instant::now();
    // Which processes of an NVML list are an owner's: its tree, walked at most once a period.
    let mut trees = TreeCache::new(TREE_WALK_EVERY);
    while !stop.load(Ordering::Relaxed) {
        // The reading is as old as the probe's start: a job admitted while the probe ran
        // cannot show in it.
        let taken = Instant::now();
        match setup.probe.snapshot() {
            Ok(devices) => {
                let owners = roots.lock().unwrap_or_else(|p| p.into_inner()).clone();
                trees.retain(&owners.values().copied().collect::<Vec<_>>());
                for d in &devices {
                    setup.names.note(d);
                    setup
                        .telemetry
                        .gauge(GPU_MEMORY_USED_BYTES, &[("gpu", &d.index.to_string())])
                        .set(d.used_bytes as f64);
                    setup.gate.push_memory_reading(reading(
                        d,
                        &setup.memory,
                        &setup.owners,
                        &owners,
                        taken,
                        &mut trees,
                    ));
                }
            }
            Err(_) => {
                for device in devices_of(&setup) {
                    setup.gate.memory_unreadable(device);
                }
            }
        }
        let _ = first.send(());
        if last_save.elapsed() >= SAVE_EVERY {
            last_save = std::time::Instant::now();
            save_changed(&setup, &mut saved);
        }
        next += interval;
        let now = std::time::Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now; // ran late (slow probe): do not try to catch up
        }
    }
    save_changed(&setup, &mut saved);
}

fn devices_of(setup: &FeedSetup) -> Vec<u32> {
    let mut devices: Vec<u32> = setup
        .gate
        .lanes()
        .iter()
        .filter_map(|l| l.gpu.as_ref().map(|g| g.device))
        .collect();
    devices.sort_unstable();
    devices.dedup();
    devices
}

/// One device as the ledger sees it: the free figure within the pool's capacity, and each
/// owner's use (host pool: the member's row; NVML: the processes of its tree).
fn reading(
    d: &DeviceSnapshot,
    memory: &MemoryConfig,
    urls: &[String],
    roots: &HashMap<String, u32>,
    at: Instant,
    trees: &mut TreeCache,
) -> MemoryReading {
    let (total, free) = match (memory.probe, memory.capacity) {
        (ProbeKind::Nvml, Some(cap)) => (
            d.total_bytes.min(cap),
            d.free_bytes.min(cap.saturating_sub(d.used_bytes)),
        ),
        _ => (d.total_bytes, d.free_bytes),
    };
    let owner_use = urls
        .iter()
        .filter_map(|url| {
            let root = *roots.get(url)?;
            // An owner whose use cannot be seen is left out rather than read as 0: its
            // reservations stay hidden until they settle, and it yields no learning samples.
            let used = match memory.probe {
                // A member whose root exited is listed with 0.
                ProbeKind::Host => d
                    .processes
                    .iter()
                    .find(|p| &p.name == url)
                    .map(|p| p.used_bytes)
                    .filter(|b| *b > 0)?,
                // NVML lists no processes in some containers: then nothing of the tree shows.
                ProbeKind::Nvml => {
                    let tree = trees.tree(root);
                    let mine: Vec<u64> = d
                        .processes
                        .iter()
                        .filter(|p| tree.contains(&p.pid))
                        .map(|p| p.used_bytes)
                        .collect();
                    if mine.is_empty() {
                        return None;
                    }
                    mine.iter().sum()
                }
            };
            Some((url.clone(), used))
        })
        .collect();
    MemoryReading {
        device: d.index,
        total_bytes: total,
        free_bytes: free,
        owners: owner_use,
        at,
    }
}

fn save_changed(setup: &FeedSetup, saved: &mut HashMap<usize, LearnedNeed>) {
    let Some(path) = &setup.memory.calibration else {
        return;
    };
    let mut changed = Vec::new();
    for (lane, name) in &setup.learn_lanes {
        if let Some(l) = setup.gate.learned(*lane)
            && saved.get(lane) != Some(&l)
        {
            changed.push((*lane, name.clone(), l));
        }
    }
    if changed.is_empty() {
        return;
    }
    match save_learned(path, &setup.memory, &changed) {
        Ok(()) => {
            for (lane, _, l) in changed {
                saved.insert(lane, l);
            }
        }
        Err(e) => crate::stderr::line(&format!(
            "headroom serve: cannot save learned memory needs: {e}"
        )),
    }
}

/// Writes learned needs into the calibration file's `learned` map (keeping everything else).
pub(crate) fn save_learned(
    path: &Path,
    memory: &MemoryConfig,
    learned: &[(usize, String, LearnedNeed)],
) -> Result<(), CalibrationError> {
    let mut calibration = Calibration::load_if_present(path)?
        .unwrap_or_else(|| Calibration::new(memory.probe.as_str(), memory.capacity.unwrap_or(0)));
    for (_, name, l) in learned {
        calibration.learned.insert(
            name.clone(),
            LearnedLane {
                bytes_per_job: l.bytes_per_job,
                bytes_per_audio_second: (l.bytes_per_audio_second > 0)
                    .then_some(l.bytes_per_audio_second as f64),
                samples: l.samples,
                between_jobs: true,
            },
        );
    }
    calibration.save(path)
}

/// Reads learned needs back for the lanes named in the calibration file (none if it is absent).
/// Needs an older version learned above the level before each job (not the level the backend
/// keeps between jobs) are left out, with a line saying so: they count what a backend keeps
/// after its first job twice.
pub(crate) fn load_learned(path: &Path) -> Result<Vec<(String, LearnedNeed)>, CalibrationError> {
    let Some(calibration) = Calibration::load_if_present(path)? else {
        return Ok(Vec::new());
    };
    Ok(calibration
        .learned
        .into_iter()
        .filter(|(lane, l)| {
            if !l.between_jobs {
                crate::stderr::line(&format!(
                    "headroom serve: lane `{lane}`: the learned need in {} was measured by an older version (above the level before each job); it is learned again",
                    path.display()
                ));
            }
            l.between_jobs
        })
        .map(|(lane, l)| {
            (
                lane,
                LearnedNeed {
                    bytes_per_job: l.bytes_per_job,
                    bytes_per_audio_second: l
                        .bytes_per_audio_second
                        .map_or(0, |b| b.max(0.0).round() as u64),
                    samples: l.samples,
                },
            )
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_read_from_their_rows_and_unseen_ones_left_out() {
        use headroom_gpu::ProcessMemory;
        let me = std::process::id();
        let urls = vec!["http://a:1".to_string(), "http://b:2".to_string()];
        let roots: HashMap<String, u32> = [(urls[0].clone(), me), (urls[1].clone(), 1)].into();
        let mut d = DeviceSnapshot::with_memory(0, 1000, 400);
        d.processes = vec![
            ProcessMemory {
                pid: me,
                name: urls[0].clone(),
                used_bytes: 300,
            },
            ProcessMemory {
                pid: 1,
                name: urls[1].clone(),
                used_bytes: 0,
            },
        ];
        let host = MemoryConfig {
            probe: ProbeKind::Host,
            capacity: Some(1000),
            ..MemoryConfig::default()
        };
        let mut trees = TreeCache::new(TREE_WALK_EVERY);
        let r = reading(&d, &host, &urls, &roots, Instant::now(), &mut trees);
        assert_eq!(r.owners, vec![(urls[0].clone(), 300)]);
        assert_eq!((r.total_bytes, r.free_bytes), (1000, 600));
        // NVML with a capacity cap: free within the cap; this process's tree is found by pid.
        let nvml = MemoryConfig {
            capacity: Some(500),
            ..MemoryConfig::default()
        };
        let r = reading(&d, &nvml, &urls, &roots, Instant::now(), &mut trees);
        assert_eq!((r.total_bytes, r.free_bytes), (500, 100));
        assert_eq!(r.owners[0], (urls[0].clone(), 300));
        d.processes.clear();
        assert!(
            reading(&d, &nvml, &urls, &roots, Instant::now(), &mut trees)
                .owners
                .is_empty()
        );
    }

    #[test]
    fn the_supervisors_members_are_kept_and_listeners_followed() {
        let pool = HostPool::new(1 << 30);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
        // A backend `up` started, not listening (yet, or while it restarts): its member stays.
        let managed = "http://127.0.0.1:1".to_string();
        pool.set_member(&managed, 4242);
        let roots: Roots = Arc::default();
        let mut added = HashSet::new();
        let urls = [managed.clone(), url.clone()];
        resolve(&urls, &roots, Some(&pool), &mut added);
        assert_eq!(pool.member(&managed), Some(4242));
        assert_eq!(pool.member(&url), Some(std::process::id()));
        assert_eq!(roots.lock().unwrap().get(&managed), Some(&4242));
        // Found again (the cheap way) while it listens; gone when it stops listening.
        resolve(&urls, &roots, Some(&pool), &mut added);
        assert_eq!(pool.member(&url), Some(std::process::id()));
        drop(listener);
        resolve(&urls, &roots, Some(&pool), &mut added);
        assert_eq!(pool.member(&url), None);
        assert!(roots.lock().unwrap().get(&url).is_none());
        assert_eq!(pool.member(&managed), Some(4242));
    }

    #[test]
    fn learned_needs_survive_a_save_and_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("calibration.json");
        let memory = MemoryConfig::default();
        let need = LearnedNeed {
            bytes_per_job: 314_572_800,
            bytes_per_audio_second: 1_200_000,
            samples: 12,
        };
        save_learned(&path, &memory, &[(0, "stt".into(), need)]).unwrap();
        assert_eq!(
            load_learned(&path).unwrap(),
            vec![("stt".to_string(), need)]
        );
        assert!(
            load_learned(&dir.path().join("none.json"))
                .unwrap()
                .is_empty()
        );
    }
}
