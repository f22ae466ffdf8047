//! The commented example configuration (`headroom serve --print-example-config`).

/// The commented example printed by `headroom serve --print-example-config`. Every key appears.
pub const EXAMPLE_CONFIG: &str = r#"# headroom serve configuration. Durations accept ms, s, m (e.g. "500ms", "5s", "2m");
# sizes accept a byte count or KiB/MiB/GiB (KB/MB/GB) strings.

# Address to listen on. Anything other than a loopback address requires API keys.
listen = "127.0.0.1:8080"

# Bearer keys clients must send (Authorization: Bearer KEY). Compared in constant time.
# Required whenever `listen` is not loopback. /healthz and /readyz stay open (/readyz without a
# key says only whether the box is ready). The scheme is matched in any case (bearer, BEARER).
api_keys = []
# Extra keys read from an environment variable, comma separated (optional).
# api_keys_env = "HEADROOM_API_KEYS"

# Cap on requests in flight across all lanes together (they share one GPU). Optional.
# max_inflight_total = 4

# On SIGTERM/Ctrl-C: stop accepting, let in-flight work finish for at most this long.
shutdown_grace = "30s"
# Requests whose headers together exceed this get 431.
max_header_bytes = "16KiB"
# Client timeouts (nginx's names and defaults). A request head must arrive whole within
# client_header_timeout (from the connection's start, or from the head's first byte on a kept-alive
# connection); an idle kept-alive connection closes after keepalive_timeout; a write to the client
# that makes no progress for send_timeout (a client that stopped reading) drops the connection,
# and its request's slot and memory with it. A response is also cut at its request's deadline
# while the client is slow to read it.
client_header_timeout = "60s"
keepalive_timeout = "75s"
send_timeout = "60s"
# Most request-body bytes held in memory at once, across all requests (checked before a body is
# read; past it a request waits up to its lane's queue_timeout, then gets 503 with Retry-After).
# Default: 4 x the largest max_body_bytes (at least 64MiB), at most 1/8 of the machine's memory.
# max_body_memory = "256MiB"
# How often engine /metrics are read, and how long one read may take (a busy engine answers
# slowly; the next read starts when this one has ended).
scrape_interval = "1s"
scrape_timeout = "2s"
# Threads handling requests. One serves tens of thousands of proxied requests a second (far more
# than the engines behind it answer) and, like an nginx worker, keeps each request on one core
# with no hand-off between threads; tokenizer counts run on a separate blocking pool.
worker_threads = 1

# The memory pool lanes with gpu_memory_* admit on (the same table as in `headroom up`'s box
# file). A job is admitted only while free memory, less what admitted jobs have reserved and the
# readings do not show yet, covers its need plus the margin. Readings are taken by a sampler
# task, never on the request path.
[memory]
probe = "nvml"                         # nvml: a GPU; host: RSS of the `watch` process trees
device = 0                             # NVML device index (lanes may override with gpu_device)
# capacity = "8GiB"                    # pool size (required for host; a cap below the card for nvml)
margin = 0                              # always left free (a lane's gpu_memory_margin may ask for more)
watch = []                             # host: upstream URLs whose listening process trees are the pool
sample_interval = "50ms"               # sampler period (5ms to 50ms)
settle = "5s"                          # reserved-but-unused counts as in the reading this long after growth stops
stale_after = "1s"                     # older readings count as none (see gpu_fail_open)
learn_quantile = 0.95                  # learned needs cover this quantile of measured job peaks
learn_min_samples = 8                  # measured jobs before a learned need replaces the figure
# calibration = "calibration.json"     # learned needs are saved here and read back at start

[[lanes]]
name = "audio"                         # shown in metrics, /admin/lanes, x-headroom-lane
# Routes this lane serves. A request goes to the lane named in its x-headroom-lane header,
# else to the first lane whose `models` matches the request's model, else to the first lane
# with an empty `models` list that serves the route.
paths = ["/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech"]
models = []                            # exact names or prefixes ending in "*"; empty = any
chat_audio = false                     # true: chat requests carrying audio parts come here
upstreams = ["http://127.0.0.1:8001"]  # replicas; the least loaded one gets each request
idempotent = false                     # true: a request that failed before any response byte may be sent
                                       # again (fresh connection, other replica); false: it is answered 502
eject_after_failures = 3               # failures in a row (refused, reset, closed, 5xx, a timeout) that
                                       # take a replica out of rotation...
base_ejection_time = "5s"              # ...for this long times the ejections it had in a row...
max_ejection_time = "300s"             # ...at most this long; then one request probes it back in
max_ejection_percent = 50              # most of the lane's replicas out at once (never the last one)
priority = 10                          # higher goes first when lanes compete for max_inflight_total
max_inflight = 1                       # requests running upstream at once
max_queue = 8                          # requests allowed to wait (0 allowed)
queue_timeout = "30s"                  # longest wait in the queue, then 503 queue_timeout
request_timeout = "120s"               # whole-request deadline, then 504 (or a final SSE error event)
policy = "queue"                       # reject | queue | fallback
max_body_bytes = "25MiB"               # larger bodies get 413 before they are read
max_audio_seconds = 600.0              # from the WAV/FLAC/MP3/OGG header; longer gets 413
# Speech (/v1/audio/speech) costs what it makes: its audio seconds are the input's characters
# times this (English at about 150 words a minute), divided by the request's `speed`.
speech_seconds_per_char = 0.07
# max_input_chars = 4096               # longer speech input gets 400 input_too_long
# Memory one job needs from the [memory] pool (GPU or host, whichever it is); audio of unknown
# length counts as max_audio_seconds.
# gpu_device = 0
# gpu_memory_per_job = "1GiB"
# gpu_memory_per_audio_second = "4MiB"
# gpu_memory_margin = "512MiB"
# gpu_fail_open = false                # true: admit when the pool cannot be read
# learn = false                        # true: measure job peaks and use a high quantile of them
# upstream_api_key = "..."             # Bearer key sent upstream (or upstream_api_key_env = "VAR")

[[lanes]]
name = "text"
paths = ["/v1/chat/completions", "/v1/completions"]
upstreams = ["http://127.0.0.1:8000"]
priority = 0
max_inflight = 2
max_queue = 0
queue_timeout = "5s"
request_timeout = "60s"
policy = "fallback"                    # overloaded requests get the fallback below
fallback = "rule-based-cleanup"        # chat answered by the rule-based transcript cleaner
fallback_reasons = ["lane_saturated", "lane_queue_full"]  # refusals that may fall back (the default)
yield_to = ["audio"]                   # admit nothing new while audio has work...
max_yield = "2s"                       # ...for at most this long, so text never starves
yield_linger = "1s"                    # audio counts as busy this long after its last job ends
preempt = false                        # true: audio work stops running text (503 `preempted`)
preempt_per_job = 1                    # with preempt: text requests each admitted audio job stops, youngest
                                       # first; "all": every running one (engines sharing the same cores)
preempt_settle = "0s"                  # with preempt (abort) and `engine`: the audio job waits up to this long
                                       # for the engine's metrics to show the stopped requests gone (0s: no wait)
preempt_mode = "abort"                 # abort: stop them; pause: pause the engine while audio runs (vLLM
                                       # started with VLLM_SERVER_DEV_MODE=1: /sleep?level=0&mode=keep, /wake_up)
max_body_bytes = "1MiB"
max_input_tokens = 8192                # counted with `tokenizer`, else estimated as characters / 4
# tokenizer = "/models/llm/tokenizer.json"  # the model's tokenizer.json (relative: to this file)
max_output_tokens = 1024
output_tokens_mode = "cap"             # cap: lower max_tokens to the cap; reject: answer 400
engine = "vllm"                        # vllm | llamacpp: read its /metrics for admission
metrics_path = "/metrics"
engine_max_waiting = 4                 # hold while the engine's own queue is longer
engine_max_kv_cache_usage = 0.9        # hold while KV cache usage is above this fraction
engine_metrics_stale_after = "5s"      # older metrics count as saturated...
engine_fail_open = false               # ...unless this is true
"#;
