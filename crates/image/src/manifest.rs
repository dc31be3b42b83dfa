//! Reads the manifests of an unpacked image archive (`docker save` or OCI
//! layout) and names the layer blobs of its first image, in order.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::{Error, SourceKind};

/// Largest JSON document read from an archive (`manifest.json`,
/// `index.json`, a manifest or index blob); real ones are a few KiB.
pub const JSON_BYTES_MAX: u64 = 16 << 20;

/// How many nested indexes are followed from `index.json` to a manifest.
const INDEX_DEPTH_MAX: usize = 8;

/// The first image of an archive.
pub(crate) struct Image {
    pub(crate) kind: SourceKind,
    /// Layer blobs, lowest first, each a regular file inside the archive.
    pub(crate) layers: Vec<PathBuf>,
    pub(crate) images_in_archive: usize,
}

/// One image of `manifest.json`.
#[derive(Deserialize)]
struct DockerImage {
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    #[serde(default)]
    media_type: Option<String>,
    digest: String,
    #[serde(default)]
    annotations: HashMap<String, String>,
}

impl Descriptor {
    /// Buildx stores provenance and SBOMs as manifests beside the images.
    fn is_attestation(&self) -> bool {
        self.annotations
            .get("vnd.docker.reference.type")
            .is_some_and(|kind| kind == "attestation-manifest")
    }
}

/// An OCI image index or image manifest: which one shows in the fields.
#[derive(Deserialize)]
struct IndexOrManifest {
    #[serde(default)]
    manifests: Option<Vec<Descriptor>>,
    #[serde(default)]
    layers: Option<Vec<Descriptor>>,
}

/// Tells an image archive from a root-filesystem tar by the top level of
/// `archive` (the unpacked outer tar), and reads it if it is one.
pub(crate) fn detect(archive: &Path) -> Result<Option<Image>, Error> {
    if is_file(&archive.join("manifest.json"))? {
        return docker(archive).map(Some);
    }
    if is_file(&archive.join("index.json"))? && is_file(&archive.join("oci-layout"))? {
        return oci(archive).map(Some);
    }
    Ok(None)
}

fn is_file(path: &Path) -> Result<bool, Error> {
    match fs::symlink_metadata(path) {
        Ok(metadata) => Ok(metadata.is_file()),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(error) => Err(Error::io(path)(error)),
    }
}

fn docker(archive: &Path) -> Result<Image, Error> {
    let images: Vec<DockerImage> = read_json(archive, Path::new("manifest.json"))?;
    let Some(first) = images.first() else {
        return Err(Error::Malformed("manifest.json lists no images".to_owned()));
    };
    let layers = first
        .layers
        .iter()
        .map(|layer| blob(archive, Path::new(layer)))
        .collect::<Result<_, _>>()?;
    Ok(Image {
        kind: SourceKind::DockerArchive,
        layers,
        images_in_archive: images.len(),
    })
}

fn oci(archive: &Path) -> Result<Image, Error> {
    let index: IndexOrManifest = read_json(archive, Path::new("index.json"))?;
    let Some(manifests) = index.manifests else {
        return Err(Error::Malformed("index.json has no manifests".to_owned()));
    };
    let images: Vec<Descriptor> = manifests
        .into_iter()
        .filter(|d| !d.is_attestation())
        .collect();
    let images_in_archive = images.len();
    let Some(mut descriptor) = images.into_iter().next() else {
        return Err(Error::Malformed("index.json lists no images".to_owned()));
    };

    for _ in 0..INDEX_DEPTH_MAX {
        check_media_type(&descriptor)?;
        let document: IndexOrManifest = read_json(archive, &digest_path(&descriptor.digest)?)?;
        match (document.manifests, document.layers) {
            (Some(manifests), _) => {
                descriptor = manifests
                    .into_iter()
                    .find(|d| !d.is_attestation())
                    .ok_or_else(|| {
                        Error::Malformed(format!("index {} lists no images", descriptor.digest))
                    })?;
            }
            (None, Some(layers)) => {
                let layers = layers
                    .iter()
                    .map(|layer| {
                        check_media_type(layer)?;
                        blob(archive, &digest_path(&layer.digest)?)
                    })
                    .collect::<Result<_, _>>()?;
                return Ok(Image {
                    kind: SourceKind::OciArchive,
                    layers,
                    images_in_archive,
                });
            }
            (None, None) => {
                return Err(Error::Malformed(format!(
                    "blob {} is neither an image manifest nor an index",
                    descriptor.digest
                )));
            }
        }
    }
    Err(Error::Malformed(format!(
        "more than {INDEX_DEPTH_MAX} nested image indexes"
    )))
}

fn check_media_type(descriptor: &Descriptor) -> Result<(), Error> {
    match &descriptor.media_type {
        Some(media_type) if media_type.contains("encrypted") => Err(Error::Unsupported(format!(
            "blob {} is encrypted ({media_type})",
            descriptor.digest
        ))),
        _ => Ok(()),
    }
}

/// `sha256:abc…` is stored as `blobs/sha256/abc…`. The OCI grammar for the
/// two parts leaves no room for `/` or `..`.
fn digest_path(digest: &str) -> Result<PathBuf, Error> {
    let invalid = || Error::Malformed(format!("invalid digest {digest:?}"));
    let (algorithm, encoded) = digest.split_once(':').ok_or_else(invalid)?;
    let algorithm_ok = algorithm
        .bytes()
        .next()
        .is_some_and(|first| first.is_ascii_alphanumeric())
        && algorithm
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+._-".contains(&b));
    let encoded_ok = !encoded.is_empty()
        && encoded
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"=_-".contains(&b));
    if !algorithm_ok || !encoded_ok {
        return Err(invalid());
    }
    Ok(Path::new("blobs").join(algorithm).join(encoded))
}

/// The regular file `relative` names inside `archive`. Neither `..`, an
/// absolute path nor a symlink in the archive may lead out of it.
fn blob(archive: &Path, relative: &Path) -> Result<PathBuf, Error> {
    let escapes = || {
        Error::Malformed(format!(
            "blob path {} escapes the archive",
            relative.display()
        ))
    };
    let mut names = 0;
    for component in relative.components() {
        match component {
            Component::Normal(_) => names += 1,
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) | Component::ParentDir => {
                return Err(escapes());
            }
        }
    }
    if names == 0 {
        return Err(escapes());
    }
    let archive = fs::canonicalize(archive).map_err(Error::io(archive))?;
    let path = match fs::canonicalize(archive.join(relative)) {
        Ok(path) => path,
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            return Err(Error::Malformed(format!(
                "missing blob {}",
                relative.display()
            )));
        }
        Err(error) => return Err(Error::io(&archive.join(relative))(error)),
    };
    if !path.starts_with(&archive) || path == archive {
        return Err(escapes());
    }
    let metadata = fs::metadata(&path).map_err(Error::io(&path))?;
    if !metadata.is_file() {
        return Err(Error::Malformed(format!(
            "blob {} is not a regular file",
            relative.display()
        )));
    }
    Ok(path)
}

fn read_json<T: DeserializeOwned>(archive: &Path, relative: &Path) -> Result<T, Error> {
    let path = blob(archive, relative)?;
    let file = File::open(&path).map_err(Error::io(&path))?;
    let mut bytes = Vec::new();
    file.take(JSON_BYTES_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(Error::io(&path))?;
    if bytes.len() as u64 > JSON_BYTES_MAX {
        return Err(Error::Malformed(format!(
            "{} is larger than {JSON_BYTES_MAX} bytes",
            relative.display()
        )));
    }
    serde_json::from_slice(&bytes)
        .map_err(|error| Error::Malformed(format!("{}: {error}", relative.display())))
}
