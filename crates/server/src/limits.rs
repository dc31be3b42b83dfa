//! Bounds on everything a request carries. Breaking a size bound is 413
//! `payload_too_large`; a count, length or format bound 400
//! `invalid_request`. Both name the field in `details.field`.

use std::collections::BTreeMap;

use crate::error::ControlError;
use api::ErrorCode;

pub const ENV_ENTRIES_MAX: usize = 128;
pub const ENV_BYTES_MAX: usize = 64 * 1024;
pub const LABELS_MAX: usize = 32;
pub const LABEL_KEY_BYTES_MAX: usize = 63;
pub const LABEL_VALUE_BYTES_MAX: usize = 255;
pub const ARGV_ENTRIES_MAX: usize = 4096;
pub const ARGV_BYTES_MAX: usize = 256 * 1024;
pub const PATH_BYTES_MAX: usize = 4096;
pub const NAME_BYTES_MAX: usize = 128;
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 255;
pub const TTL_SECONDS_MAX: u64 = 365 * 24 * 3600;
pub const COMMAND_TIMEOUT_SECONDS_MAX: u64 = 30 * 24 * 3600;
pub const LIST_LIMIT_MAX: usize = 200;
pub const LIST_LIMIT_DEFAULT: usize = 50;

pub fn invalid(field: &str, message: impl Into<String>) -> ControlError {
    ControlError::new(
        ErrorCode::InvalidRequest,
        format!("{field}: {}", message.into()),
    )
    .with_details(serde_json::json!({ "field": field }))
}

pub fn too_large(field: &str, limit: usize) -> ControlError {
    ControlError::new(
        ErrorCode::PayloadTooLarge,
        format!("{field}: larger than {limit} bytes"),
    )
    .with_details(serde_json::json!({ "field": field, "limit_bytes": limit }))
}

pub fn env(field: &str, env: &BTreeMap<String, String>) -> Result<(), ControlError> {
    if env.len() > ENV_ENTRIES_MAX {
        return Err(invalid(
            field,
            format!("more than {ENV_ENTRIES_MAX} variables"),
        ));
    }
    let mut bytes = 0;
    for (key, value) in env {
        let valid_key = !key.is_empty()
            && key.len() <= NAME_BYTES_MAX
            && key.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_')
            && !key.as_bytes()[0].is_ascii_digit();
        if !valid_key {
            return Err(invalid(
                field,
                format!("{key:?} is not a variable name (A-Z a-z 0-9 _, at most {NAME_BYTES_MAX})"),
            ));
        }
        if value.contains('\0') {
            return Err(invalid(field, format!("{key} contains a NUL byte")));
        }
        bytes += key.len() + value.len();
    }
    if bytes > ENV_BYTES_MAX {
        return Err(too_large(field, ENV_BYTES_MAX));
    }
    Ok(())
}

pub fn labels(labels: &BTreeMap<String, String>) -> Result<(), ControlError> {
    if labels.len() > LABELS_MAX {
        return Err(invalid("labels", format!("more than {LABELS_MAX} labels")));
    }
    for (key, value) in labels {
        label_key(key)?;
        if value.len() > LABEL_VALUE_BYTES_MAX || value.chars().any(char::is_control) {
            return Err(invalid(
                "labels",
                format!(
                    "value of {key:?} is longer than {LABEL_VALUE_BYTES_MAX} bytes or has control characters"
                ),
            ));
        }
    }
    Ok(())
}

pub fn label_key(key: &str) -> Result<(), ControlError> {
    let ok = !key.is_empty()
        && key.len() <= LABEL_KEY_BYTES_MAX
        && key
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"-_./".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(invalid(
            "labels",
            format!("key {key:?}: use 1-{LABEL_KEY_BYTES_MAX} of a-z 0-9 - _ . /"),
        ))
    }
}

pub fn name(field: &str, value: &str) -> Result<(), ControlError> {
    let ok = !value.is_empty()
        && value.len() <= NAME_BYTES_MAX
        && value
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.:/@".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("use 1-{NAME_BYTES_MAX} of A-Z a-z 0-9 - _ . : / @"),
        ))
    }
}

pub fn argv(argv: &[String]) -> Result<(), ControlError> {
    if argv.is_empty() {
        return Err(invalid("argv", "must name a program"));
    }
    if argv.len() > ARGV_ENTRIES_MAX {
        return Err(invalid(
            "argv",
            format!("more than {ARGV_ENTRIES_MAX} arguments"),
        ));
    }
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(invalid("argv", "contains a NUL byte"));
    }
    if argv[0].is_empty() {
        return Err(invalid("argv", "the program name is empty"));
    }
    if argv.iter().map(String::len).sum::<usize>() > ARGV_BYTES_MAX {
        return Err(too_large("argv", ARGV_BYTES_MAX));
    }
    Ok(())
}

pub fn absolute_path(field: &str, path: &str) -> Result<(), ControlError> {
    if !path.starts_with('/') || path.contains('\0') || path.len() > PATH_BYTES_MAX {
        return Err(invalid(
            field,
            format!("must be an absolute path of at most {PATH_BYTES_MAX} bytes"),
        ));
    }
    Ok(())
}

/// A list's `limit` query parameter.
pub fn list_limit(value: &str) -> Result<usize, ControlError> {
    value
        .parse::<usize>()
        .ok()
        .filter(|l| (1..=LIST_LIMIT_MAX).contains(l))
        .ok_or_else(|| invalid("limit", format!("a number from 1 to {LIST_LIMIT_MAX}")))
}

/// A list's `cursor`: empty (the first page) or an id this list hands out
/// (`PREFIX_` and hex, as `records::new_id` makes them); anything else is
/// 400 rather than silently the first page.
pub fn cursor(value: &str, prefix: &str) -> Result<String, ControlError> {
    let well_formed = value.is_empty()
        || value
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix('_'))
            .is_some_and(|hex| {
                !hex.is_empty() && hex.len() <= 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())
            });
    if well_formed {
        Ok(value.to_owned())
    } else {
        Err(invalid(
            "cursor",
            "use the next_cursor of the previous page",
        ))
    }
}
