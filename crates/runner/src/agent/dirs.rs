//! The runner's data directory: what it keeps on disk so that a restart
//! loses nothing it has reported.
//!
//! ```text
//! DIR/lock                       held (flock) while a runner uses DIR
//! DIR/runner-id                  the id the server gave at the first register
//! DIR/runner-token               that runner's own credential (mode 0600):
//!                                every call after registering goes with it,
//!                                and a restart registers again with it
//! DIR/runtime/                   the OCI runtime's --root (container state)
//! DIR/sandboxes/ID/              the sandbox's files (rootfs: its writable
//!                                layer; bundle: config.json, init status)
//! DIR/volumes/roots/ID/          its writable layer, where the homes' volume
//!                                is btrfs: a subvolume, bounded by the
//!                                runner's `--sandbox-disk-max` (see
//!                                `homes::Homes::prepare_layer`); a sandbox
//!                                first launched before that keeps its
//!                                layer in DIR/sandboxes/ID
//! DIR/sandboxes/ID/placement     the epoch its container was launched for,
//!                                written before the launch: a container of
//!                                an earlier placement is never adopted by
//!                                a later one
//! DIR/homes/ID/                  /workspace of a standard sandbox, kept
//!                                across stop and start, removed at delete
//! DIR/commands/ID/CMD.launched   written and fsynced before CMD is launched:
//!                                a command with this file is never launched
//!                                again (at most once, across restarts);
//!                                how CMD ended is appended to it (`end …`)
//!                                before the end is reported
//! DIR/commands/ID/CMD.end        how a CMD never launched ended
//! DIR/commands/ID/CMD.stdout|stderr  output spooled until the server has it
//!                                (made at the stream's first byte)
//! ```
//!
//! Files of a command stay until the command is no longer assigned (the
//! server has recorded its end); those of a sandbox until it is deleted or
//! no longer this runner's.
//!
//! `DIR` is `0700` (made so, and tightened if it exists): everything
//! below is tenant content written as root (homes, image trees, writable
//! layers), and no host user but root has any business traversing to it,
//! least of all to run a file a tenant made setuid.

use api::lifecycle::CommandState;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use oci::config::{SandboxId, SandboxPaths};
use oci::host::{sync_dir, write_durably};
use oci::{Error, Result};

/// The data directory, locked for this runner.
#[derive(Debug)]
pub struct DataDir {
    root: PathBuf,
    /// Where sandboxes' writable layers are (`None`: in each sandbox's
    /// directory), and whether new ones go there:
    /// [`DataDir::place_layers_in`].
    layers: Option<(PathBuf, bool)>,
    /// Holds the exclusive lock for as long as the runner lives.
    _lock: File,
}

impl DataDir {
    /// Creates (if needed) and locks `root`. A second runner on the same
    /// directory would fight the first over every container: refused.
    pub fn open(root: &Path) -> Result<DataDir> {
        if !root.is_absolute() {
            return Err(Error::Invalid(format!(
                "data dir {} must be an absolute path",
                root.display()
            )));
        }
        create_private_dir(root)?;
        for dir in [
            root.join("sandboxes"),
            root.join("homes"),
            root.join("commands"),
        ] {
            std::fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        }
        let lock_path = root.join("lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| Error::io("open", &lock_path, e))?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
            |_| {
                Error::Invalid(format!(
                    "data dir {} is in use by another runner (it holds {})",
                    root.display(),
                    lock_path.display()
                ))
            },
        )?;
        Ok(DataDir {
            root: root.to_path_buf(),
            layers: None,
            _lock: lock,
        })
    }

    /// Finds sandboxes' writable layers under `layers` (`LAYERS/ID`), and
    /// with `new_ones_too` puts new sandboxes' there (made by
    /// `homes::Homes::prepare_layer` before a launch). Without it (a
    /// runner that cannot make them now: no `btrfs` tool, a purge), those
    /// already there are still found, never taken for missing.
    pub fn place_layers_in(&mut self, layers: PathBuf, new_ones_too: bool) {
        self.layers = Some((layers, new_ones_too));
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The OCI runtime's state root: private to this runner.
    pub fn runtime_root(&self) -> PathBuf {
        self.root.join("runtime")
    }

    /// A sandbox's files. Its writable layer stays where its first launch
    /// put it: under the layers' place when there is one, unless the
    /// sandbox already has a layer in its own directory (launched by a
    /// runner from before layers had a place), which is adopted there.
    pub fn sandbox_paths(&self, id: &SandboxId) -> Result<SandboxPaths> {
        let paths = SandboxPaths::new(self.root.join("sandboxes").join(id.as_str()))?;
        let Some((layers, new_ones_too)) = &self.layers else {
            return Ok(paths);
        };
        let layer = layers.join(id.as_str());
        if layer.exists() {
            return paths.with_layer(layer);
        }
        let layer_in_dir = [paths.rootfs(), paths.upper()].iter().any(|d| d.exists());
        if layer_in_dir || !new_ones_too {
            return Ok(paths);
        }
        paths.with_layer(layer)
    }

    pub fn home(&self, id: &SandboxId) -> PathBuf {
        self.root.join("homes").join(id.as_str())
    }

    pub fn commands(&self, id: &SandboxId) -> CommandFiles {
        CommandFiles {
            dir: self.root.join("commands").join(id.as_str()),
        }
    }

    /// The runner id saved by an earlier run, if any.
    pub fn runner_id(&self) -> Result<Option<String>> {
        let path = self.root.join("runner-id");
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let id = text.trim();
                Ok((!id.is_empty()).then(|| id.to_owned()))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("read", &path, e)),
        }
    }

    pub fn save_runner_id(&self, id: &str) -> Result<()> {
        write_durably(&self.root.join("runner-id"), format!("{id}\n").as_bytes())
    }

    /// The runner's own credential saved by an earlier run, if any.
    pub fn runner_token(&self) -> Result<Option<String>> {
        let path = self.root.join("runner-token");
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let token = text.trim();
                Ok((!token.is_empty()).then(|| token.to_owned()))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("read", &path, e)),
        }
    }

    /// Keeps the runner's credential, readable by root alone (mode 0600
    /// from its creation: never readable by others, even for a moment),
    /// fsynced and renamed into place.
    pub fn save_runner_token(&self, token: &str) -> Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.root.join("runner-token");
        let temporary = self.root.join("runner-token.tmp");
        remove_file(&temporary)?;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temporary)
            .map_err(|e| Error::io("create", &temporary, e))?;
        file.write_all(format!("{token}\n").as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(|e| Error::io("write", &temporary, e))?;
        std::fs::rename(&temporary, &path).map_err(|e| Error::io("rename into", &path, e))?;
        sync_dir(&self.root)
    }

    /// Ids of the sandboxes anything is kept for on disk (files, home,
    /// command records), for finding leftovers no longer assigned.
    pub fn sandbox_ids_on_disk(&self) -> Result<Vec<String>> {
        let mut ids = Vec::new();
        for dir in [
            "sandboxes",
            "homes",
            "commands",
            "volumes/homes",
            "volumes/roots",
        ] {
            let dir = self.root.join(dir);
            for name in list(&dir)? {
                if !ids.contains(&name) {
                    ids.push(name);
                }
            }
        }
        ids.sort();
        Ok(ids)
    }
}

/// The data dir's mode: root's alone (see the module documentation).
pub const DATA_DIR_MODE: u32 = 0o700;

/// Creates `root` (and missing parents) and makes it [`DATA_DIR_MODE`],
/// whatever it was: created that mode, so never visible wider, and
/// tightened if an earlier runner (or an operator) left it open.
fn create_private_dir(root: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DATA_DIR_MODE)
        .create(root)
        .map_err(|e| Error::io("create directory", root, e))?;
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(DATA_DIR_MODE))
        .map_err(|e| Error::io("set the mode of", root, e))
}

/// A sandbox's command records (`DIR/commands/ID/`).
#[derive(Clone, Debug)]
pub struct CommandFiles {
    dir: PathBuf,
}

/// What the data dir says about one command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommandRecord {
    /// Never launched by this runner.
    New,
    /// Launched (or about to be), end unknown to the data dir; through
    /// the agent of this incarnation, if through an agent.
    Launched { incarnation: Option<String> },
    /// Ended, as recorded (not necessarily reported yet).
    Ended(RecordedEnd),
}

/// A command's end as it is reported: the state and its details.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedEnd {
    pub state: CommandState,
    pub exit_code: Option<i32>,
    pub signal: Option<String>,
    pub reason: Option<String>,
    /// The command's pid in the sandbox (reported with `running`; not
    /// part of the recorded line).
    pub pid: Option<i32>,
}

impl RecordedEnd {
    pub fn new(state: CommandState) -> RecordedEnd {
        RecordedEnd {
            state,
            exit_code: None,
            signal: None,
            reason: None,
            pid: None,
        }
    }

    /// One line: `STATE EXIT_CODE SIGNAL REASON`, `-` for an absent field.
    /// States, signals and reasons are single words.
    fn to_line(&self) -> String {
        let field = |value: Option<String>| value.unwrap_or_else(|| "-".to_owned());
        format!(
            "{} {} {} {}\n",
            self.state,
            field(self.exit_code.map(|c| c.to_string())),
            field(self.signal.clone()),
            field(self.reason.clone()),
        )
    }

    fn parse(text: &str) -> Option<RecordedEnd> {
        let mut fields = text.split_whitespace();
        let state = fields.next()?.parse().ok()?;
        let mut next = || fields.next().filter(|f| *f != "-").map(str::to_owned);
        let exit_code = match next() {
            Some(code) => Some(code.parse().ok()?),
            None => None,
        };
        Some(RecordedEnd {
            state,
            exit_code,
            signal: next(),
            reason: next(),
            pid: None,
        })
    }
}

impl CommandFiles {
    fn path(&self, command_id: &str, suffix: &str) -> PathBuf {
        self.dir.join(format!("{command_id}.{suffix}"))
    }

    pub fn output(&self, command_id: &str, stream: &str) -> PathBuf {
        self.path(command_id, stream)
    }

    /// Command ids must be one plain file name part; the server's are.
    fn check(command_id: &str) -> Result<()> {
        let ok = !command_id.is_empty()
            && command_id.len() <= 128
            && command_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if ok {
            Ok(())
        } else {
            Err(Error::Invalid(format!("command id {command_id:?}")))
        }
    }

    pub fn record(&self, command_id: &str) -> Result<CommandRecord> {
        Self::check(command_id)?;
        // The end of a command never launched (and of any command, as an
        // earlier runner recorded ends) has a file of its own.
        let end = self.path(command_id, "end");
        match std::fs::read_to_string(&end) {
            Ok(text) => {
                return RecordedEnd::parse(&text)
                    .map(CommandRecord::Ended)
                    .ok_or_else(|| {
                        Error::Invalid(format!("unreadable command end record {}", end.display()))
                    });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("read", &end, e)),
        }
        let launched = self.path(command_id, "launched");
        let text = match std::fs::read_to_string(&launched) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(CommandRecord::New),
            Err(e) => return Err(Error::io("read", &launched, e)),
        };
        // Only whole lines count: an end line cut short (or lost, or left
        // as zeros) by a host crash leaves the command launched, end
        // unknown, which is still true.
        let lines = || {
            text.split_inclusive('\n')
                .filter_map(|line| line.strip_suffix('\n'))
        };
        if let Some(end) = lines()
            .filter_map(|line| line.strip_prefix("end "))
            .find_map(RecordedEnd::parse)
        {
            return Ok(CommandRecord::Ended(end));
        }
        Ok(CommandRecord::Launched {
            incarnation: lines()
                .find_map(|line| line.strip_prefix("incarnation "))
                .map(str::to_owned),
        })
    }

    /// Records, durably, that `command_id` is being launched: the file and
    /// its directory entry are fsynced before this returns, so after any
    /// crash (even of the host) the command is known as possibly run.
    /// `incarnation`: the agent it is launched through (a restarted runner
    /// asks that agent again: it attaches, or starts a command it never
    /// received; see `oci::agent`).
    pub fn record_launch(
        &self,
        command_id: &str,
        epoch: u64,
        incarnation: Option<&str>,
    ) -> Result<()> {
        Self::check(command_id)?;
        // Told by the agent, inside the sandbox: one word or nothing, so
        // it can never add a line (an `end`) to the record.
        if let Some(incarnation) = incarnation
            && (incarnation.is_empty() || incarnation.contains(|c: char| c.is_whitespace()))
        {
            return Err(Error::Invalid(format!("agent incarnation {incarnation:?}")));
        }
        if !self.dir.is_dir() {
            std::fs::create_dir_all(&self.dir)
                .map_err(|e| Error::io("create directory", &self.dir, e))?;
            if let Some(parent) = self.dir.parent() {
                sync_dir(parent)?;
            }
        }
        let path = self.path(command_id, "launched");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| Error::io("create", &path, e))?;
        let mut text = format!("epoch {epoch}\n");
        if let Some(incarnation) = incarnation {
            text.push_str(&format!("incarnation {incarnation}\n"));
        }
        file.write_all(text.as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(|e| Error::io("write", &path, e))?;
        sync_dir(&self.dir)
    }

    /// Records how the command ended, before it is reported, so a restart
    /// reports the same end instead of `unknown`. Not fsynced: a runner
    /// crash keeps it (page cache); a host crash may lose it, and the end
    /// is then reported `unknown`, which is still true.
    ///
    /// A launched command's end is one line appended to its launch record
    /// (one file per command: every file made and removed is work for the
    /// data dir's filesystem); one never launched gets a file of its own.
    pub fn record_end(&self, command_id: &str, end: &RecordedEnd) -> Result<()> {
        Self::check(command_id)?;
        let launched = self.path(command_id, "launched");
        match std::fs::OpenOptions::new().append(true).open(&launched) {
            // One write of one short line: never interleaved or cut short
            // by a crash of this process.
            Ok(mut file) => {
                return file
                    .write_all(format!("end {}", end.to_line()).as_bytes())
                    .map_err(|e| Error::io("write", &launched, e));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("open", &launched, e)),
        }
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| Error::io("create directory", &self.dir, e))?;
        let path = self.path(command_id, "end");
        let temporary = self.path(command_id, "end.tmp");
        std::fs::write(&temporary, end.to_line()).map_err(|e| Error::io("write", &temporary, e))?;
        std::fs::rename(&temporary, &path).map_err(|e| Error::io("rename into", &path, e))
    }

    /// Records that signal request number `seq`, for `requested` (a name
    /// from `api::commands::SIGNALS`), was delivered to the launched
    /// command: a line appended to its launch record, so that a restarted
    /// runner attaching again does not deliver the same request a second
    /// time. Not fsynced (as an end): a host crash ends the command anyway.
    pub fn record_signal(&self, command_id: &str, seq: u64, requested: &str) -> Result<()> {
        Self::check(command_id)?;
        if requested.is_empty() || !requested.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Err(Error::Invalid(format!("signal {requested:?}")));
        }
        let launched = self.path(command_id, "launched");
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&launched)
            .map_err(|e| Error::io("open", &launched, e))?;
        file.write_all(format!("signal {seq} {requested}\n").as_bytes())
            .map_err(|e| Error::io("write", &launched, e))
    }

    /// The signal requests recorded as delivered to `command_id` (number
    /// and name), oldest first (none if it has no launch record).
    pub fn delivered_signals(&self, command_id: &str) -> Result<Vec<(u64, String)>> {
        Self::check(command_id)?;
        let launched = self.path(command_id, "launched");
        let text = match std::fs::read_to_string(&launched) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io("read", &launched, e)),
        };
        // Whole lines only, as `record` reads them.
        Ok(text
            .split_inclusive('\n')
            .filter_map(|line| line.strip_suffix('\n'))
            .filter_map(|line| line.strip_prefix("signal "))
            .filter_map(|line| {
                let (seq, name) = line.split_once(' ')?;
                Some((seq.parse().ok()?, name.to_owned()))
            })
            .collect())
    }

    /// Ids of the commands with files here.
    pub fn command_ids(&self) -> Result<Vec<String>> {
        let mut ids: Vec<String> = list(&self.dir)?
            .into_iter()
            .filter_map(|name| name.split_once('.').map(|(id, _)| id.to_owned()))
            .collect();
        ids.sort();
        ids.dedup();
        Ok(ids)
    }

    /// Removes every file of `command_id`.
    pub fn forget(&self, command_id: &str) -> Result<()> {
        Self::check(command_id)?;
        for suffix in ["stdout", "stderr", "end", "end.tmp", "launched"] {
            remove_file(&self.path(command_id, suffix))?;
        }
        Ok(())
    }

    /// Removes the sandbox's whole command directory.
    pub fn remove_all(&self) -> Result<()> {
        remove_tree(&self.dir)
    }
}

/// Names in `dir` (none if it does not exist).
fn list(dir: &Path) -> Result<Vec<String>> {
    let listing = match std::fs::read_dir(dir) {
        Ok(listing) => listing,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("list", dir, e)),
    };
    let mut names = Vec::new();
    for entry in listing {
        let entry = entry.map_err(|e| Error::io("list", dir, e))?;
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    Ok(names)
}

pub(crate) fn remove_file(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove", path, e)),
    }
}

/// A tree the runner or a sandbox wrote, of any depth
/// (`oci::host::remove_tree`).
pub(crate) fn remove_tree(path: &Path) -> Result<()> {
    oci::host::remove_tree(path)
}

/// Refuses a shared filesystem's `root` that overlaps a directory the
/// runner keeps for itself (`own`: its data dir with every sandbox's
/// home and layer, its secrets' tmpfs), either way round: a sandbox that
/// mounts a subpath of such a root would reach other orgs' homes or
/// secrets, and removing the runner's dir would remove the shared files.
/// Paths are compared as the kernel resolves them (symlinks followed; a
/// part not made yet taken as written).
pub(crate) fn check_apart(id: &str, root: &Path, own: &[(&str, &Path)]) -> Result<()> {
    let root = resolved(root);
    for (what, dir) in own {
        let dir = resolved(dir);
        if root.starts_with(&dir) || dir.starts_with(&root) {
            return Err(Error::Invalid(format!(
                "filesystem {id}: {} overlaps the runner's {what} {}: give a directory apart from it",
                root.display(),
                dir.display()
            )));
        }
    }
    Ok(())
}

/// `path` made absolute, its longest existing ancestor canonicalized and
/// the rest applied as written (`..` taking a part off: nothing below an
/// existing directory that does not exist yet can be a symlink).
fn resolved(path: &Path) -> PathBuf {
    use std::path::Component;
    let Ok(path) = std::path::absolute(path) else {
        return path.to_path_buf();
    };
    let mut existing = path.clone();
    let mut rest = Vec::new();
    let mut out = loop {
        if let Ok(canonical) = existing.canonicalize() {
            break canonical;
        }
        match existing.components().next_back() {
            Some(Component::RootDir) | None => break existing,
            Some(last) => {
                rest.push(last.as_os_str().to_owned());
                existing.pop();
            }
        }
    };
    for part in rest.iter().rev() {
        match Path::new(part).components().next() {
            Some(Component::ParentDir) => {
                out.pop();
            }
            Some(Component::Normal(name)) => out.push(name),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_root_apart_from_the_runners_dirs_is_taken_and_one_overlapping_them_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (srv, data) = (tmp.path().join("srv"), tmp.path().join("srv/roost"));
        std::fs::create_dir_all(&data).expect("dirs");
        std::fs::create_dir_all(tmp.path().join("team")).expect("dirs");
        let secrets = tmp.path().join("run/roost/secrets/x");
        let own = [
            ("data dir", data.as_path()),
            ("secrets dir", secrets.as_path()),
        ];
        check_apart("team", &tmp.path().join("team"), &own).expect("apart");
        for (root, what) in [
            (srv.clone(), "data dir"),
            (data.clone(), "data dir"),
            (data.join("volumes"), "data dir"),
            (tmp.path().join("run"), "secrets dir"),
        ] {
            let err = check_apart("team", &root, &own)
                .expect_err("overlapping")
                .to_string();
            assert!(
                err.contains(&format!("overlaps the runner's {what}")),
                "{err}"
            );
        }
        // Through a symlink, as the kernel would resolve it.
        std::os::unix::fs::symlink(&srv, tmp.path().join("link")).expect("symlink");
        assert!(check_apart("team", &tmp.path().join("link"), &own).is_err());
        // A sibling whose name shares a prefix is apart.
        std::fs::create_dir_all(tmp.path().join("srv/roost-shared")).expect("dirs");
        check_apart("team", &tmp.path().join("srv/roost-shared"), &own).expect("apart");
        // A secrets dir not made yet, named with `..`, is where it lands.
        let team = tmp.path().join("team");
        let up = tmp.path().join("run/later/../../team/secrets");
        assert!(check_apart("team", &team, &[("secrets dir", up.as_path())]).is_err());
    }

    #[test]
    fn ends_round_trip() {
        let ends = [
            RecordedEnd {
                state: CommandState::Exited,
                exit_code: Some(-3),
                signal: None,
                reason: None,
                pid: None,
            },
            RecordedEnd {
                state: CommandState::Interrupted,
                exit_code: None,
                signal: Some("TERM".into()),
                reason: Some("signal_requested".into()),
                pid: None,
            },
            RecordedEnd::new(CommandState::Unknown),
        ];
        for end in ends {
            assert_eq!(RecordedEnd::parse(&end.to_line()), Some(end));
        }
        assert_eq!(RecordedEnd::parse(""), None);
        assert_eq!(RecordedEnd::parse("exited x - -"), None);
    }

    /// Audit finding: a runner restarted while a command ran delivered its
    /// last requested signal again (a second SIGINT to a program that
    /// counts them). Deliveries are lines of the launch record, read back
    /// in order; they leave the record launched and its end readable.
    #[test]
    fn delivered_signals_are_read_back_from_the_launch_record() {
        let tmp = tempfile::tempdir().expect("tmp");
        let data = DataDir::open(tmp.path()).expect("open");
        let files = data.commands(&SandboxId::new("sbx_1").expect("id"));
        assert_eq!(files.delivered_signals("cmd_1").expect("none"), []);
        assert!(
            files.record_signal("cmd_1", 1, "INT").is_err(),
            "not launched"
        );
        files
            .record_launch("cmd_1", 1, Some("inc"))
            .expect("launch");
        files.record_signal("cmd_1", 1, "INT").expect("INT");
        files.record_signal("cmd_1", 2, "INT").expect("INT again");
        files.record_signal("cmd_1", 3, "TERM").expect("TERM");
        assert!(
            files
                .record_signal("cmd_1", 4, "INT\nend exited 0")
                .is_err()
        );
        assert_eq!(
            files.delivered_signals("cmd_1").expect("read"),
            [
                (1, "INT".to_owned()),
                (2, "INT".to_owned()),
                (3, "TERM".to_owned())
            ]
        );
        assert!(matches!(
            files.record("cmd_1").expect("record"),
            CommandRecord::Launched { incarnation: Some(ref i) } if i == "inc"
        ));
        files
            .record_end("cmd_1", &RecordedEnd::new(CommandState::Interrupted))
            .expect("end");
        assert!(matches!(
            files.record("cmd_1").expect("record"),
            CommandRecord::Ended(ref end) if end.state == CommandState::Interrupted
        ));
    }

    #[test]
    fn a_launched_command_stays_launched_until_forgotten() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let data = DataDir::open(tmp.path()).expect("open");
        let id = SandboxId::new("sbx_1").expect("id");
        let files = data.commands(&id);
        assert_eq!(files.record("cmd_1").expect("record"), CommandRecord::New);
        files.record_launch("cmd_1", 3, None).expect("launch");
        assert_eq!(
            files.record("cmd_1").expect("record"),
            CommandRecord::Launched { incarnation: None }
        );
        // Launching twice is refused: the marker is created exclusively.
        assert!(files.record_launch("cmd_1", 3, None).is_err());
        // An incarnation that would add a line is refused, nothing made.
        assert!(
            files
                .record_launch(
                    "cmd_2",
                    3,
                    Some("x\nend not_launched - - sandbox_not_running")
                )
                .is_err()
        );
        assert_eq!(files.record("cmd_2").expect("record"), CommandRecord::New);
        files
            .record_launch("cmd_2", 3, Some("abc123"))
            .expect("launch");
        assert_eq!(
            files.record("cmd_2").expect("record"),
            CommandRecord::Launched {
                incarnation: Some("abc123".to_owned())
            }
        );
        let end = RecordedEnd {
            exit_code: Some(0),
            ..RecordedEnd::new(CommandState::Exited)
        };
        files.record_end("cmd_1", &end).expect("end");
        assert_eq!(
            files.record("cmd_1").expect("record"),
            CommandRecord::Ended(end)
        );
        assert_eq!(
            files.command_ids().expect("ids"),
            vec!["cmd_1".to_owned(), "cmd_2".to_owned()]
        );
        files.forget("cmd_1").expect("forget");
        assert_eq!(files.record("cmd_1").expect("record"), CommandRecord::New);
        assert!(files.record("../x").is_err());
    }

    #[test]
    fn a_launched_commands_end_is_a_whole_line_of_its_launch_record() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let data = DataDir::open(tmp.path()).expect("open");
        let files = data.commands(&SandboxId::new("sbx_1").expect("id"));
        let end = RecordedEnd {
            exit_code: Some(0),
            ..RecordedEnd::new(CommandState::Exited)
        };
        files
            .record_launch("cmd_1", 3, Some("abc123"))
            .expect("launch");
        files.record_end("cmd_1", &end).expect("end");
        let launched = files.path("cmd_1", "launched");
        assert_eq!(
            std::fs::read_to_string(&launched).expect("the launch record"),
            "epoch 3\nincarnation abc123\nend exited 0 - -\n"
        );
        assert!(!files.path("cmd_1", "end").exists(), "a file of its own");
        assert_eq!(
            files.record("cmd_1").expect("record"),
            CommandRecord::Ended(end.clone())
        );

        // What a host crash can leave of an end that was never fsynced: a
        // line cut short, or zeros. The command stays launched, its end
        // unknown (a restart attaches again, or reports `unknown`).
        let launched_only = CommandRecord::Launched {
            incarnation: Some("abc123".to_owned()),
        };
        for torn in [
            "end exited 0",
            "end exited",
            "\0\0\0\0\0\0",
            "end bogus 0 - -\n",
        ] {
            std::fs::write(&launched, format!("epoch 3\nincarnation abc123\n{torn}"))
                .expect("write");
            assert_eq!(
                files.record("cmd_1").expect("record"),
                launched_only,
                "{torn:?}"
            );
        }

        // A command never launched: its end in a file of its own.
        let not_launched = RecordedEnd {
            reason: Some("sandbox_not_running".to_owned()),
            ..RecordedEnd::new(CommandState::NotLaunched)
        };
        files.record_end("cmd_2", &not_launched).expect("end");
        assert!(!files.path("cmd_2", "launched").exists());
        assert_eq!(
            files.record("cmd_2").expect("record"),
            CommandRecord::Ended(not_launched)
        );
        files.forget("cmd_2").expect("forget");
        assert_eq!(files.record("cmd_2").expect("record"), CommandRecord::New);
    }

    /// A sandbox's layer is found where its first launch put it, whatever
    /// this runner would do for a new one.
    #[test]
    fn a_sandboxs_layer_stays_where_its_first_launch_put_it() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut data = DataDir::open(tmp.path()).expect("open");
        let layers = tmp.path().join("volumes/roots");
        let id = |name: &str| SandboxId::new(name).expect("id");
        let dir = |name: &str| tmp.path().join("sandboxes").join(name);

        // No place for layers: in the sandbox's directory.
        let paths = data.sandbox_paths(&id("sbx_a")).expect("paths");
        assert!(!paths.layer_apart());
        assert_eq!(paths.rootfs(), dir("sbx_a").join("rootfs"));

        data.place_layers_in(layers.clone(), true);
        // A new sandbox: in the layers' place.
        let paths = data.sandbox_paths(&id("sbx_new")).expect("paths");
        assert_eq!(paths.layer(), layers.join("sbx_new"));
        assert_eq!(paths.rootfs(), layers.join("sbx_new/rootfs"));
        assert_eq!(paths.upper(), layers.join("sbx_new/upper"));
        assert_eq!(paths.bundle(), dir("sbx_new").join("bundle"));
        // One launched before layers had a place (host image, or image):
        // adopted where it is.
        for (name, layer) in [("sbx_host", "rootfs"), ("sbx_image", "upper")] {
            std::fs::create_dir_all(dir(name).join(layer)).expect("mkdir");
            let paths = data.sandbox_paths(&id(name)).expect("paths");
            assert!(!paths.layer_apart(), "{name}");
        }
        // One whose layer is in the place, found there even by a runner
        // that makes no new ones there (no btrfs tool now, a purge).
        std::fs::create_dir_all(layers.join("sbx_moved/rootfs")).expect("mkdir");
        data.place_layers_in(layers.clone(), false);
        let paths = data.sandbox_paths(&id("sbx_moved")).expect("paths");
        assert_eq!(paths.layer(), layers.join("sbx_moved"));
        let paths = data.sandbox_paths(&id("sbx_other")).expect("paths");
        assert!(!paths.layer_apart(), "a new one stays in its directory");
    }

    #[test]
    fn the_data_dir_is_locked_and_keeps_the_runner_id() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let data = DataDir::open(tmp.path()).expect("open");
        assert!(DataDir::open(tmp.path()).is_err(), "a second runner");
        assert_eq!(data.runner_id().expect("read"), None);
        data.save_runner_id("rnr_1").expect("save");
        drop(data);
        let again = DataDir::open(tmp.path()).expect("reopen after the first let go");
        assert_eq!(again.runner_id().expect("read"), Some("rnr_1".to_owned()));
    }

    /// Issue 14: no host user but root may traverse to what a tenant wrote
    /// (a setuid file in a home or an image tree), whether the data dir is
    /// new or an earlier runner left it open.
    #[test]
    fn the_data_dir_is_roots_alone() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().expect("tempdir");
        let mode =
            |path: &Path| std::fs::metadata(path).expect("stat").permissions().mode() & 0o7777;
        let fresh = tmp.path().join("new/runner");
        drop(DataDir::open(&fresh).expect("open"));
        assert_eq!(mode(&fresh), 0o700);
        let open = tmp.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        drop(DataDir::open(&open).expect("open"));
        assert_eq!(mode(&open), 0o700);
    }

    #[test]
    fn the_runner_token_is_kept_for_root_alone() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().expect("tempdir");
        let data = DataDir::open(tmp.path()).expect("open");
        assert_eq!(data.runner_token().expect("read"), None);
        data.save_runner_token("roost_runnercred_1").expect("save");
        data.save_runner_token("roost_runnercred_2")
            .expect("save again");
        let mode = std::fs::metadata(tmp.path().join("runner-token"))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(
            data.runner_token().expect("read"),
            Some("roost_runnercred_2".to_owned())
        );
    }
}
