//! E2B-compatible wire types (issue 24): what the `e2b` SDKs send to and
//! expect from a control plane (`rest`) and a sandbox's envd (`envd`,
//! `connect`). roost serves them under `/e2b` (`server::e2b`), translated
//! onto its own records and data path.
//!
//! The SDKs (Python `e2b` 2.x and the JS one) speak envd's Connect RPCs in
//! the Connect protocol's JSON form (`application/json`, and
//! `application/connect+json` for streams), never binary protobuf, so the
//! messages here are serde types following protobuf's JSON mapping
//! (lowerCamel names, `bytes` as base64, 64-bit integers as strings, enums
//! by name). A binary-protobuf request is refused with a Connect error
//! naming it.

pub mod connect;
pub mod envd;
pub mod rest;
