//! Memory readings of the pool: opening the probe and its sampler, a backend's readings in them
//! (its series, its peak, its level now) and the co-tenants beside the box's own backends.

use std::sync::Arc;

use headroom_gpu::{
    EnforcedPool, GpuProbe, HostPool, NvmlProbe, ProbeError, Sample, Sampler, SamplerConfig,
    process_tree,
};

use crate::boxfile::{BoxConfig, ProbeKind};
use crate::budget::CoTenants;
use crate::cgroup::BoxCgroup;
use crate::{ProbeFailure, UpError};

/// Memory readings of the pool: the probe, the sampler over it, and how a backend's bytes are
/// found in a sample.
pub(crate) struct Meter {
    pub(crate) kind: ProbeKind,
    pub(crate) device: u32,
    pub(crate) capacity: u64,
    /// The card as vLLM sees it (NVML total − reserved); the capacity on the host pool.
    pub(crate) device_total: u64,
    pub(crate) pool: Option<HostPool>,
    pub(crate) sampler: Sampler,
}

impl Meter {
    /// The backend rooted at `root` in one sample: its member row on the host pool, the sum of
    /// its tree's processes on a GPU.
    pub(crate) fn bytes_in(&self, sample: &Sample, tree: &[u32]) -> u64 {
        match self.kind {
            ProbeKind::Host => tree
                .first()
                .map_or(0, |&root| sample.process_used_bytes(root)),
            ProbeKind::Nvml => tree.iter().map(|&p| sample.process_used_bytes(p)).sum(),
        }
    }

    pub(crate) fn tree(&self, root: u32) -> Vec<u32> {
        match self.kind {
            ProbeKind::Host => vec![root],
            ProbeKind::Nvml => process_tree(root),
        }
    }

    /// `(ts_ms, bytes)` of the backend rooted at `root` since `since_ms`.
    pub(crate) fn series(&self, root: u32, since_ms: u64) -> Vec<(u64, u64)> {
        let tree = self.tree(root);
        self.sampler
            .since(since_ms)
            .iter()
            .filter(|s| s.gpu == self.device)
            .map(|s| (s.ts_ms, self.bytes_in(s, &tree)))
            .collect()
    }

    /// The highest reading of the backend rooted at `root` since `since_ms`.
    pub(crate) fn highest(&self, root: u32, since_ms: u64) -> Option<u64> {
        self.series(root, since_ms).iter().map(|p| p.1).max()
    }

    /// The backend's peak since `since_ms`, never below `floor` (a level it was measured at):
    /// [`peak_of`] its series.
    pub(crate) fn peak_since(&self, root: u32, since_ms: u64, floor: u64) -> u64 {
        peak_of(&self.series(root, since_ms), floor)
    }

    /// What the pool held beside the box's own backends (those `roots` and their trees) in every
    /// sample since `since_ms`.
    pub(crate) fn cotenants(
        &self,
        roots: impl IntoIterator<Item = u32>,
        since_ms: u64,
    ) -> CoTenants {
        let trees: Vec<Vec<u32>> = roots.into_iter().map(|r| self.tree(r)).collect();
        let mut cotenants = CoTenants::default();
        cotenants.observe_samples(&self.sampler.since(since_ms), |s| {
            trees.iter().map(|t| self.bytes_in(s, t)).sum()
        });
        cotenants
    }

    pub(crate) fn now_bytes(&self, root: u32) -> u64 {
        let tree = self.tree(root);
        self.sampler
            .latest()
            .iter()
            .find(|s| s.gpu == self.device)
            .map_or(0, |s| self.bytes_in(s, &tree))
    }

    /// Makes a backend a member of the host pool under its upstream URL, the name `serve`'s
    /// memory feed gives the same process tree (so the two never count it twice).
    pub(crate) fn join(&self, upstream: &str, pid: u32) {
        if let Some(pool) = &self.pool {
            pool.set_member(upstream, pid);
        }
    }
}

/// Opens the pool `[memory] probe` names and starts sampling it every `sample_interval`: the
/// meter, and the probe the gateway reads too.
pub(crate) fn open_meter(
    config: &BoxConfig,
    enforced: Option<&BoxCgroup>,
) -> Result<(Meter, Arc<dyn GpuProbe>), UpError> {
    let m = &config.memory;
    let opened = match m.probe {
        ProbeKind::Host => open_host_pool(config, enforced)?,
        ProbeKind::Nvml => open_nvml(config)?,
    };
    let sampler = Sampler::start(
        Arc::clone(&opened.probe),
        SamplerConfig::new(config.memory.sample_interval).with_ring_capacity(16_384),
    )
    .map_err(ProbeFailure::from)?;
    Ok((
        Meter {
            kind: m.probe,
            device: m.device,
            capacity: opened.capacity,
            device_total: opened.device_total,
            pool: opened.pool,
            sampler,
        },
        opened.probe,
    ))
}

/// A probe opened on the pool, before its sampler starts.
struct OpenedPool {
    probe: Arc<dyn GpuProbe>,
    /// The host pool (its members named by upstream URL); none on a GPU.
    pool: Option<HostPool>,
    capacity: u64,
    device_total: u64,
}

/// The host pool: `[memory] capacity` (else the host's memory), its watched co-tenants as
/// members, read through the box's cgroup where `[memory] enforce` made one.
fn open_host_pool(
    config: &BoxConfig,
    enforced: Option<&BoxCgroup>,
) -> Result<OpenedPool, ProbeFailure> {
    let m = &config.memory;
    let capacity = match m.capacity {
        Some(c) => c,
        None => headroom_gpu::host::host_mem_total().map_err(ProbeFailure::MemInfo)?,
    };
    let pool = HostPool::new(capacity);
    // The meter's sampler and serve's memory feed both poll the pool every
    // sample_interval: within half of it they share one reading of /proc.
    pool.share_readings_within(m.sample_interval / 2);
    // Co-tenants: the processes listening on the watched upstreams, with their trees.
    let ours: Vec<String> = config.backends.iter().map(|b| b.upstream()).collect();
    for url in m.watch.iter().filter(|u| !ours.contains(u)) {
        if let Ok(pid) = headroom_gpu::url_listener(url) {
            pool.set_member(url, pid);
        }
    }
    // Enforced: the pool's use is the cgroup's charge, one read per sample.
    let probe: Arc<dyn GpuProbe> = match enforced {
        Some(c) => Arc::new(EnforcedPool::new(pool.clone(), c.cgroup().clone())),
        None => Arc::new(pool.clone()),
    };
    Ok(OpenedPool {
        probe,
        pool: Some(pool),
        capacity,
        device_total: capacity,
    })
}

/// The GPU `[memory] device` through NVML: its capacity `[memory] capacity` within the card as
/// vLLM sees it (total less reserved).
fn open_nvml(config: &BoxConfig) -> Result<OpenedPool, ProbeFailure> {
    let m = &config.memory;
    let nvml = NvmlProbe::new()?;
    let devices = nvml.snapshot()?;
    let device = devices
        .iter()
        .find(|d| d.index == m.device)
        .ok_or(ProbeError::NoSuchDevice(m.device))?;
    let total = device.total_bytes.saturating_sub(device.reserved_bytes);
    Ok(OpenedPool {
        probe: Arc::new(nvml),
        pool: None,
        capacity: m.capacity.unwrap_or(total).min(total),
        device_total: total,
    })
}

/// The highest reading of a `(ts_ms, bytes)` series, never below `floor`: the peak of a backend
/// measured at the level `floor` (an empty series has `floor` as its peak).
pub(crate) fn peak_of(series: &[(u64, u64)], floor: u64) -> u64 {
    series.iter().map(|p| p.1).max().unwrap_or(floor).max(floor)
}

#[cfg(test)]
mod tests {
    use super::peak_of;

    #[test]
    fn the_peak_is_the_highest_reading_never_below_the_floor() {
        let series = [(100, 50), (150, 90), (200, 70)];
        assert_eq!(peak_of(&series, 30), 90);
        // Measured steady at 120 after the series: the peak is at least that level.
        assert_eq!(peak_of(&series, 120), 120);
        assert_eq!(peak_of(&[], 40), 40, "no reading: the level measured");
        assert_eq!(peak_of(&[(0, 7)], 0), 7);
    }
}
