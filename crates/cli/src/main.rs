//! The `roost` binary: parses the command line and hands each subcommand
//! to its module. No logic lives here.

mod backup;
mod control;
mod credentials;
mod exec;
mod files;
mod home;
mod image;
mod info;
mod output;
mod runner;
mod sandbox;
mod secret;
mod snapshot;
mod store_admin;
mod terminal;
mod up;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "roost",
    version,
    about = "Sandboxes for AI coding agents whose homes persist"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Save a home directory to a store, or materialise it from one.
    #[command(subcommand)]
    Home(home::HomeCommand),
    /// Maintain a store: garbage-collect, verify, report usage.
    #[command(subcommand)]
    Store(store_admin::StoreCommand),
    /// Run the control plane.
    Server(control::ServerArgs),
    /// Administer a running control plane (organisations, runner tokens,
    /// quarantine).
    #[command(subcommand)]
    Admin(control::AdminCommand),
    /// Create, inspect, list, stop, start and delete sandboxes (org token).
    #[command(subcommand)]
    Sandbox(sandbox::SandboxCommand),
    /// Snapshot sandboxes' homes into the store; list and delete
    /// snapshots (org token).
    #[command(subcommand)]
    Snapshot(snapshot::SnapshotCommand),
    /// Import root filesystems as images into the org's store; list,
    /// show and delete them (org token).
    #[command(subcommand)]
    Image(image::ImageCommand),
    /// Set, list and delete the org's secrets, delivered into sandboxes
    /// that ask for them (org token; values never printed).
    #[command(subcommand)]
    Secret(secret::SecretCommand),
    /// Run a command in a sandbox, streaming its output; exits with its
    /// exit code.
    Exec(exec::ExecArgs),
    /// An interactive shell (or ARGV) on a terminal in a sandbox.
    Shell(terminal::ShellArgs),
    /// Inspect, read and signal the commands run in a sandbox.
    #[command(subcommand, name = "command")]
    Cmd(exec::CommandCommand),
    /// Move files into and out of a running sandbox, list, remove, rename
    /// and make them (its own agent does it, inside the sandbox).
    #[command(subcommand)]
    Files(files::FilesCommand),
    /// Run the agent on a host: register with the control plane and run
    /// the sandboxes it places here.
    Runner(runner::RunnerArgs),
    /// What the deployment promises (save interval, leases, where the
    /// store lives), what a host failure can cost, and what it observed
    /// (any token).
    Info(info::InfoArgs),
    /// Run everything on this machine in one process: the control plane,
    /// one runner and a local home store; saves the URL and an org token
    /// for the CLI.
    Up(up::UpArgs),
    /// Remove everything `roost up` made with a data dir: its sandboxes
    /// (killed), their mounts and namespaces, every home and saved home,
    /// the database. Asks for --yes.
    Purge(up::PurgeArgs),
}

/// Allocations of 4 MiB and more (read buffers, packs and batches of a
/// push or pull, block service bodies) get a mapping of their own, which
/// is returned to the kernel when freed. glibc's default threshold starts
/// lower but rises to the largest such buffer freed, after which every
/// 8–16 MiB pack is carved from the heap, where the small per-file
/// allocations around it keep the memory from going back: a push of a
/// 100k-file home peaked at 167 MiB instead of 133 MiB (issue 18).
///
/// Small allocations share at most two arenas: a push's scan makes
/// millions on its worker threads and frees most of them between ones it
/// keeps, and each thread's own arena kept its freed memory resident
/// through the upload (glibc returns only an arena's top): two arenas
/// took the first S3 push of a 100k-file home from 130 to 125 MiB.
///
/// Not for the long-running parts: they reuse buffers of those sizes for
/// request after request, and a mapping of their own is a fresh zeroed
/// one every time (during a fresh runner's wake, page faults and page
/// clearing took 45% of the server's CPU and 12% of the runner's); and
/// their many request threads would contend for two arenas.
fn map_large_buffers_apart() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: `mallopt` only sets allocator parameters; called once,
    // before this process starts any thread of its own.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// The soft limit on open files raised to the hard one: a server or a
/// runner holds a descriptor per connection, stream and sandbox agent,
/// and the usual soft limit of 1,024 would refuse new work long before
/// its own bounds do (a runner serves 256 data requests at once, each with
/// a connection to a sandbox's agent). Best effort: a limit that cannot be
/// raised stays as it was.
fn raise_open_files_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum || (limit.current.is_some() && limit.maximum.is_none()) {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: limit.maximum,
                maximum: limit.maximum,
            },
        );
    }
}

/// The server, a runner or `up`: a process that serves for long.
fn long_running() -> bool {
    matches!(
        std::env::args().nth(1).as_deref(),
        Some("server" | "runner" | "up")
    )
}

/// Long-running parts log their decisions; other commands only warn.
fn default_log_filter() -> &'static str {
    if long_running() { "info" } else { "warn" }
}

fn main() -> std::process::ExitCode {
    // `roost init` is PID 1 inside every sandbox (hidden): it runs before
    // anything else, with no logging and no argument parsing of ours.
    let mut args = std::env::args_os().skip(1);
    if args.next().is_some_and(|first| first == "init") {
        return runner::run_init(args);
    }
    if long_running() {
        raise_open_files_limit();
    } else {
        map_large_buffers_apart();
    }
    // Logs go to stderr: key=value text by default, one JSON object per
    // line with ROOST_LOG_FORMAT=json (for log pipelines). ROOST_LOG sets
    // the filter (default `warn`; `roost server` raises it to `info`).
    let filter = tracing_subscriber::EnvFilter::try_from_env("ROOST_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_log_filter()));
    // Colour only on a terminal: a log file or a pipe gets plain text.
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(filter);
    if std::env::var("ROOST_LOG_FORMAT").is_ok_and(|f| f == "json") {
        logs.json().init();
    } else {
        logs.init();
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Home(command) => home::run(command),
        Command::Store(command) => store_admin::run(command),
        Command::Server(args) => control::run_server(args),
        Command::Admin(command) => control::run_admin(command),
        Command::Sandbox(command) => sandbox::run(command),
        Command::Image(command) => image::run(command),
        Command::Secret(command) => secret::run(command),
        Command::Snapshot(command) => snapshot::run(command),
        Command::Exec(args) => exec::run_exec(args),
        Command::Cmd(command) => exec::run_command(command),
        Command::Shell(args) => terminal::run_shell(args),
        Command::Files(command) => files::run(command),
        Command::Runner(args) => runner::run(args),
        Command::Up(args) => up::run(args),
        Command::Purge(args) => up::purge(args),
        Command::Info(args) => info::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            // One line naming the problem: the outermost context and its cause.
            let mut message = err.to_string();
            if let Some(cause) = err.chain().nth(1) {
                message = format!("{message}: {cause}");
            }
            if unreachable(&err) {
                message.push_str("; is the server running (roost up)?");
            }
            eprintln!("roost: error: {}", message.replace('\n', " "));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The server could not be reached at all (nothing listening, no route).
fn unreachable(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<api::client::ClientError>(),
            Some(api::client::ClientError::Unreachable { .. })
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every command, with its path (`roost sandbox create`).
    fn every_command() -> Vec<(String, clap::Command)> {
        let mut all = Vec::new();
        let mut pending = vec![("roost".to_owned(), Cli::command())];
        while let Some((path, command)) = pending.pop() {
            for sub in command.get_subcommands() {
                pending.push((format!("{path} {}", sub.get_name()), sub.clone()));
            }
            all.push((path, command));
        }
        all
    }

    /// Every command a script may call answers in JSON with `--json`; the
    /// exceptions serve for as long as they run (`server`, `runner`) or
    /// belong to a terminal (`shell`), and do not offer a `--json` they
    /// would ignore.
    #[test]
    fn every_command_takes_json() {
        const NO_JSON: &[&str] = &["roost server", "roost runner", "roost shell"];
        let mut missing = Vec::new();
        let mut ignored = Vec::new();
        for (path, command) in every_command() {
            if command.has_subcommands() {
                continue;
            }
            let json = command.get_arguments().any(|arg| arg.get_id() == "json");
            match (json, NO_JSON.contains(&path.as_str())) {
                (false, false) => missing.push(path),
                (true, true) => ignored.push(path),
                _ => {}
            }
        }
        assert!(missing.is_empty(), "no --json on: {missing:?}");
        assert!(
            ignored.is_empty(),
            "--json offered but ignored on: {ignored:?}"
        );
    }

    /// `--help` says what every argument and option is.
    #[test]
    fn every_argument_has_a_description() {
        let mut missing = Vec::new();
        for (path, command) in every_command() {
            for arg in command.get_arguments() {
                let id = arg.get_id().as_str();
                if id != "help" && id != "version" && arg.get_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
        }
        assert!(missing.is_empty(), "no description: {missing:?}");
    }

    /// A listen address may name its host (`localhost:PORT`).
    #[test]
    fn listen_addresses_take_a_host_name() {
        for args in [
            ["roost", "server", "--listen", "localhost:7070"],
            ["roost", "up", "--listen", "localhost:0"],
            ["roost", "server", "--listen", "127.0.0.1:7070"],
        ] {
            if let Err(err) = Cli::try_parse_from(args) {
                panic!("{args:?}: {err}");
            }
        }
        let Err(err) = Cli::try_parse_from(["roost", "server", "--listen", "7070"]) else {
            panic!("a bare port parsed");
        };
        assert!(err.to_string().contains("HOST:PORT"), "{err}");
    }

    /// Every timeout and duration flag takes seconds or a unit alike.
    #[test]
    fn durations_are_seconds_or_carry_a_unit_everywhere() {
        for args in [
            "sandbox get s --wait-for running --timeout V",
            "sandbox wait s running --timeout V",
            "command get s c --wait-for ended --timeout V",
            "exec s --timeout V -- true",
            "snapshot create s --deadline V",
            "sandbox create --ttl V",
            "store gc --store s --grace V",
        ] {
            for value in ["5", "30s", "5m"] {
                let argv = args.split(' ').map(|a| if a == "V" { value } else { a });
                if let Err(err) = Cli::try_parse_from(std::iter::once("roost").chain(argv)) {
                    panic!("{args} ({value}): {err}");
                }
            }
        }
        let Err(err) = Cli::try_parse_from(["roost", "sandbox", "create", "--ttl", "forever"])
        else {
            panic!("--ttl forever parsed");
        };
        assert!(err.to_string().contains("30s"), "{err}");
    }
}
