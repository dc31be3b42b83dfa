//! Which paths of a home are not saved.
//!
//! A pattern without `/` matches a name at any depth (`__pycache__`,
//! `*.pyc`); a pattern with `/` matches a path relative to the home root
//! (`.cache/pip`). An excluded directory is skipped whole.

use std::path::Path;

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};

use crate::{Error, Result};

/// The scrap class only a tool recreates. Package caches (`.npm`,
/// `.gradle`, `.cargo/registry`, `.pub-cache`) are kept on purpose: they
/// are slow or impossible to fetch again and dedupe well across homes.
pub const DEFAULT_EXCLUDES: &[&str] = &[
    "__pycache__",
    "*.pyc",
    "*.tmp",
    ".dartServer",
    ".cache/pip",
    ".cache/ms-playwright",
];

/// The environment variable that replaces [`DEFAULT_EXCLUDES`].
pub const EXCLUDES_ENV: &str = "ROOST_HOME_EXCLUDES";

#[derive(Clone, Debug)]
pub struct Excludes {
    set: GlobSet,
    patterns: Vec<String>,
}

impl Excludes {
    pub fn new<S: AsRef<str>>(patterns: &[S]) -> Result<Excludes> {
        let mut builder = GlobSetBuilder::new();
        let mut kept = Vec::new();
        for pattern in patterns {
            let pattern = pattern.as_ref().trim();
            if pattern.is_empty() {
                continue;
            }
            let anchored = pattern.trim_start_matches('/');
            let glob_text = if pattern.contains('/') {
                anchored.trim_end_matches('/').to_owned()
            } else {
                format!("**/{pattern}")
            };
            let glob = GlobBuilder::new(&glob_text)
                .literal_separator(true)
                .build()
                .map_err(|err| Error::InvalidExclude {
                    pattern: pattern.to_owned(),
                    reason: err.to_string(),
                })?;
            builder.add(glob);
            kept.push(pattern.to_owned());
        }
        let set = builder.build().map_err(|err| Error::InvalidExclude {
            pattern: kept.join(","),
            reason: err.to_string(),
        })?;
        Ok(Excludes {
            set,
            patterns: kept,
        })
    }

    pub fn default_set() -> Excludes {
        // The defaults are constant, valid globs: tested below.
        Excludes::new(DEFAULT_EXCLUDES).unwrap_or_else(|_| Excludes::none())
    }

    pub fn none() -> Excludes {
        Excludes {
            set: GlobSet::empty(),
            patterns: Vec::new(),
        }
    }

    /// `ROOST_HOME_EXCLUDES` (comma-separated globs) if set, else the defaults.
    pub fn from_env() -> Result<Excludes> {
        match std::env::var(EXCLUDES_ENV) {
            Ok(value) => Excludes::new(&value.split(',').collect::<Vec<_>>()),
            Err(_) => Ok(Excludes::default_set()),
        }
    }

    /// `relative` is the path from the home root, without a leading `/`.
    pub fn is_excluded(&self, relative: &Path) -> bool {
        !self.patterns.is_empty() && self.set.is_match(relative)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_scrap_and_keep_package_caches() {
        let excludes = Excludes::new(DEFAULT_EXCLUDES).expect("defaults are valid");
        for scrap in [
            "__pycache__",
            "src/pkg/__pycache__",
            "a.pyc",
            "x/y/b.tmp",
            ".dartServer",
            ".cache/pip",
            ".cache/ms-playwright",
        ] {
            assert!(excludes.is_excluded(Path::new(scrap)), "{scrap}");
        }
        for kept in [
            ".npm",
            ".gradle",
            ".cargo/registry",
            ".pub-cache",
            ".cache",
            "src/.cache/pip",
            "notes.txt",
            "pyc",
        ] {
            assert!(!excludes.is_excluded(Path::new(kept)), "{kept}");
        }
    }

    #[test]
    fn custom_patterns_replace_defaults() {
        let excludes = Excludes::new(&["node_modules", "build/out"]).expect("valid");
        assert!(excludes.is_excluded(Path::new("a/node_modules")));
        assert!(excludes.is_excluded(Path::new("build/out")));
        assert!(!excludes.is_excluded(Path::new("a/build/out")));
        assert!(!excludes.is_excluded(Path::new("x.pyc")));
        assert!(Excludes::new(&["a["]).is_err());
    }
}
