//! Assignment translation: a sandbox's assignment (the wire's
//! `SandboxAssignment`) turned into the `SandboxConfig` the OCI layer
//! launches, or the reason this runner cannot run it as asked (reported
//! `failed` with that reason, never weakened). Pure: what it needs of the
//! host comes in a [`Host`], so it is tested alone.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use api::lifecycle::StorageClass;
use api::runners::SandboxAssignment;
use oci::config::{
    InitProgram, Limits, Network, RootImage, SandboxConfig, SandboxId, SandboxPaths, SharedMount,
};

/// What the translation needs of this runner.
pub(crate) struct Host<'a> {
    /// The init every sandbox runs as PID 1.
    pub init: &'a InitProgram,
    /// The runner's data dir: masked in every sandbox.
    pub data_root: &'a Path,
    /// Whether durable homes can be kept here (running homes can be
    /// snapshotted).
    pub durable: bool,
    /// Shared filesystems mounted on this host, by id.
    pub filesystems: &'a BTreeMap<String, PathBuf>,
}

/// A sandbox this runner cannot run as asked: reported `failed`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Unrunnable {
    /// The stable `state_reason`.
    pub reason: &'static str,
    pub message: String,
}

impl Unrunnable {
    fn new(reason: &'static str, message: String) -> Unrunnable {
        Unrunnable { reason, message }
    }
}

/// The container `sandbox` asks for, with its home at `home` and its root
/// filesystem `image` (already materialised).
pub(crate) fn sandbox_config(
    sandbox: &SandboxAssignment,
    id: &SandboxId,
    paths: SandboxPaths,
    home: PathBuf,
    image: RootImage,
    host: &Host<'_>,
) -> Result<SandboxConfig, Unrunnable> {
    if sandbox.image_root.is_none() && sandbox.image != "default" {
        return Err(Unrunnable::new(
            "image_unavailable",
            format!(
                "image {:?} is not available on this runner (it runs only the default image)",
                sandbox.image
            ),
        ));
    }
    let durable_here = sandbox.storage_class == StorageClass::Durable && host.durable;
    if sandbox.storage_class != StorageClass::Standard && !durable_here {
        return Err(Unrunnable::new(
            "storage_unavailable",
            format!(
                "storage class {:?} is not available on this runner",
                sandbox.storage_class
            ),
        ));
    }
    let network = match sandbox.network {
        api::Network::None => Network::None,
        api::Network::Bridge => Network::Bridge,
    };
    // The init enforces the lease this runner renews, even once this
    // runner is gone (`fence`, `oci::lease`).
    let lease_dir = paths.lease();
    let mut config = SandboxConfig::new(id.clone(), paths, home, host.init.clone());
    config.lease_dir = Some(lease_dir);
    config.image = image;
    config.env = sandbox.env.clone();
    config.network = network;
    let resources = &sandbox.resources;
    config.limits = Limits {
        memory_bytes: resources.memory_mib.map(|mib| mib.saturating_mul(1 << 20)),
        cpus: resources.cpus,
        pids: resources.pids,
    };
    for mount in &sandbox.mounts {
        let Some(root) = host.filesystems.get(&mount.filesystem) else {
            return Err(Unrunnable::new(
                "filesystem_unavailable",
                format!(
                    "shared filesystem {} is not mounted on this runner",
                    mount.filesystem
                ),
            ));
        };
        config.shared.push(SharedMount {
            name: mount.filesystem.clone(),
            root: root.clone(),
            subpath: mount.subpath.clone(),
            destination: mount.path.clone(),
            read_only: mount.read_only,
        });
    }
    // The runner's own files are no business of a sandbox, wherever the
    // data dir is.
    config.masked_paths = vec![host.data_root.display().to_string()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::testing::assignment;
    use api::lifecycle::{DesiredState, SandboxState};

    fn translate(sandbox: &SandboxAssignment, durable: bool) -> Result<SandboxConfig, Unrunnable> {
        let init = InitProgram {
            host_path: "/usr/bin/roost".into(),
            args: vec!["init".to_owned()],
        };
        let filesystems = BTreeMap::from([("team".to_owned(), PathBuf::from("/srv/team"))]);
        let host = Host {
            init: &init,
            data_root: Path::new("/var/lib/roost/runner"),
            durable,
            filesystems: &filesystems,
        };
        let id = SandboxId::new("sbx_0123".to_owned()).expect("an id");
        let paths = SandboxPaths::new("/var/lib/roost/runner/sandboxes/sbx_0123").expect("paths");
        sandbox_config(
            sandbox,
            &id,
            paths,
            "/var/lib/roost/runner/volumes/homes/sbx_0123".into(),
            RootImage::Host,
            &host,
        )
    }

    fn running() -> SandboxAssignment {
        assignment("sbx_0123", 1, DesiredState::Running, SandboxState::Starting)
    }

    #[test]
    fn settings_carry_over_and_the_data_dir_is_masked() {
        let mut sandbox = running();
        sandbox.resources.memory_mib = Some(512);
        sandbox.resources.cpus = Some(1.5);
        sandbox.resources.pids = Some(64);
        sandbox.network = api::Network::Bridge;
        sandbox.env.insert("A".to_owned(), "b".to_owned());
        let config = translate(&sandbox, false).expect("runnable");
        assert_eq!(config.limits.memory_bytes, Some(512 << 20));
        assert_eq!(config.limits.cpus, Some(1.5));
        assert_eq!(config.limits.pids, Some(64));
        assert_eq!(config.network, Network::Bridge);
        assert_eq!(config.env.get("A").map(String::as_str), Some("b"));
        assert_eq!(config.masked_paths, ["/var/lib/roost/runner"]);
        assert_eq!(config.id.as_str(), "sbx_0123");
    }

    #[test]
    fn what_this_runner_cannot_enforce_is_refused_with_its_reason() {
        let mut other_image = running();
        other_image.image = "python:3.12".to_owned();
        assert_eq!(
            translate(&other_image, true)
                .map(drop)
                .map_err(|u| u.reason),
            Err("image_unavailable")
        );
        let mut durable = running();
        durable.storage_class = StorageClass::Durable;
        assert_eq!(
            translate(&durable, false).map(drop).map_err(|u| u.reason),
            Err("storage_unavailable")
        );
        assert!(
            translate(&durable, true).is_ok(),
            "durable where homes snapshot"
        );
    }

    #[test]
    fn shared_mounts_resolve_by_this_runners_ids_only() {
        let mut sandbox = running();
        sandbox.mounts.push(api::sandboxes::Mount {
            filesystem: "team".to_owned(),
            subpath: "proj".to_owned(),
            path: "/workspace".to_owned(),
            read_only: true,
        });
        let config = translate(&sandbox, false).expect("runnable");
        assert_eq!(config.shared.len(), 1);
        assert_eq!(config.shared[0].root, PathBuf::from("/srv/team"));
        assert_eq!(config.shared[0].destination, "/workspace");
        assert!(config.shared[0].read_only);
        sandbox.mounts[0].filesystem = "elsewhere".to_owned();
        assert_eq!(
            translate(&sandbox, false).map(drop).map_err(|u| u.reason),
            Err("filesystem_unavailable")
        );
    }
}
