//! Failures that are not about memory at all (no GPU visible, driver too old, no kernels for this
//! GPU, illegal memory access, NCCL errors, host shared memory (/dev/shm) too small for worker
//! processes), so the doctor can say "not an out-of-memory problem"
//! instead of guessing.

use crate::facts::{Facts, record};
use crate::finding::{Cause, Finding};
use crate::text::has;

const PATTERNS: [(&str, &str); 10] = [
    (
        "no kernel image is available for execution on the device",
        "the installed build has no kernels for this GPU's compute capability: install a build for this architecture",
    ),
    (
        "No CUDA GPUs are available",
        "no GPU is visible to the process: check CUDA_VISIBLE_DEVICES and the container's GPU runtime (`--gpus`)",
    ),
    (
        "CUDA driver version is insufficient",
        "the NVIDIA driver is older than the CUDA runtime: upgrade the driver or use a build for an older CUDA",
    ),
    (
        "Found no NVIDIA driver",
        "no NVIDIA driver is installed or loaded",
    ),
    (
        "an illegal memory access was encountered",
        "a kernel read or wrote outside its memory (a bug or a corrupted build), not a shortage of memory",
    ),
    (
        "NCCL error",
        "communication between GPUs failed (NCCL), not a shortage of memory",
    ),
    ("ModuleNotFoundError", "a Python package is missing"),
    (
        "Address already in use",
        "the port is already taken by another server",
    ),
    (
        "insufficient shared memory (shm)",
        "worker processes ran out of host shared memory (/dev/shm), not GPU memory: give the container more \
         (`docker run --shm-size=8g` or `--ipc=host`; Kubernetes: an `emptyDir` with `medium: Memory` mounted at /dev/shm), or use fewer worker processes",
    ),
    (
        "out of shared memory",
        "worker processes ran out of host shared memory (/dev/shm), not GPU memory: give the container more \
         (`docker run --shm-size=8g` or `--ipc=host`), or use fewer worker processes",
    ),
];

pub fn scan(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    for (pattern, meaning) in PATTERNS {
        if has(line, pattern) {
            record(&mut facts.non_memory, meaning, line_no);
            return true;
        }
    }
    false
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    if let Some(seen) = &facts.non_memory {
        out.push(
            Finding::new(Cause::NotOutOfMemory, 0.9)
                .fix(format!("not an out-of-memory problem: {}", seen.value))
                .lines(seen.lines.iter().copied()),
        );
    }
}
