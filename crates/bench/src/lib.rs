//! headroom-bench: placeholder until its issue lands.
