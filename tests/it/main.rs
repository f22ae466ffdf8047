//! The one integration-test binary: each module drives the real `headroom` binary or real servers
//! on 127.0.0.1.

mod bench;
mod doctor;
mod plan;
mod serve;
mod serve_hardening;
mod serve_upstream;
mod serve_wire;
mod stale_conn;
mod top;
