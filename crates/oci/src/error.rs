//! The runner's OCI-layer error type. Variants are what a caller acts on;
//! messages name the sandbox, the runtime operation and, when the runtime
//! failed, what the runtime itself said, in lowercase, on one line.

use std::path::PathBuf;

use crate::state::Status;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The chosen runtime binary is not installed (not on `PATH`).
    #[error("OCI runtime {name} not found on PATH ({path}): install it or choose another runtime")]
    RuntimeNotFound { name: &'static str, path: String },

    /// `auto` found neither runtime.
    #[error("no OCI runtime found on PATH ({path}): install runc or crun")]
    NoRuntime { path: String },

    /// The settings ask for something this layer refuses (fail closed: never
    /// weakened into something else).
    #[error("unsupported sandbox setting: {0}")]
    Unsupported(String),

    /// The settings are malformed (bad id, env name, limit, path).
    #[error("invalid sandbox setting: {0}")]
    Invalid(String),

    /// What the sandbox is to hold cannot be had as stored: a home or image
    /// with a missing or corrupt object, or one past the store's bounds.
    /// Permanent; the message names the object or path (not a setting).
    #[error("{0}")]
    Unusable(String),

    /// A shared filesystem's directory a sandbox mounts is not there (or
    /// not a directory) on this host. Permanent; nothing is created.
    #[error("{0}")]
    MountSourceMissing(String),

    /// The runtime ran and reported failure.
    #[error("{runtime} {op} failed for sandbox {id}{}: {message}", status_suffix(.status))]
    Runtime {
        runtime: &'static str,
        op: &'static str,
        id: String,
        status: Option<i32>,
        message: String,
    },

    /// The runtime could not even be started.
    #[error("could not run {runtime} {op} for sandbox {id}: {source}")]
    Spawn {
        runtime: &'static str,
        op: &'static str,
        id: String,
        #[source]
        source: std::io::Error,
    },

    /// The runtime's answer could not be understood.
    #[error("unexpected output from {runtime} {op} for sandbox {id}: {message}")]
    Protocol {
        runtime: &'static str,
        op: &'static str,
        id: String,
        message: String,
    },

    /// The runtime has no container by this id.
    #[error("sandbox {id} does not exist in the runtime")]
    NotFound { id: String },

    /// Create found the runtime already holding a container by this id.
    #[error("sandbox {id} already exists in the runtime: delete it before creating it again")]
    AlreadyExists { id: String },

    /// An operation that needs a running sandbox (exec) found it otherwise;
    /// a command refused this way was never launched.
    #[error("sandbox {id} is {status}, not running: {op} refused")]
    NotRunning {
        id: String,
        status: Status,
        op: &'static str,
    },

    /// Building the OCI configuration failed.
    #[error("could not build the OCI config for sandbox {id}: {message}")]
    Spec { id: String, message: String },

    /// A host networking command (`ip`, `iptables`) failed or could not be
    /// started; `message` is what it said on stderr.
    #[error("could not {action}: `{command}` failed{}: {message}", status_suffix(.status))]
    Network {
        action: String,
        command: String,
        status: Option<i32>,
        message: String,
    },

    /// Every address of the bridge's subnet is leased.
    #[error(
        "no free address in the bridge subnet {subnet} ({leases} leased): delete sandboxes or configure a larger subnet"
    )]
    AddressesExhausted { subnet: String, leases: usize },

    /// The sandbox's agent refused a request (`code` is its stable code,
    /// see [`crate::agent`]) or could not be reached (`unreachable`).
    #[error("the agent of sandbox {id} refused: {code}: {message}")]
    Agent {
        id: String,
        code: String,
        message: String,
    },

    /// A host file operation failed.
    #[error("could not {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn status_suffix(status: &Option<i32>) -> String {
    match status {
        Some(code) => format!(" (exit status {code})"),
        None => String::new(),
    }
}

impl Error {
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// Whether retrying the same request cannot help: the settings or the
    /// host are wrong, not the moment.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Error::RuntimeNotFound { .. }
                | Error::NoRuntime { .. }
                | Error::Unsupported(_)
                | Error::Invalid(_)
                | Error::Unusable(_)
                | Error::MountSourceMissing(_)
                | Error::Spec { .. }
        )
    }
}
