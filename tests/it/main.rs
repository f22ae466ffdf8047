//! The one integration-test binary: each module drives the real `headroom` binary or real servers
//! on 127.0.0.1.

mod admin_box;
mod bench;
mod cli;
mod common;
mod deploy;
mod doctor;
mod doctor_cli;
mod doctor_live;
mod drill;
mod fault_upstream;
mod inputs;
mod live_vllm;
mod memory;
mod plan;
mod plan_asks;
mod plan_fixes;
mod plan_hub;
mod plan_llamacpp;
mod plan_v2;
mod scale_out;
mod serve;
mod serve_config;
mod serve_hardening;
mod serve_hostile;
mod serve_upstream;
mod serve_wire;
mod speech;
mod stale_conn;
mod top;
mod ui;
mod up_box;
mod upstream_faults;
