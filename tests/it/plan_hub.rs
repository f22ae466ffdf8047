//! `headroom plan` of a model it has never seen: not on disk, not in the cache, not in the
//! catalog. Its config.json and safetensors headers come from a Hub on 127.0.0.1
//! (`headroom_hub::testing`, HF_ENDPOINT), the next plan reads the cache with the Hub gone, an
//! architecture the planner does not know is named, and without a network the error says what it
//! tried.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::Ordering;

use headroom_hub::testing::{FakeRepo, fake_sha, repo_with_shards, start};
use serde_json::Value;

fn plan(hf_home: &Path, endpoint: &str, extra_env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_headroom"));
    c.arg("plan")
        .args(args)
        .env("HF_HOME", hf_home)
        .env("HF_ENDPOINT", endpoint)
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE");
    for (k, v) in extra_env {
        c.env(k, v);
    }
    c.output().expect("run headroom")
}

async fn plan_async(
    hf_home: &Path,
    endpoint: &str,
    extra_env: &[(&str, &str)],
    args: &[&str],
) -> Output {
    let (home, endpoint) = (hf_home.to_path_buf(), endpoint.to_string());
    let env: Vec<(String, String)> = extra_env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        plan(&home, &endpoint, &env, &args)
    })
    .await
    .unwrap()
}

/// A model released after the catalog: a Qwen3-like decoder in two shards.
fn new_model(id: &str, config: &str, gated: Option<&str>) -> (FakeRepo, u64) {
    let first = vec![
        ("model.embed_tokens.weight".to_string(), 151_936, 2560),
        ("model.layers.0.mlp.up_proj.weight".to_string(), 9728, 2560),
    ];
    let second = vec![("lm_head.weight".to_string(), 151_936, 2560)];
    repo_with_shards(id, config, &[first, second], gated)
}

const QWEN_LIKE: &str = r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":2560,
  "intermediate_size":9728,"num_hidden_layers":36,"num_attention_heads":32,"num_key_value_heads":8,
  "head_dim":128,"vocab_size":151936,"max_position_embeddings":40960,"tie_word_embeddings":false,
  "torch_dtype":"bfloat16"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_released_after_the_catalog_is_planned_from_its_hub_headers_then_offline() {
    let (repo, declared) = new_model("newlab/Fresh-4B", QWEN_LIKE, Some("hf_ok"));
    let hub = start(vec![repo], false).await;
    let home = tempfile::tempdir().unwrap();
    let args = [
        "--model",
        "newlab/Fresh-4B",
        "--gpu",
        "24GiB",
        "--max-model-len",
        "8192",
        "--format",
        "json",
    ];
    let out = plan_async(
        home.path(),
        &hub.endpoint(),
        &[("HF_TOKEN", "hf_ok")],
        &args,
    )
    .await;
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(0), "{err}");
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    // Exact weights from the headers (the index's total_size is deliberately wrong).
    assert_eq!(p["weights_bytes"].as_u64().unwrap(), declared);
    assert_eq!(p["weights_origin"], "exact");
    // 36 layers × 8 KV heads × 128 × 2 (K, V) × 2 B.
    assert_eq!(
        p["kv_bytes_per_token"].as_u64().unwrap(),
        36 * 8 * 128 * 2 * 2
    );
    assert!(
        err.contains("read from") && err.contains(&hub.endpoint()),
        "{err}"
    );
    // Only headers travelled: a few KiB of gigabytes.
    assert!(declared > 1 << 30);
    assert!(hub.served.shard_bytes.load(Ordering::Relaxed) < 1 << 20);
    assert_eq!(hub.served.cdn_authorized.load(Ordering::Relaxed), 0);

    // The Hub gone, the next plan reads the cache.
    let dead = hub.endpoint();
    drop(hub);
    let again = plan_async(home.path(), &dead, &[], &args).await;
    assert_eq!(
        again.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let q: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(q["weights_bytes"], p["weights_bytes"]);
    // The cache holds no file a loader could take for the weights.
    let snap = home
        .path()
        .join("hub/models--newlab--Fresh-4B/snapshots")
        .join(fake_sha("newlab/Fresh-4B", 40));
    for entry in std::fs::read_dir(&snap).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(!name.ends_with(".safetensors"), "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gated_model_needs_hf_token_and_an_unknown_architecture_is_named() {
    let (gated, _) = new_model("newlab/Gated-4B", QWEN_LIKE, Some("hf_ok"));
    let mut types = Vec::new();
    for i in 0..48 {
        types.push(if i % 4 == 3 {
            "\"full_attention\""
        } else {
            "\"linear_attention\""
        });
    }
    let hybrid = format!(
        r#"{{"architectures":["Qwen3NextForCausalLM"],"model_type":"qwen3_next","hidden_size":2048,
        "num_hidden_layers":48,"num_attention_heads":16,"num_key_value_heads":2,"vocab_size":151936,
        "layer_types":[{}]}}"#,
        types.join(",")
    );
    let (next, _) = new_model("newlab/Hybrid-80B", &hybrid, None);
    let hub = start(vec![gated, next], false).await;
    let home = tempfile::tempdir().unwrap();
    let out = plan_async(
        home.path(),
        &hub.endpoint(),
        &[],
        &["--model", "newlab/Gated-4B", "--gpu", "24GiB"],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gated") && err.contains("HF_TOKEN"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");

    let out = plan_async(
        home.path(),
        &hub.endpoint(),
        &[],
        &["--model", "newlab/Hybrid-80B", "--gpu", "H100"],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Qwen3NextForCausalLM")
            && err.contains("36 of 48 layers are 'linear_attention'"),
        "{err}"
    );
}

#[test]
fn without_a_network_the_error_names_the_url_it_tried() {
    let home = tempfile::tempdir().unwrap();
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let out = plan(
        home.path(),
        &endpoint,
        &[],
        &["--model", "newlab/Never-1B", "--gpu", "24GiB"],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "{endpoint}/api/models/newlab/Never-1B/revision/main"
        )),
        "{err}"
    );
    assert!(err.contains("not in the catalog"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    // HF_HUB_OFFLINE=1: the Hub is not asked, and the error says so.
    let out = plan(
        home.path(),
        &endpoint,
        &[("HF_HUB_OFFLINE", "1")],
        &["--model", "newlab/Never-1B", "--gpu", "24GiB"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("HF_HUB_OFFLINE"), "{err}");
}
