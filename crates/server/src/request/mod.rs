//! The proxied request path, one module per step: choose the candidate lanes, read the body,
//! validate it into [`Facts`], choose the lane, apply the lane's limits, rewrite the body, admit
//! through the gate, arm preemption, forward upstream, and build the response. [`handle`] is the
//! outline; the facts read from the request travel between the steps as plain structs.

mod admit;
mod asked;
mod body;
mod fallback;
mod forward;
mod lane;
mod limits;
mod preempt;
mod respond;
mod rewrite;
mod validate;
use std::borrow::Cow;
use std::pin::Pin;

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use tokio::time::{Instant, Sleep};

use self::asked::Asked;
use crate::body_facts::JsonRoute;
use crate::core_state::Core;
use crate::error::ApiError;
use crate::live_config::LaneConfig;
use crate::proxy::Flight;
use crate::upstream::wire::Forwarded;

/// The OpenAI routes the gateway proxies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    Chat,
    Completions,
    Transcriptions,
    Translations,
    Speech,
}

impl Route {
    /// Every route, in declaration order (`route as usize` indexes it).
    pub(crate) const ALL: [Route; 5] = [
        Route::Chat,
        Route::Completions,
        Route::Transcriptions,
        Route::Translations,
        Route::Speech,
    ];

    pub(crate) fn path(self) -> &'static str {
        match self {
            Route::Chat => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::Transcriptions => "/v1/audio/transcriptions",
            Route::Translations => "/v1/audio/translations",
            Route::Speech => "/v1/audio/speech",
        }
    }

    /// The route served at `path`, if the gateway proxies it.
    pub(crate) fn from_path(path: &str) -> Option<Route> {
        Route::ALL.into_iter().find(|r| r.path() == path)
    }

    /// The route a request goes to without the router: a `POST` on a proxied path.
    pub(crate) fn proxied(method: &str, path: &str) -> Option<Route> {
        if method != "POST" {
            return None;
        }
        Route::from_path(path)
    }

    fn json(self) -> Option<JsonRoute> {
        match self {
            Route::Chat => Some(JsonRoute::Chat),
            Route::Completions => Some(JsonRoute::Completions),
            Route::Speech => Some(JsonRoute::Speech),
            Route::Transcriptions | Route::Translations => None,
        }
    }
}

/// What the gateway read from a request body before choosing a lane.
struct Facts<'a> {
    model: Option<Cow<'a, str>>,
    stream: bool,
    has_audio: bool,
    audio_seconds: Option<f64>,
    input_tokens: u64,
    texts: Vec<Cow<'a, str>>,
    token_ids: u64,
    max_tokens: Option<(&'static str, u64)>,
    /// A speech request's input length and speed.
    speech: Option<crate::body_facts::SpeechAsk>,
    /// The body is JSON (forwarded as received unless a step rewrites it).
    json: bool,
    audio_param: &'static str,
    input_param: &'static str,
}

/// The lane chosen for a request.
#[derive(Clone, Copy)]
struct Lane<'a> {
    index: usize,
    config: &'a LaneConfig,
}

impl<'a> Lane<'a> {
    fn name(&self) -> &'a str {
        self.config.spec.name.as_str()
    }
}

/// When the request must be done: the lane's timeout, or the client's shorter one.
#[derive(Clone, Copy)]
struct Deadline {
    at: Instant,
    timeout: std::time::Duration,
    /// The lane's own `request_timeout` (what an upstream is judged by).
    lane_timeout: std::time::Duration,
}

/// A response, and the upstream's end-to-end header fields kept as the upstream wrote them until
/// the response is written: the fast path ([`crate::listen::h1`]) writes them as they are, and
/// hyper's path makes them part of the response's map ([`IntoResponse`]). The response's own
/// map holds the gateway's fields, which replace an upstream's of the same name.
pub(crate) struct Reply {
    pub(crate) response: Response,
    pub(crate) forwarded: Forwarded,
    /// The request's deadline, which also bounds the writing of a response the client is slow
    /// to read (`None`: an answer of the gateway's own, bounded by `send_timeout` alone).
    pub(crate) deadline: Option<Instant>,
}

impl From<Response> for Reply {
    fn from(response: Response) -> Reply {
        Reply {
            response,
            forwarded: Forwarded::default(),
            deadline: None,
        }
    }
}

impl IntoResponse for Reply {
    fn into_response(mut self) -> Response {
        let own = std::mem::take(self.response.headers_mut());
        *self.response.headers_mut() = self.forwarded.into_map(own);
        self.response
    }
}

/// A connection's deadline timer, re-armed for each request it carries: moving a registered
/// timer's deadline later is one atomic update, where a timer of the request's own is put into
/// the runtime's timer wheel and taken out again (a lock each) on every request.
pub(crate) type Timer<'t> = Option<Pin<&'t mut Sleep>>;

/// Serves one proxied request, step by step. `timer`: the connection's, when it has one.
pub(crate) async fn handle(
    s: std::sync::Arc<Core>,
    route: Route,
    req: Request,
    mut timer: Timer<'_>,
) -> Result<Reply, ApiError> {
    let arrival = Instant::now();
    let (parts, body) = req.into_parts();
    let asked = Asked::of(&parts.headers);
    let targets = lane::candidates(&s.config, route, asked.lane)?;
    // The body's bytes count against `max_body_memory` from before they are read until the
    // request ends.
    let (bytes, _held) = body::read(&s, body, &asked, &targets, arrival).await?;
    let mut facts = validate::inspect(route, asked.content_type(), &bytes)?;
    let lane = lane::choose(&targets, route, &facts)?;
    limits::check(lane, route, &facts, bytes.len()).await?;
    let assumed_duration = limits::assume_unknown_duration(lane, &mut facts);
    limits::speech_seconds(lane, &mut facts);
    let forward_body = rewrite::output_tokens(lane, route, &facts, bytes.clone());
    let deadline = admit::deadline(arrival, lane, asked.timeout);
    // Under `headroom up`: a lane whose every backend is restarting answers 503 at once.
    if let Some(e) = s.backend_unavailable(lane.name(), &lane.config.spec.upstreams) {
        s.telemetry.outcome(lane.name(), "backend_unavailable");
        return Err(e);
    }
    let client = crate::retry_watch::client_of(asked.client_id());
    admit::note_early_retry(&s, lane, client);
    let permit = match admit::admit(&s, lane, &facts, deadline).await {
        Ok(permit) => permit,
        Err(rejection) => {
            if let Some(c) = client {
                s.retries
                    .refused(lane.name(), c, rejection.retry_after, Instant::now());
            }
            return admit::refused(&s, lane, route, &facts, &bytes, &rejection).map(Reply::from);
        }
    };
    let mut preempted = preempt::arm(&permit);
    let settled = preempt::settle(&s, &permit).await;
    let queue_wait = permit.queue_wait();
    let mut endpoint = forward::endpoint(&s, lane, &permit);
    let outgoing = forward::outgoing(&s, lane, route, &parts.uri, &parts.headers, forward_body);
    let mut flight = Flight::new(s.telemetry.clone(), arrival, permit);
    let response = loop {
        let send = forward::send(endpoint, &outgoing);
        let sent = preempt::race(
            send,
            preempted.as_mut(),
            deadline,
            timer.as_mut().map(Pin::as_mut),
            &mut flight,
        )
        .await?;
        let received = forward::received(sent, &mut flight, lane.config.idempotent)
            .map_err(|e| s.restarting_backend(lane.name(), &lane.config.spec.upstreams, e));
        match received? {
            forward::Attempt::Answered(response) => break response,
            forward::Attempt::Rerouted => {
                // A reroute keeps the permit (it moved to another upstream).
                endpoint = match flight.permit_mut() {
                    Some(p) => forward::endpoint(&s, lane, p),
                    None => Err(crate::upstream::UpstreamError::BadAddress(String::new())),
                };
            }
        }
    };
    let mut reply = respond::respond(
        lane, response, flight, deadline, queue_wait, preempted, &s.cut,
    )
    .await?;
    if let Some(settled) = settled {
        reply.response.headers_mut().insert(
            // Milliseconds this job waited, after admission, for the requests it stopped to end
            // on their engine (`preempt_settle`); absent when it waited for none.
            crate::headers::PREEMPT_SETTLE,
            axum::http::HeaderValue::from(settled.as_millis() as u64),
        );
    }
    if assumed_duration {
        reply.response.headers_mut().insert(
            // The audio's duration could not be read: the lane's longest clip was assumed.
            crate::headers::AUDIO_DURATION,
            axum::http::HeaderValue::from_static(
                "unknown; admitted as the lane's max_audio_seconds",
            ),
        );
    }
    Ok(reply)
}
