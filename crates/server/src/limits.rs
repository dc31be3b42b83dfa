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
/// Label filters one list may carry (`label=KEY=VALUE`, E2B's `metadata`):
/// a sandbox has at most [`LABELS_MAX`] labels, so as many filters name
/// all of them. Each filter is a subquery of the list's one statement,
/// which the database refuses past its own limits (SQLite's expression
/// depth at about a thousand, PostgreSQL's bind parameters): a 500 before.
pub const LABEL_FILTERS_MAX: usize = LABELS_MAX;
pub const ARGV_ENTRIES_MAX: usize = 4096;
pub const ARGV_BYTES_MAX: usize = 256 * 1024;
pub const PATH_BYTES_MAX: usize = 4096;
pub const NAME_BYTES_MAX: usize = 128;
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 255;
pub const TTL_SECONDS_MAX: u64 = 365 * 24 * 3600;
pub const COMMAND_TIMEOUT_SECONDS_MAX: u64 = 30 * 24 * 3600;
pub const LIST_LIMIT_MAX: usize = 200;
pub const LIST_LIMIT_DEFAULT: usize = 50;
/// Free text a runner reports (a sandbox's message, a save's error, a
/// failed snapshot's message) is cut to this many bytes where a record
/// keeps it: it is for people reading the record.
pub const RUNNER_TEXT_BYTES_MAX: usize = 1024;

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

/// `text` cut to at most `bytes_max` bytes, at a character boundary.
/// Text from outside may put a multi-byte character across the cut, where
/// `String::truncate` would panic.
pub fn truncated(text: &str, bytes_max: usize) -> String {
    let mut end = text.len().min(bytes_max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
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

/// `count` label filters in one list's query `field`.
pub fn label_filters(field: &str, count: usize) -> Result<(), ControlError> {
    if count > LABEL_FILTERS_MAX {
        return Err(invalid(
            field,
            format!("more than {LABEL_FILTERS_MAX} label filters"),
        ));
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

/// A byte offset into a command's output (`offset` of its output and
/// attach): kept as a signed 64-bit integer in the records, so one above
/// `i64::MAX` would turn negative (an attach then spun forever, reading
/// nothing from a place before the start).
pub fn output_offset(offset: u64) -> Result<i64, ControlError> {
    i64::try_from(offset).map_err(|_| invalid("offset", format!("at most {}", i64::MAX)))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncated_text_ends_at_a_character_boundary() {
        let check = |text: &str, max: usize, expected: &str| {
            assert_eq!(truncated(text, max), expected, "{text:?} to {max}");
        };
        check("", 4, "");
        check("abc", 4, "abc");
        check("abcd", 4, "abcd");
        check("abcde", 4, "abcd");
        check("abcé", 4, "abc");
        check("ééé", 5, "éé");
        check("日本", 2, "");
        let runner_text = format!("{}é", "a".repeat(1023));
        check(&runner_text, 1024, &"a".repeat(1023));
    }
}
