//! The server's own tests, one binary for the crate: the server runs in
//! this process (`server::serve` on a loopback port, SQLite and a local
//! store in a temp dir), driven through `api`'s client.
//!
//! - `support`: starting a server, making an org.
//! - `bounds`: bounds an audit found missing (offsets, label filters,
//!   multipart boundaries), each a 400 naming the field.
//! - `blocks`: the block service through its client passes the store's
//!   `Objects` conformance suite, and refuses what it must.
//! - `control`: the control layer called directly (no HTTP), on SQLite
//!   and PostgreSQL.
//! - `data_path`: the relay to a runner's data listener against a fake
//!   runner: redirects, refused credentials; idle connections closed.
//! - `dashboard`: what `/ui` needs: its files under a strict policy, the
//!   events and list long-polls, the admin's orgs with quota use.
//! - `deployment`: `GET /v1/deployment` with any token; README's
//!   host-failure table is the API's defaults; every field has its unit.
//! - `envelope`: every error is the JSON envelope, in the right order.
//! - `idempotency`: creates with one `Idempotency-Key` racing each other
//!   answer as one request.
//! - `openapi`: the document states tokens, values and bounds as the
//!   server enforces them; a schema-based fuzzer finds nothing.
//! - `runners`: runner credentials: one runner cannot read or report as
//!   another, nor reach the objects of an org it runs nothing for.

mod blocks;
mod bounds;
mod control;
mod dashboard;
mod data_path;
mod deployment;
mod envelope;
mod idempotency;
mod openapi;
mod runners;
mod support;
