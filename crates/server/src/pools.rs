//! What each memory pool is called where an operator reads it (`/ui`, `/ui/state`,
//! `/admin/lanes`): "host RAM" for the host pool, "GPU N (its driver's name)" for a card. The
//! memory feed (or, without one, the GPU gauge loop) notes each device it reads; before the first
//! reading a pool is named from the configured probe alone.

use std::collections::BTreeMap;
use std::sync::Mutex;

use headroom_gpu::DeviceSnapshot;

use crate::config::memory::ProbeKind;

/// The names of the pools read so far, by device index.
#[derive(Debug)]
pub struct PoolNames {
    kind: ProbeKind,
    names: Mutex<BTreeMap<u32, String>>,
}

impl PoolNames {
    /// Names for a gateway whose `[memory] probe` is `kind`.
    pub fn new(kind: ProbeKind) -> PoolNames {
        PoolNames {
            kind,
            names: Mutex::new(BTreeMap::new()),
        }
    }

    /// Keeps the name of a device just read (a no-op when it is unchanged).
    pub fn note(&self, device: &DeviceSnapshot) {
        let name = pool_name(self.kind, device.index, &device.name);
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        if names.get(&device.index) != Some(&name) {
            names.insert(device.index, name);
        }
    }

    /// The name of `device`: as read, else from the probe kind alone.
    pub fn name(&self, device: u32) -> String {
        self.names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&device)
            .cloned()
            .unwrap_or_else(|| pool_name(self.kind, device, ""))
    }
}

/// "host RAM" on the host pool; "GPU N (NAME)" on a card whose driver gave a name, else "GPU N".
pub fn pool_name(kind: ProbeKind, index: u32, driver_name: &str) -> String {
    match kind {
        ProbeKind::Host => "host RAM".to_string(),
        ProbeKind::Nvml if driver_name.trim().is_empty() => format!("GPU {index}"),
        ProbeKind::Nvml => format!("GPU {index} ({})", driver_name.trim()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_are_named_for_what_they_are() {
        let mut card = DeviceSnapshot::with_memory(1, 80 << 30, 0);
        card.name = "NVIDIA H100 80GB HBM3".into();
        let gpus = PoolNames::new(ProbeKind::Nvml);
        assert_eq!(gpus.name(1), "GPU 1");
        gpus.note(&card);
        assert_eq!(gpus.name(1), "GPU 1 (NVIDIA H100 80GB HBM3)");
        let host = PoolNames::new(ProbeKind::Host);
        assert_eq!(host.name(0), "host RAM");
        host.note(&DeviceSnapshot::with_memory(0, 1 << 30, 0));
        assert_eq!(host.name(0), "host RAM");
    }
}
