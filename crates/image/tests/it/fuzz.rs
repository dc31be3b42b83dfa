//! Property-based fuzzing of `image::unpack` where hostile bytes enter: the
//! layer applier (a root-filesystem tar, and layers with whiteouts inside
//! an image archive) and the manifest reader (`manifest.json`, an OCI
//! `index.json` and the manifests and indexes it names).
//!
//! Generators build archives member by member from path tricks: `..`,
//! absolute paths, symlinks to the host and then members through them,
//! hard links in and out, device nodes and fifos, setuid modes, whiteouts
//! and opaque markers, names past the 100-byte header field and deep paths.
//! The archives are then broken byte by byte (with header checksums fixed
//! up, so the breakage reaches the parser) and compressed or not. Manifests
//! are generated with blob paths and digests of every escaping shape,
//! nested and cyclic indexes, and as valid JSON broken byte by byte.
//! Properties, checked on the filesystem after every case: no panic;
//! a refusal is a typed `image::Error` on one line; nothing outside the
//! scratch directory is written, changed, linked to or removed; the root
//! holds no setuid or setgid file and no device node or fifo.
//!
//! Each target runs a bounded number of cases (a few seconds in a debug
//! build); `PROPTEST_CASES=10000 cargo test -p image --test it fuzz::` runs
//! them longer. A failing case is saved under `proptest-regressions/` and
//! replayed first on every later run.

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use proptest::prelude::*;
use proptest::sample::Index;
use tar::{EntryType, Header};

use crate::hostile::{outside_state, seed_outside};
use crate::{Workspace, gzip, zstd};

/// `cases` unless `PROPTEST_CASES` asks for another number.
fn config(cases: u32) -> ProptestConfig {
    let mut config = ProptestConfig::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = cases;
    }
    config
}

/// Stands for the workspace's `outside` directory (an absolute host path)
/// in generated names and targets; replaced when the archive is written.
const OUTSIDE: &str = "@OUT";

#[derive(Clone, Debug)]
enum Kind {
    Dir,
    File(Vec<u8>),
    Symlink(String),
    Hardlink(String),
    CharDevice,
    BlockDevice,
    Fifo,
}

#[derive(Clone, Debug)]
struct Member {
    path: String,
    kind: Kind,
    mode: u32,
}

fn component() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "a",
        "b",
        "link",
        "up",
        "hard",
        "..",
        ".",
        "",
        ".wh.a",
        ".wh.link",
        ".wh..wh..opq",
        ".wh..",
        ".wh...",
        ".wh..wh.plnk",
        "victim",
        "dir",
    ])
    .prop_map(str::to_owned)
}

fn member_path() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => (
            prop::sample::select(vec!["", "/", "./", "../", "@OUT/"]),
            prop::collection::vec(component(), 1..4),
            any::<bool>(),
        )
            .prop_map(|(lead, parts, slash)| {
                format!("{lead}{}{}", parts.join("/"), if slash { "/" } else { "" })
            }),
        // Past the header's 100-byte name field (a GNU long name), and deep.
        1 => (1usize..60).prop_map(|n| "a/".repeat(n) + "long-name-past-the-header-field"),
        1 => (100usize..400).prop_map(|n| "d/".repeat(n) + "deep"),
    ]
}

fn link_target() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "@OUT",
            "@OUT/victim",
            "@OUT/dir",
            "..",
            "../..",
            "../../outside",
            "../../outside/victim",
            "a",
            "a/b",
            "link",
            "up/..",
            "/",
            "/a",
            ".",
            "",
        ])
        .prop_map(str::to_owned),
        1 => member_path(),
    ]
}

fn mode() -> impl Strategy<Value = u32> {
    prop::sample::select(vec![
        0o755, 0o644, 0o700, 0o777, 0o1777, 0o4755, 0o2755, 0o6777,
    ])
}

fn member() -> impl Strategy<Value = Member> {
    let kind = prop_oneof![
        3 => Just(Kind::Dir),
        4 => prop::collection::vec(any::<u8>(), 0..600).prop_map(Kind::File),
        3 => link_target().prop_map(Kind::Symlink),
        2 => link_target().prop_map(Kind::Hardlink),
        1 => prop::sample::select(vec![Kind::CharDevice, Kind::BlockDevice, Kind::Fifo]),
    ];
    (member_path(), kind, mode()).prop_map(|(path, kind, mode)| Member { path, kind, mode })
}

fn members() -> impl Strategy<Value = Vec<Member>> {
    prop::collection::vec(member(), 0..12)
}

/// A GNU long-name (`L`) or long-link (`K`) member for `name`.
fn append_long(builder: &mut tar::Builder<Vec<u8>>, kind: u8, name: &[u8]) {
    let mut header = Header::new_gnu();
    header.as_gnu_mut().expect("gnu").name[..13].copy_from_slice(b"././@LongLink");
    header.set_entry_type(EntryType::new(kind));
    let data = [name, b"\0"].concat();
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    header.set_cksum();
    builder
        .append(&header, data.as_slice())
        .expect("append to a Vec");
}

/// Writes `members` as a tar, names and targets raw (`..` and absolute
/// paths go in as they are), `@OUT` replaced by `outside`.
fn write_tar(members: &[Member], outside: &str) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for member in members {
        let path = member.path.replace(OUTSIDE, outside);
        let (kind, link, data): (EntryType, String, &[u8]) = match &member.kind {
            Kind::Dir => (EntryType::Directory, String::new(), &[]),
            Kind::File(data) => (EntryType::Regular, String::new(), data),
            Kind::Symlink(target) => (EntryType::Symlink, target.replace(OUTSIDE, outside), &[]),
            Kind::Hardlink(target) => (EntryType::Link, target.replace(OUTSIDE, outside), &[]),
            Kind::CharDevice => (EntryType::Char, String::new(), &[]),
            Kind::BlockDevice => (EntryType::Block, String::new(), &[]),
            Kind::Fifo => (EntryType::Fifo, String::new(), &[]),
        };
        if path.len() >= 100 {
            append_long(&mut builder, b'L', path.as_bytes());
        }
        if link.len() >= 100 {
            append_long(&mut builder, b'K', link.as_bytes());
        }
        let mut header = Header::new_gnu();
        let gnu = header.as_gnu_mut().expect("gnu");
        let name = &path.as_bytes()[..path.len().min(99)];
        gnu.name[..name.len()].copy_from_slice(name);
        let target = &link.as_bytes()[..link.len().min(99)];
        gnu.linkname[..target.len()].copy_from_slice(target);
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(member.mode);
        header.set_mtime(1_700_000_000);
        header.set_cksum();
        builder.append(&header, data).expect("append to a Vec");
    }
    builder.into_inner().expect("finish a Vec")
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(Index, u8),
    Insert(Index, u8),
    Delete(Index),
    Truncate(Index),
    /// An octal or binary size, mode or mtime field made extreme.
    Field(Index, Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip(at, bit)),
        (any::<Index>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert(at, byte)),
        any::<Index>().prop_map(Mutation::Delete),
        any::<Index>().prop_map(Mutation::Truncate),
        (
            any::<Index>(),
            prop::sample::select(vec![
                b"77777777777\0".to_vec(),
                b"00000000000\0".to_vec(),
                vec![0x80, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff],
                vec![0xff; 12],
                b"99999999999\0".to_vec(),
            ])
        )
            .prop_map(|(at, field)| Mutation::Field(at, field)),
    ]
}

/// Applies `mutations`, then (if `fix`) recomputes the checksum of every
/// block that still looks like a tar header, so a broken field reaches the
/// parser instead of failing the checksum.
fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation], fix: bool) -> Vec<u8> {
    for mutation in mutations {
        let len = bytes.len();
        match mutation {
            Mutation::Flip(at, bit) if len > 0 => bytes[at.index(len)] ^= 1u8 << bit,
            Mutation::Insert(at, byte) => bytes.insert(at.index(len + 1), *byte),
            Mutation::Delete(at) if len > 0 => {
                bytes.remove(at.index(len));
            }
            Mutation::Truncate(at) => bytes.truncate(at.index(len + 1)),
            Mutation::Field(at, field) if len >= 512 => {
                // The size (124), mtime (136) or mode (100) field of a block.
                let block = at.index(len / 512) * 512;
                let offset = [124, 136, 100][at.index(3)];
                let width = if offset == 100 { 8 } else { 12 };
                bytes[block + offset..block + offset + width].copy_from_slice(&field[..width]);
            }
            _ => {}
        }
    }
    if fix {
        for block in bytes.chunks_exact_mut(512) {
            if &block[257..262] == b"ustar" {
                let mut header = Header::new_old();
                header.as_mut_bytes().copy_from_slice(block);
                header.set_cksum();
                block.copy_from_slice(header.as_bytes());
            }
        }
    }
    bytes
}

#[derive(Clone, Copy, Debug)]
enum Compression {
    Plain,
    Gzip,
    Zstd,
}

fn compress(bytes: &[u8], compression: Compression) -> Vec<u8> {
    match compression {
        Compression::Plain => bytes.to_vec(),
        Compression::Gzip => gzip(bytes),
        Compression::Zstd => zstd(bytes),
    }
}

fn compression() -> impl Strategy<Value = Compression> {
    prop_oneof![
        3 => Just(Compression::Plain),
        1 => Just(Compression::Gzip),
        1 => Just(Compression::Zstd),
    ]
}

/// A tar: members, then broken, then compressed.
#[derive(Clone, Debug)]
struct Tarball {
    members: Vec<Member>,
    mutations: Vec<Mutation>,
    fix_checksums: bool,
    compression: Compression,
}

fn tarball() -> impl Strategy<Value = Tarball> {
    (
        members(),
        prop_oneof![
            3 => Just(Vec::new()),
            2 => prop::collection::vec(mutation(), 1..4),
        ],
        any::<bool>(),
        compression(),
    )
        .prop_map(|(members, mutations, fix_checksums, compression)| Tarball {
            members,
            mutations,
            fix_checksums,
            compression,
        })
}

impl Tarball {
    fn bytes(&self, outside: &str) -> Vec<u8> {
        let tar = mutate(
            write_tar(&self.members, outside),
            &self.mutations,
            self.fix_checksums,
        );
        compress(&tar, self.compression)
    }
}

/// What the host must still look like, beside `outside_state`: the
/// victim's link count (no hard link was made to it) and the workspace's
/// top level (nothing added beside `scratch`).
fn host_state(workspace: &Workspace) -> (Vec<String>, u64) {
    let victim = fs::symlink_metadata(workspace.outside().join("victim")).expect("victim");
    (outside_state(workspace), victim.nlink())
}

/// Every path under `dir`, without following a symlink: none is setuid or
/// setgid, a device node, a fifo or a socket.
fn check_tree(dir: &Path) -> Result<(), TestCaseError> {
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(children) = fs::read_dir(&dir) else {
            continue;
        };
        for child in children {
            let child = child.expect("a directory entry").path();
            let metadata = fs::symlink_metadata(&child).expect("metadata");
            let kind = metadata.file_type();
            prop_assert!(
                !(kind.is_char_device()
                    || kind.is_block_device()
                    || kind.is_fifo()
                    || kind.is_socket()),
                "special file {}",
                child.display()
            );
            if !kind.is_symlink() {
                prop_assert_eq!(
                    metadata.mode() & 0o6000,
                    0,
                    "setuid or setgid {}",
                    child.display()
                );
            }
            if kind.is_dir() {
                pending.push(child);
            }
        }
    }
    Ok(())
}

/// Unpacks what `archive` writes (given the outside directory's path) in a
/// fresh workspace whose host side is seeded, and checks the properties.
fn check_unpack(archive: impl FnOnce(&str) -> Vec<u8>) -> Result<(), TestCaseError> {
    let workspace = Workspace::new();
    seed_outside(&workspace);
    let before = host_state(&workspace);
    let outside = workspace.outside();
    let bytes = archive(outside.to_str().expect("a utf-8 temp path"));
    let result = workspace.unpack(&bytes);
    prop_assert_eq!(host_state(&workspace), before);
    // Whatever was unpacked, or left half-done on error, is confined and
    // harmless.
    check_tree(&workspace.scratch())?;
    if let Err(error) = result {
        let message = error.to_string();
        prop_assert!(!message.contains('\n'), "not one line: {:?}", message);
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Manifests.

/// A blob path as `manifest.json` names a layer.
fn blob_path() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["lower.tar", "upper.tar"]).prop_map(str::to_owned),
        2 => prop::sample::select(vec![
            "../layer.tar",
            "/etc/hostname",
            "@OUT/victim",
            "link/victim",
            "self/victim",
            ".",
            "",
            "./",
            "blobs",
            "manifest.json",
            "lower.tar/",
            "lower.tar/..",
            "lower.tar\u{0}x",
        ])
        .prop_map(str::to_owned),
    ]
}

/// A digest as an OCI descriptor names a blob.
fn digest() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["sha256:1111", "sha256:2222", "sha256:aaaa", "sha256:dddd"])
            .prop_map(str::to_owned),
        2 => prop::sample::select(vec![
            "sha256:../../outside/victim",
            "sha256:..",
            "sha256:",
            ":1111",
            "sha256",
            "SHA256:1111",
            "sha256:a/b",
            "sha256:1111:2222",
            "../sha256:1111",
            "sha256:link",
            "sha256:\u{e9}",
        ])
        .prop_map(str::to_owned),
    ]
}

/// A descriptor; sometimes encrypted, sometimes an attestation.
fn descriptor() -> impl Strategy<Value = String> {
    (
        digest(),
        prop::sample::select(vec![
            "application/vnd.oci.image.manifest.v1+json",
            "application/vnd.oci.image.index.v1+json",
            "application/vnd.oci.image.layer.v1.tar+encrypted",
            "application/vnd.oci.image.layer.v1.tar+gzip",
        ]),
        any::<bool>(),
    )
        .prop_map(|(digest, media_type, attestation)| {
            let annotations = if attestation {
                r#""vnd.docker.reference.type":"attestation-manifest""#
            } else {
                ""
            };
            format!(
                r#"{{"mediaType":"{media_type}","digest":"{digest}","size":1,"annotations":{{{annotations}}}}}"#
            )
        })
}

/// An OCI document: an index (`manifests`), an image manifest (`layers`),
/// both, neither, or a JSON value of another shape entirely.
fn oci_document() -> impl Strategy<Value = String> {
    let list = || prop::collection::vec(descriptor(), 0..4).prop_map(|d| d.join(","));
    prop_oneof![
        3 => list().prop_map(|m| format!(r#"{{"schemaVersion":2,"manifests":[{m}]}}"#)),
        3 => list().prop_map(|l| format!(r#"{{"schemaVersion":2,"layers":[{l}]}}"#)),
        1 => (list(), list()).prop_map(|(m, l)| format!(r#"{{"manifests":[{m}],"layers":[{l}]}}"#)),
        1 => prop::sample::select(vec![
            "{}",
            "[]",
            "null",
            "\"x\"",
            r#"{"manifests":null,"layers":null}"#,
            r#"{"manifests":[{"digest":7}]}"#,
            r#"{"layers":[{}]}"#,
        ])
        .prop_map(str::to_owned),
        // Past serde_json's recursion limit.
        1 => (100usize..2_000).prop_map(|n| "[".repeat(n) + &"]".repeat(n)),
    ]
}

fn docker_manifest() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::collection::vec(blob_path(), 0..4).prop_map(|layers| {
            let layers: Vec<String> = layers.iter().map(|l| format!("{l:?}")).collect();
            format!(r#"[{{"Layers":[{}]}}]"#, layers.join(","))
        }),
        1 => prop::sample::select(vec![
            "[]",
            "{}",
            r#"[{"Layers":null}]"#,
            r#"[{"Layers":[7]}]"#,
            r#"[{}]"#,
            "",
        ])
        .prop_map(str::to_owned),
        1 => (100usize..2_000).prop_map(|n| "[".repeat(n) + &"]".repeat(n)),
    ]
}

/// An image archive around two layers: `manifest.json` or an OCI layout
/// with the blobs the digests above name, plus symlinks inside the archive
/// that lead out of it.
#[derive(Clone, Debug)]
struct ImageArchive {
    lower: Tarball,
    upper: Tarball,
    docker: Option<String>,
    /// `index.json` and the blobs `aaaa` and `dddd` (manifests or indexes).
    oci: [String; 3],
    json_mutations: Vec<Mutation>,
    outer_compression: Compression,
}

fn image_archive() -> impl Strategy<Value = ImageArchive> {
    (
        tarball(),
        tarball(),
        prop::option::of(docker_manifest()),
        [oci_document(), oci_document(), oci_document()],
        prop_oneof![
            3 => Just(Vec::new()),
            1 => prop::collection::vec(mutation(), 1..3),
        ],
        compression(),
    )
        .prop_map(
            |(lower, upper, docker, oci, json_mutations, outer_compression)| ImageArchive {
                lower,
                upper,
                docker,
                oci,
                json_mutations,
                outer_compression,
            },
        )
}

impl ImageArchive {
    fn bytes(&self, outside: &str) -> Vec<u8> {
        let lower = self.lower.bytes(outside);
        let upper = self.upper.bytes(outside);
        let json = |text: &str| {
            mutate(
                text.replace(OUTSIDE, outside).into_bytes(),
                &self.json_mutations,
                false,
            )
        };
        let file = |path: &str, data: Vec<u8>| Member {
            path: path.to_owned(),
            kind: Kind::File(data),
            mode: 0o644,
        };
        let symlink = |path: &str, target: &str| Member {
            path: path.to_owned(),
            kind: Kind::Symlink(target.to_owned()),
            mode: 0o777,
        };
        let mut members = vec![
            symlink("link", OUTSIDE),
            symlink("self", "../../outside"),
            file("lower.tar", lower.clone()),
            file("upper.tar", upper.clone()),
        ];
        match &self.docker {
            Some(manifest) => members.push(file("manifest.json", json(manifest))),
            None => {
                let [index, first, second] = &self.oci;
                members.extend([
                    file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()),
                    file("index.json", json(index)),
                    file("blobs/sha256/aaaa", json(first)),
                    file("blobs/sha256/dddd", json(second)),
                    file("blobs/sha256/1111", lower),
                    file("blobs/sha256/2222", upper),
                    symlink("blobs/sha256/link", OUTSIDE),
                ]);
            }
        }
        compress(&write_tar(&members, outside), self.outer_compression)
    }
}

proptest! {
    // Every case makes and removes directories (some a few hundred deep):
    // fewer cases than the in-memory targets.
    #![proptest_config(config(32))]

    #[test]
    fn rootfs_tars_stay_inside(tarball in tarball()) {
        check_unpack(|outside| tarball.bytes(outside))?;
    }
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn image_layers_and_manifests_stay_inside(archive in image_archive()) {
        check_unpack(|outside| archive.bytes(outside))?;
    }
}

/// `write_tar` writes what it is given: a sanity check of the generator,
/// so the properties above are about hostile archives, not broken ones.
#[test]
fn generated_archives_are_what_they_say() {
    let workspace = Workspace::new();
    let members = [
        Member {
            path: "d/".to_owned(),
            kind: Kind::Dir,
            mode: 0o755,
        },
        Member {
            path: "a/".repeat(60) + "f",
            kind: Kind::File(b"x".to_vec()),
            mode: 0o4755,
        },
        Member {
            path: "d/l".to_owned(),
            kind: Kind::Symlink("a/".repeat(60)),
            mode: 0o777,
        },
    ];
    let (root, report) = crate::ok(workspace.unpack(&write_tar(&members, "/nowhere")));
    assert_eq!(report.entries, 3);
    let file = root.join("a/".repeat(60) + "f");
    assert_eq!(fs::read(&file).expect("the long name"), b"x");
    assert_eq!(
        fs::metadata(&file).expect("metadata").mode() & 0o7777,
        0o755
    );
    assert_eq!(
        fs::read_link(root.join("d/l")).expect("the long link"),
        Path::new(&"a/".repeat(60))
    );
}

#[test]
fn mutations_fix_checksums() {
    let bytes = write_tar(
        &[Member {
            path: "f".to_owned(),
            kind: Kind::File(b"x".to_vec()),
            mode: 0o644,
        }],
        "/nowhere",
    );
    // `f` becomes `g`: a broken name, with the checksum made right again.
    let mut bytes = bytes;
    bytes[0] ^= 1;
    let broken = mutate(bytes, &[], true);
    let mut archive = tar::Archive::new(broken.as_slice());
    let entry = archive
        .entries()
        .expect("entries")
        .next()
        .expect("a member")
        .expect("checksum fixed up");
    assert_eq!(entry.path().expect("path"), Path::new("g"));
}

/// A member whose mtime field is base-256 and says 2^64 - 1 seconds: adding
/// it to the epoch panicked ("overflow when adding duration to instant"),
/// so one header crashed whatever was importing the image. Found by
/// `rootfs_tars_stay_inside`; the time is now treated as unreadable.
#[test]
fn regression_mtime_past_what_system_time_holds() {
    for member in [
        Member {
            path: "f".to_owned(),
            kind: Kind::File(b"x".to_vec()),
            mode: 0o644,
        },
        Member {
            path: "d/".to_owned(),
            kind: Kind::Dir,
            mode: 0o755,
        },
        Member {
            path: "l".to_owned(),
            kind: Kind::Symlink("f".to_owned()),
            mode: 0o777,
        },
    ] {
        let mut bytes = write_tar(&[member], "/nowhere");
        bytes[136..148].copy_from_slice(&[0xff; 12]);
        let bytes = mutate(bytes, &[], true);
        let workspace = Workspace::new();
        let (_, report) = crate::ok(workspace.unpack(&bytes));
        assert_eq!(report.entries, 1);
    }
}
