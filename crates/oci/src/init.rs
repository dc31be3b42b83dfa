//! The sandbox's init: PID 1 inside every container.
//!
//! PID 1 has two duties a normal program does not: orphans are re-parented
//! to it, so it must reap them or they stay zombies (filling the pids
//! limit), and the kernel delivers it only the signals it handles, so a
//! program that never expected to be PID 1 ignores a polite SIGTERM. This
//! init reaps every child and forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT,
//! SIGUSR1 and SIGUSR2 to its workload.
//!
//! Without a workload it idles: it waits forever, reaping what commands
//! leave behind, and ends cleanly on SIGTERM or SIGINT (a stop). With one,
//! it ends when the workload ends, with the workload's status (128 + signal
//! for a killed one); the kernel then kills whatever else runs in the
//! sandbox.
//!
//! It tells the runner how it ended with one line on its stdout, which the
//! runner points at a file on the host (`bundle/init.status`); everything
//! else (its complaints, the workload's output) goes to stderr. The lines:
//!
//! ```text
//! roost-init: workload exited code=N
//! roost-init: workload killed signal=N
//! roost-init: stopped signal=N
//! ```
//!
//! A process in the sandbox could write such a line too (it may reach the
//! init's stdout through `/proc/1/fd/1`); it would only mislabel its own
//! sandbox's end, which is why the runner treats the line as the
//! workload's word, not as evidence (an OOM kill is read from the cgroup).
//! An init killed by SIGKILL writes nothing.

use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;

use rustix::process::{Pid, Signal, WaitOptions};
use tokio::signal::unix::{Signal as SignalStream, SignalKind, signal};

/// How the init's status lines start.
pub const STATUS_PREFIX: &str = "roost-init:";

/// How the init ended, as it reported on its stdout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitEnd {
    /// The workload exited with this code.
    WorkloadExited { code: i32 },
    /// The workload was killed by this signal.
    WorkloadKilled { signal: i32 },
    /// The idle init was asked to stop (SIGTERM or SIGINT) and did.
    Stopped { signal: i32 },
}

impl InitEnd {
    /// The exit status the init ended with.
    pub fn exit_code(self) -> i32 {
        match self {
            InitEnd::WorkloadExited { code } => code,
            InitEnd::WorkloadKilled { signal } => 128 + signal,
            InitEnd::Stopped { .. } => 0,
        }
    }

    /// Ended by SIGKILL, directly or as reported by a shell (137): the
    /// shape of an OOM kill.
    pub fn looks_killed(self) -> bool {
        matches!(
            self,
            InitEnd::WorkloadKilled { signal: 9 } | InitEnd::WorkloadExited { code: 137 }
        )
    }

    pub fn to_line(self) -> String {
        match self {
            InitEnd::WorkloadExited { code } => {
                format!("{STATUS_PREFIX} workload exited code={code}")
            }
            InitEnd::WorkloadKilled { signal } => {
                format!("{STATUS_PREFIX} workload killed signal={signal}")
            }
            InitEnd::Stopped { signal } => format!("{STATUS_PREFIX} stopped signal={signal}"),
        }
    }

    /// The last well-formed status line of `text`, if any.
    pub fn parse_last(text: &str) -> Option<InitEnd> {
        text.lines().rev().find_map(|line| {
            let rest = line.strip_prefix(STATUS_PREFIX)?.trim();
            let (kind, value) = rest.rsplit_once('=')?;
            let value: i32 = value.parse().ok()?;
            match kind {
                "workload exited code" => Some(InitEnd::WorkloadExited { code: value }),
                "workload killed signal" => Some(InitEnd::WorkloadKilled { signal: value }),
                "stopped signal" => Some(InitEnd::Stopped { signal: value }),
                _ => None,
            }
        })
    }
}

/// Runs the init with `args` as given after the init's own name or
/// subcommand: `[--] [WORKLOAD ARGV…]`. Returns the init's exit status.
pub fn run_from_args(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    let mut args: Vec<OsString> = args.into_iter().collect();
    if args.first().is_some_and(|a| a == "--") {
        args.remove(0);
    }
    run(&args)
}

/// Runs the init: supervises `workload` (or idles when it is empty) until
/// it ends. Never returns early on its own; see the module docs.
pub fn run(workload: &[OsString]) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("{STATUS_PREFIX} cannot start: {e}");
            return ExitCode::from(126);
        }
    };
    let code = runtime.block_on(supervise(workload));
    ExitCode::from(u8::try_from(code & 0xff).unwrap_or(1))
}

const FORWARDED: [(SignalKind, Signal); 6] = [
    (SignalKind::terminate(), Signal::TERM),
    (SignalKind::interrupt(), Signal::INT),
    (SignalKind::hangup(), Signal::HUP),
    (SignalKind::quit(), Signal::QUIT),
    (SignalKind::user_defined1(), Signal::USR1),
    (SignalKind::user_defined2(), Signal::USR2),
];

async fn supervise(workload: &[OsString]) -> i32 {
    // Outside a container (not PID 1) orphans would escape to the real
    // init; becoming a subreaper keeps them ours. PID 1 already is one.
    if rustix::process::getpid() != Pid::INIT {
        let _ = rustix::process::set_child_subreaper(Some(rustix::process::getpid()));
    }
    // Handlers first, then the child: a SIGCHLD or SIGTERM that arrives
    // right after the spawn must find them installed.
    let mut children = match signal(SignalKind::child()) {
        Ok(stream) => stream,
        Err(e) => {
            eprintln!("{STATUS_PREFIX} cannot watch SIGCHLD: {e}");
            return 126;
        }
    };
    let mut forwarded = Vec::new();
    for (kind, signal_number) in FORWARDED {
        match signal(kind) {
            Ok(stream) => forwarded.push((stream, signal_number)),
            Err(e) => eprintln!(
                "{STATUS_PREFIX} cannot handle signal {}: {e}",
                signal_number.as_raw()
            ),
        }
    }

    let child = match workload.split_first() {
        None => None,
        Some((program, args)) => match std::process::Command::new(program).args(args).spawn() {
            // Reaped below through waitpid(-1) like every other child; the
            // `Child` handle is not needed to wait.
            Ok(child) => Some(Pid::from_child(&child)),
            Err(e) => {
                eprintln!("{STATUS_PREFIX} cannot start the workload {program:?}: {e}");
                let end = InitEnd::WorkloadExited { code: 127 };
                report(end);
                return end.exit_code();
            }
        },
    };

    loop {
        if let Some(end) = reap(child) {
            report(end);
            return end.exit_code();
        }
        let received = tokio::select! {
            _ = children.recv() => None,
            number = std::future::poll_fn(|cx| poll_any(&mut forwarded, cx)) => Some(number),
        };
        let Some(number) = received else { continue };
        match child {
            Some(pid) => {
                // The workload may have just ended; the reap above or the
                // next SIGCHLD settles it.
                let _ = rustix::process::kill_process(pid, number);
            }
            None if number == Signal::TERM || number == Signal::INT => {
                reap(None);
                let end = InitEnd::Stopped {
                    signal: number.as_raw(),
                };
                report(end);
                return end.exit_code();
            }
            None => {}
        }
    }
}

/// The first of the forwarded signals that has arrived.
fn poll_any(
    streams: &mut [(SignalStream, Signal)],
    cx: &mut std::task::Context<'_>,
) -> std::task::Poll<Signal> {
    for (stream, number) in streams.iter_mut() {
        if stream.poll_recv(cx).is_ready() {
            return std::task::Poll::Ready(*number);
        }
    }
    std::task::Poll::Pending
}

/// Reaps every child that has ended; returns how the workload ended if it
/// was among them.
fn reap(workload: Option<Pid>) -> Option<InitEnd> {
    let mut end = None;
    loop {
        match rustix::process::wait(WaitOptions::NOHANG) {
            Ok(Some((pid, status))) => {
                if Some(pid) == workload {
                    end = if let Some(signal) = status.terminating_signal() {
                        Some(InitEnd::WorkloadKilled { signal })
                    } else {
                        status
                            .exit_status()
                            .map(|code| InitEnd::WorkloadExited { code })
                    };
                }
            }
            Ok(None) => break,
            Err(rustix::io::Errno::INTR) => continue,
            // ECHILD: no children at all.
            Err(_) => break,
        }
    }
    end
}

fn report(end: InitEnd) {
    let mut stdout = std::io::stdout().lock();
    // Nobody to tell if stdout is gone; the exit status still says it.
    let _ = writeln!(stdout, "{}", end.to_line());
    let _ = stdout.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_round_trip() {
        for end in [
            InitEnd::WorkloadExited { code: 3 },
            InitEnd::WorkloadKilled { signal: 9 },
            InitEnd::Stopped { signal: 15 },
        ] {
            assert_eq!(InitEnd::parse_last(&end.to_line()), Some(end));
        }
        let text = "noise\nroost-init: workload exited code=1\nroost-init: bogus=2\nmore noise\n";
        assert_eq!(
            InitEnd::parse_last(text),
            Some(InitEnd::WorkloadExited { code: 1 })
        );
        assert_eq!(InitEnd::parse_last(""), None);
        assert_eq!(InitEnd::WorkloadKilled { signal: 15 }.exit_code(), 143);
        assert!(InitEnd::WorkloadExited { code: 137 }.looks_killed());
        assert!(!InitEnd::Stopped { signal: 15 }.looks_killed());
    }
}
