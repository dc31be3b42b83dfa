//! Takes each request's place in its org's share
//! (`control::org_share`) for as long as the request lasts.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::auth::{self, Principal};
use crate::control::AppState;
use crate::control::org_share::OrgPlace;

/// The places a request holds, put in its extensions: a handler whose
/// work outlives the request (an attached terminal, after its 101) takes
/// them for its own life; otherwise they go with the answer.
#[derive(Clone, Default)]
pub struct HeldPlaces(std::sync::Arc<std::sync::Mutex<Vec<OrgPlace>>>);

impl HeldPlaces {
    /// The places, moved out (none if taken already).
    pub fn take(&self) -> Vec<OrgPlace> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Every token a request carries as an org could: a bearer token, E2B's
/// `X-API-KEY` and `X-Access-Token` (each handler reads them in its own
/// order, so all are counted).
fn carried_tokens(headers: &axum::http::HeaderMap) -> Vec<&str> {
    let mut tokens: Vec<&str> = super::bearer_token(headers).into_iter().collect();
    for name in ["x-api-key", "x-access-token"] {
        if let Some(token) = headers.get(name).and_then(|v| v.to_str().ok())
            && !tokens.contains(&token.trim())
        {
            tokens.push(token.trim());
        }
    }
    tokens
}

/// Takes a place in the share of every org whose token the request
/// carries, for the whole request, its answer's body included (a download
/// holds it while it streams). Requests of no org (runners, the admin,
/// unauthenticated ones) take none; a token's lookup is the cached one
/// every handler makes again. The places are in the request's
/// extensions ([`HeldPlaces`]) for a handler that outlives it.
pub async fn hold(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    let mut orgs: Vec<String> = Vec::new();
    for token in carried_tokens(request.headers()) {
        let org = if auth::is_envd_token(token) {
            // One sandbox's envd token: its org's share, the sandbox named
            // beside it.
            request
                .headers()
                .get("e2b-sandbox-id")
                .and_then(|v| v.to_str().ok())
                .and_then(|sandbox_id| auth::envd_org(&state.envd_key, token, sandbox_id))
        } else {
            match auth::authenticate(&state.db, token).await {
                Ok(Some(Principal::Org { org_id })) => Some(org_id),
                _ => None,
            }
        };
        if let Some(org_id) = org
            && !orgs.contains(&org_id)
        {
            orgs.push(org_id);
        }
    }
    if orgs.is_empty() {
        return next.run(request).await;
    }
    let mut places = Vec::with_capacity(orgs.len());
    for org_id in &orgs {
        match state.org_requests.take(org_id) {
            Ok(taken) => places.push(taken),
            Err(refused) => return refused.into_response(),
        }
    }
    let place = HeldPlaces(std::sync::Arc::new(std::sync::Mutex::new(places)));
    request.extensions_mut().insert(place.clone());
    let response = next.run(request).await;
    // An answer of at most a part goes as it is (the socket takes it at
    // once: most answers, and the reads that must stay cheap). A larger
    // one, whole or streamed, holds the place until about its last byte
    // is sent (a whole one framed with its length as ever): a client
    // reading megabytes slowly holds its org's place, not one outside
    // every share.
    if axum::body::HttpBody::size_hint(response.body())
        .exact()
        .is_some_and(|bytes| bytes <= PART_BYTES as u64)
    {
        return response;
    }
    response.map(|body| {
        Body::new(Holding {
            body,
            pending: axum::body::Bytes::new(),
            _place: place,
        })
    })
}

/// An answer's body that holds its request's places until it is sent or
/// dropped, and says what it says of its size (a whole answer keeps its
/// `Content-Length`). It hands its bytes on in parts of at most
/// [`PART_BYTES`]: hyper drops a body once it has taken its last frame,
/// and a whole answer is one frame, taken long before its bytes are
/// sent; in parts, the body (and the places) go with about the last part.
struct Holding {
    body: Body,
    /// What is left of a frame larger than a part.
    pending: axum::body::Bytes,
    _place: HeldPlaces,
}

/// The largest part [`Holding`] hands on at once.
const PART_BYTES: usize = 64 * 1024;

impl hyper::body::Body for Holding {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        if this.pending.is_empty() {
            match std::pin::Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => this.pending = data,
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                other => return other,
            }
        }
        let part = this.pending.len().min(PART_BYTES);
        Poll::Ready(Some(Ok(hyper::body::Frame::data(
            this.pending.split_to(part),
        ))))
    }

    fn is_end_stream(&self) -> bool {
        self.pending.is_empty() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        let inner = self.body.size_hint();
        let pending = self.pending.len() as u64;
        let mut hint = hyper::body::SizeHint::new();
        hint.set_lower(inner.lower() + pending);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + pending);
        }
        hint
    }
}
