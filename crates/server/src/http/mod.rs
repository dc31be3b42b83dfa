//! The HTTP layer: thin handlers that parse, authenticate and call into
//! the records. Every error leaves as the one envelope of `api::ErrorBody`.

pub(crate) mod admin;
pub(crate) mod blocks;
pub mod commands;
pub(crate) mod drain;
pub(crate) mod files;
pub(crate) mod homes;
pub(crate) mod images;
pub(crate) mod kept;
pub(crate) mod meta;
pub mod org_share;
pub mod runner;
pub mod sandboxes;
pub(crate) mod secrets;
pub(crate) mod snapshots;
pub mod ui;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde::de::DeserializeOwned;

use crate::auth::{self, Principal};
pub use crate::control::AppState;
pub use crate::error::ControlError;

pub fn router(state: AppState) -> Router {
    // axum adds a route's `Allow` header outside every layer of the route,
    // so only a router around this one sees the final answer: there, no
    // 404 names a path's methods (an admin path's to a non-admin caller,
    // `method_not_allowed`).
    Router::new()
        .fallback_service(routes(state))
        .layer(middleware::map_response(|mut response: Response| async {
            if response.status() == StatusCode::NOT_FOUND {
                response.headers_mut().remove(axum::http::header::ALLOW);
            }
            // Answers carry tokens (E2B's `envdAccessToken`), records and
            // files, and E2B's clients authenticate with headers a shared
            // cache does not know to keep private: none is stored, and none
            // is read as another type than it says. The dashboard sets its
            // own (its static files may be kept a while).
            let headers = response.headers_mut();
            headers
                .entry(axum::http::header::CACHE_CONTROL)
                .or_insert(axum::http::HeaderValue::from_static("no-store"));
            headers
                .entry(axum::http::header::X_CONTENT_TYPE_OPTIONS)
                .or_insert(axum::http::HeaderValue::from_static("nosniff"));
            response
        }))
}

fn routes(state: AppState) -> Router {
    Router::new()
        .route(
            "/v1/admin/orgs",
            post(admin::create_org).get(admin::list_orgs),
        )
        .route("/v1/admin/orgs/{org}/tokens", post(admin::create_org_token))
        .route("/v1/admin/tokens/revoke", post(admin::revoke_token))
        .route("/v1/admin/runner-tokens", post(admin::create_runner_token))
        .route("/v1/admin/counts", get(admin::counts))
        .route("/v1/admin/filesystems", get(admin::list_filesystems))
        .route(
            "/v1/admin/filesystems/{id}/orgs/{org}",
            put(admin::bind_filesystem).delete(admin::unbind_filesystem),
        )
        .route("/v1/admin/runners", get(drain::list))
        .route("/v1/admin/runners/{id}/{action}", post(drain::admin_action))
        .route("/v1/runner/preempt", post(drain::runner_preempt))
        .route(
            "/v1/admin/sandboxes/{id}/quarantine",
            post(admin::quarantine).delete(admin::release_quarantine),
        )
        .route(
            "/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(
            "/v1/sandboxes/{id}",
            get(sandboxes::get)
                .patch(sandboxes::update)
                .delete(sandboxes::delete),
        )
        .route("/v1/sandboxes/{id}/stop", post(sandboxes::stop))
        .route("/v1/sandboxes/{id}/keepalive", post(sandboxes::keepalive))
        .route(
            "/v1/sandboxes/{id}/kept/{copy}/discard",
            post(kept::discard),
        )
        .route(
            "/v1/admin/sandboxes/{id}/kept/{copy}/discard",
            post(kept::admin_discard),
        )
        .route(
            "/v1/sandboxes/{id}/kept/{copy}/salvage",
            post(kept::salvage),
        )
        .route(
            "/v1/admin/sandboxes/{id}/kept/{copy}/salvage",
            post(kept::admin_salvage),
        )
        .route("/v1/runner/kept", post(kept::report))
        .route("/v1/sandboxes/{id}/start", post(sandboxes::start))
        .route("/v1/sandboxes/{id}/events", get(sandboxes::events))
        .route(
            "/v1/sandboxes/{id}/commands",
            post(commands::create).get(commands::list),
        )
        .route(
            "/v1/sandboxes/{id}/commands/{command_id}",
            get(commands::get),
        )
        .route(
            "/v1/sandboxes/{id}/commands/{command_id}/output",
            get(commands::output),
        )
        .route(
            "/v1/sandboxes/{id}/commands/{command_id}/signal",
            post(commands::signal),
        )
        .route(
            "/v1/sandboxes/{id}/commands/{command_id}/resize",
            post(commands::resize),
        )
        .route(
            "/v1/sandboxes/{id}/commands/{command_id}/attach",
            get(commands::attach),
        )
        .route(
            "/v1/sandboxes/{id}/commands/{command_id}/stdin",
            // Streamed through to the runner: no body limit here.
            post(commands::stdin).layer(DefaultBodyLimit::disable()),
        )
        .route(
            "/v1/sandboxes/{id}/files",
            // Streamed through to the runner: no body limit here.
            get(files::read)
                .put(files::write)
                .delete(files::remove)
                .layer(DefaultBodyLimit::disable()),
        )
        .route("/v1/sandboxes/{id}/files/list", get(files::list))
        .route("/v1/sandboxes/{id}/files/move", post(files::rename))
        .route("/v1/sandboxes/{id}/files/mkdir", post(files::mkdir))
        .route(
            "/v1/sandboxes/{id}/files/tar",
            get(files::tar_read)
                .put(files::tar_write)
                .layer(DefaultBodyLimit::disable()),
        )
        .route("/v1/sandboxes/{id}/snapshots", post(snapshots::create))
        .route("/v1/snapshots", get(snapshots::list))
        .route(
            "/v1/snapshots/{id}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route("/v1/runner/sandboxes/{id}/saves", post(homes::report_save))
        .route("/v1/runner/snapshots/{id}/report", post(snapshots::report))
        .route("/v1/secrets", get(secrets::list))
        .route(
            "/v1/secrets/{name}",
            put(secrets::set).delete(secrets::delete),
        )
        .route(
            "/v1/runner/sandboxes/{id}/secrets",
            post(secrets::for_runner),
        )
        .route("/v1/images", get(images::list))
        .route(
            "/v1/images/{name}",
            get(images::get).put(images::commit).delete(images::delete),
        )
        .route("/v1/blocks/{org}/missing", post(blocks::missing))
        .route("/v1/blocks/{org}/fetch", post(blocks::fetch))
        .route(
            "/v1/blocks/{org}/batch",
            post(blocks::batch).layer(DefaultBodyLimit::max(api::blocks::BATCH_BODY_BYTES_MAX)),
        )
        .route(
            "/v1/blocks/{org}/{kind}/{hex}",
            get(blocks::get)
                .put(blocks::put)
                .layer(DefaultBodyLimit::max(blocks::OBJECT_BODY_BYTES_MAX)),
        )
        .route("/v1/runner/register", post(runner::register))
        .route("/v1/runner/heartbeat", post(runner::heartbeat))
        .route("/v1/runner/assignments", get(runner::assignments))
        .route(
            "/v1/runner/sandboxes/{id}/report",
            post(runner::report_sandbox),
        )
        .route(
            "/v1/runner/commands/{id}/report",
            post(runner::report_command),
        )
        .route(
            "/v1/runner/commands/{id}/output/{stream}",
            put(runner::append_output),
        )
        .route("/v1/whoami", get(meta::whoami))
        .route("/v1/deployment", get(meta::deployment))
        .route("/v1/openapi.json", get(meta::openapi))
        .route("/metrics", get(meta::metrics))
        .route("/healthz", get(meta::health))
        .route("/ui", get(ui::index))
        .route("/ui/", get(ui::index))
        .route("/ui/app.js", get(ui::app_js))
        .route("/ui/style.css", get(ui::style_css))
        // On every route above (axum sets it on those registered before):
        // E2B's routes answer in E2B's own shape.
        .method_not_allowed_fallback(method_not_allowed)
        .nest("/e2b", crate::e2b::router())
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(crate::REQUEST_BODY_BYTES_MAX))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            org_share::hold,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// Request id, span and metrics for every request (the outermost layer,
/// so rejections by inner layers are counted and carry the id too).
async fn observe(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let started = std::time::Instant::now();
    // Both cheap to keep: a method is a small enum, a matched path an Arc.
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .cloned();
    let response = request_id(request, next).await;
    state.metrics.observe_request(
        method.as_str(),
        route.as_ref().map_or("unmatched", |p| p.as_str()),
        response.status().as_u16(),
        started.elapsed(),
    );
    response
}

tokio::task_local! {
    /// The id of the request being handled, for error bodies and logs.
    static REQUEST_ID: String;
}

async fn request_id(request: Request, next: Next) -> Response {
    use tracing::Instrument;
    let id = auth::random_hex(8).unwrap_or_else(|_| "unknown".to_owned());
    let span = tracing::info_span!("request", request_id = %id, method = %request.method(), path = %request.uri().path());
    let started = std::time::Instant::now();
    // A mutation runs to its end on a task of its own: a client that goes
    // away (a runner killed mid-report, a timed-out retry) drops only the
    // answer, never the steps after a commit (metrics, wake-ups, pointers).
    // Reads stay cancellable: a long-poll nobody waits for ends at once.
    let mutation =
        request.method() != axum::http::Method::GET && request.method() != axum::http::Method::HEAD;
    let nul = holds_nul(request.uri());
    let e2b = request.uri().path().starts_with("/e2b/");
    let handled = REQUEST_ID
        .scope(id.clone(), async move {
            let response = if nul {
                let refused = ControlError::new(
                    api::ErrorCode::InvalidRequest,
                    "the URL's path or query holds a NUL byte (%00): no id, path or filter can",
                );
                // In the shape of the surface asked.
                if e2b {
                    crate::e2b::E2bError::from(refused).into_response()
                } else {
                    refused.into_response()
                }
            } else {
                next.run(request).await
            };
            tracing::debug!(
                status = response.status().as_u16(),
                elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
                "answered"
            );
            response
        })
        .instrument(span);
    let mut response = if mutation {
        match tokio::spawn(handled).await {
            Ok(response) => response,
            Err(err) => {
                tracing::error!(request_id = %id, %err, "a request's handler failed");
                REQUEST_ID
                    .scope(id.clone(), async {
                        ControlError::new(api::ErrorCode::Internal, "internal error")
                            .into_response()
                    })
                    .await
            }
        }
    } else {
        handled.await
    };
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// Whether the URL holds an encoded NUL byte. No id, file path or filter
/// can hold one, and PostgreSQL refuses one in any text it is asked to
/// compare: such a request was answered 500 there (404 on SQLite).
fn holds_nul(uri: &axum::http::Uri) -> bool {
    uri.path().contains("%00") || uri.query().is_some_and(|query| query.contains("%00"))
}

async fn not_found() -> ControlError {
    ControlError::new(api::ErrorCode::NotFound, "no such endpoint")
}

/// A path the router has, asked with a method it does not take: the
/// envelope (axum's own 405 has an empty body), 405 with the `Allow`
/// header axum adds. No `api::ErrorCode` is a 405 of its own, so the code
/// is `invalid_request`: the request is malformed, not the resource's
/// state. An admin path exists only for the admin token, as its handlers'
/// `AdminCaller` says: anyone else gets the unknown route's answer (and
/// `router` takes the `Allow` header off every 404).
async fn method_not_allowed(
    caller: Result<Caller, ControlError>,
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> Response {
    if uri.path().starts_with("/v1/admin/") && !matches!(caller, Ok(Caller(Principal::Admin))) {
        return not_found().await.into_response();
    }
    let mut response = ControlError::new(
        api::ErrorCode::InvalidRequest,
        format!(
            "{method} is not a method of {}: the Allow header and the OpenAPI document name its methods",
            uri.path()
        ),
    )
    .with_details(serde_json::json!({ "method": method.as_str() }))
    .into_response();
    *response.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    response
}

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        let request_id = REQUEST_ID.try_with(Clone::clone).unwrap_or_default();
        let status =
            StatusCode::from_u16(self.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = api::ErrorBody {
            error: api::ErrorDetail {
                code: self.code,
                message: self.message,
                details: self.details,
                request_id,
            },
        };
        let mut response = (status, axum::Json(body)).into_response();
        if let Some(seconds) = self.retry_after_s {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// `Json<T>` whose rejections are our envelope: malformed JSON or a wrong
/// field is 400 `invalid_request` naming the problem; an oversized body 413.
/// A number with no fractional part is an integer, as JSON Schema counts
/// (`5.0` where the document says `integer` is 5).
pub struct Json<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Json<T> {
    type Rejection = ControlError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ControlError> {
        match axum::Json::<serde_json::Value>::from_request(request, state).await {
            Ok(axum::Json(mut value)) => {
                whole_numbers_as_integers(&mut value);
                serde_path_to_error::deserialize(value)
                    .map(Json)
                    .map_err(|error| {
                        let path = error.path().to_string();
                        let message = if path == "." {
                            error.inner().to_string()
                        } else {
                            format!("{path}: {}", error.inner())
                        };
                        ControlError::new(api::ErrorCode::InvalidRequest, message)
                    })
            }
            Err(rejection) => {
                let code = if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    api::ErrorCode::PayloadTooLarge
                } else {
                    api::ErrorCode::InvalidRequest
                };
                Err(ControlError::new(code, rejection.body_text()))
            }
        }
    }
}

/// Rewrites every number with no fractional part (`5.0`, `1e3`) as the
/// integer it is, where one fits in 64 bits: JSON Schema's `integer` is a
/// mathematical integer, so a generator may write one that way. Fields of
/// type `f64` read integers as well, so nothing else changes.
pub fn whole_numbers_as_integers(value: &mut serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::Number(number) => {
            if let Some(float) = number.as_f64().filter(|_| number.is_f64())
                && float.fract() == 0.0
            {
                // `as` saturates; only a float that round-trips is exact.
                if (0.0..18_446_744_073_709_551_616.0).contains(&float) {
                    *value = Value::from(float as u64);
                } else if (-9_223_372_036_854_775_808.0..0.0).contains(&float) {
                    *value = Value::from(float as i64);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(whole_numbers_as_integers),
        Value::Object(fields) => fields.values_mut().for_each(whole_numbers_as_integers),
        Value::Null | Value::Bool(_) | Value::String(_) => {}
    }
}

/// A raw body whose rejections are our envelope: over the route's body
/// limit 413 `payload_too_large`, any other failure to read it 400.
pub struct RawBody(pub axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ControlError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ControlError> {
        match axum::body::Bytes::from_request(request, state).await {
            Ok(bytes) => Ok(RawBody(bytes)),
            Err(rejection) => {
                let code = if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    api::ErrorCode::PayloadTooLarge
                } else {
                    api::ErrorCode::InvalidRequest
                };
                Err(ControlError::new(code, rejection.body_text()))
            }
        }
    }
}

/// `Query<T>` whose rejections are our envelope: an unknown parameter or
/// a bad value is 400 `invalid_request` naming it.
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ControlError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Query(value)| Query(value))
            .map_err(|rejection| {
                ControlError::new(api::ErrorCode::InvalidRequest, rejection.body_text())
            })
    }
}

/// `Path<T>` whose rejections are our envelope: a segment that is not
/// UTF-8 or does not parse is 400 `invalid_request`.
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ControlError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(value)| Path(value))
            .map_err(|rejection| {
                ControlError::new(api::ErrorCode::InvalidRequest, rejection.body_text())
            })
    }
}

/// An org token's caller, with its org id. Extracted before the body, so
/// any other token gets 404 without the body being read: an endpoint's
/// schema is not taught to a caller who may not use it.
pub struct OrgCaller(pub String);

/// One runner, by its own credential (the runner protocol after
/// registration), with its id.
pub struct RunnerCaller(pub String);

impl RunnerCaller {
    /// The runner a request names must be the caller: a runner speaks for
    /// itself alone, and any other runner is 404 to it.
    pub fn speaks_for(&self, runner_id: &str) -> Result<(), ControlError> {
        if self.0 == runner_id {
            Ok(())
        } else {
            Err(crate::control::runner_protocol::no_such_runner())
        }
    }
}

/// Who may register: a runner token (a new runner) or a runner's own
/// credential (that runner again).
pub struct RegistrantCaller(pub crate::control::runner_protocol::Registrant);

/// The admin token's caller. Admin resources do not exist for anyone else.
pub struct AdminCaller;

/// Who may read `/metrics`: the admin token, or the deployment's metrics
/// token (`Config::metrics_token`). The fleet's counts are nobody else's
/// business: an org would learn how busy the deployment and its other
/// orgs are.
pub struct MetricsCaller;

/// A caller of the block service: an org token or a runner's credential
/// (which org's objects either may use is `control::blocks`' rule).
pub struct BlocksCaller(pub Principal);

impl FromRequestParts<AppState> for OrgCaller {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ControlError> {
        let caller = Caller::from_request_parts(parts, state).await?;
        caller.org().map(OrgCaller)
    }
}

impl FromRequestParts<AppState> for RunnerCaller {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ControlError> {
        let caller = Caller::from_request_parts(parts, state).await?;
        caller.runner().map(RunnerCaller)
    }
}

impl FromRequestParts<AppState> for RegistrantCaller {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ControlError> {
        use crate::control::runner_protocol::Registrant;
        match Caller::from_request_parts(parts, state).await?.0 {
            Principal::RunnerEnrolment { profile } => {
                Ok(RegistrantCaller(Registrant::Enrolment { profile }))
            }
            Principal::Runner { runner_id } => Ok(RegistrantCaller(Registrant::Runner(runner_id))),
            _ => Err(ControlError::new(
                api::ErrorCode::NotFound,
                "no such endpoint for this token (registering needs a runner token)",
            )),
        }
    }
}

impl FromRequestParts<AppState> for AdminCaller {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ControlError> {
        match Caller::from_request_parts(parts, state).await?.0 {
            Principal::Admin => Ok(AdminCaller),
            _ => Err(ControlError::new(
                api::ErrorCode::NotFound,
                "no such endpoint",
            )),
        }
    }
}

impl FromRequestParts<AppState> for MetricsCaller {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ControlError> {
        if let (Some(expected), Some(given)) = (
            state.config.metrics_token.as_deref(),
            bearer_token(&parts.headers),
        ) && blake3::hash(expected.as_bytes()) == blake3::hash(given.as_bytes())
        {
            // Compared as hashes: `blake3::Hash`'s equality takes the same
            // time wherever the two differ.
            return Ok(MetricsCaller);
        }
        match Caller::from_request_parts(parts, state).await?.0 {
            Principal::Admin => Ok(MetricsCaller),
            _ => Err(ControlError::new(
                api::ErrorCode::NotFound,
                "no such endpoint (/metrics takes the admin token or the metrics token)",
            )),
        }
    }
}

impl FromRequestParts<AppState> for BlocksCaller {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ControlError> {
        match Caller::from_request_parts(parts, state).await?.0 {
            Principal::Admin | Principal::RunnerEnrolment { .. } => {
                Err(ControlError::new(api::ErrorCode::NotFound, "no such org"))
            }
            principal => Ok(BlocksCaller(principal)),
        }
    }
}

/// The authenticated caller (`Authorization: Bearer TOKEN`; the scheme's
/// case does not matter).
pub struct Caller(pub Principal);

impl Caller {
    /// The caller's org; org resources do not exist for anyone else.
    pub fn org(&self) -> Result<String, ControlError> {
        match &self.0 {
            Principal::Org { org_id } => Ok(org_id.clone()),
            _ => Err(ControlError::new(
                api::ErrorCode::NotFound,
                "no such endpoint for this token (org endpoints need an org token)",
            )),
        }
    }

    /// The calling runner's id. A runner token is refused like any other
    /// token: it only registers.
    pub fn runner(&self) -> Result<String, ControlError> {
        match &self.0 {
            Principal::Runner { runner_id } => Ok(runner_id.clone()),
            _ => Err(ControlError::new(
                api::ErrorCode::NotFound,
                "no such endpoint for this token (runner endpoints need a runner's own credential, from its registration)",
            )),
        }
    }
}

/// The token of an `Authorization: Bearer TOKEN` header.
pub fn bearer_token(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()
        .and_then(|value| value.trim_start().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ControlError> {
        let unauthenticated = || {
            ControlError::new(
                api::ErrorCode::Unauthenticated,
                "missing or unknown bearer token",
            )
        };
        let token = bearer_token(&parts.headers).ok_or_else(unauthenticated)?;
        // Boxed: the query's future would otherwise stay part of every
        // request's future, long-polls included, for their whole life.
        Box::pin(auth::authenticate(&state.db, token))
            .await?
            .map(Caller)
            .ok_or_else(unauthenticated)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn whole_numbers_become_integers_and_nothing_else_changes() {
        let mut value = json!({
            "a": 5.0, "b": [1e1, -2.0, 5.5], "c": {"d": 1e300, "e": 7}, "f": "5.0"
        });
        super::whole_numbers_as_integers(&mut value);
        assert_eq!(
            value,
            json!({"a": 5, "b": [10, -2, 5.5], "c": {"d": 1e300, "e": 7}, "f": "5.0"})
        );
        assert!(value["a"].is_u64() && value["b"][1].is_i64());
    }
}
