//! headroom-gpu: placeholder until its issue lands.
