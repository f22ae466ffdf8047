//! headroom-hub against a Hub on 127.0.0.1 (`headroom_hub::testing`): headers by range requests
//! through a CDN redirect, the cache layout it leaves, the token kept to the Hub's host, and each
//! way it can fail saying what it tried.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use headroom_hub::testing::{FakeRepo, fake_sha, repo_with_shards, shard_header, start};
use headroom_hub::{FIRST_RANGE_BYTES, HubConfig, HubError, fetch};

const CONFIG: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4096,
  "intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
  "vocab_size":128256,"max_position_embeddings":131072,"torch_dtype":"bfloat16"}"#;

/// A two-shard repository whose second header is longer than the first range request, so it
/// takes two. Returns the repo and the tensor bytes its headers declare.
fn sharded_repo(id: &str, gated: Option<&str>) -> (FakeRepo, u64) {
    // 4,000 small tensors with long names: a header of several hundred KiB.
    let many: Vec<(String, u64, u64)> = (0..4000)
        .map(|i| {
            (
                format!("model.layers.{i}.some_rather_long_module_name_for_padding.weight"),
                4096,
                64,
            )
        })
        .collect();
    assert!(shard_header(&many).0.len() as u64 > FIRST_RANGE_BYTES);
    let first = vec![
        ("model.embed_tokens.weight".to_string(), 128_256, 4096),
        (
            "model.layers.0.mlp.up_proj.weight".to_string(),
            14_336,
            4096,
        ),
    ];
    repo_with_shards(id, CONFIG, &[first, many], gated)
}

fn config(endpoint: &str, cache: &Path, token: Option<&str>) -> HubConfig {
    HubConfig {
        endpoint: endpoint.to_string(),
        token: token.map(String::from),
        cache_dir: cache.to_path_buf(),
        offline: false,
        timeout: Duration::from_secs(20),
    }
}

#[tokio::test]
async fn headers_are_read_by_range_and_kept_in_the_cache_layout() {
    let (repo, declared) = sharded_repo("acme/tiny", None);
    let commit = repo.commit.clone();
    let hub = start(vec![repo], false).await;
    let cache = tempfile::tempdir().unwrap();
    let f = fetch(
        &config(&hub.endpoint(), cache.path(), Some("hf_test")),
        "acme/tiny",
        "main",
    )
    .await
    .unwrap();
    assert_eq!(f.commit, commit);
    assert_eq!(f.shards.len(), 2);
    // Gigabytes declared; a few hundred KiB sent: the headers and the first range's slack.
    assert!(declared > GIB, "{declared}");
    let sent = hub.served.shard_bytes.load(Ordering::Relaxed);
    assert!(sent >= f.header_bytes, "{sent} < {}", f.header_bytes);
    assert!(sent < f.header_bytes + 2 * FIRST_RANGE_BYTES, "{sent}");
    // The token went to the Hub, never to the CDN it redirects to.
    assert!(hub.served.hub_authorized.load(Ordering::Relaxed) > 0);
    assert_eq!(hub.served.cdn_authorized.load(Ordering::Relaxed), 0);

    let repo_dir = cache.path().join("models--acme--tiny");
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs/main")).unwrap(),
        commit
    );
    let snap = repo_dir.join("snapshots").join(&commit);
    assert_eq!(f.snapshot, snap);
    assert_eq!(
        std::fs::read_to_string(snap.join("config.json")).unwrap(),
        CONFIG
    );
    // A header is kept by the name no tool takes for the shard, under the Hub's X-Linked-Etag.
    for shard in &f.shards {
        assert!(
            !snap.join(shard).exists(),
            "{shard} exists under its own name"
        );
        let header = snap.join(format!("{shard}.headroom-header"));
        let target = std::fs::read_link(&header).unwrap();
        let sha = fake_sha(&format!("{commit}{shard}"), 64);
        assert_eq!(
            target,
            Path::new("../../blobs").join(format!("{sha}.headroom-header"))
        );
        assert!(!repo_dir.join("blobs").join(&sha).exists());
    }

    // The next plan is offline: the cache alone gives the exact weights.
    let env = headroom_inspect::resolve::Env {
        hf_hub_cache: Some(cache.path().to_path_buf()),
        ..Default::default()
    };
    drop(hub);
    let r = headroom_inspect::resolve_model("acme/tiny", &env).unwrap();
    assert_eq!(r.from, headroom_inspect::ResolvedFrom::HfCache(snap));
    let w = r.spec.exact_weights.unwrap();
    assert_eq!(w.bytes, declared);
    assert_eq!(w.origin, headroom_plan::WeightsOrigin::SafetensorsHeaders);
}

const GIB: u64 = 1 << 30;

#[tokio::test]
async fn a_single_file_repository_and_a_cdn_that_ignores_range() {
    let (repo, d) = repo_with_shards(
        "acme/one",
        CONFIG,
        &[vec![("w".into(), 1 << 20, 4096)]],
        None,
    );
    let h = shard_header(&[("w".into(), 1 << 20, 4096)]).0;
    let hub = start(vec![repo], true).await;
    let cache = tempfile::tempdir().unwrap();
    let f = fetch(
        &config(&hub.endpoint(), cache.path(), None),
        "acme/one",
        "main",
    )
    .await
    .unwrap();
    assert_eq!(f.shards, vec!["model.safetensors"]);
    assert_eq!(f.header_bytes, h.len() as u64);
    // 8 GiB offered whole; the client stopped after the first range's worth. What the server
    // counts as sent also holds what loopback's socket buffers took before the client closed (up
    // to a few MiB, more when the client is descheduled on a busy machine: 4.4 MiB seen in CI), so
    // the bound is 64 MiB: far from the 8 GiB a client reading it all would take.
    let sent = hub.served.shard_bytes.load(Ordering::Relaxed);
    assert!(d >= 8 * GIB && sent < 64 << 20, "{sent}");
}

#[tokio::test]
async fn a_gated_repository_needs_its_token() {
    let (repo, _) = sharded_repo("acme/gated", Some("hf_right"));
    let hub = start(vec![repo], false).await;
    let cache = tempfile::tempdir().unwrap();
    for token in [None, Some("hf_wrong")] {
        let err = fetch(
            &config(&hub.endpoint(), cache.path(), token),
            "acme/gated",
            "main",
        )
        .await
        .unwrap_err();
        assert!(matches!(err, HubError::Gated { .. }), "{err}");
        assert!(err.to_string().contains("HF_TOKEN"), "{err}");
    }
    fetch(
        &config(&hub.endpoint(), cache.path(), Some("hf_right")),
        "acme/gated",
        "main",
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn each_failure_names_the_url_it_tried() {
    let hub = start(Vec::new(), false).await;
    let cache = tempfile::tempdir().unwrap();
    let err = fetch(
        &config(&hub.endpoint(), cache.path(), None),
        "acme/none",
        "main",
    )
    .await
    .unwrap_err();
    assert!(matches!(err, HubError::NotFound { .. }), "{err}");
    let url = format!("{}/api/models/acme/none/revision/main", hub.endpoint());
    assert!(err.to_string().contains(&url), "{err}");

    // Nothing listening: the URL and the connection error.
    let dead = format!("http://127.0.0.1:{}", hub.addr.port());
    drop(hub);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let err = fetch(&config(&dead, cache.path(), None), "acme/none", "main")
        .await
        .unwrap_err();
    assert!(matches!(err, HubError::Unreachable { .. }), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("{dead}/api/models/acme/none/revision/main")),
        "{err}"
    );

    // HF_HUB_OFFLINE: nothing asked.
    let (repo, _) = sharded_repo("acme/tiny", None);
    let hub = start(vec![repo], false).await;
    let mut cfg = config(&hub.endpoint(), cache.path(), None);
    cfg.offline = true;
    let err = fetch(&cfg, "acme/tiny", "main").await.unwrap_err();
    assert!(matches!(err, HubError::Offline { .. }), "{err}");
    assert_eq!(hub.served.requests.load(Ordering::Relaxed), 0);
    // Nothing was written for the failures.
    assert!(!cache.path().join("models--acme--none").exists());
}

#[tokio::test]
async fn a_fetch_cut_short_leaves_nothing_a_plan_would_read() {
    let (mut repo, _) = sharded_repo("acme/broken", None);
    // The second shard is not a safetensors file: its length field says 0.
    repo.files.insert(
        "model-00002-of-00002.safetensors".into(),
        headroom_hub::testing::FakeFile::Shard {
            header: vec![0; 16],
            data_len: 1024,
        },
    );
    let hub = start(vec![repo], false).await;
    let cache = tempfile::tempdir().unwrap();
    let err = fetch(
        &config(&hub.endpoint(), cache.path(), None),
        "acme/broken",
        "main",
    )
    .await
    .unwrap_err();
    assert!(matches!(err, HubError::Malformed { .. }), "{err}");
    assert!(
        err.to_string().contains("model-00002-of-00002.safetensors"),
        "{err}"
    );
    // No config.json, so the cache does not offer the model with half its headers.
    let env = headroom_inspect::resolve::Env {
        hf_hub_cache: Some(cache.path().to_path_buf()),
        ..Default::default()
    };
    assert!(headroom_inspect::resolve_model("acme/broken", &env).is_err());
}
