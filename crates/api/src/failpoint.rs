//! Fault points for crash-safety tests: one type for the server and the
//! runner. `ROOST_FAILPOINT=NAME` arms one named point; a process that
//! reaches it dies at once, as `kill -9` would, so the tests see what a
//! crash at exactly that point leaves behind.
//!
//! The names are a contract with the integration tests (for example
//! `after_commit:create_sandbox`, `runner:after_command_launch`,
//! `runner:save_before_upload`): renaming one silently disarms a test.

/// The environment variable that arms a fault point.
pub const ENV: &str = "ROOST_FAILPOINT";

/// What reaching the armed point does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    /// SIGKILL to this process: nothing runs after it, as in a crash.
    Kill,
    /// A panic of the task that reached it: for unit tests, which run in
    /// one process with others and must not kill it.
    Panic,
}

/// The armed fault point, if any. Cheap to clone; unarmed by default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Failpoints {
    armed: Option<(String, Action)>,
}

impl Failpoints {
    /// None armed.
    pub fn none() -> Failpoints {
        Failpoints::default()
    }

    /// Armed from [`ENV`] (unset or empty: none).
    pub fn from_env() -> Failpoints {
        match std::env::var(ENV) {
            Ok(name) if !name.is_empty() => Failpoints::killing_at(&name),
            _ => Failpoints::none(),
        }
    }

    /// `name` armed: reaching it kills the process.
    pub fn killing_at(name: &str) -> Failpoints {
        Failpoints {
            armed: Some((name.to_owned(), Action::Kill)),
        }
    }

    /// `name` armed to panic instead (unit tests in a shared process).
    pub fn panicking_at(name: &str) -> Failpoints {
        Failpoints {
            armed: Some((name.to_owned(), Action::Panic)),
        }
    }

    /// The armed point's name.
    pub fn armed(&self) -> Option<&str> {
        self.armed.as_ref().map(|(name, _)| name.as_str())
    }

    /// Reaching the point `name`: dies there if it is the armed one.
    pub fn hit(&self, name: &str) {
        let Some((armed, action)) = &self.armed else {
            return;
        };
        if armed != name {
            return;
        }
        tracing::error!(failpoint = name, "failpoint reached; killing this process");
        match action {
            Action::Kill => {
                let _ = rustix::process::kill_process(
                    rustix::process::getpid(),
                    rustix::process::Signal::KILL,
                );
                // SIGKILL cannot be caught; should the kill itself fail,
                // nothing may run past the point either.
                std::process::abort();
            }
            Action::Panic => panic!("failpoint {name} reached"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_armed_point_fires() {
        let points = Failpoints::panicking_at("runner:after_command_launch");
        points.hit("runner:save_before_upload");
        Failpoints::none().hit("runner:after_command_launch");
        assert_eq!(points.armed(), Some("runner:after_command_launch"));
        let fired = std::panic::catch_unwind(|| points.hit("runner:after_command_launch"));
        assert!(fired.is_err(), "the armed point fires");
    }
}
