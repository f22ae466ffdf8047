//! [`ScriptedProbe`]: a [`GpuProbe`] that answers from a script instead of a driver, for tests in
//! this crate and in every crate that takes a probe (gate, server, bench). Always compiled.
//!
//! The script is a queue of frames. Each `snapshot()` call takes the next frame; once the queue is
//! drained the last frame keeps being answered, so a test can script a ramp and then a plateau.
//! Frames may be errors, which lets a test see how a caller copes with a probe that fails mid-run.
//! The probe can also be steered while in use ([`ScriptedProbe::set`]), e.g. to raise memory in
//! the middle of a gateway test.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::probe::{DeviceSnapshot, GpuProbe, ProbeError, ProcessMemory};

/// One answer of a [`ScriptedProbe`].
pub type Frame = Result<Vec<DeviceSnapshot>, ProbeError>;

/// A probe that plays back scripted frames. See the module docs.
#[derive(Debug)]
pub struct ScriptedProbe {
    state: Mutex<ScriptState>,
    calls: AtomicU64,
}

#[derive(Debug)]
struct ScriptState {
    queue: VecDeque<Frame>,
    current: Frame,
}

impl ScriptedProbe {
    /// A probe that answers `frames` in order, then repeats the last one. An empty script answers
    /// an empty device list.
    pub fn new(frames: impl IntoIterator<Item = Frame>) -> Self {
        ScriptedProbe {
            state: Mutex::new(ScriptState {
                queue: frames.into_iter().collect(),
                current: Ok(Vec::new()),
            }),
            calls: AtomicU64::new(0),
        }
    }

    /// A probe that always answers the same devices.
    pub fn constant(devices: Vec<DeviceSnapshot>) -> Self {
        Self::new([Ok(devices)])
    }

    /// A probe that behaves like a machine without a driver: every call fails with
    /// [`ProbeError::NoDriver`] carrying `reason`.
    pub fn no_driver(reason: &str) -> Self {
        Self::new([Err(ProbeError::NoDriver(reason.to_string()))])
    }

    /// One GPU of `total_bytes` whose used memory follows `used` call by call, all of it held by
    /// process `pid` named `name`.
    pub fn single_gpu_series(total_bytes: u64, pid: u32, name: &str, used: &[u64]) -> Self {
        Self::new(used.iter().map(|&u| {
            let mut device = DeviceSnapshot::with_memory(0, total_bytes, u);
            device.processes.push(ProcessMemory {
                pid,
                name: name.to_string(),
                used_bytes: u,
            });
            Ok(vec![device])
        }))
    }

    /// Appends frames to the end of the script.
    pub fn push(&self, frame: Frame) {
        self.lock().queue.push_back(frame);
    }

    /// Drops whatever is still scripted and answers `frame` from now on.
    pub fn set(&self, frame: Frame) {
        let mut state = self.lock();
        state.queue.clear();
        state.current = frame;
    }

    /// How many times `snapshot()` has been called.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ScriptState> {
        // A panic in another test thread must not turn every later call into a second panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl GpuProbe for ScriptedProbe {
    fn snapshot(&self) -> Result<Vec<DeviceSnapshot>, ProbeError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut state = self.lock();
        if let Some(next) = state.queue.pop_front() {
            state.current = next;
        }
        state.current.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn used(frame: Frame) -> u64 {
        frame.expect("scripted frame")[0].used_bytes
    }

    #[test]
    fn plays_frames_in_order_then_repeats_the_last() {
        let probe = ScriptedProbe::single_gpu_series(100, 7, "python", &[10, 20, 30]);
        let seen: Vec<u64> = (0..5).map(|_| used(probe.snapshot())).collect();
        assert_eq!(seen, vec![10, 20, 30, 30, 30]);
        assert_eq!(probe.calls(), 5);
    }

    #[test]
    fn errors_are_scripted_like_frames() {
        let probe = ScriptedProbe::new([
            Ok(vec![DeviceSnapshot::with_memory(0, 100, 5)]),
            Err(ProbeError::Nvml("GPU is lost".into())),
        ]);
        assert_eq!(used(probe.snapshot()), 5);
        assert_eq!(
            probe.snapshot(),
            Err(ProbeError::Nvml("GPU is lost".into()))
        );
        assert!(probe.snapshot().is_err(), "the last frame repeats");
    }

    #[test]
    fn set_replaces_the_rest_of_the_script() {
        let probe = ScriptedProbe::single_gpu_series(100, 1, "a", &[1, 2, 3]);
        assert_eq!(used(probe.snapshot()), 1);
        probe.set(Ok(vec![DeviceSnapshot::with_memory(0, 100, 90)]));
        assert_eq!(used(probe.snapshot()), 90);
        probe.push(Ok(vec![DeviceSnapshot::with_memory(0, 100, 91)]));
        assert_eq!(used(probe.snapshot()), 91);
        assert_eq!(used(probe.snapshot()), 91);
    }

    #[test]
    fn no_driver_names_the_reason() {
        let probe = ScriptedProbe::no_driver("libnvidia-ml.so.1: cannot open shared object file");
        match probe.snapshot() {
            Err(ProbeError::NoDriver(reason)) => assert!(reason.contains("libnvidia-ml")),
            other => panic!("expected NoDriver, got {other:?}"),
        }
    }
}
