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
//! The workload's stdout and stderr are a pipe the init reads and writes
//! to its own stderr, keeping at most [`WORKLOAD_LOG_BYTES_MAX`] of it on
//! the host (older output is punched out of the file, the latest kept):
//! the files are on the runner's disk, outside every bound of the
//! sandbox's own, so a workload printing forever must not fill that disk.
//! For the same reason the init makes itself non-dumpable, which closes
//! `/proc/1/fd/1` and `/proc/1/fd/2` to the sandbox's processes (they have
//! no `CAP_SYS_PTRACE`): before, any of them could write there, past the
//! bound, and print a status line in the init's name. The runner still
//! treats the line as the workload's word, not as evidence (an OOM kill
//! is read from the cgroup). An init killed by SIGKILL writes nothing.
//!
//! # The lease watch
//!
//! Started as `init --lease-dir DIR` (the runner does: see
//! [`crate::lease`]), the init also enforces its runner's lease without the
//! runner: once the deadline in `DIR` passes unrenewed, it stops (SIGSTOP)
//! every other process of its pid namespace, the workload and every
//! command, and keeps stopping any that appear; once a later deadline is
//! written, it continues (SIGCONT) exactly those it stopped. So a runner
//! process that dies leaves its sandboxes frozen, not running, and one that
//! comes back in time (or a restarted one that is still assigned the
//! sandbox) thaws them by renewing; a runner that learns it was fenced
//! kills them (SIGKILL ends a stopped process too).
//!
//! Why stop rather than kill: the contract's freeze point is a freeze
//! (DESIGN.md §7: freeze before the lease could expire, thaw if renewed in
//! time, kill once fenced). A runner restarted within its lease (an
//! upgrade, a crash and a supervisor's restart) must find its workloads
//! where they were, as with the runner's own cgroup freeze; killing at the
//! deadline would turn every slow runner restart into lost processes, and
//! a standard sandbox's only copy of its in-memory work. Stopped, the
//! processes run nothing, so they write nothing, yet can still be resumed
//! or killed. The init itself keeps running (PID 1 cannot be stopped from
//! inside its namespace, and it is what must notice the renewal); it
//! writes nothing of the sandbox's.
//!
//! Each freeze and thaw is one line on stderr (`init.log` on the host):
//!
//! ```text
//! roost-init: lease lapsed: stopped N processes frozen_at_unix_ms=T
//! roost-init: lease renewed: continued N processes
//! ```
//!
//! A SIGSTOP is visible where a cgroup freeze is not: a parent waiting
//! with `WUNTRACED` (an interactive shell's job control) sees its child
//! stop and continue. The runner's own fence (the cgroup freezer) acts
//! first, at two thirds of the lease; this watch is the backstop for when
//! the runner cannot.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use rustix::process::{Pid, Signal, WaitOptions};
use tokio::signal::unix::{Signal as SignalStream, SignalKind, signal};

use crate::agent::AGENT_FD_FLAG;
use crate::agent::server::Agent;
use crate::lease::{self, LEASE_FLAG, Move};

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
            // The file is the runner's, but what writes it runs in the
            // sandbox: a signal out of range (whose 128 + n would wrap)
            // is no status line.
            let signal = |n: i32| (1..=64).contains(&n).then_some(n);
            match kind {
                "workload exited code" => Some(InitEnd::WorkloadExited { code: value }),
                "workload killed signal" => Some(InitEnd::WorkloadKilled {
                    signal: signal(value)?,
                }),
                "stopped signal" => Some(InitEnd::Stopped {
                    signal: signal(value)?,
                }),
                _ => None,
            }
        })
    }
}

/// Runs the init with `args` as given after the init's own name or
/// subcommand: `[--lease-dir DIR] [--agent-fd N] [--] [WORKLOAD ARGV…]`.
/// Returns the init's exit status.
pub fn run_from_args(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    let mut args: Vec<OsString> = args.into_iter().collect();
    let mut lease_dir = None;
    let mut agent_fd = None;
    loop {
        let flag = args.first().and_then(|a| a.to_str()).map(str::to_owned);
        match flag.as_deref() {
            Some(LEASE_FLAG) => match args.get(1) {
                Some(dir) => lease_dir = Some(PathBuf::from(dir)),
                None => {
                    eprintln!("{STATUS_PREFIX} {LEASE_FLAG} needs a directory");
                    return ExitCode::from(126);
                }
            },
            Some(AGENT_FD_FLAG) => {
                match args.get(1).and_then(|n| n.to_str()?.parse::<i32>().ok()) {
                    Some(fd) if fd >= 3 => agent_fd = Some(fd),
                    _ => {
                        eprintln!(
                            "{STATUS_PREFIX} {AGENT_FD_FLAG} needs a descriptor number from 3"
                        );
                        return ExitCode::from(126);
                    }
                }
            }
            _ => break,
        }
        args.drain(..2);
    }
    if args.first().is_some_and(|a| a == "--") {
        args.remove(0);
    }
    run(&args, lease_dir, agent_fd)
}

/// Runs the init: supervises `workload` (or idles when it is empty) until
/// it ends, with `lease_dir` watches the runner's lease (see the module
/// docs), and with `agent_fd` serves the sandbox's agent on that listening
/// socket ([`crate::agent`]). Never returns early on its own.
pub fn run(workload: &[OsString], lease_dir: Option<PathBuf>, agent_fd: Option<i32>) -> ExitCode {
    // Stopping "every other process" outside a pid namespace of its own
    // would stop the host's: the watch runs only as PID 1.
    if lease_dir.is_some() && rustix::process::getpid() != Pid::INIT {
        eprintln!("{STATUS_PREFIX} {LEASE_FLAG} is only for PID 1 of a sandbox");
        return ExitCode::from(126);
    }
    // The sandbox's processes may not open the init's descriptors (its
    // stdout and stderr are files on the host: see the module docs).
    // Commands the agent starts are dumpable again once they exec.
    if rustix::process::getpid() == Pid::INIT
        && let Err(e) =
            rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        eprintln!("{STATUS_PREFIX} cannot close /proc/1/fd to the sandbox: {e}");
        return ExitCode::from(126);
    }
    let listener = match agent_fd.map(adopt_listener).transpose() {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("{STATUS_PREFIX} {AGENT_FD_FLAG}: {e}");
            return ExitCode::from(126);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("{STATUS_PREFIX} cannot start: {e}");
            return ExitCode::from(126);
        }
    };
    let agent = listener.map(|listener| {
        let agent = Agent::new();
        runtime.spawn(agent.clone().serve(listener));
        agent
    });
    let code = runtime.block_on(supervise(
        workload,
        lease_dir.map(LeaseWatch::new),
        agent.as_deref(),
    ));
    ExitCode::from(u8::try_from(code & 0xff).unwrap_or(1))
}

/// The most of the workload's output the init keeps in its stderr file:
/// past it, all but the last [`WORKLOAD_LOG_KEEP_BYTES`] is punched out
/// (the file keeps its length, its start reads as zeros and takes no
/// disk; `host::read_lossy` reads only a file's end).
pub const WORKLOAD_LOG_BYTES_MAX: u64 = 8 << 20;
/// What stays when the log is trimmed: the latest output, which is what
/// explains how a workload ended.
pub const WORKLOAD_LOG_KEEP_BYTES: u64 = 1 << 20;
/// How much output passes between two looks at the log's size.
const WORKLOAD_LOG_CHECK_BYTES: u64 = 256 << 10;
/// The log's length (holes included) past which it starts again from
/// nothing: punched holes keep a file's length, and a filesystem's
/// largest file (16 TiB on ext4) would end the log after hours of output.
const WORKLOAD_LOG_LENGTH_MAX: u64 = 1 << 40;
/// The longest the init's end waits for the copying thread's turn.
const DRAIN_WAIT: Duration = Duration::from_secs(1);

/// The workload's output on its way to the init's stderr: the pipe's
/// reading end (non-blocking) and the lock held while a part read from
/// it is written, so that what is read is written whole and in order
/// whichever thread copies it.
struct WorkloadOutput {
    pipe: std::io::PipeReader,
    copying: std::sync::Mutex<()>,
}

/// Starts the workload with its stdout and stderr on one pipe, which a
/// thread of the init copies to the init's stderr within
/// [`WORKLOAD_LOG_BYTES_MAX`].
fn spawn_workload(
    program: &OsString,
    args: &[OsString],
) -> std::io::Result<(std::process::Child, std::sync::Arc<WorkloadOutput>)> {
    let (reader, writer) = std::io::pipe()?;
    rustix::io::ioctl_fionbio(&reader, true)?;
    let output = std::sync::Arc::new(WorkloadOutput {
        pipe: reader,
        copying: std::sync::Mutex::new(()),
    });
    // The thread first: a workload never runs without its output copied.
    // Should the workload not start, the thread sees the pipe closed (the
    // writers dropped with the command) and ends.
    let forwarding = output.clone();
    std::thread::Builder::new()
        .name("workload-output".to_owned())
        .spawn(move || forwarding.forward())?;
    let child = std::process::Command::new(program)
        .args(args)
        .stdout(writer.try_clone()?)
        .stderr(writer)
        .spawn()?;
    Ok((child, output))
}

impl WorkloadOutput {
    /// Copies the output to the init's stderr until every writer has
    /// closed the pipe.
    fn forward(&self) {
        use rustix::event::{PollFd, PollFlags};
        let mut buffer = vec![0u8; 64 << 10];
        let mut since_check = 0u64;
        loop {
            let mut ready = [PollFd::new(&self.pipe, PollFlags::IN)];
            match rustix::event::poll(&mut ready, None) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => return,
            }
            // One buffer's worth per turn: a writer that never pauses (a
            // workload's background `yes`) must not keep the lock from
            // `drain`, which the init's end waits on.
            let open = {
                let _copying = self.copying.lock().unwrap_or_else(|e| e.into_inner());
                let turn = buffer.len() as u64;
                let (open, copied) = self.copy(&mut buffer, turn);
                since_check += copied;
                // Under the lock, as `drain`'s: two trims at once could
                // punch out what the other's truncation let in.
                if since_check >= WORKLOAD_LOG_CHECK_BYTES {
                    since_check = 0;
                    trim_log(&std::io::stderr());
                }
                open
            };
            if !open {
                return;
            }
        }
    }

    /// Writes what the pipe holds now to the log, once the workload has
    /// ended and before the init reports it: its last words are not lost
    /// when the init exits before its copying thread has caught up. Runs
    /// on the init's one thread (which also serves the agent and watches
    /// the lease), so it waits for the copying thread's turn at most
    /// [`DRAIN_WAIT`] and copies at most what the pipe holds.
    fn drain(&self) {
        let started = std::time::Instant::now();
        let _copying = loop {
            match self.copying.try_lock() {
                Ok(guard) => break guard,
                Err(std::sync::TryLockError::Poisoned(poisoned)) => break poisoned.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) if started.elapsed() < DRAIN_WAIT => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(std::sync::TryLockError::WouldBlock) => return,
            }
        };
        let held = rustix::io::ioctl_fionread(&self.pipe).unwrap_or(0);
        self.copy(&mut vec![0u8; 64 << 10], held);
        trim_log(&std::io::stderr());
    }

    /// Copies at most `most` bytes that can be read without waiting to the
    /// init's stderr. A write that fails (the host's disk full) drops that
    /// output: the workload is never held up by the host's log. Returns
    /// whether the pipe is still open and what was copied.
    fn copy(&self, buffer: &mut [u8], most: u64) -> (bool, u64) {
        use std::io::Read;
        let mut copied = 0u64;
        while copied < most {
            let want = usize::try_from(most - copied).map_or(buffer.len(), |m| m.min(buffer.len()));
            match (&self.pipe).read(&mut buffer[..want]) {
                Ok(0) => return (false, copied),
                Ok(read) => {
                    let _ = std::io::stderr().lock().write_all(&buffer[..read]);
                    copied += read as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return (true, copied),
                Err(_) => return (false, copied),
            }
        }
        (true, copied)
    }
}

/// Punches out all but the last [`WORKLOAD_LOG_KEEP_BYTES`] of the file
/// `log` is, once it takes more than [`WORKLOAD_LOG_BYTES_MAX`] of disk.
/// Not a file (a pipe, a terminal): nothing to do.
fn trim_log(log: &impl std::os::fd::AsFd) {
    use rustix::fs::{FallocateFlags, FileType};
    let Ok(stat) = rustix::fs::fstat(log) else {
        return;
    };
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
        return;
    }
    let length = u64::try_from(stat.st_size).unwrap_or(0);
    if length > WORKLOAD_LOG_LENGTH_MAX {
        // Appended writes go on from the new end, nothing.
        let _ = rustix::fs::ftruncate(log, 0);
        return;
    }
    let on_disk = u64::try_from(stat.st_blocks).unwrap_or(0) * 512;
    if on_disk <= WORKLOAD_LOG_BYTES_MAX {
        return;
    }
    let end = length.saturating_sub(WORKLOAD_LOG_KEEP_BYTES) & !4095;
    let _ = rustix::fs::fallocate(
        log,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        0,
        end,
    );
}

/// The listening socket the runtime passed as `fd`, made close-on-exec so
/// that no command inherits it (a command holding it could accept the
/// runner's connections in the agent's place).
fn adopt_listener(fd: i32) -> std::io::Result<std::os::unix::net::UnixListener> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: the runtime hands this descriptor to the init and nothing
    // else in this process owns it.
    #[allow(unsafe_code)]
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC)?;
    let kind = rustix::fs::fstat(&owned)?;
    if rustix::fs::FileType::from_raw_mode(kind.st_mode) != rustix::fs::FileType::Socket {
        return Err(std::io::Error::other(format!(
            "descriptor {fd} is not a socket"
        )));
    }
    Ok(std::os::unix::net::UnixListener::from(owned))
}

const FORWARDED: [(SignalKind, Signal); 6] = [
    (SignalKind::terminate(), Signal::TERM),
    (SignalKind::interrupt(), Signal::INT),
    (SignalKind::hangup(), Signal::HUP),
    (SignalKind::quit(), Signal::QUIT),
    (SignalKind::user_defined1(), Signal::USR1),
    (SignalKind::user_defined2(), Signal::USR2),
];

async fn supervise(
    workload: &[OsString],
    mut lease: Option<LeaseWatch>,
    agent: Option<&Agent>,
) -> i32 {
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

    let mut output = None;
    let child = match workload.split_first() {
        None => None,
        Some((program, args)) => match spawn_workload(program, args) {
            // Reaped below through waitpid(-1) like every other child; the
            // `Child` handle is not needed to wait.
            Ok((child, copying)) => {
                output = Some(copying);
                Some(Pid::from_child(&child))
            }
            Err(e) => {
                eprintln!("{STATUS_PREFIX} cannot start the workload {program:?}: {e}");
                let end = InitEnd::WorkloadExited { code: 127 };
                report(end);
                return end.exit_code();
            }
        },
    };

    // Checked at once: a sandbox started after its deadline (its runner
    // froze meanwhile) must not run a moment.
    let mut lease_check = tokio::time::Instant::now();
    loop {
        if let Some(end) = reap(child, agent) {
            if let Some(output) = &output {
                output.drain();
            }
            report(end);
            return end.exit_code();
        }
        let lease_due = async {
            match lease {
                Some(_) => tokio::time::sleep_until(lease_check).await,
                None => std::future::pending().await,
            }
        };
        let received = tokio::select! {
            _ = children.recv() => None,
            number = std::future::poll_fn(|cx| poll_any(&mut forwarded, cx)) => Some(number),
            () = lease_due => {
                if let Some(watch) = lease.as_mut() {
                    let recheck_ms = watch.check().await;
                    lease_check = tokio::time::Instant::now() + Duration::from_millis(recheck_ms);
                }
                None
            }
        };
        let Some(number) = received else { continue };
        match child {
            Some(pid) => {
                // The workload may have just ended; the reap above or the
                // next SIGCHLD settles it.
                let _ = rustix::process::kill_process(pid, number);
            }
            None if number == Signal::TERM || number == Signal::INT => {
                reap(None, agent);
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

/// The lease watch's state: whether it froze, and whom it stopped.
struct LeaseWatch {
    dir: PathBuf,
    frozen: bool,
    /// Processes this watch stopped (and only those): continued at the thaw.
    stopped: BTreeSet<i32>,
}

/// Sweeps one freeze makes at most before it waits for the next check:
/// a process in uninterruptible sleep stops only when its call returns.
const SWEEPS_MAX: u32 = 20;

impl LeaseWatch {
    fn new(dir: PathBuf) -> LeaseWatch {
        LeaseWatch {
            dir,
            frozen: false,
            stopped: BTreeSet::new(),
        }
    }

    /// Reads the deadline and acts as [`lease::decide`] says; returns when
    /// to look again, in ms.
    async fn check(&mut self) -> u64 {
        let deadline = lease::read_deadline(&self.dir);
        let step = lease::decide(self.frozen, deadline.clone(), lease::boottime_ms());
        match step {
            Move::Run { .. } => {}
            Move::Freeze => {
                let first = !self.frozen;
                self.frozen = true;
                let before = self.stopped.len();
                let running = self.stop_all().await;
                let stopped = self.stopped.len() - before;
                if first {
                    let why = match &deadline {
                        Ok(_) => "lease lapsed".to_owned(),
                        Err(err) => format!("lease unreadable ({err})"),
                    };
                    eprintln!(
                        "{STATUS_PREFIX} {why}: stopped {stopped} processes frozen_at_unix_ms={}",
                        unix_ms()
                    );
                } else if stopped > 0 {
                    eprintln!("{STATUS_PREFIX} stopped {stopped} more processes while frozen");
                }
                if running > 0 {
                    eprintln!(
                        "{STATUS_PREFIX} {running} processes not stopped yet (in an uninterruptible call?); trying again"
                    );
                }
            }
            Move::Thaw => {
                let continued = self.stopped.len();
                for pid in std::mem::take(&mut self.stopped) {
                    if let Some(pid) = Pid::from_raw(pid) {
                        // Gone meanwhile (killed): nothing to continue.
                        let _ = rustix::process::kill_process(pid, Signal::CONT);
                    }
                }
                self.frozen = false;
                eprintln!("{STATUS_PREFIX} lease renewed: continued {continued} processes");
            }
        }
        lease::recheck_ms(step)
    }

    /// Stops every process of the namespace but the init, sweeping until
    /// a sweep finds every one stopped (a process may fork, or another may
    /// continue it, until it is stopped itself); returns how many still
    /// run after [`SWEEPS_MAX`] sweeps.
    async fn stop_all(&mut self) -> usize {
        let mut running = 0;
        for _ in 0..SWEEPS_MAX {
            running = 0;
            for pid in other_processes() {
                if process_stopped(pid) {
                    continue;
                }
                running += 1;
                let Some(target) = Pid::from_raw(pid) else {
                    continue;
                };
                if rustix::process::kill_process(target, Signal::STOP).is_ok() {
                    self.stopped.insert(pid);
                }
            }
            if running == 0 {
                break;
            }
            // Let the signals land before looking again.
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        running
    }
}

/// Every process of the namespace but this one, from `/proc`.
fn other_processes() -> Vec<i32> {
    let own = rustix::process::getpid().as_raw_nonzero().get();
    let Ok(listing) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    listing
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != own)
        .collect()
}

/// Whether every thread of `pid` is stopped, traced or dead (or the
/// process is gone): nothing of it runs.
fn process_stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|task| {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            return true;
        };
        // `PID (COMM) STATE …`: COMM may hold anything, ')' included.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        matches!(state, Some('T' | 't' | 'Z' | 'X') | None)
    })
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Reaps every child that has ended (handing commands' ends to the
/// agent); returns how the workload ended if it was among them.
fn reap(workload: Option<Pid>, agent: Option<&Agent>) -> Option<InitEnd> {
    let mut end = None;
    loop {
        match rustix::process::wait(WaitOptions::NOHANG) {
            Ok(Some((pid, status))) => {
                if let Some(agent) = agent {
                    agent.reaped(pid, status);
                }
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
    fn a_log_past_its_bound_keeps_its_tail_and_one_past_its_length_starts_again() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("init.log");
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("open");
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..12 {
            log.write_all(&chunk).expect("write");
        }
        log.write_all(b"the last line\n").expect("write");
        log.sync_all().expect("sync");
        trim_log(&log);
        let metadata = std::fs::metadata(&path).expect("stat");
        assert_eq!(metadata.len(), (12 << 20) + 14, "the length stays");
        assert!(
            metadata.blocks() * 512 <= WORKLOAD_LOG_KEEP_BYTES + (64 << 10),
            "{} bytes kept",
            metadata.blocks() * 512
        );
        assert!(crate::host::read_lossy(&path).ends_with("xxthe last line\n"));

        // Holes keep a file's length: past the longest it may grow, it
        // starts again, and what comes after lands at its start.
        log.set_len(WORKLOAD_LOG_LENGTH_MAX + 1)
            .expect("a long sparse log");
        trim_log(&log);
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), 0);
        log.write_all(b"after\n").expect("write");
        assert_eq!(std::fs::read(&path).expect("read"), b"after\n");
    }

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
        // A signal out of range is no status line (128 + it would wrap).
        for forged in [
            "roost-init: workload killed signal=2147483647",
            "roost-init: workload killed signal=0",
            "roost-init: stopped signal=-9",
        ] {
            assert_eq!(InitEnd::parse_last(forged), None, "{forged}");
        }
        assert_eq!(InitEnd::WorkloadKilled { signal: 15 }.exit_code(), 143);
        assert!(InitEnd::WorkloadExited { code: 137 }.looks_killed());
        assert!(!InitEnd::Stopped { signal: 15 }.looks_killed());
    }
}
