//! headroom-gate: placeholder until its issue lands.
