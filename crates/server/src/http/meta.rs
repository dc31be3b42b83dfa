//! `/v1/openapi.json`, `/metrics`, `/healthz`.

use axum::extract::State;
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};

use super::{ApiError, AppState};

pub async fn openapi() -> Response {
    axum::Json(crate::openapi::document()).into_response()
}

pub async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let sandboxes: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, COUNT(*) FROM sandboxes GROUP BY state ORDER BY state")
            .fetch_all(&state.db.pool)
            .await?;
    let text = state.metrics.render(&sandboxes, state.db.hub.waiters());
    let mut response = text.into_response();
    response.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    Ok(response)
}

/// Liveness that includes the records: 200 only if the database answers.
pub async fn health(State(state): State<AppState>) -> Result<&'static str, ApiError> {
    sqlx::query("SELECT 1").execute(&state.db.pool).await?;
    Ok("ok\n")
}
