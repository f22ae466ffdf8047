//! `headroom plan` end to end through the built binary.
