//! The lease deadline a runner renews and every sandbox's init watches, so
//! that the freeze before a lease can expire does not depend on the runner
//! process (DESIGN.md §7): a runner that dies leaves its sandboxes frozen.
//!
//! The runner writes the deadline into a host directory of the sandbox
//! (`DIR/lease/deadline`), bind-mounted read-only at [`LEASE_PATH`]; the
//! init reads it there ([`crate::init`]). The runner writes it again after
//! every answered heartbeat, for the sandboxes it runs for a current
//! placement only: a restarted runner renews nothing it was not assigned.
//! A directory, not the file, is mounted: the runner replaces the file by
//! renaming, and a bind-mounted file would keep showing the old inode.
//!
//! # The file
//!
//! ```text
//! freeze_at_boottime_ms=123456789
//! freeze_at_unix_ms=1767225600000
//! ```
//!
//! `freeze_at_boottime_ms` is the deadline, on `CLOCK_BOOTTIME`: one clock
//! for every process on the host (sandboxes get no time namespace), never
//! set back, and, unlike `CLOCK_MONOTONIC`, counting a suspend, so a host
//! that slept past the lease wakes frozen. `freeze_at_unix_ms` is the same
//! instant on the wall clock, for people and tests; nothing decides by it.
//!
//! # The rule ([`decide`])
//!
//! Before the deadline the sandbox runs; from the deadline on, the init
//! stops (SIGSTOP) every other process of its pid namespace and keeps doing
//! so for newcomers; once a later deadline is written, it continues
//! (SIGCONT) exactly the processes it stopped. A missing or unreadable file
//! counts as a lapsed lease (fail closed): the runner writes it before it
//! creates the container.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};

/// Where the lease directory appears inside a sandbox.
pub const LEASE_PATH: &str = "/.roost/lease";
/// The deadline's file name in the lease directory.
pub const DEADLINE_FILE: &str = "deadline";
/// The init's flag naming the lease directory to watch.
pub const LEASE_FLAG: &str = "--lease-dir";

/// How often a running init looks at the file at the latest, even with a
/// deadline further away: a `CLOCK_MONOTONIC` timer does not count a
/// suspend, so a sleep is never trusted for longer than this.
pub const RUNNING_RECHECK_MS: u64 = 1_000;
/// How often a frozen init looks for a renewal (and for processes that
/// appeared since the freeze).
pub const FROZEN_RECHECK_MS: u64 = 100;

/// Milliseconds of `CLOCK_BOOTTIME`, the lease's clock.
pub fn boottime_ms() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    (now.tv_sec.max(0) as u64) * 1_000 + (now.tv_nsec.max(0) as u64) / 1_000_000
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// When a sandbox's processes are to be stopped unless renewed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline {
    pub freeze_at_boottime_ms: u64,
    /// The same instant on the wall clock (informational).
    pub freeze_at_unix_ms: u64,
}

impl Deadline {
    /// The deadline `remaining_ms` from now (negative: already passed).
    pub fn in_ms(remaining_ms: i64) -> Deadline {
        Deadline::from(boottime_ms(), remaining_ms)
    }

    /// The deadline `remaining_ms` after `boottime_now_ms` (a caller's
    /// own reading of the clock, e.g. a simulated one).
    pub fn from(boottime_now_ms: u64, remaining_ms: i64) -> Deadline {
        Deadline {
            freeze_at_boottime_ms: boottime_now_ms.saturating_add_signed(remaining_ms),
            freeze_at_unix_ms: unix_ms().saturating_add_signed(remaining_ms),
        }
    }

    pub fn to_text(self) -> String {
        format!(
            "freeze_at_boottime_ms={}\nfreeze_at_unix_ms={}\n",
            self.freeze_at_boottime_ms, self.freeze_at_unix_ms
        )
    }

    /// Reads the file's text; a missing or malformed field is an error
    /// saying which.
    pub fn parse(text: &str) -> std::result::Result<Deadline, String> {
        let field = |name: &str| -> std::result::Result<u64, String> {
            let value = text
                .lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix('='))
                .ok_or_else(|| format!("no {name} in the lease file"))?;
            value
                .trim()
                .parse()
                .map_err(|_| format!("{name}={value:?} is not a number of milliseconds"))
        };
        Ok(Deadline {
            freeze_at_boottime_ms: field("freeze_at_boottime_ms")?,
            freeze_at_unix_ms: field("freeze_at_unix_ms")?,
        })
    }
}

/// The deadline file in lease directory `dir`.
pub fn deadline_path(dir: &Path) -> PathBuf {
    dir.join(DEADLINE_FILE)
}

/// Replaces the deadline in `dir` (made if missing): a temporary file
/// renamed into place, so the init never reads half a file. Not synced: a
/// host crash ends the sandbox with it.
pub fn write_deadline(dir: &Path, deadline: Deadline) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
    let path = deadline_path(dir);
    let temporary = dir.join(format!(".{DEADLINE_FILE}.tmp"));
    std::fs::write(&temporary, deadline.to_text())
        .map_err(|e| Error::io("write", &temporary, e))?;
    std::fs::rename(&temporary, &path).map_err(|e| Error::io("rename", &path, e))
}

/// Reads the deadline in `dir`; why not, as one line.
pub fn read_deadline(dir: &Path) -> std::result::Result<Deadline, String> {
    let path = deadline_path(dir);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    Deadline::parse(&text)
}

/// What the init does at a check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Move {
    /// Before the deadline, running: nothing; look again in this long.
    Run { recheck_ms: u64 },
    /// The deadline passed (or no deadline can be read): stop every
    /// process. Also while frozen: stop any that appeared since.
    Freeze,
    /// Frozen, and a deadline in the future was written: continue what the
    /// freeze stopped.
    Thaw,
}

/// The rule, pure: `frozen` is whether the init has stopped the
/// processes, `deadline` what the file says (`Err`: it cannot be read),
/// `now_ms` the time on `CLOCK_BOOTTIME`.
pub fn decide(frozen: bool, deadline: std::result::Result<Deadline, String>, now_ms: u64) -> Move {
    let remaining_ms = match deadline {
        Ok(deadline) => deadline.freeze_at_boottime_ms.saturating_sub(now_ms),
        Err(_) => 0,
    };
    match (frozen, remaining_ms) {
        (_, 0) => Move::Freeze,
        (true, _) => Move::Thaw,
        (false, remaining_ms) => Move::Run {
            recheck_ms: remaining_ms.min(RUNNING_RECHECK_MS),
        },
    }
}

/// When to look again after `step`.
pub fn recheck_ms(step: Move) -> u64 {
    match step {
        Move::Run { recheck_ms } => recheck_ms,
        Move::Freeze => FROZEN_RECHECK_MS,
        // Running again: look at once whether the new deadline holds.
        Move::Thaw => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> std::result::Result<Deadline, String> {
        Ok(Deadline {
            freeze_at_boottime_ms: ms,
            freeze_at_unix_ms: 0,
        })
    }

    /// `(frozen, deadline, now, expected)`, on an injected clock.
    #[test]
    fn when_the_init_freezes_and_thaws() {
        let missing = || Err("no such file".to_owned());
        let rows: &[(bool, std::result::Result<Deadline, String>, u64, Move)] = &[
            // Running: sleep until the deadline, but never long.
            (false, at(10_000), 9_700, Move::Run { recheck_ms: 300 }),
            (false, at(10_000), 2_000, Move::Run { recheck_ms: 1_000 }),
            (false, at(10_000), 9_999, Move::Run { recheck_ms: 1 }),
            // The deadline is the freeze point, not a moment after.
            (false, at(10_000), 10_000, Move::Freeze),
            (false, at(10_000), 60_000, Move::Freeze),
            // Fail closed: no readable deadline is a lapsed lease.
            (false, missing(), 5_000, Move::Freeze),
            (false, Err("garbage".to_owned()), 5_000, Move::Freeze),
            // Frozen: stays so (sweeping newcomers) until a renewal.
            (true, at(10_000), 10_100, Move::Freeze),
            (true, missing(), 10_100, Move::Freeze),
            (true, at(12_500), 10_100, Move::Thaw),
        ];
        for (frozen, deadline, now, expected) in rows {
            assert_eq!(
                decide(*frozen, deadline.clone(), *now),
                *expected,
                "frozen {frozen}, deadline {deadline:?}, now {now}"
            );
        }
    }

    /// A runner renewing every 1 s with a 2.5 s grace, dying at 4 s; the
    /// init checks as `recheck_ms` says, on a simulated clock: it freezes
    /// at the last renewal's deadline (4 s + 2.5 s), not a check later,
    /// and thaws at the first renewal after.
    #[test]
    fn a_dead_renewer_freezes_at_its_last_deadline_and_a_renewal_thaws() {
        const GRACE_MS: u64 = 2_500;
        // Renewals at these times (the runner dies at 4 s, a restarted
        // one renews at 9 s).
        let renewals = [0, 1_000, 2_000, 3_000, 4_000, 9_000];
        let deadline_at = |now: u64| {
            renewals
                .iter()
                .filter(|r| **r <= now)
                .max()
                .map(|r| r + GRACE_MS)
        };
        let mut now = 0;
        let mut frozen = false;
        let mut moves = Vec::new();
        while now <= 10_000 {
            let deadline = deadline_at(now)
                .map(|ms| at(ms).expect("ok"))
                .ok_or_else(|| "missing".to_owned());
            let step = decide(frozen, deadline, now);
            match step {
                Move::Freeze if !frozen => {
                    frozen = true;
                    moves.push((now, step));
                }
                Move::Thaw => {
                    frozen = false;
                    moves.push((now, step));
                }
                _ => {}
            }
            now += recheck_ms(step).max(1);
        }
        assert_eq!(moves, [(6_500, Move::Freeze), (9_000, Move::Thaw)]);
    }

    #[test]
    fn the_file_round_trips_and_names_what_is_wrong() {
        let deadline = Deadline {
            freeze_at_boottime_ms: 42,
            freeze_at_unix_ms: 1_767_225_600_000,
        };
        assert_eq!(Deadline::parse(&deadline.to_text()), Ok(deadline));
        let err = Deadline::parse("freeze_at_unix_ms=1\n").expect_err("no boottime");
        assert!(err.contains("freeze_at_boottime_ms"), "{err}");
        let err = Deadline::parse("freeze_at_boottime_ms=soon\nfreeze_at_unix_ms=1\n")
            .expect_err("not a number");
        assert!(err.contains("soon"), "{err}");

        let dir = tempfile::tempdir().expect("tempdir");
        let lease = dir.path().join("lease");
        write_deadline(&lease, Deadline::in_ms(5_000)).expect("written");
        let read = read_deadline(&lease).expect("read");
        let now = boottime_ms();
        assert!(read.freeze_at_boottime_ms > now && read.freeze_at_boottime_ms <= now + 5_000);
        write_deadline(&lease, Deadline::in_ms(-1_000)).expect("replaced");
        assert!(read_deadline(&lease).expect("read").freeze_at_boottime_ms < boottime_ms());
        assert!(read_deadline(&dir.path().join("none")).is_err());
    }
}
