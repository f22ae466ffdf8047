//! [`NvmlProbe`]: the real probe. It opens NVML (`libnvidia-ml.so.1`) at run time through
//! `nvml-wrapper`, so the binary builds and starts on machines without any NVIDIA library; there
//! [`NvmlProbe::new`] fails with [`ProbeError::NoDriver`] carrying the loader's reason.
//!
//! Per device it reads memory (`nvmlDeviceGetMemoryInfo_v2`: total, used, free, reserved),
//! utilization, MIG mode, and the compute and graphics processes with their memory. Process names
//! come from `/proc/<pid>/comm` and are cached by pid.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::Mutex;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use crate::probe::{DeviceSnapshot, GpuProbe, ProbeError, ProcessMemory};

/// Most process names kept in the name cache before it is emptied.
const NAME_CACHE_LIMIT: usize = 4096;

/// Reads GPU memory through NVML. Initialise once and share (it is `Send + Sync`).
pub struct NvmlProbe {
    nvml: Nvml,
    /// (name, uuid) per device index: these do not change while the driver is loaded.
    identities: Mutex<HashMap<u32, (String, String)>>,
    process_names: Mutex<HashMap<u32, String>>,
}

impl std::fmt::Debug for NvmlProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlProbe").finish_non_exhaustive()
    }
}

impl NvmlProbe {
    /// Opens NVML from the default library path.
    pub fn new() -> Result<Self, ProbeError> {
        Self::from_init(Nvml::init())
    }

    /// Opens NVML from an explicit library path (e.g. a driver installed outside the loader path).
    pub fn with_lib_path(path: &OsStr) -> Result<Self, ProbeError> {
        Self::from_init(Nvml::builder().lib_path(path).init())
    }

    fn from_init(result: Result<Nvml, NvmlError>) -> Result<Self, ProbeError> {
        let nvml = result.map_err(map_error)?;
        Ok(NvmlProbe {
            nvml,
            identities: Mutex::new(HashMap::new()),
            process_names: Mutex::new(HashMap::new()),
        })
    }

    /// The driver version, for reports.
    pub fn driver_version(&self) -> Result<String, ProbeError> {
        self.nvml.sys_driver_version().map_err(map_error)
    }

    fn device(&self, index: u32) -> Result<DeviceSnapshot, ProbeError> {
        let device = self.nvml.device_by_index(index).map_err(|e| match e {
            NvmlError::InvalidArg | NvmlError::NotFound => ProbeError::NoSuchDevice(index),
            other => map_error(other),
        })?;
        let (name, uuid) = {
            let mut identities = self.identities.lock().unwrap_or_else(|e| e.into_inner());
            match identities.get(&index) {
                Some(known) => known.clone(),
                None => {
                    let known = (
                        device.name().map_err(map_error)?,
                        device.uuid().map_err(map_error)?,
                    );
                    identities.insert(index, known.clone());
                    known
                }
            }
        };
        let memory = device.memory_info().map_err(map_error)?;
        let utilization_percent = device.utilization_rates().ok().map(|u| u.gpu);
        let mig_enabled = match device.mig_mode() {
            Ok(mode) => Some(mode.current == 1),
            Err(_) => None,
        };
        let mut holders: Vec<(u32, u64)> = Vec::new();
        for list in [
            device.running_compute_processes(),
            device.running_graphics_processes(),
        ] {
            // A device that reports no process list (WDDM, some vGPU setups) still has memory.
            let Ok(list) = list else { continue };
            for info in list {
                let used = match info.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => bytes,
                    UsedGpuMemory::Unavailable => 0,
                };
                // A process with both a compute and a graphics context is listed twice with the
                // same figure: keep the larger one, once.
                match holders.iter_mut().find(|(pid, _)| *pid == info.pid) {
                    Some(entry) => entry.1 = entry.1.max(used),
                    None => holders.push((info.pid, used)),
                }
            }
        }
        let processes = holders
            .into_iter()
            .map(|(pid, used_bytes)| ProcessMemory {
                pid,
                name: self.process_name(pid),
                used_bytes,
            })
            .collect();
        Ok(DeviceSnapshot {
            index,
            name,
            uuid,
            total_bytes: memory.total,
            used_bytes: memory.used,
            free_bytes: memory.free,
            reserved_bytes: memory.reserved,
            utilization_percent,
            mig_enabled,
            processes,
        })
    }

    fn process_name(&self, pid: u32) -> String {
        let mut names = self.process_names.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(name) = names.get(&pid) {
            return name.clone();
        }
        if names.len() >= NAME_CACHE_LIMIT {
            names.clear();
        }
        let name = process_name_from_proc(pid);
        // Do not cache a failure: the process may be in another pid namespace only for now.
        if !name.is_empty() {
            names.insert(pid, name.clone());
        }
        name
    }
}

impl GpuProbe for NvmlProbe {
    fn snapshot(&self) -> Result<Vec<DeviceSnapshot>, ProbeError> {
        let count = self.nvml.device_count().map_err(map_error)?;
        (0..count).map(|index| self.device(index)).collect()
    }
}

/// `/proc/<pid>/comm` without the newline; empty when unreadable.
pub fn process_name_from_proc(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim_end().to_string())
        .unwrap_or_default()
}

/// Missing library, missing kernel driver and NVML's own "library not found" all mean "no GPU
/// telemetry here"; everything else is an NVML failure worth showing as such.
pub fn map_error(err: NvmlError) -> ProbeError {
    match err {
        NvmlError::LibloadingError(e) => ProbeError::NoDriver(e.to_string()),
        NvmlError::DriverNotLoaded => {
            ProbeError::NoDriver("NVML loaded but the NVIDIA kernel driver is not running".into())
        }
        NvmlError::LibraryNotFound => {
            ProbeError::NoDriver("NVML could not find its shared library".into())
        }
        NvmlError::NoPermission => {
            ProbeError::NoDriver("no permission to talk to the NVIDIA driver".into())
        }
        other => ProbeError::Nvml(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_no_driver_with_the_loaders_reason() {
        let path = OsStr::new("/nonexistent/headroom-test/libnvidia-ml.so.1");
        match NvmlProbe::with_lib_path(path) {
            Err(ProbeError::NoDriver(reason)) => {
                assert!(reason.contains("/nonexistent/headroom-test"), "{reason}")
            }
            Err(other) => panic!("expected NoDriver, got {other}"),
            Ok(_) => panic!("a library at a nonexistent path cannot load"),
        }
    }

    #[test]
    fn driver_states_map_to_no_driver_and_others_to_nvml() {
        assert_eq!(map_error(NvmlError::DriverNotLoaded).label(), "no_driver");
        assert_eq!(map_error(NvmlError::LibraryNotFound).label(), "no_driver");
        assert_eq!(map_error(NvmlError::GpuLost).label(), "nvml");
        assert_eq!(map_error(NvmlError::Timeout).label(), "nvml");
    }

    #[test]
    fn own_process_name_comes_from_proc() {
        let name = process_name_from_proc(std::process::id());
        assert!(!name.is_empty());
        assert!(!name.ends_with('\n'));
        assert_eq!(process_name_from_proc(u32::MAX), "");
    }
}
