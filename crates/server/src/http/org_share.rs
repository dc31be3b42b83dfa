//! Takes each request's place in its org's share
//! (`control::org_share`) for as long as the request lasts.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

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
        if let Some(token) = headers.get(name).and_then(|v| v.to_str().ok()) {
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
        if let Ok(Some(Principal::Org { org_id })) = auth::authenticate(&state.db, token).await
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
    // An answer already whole (its size known) goes as it is, framed with
    // its length; a streamed one holds the place until its last byte.
    if axum::body::HttpBody::size_hint(response.body())
        .exact()
        .is_some()
    {
        return response;
    }
    response.map(|body| {
        Body::from_stream(body.into_data_stream().map(move |chunk| {
            let _held = &place;
            chunk
        }))
    })
}
