//! The signals the platform delivers (the API's `SIGNALS` list), with their
//! Linux numbers, names and the exit status a runtime reports for a process
//! they killed (128 + number).

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Signal {
    Hup,
    Int,
    Quit,
    Kill,
    Usr1,
    Usr2,
    Term,
}

impl Signal {
    pub const ALL: [Signal; 7] = [
        Signal::Hup,
        Signal::Int,
        Signal::Quit,
        Signal::Kill,
        Signal::Usr1,
        Signal::Usr2,
        Signal::Term,
    ];

    /// The name without `SIG`, as the API and the runtimes' `kill` take it.
    pub fn name(self) -> &'static str {
        match self {
            Signal::Hup => "HUP",
            Signal::Int => "INT",
            Signal::Quit => "QUIT",
            Signal::Kill => "KILL",
            Signal::Usr1 => "USR1",
            Signal::Usr2 => "USR2",
            Signal::Term => "TERM",
        }
    }

    /// Parses `TERM` or `SIGTERM`.
    pub fn from_name(name: &str) -> Option<Signal> {
        let name = name.strip_prefix("SIG").unwrap_or(name);
        Signal::ALL.into_iter().find(|s| s.name() == name)
    }

    pub fn number(self) -> i32 {
        self.to_rustix().as_raw()
    }

    pub fn from_number(number: i32) -> Option<Signal> {
        Signal::ALL.into_iter().find(|s| s.number() == number)
    }

    pub(crate) fn to_rustix(self) -> rustix::process::Signal {
        use rustix::process::Signal as S;
        match self {
            Signal::Hup => S::HUP,
            Signal::Int => S::INT,
            Signal::Quit => S::QUIT,
            Signal::Kill => S::KILL,
            Signal::Usr1 => S::USR1,
            Signal::Usr2 => S::USR2,
            Signal::Term => S::TERM,
        }
    }
}

impl fmt::Display for Signal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SIG{}", self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers() {
        assert_eq!(Signal::from_name("TERM"), Some(Signal::Term));
        assert_eq!(Signal::from_name("SIGKILL"), Some(Signal::Kill));
        assert_eq!(Signal::from_name("STOP"), None);
        assert_eq!(Signal::Term.number(), 15);
        assert_eq!(Signal::Kill.number(), 9);
        assert_eq!(Signal::Int.number(), 2);
        for signal in Signal::ALL {
            assert_eq!(Signal::from_number(signal.number()), Some(signal));
            assert_eq!(Signal::from_name(signal.name()), Some(signal));
        }
    }
}
