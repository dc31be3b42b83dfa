//! Turns an image source (a directory, a root-filesystem tar, an OCI image
//! archive or a `docker save` archive) into a root-filesystem directory.
//!
//! # Formats
//!
//! [`unpack`] looks at what `source` is, never at its name:
//!
//! - **A directory** is already a root filesystem and is returned as is.
//! - **A tar archive**, plain or compressed with gzip or zstd (told apart by
//!   their magic bytes `1f 8b` and `28 b5 2f fd`), is unpacked. If its top
//!   level holds `manifest.json` it is a `docker save` archive; if it holds
//!   `index.json` and `oci-layout` it is an OCI image layout; otherwise it is
//!   the root filesystem itself.
//! - **A `docker save` archive**: `manifest.json` is a list of images, each
//!   with `Layers`, paths of layer tars inside the archive. Newer docker
//!   writes an OCI layout too; `manifest.json` wins when both are present.
//! - **An OCI image layout**: `index.json` lists manifests by digest, stored
//!   under `blobs/<algorithm>/<hex>`; an entry may itself be an index (a
//!   multi-platform image), which is followed. Build attestations are not
//!   images and are passed over.
//!
//! Only the first image of an archive is unpacked;
//! [`UnpackReport::images_in_archive`] says how many there were. Layers are
//! applied in order, each plain, gzip or zstd (by magic bytes again), with
//! the OCI whiteouts: `.wh.NAME` removes `NAME` as lower layers left it, and
//! `.wh..wh..opq` empties its directory of everything lower layers put
//! there. Whiteouts only ever touch lower layers, so each layer is read
//! twice: once to apply its whiteouts, once to add its members. Layer
//! digests are not verified.
//!
//! # Safety
//!
//! Archives come from outside and this runs as root, so a hostile archive
//! must not reach the host:
//!
//! - Nothing is written outside the destination. Member paths are made
//!   relative, and a member whose path holds `..` is skipped and counted in
//!   [`UnpackReport::skipped_unsafe`]. Parent directories are resolved
//!   inside the root as if it were `/`: a symlink met on the way is followed
//!   but an absolute target or a `..` can never climb above the root. The
//!   last component is never followed: whatever is there is replaced.
//! - Hard links may only point at members inside the root.
//! - Device nodes, fifos and other special members are skipped and counted
//!   in [`UnpackReport::skipped_special`].
//! - Ownership is not kept (everything belongs to the unpacking user);
//!   permission bits are, less setuid and setgid (the mode is masked with
//!   `0o1777`).
//! - Whiteouts are resolved the same confined way and remove with
//!   `symlink_metadata`: a symlink is removed, never followed.
//! - Inside an image archive a blob path must stay inside the archive, even
//!   through the archive's own symlinks.
//! - GNU sparse members (typeflag `S`) are refused, whatever their name:
//!   the tar reader makes up the holes they claim (one header can claim
//!   2^62 bytes of zeros), and no image needs them. Every other member
//!   reads only its own bytes in the archive, so skipping one costs no
//!   more than those.
//! - Memory is bounded: layers are streamed, JSON documents and the tar
//!   headers of one member have a size cap, and directory times are kept
//!   once per directory path however often a layer repeats it.
//!
//! Directory modes are applied as directories are met, so run as root (as
//! the server does): an unprivileged user cannot add members below a
//! read-only directory. On error `scratch` is left as it is, for the caller
//! to delete.

mod layer;
mod manifest;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

pub use layer::HEADER_BYTES_MAX;
pub use manifest::JSON_BYTES_MAX;

/// What [`unpack`] found at `source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// A directory, used in place.
    Directory,
    /// A tar (plain, gzip or zstd) of a root filesystem.
    Tar,
    /// An OCI image layout in a tar.
    OciArchive,
    /// A `docker save` archive.
    DockerArchive,
}

/// What [`unpack`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpackReport {
    /// What the source was.
    pub kind: SourceKind,
    /// Layers applied: 0 for a directory, 1 for a root-filesystem tar.
    pub layers: usize,
    /// Images an image archive lists at its top level (only the first is
    /// unpacked); 0 for a directory or a root-filesystem tar.
    pub images_in_archive: usize,
    /// Tar members read from the root-filesystem tar or from the layers.
    pub entries: u64,
    /// Device nodes, fifos and other special members skipped.
    pub skipped_special: u64,
    /// Members skipped because their path or link target climbs out with
    /// `..`, in the layers or in the image archive around them.
    pub skipped_unsafe: u64,
    /// Whiteout members applied (`.wh.NAME` and `.wh..wh..opq`).
    pub whiteouts: u64,
}

impl UnpackReport {
    fn new(kind: SourceKind) -> Self {
        UnpackReport {
            kind,
            layers: 0,
            images_in_archive: 0,
            entries: 0,
            skipped_special: 0,
            skipped_unsafe: 0,
            whiteouts: 0,
        }
    }
}

/// `text` with its control characters escaped: a hostile archive's bytes
/// (a member's name, a corrupt header field the tar reader quotes) must
/// not break an error message over several lines.
fn one_line(text: impl std::fmt::Display) -> String {
    text.to_string()
        .chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

/// Why [`unpack`] failed. The messages are one line each.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A filesystem operation failed on the source or under `scratch`.
    #[error("{}: {}", one_line(path.display()), one_line(source))]
    Io { path: PathBuf, source: io::Error },
    /// A tar stream could not be read: truncated, corrupt, not a tar, or
    /// its compression is broken.
    #[error("reading tar archive {}: {}", one_line(path.display()), one_line(source))]
    Archive { path: PathBuf, source: io::Error },
    /// The archive is readable but wrong: bad JSON, a missing or escaping
    /// blob, a member below a file.
    #[error("malformed image: {0}")]
    Malformed(String),
    /// A valid source this crate does not handle (xz, bzip2, encrypted
    /// layers, sockets as source).
    #[error("unsupported image: {0}")]
    Unsupported(String),
    /// `scratch` must be an existing empty directory.
    #[error("scratch directory {} is not empty", .0.display())]
    ScratchNotEmpty(PathBuf),
}

impl Error {
    fn io(path: &Path) -> impl FnOnce(io::Error) -> Error + '_ {
        move |source| Error::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Where an image archive is unpacked inside `scratch` before its layers are
/// applied; removed once they are.
const ARCHIVE_DIR: &str = ".archive";
/// Where the root filesystem ends up inside `scratch`.
const ROOTFS_DIR: &str = "rootfs";

/// Detects what `source` is and produces a root filesystem from it.
///
/// A directory is returned as is, without copying. Anything else is
/// unpacked into `scratch/rootfs`, and that path is returned; `scratch` must
/// be an existing empty directory the caller owns, and the caller deletes it
/// (on success once the root is imported, on error at once).
pub fn unpack(source: &Path, scratch: &Path) -> Result<(PathBuf, UnpackReport), Error> {
    let metadata = fs::metadata(source).map_err(Error::io(source))?;
    if metadata.is_dir() {
        return Ok((
            source.to_path_buf(),
            UnpackReport::new(SourceKind::Directory),
        ));
    }
    if !metadata.is_file() {
        return Err(Error::Unsupported(format!(
            "{} is neither a directory nor a regular file",
            source.display()
        )));
    }
    let mut scratch_entries = fs::read_dir(scratch).map_err(Error::io(scratch))?;
    if scratch_entries.next().is_some() {
        return Err(Error::ScratchNotEmpty(scratch.to_path_buf()));
    }

    // The outer tar is unpacked before it is known to be a root filesystem or
    // an image archive: docker puts `manifest.json` last, and reading a large
    // root-filesystem tar twice would cost more than a rename.
    let archive_dir = scratch.join(ARCHIVE_DIR);
    let rootfs = scratch.join(ROOTFS_DIR);
    fs::create_dir(&archive_dir).map_err(Error::io(&archive_dir))?;
    let mut outer = layer::Counts::default();
    layer::apply(source, &archive_dir, layer::Whiteouts::Keep, &mut outer)?;

    let Some(image) = manifest::detect(&archive_dir)? else {
        fs::rename(&archive_dir, &rootfs).map_err(Error::io(&rootfs))?;
        let mut report = UnpackReport::new(SourceKind::Tar);
        report.layers = 1;
        outer.add_to(&mut report);
        return Ok((rootfs, report));
    };

    fs::create_dir(&rootfs).map_err(Error::io(&rootfs))?;
    let mut counts = layer::Counts {
        skipped_unsafe: outer.skipped_unsafe,
        ..layer::Counts::default()
    };
    for blob in &image.layers {
        layer::apply(blob, &rootfs, layer::Whiteouts::Apply, &mut counts)?;
    }
    fs::remove_dir_all(&archive_dir).map_err(Error::io(&archive_dir))?;

    let mut report = UnpackReport::new(image.kind);
    report.layers = image.layers.len();
    report.images_in_archive = image.images_in_archive;
    counts.add_to(&mut report);
    Ok((rootfs, report))
}
