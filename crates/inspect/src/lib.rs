//! headroom-inspect: placeholder until its issue lands.
