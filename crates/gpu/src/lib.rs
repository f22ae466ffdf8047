//! headroom-gpu: what is on the card right now. The [`GpuProbe`] trait is the only way the rest of
//! headroom reads GPU memory; the NVML implementation is the product, the scripted one serves tests.

pub mod probe;

pub use probe::*;
