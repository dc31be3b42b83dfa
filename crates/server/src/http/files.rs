//! `/v1/sandboxes/{id}/files`: a running sandbox's files, read, written,
//! listed, removed, moved and made by the sandbox's own agent inside its
//! mount namespace, through the data path to the runner holding it
//! (`control::data_path::files_route`). Bodies are streamed both ways,
//! never held whole: an upload moves at the pace the sandbox's disk takes
//! it, a download at the pace the client reads.

use api::ErrorCode;
use api::files::{
    DirectoryMade, FileList, FileMoved, FileRemoved, FileWritten, MkdirRequest, MoveRequest,
    TarSummary, ops,
};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::{AppState, Json, OrgCaller, Path, Query};
use crate::control::data_path::{self, RelayBody};
use crate::error::ControlError;

/// Headers of the runner's answer a client gets as they are.
const PASSED_HEADERS: &[&str] = &[
    "content-type",
    "content-length",
    "content-range",
    "accept-ranges",
    "last-modified",
    api::files::headers::MODE,
    api::files::headers::SIZE,
];

/// The route to the sandbox's files for `op` (404, 409 first: a caller
/// learns nothing of a path in a sandbox it may not reach), then the
/// paths checked (400 naming the path).
async fn route(
    state: &AppState,
    org_id: &str,
    sandbox_id: &str,
    op: &str,
    suffix: &str,
    paths: &[&str],
) -> Result<data_path::DataRoute, ControlError> {
    let route = data_path::files_route(state, org_id, sandbox_id, op, suffix).await?;
    for path in paths {
        api::files::check_path(path)
            .map_err(|message| ControlError::new(ErrorCode::InvalidRequest, message))?;
    }
    Ok(route)
}

/// The runner's answer passed on: a success with its headers and its body
/// streamed (keeping the sandbox awake until it ends,
/// `DataRoute::while_awake`); anything else as our envelope (with this
/// request's id, `data_path::refusal`: a redirect is never passed on, nor
/// followed).
async fn passed_on(
    answer: reqwest::Response,
    route: &mut data_path::DataRoute,
) -> Result<Response, ControlError> {
    if !answer.status().is_success() {
        return Err(data_path::refusal(answer).await);
    }
    let status = StatusCode::from_u16(answer.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut headers = HeaderMap::new();
    for name in PASSED_HEADERS {
        if let Some(value) = answer.headers().get(*name)
            && let Ok(value) = HeaderValue::from_bytes(value.as_bytes())
        {
            headers.insert(*name, value);
        }
    }
    let mut response = Response::new(Body::from_stream(route.while_awake(answer.bytes_stream())));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    Ok(response)
}

/// How long a refused upload's body is still read (and dropped) so that
/// the refusal reaches the client: a connection closed with unread bytes
/// is reset, and a reset can destroy the answer before it is read.
const DRAIN_TIME_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// `error`, once the rest of `body` was read and dropped (at most
/// [`DRAIN_TIME_MAX`]).
async fn drained(body: Body, error: ControlError) -> ControlError {
    use futures::StreamExt;
    let mut stream = body.into_data_stream();
    let _ = tokio::time::timeout(DRAIN_TIME_MAX, async {
        while let Some(Ok(_)) = stream.next().await {}
    })
    .await;
    error
}

/// A refusal response; 416 says the file's size as `Content-Range` wants.
fn refused(error: ControlError) -> Response {
    let size = error
        .details
        .get("size")
        .and_then(serde_json::Value::as_u64);
    let range_refused = error.code == ErrorCode::RangeNotSatisfiable;
    let mut response = error.into_response();
    if range_refused
        && let Some(size) = size
        && let Ok(value) = HeaderValue::from_str(&format!("bytes */{size}"))
    {
        response.headers_mut().insert(header::CONTENT_RANGE, value);
    }
    response
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct PathQuery {
    /// The path in the sandbox: absolute (the sandbox's own `/` is the
    /// root) or relative to `/workspace`; at most 4096 bytes, no NUL byte,
    /// no `..` component (400).
    #[param(pattern = r"^[^\x00]{1,4096}$")]
    path: String,
}

/// One byte range of `Range: bytes=…`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ByteRange {
    /// `A-`: from A to the end.
    From(u64),
    /// `A-B`: A to B, inclusive.
    Span(u64, u64),
    /// `-N`: the last N bytes.
    Suffix(u64),
}

/// The one range of a `Range` header; `None` (serve the whole file, as
/// RFC 9110 says for a header a server does not take) for anything else:
/// another unit, several ranges, a malformed or backwards one.
fn parse_range(value: &str) -> Option<ByteRange> {
    let spec = value.trim().strip_prefix("bytes=")?.trim();
    if spec.contains(',') {
        return None;
    }
    let (first, last) = spec.split_once('-')?;
    let number = |text: &str| -> Option<u64> {
        (!text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()))
            .then(|| text.parse().ok())
            .flatten()
    };
    match (first.trim(), last.trim()) {
        ("", last) => number(last).map(ByteRange::Suffix),
        (first, "") => number(first).map(ByteRange::From),
        (first, last) => {
            let (first, last) = (number(first)?, number(last)?);
            (last >= first).then_some(ByteRange::Span(first, last))
        }
    }
}

/// The runner's query for a range.
fn range_query(range: Option<ByteRange>) -> Vec<(&'static str, String)> {
    match range {
        None => Vec::new(),
        Some(ByteRange::From(first)) => vec![("offset", first.to_string())],
        Some(ByteRange::Span(first, last)) => vec![
            ("offset", first.to_string()),
            ("length", (last - first).saturating_add(1).to_string()),
        ],
        Some(ByteRange::Suffix(count)) => vec![("suffix", count.to_string())],
    }
}

/// Downloads a file, streamed as the sandbox's agent reads it (a symlink
/// is followed inside the sandbox: it leads only to the sandbox's own
/// files). `Range: bytes=A-B`, `bytes=A-` or `bytes=-N` answers 206 with
/// `Content-Range`; a range starting at or past the end 416 (with
/// `Content-Range: bytes */SIZE`); any other `Range` is ignored (200, the
/// whole file). A download cut short (the file changed under the read,
/// the sandbox stopped) ends the body early: its length falls short of
/// `Content-Length`.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path, description = "sandbox id"), PathQuery, ("Range" = Option<String>, Header, description = "one byte range: `bytes=A-B`, `bytes=A-` or `bytes=-N` (the last N bytes)")), responses(
    (status = 200, description = "the whole file", content_type = "application/octet-stream", body = Vec<u8>, headers(("Content-Length" = u64, description = "bytes in the body"), ("Last-Modified" = String, description = "the file's modification time (HTTP date)"), ("x-roost-mode" = String, description = "permission bits, octal (`0644`)"), ("x-roost-size" = u64, description = "the whole file's size"), ("Accept-Ranges" = String, description = "`bytes`"))),
    (status = 206, description = "the range asked for", content_type = "application/octet-stream", body = Vec<u8>, headers(("Content-Range" = String, description = "`bytes A-B/SIZE`"), ("Content-Length" = u64, description = "bytes in the body"), ("Last-Modified" = String, description = "the file's modification time (HTTP date)"), ("x-roost-mode" = String, description = "permission bits, octal"), ("x-roost-size" = u64, description = "the whole file's size"))),
    (status = 400, description = "`invalid_request`: a path empty, over 4096 bytes, with a NUL byte or a `..` component", body = api::ErrorBody),
    (status = 404, description = "`not_found`: no such sandbox (or another org's), or no such file", body = api::ErrorBody),
    (status = 409, description = "`invalid_state`: the sandbox is not running, or the path is a directory (`details.reason`: `is_a_directory`, `permission_denied`…)", body = api::ErrorBody),
    (status = 416, description = "`range_not_satisfiable`: the range starts at or past the end (`details.size`; `Content-Range: bytes */SIZE`)", body = api::ErrorBody),
    (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn read(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(sandbox_id): Path<String>,
    Query(query): Query<PathQuery>,
    headers: HeaderMap,
) -> Response {
    let answer = async {
        let mut route = route(&state, &org_id, &sandbox_id, ops::READ, "", &[&query.path]).await?;
        let range = headers
            .get(header::RANGE)
            .and_then(|value| value.to_str().ok())
            .and_then(parse_range);
        let mut runner_query = vec![("path", query.path.clone())];
        runner_query.extend(range_query(range));
        let answer =
            data_path::relay(&route, reqwest::Method::GET, &runner_query, RelayBody::None).await?;
        passed_on(answer, &mut route).await
    };
    answer.await.unwrap_or_else(refused)
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct WriteQuery {
    /// The file's path in the sandbox (as for a download).
    #[param(pattern = r"^[^\x00]{1,4096}$")]
    path: String,
    /// Permission bits, octal (default `0644`); setuid, setgid and sticky
    /// are never set (400).
    #[param(pattern = r"^0?[0-7]{3}$")]
    mode: Option<String>,
    /// Make missing parent directories (0755) first (default false: a
    /// missing parent is 404).
    parents: Option<bool>,
}

/// Writes a file from the body, streamed (no size limit but the
/// sandbox's disk; no request timeout): written beside its target,
/// fsynced, then renamed over it, so the path holds its old content or
/// the whole new one, never a part. A body cut short or a full disk
/// (507) leaves nothing under the path but what was there.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path, description = "sandbox id"), WriteQuery), request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "the file's bytes, any length"), responses(
    (status = 201, description = "the file was made", body = FileWritten),
    (status = 200, description = "the file replaced one", body = FileWritten),
    (status = 400, description = "`invalid_request`: a bad path or mode, or the body was cut", body = api::ErrorBody),
    (status = 404, description = "`not_found`: no such sandbox (or another org's), or a missing parent without `parents`", body = api::ErrorBody),
    (status = 409, description = "`invalid_state`: the sandbox is not running, or the path is a directory or not writable (`details.reason`)", body = api::ErrorBody),
    (status = 507, description = "`insufficient_storage`: the sandbox's disk is full; nothing was left under the path", body = api::ErrorBody),
    (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn write(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(sandbox_id): Path<String>,
    Query(query): Query<WriteQuery>,
    body: Body,
) -> Result<Response, ControlError> {
    let checked = async {
        let route = route(&state, &org_id, &sandbox_id, ops::WRITE, "", &[&query.path]).await?;
        if let Some(mode) = &query.mode {
            api::files::parse_mode(mode)
                .map_err(|message| ControlError::new(ErrorCode::InvalidRequest, message))?;
        }
        Ok(route)
    };
    let mut route = match checked.await {
        Ok(route) => route,
        Err(error) => return Err(drained(body, error).await),
    };
    let mut runner_query = vec![("path", query.path.clone())];
    if let Some(mode) = &query.mode {
        runner_query.push(("mode", mode.clone()));
    }
    runner_query.push(("parents", query.parents.unwrap_or(false).to_string()));
    let stream = reqwest::Body::wrap_stream(body.into_data_stream());
    let answer = data_path::relay(
        &route,
        reqwest::Method::PUT,
        &runner_query,
        RelayBody::Stream(stream),
    )
    .await?;
    passed_on(answer, &mut route).await
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct RemoveQuery {
    /// The path in the sandbox; `/` and `/workspace` are refused (400).
    #[param(pattern = r"^[^\x00]{1,4096}$")]
    path: String,
    /// Remove a non-empty directory and everything in it (default false:
    /// 409 `directory_not_empty`).
    recursive: Option<bool>,
}

/// Removes a file, a symlink (never what it points at) or a directory.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path, description = "sandbox id"), RemoveQuery), responses(
    (status = 200, body = FileRemoved),
    (status = 400, description = "`invalid_request`: a bad path, or `/` or `/workspace`", body = api::ErrorBody),
    (status = 404, description = "`not_found`: no such sandbox (or another org's), or no such file", body = api::ErrorBody),
    (status = 409, description = "`invalid_state`: the sandbox is not running, or a non-empty directory without `recursive` (`details.reason`)", body = api::ErrorBody),
    (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn remove(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(sandbox_id): Path<String>,
    Query(query): Query<RemoveQuery>,
) -> Result<Response, ControlError> {
    let mut route = route(
        &state,
        &org_id,
        &sandbox_id,
        ops::REMOVE,
        "",
        &[&query.path],
    )
    .await?;
    let runner_query = [
        ("path", query.path.clone()),
        ("recursive", query.recursive.unwrap_or(false).to_string()),
    ];
    let answer = data_path::relay(
        &route,
        reqwest::Method::DELETE,
        &runner_query,
        RelayBody::None,
    )
    .await?;
    passed_on(answer, &mut route).await
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// The path in the sandbox: a directory (its entries), or a file or
    /// symlink (itself).
    #[param(pattern = r"^[^\x00]{1,4096}$")]
    path: String,
    /// Levels to descend: 1 (default) lists the directory's own entries.
    #[param(minimum = 1, maximum = 16)]
    depth: Option<u32>,
}

/// Lists a directory, `depth` levels down, sorted by path: each entry's
/// type, size, mode, modification time and a symlink's target (never
/// followed). At most 10,000 entries (`truncated` past them).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", tag = "files", params(("id" = String, Path, description = "sandbox id"), ListQuery), responses(
    (status = 200, body = FileList),
    (status = 400, description = "`invalid_request`: a bad path or depth", body = api::ErrorBody),
    (status = 404, description = "`not_found`: no such sandbox (or another org's), or no such path", body = api::ErrorBody),
    (status = 409, description = "`invalid_state`: the sandbox is not running", body = api::ErrorBody),
    (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(sandbox_id): Path<String>,
    Query(query): Query<ListQuery>,
) -> Result<Response, ControlError> {
    let mut route = route(
        &state,
        &org_id,
        &sandbox_id,
        ops::LIST,
        "/list",
        &[&query.path],
    )
    .await?;
    let depth = query.depth.unwrap_or(1);
    if !(1..=api::files::LIST_DEPTH_MAX).contains(&depth) {
        return Err(ControlError::new(
            ErrorCode::InvalidRequest,
            format!(
                "depth {depth} is outside 1..={}",
                api::files::LIST_DEPTH_MAX
            ),
        ));
    }
    let runner_query = [("path", query.path.clone()), ("depth", depth.to_string())];
    let answer =
        data_path::relay(&route, reqwest::Method::GET, &runner_query, RelayBody::None).await?;
    passed_on(answer, &mut route).await
}

/// Renames `from` to `to` within the sandbox (an existing `to` is
/// replaced only with `overwrite`; across filesystems 409 `cross_device`).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/move", tag = "files", params(("id" = String, Path, description = "sandbox id")), request_body = MoveRequest, responses(
    (status = 200, body = FileMoved),
    (status = 400, description = "`invalid_request`: a bad path, or `/` or `/workspace` moved", body = api::ErrorBody),
    (status = 404, description = "`not_found`: no such sandbox (or another org's), or no such `from`", body = api::ErrorBody),
    (status = 409, description = "`invalid_state`: the sandbox is not running, `to` exists without `overwrite`, or another filesystem (`details.reason`)", body = api::ErrorBody),
    (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn rename(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(sandbox_id): Path<String>,
    Json(request): Json<MoveRequest>,
) -> Result<Response, ControlError> {
    let mut route = route(
        &state,
        &org_id,
        &sandbox_id,
        ops::MOVE,
        "/move",
        &[&request.from, &request.to],
    )
    .await?;
    let body = serde_json::to_vec(&request)
        .map_err(|e| ControlError::new(ErrorCode::Internal, e.to_string()))?;
    let answer =
        data_path::relay(&route, reqwest::Method::POST, &[], RelayBody::Json(body)).await?;
    passed_on(answer, &mut route).await
}

/// Makes a directory (and its missing parents with `parents`, when an
/// existing directory is no error).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", tag = "files", params(("id" = String, Path, description = "sandbox id")), request_body = MkdirRequest, responses(
    (status = 201, description = "made", body = DirectoryMade),
    (status = 200, description = "it existed (with `parents`)", body = DirectoryMade),
    (status = 400, description = "`invalid_request`: a bad path or mode", body = api::ErrorBody),
    (status = 404, description = "`not_found`: no such sandbox (or another org's), or a missing parent without `parents`", body = api::ErrorBody),
    (status = 409, description = "`invalid_state`: the sandbox is not running, or the path exists (`details.reason`)", body = api::ErrorBody),
    (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn mkdir(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(sandbox_id): Path<String>,
    Json(request): Json<MkdirRequest>,
) -> Result<Response, ControlError> {
    let mut route = route(
        &state,
        &org_id,
        &sandbox_id,
        ops::MKDIR,
        "/mkdir",
        &[&request.path],
    )
    .await?;
    if let Some(mode) = &request.mode {
        api::files::parse_mode(mode)
            .map_err(|message| ControlError::new(ErrorCode::InvalidRequest, message))?;
    }
    let body = serde_json::to_vec(&request)
        .map_err(|e| ControlError::new(ErrorCode::Internal, e.to_string()))?;
    let answer =
        data_path::relay(&route, reqwest::Method::POST, &[], RelayBody::Json(body)).await?;
    passed_on(answer, &mut route).await
}

/// A directory as a tar stream (regular files, directories, symlinks as
/// links, never followed; modes without setuid, setgid and sticky;
/// device nodes, fifos and sockets left out), streamed as the agent walks
/// it. A tree that could not be read whole cuts the stream: the archive
/// then lacks its end.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/tar", tag = "files", params(("id" = String, Path, description = "sandbox id"), PathQuery), responses(
    (status = 200, description = "the directory as a tar stream", content_type = "application/x-tar", body = Vec<u8>),
    (status = 400, description = "`invalid_request`: a bad path", body = api::ErrorBody),
    (status = 404, description = "`not_found`: no such sandbox (or another org's), or no such directory", body = api::ErrorBody),
    (status = 409, description = "`invalid_state`: the sandbox is not running, or the path is not a directory (`details.reason`)", body = api::ErrorBody),
    (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn tar_read(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(sandbox_id): Path<String>,
    Query(query): Query<PathQuery>,
) -> Result<Response, ControlError> {
    let mut route = route(
        &state,
        &org_id,
        &sandbox_id,
        ops::TAR_READ,
        "/tar",
        &[&query.path],
    )
    .await?;
    let runner_query = [("path", query.path.clone())];
    let answer =
        data_path::relay(&route, reqwest::Method::GET, &runner_query, RelayBody::None).await?;
    passed_on(answer, &mut route).await
}

/// Unpacks a tar stream (the body) under a directory, made where missing.
/// No entry lands outside it: an absolute path, a `..` component or a way
/// through a symlink refuses the stream (400); setuid, setgid and sticky
/// are cleared; device nodes, fifos and sockets are skipped and counted.
/// A refused or broken stream leaves what was unpacked before it (never a
/// partly written file); a full disk is 507.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files/tar", tag = "files", params(("id" = String, Path, description = "sandbox id"), PathQuery), request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "a tar stream (ustar, GNU or PAX), any length; sent as `application/x-tar` or `application/octet-stream` (the type is not checked)"), responses(
    (status = 200, body = TarSummary),
    (status = 400, description = "`invalid_request`: a bad path, or a malformed or hostile tar entry", body = api::ErrorBody),
    (status = 404, description = "`not_found`: no such sandbox (or another org's)", body = api::ErrorBody),
    (status = 409, description = "`invalid_state`: the sandbox is not running, or the path is not a directory (`details.reason`)", body = api::ErrorBody),
    (status = 507, description = "`insufficient_storage`: the sandbox's disk is full", body = api::ErrorBody),
    (status = "4XX", description = "error envelope", body = api::ErrorBody)))]
pub async fn tar_write(
    State(state): State<AppState>,
    OrgCaller(org_id): OrgCaller,
    Path(sandbox_id): Path<String>,
    Query(query): Query<PathQuery>,
    body: Body,
) -> Result<Response, ControlError> {
    let checked = route(
        &state,
        &org_id,
        &sandbox_id,
        ops::TAR_WRITE,
        "/tar",
        &[&query.path],
    )
    .await;
    let mut route = match checked {
        Ok(route) => route,
        Err(error) => return Err(drained(body, error).await),
    };
    let runner_query = [("path", query.path.clone())];
    let stream = reqwest::Body::wrap_stream(body.into_data_stream());
    let answer = data_path::relay(
        &route,
        reqwest::Method::PUT,
        &runner_query,
        RelayBody::Stream(stream),
    )
    .await?;
    passed_on(answer, &mut route).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_byte_range_is_taken_and_anything_else_ignored() {
        let check = |header: &str, expected: Option<ByteRange>| {
            assert_eq!(parse_range(header), expected, "{header:?}");
        };
        check("bytes=0-99", Some(ByteRange::Span(0, 99)));
        check("bytes=100-", Some(ByteRange::From(100)));
        check("bytes=-500", Some(ByteRange::Suffix(500)));
        check(" bytes=5-5 ", Some(ByteRange::Span(5, 5)));
        for ignored in [
            "",
            "bytes=",
            "bytes=-",
            "bytes=9-3",
            "bytes=0-1,5-6",
            "items=0-1",
            "bytes=a-b",
            "bytes=+1-2",
            "bytes=99999999999999999999-",
        ] {
            check(ignored, None);
        }
        assert_eq!(
            range_query(Some(ByteRange::Span(10, 19))),
            vec![("offset", "10".to_owned()), ("length", "10".to_owned())]
        );
    }
}
