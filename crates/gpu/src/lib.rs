//! headroom-gpu: what is on the card right now and how it moves. The [`GpuProbe`] trait is the
//! only way the rest of headroom reads GPU memory; [`NvmlProbe`] is the real one (NVML opened at
//! run time), [`ScriptedProbe`] answers from a script for tests. The [`Sampler`] polls a probe into
//! a ring buffer and a sample file ([`sample`]); [`leak`] turns per-round floors and throughput
//! into a verdict using the statistics in [`trend`].

pub mod leak;
pub mod nvml;
pub mod probe;
pub mod sample;
pub mod sampler;
pub mod scripted;
pub mod trend;

pub use leak::{LeakConfig, LeakError, LeakReport, Verdict, verdict, verdict_with};
pub use nvml::NvmlProbe;
pub use probe::*;
pub use sample::{Sample, SampleFileError, SampleWriter, read_samples};
pub use sampler::{Recorder, Sampler, SamplerConfig, SamplerError, SamplerRun, SamplerStats};
pub use scripted::ScriptedProbe;
