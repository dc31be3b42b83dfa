//! The one error envelope every endpoint answers with:
//! `{"error":{"code":"…","message":"…","details":{…},"request_id":"…"}}`.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Stable error codes (DESIGN.md §3). Clients branch on these, never on
/// messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidRequest,
    Unauthenticated,
    NotFound,
    InvalidState,
    IdempotencyConflict,
    IdempotencyInProgress,
    Fenced,
    Quarantined,
    PayloadTooLarge,
    UnsupportedCapability,
    QuotaExceeded,
    Unavailable,
    /// The content store has no space left: what it could not store is
    /// still missing; retry once space is freed (507).
    InsufficientStorage,
    Internal,
    /// A byte range that starts past a file's end (416; `details.size` is
    /// the file's size).
    RangeNotSatisfiable,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::NotFound => "not_found",
            ErrorCode::InvalidState => "invalid_state",
            ErrorCode::IdempotencyConflict => "idempotency_conflict",
            ErrorCode::IdempotencyInProgress => "idempotency_in_progress",
            ErrorCode::Fenced => "fenced",
            ErrorCode::Quarantined => "quarantined",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::UnsupportedCapability => "unsupported_capability",
            ErrorCode::QuotaExceeded => "quota_exceeded",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::InsufficientStorage => "insufficient_storage",
            ErrorCode::Internal => "internal",
            ErrorCode::RangeNotSatisfiable => "range_not_satisfiable",
        }
    }

    pub fn status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest => 400,
            ErrorCode::Unauthenticated => 401,
            ErrorCode::NotFound => 404,
            ErrorCode::InvalidState
            | ErrorCode::IdempotencyConflict
            | ErrorCode::IdempotencyInProgress
            | ErrorCode::Fenced
            | ErrorCode::Quarantined => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::UnsupportedCapability => 422,
            ErrorCode::QuotaExceeded => 429,
            ErrorCode::Unavailable => 503,
            ErrorCode::InsufficientStorage => 507,
            ErrorCode::Internal => 500,
            ErrorCode::RangeNotSatisfiable => 416,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    pub code: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    #[schema(value_type = Object)]
    pub details: serde_json::Value,
    pub request_id: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_serialize_as_their_stable_names() {
        for code in [
            ErrorCode::InvalidRequest,
            ErrorCode::Unauthenticated,
            ErrorCode::NotFound,
            ErrorCode::InvalidState,
            ErrorCode::IdempotencyConflict,
            ErrorCode::IdempotencyInProgress,
            ErrorCode::Fenced,
            ErrorCode::Quarantined,
            ErrorCode::PayloadTooLarge,
            ErrorCode::UnsupportedCapability,
            ErrorCode::QuotaExceeded,
            ErrorCode::Unavailable,
            ErrorCode::Internal,
            ErrorCode::RangeNotSatisfiable,
        ] {
            assert_eq!(
                serde_json::to_value(code).ok(),
                Some(serde_json::json!(code.as_str()))
            );
        }
    }
}
