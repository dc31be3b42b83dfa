//! `roost shell` and `roost exec -t`: a command on a terminal of its own
//! in the sandbox, attached over a WebSocket (`GET …/attach`), with this
//! terminal in raw mode (every key goes to the sandbox, Ctrl-C included)
//! and its size passed on when it changes (SIGWINCH). Leaving (the
//! connection lost, roost killed) never stops the command.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::AsFd;
use std::process::ExitCode;

use anyhow::{Context, Result};
use api::client::Client;
use api::commands::{CreateCommandRequest, TtySize};
use clap::Args;
use futures::{SinkExt, StreamExt};
use tokio::signal::unix::{SignalKind, signal};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::control::runtime;
use crate::exec::exit_status;
use crate::sandbox::{OrgServer, parse_pair, state_with_reason};

/// The size used when stdin is not a terminal.
const DEFAULT_SIZE: TtySize = TtySize { rows: 24, cols: 80 };

#[derive(Args)]
#[command(after_help = "\
Opens an interactive shell (or runs ARGV) on a terminal in the sandbox.
This terminal goes to raw mode until the command ends; its size follows
yours. Exit status: the command's, as `roost exec` (124 timed out, 125
ended otherwise). Leaving does not stop the command: find it with
`roost command list ID --state running`.

Example:
  roost shell sbx_0123
  roost shell sbx_0123 -- python3")]
pub struct ShellArgs {
    /// The sandbox (it must be running).
    sandbox_id: String,
    /// An environment variable for the command (repeatable); TERM is
    /// this terminal's unless given.
    #[arg(long = "env", value_name = "K=V", value_parser = parse_pair)]
    env: Vec<(String, String)>,
    /// Working directory inside the sandbox (default `/workspace`).
    #[arg(long, value_name = "DIR")]
    cwd: Option<String>,
    #[command(flatten)]
    target: OrgServer,
    /// The program and its arguments (default: `sh -l`).
    #[arg(last = true, value_name = "ARGV")]
    argv: Vec<String>,
}

pub fn run_shell(args: ShellArgs) -> Result<ExitCode> {
    let argv = if args.argv.is_empty() {
        vec!["sh".to_owned(), "-l".to_owned()]
    } else {
        args.argv
    };
    let request = CreateCommandRequest {
        argv,
        env: args.env.into_iter().collect(),
        cwd: args.cwd,
        ..CreateCommandRequest::default()
    };
    let client = args.target.client()?;
    runtime()?.block_on(attached(&client, &args.sandbox_id, request))
}

/// This terminal's size, or the default when stdin is not one.
fn local_size() -> TtySize {
    let stdin = std::io::stdin();
    match rustix::termios::tcgetwinsize(stdin.as_fd()) {
        Ok(size) if size.ws_row > 0 && size.ws_col > 0 => TtySize {
            rows: size.ws_row.min(TtySize::MAX),
            cols: size.ws_col.min(TtySize::MAX),
        },
        _ => DEFAULT_SIZE,
    }
}

/// This terminal in raw mode until dropped (nothing when stdin is not a
/// terminal).
struct RawMode {
    saved: Option<rustix::termios::Termios>,
}

impl RawMode {
    fn enter() -> RawMode {
        let stdin = std::io::stdin();
        let fd = stdin.as_fd();
        if !rustix::termios::isatty(fd) {
            return RawMode { saved: None };
        }
        let Ok(saved) = rustix::termios::tcgetattr(fd) else {
            return RawMode { saved: None };
        };
        let mut raw = saved.clone();
        raw.make_raw();
        if rustix::termios::tcsetattr(fd, rustix::termios::OptionalActions::Now, &raw).is_err() {
            return RawMode { saved: None };
        }
        RawMode { saved: Some(saved) }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(saved) = &self.saved {
            let stdin = std::io::stdin();
            let _ = rustix::termios::tcsetattr(
                stdin.as_fd(),
                rustix::termios::OptionalActions::Now,
                saved,
            );
        }
    }
}

/// Runs `request` on a terminal in the sandbox, attached to this one,
/// until it ends; exits with its status.
pub async fn attached(
    client: &Client,
    sandbox_id: &str,
    mut request: CreateCommandRequest,
) -> Result<ExitCode> {
    request.tty = Some(local_size());
    if !request.env.contains_key("TERM") {
        let term = std::env::var("TERM").unwrap_or_else(|_| "xterm-256color".to_owned());
        request.env.insert("TERM".to_owned(), term);
    }
    let created = client
        .create_command(sandbox_id, &request, None)
        .await
        .context("shell failed")?;
    if created.waited_for_wake {
        eprintln!("roost: waking sandbox {sandbox_id}…\r");
    }
    let command_id = created.id.clone();
    let url = client
        .websocket_url(&[
            "v1",
            "sandboxes",
            sandbox_id,
            "commands",
            &command_id,
            "attach",
        ])
        .context("shell failed")?;
    let mut upgrade = url
        .as_str()
        .into_client_request()
        .context("shell failed: the attach URL")?;
    let bearer = format!("Bearer {}", client.bearer_token());
    upgrade.headers_mut().insert(
        "authorization",
        bearer.parse().context("shell failed: the token")?,
    );
    let (socket, _) = tokio_tungstenite::connect_async(upgrade)
        .await
        .with_context(|| format!("shell failed: attaching to {command_id}"))?;
    let (mut sink, mut incoming) = socket.split();
    let raw = RawMode::enter();
    let mut stdin = stdin_chunks();
    let mut window = signal(SignalKind::window_change()).context("listening for SIGWINCH")?;
    let mut stdin_open = true;
    let mut ended: Option<serde_json::Value> = None;
    loop {
        tokio::select! {
            message = incoming.next() => match message {
                Some(Ok(Message::Binary(bytes))) => {
                    let mut stdout = std::io::stdout().lock();
                    let _ = stdout.write_all(&bytes);
                    let _ = stdout.flush();
                }
                Some(Ok(Message::Text(text))) => {
                    if let Ok(value) = serde_json::from_str::<serde_json::Value>(&text)
                        && value["type"] == "exit"
                    {
                        ended = Some(value);
                    }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
            chunk = stdin.recv(), if stdin_open => match chunk {
                None => {
                    stdin_open = false;
                    let eof = serde_json::json!({"type": "eof"}).to_string();
                    let _ = sink.send(Message::Text(eof.into())).await;
                }
                Some(bytes) => {
                    if sink.send(Message::Binary(bytes.into())).await.is_err() {
                        break;
                    }
                }
            },
            _ = window.recv() => {
                let size = local_size();
                let resize = serde_json::json!({"type": "resize", "rows": size.rows, "cols": size.cols});
                let _ = sink.send(Message::Text(resize.to_string().into())).await;
            }
        }
    }
    drop(raw);
    if ended.is_none() {
        eprintln!(
            "\r\nroost: detached from {command_id}; it may still run (roost command get {sandbox_id} {command_id})"
        );
        return Ok(ExitCode::from(crate::exec::EXIT_ENDED_OTHERWISE));
    }
    let record = client
        .get_command(sandbox_id, &command_id)
        .await
        .context("shell failed: reading the command's end")?;
    if record.state != api::lifecycle::CommandState::Exited {
        eprintln!(
            "roost: command ended {}",
            state_with_reason(record.state.as_str(), record.state_reason.as_deref())
        );
    }
    Ok(ExitCode::from(exit_status(&record)))
}

/// Our stdin in chunks, until its end (the channel closes). Read on a
/// thread of its own, not tokio's: a blocking read of a terminal cannot
/// be cancelled, and roost must be able to exit while one waits.
pub fn stdin_chunks() -> tokio::sync::mpsc::Receiver<Vec<u8>> {
    let (sender, receiver) = tokio::sync::mpsc::channel(16);
    std::thread::spawn(move || {
        use std::io::Read;
        let mut stdin = std::io::stdin().lock();
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            match stdin.read(&mut buffer) {
                Ok(0) => return,
                Ok(n) => {
                    if sender.blocking_send(buffer[..n].to_vec()).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    });
    receiver
}

/// `roost exec -t`: ARGV on a terminal, as `roost shell` runs it.
pub async fn exec_on_terminal(
    client: &Client,
    sandbox_id: &str,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
    cwd: Option<String>,
) -> Result<ExitCode> {
    let request = CreateCommandRequest {
        argv,
        env,
        cwd,
        ..CreateCommandRequest::default()
    };
    attached(client, sandbox_id, request).await
}
