//! `roost image …`: import a root filesystem (a directory, a tar, an OCI
//! image archive or `docker save` output) into the org's content store
//! through the server's block service, and list, show or delete images.
//!
//! Import = unpack (the `image` crate) → upload what the store lacks
//! (`store::push::upload_tree` over [`RemoteBackend`]) → the server checks
//! the tree is complete and commits it under the name.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use api::ErrorCode;
use api::blocks::RemoteBackend;
use api::images::Image;
use clap::Subcommand;
use serde_json::json;
use store::OrgId;

use crate::control::runtime;
use crate::output::{Bar, age, human_bytes, print_fields, print_record, print_table};
use crate::sandbox::OrgTarget;

/// Upload-and-commit rounds: a commit finds objects missing only if a gc
/// took some the upload relied on; the next round uploads them.
const IMPORT_ATTEMPTS_MAX: usize = 3;

#[derive(Subcommand)]
pub enum ImageCommand {
    /// Import a root filesystem as NAME; sandboxes run it with `--image NAME`.
    #[command(
        after_help = "PATH is a directory, a tar archive of a root filesystem (plain, gzip or \
                      zstd), an OCI image archive, or `docker save` output (layers applied in \
                      order, whiteouts honoured). Only blocks the org's store lacks are uploaded. \
                      Importing an existing NAME points it at the new tree; sandboxes created \
                      before keep the tree they were created with."
    )]
    Import {
        /// The image's name (what `--image` takes).
        name: String,
        /// The root filesystem: a directory, a tar, an OCI archive or
        /// `docker save` output.
        path: PathBuf,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// List the org's images.
    List {
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Show one image.
    Get {
        /// The image's name.
        name: String,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Forget an image (its blocks go at the store's next gc; sandboxes
    /// that run it keep their copy).
    Delete {
        /// The image's name.
        name: String,
        #[command(flatten)]
        target: OrgTarget,
    },
}

pub fn run(command: ImageCommand) -> Result<ExitCode> {
    match command {
        ImageCommand::Import { name, path, target } => import(&name, &path, &target),
        ImageCommand::List { target } => {
            let client = target.client()?;
            let list = runtime()?.block_on(client.list_images())?;
            if target.json {
                print_record(&list)?;
            } else {
                let rows: Vec<Vec<String>> = list
                    .images
                    .iter()
                    .map(|i| {
                        vec![
                            i.name.clone(),
                            i.files.to_string(),
                            human_bytes(i.logical_bytes),
                            age(&i.updated_at),
                            i.root[..12].to_owned(),
                        ]
                    })
                    .collect();
                print_table(&["NAME", "FILES", "SIZE", "UPDATED", "ROOT"], &rows);
            }
            Ok(ExitCode::SUCCESS)
        }
        ImageCommand::Get { name, target } => {
            let client = target.client()?;
            let image = runtime()?.block_on(client.get_image(&name))?;
            print_image(&image, target.json)?;
            Ok(ExitCode::SUCCESS)
        }
        ImageCommand::Delete { name, target } => {
            let client = target.client()?;
            let image = runtime()?.block_on(client.delete_image(&name))?;
            if target.json {
                print_record(&image)?;
            } else {
                println!("deleted image {}", image.name);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print_image(image: &Image, json: bool) -> Result<()> {
    if json {
        return print_record(image);
    }
    print_fields(&[
        ("name", image.name.clone()),
        ("root", image.root.clone()),
        ("files", image.files.to_string()),
        ("size", human_bytes(image.logical_bytes)),
        ("created", image.created_at.clone()),
        ("updated", image.updated_at.clone()),
    ]);
    Ok(())
}

fn source_name(kind: image::SourceKind) -> &'static str {
    match kind {
        image::SourceKind::Directory => "directory",
        image::SourceKind::Tar => "tar",
        image::SourceKind::OciArchive => "oci_archive",
        image::SourceKind::DockerArchive => "docker_archive",
    }
}

fn import(name: &str, path: &Path, target: &OrgTarget) -> Result<ExitCode> {
    let started = Instant::now();
    // Before the server is asked anything: a mistyped PATH is said as such.
    std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    let client = target.client()?;
    let rt = runtime()?;
    let whoami = rt.block_on(client.whoami())?;
    let Some(org) = whoami.org_id else {
        bail!(
            "image import needs an org token (this is a {} token)",
            whoami.kind
        );
    };
    let org: OrgId = org
        .parse()
        .with_context(|| format!("org id {org:?} from the server"))?;
    let scratch = tempfile::Builder::new()
        .prefix("roost-image-")
        .tempdir()
        .context("creating a scratch directory (set TMPDIR to place it elsewhere)")?;
    let (rootfs, unpacked) = image::unpack(path, scratch.path())
        .with_context(|| format!("cannot read {} as an image", path.display()))?;
    let store = RemoteBackend::new(client.clone(), rt.handle().clone());
    let bar = Bar::new(target.json);
    let mut attempt = 1;
    let (report, image) = loop {
        let report = store::push::upload_tree(
            &store,
            &org,
            &rootfs,
            &store::push::UploadOptions::everything(),
            &bar,
        )
        .and_then(store::push::Upload::finish);
        bar.finish();
        let report = report.context("uploading the image")?;
        let root = report.root.map(|r| r.to_hex()).unwrap_or_default();
        match rt.block_on(client.commit_image(name, &root, Some(report.files))) {
            Err(err)
                if err.code() == Some(ErrorCode::InvalidState) && attempt < IMPORT_ATTEMPTS_MAX =>
            {
                tracing::warn!(%err, attempt, "commit found objects missing; uploading again");
                attempt += 1;
            }
            Err(err) => return Err(err).context("committing the image"),
            Ok(image) => break (report, image),
        }
    };
    if target.json {
        crate::output::print_json(&json!({
            "image": image,
            "source": source_name(unpacked.kind),
            "layers": unpacked.layers,
            "skipped_special": unpacked.skipped_special + report.special_skipped,
            "skipped_unsafe": unpacked.skipped_unsafe,
            "blocks_uploaded": report.blocks_uploaded,
            "trees_uploaded": report.trees_uploaded,
            "bytes_uploaded": report.bytes_uploaded,
            "seconds": started.elapsed().as_secs_f64(),
        }));
    } else {
        println!(
            "imported {} ({}, {} layers): {} files, {}; {} blocks + {} trees uploaded ({})",
            image.name,
            source_name(unpacked.kind).replace('_', " "),
            unpacked.layers,
            image.files,
            human_bytes(image.logical_bytes),
            report.blocks_uploaded,
            report.trees_uploaded,
            human_bytes(report.bytes_uploaded),
        );
        let skipped = unpacked.skipped_special + report.special_skipped + unpacked.skipped_unsafe;
        if skipped > 0 {
            println!(
                "skipped {skipped} special or unsafe entries (devices, fifos, paths leaving the root)"
            );
        }
        println!("root {}", image.root);
    }
    Ok(ExitCode::SUCCESS)
}
