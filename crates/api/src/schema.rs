//! Schemas for the OpenAPI document that the Rust types alone do not
//! carry: the allowed spellings of string fields and query parameters, and
//! the patterns of names. Each mirrors a check the server makes
//! (`server::limits` and the handlers), so a request a generator builds
//! from the document is one the server accepts.

use utoipa::openapi::schema::{Object, Schema, SchemaType, Type};
use utoipa::openapi::{ArrayBuilder, ObjectBuilder};

use crate::lifecycle::CommandState;

/// An image or other name (`server::limits::name`).
pub const NAME_PATTERN: &str = r"^[A-Za-z0-9._:/@-]{1,128}$";
/// A label key (`server::limits::label_key`).
pub const LABEL_KEY_PATTERN: &str = r"^[a-z0-9._/-]{1,63}$";
/// An environment variable name (`server::limits::env`).
pub const ENV_NAME_PATTERN: &str = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$";
/// An `Idempotency-Key`: 1-255 visible ASCII characters.
pub const IDEMPOTENCY_KEY_PATTERN: &str = r"^[!-~]{1,255}$";
/// `label=KEY=VALUE` in a list's query.
pub const LABEL_FILTER_PATTERN: &str = r"^[a-z0-9._/-]{1,63}=.*$";
/// A list's `cursor`: empty or the `next_cursor` of a page.
pub const SANDBOX_CURSOR_PATTERN: &str = r"^(sbx_[0-9a-f]{1,64})?$";
pub const COMMAND_CURSOR_PATTERN: &str = r"^(cmd_[0-9a-f]{1,64})?$";
pub const SNAPSHOT_CURSOR_PATTERN: &str = r"^(snp_[0-9a-f]{1,64})?$";

fn one_of(values: impl IntoIterator<Item = impl Into<String>>) -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::new(Type::String))
        .enum_values(Some(values.into_iter().map(|v| v.into())))
        .build()
}

fn pattern(pattern: &str) -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::new(Type::String))
        .pattern(Some(pattern))
        .build()
}

/// `SignalRequest.signal`.
pub fn signal() -> Object {
    one_of(crate::commands::SIGNALS.iter().copied())
}

/// `CreateSnapshotRequest.durability`.
pub fn durability() -> Object {
    one_of(["local", "replicated"])
}

/// `wait_for` of a snapshot: a durability, or `failed`.
pub fn snapshot_wait_for() -> Object {
    one_of(["pending", "local", "replicated", "failed"])
}

/// `wait_for` of a command: a state, or `ended` for any end state.
pub fn command_wait_for() -> Object {
    one_of(
        CommandState::ALL
            .iter()
            .map(|s| s.as_str())
            .chain(std::iter::once("ended")),
    )
}

/// The `stream` of a command's output.
pub fn stream() -> Object {
    one_of(["stdout", "stderr"])
}

/// An image name.
pub fn name() -> Object {
    pattern(NAME_PATTERN)
}

/// A secret's name, also a file name under `/run/secrets`: 1-64 of
/// A-Z a-z 0-9 _ . -, not starting with a dot.
pub const SECRET_NAME_PATTERN: &str = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$";

pub fn secret_name() -> Object {
    pattern(SECRET_NAME_PATTERN)
}

/// A sandbox's or command's `env`: at most 128 variables, named as the
/// shell names them, with no NUL byte in a value (64 KiB in all, a sum the
/// description states).
pub fn env() -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::new(Type::Object))
        .max_properties(Some(128))
        .property_names(Some(pattern(ENV_NAME_PATTERN)))
        .additional_properties(Some(Schema::from(pattern(r"^[^\x00]*$"))))
        .build()
}

/// A sandbox's `labels`: at most 32, keys of a-z 0-9 - _ . /, values of at
/// most 255 bytes without control characters. JSON Schema counts
/// characters, not bytes: 63 characters are 255 bytes at most.
pub fn labels() -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::new(Type::Object))
        .max_properties(Some(32))
        .property_names(Some(pattern(LABEL_KEY_PATTERN)))
        .additional_properties(Some(Schema::from(
            ObjectBuilder::new()
                .schema_type(SchemaType::new(Type::String))
                .max_length(Some(63))
                .pattern(Some(r"^[^\x00-\x1f\x7f-\x9f]*$"))
                .build(),
        )))
        .build()
}

/// A command's `argv`: a program name (not empty) and its arguments, with
/// no NUL byte. Their total of 256 KiB (413 past it) is a sum JSON Schema
/// cannot state; the description says it.
pub fn argv() -> utoipa::openapi::schema::Array {
    ArrayBuilder::new()
        .items(pattern(r"^[^\x00]+$"))
        .min_items(Some(1))
        .max_items(Some(4096))
        .build()
}

/// The `{kind}` of an object in the block service's paths.
#[derive(utoipa::ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum ObjectKind {
    Blocks,
    Trees,
}

/// The `{action}` of `POST /v1/admin/runners/{id}/{action}`.
#[derive(utoipa::ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum RunnerAction {
    Drain,
    Preempt,
    Undrain,
}

/// A runner's `placement_class`.
pub fn placement_class() -> Object {
    one_of(["spot", "on_demand"])
}

/// A runner's `capabilities`: at most 64 names.
pub fn capabilities() -> utoipa::openapi::schema::Array {
    ArrayBuilder::new()
        .items(name())
        .max_items(Some(64))
        .build()
}
