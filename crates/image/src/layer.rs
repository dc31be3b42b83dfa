//! Applies one tar stream to a root directory: decompression, member paths
//! confined to the root, special members, whiteouts.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};
use std::ffi::{OsStr, OsString};
use std::fs::{self, DirBuilder, File, OpenOptions, Permissions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use crate::{Error, UnpackReport};

/// Most bytes read from a tar stream between the end of one member's data
/// and the start of the next: headers, GNU long names, PAX extensions. The
/// `tar` crate holds long names and PAX extensions in memory, so a hostile
/// stream could otherwise claim gigabytes for one name.
pub const HEADER_BYTES_MAX: u64 = 16 << 20;

/// Most symlinks followed while resolving one path inside the root, as
/// Linux's `MAXSYMLINKS`.
const SYMLINKS_MAX: u32 = 40;

/// Mode bits kept: permissions and sticky, not setuid or setgid.
const MODE_MASK: u32 = 0o1777;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

/// What to do with `.wh.` members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Whiteouts {
    /// An image layer: whiteouts remove from lower layers.
    Apply,
    /// A plain tar: `.wh.` names are ordinary files.
    Keep,
}

#[derive(Debug, Default)]
pub(crate) struct Counts {
    pub(crate) entries: u64,
    pub(crate) skipped_special: u64,
    pub(crate) skipped_unsafe: u64,
    pub(crate) whiteouts: u64,
}

impl Counts {
    pub(crate) fn add_to(&self, report: &mut UnpackReport) {
        report.entries += self.entries;
        report.skipped_special += self.skipped_special;
        report.skipped_unsafe += self.skipped_unsafe;
        report.whiteouts += self.whiteouts;
    }
}

/// Applies the tar at `archive` (plain, gzip or zstd) onto `root`.
pub(crate) fn apply(
    archive: &Path,
    root: &Path,
    whiteouts: Whiteouts,
    counts: &mut Counts,
) -> Result<(), Error> {
    if whiteouts == Whiteouts::Apply {
        // A layer's whiteouts hide what lower layers have, never what the
        // same layer adds, wherever the marker sits in the stream; applying
        // them all first makes that hold without remembering every member.
        let mut stream = TarStream::open(archive)?;
        stream.for_each(|entry| apply_whiteout(root, entry, counts))?;
    }
    let dir_times = add_members(archive, root, whiteouts, counts)?;
    dir_times.restore(root)
}

/// Adds every member of the tar at `archive` to `root`; directories' times
/// are left for the caller to set once the layer is in.
fn add_members(
    archive: &Path,
    root: &Path,
    whiteouts: Whiteouts,
    counts: &mut Counts,
) -> Result<DirTimes, Error> {
    let mut stream = TarStream::open(archive)?;
    let mut buffer = vec![0u8; 64 * 1024];
    let mut dir_times = DirTimes::default();
    stream.for_each(|entry| {
        add_member(root, entry, whiteouts, counts, &mut buffer, &mut dir_times)
    })?;
    Ok(dir_times)
}

/// The times of a layer's directory members, set once the layer is in
/// (adding members changed them): the same archive then always gives the
/// same tree, and so the same root in the store.
///
/// One entry per directory path, however often the layer repeats it (a
/// small zstd layer can hold millions of `d/` members): memory grows with
/// the distinct directory paths the layer names, each also a directory on
/// disk, never with how often it names them.
#[derive(Debug, Default)]
struct DirTimes {
    /// Path → (when the path was last met, the time its last member gives).
    by_path: HashMap<Vec<OsString>, (u64, SystemTime)>,
    met: u64,
}

impl DirTimes {
    /// Keeps `modified` for `components`; a later member of the same path
    /// replaces an earlier one, as setting every member's time in archive
    /// order would.
    fn record(&mut self, components: Vec<OsString>, modified: SystemTime) {
        self.met += 1;
        self.by_path.insert(components, (self.met, modified));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_path.len()
    }

    /// Sets the times, deepest first, each path resolved again inside the
    /// root (a later member may have replaced a directory on the way with a
    /// symlink), never following a symlink. Equal depths go in the order
    /// last met: two paths through symlinks to one directory then end with
    /// the time of the later member, the same on every run.
    fn restore(self, root: &Path) -> Result<(), Error> {
        let mut times: Vec<_> = self.by_path.into_iter().collect();
        times.sort_by_key(|(components, (met, _))| (Reverse(components.len()), *met));
        for (components, (_, modified)) in times {
            if let Some(dir) = resolve_dir(root, &components, false)? {
                let time = filetime::FileTime::from_system_time(modified);
                filetime::set_symlink_file_times(&dir, time, time).map_err(Error::io(&dir))?;
            }
        }
        Ok(())
    }
}

/// The member's mtime, if the header has one `SystemTime` can hold. A
/// base-256 field can say up to 2^64 - 1 seconds, where adding it to the
/// epoch would panic; such a time is treated as an unreadable one.
fn member_mtime(member: &Member<'_, '_>) -> Option<SystemTime> {
    let seconds = member.entry.header().mtime().ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(seconds))
}

/// Caps the bytes the `tar` crate may read while looking for the next member.
struct BudgetReader<R> {
    inner: R,
    /// Bytes left, or `None` while member data is read (that is streamed).
    budget: Rc<Cell<Option<u64>>>,
}

impl<R: Read> Read for BudgetReader<R> {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        let Some(left) = self.budget.get() else {
            return self.inner.read(buffer);
        };
        if left == 0 {
            return Err(io::Error::other(format!(
                "tar headers of one member exceed {HEADER_BYTES_MAX} bytes"
            )));
        }
        let allowed = usize::try_from(left)
            .unwrap_or(usize::MAX)
            .min(buffer.len());
        let read = self.inner.read(&mut buffer[..allowed])?;
        self.budget.set(Some(left - read as u64));
        Ok(read)
    }
}

struct TarStream {
    path: PathBuf,
    archive: tar::Archive<BudgetReader<Box<dyn Read>>>,
    budget: Rc<Cell<Option<u64>>>,
}

/// One member, with the archive path for error messages.
struct Member<'a, 'b> {
    archive: &'b Path,
    entry: tar::Entry<'a, BudgetReader<Box<dyn Read>>>,
}

impl Member<'_, '_> {
    fn archive_error(&self, source: io::Error) -> Error {
        Error::Archive {
            path: self.archive.to_path_buf(),
            source,
        }
    }
}

impl TarStream {
    fn open(path: &Path) -> Result<TarStream, Error> {
        let file = File::open(path).map_err(Error::io(path))?;
        let mut file = BufReader::with_capacity(64 * 1024, file);
        let head = file.fill_buf().map_err(Error::io(path))?;
        let reader: Box<dyn Read> = if head.starts_with(&[0x1f, 0x8b]) {
            Box::new(flate2::bufread::MultiGzDecoder::new(file))
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            let decoder =
                zstd::stream::read::Decoder::with_buffer(file).map_err(Error::io(path))?;
            Box::new(decoder)
        } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
            return Err(Error::Unsupported(format!(
                "{} is xz-compressed; use plain, gzip or zstd",
                path.display()
            )));
        } else if head.starts_with(b"BZh") {
            return Err(Error::Unsupported(format!(
                "{} is bzip2-compressed; use plain, gzip or zstd",
                path.display()
            )));
        } else {
            Box::new(file)
        };
        let budget = Rc::new(Cell::new(None));
        let archive = tar::Archive::new(BudgetReader {
            inner: reader,
            budget: Rc::clone(&budget),
        });
        Ok(TarStream {
            path: path.to_path_buf(),
            archive,
            budget,
        })
    }

    /// Calls `visit` on every member in order, then reads what it left of
    /// the member's data so that only headers count against the budget.
    /// A GNU sparse member is refused before anyone reads it.
    fn for_each(
        &mut self,
        mut visit: impl FnMut(&mut Member<'_, '_>) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let path = self.path.as_path();
        let archive_error = |source| Error::Archive {
            path: path.to_path_buf(),
            source,
        };
        let mut entries = self.archive.entries().map_err(archive_error)?;
        loop {
            self.budget.set(Some(HEADER_BYTES_MAX));
            let next = entries.next();
            self.budget.set(None);
            let Some(entry) = next else {
                return Ok(());
            };
            let mut member = Member {
                archive: path,
                entry: entry.map_err(archive_error)?,
            };
            refuse_sparse(&member)?;
            visit(&mut member)?;
            // With sparse members refused, a member's reader yields only its
            // own bytes in the archive, so skipping one costs no more.
            io::copy(&mut member.entry, &mut io::sink()).map_err(archive_error)?;
        }
    }
}

/// Refuses a GNU sparse member (typeflag `S`), whatever its name.
///
/// Its reader yields the holes its sparse map claims as zeros the `tar`
/// crate makes up, not read from the archive: one 512-byte header can claim
/// a 2^62-byte hole, which writing fills the disk with and skipping spins on
/// for ever. No image roost unpacks needs them: Go's `archive/tar`, which
/// docker, buildkit and the registries' tools write layers with, never
/// writes sparse members, and GNU tar only does when asked (`--sparse`).
/// They are the only members whose reader yields more than their bytes in
/// the archive: in `tar` 0.4 every other member reads its `size` bytes from
/// the stream and nothing more. (PAX sparse files, `GNU.sparse.*`, are not
/// expanded by the `tar` crate: they are read as the bytes stored.)
fn refuse_sparse(member: &Member<'_, '_>) -> Result<(), Error> {
    if !member.entry.header().entry_type().is_gnu_sparse() {
        return Ok(());
    }
    let name = String::from_utf8_lossy(&member.entry.path_bytes()).into_owned();
    Err(Error::Unsupported(format!(
        "{}: member {} is a GNU sparse file; make the tar without --sparse",
        crate::one_line(member.archive.display()),
        crate::one_line(name)
    )))
}

/// A member path made relative: `/a/./b` is `a/b`.
enum MemberPath {
    /// The root itself (`.` or `/`).
    Root,
    /// Normal components only, at least one.
    Inside(Vec<OsString>),
    /// Holds `..`.
    Unsafe,
}

fn member_path(path: &Path) -> MemberPath {
    let mut components = Vec::new();
    for component in path.components() {
        match component {
            Component::Prefix(_) | Component::RootDir | Component::CurDir => {}
            Component::ParentDir => return MemberPath::Unsafe,
            Component::Normal(name) => components.push(name.to_os_string()),
        }
    }
    if components.is_empty() {
        MemberPath::Root
    } else {
        MemberPath::Inside(components)
    }
}

fn entry_path(member: &Member<'_, '_>) -> Result<MemberPath, Error> {
    let path = member
        .entry
        .path()
        .map_err(|source| member.archive_error(source))?;
    Ok(member_path(&path))
}

fn display(components: &[OsString]) -> String {
    components
        .iter()
        .map(|name| name.to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// Resolves the directory `components` name inside `root` as if `root` were
/// `/`: symlinks on the way are followed, but neither an absolute target nor
/// `..` climbs above `root`. Missing directories are created when `create`,
/// otherwise the answer is `None`, as it is for a path through a file.
fn resolve_dir(
    root: &Path,
    components: &[OsString],
    create: bool,
) -> Result<Option<PathBuf>, Error> {
    enum Step {
        Name(OsString),
        Up,
    }
    let mut pending: VecDeque<Step> = components.iter().cloned().map(Step::Name).collect();
    // `depth` counts components below `root` in `current`, all real
    // directories, so popping never leaves `root`.
    let mut current = root.to_path_buf();
    let mut depth = 0usize;
    let mut symlinks = 0u32;
    while let Some(step) = pending.pop_front() {
        let name = match step {
            Step::Up => {
                if depth > 0 {
                    current.pop();
                    depth -= 1;
                }
                continue;
            }
            Step::Name(name) => name,
        };
        let candidate = current.join(&name);
        match fs::symlink_metadata(&candidate) {
            Ok(metadata) if metadata.is_dir() => {
                current = candidate;
                depth += 1;
            }
            Ok(metadata) if metadata.file_type().is_symlink() => {
                symlinks += 1;
                if symlinks > SYMLINKS_MAX {
                    return Err(Error::Malformed(format!(
                        "more than {SYMLINKS_MAX} symlinks resolving {}",
                        display(components)
                    )));
                }
                let target = fs::read_link(&candidate).map_err(Error::io(&candidate))?;
                let mut steps = Vec::new();
                for component in target.components() {
                    match component {
                        Component::RootDir => {
                            current = root.to_path_buf();
                            depth = 0;
                        }
                        Component::Prefix(_) | Component::CurDir => {}
                        Component::ParentDir => steps.push(Step::Up),
                        Component::Normal(part) => steps.push(Step::Name(part.to_os_string())),
                    }
                }
                for step in steps.into_iter().rev() {
                    pending.push_front(step);
                }
            }
            Ok(_) if create => {
                return Err(Error::Malformed(format!(
                    "{}: a parent is not a directory",
                    display(components)
                )));
            }
            Ok(_) => return Ok(None),
            Err(error) if error.kind() == io::ErrorKind::NotFound && create => {
                DirBuilder::new()
                    .mode(0o755)
                    .create(&candidate)
                    .map_err(Error::io(&candidate))?;
                current = candidate;
                depth += 1;
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(Error::io(&candidate)(error)),
        }
    }
    Ok(Some(current))
}

/// Removes whatever is at `path` without following a symlink there.
fn remove_any(path: &Path) -> Result<(), Error> {
    let result = match fs::symlink_metadata(path) {
        Ok(metadata) if metadata.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(error) => Err(error),
    };
    match result {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(Error::io(path)(error)),
        _ => Ok(()),
    }
}

fn remove_children(dir: &Path) -> Result<(), Error> {
    for child in fs::read_dir(dir).map_err(Error::io(dir))? {
        let child = child.map_err(Error::io(dir))?;
        remove_any(&child.path())?;
    }
    Ok(())
}

fn is_whiteout(name: &OsStr) -> bool {
    name.as_bytes().starts_with(WHITEOUT_PREFIX)
}

fn apply_whiteout(
    root: &Path,
    member: &mut Member<'_, '_>,
    counts: &mut Counts,
) -> Result<(), Error> {
    let MemberPath::Inside(mut components) = entry_path(member)? else {
        return Ok(());
    };
    let Some(name) = components.pop() else {
        return Ok(());
    };
    let name = name.as_bytes();
    if !name.starts_with(WHITEOUT_PREFIX) {
        return Ok(());
    }
    if name == OPAQUE_MARKER {
        counts.whiteouts += 1;
        // The opaque directory itself is not followed if it is a symlink:
        // this layer replaces it with a directory, so it is removed.
        let Some(dir) = components.pop() else {
            return remove_children(root);
        };
        let Some(parent) = resolve_dir(root, &components, false)? else {
            return Ok(());
        };
        let dir = parent.join(dir);
        return match fs::symlink_metadata(&dir) {
            Ok(metadata) if metadata.is_dir() => remove_children(&dir),
            Ok(_) => remove_any(&dir),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(Error::io(&dir)(error)),
        };
    }
    if name.starts_with(b".wh..wh.") {
        // Other aufs metadata (`.wh..wh.plnk`, `.wh..wh.aufs`): not content.
        return Ok(());
    }
    let hidden = &name[WHITEOUT_PREFIX.len()..];
    if hidden.is_empty() || hidden == b"." || hidden == b".." {
        counts.skipped_unsafe += 1;
        return Ok(());
    }
    counts.whiteouts += 1;
    match resolve_dir(root, &components, false)? {
        Some(parent) => remove_any(&parent.join(OsStr::from_bytes(hidden))),
        None => Ok(()),
    }
}

fn add_member(
    root: &Path,
    member: &mut Member<'_, '_>,
    whiteouts: Whiteouts,
    counts: &mut Counts,
    buffer: &mut [u8],
    dir_times: &mut DirTimes,
) -> Result<(), Error> {
    counts.entries += 1;
    let kind = member.entry.header().entry_type();
    if kind.is_pax_global_extensions() {
        return Ok(());
    }
    let mut components = match entry_path(member)? {
        MemberPath::Inside(components) => components,
        // The root's own mode and times belong to the caller.
        MemberPath::Root => return Ok(()),
        MemberPath::Unsafe => {
            counts.skipped_unsafe += 1;
            return Ok(());
        }
    };
    let Some(name) = components.pop() else {
        return Ok(());
    };
    if whiteouts == Whiteouts::Apply && is_whiteout(&name) {
        return Ok(());
    }
    // GNU sparse members were refused before this.
    let regular = kind.is_file() || kind.is_contiguous();
    if !(regular || kind.is_dir() || kind.is_symlink() || kind.is_hard_link()) {
        counts.skipped_special += 1;
        return Ok(());
    }
    let described = {
        let mut all = components.clone();
        all.push(name.clone());
        display(&all)
    };
    let mode = member
        .entry
        .header()
        .mode()
        .map_err(|source| member.archive_error(source))?
        & MODE_MASK;

    // A hard link's target is checked before anything is created for it.
    let link_source = if kind.is_hard_link() {
        match hard_link_source(root, member, &described)? {
            Some(source) => Some(source),
            None => {
                counts.skipped_unsafe += 1;
                return Ok(());
            }
        }
    } else {
        None
    };

    let Some(parent) = resolve_dir(root, &components, true)? else {
        return Err(Error::Malformed(format!(
            "{described}: cannot create its parent"
        )));
    };
    let destination = parent.join(&name);

    if kind.is_dir() {
        match fs::symlink_metadata(&destination) {
            // Directories of several layers merge.
            Ok(metadata) if metadata.is_dir() => {}
            _ => {
                remove_any(&destination)?;
                fs::create_dir(&destination).map_err(Error::io(&destination))?;
            }
        }
        if let Some(modified) = member_mtime(member) {
            let mut all = components.clone();
            all.push(name.clone());
            dir_times.record(all, modified);
        }
        // `destination` is a real directory here, so this follows no symlink.
        return fs::set_permissions(&destination, Permissions::from_mode(mode))
            .map_err(Error::io(&destination));
    }

    if let Some(source) = link_source {
        if source == destination {
            return Ok(());
        }
        remove_any(&destination)?;
        // Linux's link(2) does not follow a symlink at `source`.
        return fs::hard_link(&source, &destination).map_err(Error::io(&destination));
    }

    remove_any(&destination)?;
    if kind.is_symlink() {
        let target = member
            .entry
            .link_name()
            .map_err(|source| member.archive_error(source))?
            .ok_or_else(|| Error::Malformed(format!("{described}: symlink without a target")))?;
        std::os::unix::fs::symlink(&target, &destination).map_err(Error::io(&destination))?;
        if let Some(modified) = member_mtime(member) {
            let time = filetime::FileTime::from_system_time(modified);
            filetime::set_symlink_file_times(&destination, time, time)
                .map_err(Error::io(&destination))?;
        }
        return Ok(());
    }

    // `create_new` refuses to open through a symlink put back at
    // `destination`; the file is owner-only until its data is in.
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&destination)
        .map_err(Error::io(&destination))?;
    let expected = member.entry.size();
    let mut written = 0u64;
    loop {
        let read = match member.entry.read(buffer) {
            Ok(0) => break,
            Ok(read) => read,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(member.archive_error(error)),
        };
        file.write_all(&buffer[..read])
            .map_err(Error::io(&destination))?;
        written += read as u64;
    }
    // The `tar` crate ends a member's data quietly at the end of the stream.
    if written != expected {
        return Err(member.archive_error(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("{described}: truncated after {written} of {expected} bytes"),
        )));
    }
    file.set_permissions(Permissions::from_mode(mode))
        .map_err(Error::io(&destination))?;
    if let Some(modified) = member_mtime(member) {
        file.set_modified(modified)
            .map_err(Error::io(&destination))?;
    }
    Ok(())
}

/// Where a hard link member points, inside `root`; `None` if its target
/// climbs out.
fn hard_link_source(
    root: &Path,
    member: &Member<'_, '_>,
    described: &str,
) -> Result<Option<PathBuf>, Error> {
    let target = member
        .entry
        .link_name()
        .map_err(|source| member.archive_error(source))?
        .ok_or_else(|| Error::Malformed(format!("{described}: hard link without a target")))?;
    let mut components = match member_path(&target) {
        MemberPath::Inside(components) => components,
        MemberPath::Root | MemberPath::Unsafe => return Ok(None),
    };
    let Some(name) = components.pop() else {
        return Ok(None);
    };
    let missing = || {
        Error::Malformed(format!(
            "{described}: hard link to missing {}",
            target.display()
        ))
    };
    let parent = resolve_dir(root, &components, false)?.ok_or_else(missing)?;
    let source = parent.join(name);
    match fs::symlink_metadata(&source) {
        Ok(metadata) if metadata.is_dir() => Err(Error::Malformed(format!(
            "{described}: hard link to directory {}",
            target.display()
        ))),
        Ok(_) => Ok(Some(source)),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Err(missing()),
        Err(error) => Err(Error::io(&source)(error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: every directory member was kept for the times pass, so
    /// a small layer repeating `d/` millions of times grew memory without
    /// bound.
    #[test]
    fn a_repeated_directory_is_kept_once_with_its_last_time() {
        const REPEATS: u64 = 100_000;
        const FIRST_MTIME: u64 = 1_600_000_000;
        let dir = tempfile::tempdir().expect("temp dir");
        let archive = dir.path().join("layer.tar");
        let root = dir.path().join("root");
        fs::create_dir(&root).expect("root");
        let file = io::BufWriter::new(File::create(&archive).expect("create the layer"));
        let mut builder = tar::Builder::new(file);
        for repeat in 0..REPEATS {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(tar::EntryType::Directory);
            header.set_path("d/").expect("a short path");
            header.set_size(0);
            header.set_mode(0o755);
            header.set_mtime(FIRST_MTIME + repeat);
            header.set_cksum();
            builder
                .append(&header, io::empty())
                .expect("write the layer");
        }
        builder
            .into_inner()
            .expect("finish the layer")
            .into_inner()
            .expect("flush the layer");

        let mut counts = Counts::default();
        let dir_times =
            add_members(&archive, &root, Whiteouts::Apply, &mut counts).expect("add members");
        assert_eq!(counts.entries, REPEATS);
        assert_eq!(dir_times.len(), 1);
        dir_times.restore(&root).expect("restore times");
        let modified = fs::metadata(root.join("d"))
            .expect("d")
            .modified()
            .expect("an mtime");
        let last = SystemTime::UNIX_EPOCH + Duration::from_secs(FIRST_MTIME + REPEATS - 1);
        assert_eq!(modified, last);
    }
}
