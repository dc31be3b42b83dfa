//! envd's `process.Process` service on roost's commands: Start creates a
//! command (argv, env, cwd, stdin, a terminal; the call's deadline becomes
//! its timeout) and streams its start (pid), output and end; Connect
//! streams a command again by pid; List, SendInput, StreamInput,
//! CloseStdin, SendSignal and Update (terminal size) go through the
//! control layer and the data path.
//!
//! A process is addressed by its pid inside the sandbox, as envd does.
//! Its end keeps roost's honest state: an exit code only for `exited`;
//! any other end (`timed_out`, `infrastructure_lost`, …) is `exited:
//! false`, exit code -1 and an `error` naming the state, never a clean
//! exit code.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::de::DeserializeOwned;

use super::{
    EnvdCaller, check_json, connect_error_of, connect_stream_error, connect_unary_error,
    connect_unary_ok,
};
use crate::control::{self, AppState};
use crate::error::ControlError;
use crate::records::commands::Stream;
use crate::records::{self, CommandRow};
use api::commands::{CreateCommandRequest, TtySize};
use api::e2b::connect::{self, Code};
use api::e2b::envd::{
    DataEvent, Empty, EndEvent, EventResponse, ListResponse, ProcessConfig, ProcessEvent,
    ProcessInfo, ProcessSelector, SelectRequest, SendInputRequest, SendSignalRequest, Signal,
    StartEvent, StartRequest, StreamInputRequest, UpdateRequest,
};
use api::lifecycle::CommandState;

/// Most output bytes one data event carries.
const DATA_EVENT_BYTES_MAX: usize = 64 * 1024;
/// How long an output stream waits before it sends a keepalive.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(25);
/// The largest unary request body.
const UNARY_BODY_BYTES_MAX: usize = 8 * 1024 * 1024;
/// The terminal size of a PTY asked for without one.
const DEFAULT_PTY: TtySize = TtySize { rows: 24, cols: 80 };

fn error(code: Code, message: impl Into<String>) -> connect::Error {
    connect::Error::new(code, message)
}

/// `POST /e2b/envd/process.Process/{method}`
pub async fn call(
    State(state): State<AppState>,
    Path(method): Path<String>,
    request: Request,
) -> Response {
    let streaming = matches!(method.as_str(), "Start" | "Connect" | "StreamInput");
    let (parts, body) = request.into_parts();
    let answer = async {
        let caller = EnvdCaller::from_parts(&parts, &state)
            .await
            .map_err(|(status, message)| error(code_of_status(status), message))?;
        check_json(&parts, streaming)?;
        match method.as_str() {
            "Start" => {
                let request: StartRequest = first_message(body).await?;
                start(&state, &caller, &parts, request).await
            }
            "Connect" => {
                let request: SelectRequest = first_message(body).await?;
                let command = by_selector(&state, &caller, request.process.as_ref(), false).await?;
                Ok(stream_command(state.clone(), caller, command.id))
            }
            "StreamInput" => stream_input(&state, &caller, body).await,
            "List" => list(&state, &caller).await.map(|m| connect_unary_ok(&m)),
            "SendInput" => {
                let request: SendInputRequest = unary(body).await?;
                send_input(&state, &caller, request).await
            }
            "CloseStdin" => {
                let request: SelectRequest = unary(body).await?;
                let command = by_selector(&state, &caller, request.process.as_ref(), true).await?;
                // A refusal is the error: `send_stdin` answers only a success.
                control::data_path::send_stdin(
                    &state,
                    &caller.org_id,
                    &caller.sandbox_id,
                    &command.id,
                    true,
                    reqwest::Body::from(Vec::new()),
                )
                .await
                .map_err(|e| connect_error_of(&e))?;
                Ok(connect_unary_ok(&Empty {}))
            }
            "SendSignal" => {
                let request: SendSignalRequest = unary(body).await?;
                send_signal(&state, &caller, request).await
            }
            "Update" => {
                let request: UpdateRequest = unary(body).await?;
                update(&state, &caller, request).await
            }
            other => Err(error(
                Code::Unimplemented,
                format!("process.Process/{other} is not supported by roost"),
            )),
        }
    };
    match answer.await {
        Ok(response) => response,
        Err(err) if streaming => connect_stream_error(err),
        Err(err) => connect_unary_error(err),
    }
}

pub fn code_of_status(status: StatusCode) -> Code {
    match status.as_u16() {
        401 => Code::Unauthenticated,
        404 => Code::NotFound,
        400 => Code::InvalidArgument,
        _ => Code::Unknown,
    }
}

async fn unary<T: DeserializeOwned>(body: Body) -> Result<T, connect::Error> {
    let bytes = axum::body::to_bytes(body, UNARY_BODY_BYTES_MAX)
        .await
        .map_err(|e| error(Code::InvalidArgument, format!("the request body: {e}")))?;
    let bytes: &[u8] = if bytes.is_empty() { b"{}" } else { &bytes };
    serde_json::from_slice(bytes)
        .map_err(|e| error(Code::InvalidArgument, format!("the request message: {e}")))
}

/// A server-streaming call's one request message (its first envelope).
async fn first_message<T: DeserializeOwned>(body: Body) -> Result<T, connect::Error> {
    let bytes = axum::body::to_bytes(body, connect::MESSAGE_BYTES_MAX + 5)
        .await
        .map_err(|e| error(Code::InvalidArgument, format!("the request body: {e}")))?;
    let mut decoder = connect::Decoder::default();
    decoder.push(&bytes);
    let frame = decoder
        .next_frame()
        .map_err(|e| error(Code::InvalidArgument, e.to_string()))?
        .ok_or_else(|| error(Code::InvalidArgument, "no request message in the stream"))?;
    serde_json::from_slice(&frame.1)
        .map_err(|e| error(Code::InvalidArgument, format!("the request message: {e}")))
}

/// The command's roost request for envd's Start.
pub fn command_request(
    request: &StartRequest,
    deadline_ms: Option<u64>,
) -> Result<CreateCommandRequest, connect::Error> {
    if request.tag.is_some() {
        return Err(error(
            Code::Unimplemented,
            "process tags are not supported by roost: address a process by its pid",
        ));
    }
    let process = request
        .process
        .as_ref()
        .filter(|p| !p.cmd.is_empty())
        .ok_or_else(|| error(Code::InvalidArgument, "process.cmd is empty"))?;
    let mut argv = vec![process.cmd.clone()];
    argv.extend(process.args.iter().cloned());
    let tty = request.pty.map(|pty| match pty.size {
        Some(size) => TtySize {
            rows: size.rows.min(u32::from(u16::MAX)) as u16,
            cols: size.cols.min(u32::from(u16::MAX)) as u16,
        },
        None => DEFAULT_PTY,
    });
    Ok(CreateCommandRequest {
        argv,
        env: process.envs.clone(),
        cwd: process.cwd.clone().filter(|c| !c.is_empty()),
        // The call's deadline ends the process, as envd ends it with the
        // call: here the command's own timeout (`timed_out`).
        timeout: deadline_ms.map(|ms| {
            ms.div_ceil(1000)
                .clamp(1, crate::limits::COMMAND_TIMEOUT_SECONDS_MAX)
        }),
        stdin: request.stdin.unwrap_or(false) || tty.is_some(),
        tty,
    })
}

async fn start(
    state: &AppState,
    caller: &EnvdCaller,
    parts: &Parts,
    request: StartRequest,
) -> Result<Response, connect::Error> {
    let deadline_ms = parts
        .headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let request = command_request(&request, deadline_ms)?;
    let command = async {
        control::commands::validate(&request)?;
        crate::http::sandboxes::visible_sandbox(state, &caller.org_id, &caller.sandbox_id).await?;
        let mut tx = state.db.write().await?;
        let command =
            control::commands::create(state, &mut tx, &caller.org_id, &caller.sandbox_id, &request)
                .await?;
        tx.commit().await?;
        Ok::<_, ControlError>(command)
    };
    let command = command.await.map_err(|e| connect_error_of(&e))?;
    tracing::info!(command_id = %command.id, sandbox_id = %caller.sandbox_id, "command started through envd's API");
    Ok(stream_command(
        state.clone(),
        EnvdCaller {
            org_id: caller.org_id.clone(),
            sandbox_id: caller.sandbox_id.clone(),
        },
        command.id,
    ))
}

/// Streams a command's events (start with its pid, its output from the
/// first byte, its end) as they are recorded, on the hub: never polling.
fn stream_command(state: AppState, caller: EnvdCaller, command_id: String) -> Response {
    let (sender, mut receiver) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    tokio::spawn(async move {
        let result = pump(&state, &caller, &command_id, &sender).await;
        // A client gone is no error to report to it.
        if let Err(Some(err)) = result.as_ref().map_err(Clone::clone) {
            let _ = sender.send(connect::end_envelope(Some(err))).await;
        } else if result.is_ok() {
            let _ = sender.send(connect::end_envelope(None)).await;
        }
    });
    let stream = futures::stream::poll_fn(move |cx| {
        receiver
            .poll_recv(cx)
            .map(|chunk| chunk.map(Ok::<_, std::convert::Infallible>))
    });
    let mut response = (StatusCode::OK, Body::from_stream(stream)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(connect::STREAM_JSON),
    );
    response
}

/// `Err(None)`: the client went away.
async fn pump(
    state: &AppState,
    caller: &EnvdCaller,
    command_id: &str,
    sender: &tokio::sync::mpsc::Sender<Vec<u8>>,
) -> Result<(), Option<connect::Error>> {
    let send = |event: ProcessEvent| async move {
        sender
            .send(connect::message_envelope(&EventResponse { event }))
            .await
            .map_err(|_| None::<connect::Error>)
    };
    let load = || async {
        records::commands::visible(&state.db, &caller.org_id, &caller.sandbox_id, command_id)
            .await
            .map_err(ControlError::from)?
            .ok_or_else(|| records::not_found("command"))
    };
    let watch = state.db.hub.watch(command_id);
    // The start event carries the pid: wait until the agent reported it
    // (or the command ended without one: pid 0).
    let mut command = loop {
        let row = crate::hub::wait_until(&watch, KEEPALIVE_EVERY, load, |c: &CommandRow| {
            c.pid.is_some() || c.ended()
        })
        .await
        .map_err(|e| Some(connect_error_of(&e)))?;
        if row.pid.is_some() || row.ended() {
            break row;
        }
        if sender.is_closed() {
            return Err(None);
        }
    };
    send(ProcessEvent::Start(StartEvent {
        pid: command.pid.map_or(0, |p| p.max(0) as u32),
    }))
    .await?;
    let tty = command.tty.is_some();
    let (mut out, mut err) = (0i64, 0i64);
    loop {
        let mut sent = false;
        for (stream, offset) in [(Stream::Stdout, &mut out), (Stream::Stderr, &mut err)] {
            if stream.length_of(&command) > *offset {
                let data = records::commands::read_output(
                    &state.db.pool,
                    command_id,
                    stream,
                    *offset,
                    DATA_EVENT_BYTES_MAX,
                )
                .await
                .map_err(|e| Some(connect_error_of(&e.into())))?;
                if data.is_empty() {
                    continue;
                }
                *offset += data.len() as i64;
                let event = match (stream, tty) {
                    (_, true) => DataEvent {
                        pty: Some(data),
                        ..DataEvent::default()
                    },
                    (Stream::Stdout, false) => DataEvent {
                        stdout: Some(data),
                        ..DataEvent::default()
                    },
                    (Stream::Stderr, false) => DataEvent {
                        stderr: Some(data),
                        ..DataEvent::default()
                    },
                };
                send(ProcessEvent::Data(event)).await?;
                sent = true;
            }
        }
        if sent {
            command = load().await.map_err(|e| Some(connect_error_of(&e)))?;
            continue;
        }
        if command.ended() {
            send(ProcessEvent::End(end_event(&command))).await?;
            return Ok(());
        }
        let before = (out, err);
        command = crate::hub::wait_until(&watch, KEEPALIVE_EVERY, load, |c: &CommandRow| {
            c.ended()
                || Stream::Stdout.length_of(c) > before.0
                || Stream::Stderr.length_of(c) > before.1
        })
        .await
        .map_err(|e| Some(connect_error_of(&e)))?;
        let moved = command.ended()
            || Stream::Stdout.length_of(&command) > out
            || Stream::Stderr.length_of(&command) > err;
        if !moved {
            send(ProcessEvent::Keepalive(Empty {})).await?;
        }
    }
}

/// envd's end for roost's: the exit code only for `exited`.
pub fn end_event(command: &CommandRow) -> EndEvent {
    match (command.state, command.exit_code, &command.signal) {
        (CommandState::Exited, Some(code), _) => EndEvent {
            exit_code: code as i32,
            exited: true,
            status: format!("exit status {code}"),
            error: None,
        },
        (CommandState::Exited, None, Some(signal)) => EndEvent {
            exit_code: -1,
            exited: false,
            status: format!("signal: {signal}"),
            error: Some(format!("the command was killed by signal {signal}")),
        },
        (state, _, signal) => EndEvent {
            exit_code: -1,
            exited: false,
            status: state.as_str().to_owned(),
            error: Some(format!(
                "the command ended {state} ({}){}: roost's state, not an exit code",
                command
                    .state_reason
                    .as_deref()
                    .unwrap_or("no reason recorded"),
                signal
                    .as_deref()
                    .map(|s| format!(", signal {s}"))
                    .unwrap_or_default()
            )),
        },
    }
}

/// The sandbox's command a selector names: by pid, a running one first,
/// else the latest one that had that pid (`running_only`: no ended one).
async fn by_selector(
    state: &AppState,
    caller: &EnvdCaller,
    selector: Option<&ProcessSelector>,
    running_only: bool,
) -> Result<CommandRow, connect::Error> {
    let selector = selector.ok_or_else(|| error(Code::InvalidArgument, "no process selector"))?;
    if selector.tag.is_some() {
        return Err(error(
            Code::Unimplemented,
            "process tags are not supported by roost: address a process by its pid",
        ));
    }
    let pid = selector
        .pid
        .ok_or_else(|| error(Code::InvalidArgument, "the selector names no pid"))?;
    crate::http::sandboxes::visible_sandbox(state, &caller.org_id, &caller.sandbox_id)
        .await
        .map_err(|e| connect_error_of(&e))?;
    records::commands::by_pid(
        &state.db.pool,
        &caller.sandbox_id,
        i64::from(pid),
        running_only,
    )
    .await
    .map_err(|e| connect_error_of(&e.into()))?
    .ok_or_else(|| {
        error(
            Code::NotFound,
            format!(
                "process with pid {pid} not found in sandbox {}",
                caller.sandbox_id
            ),
        )
    })
}

/// The most processes `List` answers with, and the most bytes of their
/// configs (argv and env) together: a sandbox's running commands are
/// bounded by its pids, but each may carry 320 KiB of argv and env, and
/// one answer is held whole in the shared server's memory.
const LIST_PROCESSES_MAX: usize = 1_000;
const LIST_CONFIG_BYTES_MAX: usize = 16 << 20;

async fn list(state: &AppState, caller: &EnvdCaller) -> Result<ListResponse, connect::Error> {
    crate::http::sandboxes::visible_sandbox(state, &caller.org_id, &caller.sandbox_id)
        .await
        .map_err(|e| connect_error_of(&e))?;
    let mut processes = Vec::new();
    let mut config_bytes = 0;
    let mut cursor = String::new();
    loop {
        let (rows, next) = records::commands::list(
            &state.db.pool,
            &caller.sandbox_id,
            Some(CommandState::Running),
            &cursor,
            200,
        )
        .await
        .map_err(|e| connect_error_of(&e.into()))?;
        for row in rows {
            let Some(pid) = row.pid else { continue };
            config_bytes += row.argv.len() + row.env.len();
            if processes.len() >= LIST_PROCESSES_MAX || config_bytes > LIST_CONFIG_BYTES_MAX {
                return Err(error(
                    Code::ResourceExhausted,
                    format!(
                        "more running processes than one answer holds ({LIST_PROCESSES_MAX}, or {LIST_CONFIG_BYTES_MAX} bytes of their commands and env): page through them with GET /v1/sandboxes/{}/commands?state=running",
                        caller.sandbox_id
                    ),
                ));
            }
            let api = row.to_api();
            let mut argv = api.argv.into_iter();
            processes.push(ProcessInfo {
                config: ProcessConfig {
                    cmd: argv.next().unwrap_or_default(),
                    args: argv.collect(),
                    envs: api.env,
                    cwd: api.cwd,
                },
                pid: pid.max(0) as u32,
                tag: None,
            });
        }
        match next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    Ok(ListResponse { processes })
}

async fn send_input(
    state: &AppState,
    caller: &EnvdCaller,
    request: SendInputRequest,
) -> Result<Response, connect::Error> {
    let command = by_selector(state, caller, request.process.as_ref(), true).await?;
    let bytes = request
        .input
        .map(|i| i.bytes().to_vec())
        .unwrap_or_default();
    control::data_path::send_stdin(
        state,
        &caller.org_id,
        &caller.sandbox_id,
        &command.id,
        false,
        reqwest::Body::from(bytes),
    )
    .await
    .map_err(|e| connect_error_of(&e))?;
    Ok(connect_unary_ok(&Empty {}))
}

/// An open stdin (`control::data_path::stdin_feed`): its sender, and the
/// relay's answer once the sender is dropped.
type StdinFeed = (
    control::data_path::StdinSender,
    tokio::task::JoinHandle<Result<control::data_path::Relayed, ControlError>>,
);

/// How many input messages are read between two yields of the worker.
const YIELD_EVERY_MESSAGES: u64 = 256;

/// A client stream: a start naming the process, then its input.
async fn stream_input(
    state: &AppState,
    caller: &EnvdCaller,
    body: Body,
) -> Result<Response, connect::Error> {
    let mut decoder = connect::Decoder::default();
    let mut chunks = body.into_data_stream();
    let mut feed: Option<StdinFeed> = None;
    let mut ended = false;
    let mut read: u64 = 0;
    while !ended {
        let Some(chunk) = chunks.next().await else {
            break;
        };
        let chunk = chunk.map_err(|e| error(Code::Canceled, format!("the input stream: {e}")))?;
        decoder.push(&chunk);
        while let Some((flags, message)) = decoder
            .next_frame()
            .map_err(|e| error(Code::InvalidArgument, e.to_string()))?
        {
            if flags & connect::FLAG_END_STREAM != 0 {
                ended = true;
                break;
            }
            let message: StreamInputRequest = serde_json::from_slice(&message)
                .map_err(|e| error(Code::InvalidArgument, format!("the input message: {e}")))?;
            // Many empty messages in one chunk await nothing: the worker
            // other requests share is handed back now and then.
            read += 1;
            if read.is_multiple_of(YIELD_EVERY_MESSAGES) {
                tokio::task::yield_now().await;
            }
            if let Some(start) = message.start {
                if feed.is_some() {
                    return Err(error(
                        Code::InvalidArgument,
                        "a second start message: one input stream feeds one process",
                    ));
                }
                let command = by_selector(state, caller, start.process.as_ref(), true).await?;
                let opened = control::data_path::stdin_feed(
                    state,
                    &caller.org_id,
                    &caller.sandbox_id,
                    &command.id,
                )
                .await
                .map_err(|e| connect_error_of(&e))?;
                feed = Some(opened);
            } else if let Some(data) = message.data {
                let Some((sender, _)) = &feed else {
                    return Err(error(
                        Code::InvalidArgument,
                        "input before the start message naming the process",
                    ));
                };
                let bytes = data.input.as_ref().map_or(&[][..], |i| i.bytes());
                if sender.send(bytes).await.is_err() {
                    break;
                }
            }
        }
    }
    if let Some((sender, task)) = feed {
        drop(sender);
        task.await
            .map_err(|e| error(Code::Internal, e.to_string()))?
            .map_err(|e| connect_error_of(&e))?;
    }
    let mut body = connect::message_envelope(&Empty {});
    body.extend(connect::end_envelope(None));
    let mut response = (StatusCode::OK, Body::from(body)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(connect::STREAM_JSON),
    );
    Ok(response)
}

async fn send_signal(
    state: &AppState,
    caller: &EnvdCaller,
    request: SendSignalRequest,
) -> Result<Response, connect::Error> {
    let signal = match request.signal {
        Signal::Kill => "KILL",
        Signal::Term => "TERM",
        Signal::Unspecified => {
            return Err(error(Code::InvalidArgument, "no signal named"));
        }
        Signal::Other(n) => {
            return Err(error(
                Code::InvalidArgument,
                format!("signal {n} is not one of envd's (SIGTERM, SIGKILL)"),
            ));
        }
    };
    let command = by_selector(state, caller, request.process.as_ref(), true).await?;
    let signalled = async {
        let mut tx = state.db.write().await?;
        control::commands::signal(&mut tx, &command, signal).await?;
        tx.commit().await?;
        Ok::<_, ControlError>(())
    };
    signalled.await.map_err(|e| connect_error_of(&e))?;
    Ok(connect_unary_ok(&Empty {}))
}

async fn update(
    state: &AppState,
    caller: &EnvdCaller,
    request: UpdateRequest,
) -> Result<Response, connect::Error> {
    let size = request
        .pty
        .and_then(|p| p.size)
        .ok_or_else(|| error(Code::InvalidArgument, "no pty size to update"))?;
    let command = by_selector(state, caller, request.process.as_ref(), true).await?;
    let size = TtySize {
        rows: size.rows.min(u32::from(u16::MAX)) as u16,
        cols: size.cols.min(u32::from(u16::MAX)) as u16,
    };
    control::data_path::resize(state, &caller.org_id, &caller.sandbox_id, &command.id, size)
        .await
        .map_err(|e| connect_error_of(&e))?;
    Ok(connect_unary_ok(&Empty {}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_becomes_a_command() {
        let start: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":""},"stdin":false}"#,
        )
        .expect("in a test");
        let request = command_request(&start, Some(60_000)).expect("in a test");
        assert_eq!(request.argv, ["/bin/bash", "-l", "-c", "echo hi"]);
        assert_eq!(request.env["A"], "1");
        assert_eq!(request.cwd, None);
        assert_eq!(request.timeout, Some(60));
        assert!(!request.stdin && request.tty.is_none());
        let pty: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-i"]},"pty":{"size":{"cols":100,"rows":30}}}"#,
        )
        .expect("in a test");
        let request = command_request(&pty, None).expect("in a test");
        assert_eq!(
            request.tty,
            Some(TtySize {
                rows: 30,
                cols: 100
            })
        );
        assert!(request.stdin);
        assert_eq!(request.timeout, None);
        let tagged: StartRequest =
            serde_json::from_str(r#"{"process":{"cmd":"x"},"tag":"t"}"#).expect("in a test");
        assert_eq!(
            command_request(&tagged, None).expect_err("refused").code,
            Code::Unimplemented
        );
        let empty: StartRequest = serde_json::from_str(r#"{}"#).expect("in a test");
        assert_eq!(
            command_request(&empty, None).expect_err("refused").code,
            Code::InvalidArgument
        );
    }

    fn command(state: CommandState, exit_code: Option<i64>, signal: Option<&str>) -> CommandRow {
        CommandRow {
            id: "cmd_1".into(),
            sandbox_id: "sbx_1".into(),
            org_id: "org".into(),
            argv: "[]".into(),
            env: "{}".into(),
            cwd: None,
            timeout_s: None,
            state,
            state_reason: Some("runner_lost".into()),
            exit_code,
            signal: signal.map(str::to_owned),
            signal_requested: None,
            signal_seq: 0,
            epoch: Some(1),
            stdout_bytes: 0,
            stderr_bytes: 0,
            created_at_ms: 0,
            started_at_ms: None,
            ended_at_ms: None,
            pid: Some(5),
            stdin: false,
            tty: None,
            waited_for_wake: false,
            stdout_truncated: false,
            stderr_truncated: false,
        }
    }

    #[test]
    fn only_exited_has_an_exit_code() {
        let end = end_event(&command(CommandState::Exited, Some(3), None));
        assert_eq!((end.exit_code, end.exited, end.error), (3, true, None));
        let end = end_event(&command(CommandState::Exited, None, Some("KILL")));
        assert_eq!((end.exit_code, end.exited), (-1, false));
        assert!(end.error.expect("in a test").contains("KILL"));
        for state in [
            CommandState::InfrastructureLost,
            CommandState::TimedOut,
            CommandState::Interrupted,
            CommandState::Unknown,
            CommandState::NotLaunched,
        ] {
            let end = end_event(&command(state, None, None));
            assert_eq!((end.exit_code, end.exited), (-1, false), "{state}");
            assert_eq!(end.status, state.as_str());
            let error = end.error.expect("in a test");
            assert!(
                error.contains(state.as_str()) && error.contains("runner_lost"),
                "{error}"
            );
        }
    }
}
