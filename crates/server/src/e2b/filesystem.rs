//! envd's files on roost's file API (`control::data_path::files_route`,
//! the sandbox's own agent in its mount namespace): `GET/POST /files`
//! (download; upload as multipart or octet-stream, streamed), `/health`,
//! and the `filesystem.Filesystem` RPCs (Stat, ListDir, MakeDir, Move,
//! Remove). Watching a directory is refused: roost's agent has no watch.
//!
//! A relative path is relative to `/workspace` (roost's home), where
//! envd's is relative to the user's home directory.

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::multipart::{self, Multipart};
use super::process::code_of_status;
use super::{
    E2bQuery, EnvdCaller, check_json, connect_error_of, connect_stream_error, connect_unary_error,
    connect_unary_ok,
};
use crate::control::AppState;
use crate::control::data_path::{self, RelayBody};
use crate::error::ControlError;
use api::ErrorCode;
use api::e2b::connect::{self, Code};
use api::e2b::envd::{
    Empty, EntryInfo, EntryResponse, FileType, ListDirRequest, ListDirResponse, MoveRequest,
    PathRequest, permissions,
};
use api::e2b::rest::WriteInfo;
use api::files::{FileEntry, FileList, ops};
use api::lifecycle::SandboxState;

/// roost's home: where a relative path starts.
const HOME: &str = "/workspace";

fn absolute(path: &str) -> String {
    let trimmed = path.trim_end_matches('/');
    if path.starts_with('/') {
        if trimmed.is_empty() {
            "/".to_owned()
        } else {
            trimmed.to_owned()
        }
    } else {
        format!("{HOME}/{trimmed}")
    }
}

/// envd's HTTP error (`{"code": STATUS, "message"}`).
fn http_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = api::e2b::rest::Error {
        code: status.as_u16(),
        message: message.into(),
        error_code: None,
    };
    (status, axum::Json(body)).into_response()
}

/// [`http_error`] with a stable `error_code` besides envd's status.
fn refused(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Response {
    let body = api::e2b::rest::Error {
        code: status.as_u16(),
        message: message.into(),
        error_code: Some(code.as_str().to_owned()),
    };
    (status, axum::Json(body)).into_response()
}

fn http_error_of(error: &ControlError) -> Response {
    let status = StatusCode::from_u16(error.code.status()).unwrap_or(StatusCode::BAD_GATEWAY);
    http_error(status, error.message.clone())
}

async fn caller_of(headers: &HeaderMap, state: &AppState) -> Result<EnvdCaller, Response> {
    EnvdCaller::from_headers(headers, state)
        .await
        .map_err(|(status, message)| http_error(status, message))
}

/// `GET /health`: 204 while the sandbox runs; otherwise 502 the way E2B's
/// proxy says a sandbox is gone.
pub async fn health(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let caller = match caller_of(&headers, &state).await {
        Ok(caller) => caller,
        Err(response) => return response,
    };
    let since = state.retained_since_ms();
    match crate::records::sandboxes::visible(&state.db, &caller.org_id, &caller.sandbox_id, since)
        .await
    {
        Ok(Some(row)) if row.state == SandboxState::Running => {
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(Some(row)) => http_error(
            StatusCode::BAD_GATEWAY,
            format!(
                "The sandbox {} was not found running: it is {}",
                caller.sandbox_id, row.state
            ),
        ),
        Ok(None) => http_error(
            StatusCode::BAD_GATEWAY,
            format!("The sandbox {} was not found", caller.sandbox_id),
        ),
        Err(err) => http_error_of(&err.into()),
    }
}

#[derive(Deserialize)]
pub struct FileQuery {
    path: Option<String>,
    /// envd's user; roost runs every command as the sandbox's one user.
    #[allow(dead_code)]
    username: Option<String>,
}

/// `GET /files?path=`: the file, streamed as the agent reads it.
pub async fn read(
    State(state): State<AppState>,
    E2bQuery(query): E2bQuery<FileQuery>,
    headers: HeaderMap,
) -> Response {
    let caller = match caller_of(&headers, &state).await {
        Ok(caller) => caller,
        Err(response) => return response,
    };
    let Some(path) = query.path.filter(|p| !p.is_empty()) else {
        return http_error(StatusCode::BAD_REQUEST, "no path to read");
    };
    let answer = async {
        api::files::check_path(&path)
            .map_err(|m| ControlError::new(ErrorCode::InvalidRequest, m))?;
        let mut route =
            data_path::files_route(&state, &caller.org_id, &caller.sandbox_id, ops::READ, "")
                .await?;
        let answer = data_path::relay(
            &route,
            reqwest::Method::GET,
            &[("path", path.clone())],
            RelayBody::None,
        )
        .await?;
        if !answer.status().is_success() {
            return Err(data_path::refusal(answer).await);
        }
        let mut response =
            Response::new(Body::from_stream(route.while_awake(answer.bytes_stream())));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        Ok(response)
    };
    answer.await.unwrap_or_else(|e| http_error_of(&e))
}

/// `POST /files?path=`: a multipart upload (a part per file, its file
/// name the path when no `path` is given) or an octet-stream one (the
/// body is the file), each streamed to the agent, parents made; answered
/// with envd's `[{name, type, path}]`.
pub async fn write(
    State(state): State<AppState>,
    E2bQuery(query): E2bQuery<FileQuery>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let caller = match caller_of(&headers, &state).await {
        Ok(caller) => caller,
        Err(response) => return response,
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if headers.get(header::CONTENT_ENCODING).is_some() {
        return http_error(
            StatusCode::BAD_REQUEST,
            "a compressed upload (gzip) is not supported by roost",
        );
    }
    if has_metadata(&headers) {
        return http_error(
            StatusCode::BAD_REQUEST,
            "file metadata (X-Metadata-*, extended attributes) is not supported by roost",
        );
    }
    let boundary = match multipart::boundary(&content_type) {
        Ok(boundary) => boundary,
        Err(err) => {
            return refused(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidRequest,
                err.to_string(),
            );
        }
    };
    let mut written = Vec::new();
    if let Some(boundary) = boundary {
        let mut parts = Multipart::new(body.into_data_stream(), &boundary);
        loop {
            let part = match parts.next_part().await {
                Ok(Some(part)) => part,
                Ok(None) => break,
                Err(err) => return http_error(StatusCode::BAD_REQUEST, err.to_string()),
            };
            let Some(path) = query
                .path
                .clone()
                .or(part.filename)
                .filter(|p| !p.is_empty())
            else {
                return http_error(StatusCode::BAD_REQUEST, "a part names no file path");
            };
            let (sender, mut receiver) = tokio::sync::mpsc::channel::<Vec<u8>>(8);
            let stream = futures::stream::poll_fn(move |cx| {
                receiver
                    .poll_recv(cx)
                    .map(|c| c.map(Ok::<_, std::io::Error>))
            });
            let upload = upload(&state, &caller, &path, reqwest::Body::wrap_stream(stream));
            let reader = &mut parts;
            // Owns the sender: the upload's body ends when the part does.
            let feed = async move {
                loop {
                    match reader.next_chunk().await {
                        Ok(Some(chunk)) => {
                            if sender.send(chunk).await.is_err() {
                                return Ok(());
                            }
                        }
                        Ok(None) => return Ok(()),
                        Err(err) => return Err(err),
                    }
                }
            };
            let (uploaded, fed) = tokio::join!(upload, feed);
            if let Err(err) = fed {
                return http_error(StatusCode::BAD_REQUEST, err.to_string());
            }
            match uploaded {
                Ok(info) => written.push(info),
                Err(err) => return http_error_of(&err),
            }
        }
    } else {
        let Some(path) = query.path.filter(|p| !p.is_empty()) else {
            return http_error(StatusCode::BAD_REQUEST, "no path to write");
        };
        let stream = reqwest::Body::wrap_stream(body.into_data_stream());
        match upload(&state, &caller, &path, stream).await {
            Ok(info) => written.push(info),
            Err(err) => return http_error_of(&err),
        }
    }
    axum::Json(written).into_response()
}

fn has_metadata(headers: &HeaderMap) -> bool {
    headers
        .keys()
        .any(|name| name.as_str().starts_with("x-metadata-"))
}

async fn upload(
    state: &AppState,
    caller: &EnvdCaller,
    path: &str,
    body: reqwest::Body,
) -> Result<WriteInfo, ControlError> {
    api::files::check_path(path).map_err(|m| ControlError::new(ErrorCode::InvalidRequest, m))?;
    let route =
        data_path::files_route(state, &caller.org_id, &caller.sandbox_id, ops::WRITE, "").await?;
    let answer = data_path::relay(
        &route,
        reqwest::Method::PUT,
        &[("path", path.to_owned()), ("parents", "true".to_owned())],
        RelayBody::Stream(body),
    )
    .await?;
    if !answer.status().is_success() {
        return Err(data_path::refusal(answer).await);
    }
    let path = absolute(path);
    Ok(WriteInfo {
        name: name_of(&path),
        kind: "file".to_owned(),
        path,
    })
}

fn name_of(path: &str) -> String {
    path.rsplit('/').next().unwrap_or(path).to_owned()
}

/// `POST /e2b/envd/filesystem.Filesystem/{method}`
pub async fn call(
    State(state): State<AppState>,
    Path(method): Path<String>,
    request: Request,
) -> Response {
    let streaming = method == "WatchDir";
    let (parts, body) = request.into_parts();
    let answer = async {
        let caller = EnvdCaller::from_parts(&parts, &state)
            .await
            .map_err(|(status, message)| connect::Error::new(code_of_status(status), message))?;
        check_json(&parts, streaming)?;
        match method.as_str() {
            "Stat" => {
                let request: PathRequest = unary(body).await?;
                let entry = stat(&state, &caller, &request.path).await?;
                Ok(connect_unary_ok(&EntryResponse { entry }))
            }
            "ListDir" => {
                let request: ListDirRequest = unary(body).await?;
                list_dir(&state, &caller, &request)
                    .await
                    .map(|m| connect_unary_ok(&m))
            }
            "MakeDir" => {
                let request: PathRequest = unary(body).await?;
                make_dir(&state, &caller, &request.path).await
            }
            "Move" => {
                let request: MoveRequest = unary(body).await?;
                rename(&state, &caller, &request).await
            }
            "Remove" => {
                let request: PathRequest = unary(body).await?;
                remove(&state, &caller, &request.path).await
            }
            "WatchDir" | "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher" => {
                Err(connect::Error::new(
                    Code::Unimplemented,
                    "watching a directory is not supported by roost (its sandbox agent has no file watch)",
                ))
            }
            other => Err(connect::Error::new(
                Code::Unimplemented,
                format!("filesystem.Filesystem/{other} is not supported by roost"),
            )),
        }
    };
    match answer.await {
        Ok(response) => response,
        Err(err) if streaming => connect_stream_error(err),
        Err(err) => connect_unary_error(err),
    }
}

async fn unary<T: DeserializeOwned>(body: Body) -> Result<T, connect::Error> {
    let bytes = axum::body::to_bytes(body, 1024 * 1024).await.map_err(|e| {
        connect::Error::new(Code::InvalidArgument, format!("the request body: {e}"))
    })?;
    let bytes: &[u8] = if bytes.is_empty() { b"{}" } else { &bytes };
    serde_json::from_slice(bytes).map_err(|e| {
        connect::Error::new(Code::InvalidArgument, format!("the request message: {e}"))
    })
}

/// A request to the sandbox's agent; its JSON answer, read whole: a
/// listing up to `data_path::LISTING_BYTES_MAX`, any other answer (a
/// made directory, a move, a removal) up to `data_path::ANSWER_BYTES_MAX`.
/// A larger one is the runner's bad answer.
async fn relay_json(
    state: &AppState,
    caller: &EnvdCaller,
    op: &str,
    suffix: &str,
    method: reqwest::Method,
    query: &[(&str, String)],
    body: RelayBody,
) -> Result<Vec<u8>, connect::Error> {
    let bytes_max = if op == ops::LIST {
        data_path::LISTING_BYTES_MAX
    } else {
        data_path::ANSWER_BYTES_MAX
    };
    let relayed = async {
        let route =
            data_path::files_route(state, &caller.org_id, &caller.sandbox_id, op, suffix).await?;
        let answer = data_path::relay(&route, method, query, body).await?;
        if !answer.status().is_success() {
            return Err(data_path::refusal(answer).await);
        }
        data_path::answer_bytes(answer, bytes_max).await
    };
    relayed.await.map_err(|e| connect_error_of(&e))
}

fn checked(path: &str) -> Result<String, connect::Error> {
    if path.is_empty() {
        return Err(connect::Error::new(Code::InvalidArgument, "no path"));
    }
    api::files::check_path(path).map_err(|m| connect::Error::new(Code::InvalidArgument, m))?;
    Ok(absolute(path))
}

async fn listing(
    state: &AppState,
    caller: &EnvdCaller,
    path: &str,
    depth: u32,
) -> Result<FileList, connect::Error> {
    let bytes = relay_json(
        state,
        caller,
        ops::LIST,
        "/list",
        reqwest::Method::GET,
        &[("path", path.to_owned()), ("depth", depth.to_string())],
        RelayBody::None,
    )
    .await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| connect::Error::new(Code::Internal, format!("the agent's listing: {e}")))
}

/// envd's entry for roost's.
pub fn entry_info(entry: &FileEntry) -> EntryInfo {
    let mode = api::files::parse_mode(&entry.mode).unwrap_or(0);
    let kind = match entry.kind {
        api::files::FileType::File => FileType::File,
        api::files::FileType::Directory => FileType::Directory,
        api::files::FileType::Symlink => FileType::Symlink,
        api::files::FileType::Other => FileType::Unspecified,
    };
    EntryInfo {
        name: name_of(&entry.path),
        kind,
        path: entry.path.clone(),
        size: entry.size as i64,
        mode,
        permissions: permissions(mode),
        owner: String::new(),
        group: String::new(),
        modified_time: Some(entry.modified_at.clone()),
        symlink_target: entry.link_target.clone(),
        is_symlink: entry.kind == api::files::FileType::Symlink,
    }
}

/// A path's own entry: a listing at depth 0 (the agent's stat). An agent
/// from before depth 0 refuses it; its parent's listing is read then,
/// which misses an entry past the listing's bounds (10,000 entries).
async fn stat(
    state: &AppState,
    caller: &EnvdCaller,
    path: &str,
) -> Result<EntryInfo, connect::Error> {
    let path = checked(path)?;
    if path == "/" {
        return Ok(EntryInfo {
            name: String::new(),
            kind: FileType::Directory,
            path,
            size: 0,
            mode: 0o755,
            permissions: permissions(0o755),
            owner: String::new(),
            group: String::new(),
            modified_time: None,
            symlink_target: None,
            is_symlink: false,
        });
    }
    match listing(state, caller, &path, 0).await {
        Ok(list) => {
            if let [own] = list.entries.as_slice()
                && own.path == path
            {
                return Ok(entry_info(own));
            }
        }
        Err(err) if err.code == Code::NotFound => return Err(err),
        Err(_) => {}
    }
    let parent = match path.rsplit_once('/') {
        Some(("", _)) | None => "/".to_owned(),
        Some((parent, _)) => parent.to_owned(),
    };
    let list = listing(state, caller, &parent, 1).await?;
    list.entries
        .iter()
        .find(|e| e.path == path)
        .map(entry_info)
        .ok_or_else(|| {
            connect::Error::new(Code::NotFound, format!("no such file or directory: {path}"))
        })
}

async fn list_dir(
    state: &AppState,
    caller: &EnvdCaller,
    request: &ListDirRequest,
) -> Result<ListDirResponse, connect::Error> {
    let path = checked(&request.path)?;
    let list = listing(state, caller, &path, request.depth.max(1)).await?;
    if let [only] = list.entries.as_slice()
        && only.path == path
        && only.kind != api::files::FileType::Directory
    {
        return Err(connect::Error::new(
            Code::InvalidArgument,
            format!("path {path} is not a directory"),
        ));
    }
    Ok(ListDirResponse {
        entries: list.entries.iter().map(entry_info).collect(),
    })
}

async fn make_dir(
    state: &AppState,
    caller: &EnvdCaller,
    path: &str,
) -> Result<Response, connect::Error> {
    let path = checked(path)?;
    let request = api::files::MkdirRequest {
        path: path.clone(),
        parents: true,
        mode: None,
    };
    let bytes = relay_json(
        state,
        caller,
        ops::MKDIR,
        "/mkdir",
        reqwest::Method::POST,
        &[],
        RelayBody::Json(serde_json::to_vec(&request).unwrap_or_default()),
    )
    .await?;
    let made: api::files::DirectoryMade = serde_json::from_slice(&bytes)
        .map_err(|e| connect::Error::new(Code::Internal, format!("the agent's answer: {e}")))?;
    if !made.created {
        return Err(connect::Error::new(
            Code::AlreadyExists,
            format!("directory {path} already exists"),
        ));
    }
    let entry = stat(state, caller, &path).await?;
    Ok(connect_unary_ok(&EntryResponse { entry }))
}

async fn rename(
    state: &AppState,
    caller: &EnvdCaller,
    request: &MoveRequest,
) -> Result<Response, connect::Error> {
    let from = checked(&request.source)?;
    let to = checked(&request.destination)?;
    let body = api::files::MoveRequest {
        from,
        to: to.clone(),
        overwrite: true,
    };
    relay_json(
        state,
        caller,
        ops::MOVE,
        "/move",
        reqwest::Method::POST,
        &[],
        RelayBody::Json(serde_json::to_vec(&body).unwrap_or_default()),
    )
    .await?;
    let entry = stat(state, caller, &to).await?;
    Ok(connect_unary_ok(&EntryResponse { entry }))
}

async fn remove(
    state: &AppState,
    caller: &EnvdCaller,
    path: &str,
) -> Result<Response, connect::Error> {
    let path = checked(path)?;
    relay_json(
        state,
        caller,
        ops::REMOVE,
        "",
        reqwest::Method::DELETE,
        &[("path", path), ("recursive", "true".to_owned())],
        RelayBody::None,
    )
    .await?;
    Ok(connect_unary_ok(&Empty {}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_entries_translate() {
        assert_eq!(absolute("a/b"), "/workspace/a/b");
        assert_eq!(absolute("/tmp/x/"), "/tmp/x");
        assert_eq!(absolute("/"), "/");
        let entry = FileEntry {
            path: "/workspace/link".into(),
            kind: api::files::FileType::Symlink,
            size: 3,
            mode: "0777".into(),
            modified_at: "2024-01-01T00:00:00.000Z".into(),
            link_target: Some("a".into()),
        };
        let info = entry_info(&entry);
        assert_eq!(info.name, "link");
        assert!(info.is_symlink);
        assert_eq!(info.mode, 0o777);
        assert_eq!(info.permissions, "rwxrwxrwx");
        assert_eq!(info.symlink_target.as_deref(), Some("a"));
    }
}
