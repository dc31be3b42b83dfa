//! Delivered secrets on this runner: held on a tmpfs of the runner's own
//! (`AgentConfig::secrets_dir`, outside the data dir), never on a disk.
//!
//! ```text
//! SECRETS/ID/files/FILE   a file secret, mode 0400 (owned by root, the
//!                         sandbox's user), the directory bind-mounted
//!                         read-only at /run/secrets
//! SECRETS/ID/env/VAR      an env secret, read into each command's env
//! SECRETS/ID/exec/        the scratch files of the sandbox's commands
//!                         (their process.json holds that env)
//! ```
//!
//! Written at each launch from the values the server gives the runner of
//! the placement (the current version of each), so a restarted runner
//! still gives the commands of a container it adopts their env; removed
//! with the sandbox's files. A tmpfs does not survive the host, and
//! neither does a container.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use api::runners::SecretValues;
use oci::config::SandboxId;
use oci::{Error, Result};

/// The tmpfs the secrets live on holds, for each sandbox the runner's
/// capacity allows, the most secrets a sandbox may have (64 of 64 KiB) and
/// its commands' scratch files; only what is written uses memory. Sized
/// so, it never fills before the runner does: a launch never waits for
/// room on it.
const TMPFS_BYTES_PER_SANDBOX: u64 = (api::secrets::SECRETS_PER_SANDBOX_MAX
    * api::secrets::SECRET_VALUE_BYTES_MAX) as u64
    + (1 << 20);
/// The smallest the secrets' tmpfs is made.
const TMPFS_BYTES_MIN: u64 = 256 << 20;

/// The size of the secrets' tmpfs of a runner for `sandboxes` sandboxes.
pub(crate) fn tmpfs_bytes(sandboxes: u64) -> u64 {
    sandboxes
        .saturating_mul(TMPFS_BYTES_PER_SANDBOX)
        .max(TMPFS_BYTES_MIN)
}

#[derive(Debug, Clone)]
pub(crate) struct SecretsDir {
    root: PathBuf,
    /// The size of the tmpfs at `root` ([`tmpfs_bytes`]).
    tmpfs_bytes: u64,
}

/// The default place: under `/run/roost`, named after the data dir, so
/// runners sharing a host keep theirs apart and a restart finds its own.
pub(crate) fn default_root(data_dir: &Path) -> PathBuf {
    let name: String = data_dir
        .to_string_lossy()
        .trim_matches('/')
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    PathBuf::from("/run/roost/secrets").join(name)
}

impl SecretsDir {
    /// Secrets under `root`, on a tmpfs for a runner of `sandboxes`.
    pub(crate) fn new(root: PathBuf, sandboxes: u64) -> SecretsDir {
        SecretsDir {
            root,
            tmpfs_bytes: tmpfs_bytes(sandboxes),
        }
    }

    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    fn sandbox(&self, id: &SandboxId) -> PathBuf {
        self.root.join(id.as_str())
    }

    /// The sandbox's file secrets (what `/run/secrets` shows).
    pub(crate) fn files(&self, id: &SandboxId) -> PathBuf {
        self.sandbox(id).join("files")
    }

    /// Where the sandbox's commands' scratch files go, if it has secrets.
    pub(crate) fn scratch(&self, id: &SandboxId) -> Option<PathBuf> {
        let dir = self.sandbox(id);
        dir.is_dir().then(|| dir.join("exec"))
    }

    /// Writes what the server gave for `id`, replacing what was there.
    pub(crate) fn deliver(&self, id: &SandboxId, values: &SecretValues) -> Result<PathBuf> {
        oci::tmpfs::ensure(&self.root, self.tmpfs_bytes)?;
        self.remove(id)?;
        let dir = self.sandbox(id);
        for sub in ["files", "env", "exec"] {
            let path = dir.join(sub);
            std::fs::create_dir_all(&path).map_err(|e| Error::io("create directory", &path, e))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| Error::io("chmod", &path, e))?;
        }
        for secret in &values.secrets {
            // The server checked both names at create; checked again here,
            // as a path component must never climb out.
            let (sub, name) = match (&secret.env, &secret.file) {
                (Some(env), None) => ("env", env),
                (None, Some(file)) => ("files", file),
                _ => {
                    return Err(Error::Invalid(format!(
                        "secret {:?}: neither only env nor only file",
                        secret.name
                    )));
                }
            };
            if name.is_empty() || name.starts_with('.') || name.contains('/') {
                return Err(Error::Invalid(format!("secret place {name:?}")));
            }
            let path = dir.join(sub).join(name);
            write_private(&path, secret.value.as_bytes())?;
        }
        // The mount's top: readable by the sandbox's user (root), no one else.
        let files = self.files(id);
        std::fs::set_permissions(&files, std::fs::Permissions::from_mode(0o500))
            .map_err(|e| Error::io("chmod", &files, e))?;
        Ok(files)
    }

    /// The env secrets of `id` the sandbox asked for (`names`: the env
    /// variables its assignment lists), as delivered. One that cannot be
    /// read is an error naming it: no command runs without an env secret
    /// it was promised.
    pub(crate) fn env(&self, id: &SandboxId, names: &[String]) -> Result<BTreeMap<String, String>> {
        let dir = self.sandbox(id).join("env");
        names
            .iter()
            .map(|name| {
                // Checked as at delivery: a path component never climbs out.
                if name.is_empty() || name.starts_with('.') || name.contains('/') {
                    return Err(Error::Invalid(format!("env secret {name:?}")));
                }
                let path = dir.join(name);
                let value = std::fs::read_to_string(&path)
                    .map_err(|e| Error::io("read the env secret", &path, e))?;
                Ok((name.clone(), value))
            })
            .collect()
    }

    /// Forgets everything delivered for `id`.
    pub(crate) fn remove(&self, id: &SandboxId) -> Result<()> {
        let dir = self.sandbox(id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(Error::io("remove", &dir, err)),
        }
    }
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o400)
        .open(path)
        .map_err(|e| Error::io("create", path, e))?;
    file.write_all(bytes)
        .map_err(|e| Error::io("write", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An env secret the sandbox asked for that is not there (its tmpfs
    /// gone, say) is an error naming it; it used to read as no secrets.
    #[test]
    fn an_env_secret_that_cannot_be_read_is_an_error_naming_it() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let secrets = SecretsDir::new(dir.path().to_owned(), 1);
        let id = SandboxId::new("sbx_secrets01".to_owned()).expect("an id");
        assert_eq!(
            secrets.env(&id, &[]).expect("none asked for"),
            BTreeMap::new()
        );
        let err = secrets
            .env(&id, &["TOKEN".to_owned()])
            .expect_err("nothing delivered");
        assert!(err.to_string().contains("TOKEN"), "{err}");
        let env = dir.path().join("sbx_secrets01/env");
        std::fs::create_dir_all(&env).expect("the env dir");
        std::fs::write(env.join("TOKEN"), "s3cret").expect("a delivered secret");
        assert_eq!(
            secrets.env(&id, &["TOKEN".to_owned()]).expect("delivered"),
            BTreeMap::from([("TOKEN".to_owned(), "s3cret".to_owned())])
        );
    }

    /// A runner's secrets tmpfs holds every sandbox its capacity allows
    /// with the most secrets a sandbox may have (it used to be 256 MiB
    /// whatever the capacity: 64 such sandboxes), and never less.
    #[test]
    fn the_tmpfs_holds_the_most_secrets_of_every_sandbox_the_runner_may_hold() {
        let most =
            (api::secrets::SECRETS_PER_SANDBOX_MAX * api::secrets::SECRET_VALUE_BYTES_MAX) as u64;
        for sandboxes in [1, 64, 65, 1_000, 100_000] {
            assert!(tmpfs_bytes(sandboxes) >= sandboxes * most, "{sandboxes}");
            assert!(tmpfs_bytes(sandboxes) >= 256 << 20, "{sandboxes}");
        }
        assert_eq!(tmpfs_bytes(u64::MAX), u64::MAX);
    }

    #[test]
    fn default_roots_differ_per_data_dir_and_stay_off_it() {
        let a = default_root(Path::new("/var/lib/roost/runner"));
        let b = default_root(Path::new("/var/lib/roost/runner2"));
        assert_ne!(a, b);
        assert!(a.starts_with("/run/roost/secrets"));
        assert!(!a.starts_with("/var/lib/roost/runner"));
    }
}
