//! A trivial OpenAI-shaped server for load-generator benchmarks: `/v1/models` and a fixed,
//! non-streamed chat completion, answered at once. Used by `bench/bench-vs-oha.sh`.
//!
//! `cargo run --release -p headroom-bench --example trivial_server -- 127.0.0.1:0` prints the
//! address it listens on as the first line of stdout.

use axum::Router;
use axum::body::Bytes;
use axum::routing::{get, post};

const ANSWER: &str = r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;

fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:0".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let app = Router::new()
            .route(
                "/v1/models",
                get(|| async {
                    (
                        [("content-type", "application/json")],
                        r#"{"object":"list","data":[{"id":"trivial","object":"model"}]}"#,
                    )
                }),
            )
            .route(
                "/v1/chat/completions",
                post(|_body: Bytes| async { ([("content-type", "application/json")], ANSWER) }),
            );
        let listener = tokio::net::TcpListener::bind(&addr).await?;
        println!("{}", listener.local_addr()?);
        axum::serve(listener, app).await
    })
}
