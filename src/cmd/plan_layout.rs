//! `headroom plan` layouts over several GPUs: `--data-parallel-size N` (one vLLM replica per GPU:
//! per-GPU figures, N `CUDA_VISIBLE_DEVICES` launch lines and the `upstreams` list for `serve`'s
//! lane) and the tensor-parallel KV split. The plan itself is per GPU; this adds the layout.

use std::fmt::Write as _;

use headroom_plan::Plan;
use headroom_plan::units::{gib, thousands};
use serde::Serialize;
use serde_json::Value;

/// Layout flags.
#[derive(Debug, clap::Args)]
pub struct LayoutArgs {
    /// Replicas, one per GPU of the --gpu kind (vLLM --data-parallel-size as N separate servers).
    #[arg(long, visible_alias = "dp", default_value_t = 1)]
    pub data_parallel_size: u64,
    /// Port of replica 0; replica i listens on BASE + i.
    #[arg(long, default_value_t = 8000)]
    pub base_port: u16,
}

/// What a multi-GPU layout adds to the plan.
#[derive(Debug, Clone, Serialize)]
pub struct Layout {
    pub data_parallel_size: u64,
    /// GPUs in all: replicas × tensor-parallel ranks.
    pub gpus: u64,
    /// One shell line per replica; none when the plan does not fit.
    pub launch_lines: Vec<String>,
    /// `serve`'s lane upstreams, in replica order.
    pub upstreams: Vec<String>,
    /// Sequences all replicas hold at once, and the lane limit over all of them.
    pub kv_cache_tokens_all_replicas: u64,
    pub max_inflight_all_replicas: u64,
}

fn quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@+,".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The layout for `plan` and `args`; `None` for one replica on one GPU.
pub fn layout(plan: &Plan, args: &LayoutArgs) -> anyhow::Result<Option<Layout>> {
    let n = args.data_parallel_size;
    if n == 0 {
        anyhow::bail!("invalid --data-parallel-size 0: must be at least 1");
    }
    if n == 1 && plan.tensor_parallel_size == 1 && plan.pipeline_parallel_size == 1 {
        return Ok(None);
    }
    // GPUs of one replica: tensor-parallel ranks × pipeline stages.
    let tp = plan.tensor_parallel_size.max(1) * plan.pipeline_parallel_size.max(1);
    if u64::from(args.base_port) + n > 65_536 {
        anyhow::bail!(
            "invalid --base-port {}: {n} replicas run past port 65535",
            args.base_port
        );
    }
    let mut launch_lines = Vec::new();
    let mut upstreams = Vec::new();
    // Nothing runnable for a plan that does not fit: no launch lines, no upstreams.
    let replicas = if plan.fits { n } else { 0 };
    for i in 0..replicas {
        let devices: Vec<String> = (i * tp..(i + 1) * tp).map(|d| d.to_string()).collect();
        let port = u64::from(args.base_port) + i;
        let mut parts = vec![
            format!("CUDA_VISIBLE_DEVICES={}", devices.join(",")),
            "vllm".into(),
            "serve".into(),
            quote(&plan.model),
        ];
        parts.extend(plan.vllm_args.iter().map(|a| quote(a)));
        parts.extend([
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
        ]);
        launch_lines.push(parts.join(" "));
        upstreams.push(format!("http://127.0.0.1:{port}"));
    }
    let per_replica = if plan.lanes.lane == "audio" {
        plan.lanes.audio_max_inflight
    } else {
        plan.lanes.text_max_inflight
    };
    Ok(Some(Layout {
        data_parallel_size: n,
        gpus: n * tp,
        launch_lines,
        upstreams,
        kv_cache_tokens_all_replicas: plan.kv_cache_tokens * n,
        max_inflight_all_replicas: per_replica * n,
    }))
}

/// The plan's JSON with the layout's fields added at the top level.
pub fn json_with_layout(plan: &Plan, layout: Option<&Layout>) -> anyhow::Result<Value> {
    let mut v = serde_json::to_value(plan)?;
    if let (Some(l), Some(obj)) = (layout, v.as_object_mut()) {
        let Value::Object(extra) = serde_json::to_value(l)? else {
            unreachable!("a struct serializes to an object")
        };
        obj.extend(extra);
    }
    Ok(v)
}

/// The table lines: figures per GPU, the KV split, the launch lines and the upstreams.
pub fn render_layout(plan: &Plan, layout: &Layout) -> String {
    let mut out = String::new();
    let tp = plan.tensor_parallel_size;
    if plan.pipeline_parallel_size > 1 {
        let _ = writeln!(
            out,
            "pipeline parallel {}: {} decoder layers per stage; the weights and KV above are the largest stage's",
            plan.pipeline_parallel_size, plan.layers_per_stage
        );
    }
    if tp > 1 {
        let heads = if plan.kv_heads_per_rank == 0 {
            "the MLA latent is replicated on every rank".to_string()
        } else {
            format!("{} KV heads per GPU", plan.kv_heads_per_rank)
        };
        let _ = writeln!(
            out,
            "tensor parallel {tp}: {heads}; {} B/token per GPU, {} B/token over the {tp} GPUs; KV pool {:.2} GiB per GPU ({:.2} GiB in all) for the same {} tokens",
            thousands(plan.kv_bytes_per_token),
            thousands(plan.kv_bytes_per_token_all_ranks),
            gib(plan.kv_cache_bytes),
            gib(plan.kv_cache_bytes * tp),
            thousands(plan.kv_cache_tokens)
        );
    }
    if layout.data_parallel_size > 1 {
        let _ = writeln!(
            out,
            "data parallel {}: the figures above are per replica ({} GPU{} each, {} GPUs in all); {} KV tokens and {} jobs in flight over all replicas",
            layout.data_parallel_size,
            layout.gpus / layout.data_parallel_size,
            if layout.gpus > layout.data_parallel_size {
                "s"
            } else {
                ""
            },
            layout.gpus,
            thousands(layout.kv_cache_tokens_all_replicas),
            layout.max_inflight_all_replicas
        );
    }
    if layout.launch_lines.is_empty() {
        return out;
    }
    let _ = writeln!(out, "launch:");
    for l in &layout.launch_lines {
        let _ = writeln!(out, "  {l}");
    }
    let _ = writeln!(
        out,
        "headroom serve {} lane: upstreams = [{}]",
        plan.lanes.lane,
        layout
            .upstreams
            .iter()
            .map(|u| format!("\"{u}\""))
            .collect::<Vec<_>>()
            .join(", ")
    );
    out
}
