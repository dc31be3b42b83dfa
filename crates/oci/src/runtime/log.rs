//! What a runtime says about itself: the error messages in its JSON log
//! (`--log`, `--log-format=json`), which the driver puts in its errors and
//! the outcome of a command that never started.

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
}
