//! `docker save` archives and OCI image layouts.

use image::{Error, SourceKind, UnpackReport};

use crate::{Member, Workspace, gzip, ok, tar, tree, zstd};

/// The lower layer of the two-layer image.
fn layer_one() -> Vec<u8> {
    tar(&[
        Member::Dir("etc/", 0o755),
        Member::File("etc/keep", b"kept", 0o644),
        Member::File("etc/gone", b"whited out", 0o644),
        Member::Dir("etc/gone.d/", 0o755),
        Member::File("etc/gone.d/inner", b"whited out too", 0o644),
        Member::Dir("opaque/", 0o755),
        Member::File("opaque/old", b"hidden by opaque", 0o644),
        Member::Dir("opaque/sub/", 0o755),
        Member::File("opaque/sub/deep", b"hidden by opaque", 0o644),
        Member::Symlink("opaque/link", "/etc"),
        Member::File("replaced", b"a file below", 0o644),
    ])
}

/// The upper layer: whiteouts a file and a directory, makes `opaque/`
/// opaque after adding to it (the marker hides lower layers only, wherever
/// it sits), adds a file, and replaces a file with a directory.
fn layer_two() -> Vec<u8> {
    tar(&[
        Member::File("etc/.wh.gone", b"", 0o644),
        Member::File("etc/.wh.gone.d", b"", 0o644),
        Member::Dir("opaque/", 0o750),
        Member::File("opaque/new", b"from layer two", 0o644),
        Member::File("opaque/.wh..wh..opq", b"", 0o644),
        Member::File("added", b"new file", 0o600),
        Member::Dir("replaced/", 0o755),
    ])
}

fn two_layer_tree() -> Vec<String> {
    [
        r#"added 600 "new file""#,
        "etc/ 755",
        r#"etc/keep 644 "kept""#,
        "opaque/ 750",
        r#"opaque/new 644 "from layer two""#,
        "replaced/ 755",
    ]
    .map(String::from)
    .to_vec()
}

fn two_layer_report(kind: SourceKind, images_in_archive: usize) -> UnpackReport {
    UnpackReport {
        kind,
        layers: 2,
        images_in_archive,
        entries: 18,
        skipped_special: 0,
        skipped_unsafe: 0,
        whiteouts: 3,
    }
}

fn docker_manifest(layers: &[&str]) -> String {
    let layers: Vec<String> = layers.iter().map(|layer| format!("{layer:?}")).collect();
    format!(
        r#"[{{"Config":"config.json","RepoTags":["box:latest"],"Layers":[{}]}}]"#,
        layers.join(",")
    )
}

#[test]
fn docker_save_applies_layers_and_whiteouts() {
    let workspace = Workspace::new();
    let one = layer_one();
    let two = gzip(&layer_two());
    let manifest = docker_manifest(&["aaa/layer.tar", "bbb/layer.tar"]);
    let archive = tar(&[
        Member::Dir("aaa/", 0o755),
        Member::File("aaa/layer.tar", &one, 0o644),
        Member::Dir("bbb/", 0o755),
        Member::File("bbb/layer.tar", &two, 0o644),
        Member::File("config.json", b"{}", 0o644),
        Member::File("manifest.json", manifest.as_bytes(), 0o644),
    ]);
    let (root, report) = ok(workspace.unpack(&archive));
    assert_eq!(tree(&root), two_layer_tree());
    assert_eq!(report, two_layer_report(SourceKind::DockerArchive, 1));
    let left: Vec<_> = std::fs::read_dir(workspace.scratch())
        .expect("scratch")
        .map(|entry| entry.expect("entry").file_name())
        .collect();
    assert_eq!(left, ["rootfs"], "the unpacked archive is removed");
}

#[test]
fn manifest_json_wins_over_an_oci_layout() {
    let workspace = Workspace::new();
    let one = zstd(&layer_one());
    let two = layer_two();
    let manifest = docker_manifest(&["blobs/sha256/1111", "blobs/sha256/2222"]);
    let archive = tar(&[
        Member::File("blobs/sha256/1111", &one, 0o644),
        Member::File("blobs/sha256/2222", &two, 0o644),
        Member::File("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#, 0o644),
        // Points at a blob that is not there: read, it would fail.
        Member::File(
            "index.json",
            br#"{"schemaVersion":2,"manifests":[{"digest":"sha256:9999"}]}"#,
            0o644,
        ),
        Member::File("manifest.json", manifest.as_bytes(), 0o644),
    ]);
    let (root, report) = ok(workspace.unpack(&archive));
    assert_eq!(tree(&root), two_layer_tree());
    assert_eq!(report, two_layer_report(SourceKind::DockerArchive, 1));
}

const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

fn oci_manifest(layers: &[&str]) -> String {
    let layers: Vec<String> = layers
        .iter()
        .map(|digest| format!(r#"{{"mediaType":"{LAYER_GZIP}","digest":"{digest}","size":1}}"#))
        .collect();
    format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",
            "config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:cccc","size":2}},
            "layers":[{}]}}"#,
        layers.join(",")
    )
}

fn descriptor(media_type: &str, digest: &str, annotations: &str) -> String {
    format!(
        r#"{{"mediaType":"{media_type}","digest":"{digest}","size":1,"annotations":{{{annotations}}}}}"#
    )
}

const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX: &str = "application/vnd.oci.image.index.v1+json";

#[test]
fn oci_layout_with_two_images_takes_the_first() {
    let workspace = Workspace::new();
    let one = gzip(&layer_one());
    let two = gzip(&layer_two());
    let first = oci_manifest(&["sha256:1111", "sha256:2222"]);
    // The second image has only the lower layer: taking it shows in the tree.
    let second = oci_manifest(&["sha256:1111"]);
    let index = format!(
        r#"{{"schemaVersion":2,"manifests":[{},{}]}}"#,
        descriptor(MANIFEST, "sha256:aaaa", ""),
        descriptor(MANIFEST, "sha256:bbbb", ""),
    );
    let archive = gzip(&tar(&[
        Member::File("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#, 0o644),
        Member::File("index.json", index.as_bytes(), 0o644),
        Member::Dir("blobs/", 0o755),
        Member::Dir("blobs/sha256/", 0o755),
        Member::File("blobs/sha256/aaaa", first.as_bytes(), 0o644),
        Member::File("blobs/sha256/bbbb", second.as_bytes(), 0o644),
        Member::File("blobs/sha256/cccc", b"{}", 0o644),
        Member::File("blobs/sha256/1111", &one, 0o644),
        Member::File("blobs/sha256/2222", &two, 0o644),
    ]));
    let (root, report) = ok(workspace.unpack(&archive));
    assert_eq!(tree(&root), two_layer_tree());
    assert_eq!(report, two_layer_report(SourceKind::OciArchive, 2));
}

#[test]
fn oci_nested_index_passes_over_attestations() {
    let workspace = Workspace::new();
    let one = gzip(&layer_one());
    let two = gzip(&layer_two());
    let image = oci_manifest(&["sha256:1111", "sha256:2222"]);
    let attestation = oci_manifest(&["sha256:1111"]);
    let nested = format!(
        r#"{{"schemaVersion":2,"mediaType":"{INDEX}","manifests":[{},{}]}}"#,
        descriptor(
            MANIFEST,
            "sha256:bbbb",
            r#""vnd.docker.reference.type":"attestation-manifest""#
        ),
        descriptor(MANIFEST, "sha256:aaaa", ""),
    );
    let index = format!(
        r#"{{"schemaVersion":2,"manifests":[{}]}}"#,
        descriptor(
            INDEX,
            "sha256:dddd",
            r#""org.opencontainers.image.ref.name":"latest""#
        ),
    );
    let archive = tar(&[
        Member::File("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#, 0o644),
        Member::File("index.json", index.as_bytes(), 0o644),
        Member::File("blobs/sha256/dddd", nested.as_bytes(), 0o644),
        Member::File("blobs/sha256/aaaa", image.as_bytes(), 0o644),
        Member::File("blobs/sha256/bbbb", attestation.as_bytes(), 0o644),
        Member::File("blobs/sha256/1111", &one, 0o644),
        Member::File("blobs/sha256/2222", &two, 0o644),
    ]);
    let (root, report) = ok(workspace.unpack(&archive));
    assert_eq!(tree(&root), two_layer_tree());
    assert_eq!(report, two_layer_report(SourceKind::OciArchive, 1));
}

/// Unpacks an archive expected to be refused as malformed; returns the
/// message.
fn malformed(members: &[Member<'_>]) -> String {
    let workspace = Workspace::new();
    let error = workspace.unpack(&tar(members)).expect_err("malformed");
    let message = error.to_string();
    assert!(matches!(error, Error::Malformed(_)), "{message}");
    assert!(!message.contains('\n'), "one line: {message}");
    message
}

#[test]
fn malformed_manifest_json_is_named() {
    let message = malformed(&[Member::File("manifest.json", b"[{\"Layers\": [", 0o644)]);
    assert!(
        message.starts_with("malformed image: manifest.json: "),
        "{message}"
    );
}

#[test]
fn manifest_json_without_images() {
    let message = malformed(&[Member::File("manifest.json", b"[]", 0o644)]);
    assert_eq!(message, "malformed image: manifest.json lists no images");
}

#[test]
fn missing_layer_blob_is_named() {
    let manifest = docker_manifest(&["aaa/layer.tar"]);
    let message = malformed(&[Member::File("manifest.json", manifest.as_bytes(), 0o644)]);
    assert_eq!(message, "malformed image: missing blob aaa/layer.tar");
}

#[test]
fn invalid_oci_digest_is_refused() {
    let index = r#"{"schemaVersion":2,"manifests":[{"digest":"sha256:../../x"}]}"#;
    let message = malformed(&[
        Member::File("oci-layout", b"{}", 0o644),
        Member::File("index.json", index.as_bytes(), 0o644),
    ]);
    assert!(message.contains("invalid digest"), "{message}");
}

#[test]
fn truncated_layer_is_an_archive_error() {
    let workspace = Workspace::new();
    let layer = gzip(&layer_one());
    let manifest = docker_manifest(&["aaa/layer.tar"]);
    let archive = tar(&[
        Member::File("aaa/layer.tar", &layer[..layer.len() / 2], 0o644),
        Member::File("manifest.json", manifest.as_bytes(), 0o644),
    ]);
    let error = workspace.unpack(&archive).expect_err("truncated layer");
    assert!(matches!(error, Error::Archive { .. }), "{error}");
    assert!(error.to_string().contains("aaa/layer.tar"), "{error}");
}
