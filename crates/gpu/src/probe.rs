//! The probe contract: devices, their memory, and the processes holding it.

use serde::{Deserialize, Serialize};

/// One process's memory on one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessMemory {
    pub pid: u32,
    /// Process name from /proc (empty when unreadable, e.g. another container's pid).
    pub name: String,
    pub used_bytes: u64,
}

/// One device at one instant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSnapshot {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub total_bytes: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
    /// Memory the driver reserves for itself (NVML v2 `reserved`); 0 when not reported.
    pub reserved_bytes: u64,
    /// GPU utilization in percent over the driver's last sample period.
    pub utilization_percent: Option<u32>,
    /// `Some(true)` when MIG mode is enabled; `None` when the device does not support MIG.
    pub mig_enabled: Option<bool>,
    pub processes: Vec<ProcessMemory>,
}

/// Why a probe could not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// No NVIDIA driver or library on this machine; the string is the loader's reason.
    #[error("no NVIDIA driver: {0}")]
    NoDriver(String),
    /// NVML answered with an error.
    #[error("NVML error: {0}")]
    Nvml(String),
    /// The requested device index does not exist.
    #[error("no GPU with index {0}")]
    NoSuchDevice(u32),
    /// The memory cgroup of an enforced host pool could not be read.
    #[error("memory cgroup: {0}")]
    Cgroup(String),
    /// A pool read from a running `headroom up` (its `/admin/box`) could not be read.
    #[error("the box's pool: {0}")]
    Remote(String),
}

impl ProbeError {
    /// Short stable label, reused in metrics and JSON reasons.
    pub fn label(&self) -> &'static str {
        match self {
            ProbeError::NoDriver(_) => "no_driver",
            ProbeError::Nvml(_) => "nvml",
            ProbeError::NoSuchDevice(_) => "no_such_device",
            ProbeError::Cgroup(_) => "cgroup",
            ProbeError::Remote(_) => "remote",
        }
    }
}

/// Reads GPU memory. Implementations must be cheap enough to call every few milliseconds.
pub trait GpuProbe: Send + Sync {
    /// Every visible device, in index order.
    fn snapshot(&self) -> Result<Vec<DeviceSnapshot>, ProbeError>;
}

impl DeviceSnapshot {
    /// A device with `total_bytes` of memory of which `used_bytes` are in use and no processes; the
    /// rest of the fields take neutral values. Handy for tests and replays.
    pub fn with_memory(index: u32, total_bytes: u64, used_bytes: u64) -> Self {
        DeviceSnapshot {
            index,
            name: format!("GPU {index}"),
            uuid: String::new(),
            total_bytes,
            used_bytes,
            free_bytes: total_bytes.saturating_sub(used_bytes),
            reserved_bytes: 0,
            utilization_percent: None,
            mig_enabled: None,
            processes: Vec::new(),
        }
    }

    /// Memory in use by the device's processes and the driver minus what the driver reserves for
    /// itself: the number a floor comparison should use.
    pub fn used_without_reserved(&self) -> u64 {
        self.used_bytes.saturating_sub(self.reserved_bytes)
    }

    /// Memory held by one process on this device, if it appears in the process list.
    pub fn process_used_bytes(&self, pid: u32) -> Option<u64> {
        self.processes
            .iter()
            .filter(|p| p.pid == pid)
            .map(|p| p.used_bytes)
            .reduce(|a, b| a + b)
    }
}

impl<P: GpuProbe + ?Sized> GpuProbe for std::sync::Arc<P> {
    fn snapshot(&self) -> Result<Vec<DeviceSnapshot>, ProbeError> {
        (**self).snapshot()
    }
}

impl<P: GpuProbe + ?Sized> GpuProbe for Box<P> {
    fn snapshot(&self) -> Result<Vec<DeviceSnapshot>, ProbeError> {
        (**self).snapshot()
    }
}
