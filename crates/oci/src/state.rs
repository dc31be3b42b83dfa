//! What the runtime reports about a container and what the driver makes
//! of it: [`Status`] (the runtime's own word), [`RuntimeState`],
//! [`Observation`] and, for a dead sandbox, its [`DeathCause`]; the cgroup
//! counters read beside them. Plain data: the driver ([`crate::runtime`])
//! fills it in, [`crate::error`] names a [`Status`] in its messages.

use std::fmt;

use crate::init::InitEnd;

/// A container's status as the runtime reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Creating,
    Created,
    Running,
    Paused,
    Stopped,
}

impl Status {
    pub(crate) fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "creating" => Status::Creating,
            "created" => Status::Created,
            "running" => Status::Running,
            "paused" => Status::Paused,
            "stopped" => Status::Stopped,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Status::Creating => "creating",
            Status::Created => "created",
            Status::Running => "running",
            Status::Paused => "paused",
            Status::Stopped => "stopped",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The runtime's `state` of a container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeState {
    pub status: Status,
    /// The init's pid on the host, while it has one.
    pub init_pid: Option<i32>,
}

/// Why a sandbox's init is gone: the `state_reason` it is reported with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeathCause {
    /// The memory cgroup recorded an OOM kill since the sandbox was last
    /// seen alive, and the init's end looks like that kill (SIGKILL, or no
    /// word at all because the init itself was the victim).
    OomKilled,
    /// Anything else: the workload ended, the init was stopped, or the init
    /// was killed from outside (then `end` is `None`: it could say nothing,
    /// and no exit code is knowable).
    WorkloadExited { end: Option<InitEnd> },
}

impl DeathCause {
    /// The stable `state_reason` code (DESIGN.md §2).
    pub fn reason(self) -> &'static str {
        match self {
            DeathCause::OomKilled => "oom_killed",
            DeathCause::WorkloadExited { .. } => "workload_exited",
        }
    }

    /// The workload's (or the init's) exit code, where knowable.
    pub fn exit_code(self) -> Option<i32> {
        match self {
            DeathCause::OomKilled => Some(137),
            DeathCause::WorkloadExited { end } => end.map(InitEnd::exit_code),
        }
    }
}

/// What [`crate::Sandbox::observe`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observation {
    /// The runtime has no such container (never created, or deleted).
    Missing,
    /// Created (or being created), not started.
    Created {
        init_pid: Option<i32>,
    },
    Running {
        init_pid: i32,
    },
    Paused {
        init_pid: i32,
    },
    /// The init is gone; the container (and its cgroup) remain until delete.
    Stopped(DeathCause),
}

/// Cgroup counters of a sandbox; `None` where the cgroup or file is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupCounters {
    pub oom_kills: Option<u64>,
    pub pids_current: Option<u64>,
}
