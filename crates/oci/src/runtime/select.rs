//! Which OCI runtime to use: the configured choice ([`RuntimeChoice`]), the
//! runtime picked for this host's cgroup layout ([`RuntimeKind`]) and the
//! rule that picks it ([`select`]). `auto` takes crun on a pure cgroup v2
//! host and runc otherwise (crun refuses hybrid hosts); an explicit choice
//! is used as given.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use crate::cgroup::CgroupHost;
use crate::error::{Error, Result};

/// Which runtime to use, as configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeChoice {
    Auto,
    Runc,
    Crun,
}

impl RuntimeChoice {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "auto" => Ok(RuntimeChoice::Auto),
            "runc" => Ok(RuntimeChoice::Runc),
            "crun" => Ok(RuntimeChoice::Crun),
            other => Err(Error::Invalid(format!(
                "runtime {other:?}: use auto, runc or crun"
            ))),
        }
    }
}

/// The runtime in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeKind {
    Runc,
    Crun,
}

impl RuntimeKind {
    pub fn name(self) -> &'static str {
        match self {
            RuntimeKind::Runc => "runc",
            RuntimeKind::Crun => "crun",
        }
    }

    /// The global option that sends the runtime's log to `path`.
    pub(crate) fn log_option(self, path: &Path) -> OsString {
        let mut option = OsString::from(match self {
            RuntimeKind::Runc => "--log=",
            RuntimeKind::Crun => "--log=file:",
        });
        option.push(path);
        option
    }
}

/// Picks the runtime for `choice` on a host with `cgroups`, finding
/// binaries with `find`.
pub fn select(
    choice: RuntimeChoice,
    cgroups: &CgroupHost,
    search_path: &OsStr,
    find: impl Fn(&str) -> Option<PathBuf>,
) -> Result<(RuntimeKind, PathBuf)> {
    let path_text = || search_path.to_string_lossy().into_owned();
    let explicit = |kind: RuntimeKind| {
        find(kind.name())
            .map(|binary| (kind, binary))
            .ok_or(Error::RuntimeNotFound {
                name: kind.name(),
                path: path_text(),
            })
    };
    match choice {
        RuntimeChoice::Runc => explicit(RuntimeKind::Runc),
        RuntimeChoice::Crun => explicit(RuntimeKind::Crun),
        RuntimeChoice::Auto => {
            let order: &[RuntimeKind] = if cgroups.is_pure_v2() {
                &[RuntimeKind::Crun, RuntimeKind::Runc]
            } else {
                // crun cannot run here; never fall back to it.
                &[RuntimeKind::Runc]
            };
            order
                .iter()
                .copied()
                .find_map(|kind| find(kind.name()).map(|binary| (kind, binary)))
                .ok_or(Error::NoRuntime { path: path_text() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(pure_v2: bool) -> CgroupHost {
        if pure_v2 {
            CgroupHost {
                v1: Vec::new(),
                v2: Some("/sys/fs/cgroup".into()),
            }
        } else {
            CgroupHost {
                v1: vec![("memory".into(), "/sys/fs/cgroup/memory".into())],
                v2: Some("/sys/fs/cgroup/unified".into()),
            }
        }
    }

    fn pick(choice: RuntimeChoice, pure_v2: bool, installed: &[&str]) -> Result<RuntimeKind> {
        select(choice, &host(pure_v2), OsStr::new("/usr/bin"), |name| {
            installed
                .contains(&name)
                .then(|| PathBuf::from("/usr/bin").join(name))
        })
        .map(|(kind, _)| kind)
    }

    #[test]
    fn selection() {
        use RuntimeChoice::*;
        let both = ["runc", "crun"];
        assert_eq!(pick(Auto, true, &both).ok(), Some(RuntimeKind::Crun));
        assert_eq!(pick(Auto, false, &both).ok(), Some(RuntimeKind::Runc));
        assert_eq!(pick(Auto, true, &["runc"]).ok(), Some(RuntimeKind::Runc));
        assert!(matches!(
            pick(Auto, false, &["crun"]),
            Err(Error::NoRuntime { .. })
        ));
        assert_eq!(pick(Crun, false, &both).ok(), Some(RuntimeKind::Crun));
        let missing = pick(Runc, true, &["crun"]).expect_err("runc missing");
        assert!(missing.to_string().contains("runc"), "{missing}");
        assert!(matches!(
            missing,
            Error::RuntimeNotFound { name: "runc", .. }
        ));
    }

    #[test]
    fn choices_parse() {
        assert_eq!(RuntimeChoice::parse("auto").ok(), Some(RuntimeChoice::Auto));
        assert!(RuntimeChoice::parse("youki").is_err());
    }
}
