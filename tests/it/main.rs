//! The one integration-test binary: each module drives the real `headroom` binary or real servers
//! on 127.0.0.1.

mod bench;
mod cli;
mod doctor;
mod doctor_cli;
mod inputs;
mod plan;
mod plan_fixes;
mod serve;
mod serve_config;
mod serve_upstream;
mod top;
