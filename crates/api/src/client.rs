//! A small blocking-free HTTP client over the API, shared by the CLI and
//! the runner (which speaks the runner protocol through the `runner_…`
//! methods). It turns the error envelope into [`ClientError`].

use crate::lifecycle::CommandState;
use std::time::Duration;

use reqwest::{Method, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::blocks::{FetchRequest, MissingRequest, MissingResponse};
use crate::commands::{Command, CommandList, CreateCommandRequest, SignalRequest};
use crate::images::{CommitImageRequest, Image, ImageList};
use crate::orgs::{CreateOrgRequest, CreateOrgResponse, RunnerTokenResponse, Whoami};
use crate::runners::{
    Assignments, CommandReport, HeartbeatRequest, HeartbeatResponse, KeptCopyAnswer,
    KeptCopyReport, PreemptRequest, RegisterRequest, RegisterResponse, RunnerRecord, SandboxReport,
    SaveReport, SnapshotReport,
};
use crate::sandboxes::{CreateSandboxRequest, EventList, QuarantineRequest, Sandbox, SandboxList};
use crate::snapshots::{CreateSnapshotRequest, SalvageRequest, Snapshot, SnapshotList};
use crate::{ErrorBody, ErrorCode};

mod files;
pub use files::{FileDownload, FileRange};

/// Longest a single request may take, long-polls (at most 25 s on the
/// server) included: a server that stops answering fails the call instead
/// of hanging it.
const REQUEST_TIMEOUT_SECONDS: u64 = 60;
/// How much of an unexpected body an error quotes.
const UNEXPECTED_BODY_CHARS_MAX: usize = 200;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid server url {url:?}: {message}")]
    InvalidUrl { url: String, message: String },
    #[error("cannot encode the request: {message}")]
    Encode { message: String },
    #[error("server unreachable at {url}: {message}")]
    Unreachable { url: String, message: String },
    #[error("{code} ({status}): {message} (request {request_id})")]
    Api {
        status: u16,
        code: ErrorCode,
        message: String,
        request_id: String,
        /// The envelope's `details` (`null` when it had none).
        details: serde_json::Value,
    },
    #[error("unexpected response ({status}) from {url}: {body}")]
    Unexpected {
        url: String,
        status: u16,
        body: String,
    },
}

impl ClientError {
    /// The API's error code, if the server answered with the envelope.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Which quota a 429 `quota_exceeded` names (`details.quota.metric`:
    /// `store_bytes`, `requests_at_once`, …).
    pub fn quota_metric(&self) -> Option<&str> {
        match self {
            ClientError::Api {
                code: ErrorCode::QuotaExceeded,
                details,
                ..
            } => details["quota"]["metric"].as_str(),
            _ => None,
        }
    }

    /// Whether the same request may succeed later: the server could not
    /// be reached or said it is unavailable (a proxy's 502/503/504 too).
    /// Everything else is permanent for that request.
    pub fn is_transient(&self) -> bool {
        match self {
            ClientError::Unreachable { .. } => true,
            ClientError::Api { code, .. } => *code == ErrorCode::Unavailable,
            ClientError::Unexpected { status, .. } => [502, 503, 504].contains(status),
            ClientError::InvalidUrl { .. } | ClientError::Encode { .. } => false,
        }
    }
}

/// `GET /v1/sandboxes` filters and paging.
#[derive(Clone, Debug, Default)]
pub struct SandboxListQuery {
    /// Any of these states (none: every state).
    pub states: Vec<String>,
    /// Every one of these labels.
    pub labels: Vec<(String, String)>,
    /// Page size (the server's default when unset).
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// `stdout` or `stderr` of a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputStream {
    Stdout,
    Stderr,
}

impl OutputStream {
    pub fn as_str(self) -> &'static str {
        match self {
            OutputStream::Stdout => "stdout",
            OutputStream::Stderr => "stderr",
        }
    }
}

/// One read of a command's output stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputChunk {
    /// The bytes from the requested offset (possibly none).
    pub data: Vec<u8>,
    /// Where the next read starts (`x-roost-next-offset`).
    pub next_offset: u64,
    /// The command's state when read (`x-roost-command-state`).
    pub state: String,
    /// The command has ended and every byte has been read (`x-roost-complete`).
    pub complete: bool,
}

/// A request body and its media type.
struct Body {
    bytes: Vec<u8>,
    content_type: &'static str,
}

#[derive(Clone)]
pub struct Client {
    base: String,
    token: String,
    http: reqwest::Client,
}

impl Client {
    pub fn new(base_url: &str, token: &str) -> Client {
        Client {
            base: base_url.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
            http: reqwest::Client::new(),
        }
    }

    /// The same server and connection pool, calling with `token` (a runner
    /// switches from its runner token to its own credential once it has
    /// registered).
    pub fn with_token(&self, token: &str) -> Client {
        Client {
            base: self.base.clone(),
            token: token.to_owned(),
            http: self.http.clone(),
        }
    }

    /// The base URL with `segments` appended, each percent-encoded (an id
    /// cannot reach another path), and `query`.
    fn url(&self, segments: &[&str], query: &[(&str, String)]) -> Result<Url, ClientError> {
        let invalid = |message: String| ClientError::InvalidUrl {
            url: self.base.clone(),
            message,
        };
        let mut url = Url::parse(&self.base).map_err(|e| invalid(e.to_string()))?;
        url.path_segments_mut()
            .map_err(|()| invalid("not a base url".to_owned()))?
            .pop_if_empty()
            .extend(segments);
        if !query.is_empty() {
            let mut pairs = url.query_pairs_mut();
            for (name, value) in query {
                pairs.append_pair(name, value);
            }
        }
        Ok(url)
    }

    /// The WebSocket URL (`ws://` or `wss://`) of `segments` on this server.
    pub fn websocket_url(&self, segments: &[&str]) -> Result<String, ClientError> {
        let mut url = self.url(segments, &[])?;
        let scheme = if url.scheme() == "https" { "wss" } else { "ws" };
        url.set_scheme(scheme)
            .map_err(|()| ClientError::InvalidUrl {
                url: self.base.clone(),
                message: "no WebSocket URL for it".to_owned(),
            })?;
        Ok(url.to_string())
    }

    /// The token this client sends (for a request it does not make itself,
    /// such as a WebSocket's upgrade).
    pub fn bearer_token(&self) -> &str {
        &self.token
    }

    /// Sends the request; a 2xx response is returned, anything else
    /// becomes a [`ClientError`] (the envelope's code when there is one).
    async fn send(
        &self,
        method: Method,
        url: Url,
        body: Option<Body>,
        headers: &[(&str, &str)],
    ) -> Result<reqwest::Response, ClientError> {
        let shown = url.to_string();
        let mut request = self
            .http
            .request(method, url)
            .bearer_auth(&self.token)
            .timeout(Duration::from_secs(REQUEST_TIMEOUT_SECONDS));
        if let Some(body) = body {
            request = request
                .header(reqwest::header::CONTENT_TYPE, body.content_type)
                .body(body.bytes);
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await.map_err(|e| ClientError::Unreachable {
            url: shown.clone(),
            message: error_chain(e),
        })?;
        Self::successful(response, shown).await
    }

    /// `response` if it is a 2xx; else its error envelope (or what it
    /// was) as a [`ClientError`].
    async fn successful(
        response: reqwest::Response,
        shown: String,
    ) -> Result<reqwest::Response, ClientError> {
        let status = response.status().as_u16();
        if (200..300).contains(&status) {
            return Ok(response);
        }
        let bytes = response
            .bytes()
            .await
            .map_err(|e| ClientError::Unreachable {
                url: shown.clone(),
                message: error_chain(e),
            })?;
        match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(body) => Err(ClientError::Api {
                status,
                code: body.error.code,
                message: body.error.message,
                request_id: body.error.request_id,
                details: body.error.details,
            }),
            Err(_) => Err(ClientError::Unexpected {
                url: shown,
                status,
                body: quote(&bytes),
            }),
        }
    }

    /// A request whose answer is a JSON record.
    async fn call<R: DeserializeOwned>(
        &self,
        method: Method,
        segments: &[&str],
        query: &[(&str, String)],
        body: Option<Vec<u8>>,
        headers: &[(&str, &str)],
    ) -> Result<R, ClientError> {
        let (url, status, bytes) = self.answer(method, segments, query, body, headers).await?;
        serde_json::from_slice(bytes.as_ref()).map_err(|_| ClientError::Unexpected {
            url,
            status,
            body: quote(bytes.as_ref()),
        })
    }

    /// Sends a JSON request; a successful answer's URL (as shown in
    /// errors), status and bytes, undecoded.
    async fn answer(
        &self,
        method: Method,
        segments: &[&str],
        query: &[(&str, String)],
        body: Option<Vec<u8>>,
        headers: &[(&str, &str)],
    ) -> Result<(String, u16, impl AsRef<[u8]>), ClientError> {
        let url = self.url(segments, query)?;
        let shown = url.to_string();
        let body = body.map(|bytes| Body {
            bytes,
            content_type: "application/json",
        });
        let response = self.send(method, url, body, headers).await?;
        let status = response.status().as_u16();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| ClientError::Unreachable {
                url: shown.clone(),
                message: error_chain(e),
            })?;
        Ok((shown, status, bytes))
    }

    async fn get<R: DeserializeOwned>(
        &self,
        segments: &[&str],
        query: &[(&str, String)],
    ) -> Result<R, ClientError> {
        self.call(Method::GET, segments, query, None, &[]).await
    }

    async fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        segments: &[&str],
        body: &B,
        headers: &[(&str, &str)],
    ) -> Result<R, ClientError> {
        let body = serde_json::to_vec(body).map_err(|e| ClientError::Encode {
            message: e.to_string(),
        })?;
        self.call(Method::POST, segments, &[], Some(body), headers)
            .await
    }

    async fn delete<R: DeserializeOwned>(&self, segments: &[&str]) -> Result<R, ClientError> {
        self.call(Method::DELETE, segments, &[], None, &[]).await
    }

    pub async fn create_org(
        &self,
        request: &CreateOrgRequest,
    ) -> Result<CreateOrgResponse, ClientError> {
        self.post(&["v1", "admin", "orgs"], request, &[]).await
    }

    /// `POST /v1/admin/runner-tokens` (admin token): a token runners
    /// enrol with, declaring at most what `profile` allows.
    pub async fn create_runner_token(
        &self,
        profile: &crate::orgs::RunnerProfile,
    ) -> Result<RunnerTokenResponse, ClientError> {
        self.post(&["v1", "admin", "runner-tokens"], profile, &[])
            .await
    }

    /// `POST /v1/admin/orgs/{org}/tokens` (admin token): another token for
    /// the org (named by id or name).
    pub async fn create_org_token(
        &self,
        org: &str,
    ) -> Result<crate::orgs::OrgTokenResponse, ClientError> {
        self.post(
            &["v1", "admin", "orgs", org, "tokens"],
            &serde_json::json!({}),
            &[],
        )
        .await
    }

    /// `POST /v1/admin/tokens/revoke` (admin token).
    pub async fn revoke_token(
        &self,
        token: &str,
    ) -> Result<crate::orgs::RevokedToken, ClientError> {
        let request = crate::orgs::RevokeTokenRequest {
            token: token.to_owned(),
        };
        self.post(&["v1", "admin", "tokens", "revoke"], &request, &[])
            .await
    }

    /// `PUT /v1/admin/filesystems/{id}/orgs/{org}` (admin token).
    pub async fn bind_filesystem(
        &self,
        filesystem: &str,
        org: &str,
        request: &crate::filesystems::BindFilesystemRequest,
    ) -> Result<crate::filesystems::FilesystemBinding, ClientError> {
        let body = serde_json::to_vec(request).map_err(|e| ClientError::Encode {
            message: e.to_string(),
        })?;
        self.call(
            Method::PUT,
            &["v1", "admin", "filesystems", filesystem, "orgs", org],
            &[],
            Some(body),
            &[],
        )
        .await
    }

    /// `DELETE /v1/admin/filesystems/{id}/orgs/{org}` (admin token): the
    /// binding removed.
    pub async fn unbind_filesystem(
        &self,
        filesystem: &str,
        org: &str,
    ) -> Result<crate::filesystems::FilesystemBinding, ClientError> {
        self.delete(&["v1", "admin", "filesystems", filesystem, "orgs", org])
            .await
    }

    /// `GET /v1/admin/filesystems` (admin token).
    pub async fn list_filesystem_bindings(
        &self,
    ) -> Result<crate::filesystems::FilesystemBindingList, ClientError> {
        self.get(&["v1", "admin", "filesystems"], &[]).await
    }

    /// `POST /v1/admin/sandboxes/{id}/quarantine` (admin token).
    pub async fn quarantine_sandbox(
        &self,
        id: &str,
        request: &QuarantineRequest,
    ) -> Result<Sandbox, ClientError> {
        self.post(
            &["v1", "admin", "sandboxes", id, "quarantine"],
            request,
            &[],
        )
        .await
    }

    /// `DELETE /v1/admin/sandboxes/{id}/quarantine` (admin token).
    pub async fn release_sandbox(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.delete(&["v1", "admin", "sandboxes", id, "quarantine"])
            .await
    }

    /// `POST /v1/sandboxes`; with a key, a retry returns the same sandbox.
    pub async fn create_sandbox(
        &self,
        request: &CreateSandboxRequest,
        idempotency_key: Option<&str>,
    ) -> Result<Sandbox, ClientError> {
        let headers: Vec<(&str, &str)> = idempotency_key
            .map(|key| ("idempotency-key", key))
            .into_iter()
            .collect();
        self.post(&["v1", "sandboxes"], request, &headers).await
    }

    pub async fn get_sandbox(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.get(&["v1", "sandboxes", id], &[]).await
    }

    /// Long-poll: answers once the sandbox is in `state` (or an end state
    /// makes it unreachable), or after `timeout_s` (at most 25) with the
    /// record as it is.
    pub async fn wait_sandbox(
        &self,
        id: &str,
        state: &str,
        timeout_s: u64,
    ) -> Result<Sandbox, ClientError> {
        let query = [
            ("wait_for", state.to_owned()),
            ("timeout", timeout_s.to_string()),
        ];
        self.get(&["v1", "sandboxes", id], &query).await
    }

    pub async fn list_sandboxes(
        &self,
        query: &SandboxListQuery,
    ) -> Result<SandboxList, ClientError> {
        let mut pairs: Vec<(&str, String)> = Vec::new();
        for state in &query.states {
            pairs.push(("state", state.clone()));
        }
        for (key, value) in &query.labels {
            pairs.push(("label", format!("{key}={value}")));
        }
        if let Some(limit) = query.limit {
            pairs.push(("limit", limit.to_string()));
        }
        if let Some(cursor) = &query.cursor {
            pairs.push(("cursor", cursor.clone()));
        }
        self.get(&["v1", "sandboxes"], &pairs).await
    }

    pub async fn stop_sandbox(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.post(
            &["v1", "sandboxes", id, "stop"],
            &serde_json::json!({}),
            &[],
        )
        .await
    }

    pub async fn start_sandbox(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.post(
            &["v1", "sandboxes", id, "start"],
            &serde_json::json!({}),
            &[],
        )
        .await
    }

    /// `PATCH /v1/sandboxes/{id}`: the idle policy.
    pub async fn update_sandbox(
        &self,
        id: &str,
        request: &crate::sandboxes::UpdateSandboxRequest,
    ) -> Result<Sandbox, ClientError> {
        let body = serde_json::to_vec(request).map_err(|e| ClientError::Encode {
            message: e.to_string(),
        })?;
        self.call(
            Method::PATCH,
            &["v1", "sandboxes", id],
            &[],
            Some(body),
            &[],
        )
        .await
    }

    /// `POST /v1/sandboxes/{id}/keepalive`.
    pub async fn keepalive(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.post(
            &["v1", "sandboxes", id, "keepalive"],
            &serde_json::json!({}),
            &[],
        )
        .await
    }

    pub async fn delete_sandbox(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.delete(&["v1", "sandboxes", id]).await
    }

    pub async fn sandbox_events(&self, id: &str) -> Result<EventList, ClientError> {
        let mut all: EventList = self.get(&["v1", "sandboxes", id, "events"], &[]).await?;
        // Every page, oldest first.
        while let Some(cursor) = all.next_cursor.take() {
            let page: EventList = self
                .get(&["v1", "sandboxes", id, "events"], &[("after", cursor)])
                .await?;
            all.events.extend(page.events);
            all.next_cursor = page.next_cursor;
        }
        Ok(all)
    }

    /// `POST /v1/sandboxes/{id}/commands`; with a key, a retry does not
    /// run the command twice.
    pub async fn create_command(
        &self,
        sandbox_id: &str,
        request: &CreateCommandRequest,
        idempotency_key: Option<&str>,
    ) -> Result<Command, ClientError> {
        let headers: Vec<(&str, &str)> = idempotency_key
            .map(|key| ("idempotency-key", key))
            .into_iter()
            .collect();
        self.post(
            &["v1", "sandboxes", sandbox_id, "commands"],
            request,
            &headers,
        )
        .await
    }

    pub async fn get_command(&self, sandbox_id: &str, id: &str) -> Result<Command, ClientError> {
        self.get(&["v1", "sandboxes", sandbox_id, "commands", id], &[])
            .await
    }

    /// Long-poll: answers once the command is in `state` (`ended` for any
    /// end state) or has ended, or after `timeout_s` (at most 25).
    pub async fn wait_command(
        &self,
        sandbox_id: &str,
        id: &str,
        state: &str,
        timeout_s: u64,
    ) -> Result<Command, ClientError> {
        let query = [
            ("wait_for", state.to_owned()),
            ("timeout", timeout_s.to_string()),
        ];
        self.get(&["v1", "sandboxes", sandbox_id, "commands", id], &query)
            .await
    }

    /// A page of a sandbox's commands; `state`: only those in it.
    pub async fn list_commands(
        &self,
        sandbox_id: &str,
        state: Option<CommandState>,
        limit: Option<u32>,
        cursor: Option<&str>,
    ) -> Result<CommandList, ClientError> {
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(state) = state {
            query.push(("state", state.to_string()));
        }
        if let Some(limit) = limit {
            query.push(("limit", limit.to_string()));
        }
        if let Some(cursor) = cursor {
            query.push(("cursor", cursor.to_owned()));
        }
        self.get(&["v1", "sandboxes", sandbox_id, "commands"], &query)
            .await
    }

    /// Streams `body` to a command's stdin (created with `stdin: true`),
    /// closing it after when `close`. No overall timeout: the stream lasts
    /// as long as the command takes to read it. Returns how many bytes the
    /// command's stdin took.
    pub async fn send_stdin(
        &self,
        sandbox_id: &str,
        command_id: &str,
        body: reqwest::Body,
        close: bool,
    ) -> Result<u64, ClientError> {
        let url = self.url(
            &[
                "v1",
                "sandboxes",
                sandbox_id,
                "commands",
                command_id,
                "stdin",
            ],
            &[("close", close.to_string())],
        )?;
        let shown = url.to_string();
        let response = self
            .http
            .post(url)
            .bearer_auth(&self.token)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(body)
            .send()
            .await
            .map_err(|e| ClientError::Unreachable {
                url: shown.clone(),
                message: error_chain(e),
            })?;
        let response = Self::successful(response, shown.clone()).await?;
        #[derive(serde::Deserialize)]
        struct Taken {
            bytes: u64,
        }
        Self::decoded::<Taken>(response, shown)
            .await
            .map(|answer| answer.bytes)
    }

    /// A successful answer's JSON body as `R`.
    async fn decoded<R: DeserializeOwned>(
        response: reqwest::Response,
        shown: String,
    ) -> Result<R, ClientError> {
        let status = response.status().as_u16();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| ClientError::Unreachable {
                url: shown.clone(),
                message: error_chain(e),
            })?;
        serde_json::from_slice::<R>(&bytes).map_err(|_| ClientError::Unexpected {
            url: shown,
            status,
            body: quote(&bytes),
        })
    }

    pub async fn signal_command(
        &self,
        sandbox_id: &str,
        id: &str,
        request: &SignalRequest,
    ) -> Result<Command, ClientError> {
        self.post(
            &["v1", "sandboxes", sandbox_id, "commands", id, "signal"],
            request,
            &[],
        )
        .await
    }

    /// Reads a command's `stream` from `offset` (raw bytes, at most 1 MiB a
    /// read). With `timeout_s` above 0 it long-polls until there are bytes
    /// past `offset` or the command has ended.
    pub async fn command_output(
        &self,
        sandbox_id: &str,
        id: &str,
        stream: OutputStream,
        offset: u64,
        timeout_s: u64,
    ) -> Result<OutputChunk, ClientError> {
        let query = [
            ("stream", stream.as_str().to_owned()),
            ("offset", offset.to_string()),
            ("timeout", timeout_s.to_string()),
        ];
        let url = self.url(
            &["v1", "sandboxes", sandbox_id, "commands", id, "output"],
            &query,
        )?;
        let shown = url.to_string();
        let response = self.send(Method::GET, url, None, &[]).await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let next_offset = header("x-roost-next-offset").and_then(|v| v.parse::<u64>().ok());
        let state = header("x-roost-command-state").map(str::to_owned);
        let complete = header("x-roost-complete").map(|v| v == "true");
        let data = response
            .bytes()
            .await
            .map_err(|e| ClientError::Unreachable {
                url: shown.clone(),
                message: error_chain(e),
            })?
            .to_vec();
        match (next_offset, state, complete) {
            (Some(next_offset), Some(state), Some(complete)) => Ok(OutputChunk {
                data,
                next_offset,
                state,
                complete,
            }),
            _ => Err(ClientError::Unexpected {
                url: shown,
                status,
                body: "output without the x-roost-next-offset, x-roost-command-state and x-roost-complete headers".to_owned(),
            }),
        }
    }

    /// `POST /v1/runner/register`: with a runner token, a new runner (its
    /// id and credential); with a runner's credential, that runner again
    /// (its id kept). Both with a lease.
    pub async fn runner_register(
        &self,
        request: &RegisterRequest,
    ) -> Result<RegisterResponse, ClientError> {
        self.post(&["v1", "runner", "register"], request, &[]).await
    }

    /// `POST /v1/runner/heartbeat`: renews the lease; 409 `fenced` once it
    /// has expired (register again).
    pub async fn runner_heartbeat(
        &self,
        request: &HeartbeatRequest,
    ) -> Result<HeartbeatResponse, ClientError> {
        self.post(&["v1", "runner", "heartbeat"], request, &[])
            .await
    }

    /// `POST /v1/runner/preempt`: this runner's host is being preempted.
    pub async fn runner_preempt(
        &self,
        request: &PreemptRequest,
    ) -> Result<RunnerRecord, ClientError> {
        self.post(&["v1", "runner", "preempt"], request, &[]).await
    }

    /// `GET /v1/admin/counts` (admin token): the kept counts checked.
    pub async fn admin_counts(&self) -> Result<crate::orgs::CountsCheck, ClientError> {
        self.get(&["v1", "admin", "counts"], &[]).await
    }

    /// `GET /v1/admin/orgs` (admin token): every org, its quotas and what
    /// it uses of them.
    pub async fn admin_orgs(&self) -> Result<crate::orgs::OrgList, ClientError> {
        self.get(&["v1", "admin", "orgs"], &[]).await
    }

    /// `GET /v1/admin/runners` (admin token).
    pub async fn admin_runners(&self) -> Result<Vec<RunnerRecord>, ClientError> {
        self.get(&["v1", "admin", "runners"], &[]).await
    }

    /// `POST /v1/admin/runners/{id}/{action}` (admin token), where action
    /// is `drain`, `preempt` or `undrain`.
    pub async fn admin_runner_action(
        &self,
        id: &str,
        action: &str,
    ) -> Result<RunnerRecord, ClientError> {
        self.post(
            &["v1", "admin", "runners", id, action],
            &serde_json::json!({}),
            &[],
        )
        .await
    }

    /// `GET /v1/runner/assignments`: everything placed on the runner.
    /// Long-polls up to `timeout_s` (at most 25) while the answer's etag
    /// would still be `etag`; such an answer may say only `unchanged`.
    pub async fn runner_assignments(
        &self,
        runner_id: &str,
        etag: &str,
        timeout_s: u64,
    ) -> Result<Assignments, ClientError> {
        let query = [
            ("runner_id", runner_id.to_owned()),
            ("etag", etag.to_owned()),
            ("timeout", timeout_s.to_string()),
            ("unchanged", "true".to_owned()),
        ];
        self.get(&["v1", "runner", "assignments"], &query).await
    }

    /// `POST /v1/runner/sandboxes/{id}/report`: an observed sandbox state.
    pub async fn runner_report_sandbox(
        &self,
        sandbox_id: &str,
        report: &SandboxReport,
    ) -> Result<Sandbox, ClientError> {
        self.post(
            &["v1", "runner", "sandboxes", sandbox_id, "report"],
            report,
            &[],
        )
        .await
    }

    /// `POST /v1/runner/commands/{id}/report`: an observed command state.
    pub async fn runner_report_command(
        &self,
        command_id: &str,
        report: &CommandReport,
    ) -> Result<Command, ClientError> {
        self.post(
            &["v1", "runner", "commands", command_id, "report"],
            report,
            &[],
        )
        .await
    }

    /// `PUT /v1/runner/commands/{id}/output/{stream}`: appends `data` at
    /// `offset` (bytes the server already has are skipped, so a retry is
    /// safe); returns the stream's length afterwards.
    pub async fn runner_append_output(
        &self,
        command_id: &str,
        stream: OutputStream,
        placement: (&str, u64),
        offset: u64,
        data: Vec<u8>,
    ) -> Result<u64, ClientError> {
        let (runner_id, epoch) = placement;
        let query = [
            ("runner_id", runner_id.to_owned()),
            ("epoch", epoch.to_string()),
            ("offset", offset.to_string()),
        ];
        let url = self.url(
            &[
                "v1",
                "runner",
                "commands",
                command_id,
                "output",
                stream.as_str(),
            ],
            &query,
        )?;
        let shown = url.to_string();
        let body = Body {
            bytes: data,
            content_type: "application/octet-stream",
        };
        let response = self.send(Method::PUT, url, Some(body), &[]).await?;
        #[derive(serde::Deserialize)]
        struct Length {
            length: u64,
        }
        Self::decoded::<Length>(response, shown)
            .await
            .map(|answer| answer.length)
    }

    /// `POST /v1/runner/sandboxes/{id}/saves`: how a save went.
    pub async fn runner_report_save(
        &self,
        sandbox_id: &str,
        report: &SaveReport,
    ) -> Result<Sandbox, ClientError> {
        self.post(
            &["v1", "runner", "sandboxes", sandbox_id, "saves"],
            report,
            &[],
        )
        .await
    }

    /// `POST /v1/runner/kept`: a home set aside instead of deleted.
    pub async fn runner_report_kept(
        &self,
        report: &KeptCopyReport,
    ) -> Result<KeptCopyAnswer, ClientError> {
        self.post(&["v1", "runner", "kept"], report, &[]).await
    }

    /// `POST /v1/sandboxes/{id}/kept/{copy}/discard` (the sandbox's org, or
    /// the admin token): the runner holding the copy deletes it.
    pub async fn discard_kept_copy(
        &self,
        sandbox_id: &str,
        copy_id: &str,
    ) -> Result<Sandbox, ClientError> {
        self.post(
            &["v1", "sandboxes", sandbox_id, "kept", copy_id, "discard"],
            &serde_json::json!({}),
            &[],
        )
        .await
    }

    /// `POST /v1/sandboxes/{id}/kept/{copy}/salvage`: a snapshot whose
    /// content is the kept copy (`pending` until its runner uploaded it);
    /// with a key, a retry returns the same snapshot.
    pub async fn salvage_kept_copy(
        &self,
        sandbox_id: &str,
        copy_id: &str,
        request: &SalvageRequest,
        idempotency_key: Option<&str>,
    ) -> Result<Snapshot, ClientError> {
        let headers: Vec<(&str, &str)> = idempotency_key
            .map(|key| ("idempotency-key", key))
            .into_iter()
            .collect();
        self.post(
            &["v1", "sandboxes", sandbox_id, "kept", copy_id, "salvage"],
            request,
            &headers,
        )
        .await
    }

    /// `POST /v1/runner/snapshots/{id}/report`.
    pub async fn runner_report_snapshot(
        &self,
        snapshot_id: &str,
        report: &SnapshotReport,
    ) -> Result<Snapshot, ClientError> {
        self.post(
            &["v1", "runner", "snapshots", snapshot_id, "report"],
            report,
            &[],
        )
        .await
    }

    /// `POST /v1/sandboxes/{id}/snapshots`; with a key, a retry returns the
    /// same snapshot.
    pub async fn create_snapshot(
        &self,
        sandbox_id: &str,
        request: &CreateSnapshotRequest,
        idempotency_key: Option<&str>,
    ) -> Result<Snapshot, ClientError> {
        let headers: Vec<(&str, &str)> = idempotency_key
            .map(|key| ("idempotency-key", key))
            .into_iter()
            .collect();
        self.post(
            &["v1", "sandboxes", sandbox_id, "snapshots"],
            request,
            &headers,
        )
        .await
    }

    pub async fn get_snapshot(&self, id: &str) -> Result<Snapshot, ClientError> {
        self.get(&["v1", "snapshots", id], &[]).await
    }

    /// Long-poll: answers once the snapshot reached `durability` (or
    /// failed), or after `timeout_s` (at most 25) as it is.
    pub async fn wait_snapshot(
        &self,
        id: &str,
        durability: &str,
        timeout_s: u64,
    ) -> Result<Snapshot, ClientError> {
        let query = [
            ("wait_for", durability.to_owned()),
            ("timeout", timeout_s.to_string()),
        ];
        self.get(&["v1", "snapshots", id], &query).await
    }

    pub async fn list_snapshots(
        &self,
        sandbox_id: Option<&str>,
        limit: Option<u32>,
        cursor: Option<&str>,
    ) -> Result<SnapshotList, ClientError> {
        let mut query = Vec::new();
        if let Some(sandbox_id) = sandbox_id {
            query.push(("sandbox_id", sandbox_id.to_owned()));
        }
        if let Some(limit) = limit {
            query.push(("limit", limit.to_string()));
        }
        if let Some(cursor) = cursor {
            query.push(("cursor", cursor.to_owned()));
        }
        self.get(&["v1", "snapshots"], &query).await
    }

    pub async fn delete_snapshot(&self, id: &str) -> Result<Snapshot, ClientError> {
        self.delete(&["v1", "snapshots", id]).await
    }

    /// `GET /v1/whoami`: the token's kind and org.
    pub async fn whoami(&self) -> Result<Whoami, ClientError> {
        self.get(&["v1", "whoami"], &[]).await
    }

    /// `GET /v1/deployment`: what the deployment promises and observed.
    pub async fn deployment(&self) -> Result<crate::deployment::Deployment, ClientError> {
        self.get(&["v1", "deployment"], &[]).await
    }

    /// `POST /v1/blocks/{org}/missing`: which of `objects` (`blocks/HEX`,
    /// `trees/HEX`) the org's store lacks.
    pub async fn missing_objects(
        &self,
        org: &str,
        objects: &[String],
    ) -> Result<Vec<String>, ClientError> {
        let request = MissingRequest {
            objects: objects.to_vec(),
        };
        let answer: MissingResponse = self
            .post(&["v1", "blocks", org, "missing"], &request, &[])
            .await?;
        Ok(answer.missing)
    }

    /// `PUT /v1/blocks/{org}/{kind}/{hex}`: an object's stored (framed)
    /// bytes; the server checks them against the digest.
    pub async fn put_object(
        &self,
        org: &str,
        object: &str,
        stored: Vec<u8>,
    ) -> Result<(), ClientError> {
        let mut segments = vec!["v1", "blocks", org];
        segments.extend(object.split('/'));
        let url = self.url(&segments, &[])?;
        let body = Body {
            bytes: stored,
            content_type: "application/octet-stream",
        };
        self.send(Method::PUT, url, Some(body), &[]).await?;
        Ok(())
    }

    /// `POST /v1/blocks/{org}/batch`: several objects' stored bytes in one
    /// body of frames ([`crate::blocks`] documents the format); the server
    /// checks every one against its digest and stores them in order.
    pub async fn put_objects(&self, org: &str, batch: Vec<u8>) -> Result<(), ClientError> {
        let url = self.url(&["v1", "blocks", org, "batch"], &[])?;
        let body = Body {
            bytes: batch,
            content_type: "application/octet-stream",
        };
        self.send(Method::POST, url, Some(body), &[]).await?;
        Ok(())
    }

    /// `GET /v1/blocks/{org}/{kind}/{hex}`: the stored bytes, `None` when
    /// the org's store lacks the object.
    pub async fn get_object(
        &self,
        org: &str,
        object: &str,
    ) -> Result<Option<Vec<u8>>, ClientError> {
        let mut segments = vec!["v1", "blocks", org];
        segments.extend(object.split('/'));
        let url = self.url(&segments, &[])?;
        let shown = url.to_string();
        let response = match self.send(Method::GET, url, None, &[]).await {
            Ok(response) => response,
            Err(err) if err.code() == Some(ErrorCode::NotFound) => return Ok(None),
            Err(err) => return Err(err),
        };
        let bytes = response
            .bytes()
            .await
            .map_err(|e| ClientError::Unreachable {
                url: shown,
                message: error_chain(e),
            })?;
        // Without a copy when the body arrived as one buffer.
        Ok(Some(Vec::from(bytes)))
    }

    /// `POST /v1/blocks/{org}/fetch`: several objects' stored bytes in one
    /// answer of frames (`api::blocks` documents the format), a prefix of
    /// `objects` in their order.
    pub async fn fetch_objects(
        &self,
        org: &str,
        objects: &[String],
    ) -> Result<Vec<u8>, ClientError> {
        let request = FetchRequest {
            objects: objects.to_vec(),
        };
        let bytes = serde_json::to_vec(&request).map_err(|e| ClientError::Encode {
            message: e.to_string(),
        })?;
        let url = self.url(&["v1", "blocks", org, "fetch"], &[])?;
        let shown = url.to_string();
        let body = Body {
            bytes,
            content_type: "application/json",
        };
        let response = self.send(Method::POST, url, Some(body), &[]).await?;
        let bytes = response
            .bytes()
            .await
            .map_err(|e| ClientError::Unreachable {
                url: shown,
                message: error_chain(e),
            })?;
        // Without a copy when the body arrived as one buffer.
        Ok(Vec::from(bytes))
    }

    /// `PUT /v1/images/{name}`: commits an uploaded tree as the image.
    pub async fn commit_image(
        &self,
        name: &str,
        root: &str,
        files: Option<u64>,
    ) -> Result<Image, ClientError> {
        let body = serde_json::to_vec(&CommitImageRequest {
            root: root.to_owned(),
            files,
        })
        .map_err(|e| ClientError::Encode {
            message: e.to_string(),
        })?;
        self.call(Method::PUT, &["v1", "images", name], &[], Some(body), &[])
            .await
    }

    pub async fn get_image(&self, name: &str) -> Result<Image, ClientError> {
        self.get(&["v1", "images", name], &[]).await
    }

    pub async fn list_images(&self) -> Result<ImageList, ClientError> {
        self.get(&["v1", "images"], &[]).await
    }

    pub async fn delete_image(&self, name: &str) -> Result<Image, ClientError> {
        self.delete(&["v1", "images", name]).await
    }

    /// `PUT /v1/secrets/{name}`: sets (makes or rotates) an org secret.
    pub async fn set_secret(
        &self,
        name: &str,
        request: &crate::secrets::SetSecretRequest,
    ) -> Result<crate::secrets::SecretRecord, ClientError> {
        let body = serde_json::to_vec(request).map_err(|e| ClientError::Encode {
            message: e.to_string(),
        })?;
        self.call(Method::PUT, &["v1", "secrets", name], &[], Some(body), &[])
            .await
    }

    pub async fn list_secrets(&self) -> Result<crate::secrets::SecretList, ClientError> {
        self.get(&["v1", "secrets"], &[]).await
    }

    pub async fn delete_secret(
        &self,
        name: &str,
    ) -> Result<crate::secrets::SecretRecord, ClientError> {
        self.delete(&["v1", "secrets", name]).await
    }

    /// `POST /v1/runner/sandboxes/{id}/secrets` (a runner's credential).
    /// An answer that does not decode is reported without its body: it
    /// may hold values.
    pub async fn runner_secrets(
        &self,
        sandbox_id: &str,
        request: &crate::runners::SecretsRequest,
    ) -> Result<crate::runners::SecretValues, ClientError> {
        let body = serde_json::to_vec(request).map_err(|e| ClientError::Encode {
            message: e.to_string(),
        })?;
        let segments = ["v1", "runner", "sandboxes", sandbox_id, "secrets"];
        let (url, status, bytes) = self
            .answer(Method::POST, &segments, &[], Some(body), &[])
            .await?;
        serde_json::from_slice(bytes.as_ref()).map_err(|_| ClientError::Unexpected {
            url,
            status,
            body: "(not shown: it may hold secret values)".to_owned(),
        })
    }
}

fn quote(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .chars()
        .take(UNEXPECTED_BODY_CHARS_MAX)
        .collect()
}

/// reqwest's own message is often just "error sending request"; the cause
/// (connection refused, timed out) is what a user needs.
fn error_chain(err: reqwest::Error) -> String {
    let err = err.without_url();
    let mut message = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        message = format!("{message}: {cause}");
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_unreachable_and_unavailable_are_transient() {
        let api = |code: ErrorCode| ClientError::Api {
            status: code.status(),
            code,
            message: String::new(),
            request_id: String::new(),
            details: serde_json::Value::Null,
        };
        let unexpected = |status: u16| ClientError::Unexpected {
            url: String::new(),
            status,
            body: String::new(),
        };
        let unreachable = ClientError::Unreachable {
            url: String::new(),
            message: String::new(),
        };
        assert!(unreachable.is_transient());
        assert!(api(ErrorCode::Unavailable).is_transient());
        assert!(unexpected(502).is_transient());
        assert!(!api(ErrorCode::NotFound).is_transient());
        assert!(!api(ErrorCode::Internal).is_transient());
        assert!(!api(ErrorCode::QuotaExceeded).is_transient());
        assert!(!unexpected(200).is_transient());
    }

    #[test]
    fn ids_are_one_path_segment_each() {
        let client = Client::new("http://127.0.0.1:7070/", "t");
        let url = client
            .url(
                &["v1", "sandboxes", "../admin/orgs"],
                &[("label", "a=b&c".to_owned())],
            )
            .expect("url");
        assert_eq!(
            url.as_str(),
            "http://127.0.0.1:7070/v1/sandboxes/..%2Fadmin%2Forgs?label=a%3Db%26c"
        );
        let prefixed = Client::new("https://example.com/roost", "t");
        assert_eq!(
            prefixed
                .url(&["v1", "sandboxes"], &[])
                .expect("url")
                .as_str(),
            "https://example.com/roost/v1/sandboxes"
        );
    }
}
