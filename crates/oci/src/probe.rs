//! Host probing: what the default image takes from this host's own system
//! ([`HostSystem`]: its system directories, the SSH host keys to mask, swap
//! accounting, the open-file ceiling) and what the init binary needs to run
//! inside an imported image ([`init_linkage`]: its ELF interpreter, found
//! by reading the ELF headers, and the libraries that loader resolves).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use crate::config::RootImage;
use crate::error::{Error, Result};
use crate::host::{ToolFailureKind, run_tool};

/// One top-level entry of the host's system that the default image shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SystemEntry {
    /// A host directory, bind-mounted read-only at the same path.
    Directory(String),
    /// A host symlink such as `/bin -> usr/bin`, recreated in the rootfs.
    Symlink { path: String, target: PathBuf },
}

/// What the default image takes from the host, probed once per runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostSystem {
    pub entries: Vec<SystemEntry>,
    /// Extra paths the default image masks: everything under the host's
    /// `/etc` that the host's other users cannot read ([`private_paths`]:
    /// shadow files, SSH host keys, `/etc/ssl/private`, a database's
    /// access rules). Root in a sandbox holds `CAP_DAC_OVERRIDE`, so
    /// without the mask it would read them all.
    pub secret_paths: Vec<String>,
    /// Whether the memory cgroup accounts swap; only then can the config
    /// pin swap to zero (`memory.swap` = `memory.limit`).
    pub swap_accounting: bool,
    /// The runner's own hard limit on open files. The sandbox's cannot be
    /// higher unless the runner holds CAP_SYS_RESOURCE, so it is capped
    /// here rather than failing every create.
    pub nofile_hard_max: u64,
}

impl HostSystem {
    /// What a sandbox takes from the host's system: everything for the
    /// default image, nothing for an imported one.
    pub fn entries_for(&self, image: &RootImage) -> &[SystemEntry] {
        match image {
            RootImage::Host => &self.entries,
            RootImage::Tree(_) => &[],
        }
    }

    /// Reads `/` for `usr`, `etc`, `bin`, `sbin` and `lib*`, and `/etc` for
    /// what others cannot read ([`private_paths`]).
    pub fn probe(swap_accounting: bool) -> Result<Self> {
        let mut entries = Vec::new();
        let root = Path::new("/");
        let listing = std::fs::read_dir(root).map_err(|e| Error::io("list", root, e))?;
        let mut names: Vec<String> = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|e| Error::io("list", root, e))?;
            if let Ok(name) = entry.file_name().into_string()
                && (matches!(name.as_str(), "usr" | "etc" | "bin" | "sbin")
                    || name.starts_with("lib"))
            {
                names.push(name);
            }
        }
        names.sort();
        for name in names {
            let path = format!("/{name}");
            let metadata =
                std::fs::symlink_metadata(&path).map_err(|e| Error::io("inspect", &path, e))?;
            if metadata.file_type().is_symlink() {
                let target = std::fs::read_link(&path).map_err(|e| Error::io("read", &path, e))?;
                entries.push(SystemEntry::Symlink { path, target });
            } else if metadata.is_dir() {
                entries.push(SystemEntry::Directory(path));
            }
        }
        for required in ["/usr", "/etc"] {
            if !entries
                .iter()
                .any(|e| matches!(e, SystemEntry::Directory(p) if p == required))
            {
                return Err(Error::Unsupported(format!(
                    "the default image needs the host directory {required}"
                )));
            }
        }
        let secret_paths = private_paths(Path::new("/etc"))?;
        let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        Ok(HostSystem {
            entries,
            secret_paths,
            swap_accounting,
            nofile_hard_max: nofile.maximum.unwrap_or(u64::MAX),
        })
    }
}

/// Most private paths [`private_paths`] masks. A host whose `/etc` holds
/// more is refused rather than shown partly unmasked: each is a mount in
/// every sandbox, and a few dozen is what a Debian host with a database
/// and a web server has.
pub const PRIVATE_PATHS_MAX: usize = 512;
/// Most entries [`private_paths`] looks at: `/etc` is configuration, a
/// few thousand entries; one far larger is a mistake to refuse, not walk.
const ETC_ENTRIES_MAX: usize = 200_000;

/// The paths under `etc` (the host's `/etc`, or a test's stand-in) that
/// the host's other users cannot read, as they appear in a sandbox
/// (`/etc/...`): a file without read permission for others, or a
/// directory without read and search permission for others (masked
/// whole, not entered). The rule, rather than a list of known secrets,
/// because what an operator installs next (a TLS key, a token file) is
/// unknown here, and whoever made it private said so with its mode. A
/// sandbox on the default image so reads, under `/etc`, exactly what an
/// unprivileged user of the host could. Symlinks are left alone: they
/// lead to a path that is itself masked or readable. Sorted; walked
/// without recursion.
pub fn private_paths(etc: &Path) -> Result<Vec<String>> {
    use std::os::unix::fs::PermissionsExt;
    const OTHERS_READ: u32 = 0o004;
    const OTHERS_READ_SEARCH: u32 = 0o005;
    let mut private = Vec::new();
    let mut seen = 0usize;
    // (the directory on this host, its path in the sandbox)
    let mut stack = vec![(etc.to_path_buf(), String::from("/etc"))];
    while let Some((dir, shown)) = stack.pop() {
        let listing = std::fs::read_dir(&dir).map_err(|e| Error::io("list", &dir, e))?;
        for entry in listing {
            let entry = entry.map_err(|e| Error::io("list", &dir, e))?;
            seen += 1;
            if seen > ETC_ENTRIES_MAX {
                return Err(Error::Unsupported(format!(
                    "{} holds more than {ETC_ENTRIES_MAX} entries: too many to check for private files",
                    etc.display()
                )));
            }
            let Ok(name) = entry.file_name().into_string() else {
                // A name the spec cannot carry: mask its directory instead.
                private.push(shown.clone());
                continue;
            };
            let path = entry.path();
            let metadata =
                std::fs::symlink_metadata(&path).map_err(|e| Error::io("inspect", &path, e))?;
            let mode = metadata.permissions().mode();
            let shown_child = format!("{shown}/{name}");
            if metadata.file_type().is_symlink() {
                continue;
            } else if metadata.is_dir() {
                if mode & OTHERS_READ_SEARCH == OTHERS_READ_SEARCH {
                    stack.push((path, shown_child));
                } else {
                    private.push(shown_child);
                }
            } else if mode & OTHERS_READ == 0 {
                private.push(shown_child);
            }
        }
    }
    private.sort();
    private.dedup();
    // A directory masked for an odd name covers what was found inside it.
    let covered: Vec<String> = private.clone();
    private.retain(|p| {
        !covered.iter().any(|dir| {
            p.len() > dir.len() && p.starts_with(dir.as_str()) && p.as_bytes()[dir.len()] == b'/'
        })
    });
    if private.len() > PRIVATE_PATHS_MAX {
        return Err(Error::Unsupported(format!(
            "{} holds {} files others cannot read, more than the {PRIVATE_PATHS_MAX} the default image can mask",
            etc.display(),
            private.len()
        )));
    }
    Ok(private)
}

/// What a dynamically linked init needs from the host to run in a root
/// that is not the host's: its ELF interpreter and the libraries it loads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitLinkage {
    pub loader: PathBuf,
    pub libs: Vec<PathBuf>,
}

/// The init binary's linkage (`None` for a static binary), found once per
/// binary: its `PT_INTERP`, then the libraries that loader resolves
/// (`ld.so --list`, which is what `ldd` runs).
pub fn init_linkage(init: &Path) -> Result<Option<InitLinkage>> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static FOUND: OnceLock<Mutex<HashMap<PathBuf, Option<InitLinkage>>>> = OnceLock::new();
    let found = FOUND.get_or_init(Default::default);
    if let Some(known) = found.lock().ok().and_then(|map| map.get(init).cloned()) {
        return Ok(known);
    }
    let linkage = match elf_interpreter(init)? {
        None => None,
        Some(loader) => {
            let listed = run_tool(&loader, &[OsStr::new("--list"), init.as_os_str()], None)
                .map_err(|failure| match failure.kind {
                    ToolFailureKind::Run { source, .. } => Error::io("run", &loader, source),
                    ToolFailureKind::Exited { stderr, .. } => Error::Unsupported(format!(
                        "{} --list {} failed: {}",
                        loader.display(),
                        init.display(),
                        stderr.trim()
                    )),
                })?;
            let libs = listed
                .lines()
                .filter_map(|line| line.split_once(" => ").map(|(_, rest)| rest))
                .filter_map(|rest| rest.split(" (").next())
                .map(PathBuf::from)
                .filter(|path| path.is_absolute())
                .collect();
            Some(InitLinkage { loader, libs })
        }
    };
    if let Ok(mut map) = found.lock() {
        map.insert(init.to_path_buf(), linkage.clone());
    }
    Ok(linkage)
}

/// The `PT_INTERP` of a 64-bit little-endian ELF file, `None` if it has
/// none (a static binary). Reads the headers only, not the whole binary.
fn elf_interpreter(path: &Path) -> Result<Option<PathBuf>> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::FileExt;
    const PT_INTERP: u32 = 3;
    const PHDR_BYTES: usize = 56;
    let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let unsupported = || {
        Error::Unsupported(format!(
            "{} is not a 64-bit little-endian ELF binary",
            path.display()
        ))
    };
    let read = |offset: u64, len: usize| -> Result<Vec<u8>> {
        let mut buffer = vec![0u8; len];
        file.read_exact_at(&mut buffer, offset)
            .map_err(|_| unsupported())?;
        Ok(buffer)
    };
    let le = |bytes: &[u8]| {
        bytes
            .iter()
            .rev()
            .fold(0u64, |n, b| (n << 8) | u64::from(*b))
    };
    let header = read(0, 64)?;
    if header[..6] != [0x7f, b'E', b'L', b'F', 2, 1] {
        return Err(unsupported());
    }
    let phoff = le(&header[0x20..0x28]);
    let phentsize = le(&header[0x36..0x38]);
    let phnum = le(&header[0x38..0x3a]);
    if phentsize < PHDR_BYTES as u64 || phnum > 4096 {
        return Err(unsupported());
    }
    for i in 0..phnum {
        let phdr = read(phoff + i * phentsize, PHDR_BYTES)?;
        if le(&phdr[0..4]) != u64::from(PT_INTERP) {
            continue;
        }
        let (offset, size) = (le(&phdr[8..16]), le(&phdr[0x20..0x28]));
        if size == 0 || size > 4096 {
            return Err(unsupported());
        }
        let raw = read(offset, size as usize)?;
        let name = raw.split(|b| *b == 0).next().unwrap_or_default();
        return Ok(Some(PathBuf::from(std::ffi::OsStr::from_bytes(name))));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn make(path: &Path, mode: u32, dir: bool) {
        if dir {
            std::fs::create_dir(path).expect("mkdir");
        } else {
            std::fs::write(path, "x").expect("write");
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    /// Private means "others cannot read it", whatever its name; a private
    /// directory is masked whole and not entered; symlinks are left alone.
    #[test]
    fn private_paths_are_what_others_cannot_read() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let etc = tmp.path();
        make(&etc.join("passwd"), 0o644, false);
        make(&etc.join("shadow"), 0o640, false);
        make(&etc.join("ssl"), 0o755, true);
        make(&etc.join("ssl/certs"), 0o755, true);
        make(&etc.join("ssl/certs/ca.pem"), 0o644, false);
        make(&etc.join("ssl/private"), 0o755, true);
        make(&etc.join("ssl/private/key.pem"), 0o600, false);
        make(&etc.join("ssl/private/readable"), 0o644, false);
        make(&etc.join("vault"), 0o711, true);
        make(&etc.join("vault/token"), 0o644, false);
        std::os::unix::fs::symlink("shadow", etc.join("shadow-link")).expect("symlink");
        assert_eq!(
            private_paths(etc).expect("walk"),
            ["/etc/shadow", "/etc/ssl/private/key.pem", "/etc/vault"]
        );
    }

    #[test]
    fn a_deep_etc_is_walked_without_recursion() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut deepest = tmp.path().to_path_buf();
        for _ in 0..300 {
            deepest.push("d");
        }
        std::fs::create_dir_all(&deepest).expect("mkdir -p");
        make(&deepest.join("key"), 0o600, false);
        let found = std::thread::Builder::new()
            .stack_size(128 * 1024)
            .spawn({
                let etc = tmp.path().to_path_buf();
                move || private_paths(&etc).expect("walk")
            })
            .expect("spawn")
            .join()
            .expect("no overflow");
        assert_eq!(found.len(), 1);
        assert!(found[0].ends_with("/d/key"), "{found:?}");
    }
}
