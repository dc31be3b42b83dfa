//! The data listener's file routes (mounted by `data.rs`): a sandbox's
//! files read, written, listed, removed, moved and made, and directories
//! as tar streams, all executed by the sandbox's own agent inside its
//! mount namespace through the `oci::Container` seam. The runner never
//! touches a sandbox's files itself: a path is only ever the agent's to
//! resolve, so no symlink the sandbox made can lead the runner anywhere.
//!
//! Every request carries a token a server minted for exactly its
//! operation (`api::files::ops`) on a sandbox this runner holds at the
//! token's epoch, with no command (`DataPlane::authorize_sandbox`).
//! Answers are the public API's (`api::files`), so the server passes them
//! on; refusals are the API's envelope, the agent's code kept in
//! `details.reason`.
//!
//! Routes, under `/v1/data/sandboxes/{id}/files`:
//! - `GET ?path&offset&length&suffix`: the file's bytes, streamed as the
//!   agent reads them. `offset`/`length` (a range) or `suffix` (the last
//!   N bytes) answer 206 with `Content-Range`; a range starting at or past
//!   the end 416 `range_not_satisfiable` with `Content-Range: bytes */SIZE`.
//! - `PUT ?path&mode&parents`: the body becomes the file, in place only
//!   once whole; 201 when it is new, 200 when it replaced one.
//! - `DELETE ?path&recursive`, `GET /list?path&depth`, `POST /move`,
//!   `POST /mkdir`, `GET /tar?path`, `PUT /tar?path`.

use std::sync::Arc;

use api::ErrorCode;
use api::files::{
    DirectoryMade, FileEntry, FileList, FileMoved, FileRemoved, FileType, FileWritten,
    MkdirRequest, MoveRequest, TarSummary, ops,
};
use axum::body::{Body, BodyDataStream};
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use oci::agent::files::DATA_BYTES_MAX;
use oci::agent::files_client::{FileKind, FileListing};
use oci::config::SandboxId;
use oci::{Container, FileDownload};

use super::data::DataPlane;

pub(super) fn routes() -> axum::Router<Arc<DataPlane>> {
    axum::Router::new()
        .route(
            "/v1/data/sandboxes/{sandbox_id}/files",
            get(read).put(write).delete(remove),
        )
        .route("/v1/data/sandboxes/{sandbox_id}/files/list", get(list))
        .route("/v1/data/sandboxes/{sandbox_id}/files/move", post(rename))
        .route("/v1/data/sandboxes/{sandbox_id}/files/mkdir", post(mkdir))
        .route(
            "/v1/data/sandboxes/{sandbox_id}/files/tar",
            get(tar_read).put(tar_write),
        )
}

/// A refusal, answered as the API's envelope.
#[derive(Debug)]
struct Refusal {
    code: ErrorCode,
    message: String,
    details: serde_json::Value,
}

fn refusal(code: ErrorCode, message: impl Into<String>, details: serde_json::Value) -> Refusal {
    Refusal {
        code,
        message: message.into(),
        details,
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        // 416 says the file's size as `Content-Range` wants it.
        let range = match (self.code, self.details["size"].as_u64()) {
            (ErrorCode::RangeNotSatisfiable, Some(size)) => {
                HeaderValue::from_str(&format!("bytes */{size}")).ok()
            }
            _ => None,
        };
        let body = api::ErrorBody {
            error: api::ErrorDetail {
                code: self.code,
                message: self.message,
                details: self.details,
                request_id: String::new(),
            },
        };
        let status =
            StatusCode::from_u16(self.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, axum::Json(body)).into_response();
        if let Some(range) = range {
            response.headers_mut().insert(header::CONTENT_RANGE, range);
        }
        response
    }
}

fn bad_request(message: impl Into<String>) -> Refusal {
    refusal(ErrorCode::InvalidRequest, message, serde_json::Value::Null)
}

/// The agent's refusals as the API's codes; the agent's code, where it
/// tells more than the API's, in `details.reason`.
fn agent_refusal(err: oci::Error) -> Refusal {
    let oci::Error::Agent { code, message, .. } = &err else {
        return refusal(
            ErrorCode::Internal,
            err.to_string(),
            serde_json::Value::Null,
        );
    };
    let reason = serde_json::json!({"reason": code});
    match code.as_str() {
        "bad_request" => refusal(ErrorCode::InvalidRequest, message.clone(), reason),
        "not_found" => refusal(ErrorCode::NotFound, message.clone(), reason),
        // What the sandbox's files are, not what the request is: the same
        // request may succeed once they change.
        "is_a_directory"
        | "not_a_directory"
        | "already_exists"
        | "directory_not_empty"
        | "cross_device"
        | "permission_denied" => refusal(ErrorCode::InvalidState, message.clone(), reason),
        "insufficient_storage" => refusal(ErrorCode::InsufficientStorage, message.clone(), reason),
        "offset_past_end" => refusal(ErrorCode::RangeNotSatisfiable, message.clone(), reason),
        "unreachable" => refusal(
            ErrorCode::InvalidState,
            format!("the sandbox is not running: {message}"),
            reason,
        ),
        _ => refusal(ErrorCode::Internal, err.to_string(), reason),
    }
}

/// The container of a sandbox this request's token allows `op` on.
fn container(
    plane: &DataPlane,
    headers: &HeaderMap,
    op: &str,
    sandbox_id: &str,
) -> Result<Arc<dyn Container>, Refusal> {
    authorized_container(plane, headers, op, sandbox_id).map(|(container, _)| container)
}

/// [`container`], with the org the token names, if it does.
fn authorized_container(
    plane: &DataPlane,
    headers: &HeaderMap,
    op: &str,
    sandbox_id: &str,
) -> Result<(Arc<dyn Container>, Option<String>), Refusal> {
    let claims = plane
        .authorize_sandbox(headers, op, sandbox_id)
        .map_err(|(code, message)| refusal(code, message, serde_json::Value::Null))?;
    let id = SandboxId::new(sandbox_id)
        .map_err(|e| refusal(ErrorCode::NotFound, e.to_string(), serde_json::Value::Null))?;
    let paths = plane
        .shared
        .data
        .sandbox_paths(&id)
        .map_err(|e| refusal(ErrorCode::Internal, e.to_string(), serde_json::Value::Null))?;
    Ok((plane.shared.runtime.container(id, paths), claims.org_id))
}

fn json<T: serde::Serialize>(status: StatusCode, value: &T) -> Response {
    (status, axum::Json(value)).into_response()
}

fn kind(kind: FileKind) -> FileType {
    match kind {
        FileKind::File => FileType::File,
        FileKind::Directory => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Other => FileType::Other,
    }
}

/// The last millisecond of the year 9999: RFC 3339 and HTTP dates have
/// four-digit years (the formatters panic past it).
const LATEST_DATE_UNIX_MS: i64 = 253_402_300_799_999;

/// A file's time as the agent told it, within what a date can say: a file
/// in the sandbox can carry any time (`touch -d @-1`), so one before 1970
/// shows as 1970 and one past 9999 as the end of 9999.
fn system_time(unix_ms: i64) -> std::time::SystemTime {
    let since = unix_ms.clamp(0, LATEST_DATE_UNIX_MS) as u64;
    std::time::UNIX_EPOCH + std::time::Duration::from_millis(since)
}

fn listing(listing: FileListing) -> FileList {
    FileList {
        entries: listing
            .entries
            .into_iter()
            .map(|entry| FileEntry {
                path: entry.path,
                kind: kind(entry.kind),
                size: entry.size,
                mode: api::files::format_mode(entry.mode),
                modified_at: humantime::format_rfc3339_millis(system_time(entry.mtime_unix_ms))
                    .to_string(),
                link_target: entry.link_target,
            })
            .collect(),
        truncated: listing.truncated,
    }
}

/// An agent's download as a response body, pulled only as fast as the
/// client takes it. An error from the agent (the file changed under the
/// read, the sandbox went) cuts the body: the client sees it incomplete.
fn streamed(download: Box<dyn FileDownload>) -> Body {
    let chunks = futures::stream::unfold(Some(download), |state| async move {
        let mut download = state?;
        match download.next_chunk().await {
            Ok(Some(chunk)) => Some((Ok(axum::body::Bytes::from(chunk)), Some(download))),
            Ok(None) => None,
            Err(err) => {
                tracing::warn!(%err, "a download from a sandbox's agent was cut");
                Some((Err(std::io::Error::other(err.to_string())), None))
            }
        }
    });
    Body::from_stream(chunks)
}

/// What a request body goes to: a file or a tar upload.
enum Sink<'a> {
    File(&'a mut Box<dyn oci::FileUpload>),
    Tar(&'a mut Box<dyn oci::TarUpload>),
}

impl Sink<'_> {
    async fn write(&mut self, bytes: &[u8]) -> oci::Result<()> {
        match self {
            Sink::File(upload) => upload.write(bytes).await,
            Sink::Tar(upload) => upload.write(bytes).await,
        }
    }
}

/// How long a refused upload's body is still read (and dropped) so that
/// the refusal reaches the server: a connection closed with unread bytes
/// is reset, and a reset can destroy the answer before it is read.
const DRAIN_TIME_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// Sends a request body to an agent upload, gathered into frames of the
/// agent's largest size (a network chunk is often a few KiB; each frame
/// costs the agent a wake-up and a write), each written before more of
/// the body is read: back-pressure to the client.
async fn send_body(stream: &mut BodyDataStream, mut sink: Sink<'_>) -> Result<(), Refusal> {
    let mut gathered: Vec<u8> = Vec::with_capacity(DATA_BYTES_MAX);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| bad_request(format!("the request body was cut: {e}")))?;
        let mut rest = &chunk[..];
        while !rest.is_empty() {
            let room = DATA_BYTES_MAX - gathered.len();
            let (taken, left) = rest.split_at(room.min(rest.len()));
            gathered.extend_from_slice(taken);
            rest = left;
            if gathered.len() == DATA_BYTES_MAX {
                sink.write(&gathered).await.map_err(agent_refusal)?;
                gathered.clear();
            }
        }
    }
    if !gathered.is_empty() {
        sink.write(&gathered).await.map_err(agent_refusal)?;
    }
    Ok(())
}

/// `answer`, but a refusal only once the rest of the body was read and
/// dropped (at most [`DRAIN_TIME_MAX`]).
async fn after_draining(
    mut stream: BodyDataStream,
    answer: Result<Response, Refusal>,
) -> Result<Response, Refusal> {
    if answer.is_err() {
        let _ = tokio::time::timeout(DRAIN_TIME_MAX, async {
            while let Some(Ok(_)) = stream.next().await {}
        })
        .await;
    }
    answer
}

#[derive(serde::Deserialize)]
struct ReadQuery {
    path: String,
    offset: Option<u64>,
    length: Option<u64>,
    suffix: Option<u64>,
}

/// A range starting at or past the end (416 with the size).
fn unsatisfiable(size: u64) -> Refusal {
    refusal(
        ErrorCode::RangeNotSatisfiable,
        format!("the range starts at or past the file's end ({size} bytes)"),
        serde_json::json!({"size": size}),
    )
}

/// A file's size, read through a download of none of its bytes.
async fn size_of(container: &dyn Container, path: &str) -> Result<u64, Refusal> {
    let (info, mut download) = container
        .read_file(path, 0, Some(0))
        .await
        .map_err(agent_refusal)?;
    while download
        .next_chunk()
        .await
        .map_err(agent_refusal)?
        .is_some()
    {}
    Ok(info.size)
}

async fn read(
    State(plane): State<Arc<DataPlane>>,
    Path(sandbox_id): Path<String>,
    Query(query): Query<ReadQuery>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let container = container(&plane, &headers, ops::READ, &sandbox_id)?;
    let ranged = query.offset.is_some() || query.suffix.is_some();
    let (offset, length) = match query.suffix {
        Some(suffix) => {
            let size = size_of(container.as_ref(), &query.path).await?;
            if suffix == 0 || size == 0 {
                return Err(unsatisfiable(size));
            }
            (size - suffix.min(size), None)
        }
        None => (query.offset.unwrap_or(0), query.length),
    };
    let (info, download) = match container.read_file(&query.path, offset, length).await {
        Ok(answer) => answer,
        Err(oci::Error::Agent { code, .. }) if code == "offset_past_end" => {
            return Err(unsatisfiable(
                size_of(container.as_ref(), &query.path).await?,
            ));
        }
        Err(err) => return Err(agent_refusal(err)),
    };
    // A range of no byte (`length=0`, which no server asks) has no last
    // byte to name: unsatisfiable, like one past the end.
    if ranged && (offset >= info.size || length == Some(0)) {
        return Err(unsatisfiable(info.size));
    }
    let part = (info.size - offset.min(info.size)).min(length.unwrap_or(u64::MAX));
    let mut response = Response::new(streamed(download));
    let answer = response.headers_mut();
    let mut set = |name: header::HeaderName, value: String| {
        if let Ok(value) = HeaderValue::from_str(&value) {
            answer.insert(name, value);
        }
    };
    set(header::CONTENT_TYPE, "application/octet-stream".to_owned());
    set(header::CONTENT_LENGTH, part.to_string());
    set(header::ACCEPT_RANGES, "bytes".to_owned());
    set(
        header::LAST_MODIFIED,
        httpdate::fmt_http_date(system_time(info.mtime_unix_ms)),
    );
    set(
        header::HeaderName::from_static(api::files::headers::MODE),
        api::files::format_mode(info.mode),
    );
    set(
        header::HeaderName::from_static(api::files::headers::SIZE),
        info.size.to_string(),
    );
    if ranged {
        set(
            header::CONTENT_RANGE,
            format!(
                "bytes {offset}-{}/{}",
                (offset + part).saturating_sub(1),
                info.size
            ),
        );
        *response.status_mut() = StatusCode::PARTIAL_CONTENT;
    }
    Ok(response)
}

#[derive(serde::Deserialize)]
struct WriteQuery {
    path: String,
    mode: Option<String>,
    #[serde(default)]
    parents: bool,
}

async fn write(
    State(plane): State<Arc<DataPlane>>,
    Path(sandbox_id): Path<String>,
    Query(query): Query<WriteQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refusal> {
    let mut stream = body.into_data_stream();
    let answer = write_file(&plane, &sandbox_id, query, &headers, &mut stream).await;
    after_draining(stream, answer).await
}

async fn write_file(
    plane: &DataPlane,
    sandbox_id: &str,
    query: WriteQuery,
    headers: &HeaderMap,
    stream: &mut BodyDataStream,
) -> Result<Response, Refusal> {
    let container = container(plane, headers, ops::WRITE, sandbox_id)?;
    let mode = query
        .mode
        .as_deref()
        .map(api::files::parse_mode)
        .transpose()
        .map_err(bad_request)?;
    // Whether a file is there already (201 or 200): only what the answer
    // says, the write itself does not depend on it.
    let existed = container.read_file(&query.path, 0, Some(0)).await.is_ok();
    let mut upload = container
        .write_file(&query.path, mode, query.parents)
        .await
        .map_err(agent_refusal)?;
    // On any failure `upload` drops unfinished: the agent removes what it
    // wrote, and the path keeps its old content (or stays absent).
    send_body(stream, Sink::File(&mut upload)).await?;
    let size = upload.finish().await.map_err(agent_refusal)?;
    let status = if existed {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    let written = FileWritten {
        path: query.path,
        size,
    };
    Ok(json(status, &written))
}

#[derive(serde::Deserialize)]
struct ListQuery {
    path: String,
    depth: Option<u32>,
}

async fn list(
    State(plane): State<Arc<DataPlane>>,
    Path(sandbox_id): Path<String>,
    Query(query): Query<ListQuery>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let (container, org) = authorized_container(&plane, &headers, ops::LIST, &sandbox_id)?;
    // A listing is held whole (up to the agent's bound, twice: as read and
    // as written), so only a few are built at once; the rest wait.
    // A sandbox and an org have their shares of the turns, and an agent a
    // deadline, so slow ones hold no other org's listings up.
    let _turn = plane
        .listings
        .turn(org.as_deref(), &sandbox_id)
        .await
        .map_err(|message| refusal(ErrorCode::Unavailable, message, serde_json::Value::Null))?;
    let answer = tokio::time::timeout(
        super::data::LISTING_DEADLINE,
        container.list_files(&query.path, query.depth.unwrap_or(1)),
    )
    .await
    .map_err(|_| {
        refusal(
            ErrorCode::Unavailable,
            format!(
                "the sandbox's agent did not finish the listing within {} s",
                super::data::LISTING_DEADLINE.as_secs()
            ),
            serde_json::Value::Null,
        )
    })?
    .map_err(agent_refusal)?;
    Ok(json(StatusCode::OK, &listing(answer)))
}

#[derive(serde::Deserialize)]
struct RemoveQuery {
    path: String,
    #[serde(default)]
    recursive: bool,
}

async fn remove(
    State(plane): State<Arc<DataPlane>>,
    Path(sandbox_id): Path<String>,
    Query(query): Query<RemoveQuery>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let container = container(&plane, &headers, ops::REMOVE, &sandbox_id)?;
    container
        .remove_file(&query.path, query.recursive)
        .await
        .map_err(agent_refusal)?;
    Ok(json(StatusCode::OK, &FileRemoved { path: query.path }))
}

/// A JSON body, checked after the token (a refusal before anything is
/// read teaches an unauthenticated caller nothing).
fn json_request<T>(request: Result<axum::Json<T>, JsonRejection>) -> Result<T, Refusal> {
    request
        .map(|axum::Json(request)| request)
        .map_err(|rejection| bad_request(rejection.body_text()))
}

async fn rename(
    State(plane): State<Arc<DataPlane>>,
    Path(sandbox_id): Path<String>,
    headers: HeaderMap,
    request: Result<axum::Json<MoveRequest>, JsonRejection>,
) -> Result<Response, Refusal> {
    let container = container(&plane, &headers, ops::MOVE, &sandbox_id)?;
    let request = json_request(request)?;
    container
        .move_file(&request.from, &request.to, request.overwrite)
        .await
        .map_err(agent_refusal)?;
    let moved = FileMoved {
        from: request.from,
        to: request.to,
    };
    Ok(json(StatusCode::OK, &moved))
}

async fn mkdir(
    State(plane): State<Arc<DataPlane>>,
    Path(sandbox_id): Path<String>,
    headers: HeaderMap,
    request: Result<axum::Json<MkdirRequest>, JsonRejection>,
) -> Result<Response, Refusal> {
    let container = container(&plane, &headers, ops::MKDIR, &sandbox_id)?;
    let request = json_request(request)?;
    let mode = request
        .mode
        .as_deref()
        .map(api::files::parse_mode)
        .transpose()
        .map_err(bad_request)?;
    let created = container
        .make_dir(&request.path, request.parents, mode)
        .await
        .map_err(agent_refusal)?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let made = DirectoryMade {
        path: request.path,
        created,
    };
    Ok(json(status, &made))
}

#[derive(serde::Deserialize)]
struct TarQuery {
    path: String,
}

async fn tar_read(
    State(plane): State<Arc<DataPlane>>,
    Path(sandbox_id): Path<String>,
    Query(query): Query<TarQuery>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let container = container(&plane, &headers, ops::TAR_READ, &sandbox_id)?;
    let download = container
        .tar_read(&query.path)
        .await
        .map_err(agent_refusal)?;
    let mut response = Response::new(streamed(download));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-tar"),
    );
    Ok(response)
}

async fn tar_write(
    State(plane): State<Arc<DataPlane>>,
    Path(sandbox_id): Path<String>,
    Query(query): Query<TarQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refusal> {
    let mut stream = body.into_data_stream();
    let answer = async {
        let container = container(&plane, &headers, ops::TAR_WRITE, &sandbox_id)?;
        let mut upload = container
            .tar_write(&query.path)
            .await
            .map_err(agent_refusal)?;
        send_body(&mut stream, Sink::Tar(&mut upload)).await?;
        let summary = upload.finish().await.map_err(agent_refusal)?;
        let summary = TarSummary {
            files: summary.files,
            directories: summary.directories,
            symlinks: summary.symlinks,
            bytes: summary.bytes,
            skipped: summary.skipped,
        };
        Ok(json(StatusCode::OK, &summary))
    }
    .await;
    after_draining(stream, answer).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_time_a_sandbox_gives_a_file_is_rendered_without_a_panic() {
        let entry = |mtime_unix_ms| oci::agent::files_client::FileEntry {
            path: "/workspace/x".to_owned(),
            kind: FileKind::File,
            size: 0,
            mode: 0o644,
            mtime_unix_ms,
            link_target: None,
        };
        let list = listing(FileListing {
            entries: vec![entry(-1), entry(i64::MIN), entry(i64::MAX), entry(1_000)],
            truncated: false,
        });
        let times: Vec<&str> = list
            .entries
            .iter()
            .map(|e| e.modified_at.as_str())
            .collect();
        assert_eq!(
            times,
            [
                "1970-01-01T00:00:00.000Z",
                "1970-01-01T00:00:00.000Z",
                "9999-12-31T23:59:59.999Z",
                "1970-01-01T00:00:01.000Z"
            ]
        );
        for ms in [i64::MIN, -1, i64::MAX] {
            assert!(!httpdate::fmt_http_date(system_time(ms)).is_empty());
        }
    }
}
