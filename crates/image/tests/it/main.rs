//! Integration tests for `image::unpack`: archives are built in memory with
//! the `tar` crate, unpacked into temp dirs, and the resulting tree is
//! compared whole. `fuzz` generates hostile archives and manifests and
//! checks the host after each one (property-based, a bounded number of
//! cases).

mod archives;
mod fuzz;
mod hostile;
mod rootfs;

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use image::{Error, UnpackReport};
use tar::{EntryType, Header};
use tempfile::TempDir;

/// One tar member; names and link targets are written raw, so hostile
/// ones (`../x`, `/x`) go in as they are.
pub enum Member<'a> {
    Dir(&'a str, u32),
    File(&'a str, &'a [u8], u32),
    Symlink(&'a str, &'a str),
    Hardlink(&'a str, &'a str),
    CharDevice(&'a str),
    Fifo(&'a str),
    /// A PAX extended header carrying one record, for the next member.
    Pax(&'a str, Vec<u8>),
}

fn header(kind: EntryType, name: &str, link: &str, size: u64, mode: u32) -> Header {
    let mut header = Header::new_gnu();
    let gnu = header.as_gnu_mut().expect("a gnu header is gnu");
    assert!(name.len() < 100 && link.len() < 100, "test names are short");
    gnu.name[..name.len()].copy_from_slice(name.as_bytes());
    gnu.linkname[..link.len()].copy_from_slice(link.as_bytes());
    header.set_entry_type(kind);
    header.set_size(size);
    header.set_mode(mode);
    header.set_mtime(1_700_000_000);
    header.set_cksum();
    header
}

/// A PAX record: `"<length> <key>=<value>\n"`, the length counting itself.
fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
    let rest = key.len() + value.len() + 3;
    let mut length = rest + 1;
    while (length.to_string().len() + rest) != length {
        length = length.to_string().len() + rest;
    }
    let mut record = format!("{length} {key}=").into_bytes();
    record.extend_from_slice(value);
    record.push(b'\n');
    record
}

pub fn tar(members: &[Member<'_>]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for member in members {
        let (header, data): (Header, &[u8]) = match member {
            Member::Dir(name, mode) => (header(EntryType::Directory, name, "", 0, *mode), &[]),
            Member::File(name, data, mode) => (
                header(EntryType::Regular, name, "", data.len() as u64, *mode),
                data,
            ),
            Member::Symlink(name, target) => {
                (header(EntryType::Symlink, name, target, 0, 0o777), &[])
            }
            Member::Hardlink(name, target) => {
                (header(EntryType::Link, name, target, 0, 0o644), &[])
            }
            Member::CharDevice(name) => (header(EntryType::Char, name, "", 0, 0o666), &[]),
            Member::Fifo(name) => (header(EntryType::Fifo, name, "", 0, 0o644), &[]),
            Member::Pax(key, value) => {
                let record = pax_record(key, value);
                let header = header(EntryType::XHeader, "pax", "", record.len() as u64, 0o644);
                builder
                    .append(&header, record.as_slice())
                    .expect("append to a Vec");
                continue;
            }
        };
        builder.append(&header, data).expect("append to a Vec");
    }
    builder.into_inner().expect("finish a Vec")
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).expect("gzip into a Vec");
    encoder.finish().expect("gzip into a Vec")
}

pub fn zstd(bytes: &[u8]) -> Vec<u8> {
    zstd::encode_all(bytes, 1).expect("zstd into a Vec")
}

/// A temp dir with `source` (written from bytes), `scratch` (empty) and
/// `outside` (for hostile archives to aim at) side by side.
pub struct Workspace {
    pub dir: TempDir,
}

impl Workspace {
    pub(crate) fn new() -> Workspace {
        let dir = tempfile::tempdir().expect("temp dir");
        fs::create_dir(dir.path().join("scratch")).expect("scratch");
        fs::create_dir(dir.path().join("outside")).expect("outside");
        Workspace { dir }
    }

    pub fn scratch(&self) -> PathBuf {
        self.dir.path().join("scratch")
    }

    pub fn outside(&self) -> PathBuf {
        self.dir.path().join("outside")
    }

    /// Unpacks `bytes`, stored under a name that says nothing of the format.
    pub fn unpack(&self, bytes: &[u8]) -> Result<(PathBuf, UnpackReport), Error> {
        let source = self.dir.path().join("source.bin");
        fs::write(&source, bytes).expect("write source");
        image::unpack(&source, &self.scratch())
    }
}

/// Every path under `root`, sorted: `dir/ 755`, `file 644 "contents"`,
/// `link -> target`.
pub fn tree(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let mut children: Vec<_> = fs::read_dir(dir)
            .expect("read_dir")
            .map(|entry| entry.expect("dir entry").path())
            .collect();
        children.sort();
        for path in children {
            let relative = path.strip_prefix(root).expect("below root").display();
            let metadata = fs::symlink_metadata(&path).expect("metadata");
            let mode = metadata.permissions().mode() & 0o7777;
            if metadata.file_type().is_symlink() {
                let target = fs::read_link(&path).expect("read_link");
                out.push(format!("{relative} -> {}", target.display()));
            } else if metadata.is_dir() {
                out.push(format!("{relative}/ {mode:o}"));
                walk(root, &path, out);
            } else {
                let contents = fs::read(&path).expect("read");
                out.push(format!(
                    "{relative} {mode:o} {:?}",
                    String::from_utf8_lossy(&contents)
                ));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out
}

/// Unwraps a successful unpack, printing the error otherwise.
pub fn ok(result: Result<(PathBuf, UnpackReport), Error>) -> (PathBuf, UnpackReport) {
    match result {
        Ok(done) => done,
        Err(error) => panic!("unpack failed: {error}"),
    }
}
