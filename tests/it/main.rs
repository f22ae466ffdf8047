//! The one integration-test binary: each module drives the real `headroom` binary or real servers
//! on 127.0.0.1.

mod admin_box;
mod bench;
mod doctor;
mod memory;
mod plan;
mod plan_llamacpp;
mod plan_v2;
mod serve;
mod serve_upstream;
mod top;
