//! The lifecycle vocabulary (DESIGN.md §2 and §4): sandbox and command
//! states, what a request may ask for, and the rules every crate used to
//! re-derive from strings. Adding a state is one variant here plus the
//! places the compiler then names.
//!
//! Every enum is serialized in snake_case, so the wire is exactly the
//! strings it replaced; `as_str` gives the same text for SQL and logs.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Declares a wire enum: its variants with their snake_case names, `ALL`,
/// `as_str`, `Display` and `FromStr` (the error names the allowed values).
macro_rules! wire_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, ToSchema)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The wire (and database) spelling.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }

            /// The allowed spellings, for error messages.
            pub fn allowed() -> String {
                Self::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>().join(", ")
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownValue;

            fn from_str(text: &str) -> Result<Self, UnknownValue> {
                match text {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownValue {
                        kind: stringify!($name),
                        value: text.to_owned(),
                        allowed: Self::allowed(),
                    }),
                }
            }
        }
    };
}

/// A string that is none of an enum's spellings.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {value:?} (one of {allowed})")]
pub struct UnknownValue {
    pub kind: &'static str,
    pub value: String,
    pub allowed: String,
}

wire_enum! {
    /// What the runtime was observed doing (DESIGN.md §2), never what a
    /// request intended.
    SandboxState {
        /// Admitted, not yet placed (e.g. waiting for capacity).
        Pending = "pending",
        /// Placed: home and image being materialised, container starting.
        Starting = "starting",
        /// The workload's init is observed alive.
        Running = "running",
        /// The workload is being stopped.
        Stopping = "stopping",
        /// Compute down, the home being written to the store.
        Securing = "securing",
        /// No compute; the home is in the store or on its runner.
        Stopped = "stopped",
        /// A durable sandbox whose host was lost, being re-placed.
        Recovering = "recovering",
        /// Terminal: `state_reason` says why.
        Failed = "failed",
        /// Terminal: ended on purpose by the platform (TTL).
        Terminated = "terminated",
        /// Delete accepted, resources being released.
        Deleting = "deleting",
        /// Resources released.
        Deleted = "deleted",
    }
}

impl SandboxState {
    /// The `state_reason` a record carries when whatever moved it there
    /// named none: the state's ordinary cause, so every state has a
    /// stable reason (a runner reports `running` without one, for
    /// example). Failures and terminations always name their own;
    /// `unknown` stands for a cause nobody reported.
    pub const fn usual_reason(self) -> &'static str {
        match self {
            SandboxState::Pending => "awaiting_placement",
            SandboxState::Starting => "placed",
            SandboxState::Running => "workload_started",
            SandboxState::Stopping => "stop_requested",
            SandboxState::Securing => "securing_home",
            SandboxState::Stopped => "home_secured",
            SandboxState::Recovering => "node_lost",
            SandboxState::Deleting => "delete_requested",
            SandboxState::Deleted => "deleted",
            SandboxState::Failed | SandboxState::Terminated => "unknown",
        }
    }

    /// The runtime is gone for good: nothing but a delete follows.
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            SandboxState::Failed | SandboxState::Terminated | SandboxState::Deleted
        )
    }

    /// Holds compute on its runner: counts against the runner's capacity.
    /// `securing` does not: its workload is down, only the upload runs.
    pub const fn holds_compute(self) -> bool {
        matches!(
            self,
            SandboxState::Starting | SandboxState::Running | SandboxState::Stopping
        )
    }

    /// Its runner is at work on it: compute, or the upload of its home
    /// (`securing`). The platform must not end such a sandbox over the
    /// runner's head (a TTL waits for the runner's report); capacity, on
    /// the other hand, counts only [`holds_compute`](Self::holds_compute).
    pub const fn runner_at_work(self) -> bool {
        self.holds_compute() || matches!(self, SandboxState::Securing)
    }

    /// Counts against the `sandboxes.running` quota (with desired
    /// `running`): holds compute or waits for it.
    pub const fn counts_as_running(self) -> bool {
        self.holds_compute() || matches!(self, SandboxState::Pending | SandboxState::Recovering)
    }

    /// Waits to be placed on a runner by the scheduler.
    pub const fn awaits_placement(self) -> bool {
        matches!(self, SandboxState::Pending | SandboxState::Recovering)
    }

    /// Still counts against `sandboxes.total` (with desired other than
    /// `deleted`): not yet being released.
    pub const fn is_held(self) -> bool {
        !matches!(self, SandboxState::Deleting | SandboxState::Deleted)
    }

    /// The transition table of a runner's reports: whether a runner holding
    /// the sandbox (recorded in `self`, wanted `desired`) may move it to
    /// `to`. The control plane itself moves a sandbox to `pending`,
    /// `starting`, `recovering` and `deleting`; a runner reports only what
    /// its runtime did. Reporting the recorded state again is not a
    /// transition (the caller skips it).
    pub fn runner_may_report(self, to: SandboxState, desired: DesiredState) -> bool {
        use SandboxState::*;
        if to == Deleted {
            // Releasing what the runner holds happens only on request, and
            // from any state that may still hold something.
            return desired == DesiredState::Deleted && self != Deleted;
        }
        match self {
            // Compute was placed or is running: the runtime may run, die,
            // stop (through `stopping`, `securing` for a durable home) or
            // end by TTL.
            Starting | Running => {
                matches!(
                    to,
                    Running | Failed | Stopping | Securing | Stopped | Terminated
                )
            }
            // Started again while stopping: it runs (again); or the stop
            // finishes.
            Stopping => matches!(to, Running | Failed | Securing | Stopped | Terminated),
            // The home goes up; a container found running is stopped first.
            Securing => matches!(to, Stopping | Failed | Stopped | Terminated),
            // A standard sandbox waiting to be placed again on the runner
            // that holds its home, or a stopped one: a stop or TTL of what
            // that runner still has.
            Pending | Stopped => matches!(to, Stopping | Securing | Stopped | Terminated),
            // Fenced off every runner (its epoch was bumped): nothing a
            // runner says applies; being released: only `deleted`.
            Recovering | Deleting => false,
            Failed | Terminated | Deleted => false,
        }
    }

    /// Whether a runner may report the recorded state again with `reason`,
    /// changing only the record's reason and message: a placed sandbox
    /// still `starting` because what its launch needs is out of reach for
    /// now ([`STARTING_WAIT_REASONS`]); the runner tries again by itself,
    /// so this is a wait, not a failure. Any other repeat of the recorded
    /// state is no change (the caller skips it).
    pub fn runner_may_restate(self, reason: &str) -> bool {
        self == SandboxState::Starting && STARTING_WAIT_REASONS.contains(&reason)
    }

    /// Whether a long-poll for `target` is over: the state is reached, or
    /// an end state makes it unreachable, or (for any target but `stopped`)
    /// the sandbox rests `stopped` because nobody wants it running.
    pub fn settles_wait_for(self, target: SandboxState, desired: DesiredState) -> bool {
        if self == target || self.is_terminal() {
            return true;
        }
        let resting = self == SandboxState::Stopped && desired != DesiredState::Running;
        resting && target != SandboxState::Stopped
    }
}

/// Why a placed sandbox waits in `starting` (its runner retries with a
/// backoff, and says when in the record's `state_message`): the content
/// store, or the block service in front of it, does not answer
/// (`store_unreachable`), or has no space left (`store_full`). Once the
/// store is back the sandbox runs, its reason back to `workload_started`.
pub const STARTING_WAIT_REASONS: &[&str] = &["store_unreachable", "store_full"];

wire_enum! {
    /// What keeps a sandbox awake, and nothing else (README "Idle
    /// sandboxes"): each moves `last_activity_at` and, while the sandbox
    /// runs, its `idle_deadline`. Processes the sandbox starts by itself
    /// (a daemon left behind by a command that ended), network traffic
    /// and reads of the record are not activity.
    Activity {
        /// The sandbox was created.
        Created = "created",
        /// It began running (a create, start or wake): idleness counts
        /// from here, not from the request.
        Started = "started",
        /// A command was created in it.
        Command = "command",
        /// A command was still running when the deadline came: a command
        /// keeps its sandbox awake for as long as it runs.
        CommandRunning = "command_running",
        /// A command ended: idleness counts from its end.
        CommandEnded = "command_ended",
        /// A command's stdin was written or closed.
        Stdin = "stdin",
        /// A command was attached to (a WebSocket opened: its output
        /// streamed, its terminal used) or its terminal resized. Reading a
        /// command's output page by page is not activity in itself: the
        /// command it streams keeps the sandbox awake while it runs.
        Attach = "attach",
        /// A file API call.
        Files = "files",
        /// `POST /v1/sandboxes/{id}/keepalive`.
        Keepalive = "keepalive",
    }
}

wire_enum! {
    /// What a request asked for; only runners' reports change `state`.
    DesiredState {
        Running = "running",
        Stopped = "stopped",
        /// TTL expiry: stop for good, storage kept until delete.
        Terminated = "terminated",
        Deleted = "deleted",
    }
}

impl DesiredState {
    /// Whether a stop may still be asked: not once the sandbox is being
    /// deleted or has ended.
    pub fn can_stop(self, state: SandboxState) -> bool {
        !state.is_terminal() && self != DesiredState::Deleted
    }

    /// Whether a start may still be asked: not once it is ended, being
    /// deleted or terminated.
    pub fn can_start(self, state: SandboxState) -> bool {
        !state.is_terminal() && !matches!(self, DesiredState::Deleted | DesiredState::Terminated)
    }

    /// Whether a delete is still to be accepted (idempotent by outcome).
    pub fn can_delete(self, state: SandboxState) -> bool {
        self != DesiredState::Deleted && state != SandboxState::Deleted
    }
}

wire_enum! {
    /// A command's state (DESIGN.md §4): `queued`, `starting` (handed to the
    /// runner, not yet seen running), `running`, or one of the end states.
    CommandState {
        Queued = "queued",
        Starting = "starting",
        Running = "running",
        Exited = "exited",
        TimedOut = "timed_out",
        ResourceExhausted = "resource_exhausted",
        Interrupted = "interrupted",
        LaunchFailed = "launch_failed",
        NotLaunched = "not_launched",
        InfrastructureLost = "infrastructure_lost",
        Unknown = "unknown",
    }
}

impl CommandState {
    pub const fn is_end(self) -> bool {
        !matches!(
            self,
            CommandState::Queued | CommandState::Starting | CommandState::Running
        )
    }

    /// Handed to its runner and not ended: the runner reports it and
    /// delivers its signals.
    pub const fn on_runner(self) -> bool {
        matches!(self, CommandState::Starting | CommandState::Running)
    }

    /// The transition table of a runner's command reports.
    pub fn runner_may_report(self, to: CommandState) -> bool {
        match self {
            CommandState::Starting => to == CommandState::Running || to.is_end(),
            CommandState::Running => to.is_end(),
            _ => false,
        }
    }

    /// Whether a long-poll for `target` is over.
    pub fn settles_wait_for(self, target: CommandState) -> bool {
        self == target || self.is_end()
    }
}

wire_enum! {
    /// Where a sandbox's home lives (DESIGN.md §5).
    StorageClass {
        /// Node-bound: lost with the node.
        Standard = "standard",
        /// Saved to the store, recovered elsewhere.
        Durable = "durable",
    }
}

wire_enum! {
    /// A sandbox's network.
    Network {
        /// Loopback only.
        None = "none",
        /// The runner's bridge, outbound NAT.
        Bridge = "bridge",
    }
}

wire_enum! {
    /// Which runners a sandbox may be placed on.
    Placement {
        /// Spot runners first, on-demand as fallback.
        SpotFirst = "spot_first",
        /// On-demand runners only.
        NonPreemptible = "non_preemptible",
    }
}

/// A SQL `IN` list of the values a predicate selects, e.g.
/// `('starting', 'running', 'stopping')`: the text is built from the enum,
/// never from input, so it is safe to splice into a statement.
pub fn sql_in<T: Copy>(
    all: &[T],
    select: impl Fn(T) -> bool,
    text: impl Fn(T) -> &'static str,
) -> String {
    let items: Vec<String> = all
        .iter()
        .copied()
        .filter(|value| select(*value))
        .map(|value| format!("'{}'", text(value)))
        .collect();
    format!("({})", items.join(", "))
}

impl SandboxState {
    /// The SQL `IN` list of the states `select` picks.
    pub fn sql_in(select: impl Fn(SandboxState) -> bool) -> String {
        sql_in(SandboxState::ALL, select, SandboxState::as_str)
    }
}

impl CommandState {
    /// The SQL `IN` list of the states `select` picks.
    pub fn sql_in(select: impl Fn(CommandState) -> bool) -> String {
        sql_in(CommandState::ALL, select, CommandState::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every state has a stable reason to fall back on, in the reasons'
    /// spelling (snake_case), and only the ones that always name their
    /// own fall back on `unknown`.
    #[test]
    fn every_state_has_a_usual_reason() {
        for state in SandboxState::ALL {
            let reason = state.usual_reason();
            assert!(
                !reason.is_empty() && reason.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{state}: {reason:?}"
            );
            assert_eq!(
                reason == "unknown",
                matches!(state, SandboxState::Failed | SandboxState::Terminated),
                "{state}"
            );
        }
    }

    #[test]
    fn the_wire_spelling_is_the_serde_spelling_and_parses_back() {
        fn check<T>(all: &[T])
        where
            T: Copy
                + Serialize
                + FromStr<Err = UnknownValue>
                + fmt::Display
                + PartialEq
                + fmt::Debug,
        {
            for value in all {
                let json = serde_json::to_string(value).expect("serializes");
                assert_eq!(json, format!("\"{value}\""));
                assert_eq!(value.to_string().parse::<T>().expect("parses"), *value);
            }
        }
        check(SandboxState::ALL);
        check(DesiredState::ALL);
        check(CommandState::ALL);
        check(StorageClass::ALL);
        check(Network::ALL);
        check(Placement::ALL);
        let err = "asleep".parse::<SandboxState>().expect_err("not a state");
        assert!(err.to_string().contains("\"asleep\""), "{err}");
        assert!(err.to_string().contains("recovering"), "{err}");
    }

    #[test]
    fn predicates_match_design() {
        use SandboxState::*;
        let pick = |f: fn(SandboxState) -> bool| -> Vec<SandboxState> {
            SandboxState::ALL
                .iter()
                .copied()
                .filter(|s| f(*s))
                .collect()
        };
        assert_eq!(
            pick(SandboxState::is_terminal),
            [Failed, Terminated, Deleted]
        );
        assert_eq!(
            pick(SandboxState::holds_compute),
            [Starting, Running, Stopping]
        );
        assert_eq!(
            pick(SandboxState::counts_as_running),
            [Pending, Starting, Running, Stopping, Recovering]
        );
        assert_eq!(
            SandboxState::sql_in(SandboxState::holds_compute),
            "('starting', 'running', 'stopping')"
        );
        assert_eq!(
            CommandState::sql_in(CommandState::is_end)
                .matches('\'')
                .count(),
            2 * 8
        );
    }

    /// Every (from, to, desired) a runner could send, against the table
    /// written out row by row: `allowed` lists, per recorded state, the
    /// states a runner may report with desired `running`/`stopped`/
    /// `terminated` (`deleted` is allowed from any state but `deleted`
    /// exactly when desired is `deleted`).
    #[test]
    fn runner_reports_follow_the_transition_table() {
        use SandboxState::*;
        let allowed = |from: SandboxState| -> &'static [SandboxState] {
            match from {
                Starting | Running => &[Running, Failed, Stopping, Securing, Stopped, Terminated],
                Stopping => &[Running, Failed, Securing, Stopped, Terminated],
                Securing => &[Stopping, Failed, Stopped, Terminated],
                Pending | Stopped => &[Stopping, Securing, Stopped, Terminated],
                Recovering | Deleting | Failed | Terminated | Deleted => &[],
            }
        };
        let mut checked = 0;
        for &from in SandboxState::ALL {
            for &to in SandboxState::ALL {
                for &desired in DesiredState::ALL {
                    let expected = if to == Deleted {
                        desired == DesiredState::Deleted && from != Deleted
                    } else {
                        allowed(from).contains(&to)
                    };
                    assert_eq!(
                        from.runner_may_report(to, desired),
                        expected,
                        "{from} -> {to} (desired {desired})"
                    );
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 11 * 11 * 4);
        // No runner report ever moves a sandbox to a state only the control
        // plane sets.
        for &from in SandboxState::ALL {
            for to in [Pending, Starting, Recovering, Deleting] {
                for &desired in DesiredState::ALL {
                    assert!(!from.runner_may_report(to, desired), "{from} -> {to}");
                }
            }
        }
    }

    /// A runner may say again that a sandbox is `starting` only to say it
    /// waits for the store; every other repeat is no change.
    #[test]
    fn only_a_starting_sandbox_waiting_for_the_store_is_restated() {
        for &state in SandboxState::ALL {
            for reason in [
                "store_unreachable",
                "store_full",
                "placed",
                "workload_started",
                "",
            ] {
                let expected = state == SandboxState::Starting
                    && matches!(reason, "store_unreachable" | "store_full");
                assert_eq!(
                    state.runner_may_restate(reason),
                    expected,
                    "{state} restated as {reason:?}"
                );
            }
        }
    }

    #[test]
    fn command_reports_follow_the_transition_table() {
        use CommandState::*;
        for &from in CommandState::ALL {
            for &to in CommandState::ALL {
                let expected = match from {
                    Starting => to == Running || to.is_end(),
                    Running => to.is_end(),
                    _ => false,
                };
                assert_eq!(from.runner_may_report(to), expected, "{from} -> {to}");
            }
        }
        assert!(!Queued.runner_may_report(Running));
        assert!(Starting.runner_may_report(LaunchFailed));
        assert!(!Exited.runner_may_report(Unknown));
    }

    #[test]
    fn a_wait_ends_when_reached_or_unreachable() {
        use DesiredState as D;
        use SandboxState::*;
        let cases = [
            (Running, Running, D::Running, true),
            (Starting, Running, D::Running, false),
            (Failed, Running, D::Running, true),
            (Deleted, Stopped, D::Deleted, true),
            // Stopped and wanted stopped: `running` will not come.
            (Stopped, Running, D::Stopped, true),
            // Stopped but wanted running (the scheduler will place it).
            (Stopped, Running, D::Running, false),
            (Stopping, Stopped, D::Stopped, false),
            (Stopped, Stopped, D::Stopped, true),
        ];
        for (state, target, desired, settled) in cases {
            assert_eq!(
                state.settles_wait_for(target, desired),
                settled,
                "{state} waiting for {target} (desired {desired})"
            );
        }
        assert!(CommandState::Running.settles_wait_for(CommandState::Running));
        assert!(CommandState::Exited.settles_wait_for(CommandState::Running));
        assert!(!CommandState::Queued.settles_wait_for(CommandState::Running));
    }

    #[test]
    fn requests_are_allowed_as_the_contract_says() {
        use DesiredState as D;
        use SandboxState::*;
        assert!(D::Running.can_stop(Running));
        assert!(!D::Deleted.can_stop(Running));
        assert!(!D::Running.can_stop(Failed));
        assert!(D::Stopped.can_start(Stopped));
        assert!(!D::Terminated.can_start(Stopped));
        assert!(!D::Running.can_start(Terminated));
        // Delete is accepted once for anything still holding resources,
        // failed and terminated included.
        assert!(D::Running.can_delete(Failed));
        assert!(D::Terminated.can_delete(Terminated));
        assert!(!D::Deleted.can_delete(Deleting));
        assert!(!D::Running.can_delete(Deleted));
    }
}
