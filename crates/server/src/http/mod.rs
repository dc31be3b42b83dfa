//! The HTTP layer: thin handlers that parse, authenticate and call into
//! the records. Every error leaves as the one envelope of `api::ErrorBody`.

mod admin;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::de::DeserializeOwned;

use crate::auth::{self, Principal};
use crate::db::Db;

#[derive(Clone)]
pub struct AppState {
    pub db: Db,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/admin/orgs", post(admin::create_org))
        .route("/v1/admin/runner-tokens", post(admin::create_runner_token))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(crate::REQUEST_BODY_BYTES_MAX))
        .layer(middleware::from_fn(request_id))
        .with_state(state)
}

tokio::task_local! {
    /// The id of the request being handled, for error bodies and logs.
    static REQUEST_ID: String;
}

async fn request_id(request: Request, next: Next) -> Response {
    use tracing::Instrument;
    let id = auth::random_hex(8).unwrap_or_else(|_| "unknown".to_owned());
    let span = tracing::info_span!("request", request_id = %id, method = %request.method(), path = %request.uri().path());
    let mut response = REQUEST_ID
        .scope(id.clone(), next.run(request))
        .instrument(span)
        .await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

async fn not_found() -> ApiError {
    ApiError::new(api::ErrorCode::NotFound, "no such endpoint")
}

/// An error answer: a stable code, a one-line message, optional details.
#[derive(Debug)]
pub struct ApiError {
    code: api::ErrorCode,
    message: String,
    details: serde_json::Value,
}

impl ApiError {
    pub fn new(code: api::ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: message.into(),
            details: serde_json::Value::Null,
        }
    }

    pub fn with_details(mut self, details: serde_json::Value) -> ApiError {
        self.details = details;
        self
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(err: sqlx::Error) -> ApiError {
        // Logged once here, where it is handled; the body hides internals.
        tracing::error!(%err, "database error");
        ApiError::new(api::ErrorCode::Internal, "internal error")
    }
}

impl From<crate::ServerError> for ApiError {
    fn from(err: crate::ServerError) -> ApiError {
        tracing::error!(%err, "server error");
        ApiError::new(api::ErrorCode::Internal, "internal error")
    }
}

impl IntoResponse for ApiError {
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
        (status, axum::Json(body)).into_response()
    }
}

/// `Json<T>` whose rejections are our envelope: malformed JSON or a wrong
/// field is 400 `invalid_request` naming the problem; an oversized body 413.
pub struct Json<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        match axum::Json::<T>::from_request(request, state).await {
            Ok(axum::Json(value)) => Ok(Json(value)),
            Err(rejection) => {
                let code = if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    api::ErrorCode::PayloadTooLarge
                } else {
                    api::ErrorCode::InvalidRequest
                };
                Err(ApiError::new(code, rejection.body_text()))
            }
        }
    }
}

/// The authenticated caller (`Authorization: Bearer TOKEN`).
pub struct Caller(pub Principal);

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let unauthenticated = || {
            ApiError::new(
                api::ErrorCode::Unauthenticated,
                "missing or unknown bearer token",
            )
        };
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .ok_or_else(unauthenticated)?;
        let token = header
            .to_str()
            .ok()
            .and_then(|value| value.strip_prefix("Bearer "))
            .ok_or_else(unauthenticated)?;
        auth::authenticate(&state.db, token.trim())
            .await?
            .map(Caller)
            .ok_or_else(unauthenticated)
    }
}
