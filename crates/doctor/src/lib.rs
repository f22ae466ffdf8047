//! headroom-doctor: placeholder until its issue lands.
