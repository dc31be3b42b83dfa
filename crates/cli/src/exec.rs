//! `roost exec` (run a command in a sandbox, stream its output, exit with
//! its exit code) and `roost command …` (inspect, read and signal commands).

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use api::client::{Client, ClientError, OutputStream};
use api::commands::{Command, CommandList, CreateCommandRequest};
use api::lifecycle::CommandState;
use clap::{Args, Subcommand};
use serde_json::json;
use tokio::time::Instant;

use crate::control::runtime;
use crate::output::{
    age, collect_pages, human_bytes, or_dash, print_fields, print_json, print_record, print_table,
    time_and_age,
};
use crate::sandbox::{
    LONG_POLL_SECONDS_MAX, OrgTarget, parse_pair, retrying, seconds_rounded_up, state_with_reason,
};

/// Exit status of `roost exec` when the command timed out (as coreutils
/// `timeout` does).
pub const EXIT_TIMED_OUT: u8 = 124;
/// Exit status of `roost exec` when the command ended other than by
/// exiting or timing out.
pub const EXIT_ENDED_OTHERWISE: u8 = 125;
/// A pause after an empty read that did not finish the stream, so a
/// server answering at once can never make the reader spin.
const EMPTY_READ_PAUSE: Duration = Duration::from_millis(200);

#[derive(Args)]
#[command(after_help = "\
Exit status:
  N    the program exited with status N
  124  the command timed out (--timeout), like coreutils timeout
  125  it ended any other way: interrupted, launch_failed, not_launched,
       resource_exhausted, infrastructure_lost or unknown
       (a line `roost: command ended STATE (REASON)` on stderr says which)
  1    roost itself failed: the server refused the call or could not be
       reached (one `roost: error: …` line on stderr)
With --json the final command record is printed instead of the output,
with the same exit status and nothing on stderr. With --detach, 0 once the
command is queued. Interrupting roost does not stop the command: use
`roost command signal`.

Example:
  roost exec sbx_0123 --env CI=1 --cwd /workspace -- make test")]
pub struct ExecArgs {
    /// The sandbox to run in (it must be running or about to).
    sandbox_id: String,
    /// An environment variable for the command (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_pair)]
    env: Vec<(String, String)>,
    /// Working directory inside the sandbox (default `/workspace`).
    #[arg(long, value_name = "DIR")]
    cwd: Option<String>,
    /// Ask the command to end after this long (seconds, or e.g. `30s`,
    /// `10m`); it then ends `timed_out` and roost exits 124.
    #[arg(long, value_name = "DURATION", value_parser = crate::sandbox::parse_duration)]
    timeout: Option<Duration>,
    /// Makes the exec safe to retry: the same key with the same request
    /// returns the command the first one made, never runs it twice.
    #[arg(long, value_name = "KEY")]
    idempotency_key: Option<String>,
    /// Print the command record and return once it is queued, without
    /// waiting (read it later with `roost command output`).
    #[arg(long)]
    detach: bool,
    /// Pass this process's stdin to the command (its end closes the
    /// command's stdin), e.g. `tar c . | roost exec -i ID -- tar x`.
    #[arg(short = 'i', long, conflicts_with = "detach")]
    interactive: bool,
    /// Run it on a terminal attached to this one (raw mode, size passed
    /// on), as `roost shell` does; `-it` reads like docker's.
    #[arg(short = 't', long, conflicts_with_all = ["detach", "json"])]
    tty: bool,
    #[command(flatten)]
    target: OrgTarget,
    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "ARGV")]
    argv: Vec<String>,
}

#[derive(Subcommand)]
pub enum CommandCommand {
    /// Show a command's record, optionally waiting for a state.
    #[command(
        after_help = "With --wait-for, exits 1 when the command did not reach the state \
                      (it ended otherwise, or --timeout passed); the record is printed either way."
    )]
    Get {
        /// The sandbox it runs in.
        sandbox_id: String,
        /// The command's id (`cmd_…`).
        command_id: String,
        /// Wait until the command is in this state: queued, starting,
        /// running, `ended` (any end state) or an end state such as exited.
        #[arg(long, value_name = "STATE")]
        wait_for: Option<String>,
        /// Longest to wait with --wait-for (seconds, or e.g. `30s`, `5m`).
        #[arg(
            long,
            value_name = "DURATION",
            default_value = "60s",
            value_parser = crate::sandbox::parse_duration,
            requires = "wait_for"
        )]
        timeout: Duration,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// List a sandbox's commands, oldest first (PID: inside the sandbox,
    /// while its agent runs the command).
    List {
        /// The sandbox.
        sandbox_id: String,
        /// Only commands in this state, e.g. `running` (background work).
        #[arg(long, value_name = "STATE")]
        state: Option<CommandState>,
        /// Commands per page (1 to 200; the server's default is 50).
        #[arg(long, value_name = "N")]
        limit: Option<u32>,
        /// Follow every page to the end instead of printing the first.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Print a command's output (kept while and after it runs) as raw bytes.
    #[command(
        after_help = "With --json, one object: sandbox_id, command_id, stream, bytes, \
                      next_offset, state, complete, and text (the bytes as UTF-8, invalid \
                      sequences replaced)."
    )]
    Output {
        /// The sandbox it runs in.
        sandbox_id: String,
        /// The command's id.
        command_id: String,
        /// Which stream to read.
        #[arg(long, value_name = "STREAM", default_value = "stdout", value_parser = ["stdout", "stderr"])]
        stream: String,
        /// Keep reading as output arrives, until the command has ended.
        #[arg(long)]
        follow: bool,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Send a signal to a running command; a queued one is cancelled
    /// (`not_launched`).
    Signal {
        /// The sandbox it runs in.
        sandbox_id: String,
        /// The command's id.
        command_id: String,
        /// TERM, KILL, INT, HUP, QUIT, USR1 or USR2 (`SIG` prefix and lower
        /// case accepted).
        signal: String,
        #[command(flatten)]
        target: OrgTarget,
    },
}

pub fn run_exec(args: ExecArgs) -> Result<ExitCode> {
    runtime()?.block_on(exec(args))
}

pub async fn exec(args: ExecArgs) -> Result<ExitCode> {
    if args.tty {
        let client = args.target.client()?;
        let env = args.env.into_iter().collect::<BTreeMap<_, _>>();
        return crate::terminal::exec_on_terminal(
            &client,
            &args.sandbox_id,
            args.argv,
            env,
            args.cwd,
        )
        .await;
    }
    let request = CreateCommandRequest {
        argv: args.argv,
        env: args.env.into_iter().collect::<BTreeMap<_, _>>(),
        cwd: args.cwd,
        timeout: args.timeout.map(seconds_rounded_up),
        stdin: args.interactive,
        tty: None,
    };
    let client = args.target.client()?;
    let sandbox_id = args.sandbox_id.as_str();
    let created = client
        .create_command(sandbox_id, &request, args.idempotency_key.as_deref())
        .await
        .context("exec failed")?;
    if created.waited_for_wake && !args.target.json {
        // The sandbox was asleep (or stopped): it starts first.
        eprintln!("roost: waking sandbox {sandbox_id}…");
    }
    if args.detach {
        if args.target.json {
            print_record(&created)?;
        } else {
            println!(
                "command {} queued in sandbox {sandbox_id}; follow it with: roost command output {sandbox_id} {} --follow",
                created.id, created.id
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let command_id = created.id.as_str();
    let feeding = async {
        if args.interactive {
            feed_stdin(&client, sandbox_id, command_id).await
        } else {
            Ok(())
        }
    };
    if args.target.json {
        feeding.await?;
    } else {
        let stdout = pump(&client, sandbox_id, command_id, OutputStream::Stdout);
        let stderr = pump(&client, sandbox_id, command_id, OutputStream::Stderr);
        tokio::try_join!(stdout, stderr, feeding)?;
    }
    let ended = wait_until_ended(&client, sandbox_id, command_id)
        .await
        .with_context(|| format!("exec failed: waiting for {command_id} to end"))?;
    if args.target.json {
        print_record(&ended)?;
    } else {
        if let Some(note) = truncation_note(&ended) {
            eprintln!("roost: {note}");
        }
        if ended.state != CommandState::Exited {
            eprintln!(
                "roost: command ended {}",
                state_with_reason(ended.state.as_str(), ended.state_reason.as_deref())
            );
        }
    }
    Ok(ExitCode::from(exit_status(&ended)))
}

/// Streams our stdin to the command's until it ends. A command that ended
/// (or closed its stdin) before reading it all is not an error: its end
/// says what happened.
async fn feed_stdin(client: &Client, sandbox_id: &str, command_id: &str) -> Result<()> {
    let mut stdin = crate::terminal::stdin_chunks();
    let chunks = futures::stream::poll_fn(move |cx| {
        stdin
            .poll_recv(cx)
            .map(|chunk| chunk.map(Ok::<_, std::io::Error>))
    });
    match client
        .send_stdin(
            sandbox_id,
            command_id,
            reqwest::Body::wrap_stream(chunks),
            true,
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(err) if err.code() == Some(api::ErrorCode::InvalidState) => Ok(()),
        Err(err) => Err(err).context("exec failed: sending stdin"),
    }
}

/// `roost exec`'s exit status for an ended command (documented in its help).
/// What the record did not keep of the command's output, if anything.
fn truncation_note(command: &Command) -> Option<String> {
    let cut: Vec<&str> = [
        ("stdout", command.stdout_truncated),
        ("stderr", command.stderr_truncated),
    ]
    .into_iter()
    .filter_map(|(stream, cut)| cut.then_some(stream))
    .collect();
    (!cut.is_empty()).then(|| {
        format!(
            "only the first {} of {} kept; the rest of the output was not stored",
            human_bytes(api::commands::OUTPUT_STREAM_BYTES_MAX),
            cut.join(" and ")
        )
    })
}

pub(crate) fn exit_status(command: &Command) -> u8 {
    match command.state {
        CommandState::Exited => command
            .exit_code
            .and_then(|code| u8::try_from(code).ok())
            .unwrap_or(EXIT_ENDED_OTHERWISE),
        CommandState::TimedOut => EXIT_TIMED_OUT,
        _ => EXIT_ENDED_OTHERWISE,
    }
}

/// Copies one output stream to ours as it arrives, until the command has
/// ended and every byte has been read. A closed pipe on our side (e.g.
/// `| head`) stops the copying, not the wait.
async fn pump(
    client: &Client,
    sandbox_id: &str,
    command_id: &str,
    stream: OutputStream,
) -> Result<()> {
    let mut offset = 0;
    let mut open = true;
    loop {
        let chunk = retrying(|| {
            client.command_output(
                sandbox_id,
                command_id,
                stream,
                offset,
                LONG_POLL_SECONDS_MAX,
            )
        })
        .await
        .with_context(|| {
            format!(
                "exec failed: reading {} of {command_id} at byte {offset}",
                stream.as_str()
            )
        })?;
        if open && !chunk.data.is_empty() {
            match write_to(stream, &chunk.data) {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => open = false,
                Err(err) => {
                    return Err(err).with_context(|| format!("writing {}", stream.as_str()));
                }
            }
        }
        if chunk.complete {
            return Ok(());
        }
        if chunk.data.is_empty() {
            tokio::time::sleep(EMPTY_READ_PAUSE).await;
        }
        offset = chunk.next_offset;
    }
}

fn write_to(stream: OutputStream, data: &[u8]) -> std::io::Result<()> {
    match stream {
        OutputStream::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_all(data)?;
            out.flush()
        }
        OutputStream::Stderr => {
            let mut err = std::io::stderr().lock();
            err.write_all(data)?;
            err.flush()
        }
    }
}

/// Long-polls the command until it is in an end state.
async fn wait_until_ended(
    client: &Client,
    sandbox_id: &str,
    command_id: &str,
) -> Result<Command, ClientError> {
    loop {
        let command = retrying(|| {
            client.wait_command(sandbox_id, command_id, "ended", LONG_POLL_SECONDS_MAX)
        })
        .await?;
        if ended(&command) {
            return Ok(command);
        }
    }
}

fn ended(command: &Command) -> bool {
    command.state.is_end()
}

pub fn run_command(command: CommandCommand) -> Result<ExitCode> {
    runtime()?.block_on(async move {
        match command {
            CommandCommand::Get {
                sandbox_id,
                command_id,
                wait_for,
                timeout,
                target,
            } => {
                get(
                    &sandbox_id,
                    &command_id,
                    wait_for.as_deref(),
                    timeout,
                    &target,
                )
                .await
            }
            CommandCommand::List {
                sandbox_id,
                state,
                limit,
                all,
                target,
            } => list(&sandbox_id, state, limit, all, &target).await,
            CommandCommand::Output {
                sandbox_id,
                command_id,
                stream,
                follow,
                target,
            } => output(&sandbox_id, &command_id, &stream, follow, &target).await,
            CommandCommand::Signal {
                sandbox_id,
                command_id,
                signal,
                target,
            } => {
                let upper = signal.to_ascii_uppercase();
                let name = upper.strip_prefix("SIG").unwrap_or(&upper).to_owned();
                let request = api::commands::SignalRequest { signal: name };
                let command = target
                    .client()?
                    .signal_command(&sandbox_id, &command_id, &request)
                    .await
                    .context("command signal failed")?;
                if target.json {
                    print_record(&command)?;
                } else {
                    println!(
                        "command {}: {} requested; state {}",
                        command.id,
                        request.signal,
                        state_with_reason(command.state.as_str(), command.state_reason.as_deref())
                    );
                }
                Ok(ExitCode::SUCCESS)
            }
        }
    })
}

async fn get(
    sandbox_id: &str,
    command_id: &str,
    wait_for: Option<&str>,
    timeout: Duration,
    target: &OrgTarget,
) -> Result<ExitCode> {
    let client = target.client()?;
    let Some(state) = wait_for else {
        let command = client
            .get_command(sandbox_id, command_id)
            .await
            .context("command get failed")?;
        print_command(&command, target)?;
        return Ok(ExitCode::SUCCESS);
    };
    let deadline = Instant::now() + timeout;
    let command = loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let timeout_s = seconds_rounded_up(remaining).min(LONG_POLL_SECONDS_MAX);
        let command = retrying(|| client.wait_command(sandbox_id, command_id, state, timeout_s))
            .await
            .context("command get failed")?;
        if command.state.as_str() == state || ended(&command) || Instant::now() >= deadline {
            break command;
        }
    };
    print_command(&command, target)?;
    let reached = command.state.as_str() == state || (state == "ended" && ended(&command));
    if reached {
        return Ok(ExitCode::SUCCESS);
    }
    if !target.json {
        eprintln!(
            "roost: command {} is {}, not {state}",
            command.id,
            state_with_reason(command.state.as_str(), command.state_reason.as_deref())
        );
    }
    Ok(ExitCode::FAILURE)
}

async fn list(
    sandbox_id: &str,
    state: Option<CommandState>,
    limit: Option<u32>,
    all: bool,
    target: &OrgTarget,
) -> Result<ExitCode> {
    let client = target.client()?;
    let (commands, next_cursor) = collect_pages(all, |cursor| {
        let client = &client;
        async move {
            let page = client
                .list_commands(sandbox_id, state, limit, cursor.as_deref())
                .await
                .context("command list failed")?;
            Ok((page.commands, page.next_cursor))
        }
    })
    .await?;
    let listed = CommandList {
        commands,
        next_cursor,
    };
    if target.json {
        print_record(&listed)?;
        return Ok(ExitCode::SUCCESS);
    }
    if listed.commands.is_empty() {
        println!("no commands");
    } else {
        let rows: Vec<Vec<String>> = listed
            .commands
            .iter()
            .map(|c| {
                vec![
                    c.id.clone(),
                    c.state.to_string(),
                    or_dash(c.state_reason.as_deref()),
                    c.exit_code
                        .map_or_else(|| "-".to_owned(), |e| e.to_string()),
                    c.pid.map_or_else(|| "-".to_owned(), |p| p.to_string()),
                    human_bytes(c.stdout_bytes),
                    human_bytes(c.stderr_bytes),
                    age(&c.created_at),
                    display_argv(&c.argv),
                ]
            })
            .collect();
        print_table(
            &[
                "ID", "STATE", "REASON", "EXIT", "PID", "STDOUT", "STDERR", "AGE", "ARGV",
            ],
            &rows,
        );
    }
    if listed.next_cursor.is_some() {
        eprintln!("roost: more commands than shown: add --all (or a larger --limit)");
    }
    Ok(ExitCode::SUCCESS)
}

async fn output(
    sandbox_id: &str,
    command_id: &str,
    stream: &str,
    follow: bool,
    target: &OrgTarget,
) -> Result<ExitCode> {
    let stream = if stream == "stderr" {
        OutputStream::Stderr
    } else {
        OutputStream::Stdout
    };
    let client = target.client()?;
    // Without --follow, read what is there now (several reads if large).
    let timeout_s = if follow { LONG_POLL_SECONDS_MAX } else { 0 };
    let mut offset = 0;
    let mut collected: Vec<u8> = Vec::new();
    loop {
        let chunk =
            retrying(|| client.command_output(sandbox_id, command_id, stream, offset, timeout_s))
                .await
                .context("command output failed")?;
        if target.json {
            collected.extend_from_slice(&chunk.data);
        } else if !chunk.data.is_empty() {
            let mut out = std::io::stdout().lock();
            out.write_all(&chunk.data)
                .and_then(|()| out.flush())
                .context("writing stdout")?;
        }
        let empty = chunk.data.is_empty();
        offset = chunk.next_offset;
        if chunk.complete || (empty && !follow) {
            if target.json {
                print_json(&json!({
                    "sandbox_id": sandbox_id,
                    "command_id": command_id,
                    "stream": stream.as_str(),
                    "bytes": collected.len(),
                    "next_offset": chunk.next_offset,
                    "state": chunk.state,
                    "complete": chunk.complete,
                    "text": String::from_utf8_lossy(&collected),
                }));
            }
            return Ok(ExitCode::SUCCESS);
        }
        if empty {
            tokio::time::sleep(EMPTY_READ_PAUSE).await;
        }
    }
}

fn print_command(command: &Command, target: &OrgTarget) -> Result<()> {
    if target.json {
        return print_record(command);
    }
    // Env values may be secrets: names only on screen (--json has all).
    let env_names = if command.env.is_empty() {
        "-".to_owned()
    } else {
        command.env.keys().cloned().collect::<Vec<_>>().join(", ")
    };
    print_fields(&[
        ("id", command.id.clone()),
        ("sandbox", command.sandbox_id.clone()),
        ("argv", display_argv(&command.argv)),
        (
            "state",
            state_with_reason(command.state.as_str(), command.state_reason.as_deref()),
        ),
        (
            "exit code",
            command
                .exit_code
                .map_or_else(|| "-".to_owned(), |e| e.to_string()),
        ),
        ("signal", or_dash(command.signal.as_deref())),
        ("cwd", or_dash(command.cwd.as_deref())),
        ("env", env_names),
        (
            "timeout",
            command
                .timeout
                .map_or_else(|| "-".to_owned(), |t| format!("{t}s")),
        ),
        (
            "stdout",
            output_size(command.stdout_bytes, command.stdout_truncated),
        ),
        (
            "stderr",
            output_size(command.stderr_bytes, command.stderr_truncated),
        ),
        ("created", time_and_age(Some(&command.created_at))),
        ("started", time_and_age(command.started_at.as_deref())),
        ("ended", time_and_age(command.ended_at.as_deref())),
    ]);
    Ok(())
}

fn output_size(bytes: u64, truncated: bool) -> String {
    if truncated {
        format!("{} (the rest not stored)", human_bytes(bytes))
    } else {
        human_bytes(bytes)
    }
}

/// argv as one line a shell would split back the same way: words with
/// anything but safe characters are single-quoted.
fn display_argv(argv: &[String]) -> String {
    argv.iter()
        .map(|word| {
            let safe = !word.is_empty()
                && word
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
            if safe {
                word.clone()
            } else {
                format!("'{}'", word.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(state: CommandState, exit_code: Option<i32>) -> Command {
        Command {
            id: "cmd_1".to_owned(),
            sandbox_id: "sbx_1".to_owned(),
            argv: vec!["true".to_owned()],
            env: BTreeMap::new(),
            cwd: None,
            timeout: None,
            state,
            state_reason: None,
            exit_code,
            signal: None,
            epoch: Some(1),
            stdout_bytes: 0,
            stderr_bytes: 0,
            created_at: "2025-01-01T00:00:00.000Z".to_owned(),
            started_at: None,
            ended_at: None,
            pid: None,
            stdin: false,
            tty: None,
            waited_for_wake: false,
            stdout_truncated: false,
            stderr_truncated: false,
        }
    }

    #[test]
    fn output_the_record_did_not_keep_is_named() {
        let mut ended = command(CommandState::Exited, Some(0));
        assert_eq!(truncation_note(&ended), None);
        ended.stdout_truncated = true;
        ended.stderr_truncated = true;
        let note = truncation_note(&ended).expect("a note");
        assert!(note.contains("stdout and stderr"), "{note}");
        assert!(note.contains("32"), "{note}");
    }

    #[test]
    fn exit_status_is_the_programs_or_names_how_it_ended() {
        let check = |state: &str, code: Option<i32>, expected: u8| {
            let parsed = state.parse().expect("a command state");
            assert_eq!(exit_status(&command(parsed, code)), expected, "{state}");
        };
        check("exited", Some(0), 0);
        check("exited", Some(3), 3);
        check("exited", Some(255), 255);
        check("exited", Some(-1), EXIT_ENDED_OTHERWISE);
        check("exited", None, EXIT_ENDED_OTHERWISE);
        check("timed_out", None, 124);
        for state in [
            "interrupted",
            "launch_failed",
            "not_launched",
            "resource_exhausted",
            "infrastructure_lost",
            "unknown",
        ] {
            check(state, None, 125);
        }
    }

    #[test]
    fn argv_is_shown_as_a_shell_would_read_it() {
        let argv = |words: &[&str]| words.iter().map(|w| (*w).to_owned()).collect::<Vec<_>>();
        assert_eq!(display_argv(&argv(&["ls", "-la", "/tmp"])), "ls -la /tmp");
        assert_eq!(
            display_argv(&argv(&["sh", "-c", "echo it's"])),
            r"sh -c 'echo it'\''s'"
        );
        assert_eq!(display_argv(&argv(&[""])), "''");
    }
}
