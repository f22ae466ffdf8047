//! The commented example box file printed by `headroom up --print-example-config`: the CPU box
//! of `examples/cpu-box.up.toml`.

/// The example box file.
pub const EXAMPLE_BOX: &str = include_str!("../../../examples/cpu-box.up.toml");
