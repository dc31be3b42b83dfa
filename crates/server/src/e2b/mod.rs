//! An E2B-compatible surface (issue 24), served under `/e2b` by every
//! `roost server`: E2B's control plane (`E2B_API_URL=…/e2b`, `sandboxes`)
//! and envd's data plane (`E2B_SANDBOX_URL=…/e2b/envd`: `process`,
//! `filesystem`, `files`), translated onto roost's own records and
//! control layer (sandboxes, commands, the data path). Nothing here routes
//! to a runner by itself: streams go through `control::data_path`, so any
//! server of a deployment serves any sandbox.
//!
//! Auth: the SDK's `X-API-KEY` (or `Authorization: Bearer`) carries a
//! roost org token. The data plane takes the sandbox's `envdAccessToken`
//! (`X-Access-Token`), which roost mints per sandbox (`auth::envd_token`:
//! good for that sandbox's envd only, never the org's API), or an org
//! token, and the sandbox from `E2b-Sandbox-Id`; an org reaches only its
//! own sandboxes.
//!
//! What roost cannot honour is refused in E2B's error shape with a
//! message naming it (`unsupported`), never a silent no-op.

mod filesystem;
mod multipart;
mod process;
mod sandboxes;

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::auth::{self, Principal};
use crate::control::AppState;
use crate::error::ControlError;
use api::ErrorCode;
use api::e2b::connect;

/// The router nested at `/e2b` (`http::router`).
pub fn router() -> Router<AppState> {
    Router::new()
        // Control plane.
        .route(
            "/v2/sandboxes",
            post(sandboxes::create).get(sandboxes::list_v2),
        )
        .route(
            "/sandboxes",
            post(sandboxes::create).get(sandboxes::list_v1),
        )
        .route(
            "/sandboxes/{id}",
            get(sandboxes::get).delete(sandboxes::kill),
        )
        .route("/sandboxes/{id}/timeout", post(sandboxes::set_timeout))
        .route("/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/v2/sandboxes/{id}/connect", post(sandboxes::connect))
        // Data plane (envd).
        .route("/envd/health", get(filesystem::health))
        .route(
            "/envd/files",
            get(filesystem::read)
                .post(filesystem::write)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route(
            "/envd/process.Process/{method}",
            post(process::call).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route(
            "/envd/filesystem.Filesystem/{method}",
            post(filesystem::call),
        )
        .fallback(unsupported_endpoint)
}

/// Anything of E2B's API roost does not serve (snapshots, fork, metrics,
/// logs, templates, volumes, network updates, …): 501 naming it.
async fn unsupported_endpoint(request: Request) -> Response {
    E2bError::new(
        StatusCode::NOT_IMPLEMENTED,
        "unsupported",
        format!(
            "{} {} is not supported by roost's E2B-compatible API",
            request.method(),
            request.uri().path()
        ),
    )
    .into_response()
}

/// An error in E2B's REST shape (`{"code": STATUS, "message", "error_code"}`).
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub error_code: String,
    pub message: String,
}

impl E2bError {
    pub fn new(status: StatusCode, error_code: &str, message: impl Into<String>) -> E2bError {
        E2bError {
            status,
            error_code: error_code.to_owned(),
            message: message.into(),
        }
    }

    /// A request part (`query`, `path`) axum could not decode, in E2B's
    /// shape rather than axum's plain text.
    fn undecodable(part: &str, why: String) -> E2bError {
        E2bError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest.as_str(),
            format!("{part}: {why}"),
        )
    }

    /// A feature roost does not enforce, named.
    pub fn unsupported(message: impl Into<String>) -> E2bError {
        E2bError::new(StatusCode::BAD_REQUEST, "unsupported", message)
    }
}

impl From<ControlError> for E2bError {
    fn from(error: ControlError) -> E2bError {
        E2bError {
            status: StatusCode::from_u16(error.code.status())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            error_code: error.code.as_str().to_owned(),
            message: error.message,
        }
    }
}

impl From<sqlx::Error> for E2bError {
    fn from(error: sqlx::Error) -> E2bError {
        ControlError::from(error).into()
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = api::e2b::rest::Error {
            code: self.status.as_u16(),
            message: self.message,
            error_code: Some(self.error_code),
        };
        (self.status, axum::Json(body)).into_response()
    }
}

/// axum's `Query`, refused in E2B's shape (a 400 `invalid_request` naming
/// what is wrong) instead of axum's plain-text body, which E2B's SDKs
/// cannot read.
pub struct E2bQuery<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequestParts<S> for E2bQuery<T> {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, E2bError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Query(value)| E2bQuery(value))
            .map_err(|rejection| E2bError::undecodable("query", rejection.body_text()))
    }
}

/// axum's `Path`, refused in E2B's shape (a path segment that is not
/// UTF-8 once decoded, say).
pub struct E2bPath<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Send> FromRequestParts<S> for E2bPath<T> {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, E2bError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(value)| E2bPath(value))
            .map_err(|rejection| E2bError::undecodable("path", rejection.body_text()))
    }
}

/// The org of the caller of E2B's control plane: `X-API-KEY`, or a bearer
/// token, holding an org token.
pub struct ApiKeyCaller {
    pub org_id: String,
}

impl FromRequestParts<AppState> for ApiKeyCaller {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, E2bError> {
        let token = parts
            .headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| bearer(parts));
        let org_id = org_of(state, token.as_deref()).await?;
        Ok(ApiKeyCaller { org_id })
    }
}

fn bearer(parts: &Parts) -> Option<String> {
    parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim_start().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim().to_owned())
}

async fn org_of(state: &AppState, token: Option<&str>) -> Result<String, E2bError> {
    let unauthenticated = || {
        E2bError::new(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthenticated.as_str(),
            "missing or unknown API key (E2B_API_KEY must be a roost org token)",
        )
    };
    let token = token
        .filter(|t| !t.is_empty())
        .ok_or_else(unauthenticated)?;
    match Box::pin(auth::authenticate(&state.db, token)).await? {
        Some(Principal::Org { org_id }) => Ok(org_id),
        Some(_) => Err(E2bError::new(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthenticated.as_str(),
            "this token is not an org token: E2B's API needs one",
        )),
        None => Err(unauthenticated()),
    }
}

/// The caller of a sandbox's envd: as `X-Access-Token`, the sandbox's own
/// envd token (the `envdAccessToken` roost answers with,
/// `auth::envd_token`: that sandbox only) or an org token; the sandbox
/// as `E2b-Sandbox-Id`.
pub struct EnvdCaller {
    pub org_id: String,
    pub sandbox_id: String,
}

impl EnvdCaller {
    async fn from_parts(
        parts: &Parts,
        state: &AppState,
    ) -> Result<EnvdCaller, (StatusCode, String)> {
        Self::from_headers(&parts.headers, state).await
    }

    async fn from_headers(
        headers: &axum::http::HeaderMap,
        state: &AppState,
    ) -> Result<EnvdCaller, (StatusCode, String)> {
        let token = headers
            .get("x-access-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| {
                headers
                    .get("x-api-key")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            });
        let sandbox_id = headers
            .get("e2b-sandbox-id")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .ok_or((
                StatusCode::BAD_REQUEST,
                "no E2b-Sandbox-Id header: which sandbox?".to_owned(),
            ))?
            .to_owned();
        let org_id = match token.as_deref() {
            // The sandbox's own envd token: that sandbox only.
            Some(token) if auth::is_envd_token(token) => {
                auth::envd_org(&state.envd_key, token, &sandbox_id).ok_or((
                    StatusCode::UNAUTHORIZED,
                    format!("this access token is not sandbox {sandbox_id}'s"),
                ))?
            }
            token => org_of(state, token)
                .await
                .map_err(|e| (e.status, e.message))?,
        };
        Ok(EnvdCaller { org_id, sandbox_id })
    }
}

/// A Connect error as a unary call's answer.
pub fn connect_unary_error(error: connect::Error) -> Response {
    let status =
        StatusCode::from_u16(error.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, axum::Json(error)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(connect::UNARY_JSON),
    );
    response
}

/// A unary call's answer.
pub fn connect_unary_ok(message: &impl serde::Serialize) -> Response {
    let body = serde_json::to_vec(message).unwrap_or_default();
    let mut response = (StatusCode::OK, Body::from(body)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(connect::UNARY_JSON),
    );
    response
}

/// A stream that ends at once with `error` (a streaming call is answered
/// 200 with the error in its end message).
pub fn connect_stream_error(error: connect::Error) -> Response {
    let mut response = (
        StatusCode::OK,
        Body::from(connect::end_envelope(Some(error))),
    )
        .into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(connect::STREAM_JSON),
    );
    response
}

/// roost's refusal as a Connect error.
pub fn connect_error_of(error: &ControlError) -> connect::Error {
    connect::Error::new(connect_code_of(error.code), error.message.clone())
}

pub fn connect_code_of(code: ErrorCode) -> connect::Code {
    use connect::Code;
    match code {
        ErrorCode::NotFound => Code::NotFound,
        ErrorCode::InvalidRequest | ErrorCode::PayloadTooLarge => Code::InvalidArgument,
        ErrorCode::Unauthenticated => Code::Unauthenticated,
        ErrorCode::Unavailable => Code::Unavailable,
        ErrorCode::InsufficientStorage => Code::ResourceExhausted,
        ErrorCode::InvalidState | ErrorCode::Quarantined => Code::FailedPrecondition,
        ErrorCode::Internal => Code::Internal,
        _ => Code::Unknown,
    }
}

/// How a Connect request's body is encoded: JSON only (what the SDKs
/// send); binary protobuf is refused, naming it.
pub fn check_json(parts: &Parts, stream: bool) -> Result<(), connect::Error> {
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let wanted = if stream {
        connect::STREAM_JSON
    } else {
        connect::UNARY_JSON
    };
    if content_type == wanted {
        Ok(())
    } else {
        Err(connect::Error::new(
            connect::Code::Unimplemented,
            format!(
                "content type {content_type:?}: roost's envd speaks Connect with JSON only ({wanted}); binary protobuf is not supported"
            ),
        ))
    }
}
