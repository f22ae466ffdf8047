//! headroom-gpu: what is on the card right now and how it moves. The [`GpuProbe`] trait is the
//! only way the rest of headroom reads GPU memory; [`NvmlProbe`] is the real one (NVML opened at
//! run time), [`ScriptedProbe`] answers from a script for tests. The [`Sampler`] polls a probe into
//! a ring buffer and a sample file ([`sample`]); [`leak`] turns per-round floors and throughput
//! into a verdict using the statistics in [`trend`]. [`HostPool`] is the probe of a box without a
//! GPU: host RAM as one device whose users are process trees read from `/proc`; [`calibration`]
//! is the file `up` keeps its measurements in; [`listen`] names the process listening on a port;
//! [`cgroup`] finds this process's memory cgroup and reads one (an [`EnforcedPool`] is a host pool
//! whose use is the cgroup's charge).
//! [`remote`] reads a running `up`'s pool for tools that have no NVML.

pub mod calibration;
pub mod cgroup;
pub mod host;
pub mod leak;
pub mod listen;
pub mod nvml;
pub mod probe;
pub mod remote;
pub mod sample;
pub mod sampler;
pub mod scripted;
pub mod trend;

pub use calibration::{BackendCalibration, Calibration, CalibrationError, LearnedLane};
pub use cgroup::{EnforcedPool, MemoryCgroup, MemoryHierarchy};
pub use host::{
    HostPool, PSS_EVERY, PoolReadStats, TREE_WALK_EVERY, TreeCache, TreeMemory, process_tree,
    tree_memory,
};
pub use leak::{LeakConfig, LeakError, LeakReport, Verdict, verdict, verdict_with};
pub use listen::{ListenError, listening_pid, tree_listens, url_listener, url_port};
pub use nvml::NvmlProbe;
pub use probe::*;
pub use remote::{RemotePool, device_from_box};
pub use sample::{Sample, SampleFileError, SampleWriter, read_samples};
pub use sampler::{Recorder, Sampler, SamplerConfig, SamplerError, SamplerRun, SamplerStats};
pub use scripted::ScriptedProbe;
