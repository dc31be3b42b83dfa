//! What a runtime says about itself: the error messages in its JSON log
//! (`--log`, `--log-format=json`), which the driver puts in its errors and
//! the outcome of a command that never started, and what such a message
//! means ([`LaunchFailure`]). runc and crun say why an exec failed only in
//! words; this is the one place that reads them, so callers match on a
//! type.

use serde::Deserialize;

pub(crate) fn tail(text: &str, max_chars: usize) -> String {
    let text = text.trim();
    let count = text.chars().count();
    text.chars().skip(count.saturating_sub(max_chars)).collect()
}

/// The error messages in a runtime's JSON log (`{"level":"error","msg":…}`
/// lines), joined; or, when there are none, the text lines that are not
/// JSON (a runtime also prints its fatal error plainly).
pub fn runtime_errors(log: &str) -> String {
    #[derive(Deserialize)]
    struct Line {
        level: Option<String>,
        msg: Option<String>,
    }
    let mut errors = Vec::new();
    let mut plain = Vec::new();
    for line in log.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match serde_json::from_str::<Line>(line) {
            Ok(Line {
                level: Some(level),
                msg: Some(msg),
            }) if matches!(level.as_str(), "error" | "fatal" | "panic") => errors.push(msg),
            Ok(_) => {}
            Err(_) => plain.push(line.to_owned()),
        }
    }
    let chosen = if errors.is_empty() { plain } else { errors };
    tail(&chosen.join("; "), 2000)
}

/// Why a command never started, as the runtime's words tell. The words
/// themselves stay in the outcome's message, for people.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchFailure {
    /// The sandbox had stopped or was gone when the runtime came to exec:
    /// the command never started for want of a sandbox.
    SandboxNotRunning,
    /// The command's cwd could not be entered.
    BadCwd,
    /// The program was not found (not on `PATH`, or no such file).
    MissingExecutable,
    /// The program, or a directory on its way, was not accessible.
    PermissionDenied,
    /// Anything else the runtime refused or failed at.
    RuntimeRefused,
}

impl LaunchFailure {
    /// Reads a runtime's exec error message (runc's and crun's words, in
    /// that order of precedence: a stopped sandbox explains any later
    /// complaint).
    pub fn of_runtime_message(message: &str) -> LaunchFailure {
        let message = message.to_ascii_lowercase();
        let says = |words: &[&str]| words.iter().any(|w| message.contains(w));
        if says(&["stopped", "container does not exist", "not running"]) {
            LaunchFailure::SandboxNotRunning
        } else if says(&["chdir", "cwd"]) {
            LaunchFailure::BadCwd
        } else if says(&["not found", "no such file or directory"]) {
            LaunchFailure::MissingExecutable
        } else if says(&["permission denied"]) {
            LaunchFailure::PermissionDenied
        } else {
            LaunchFailure::RuntimeRefused
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_error_messages() {
        let log = r#"{"level":"warning","msg":"ignoring","time":"x"}
{"level":"error","msg":"exec failed: unable to start container process: exec: \"nope\": executable file not found in $PATH","time":"x"}
exec failed: unable to start container process: exec: "nope": executable file not found in $PATH
"#;
        assert_eq!(
            runtime_errors(log),
            "exec failed: unable to start container process: exec: \"nope\": executable file not found in $PATH"
        );
        assert_eq!(runtime_errors("plain failure\n"), "plain failure");
        assert_eq!(runtime_errors(""), "");
    }

    #[test]
    fn launch_failures_from_the_runtimes_words() {
        let check = |message: &str, expected: LaunchFailure| {
            assert_eq!(
                LaunchFailure::of_runtime_message(message),
                expected,
                "{message}"
            );
        };
        check(
            "exec failed: unable to start container process: exec: \"nope\": executable file not found in $PATH",
            LaunchFailure::MissingExecutable,
        );
        check(
            "exec failed: unable to start container process: exec: \"/x\": stat /x: no such file or directory",
            LaunchFailure::MissingExecutable,
        );
        check(
            "chdir to cwd (\"/x\") set in config.json failed: no such file or directory",
            LaunchFailure::BadCwd,
        );
        check(
            "exec failed: unable to start container process: exec: \"/x\": permission denied",
            LaunchFailure::PermissionDenied,
        );
        check(
            "exec failed: cannot exec in a stopped container",
            LaunchFailure::SandboxNotRunning,
        );
        check("container does not exist", LaunchFailure::SandboxNotRunning);
        check("Container Not Running", LaunchFailure::SandboxNotRunning);
        check("something else", LaunchFailure::RuntimeRefused);
        check(
            "runc exec ended with status 255 before starting the process",
            LaunchFailure::RuntimeRefused,
        );
    }
}
