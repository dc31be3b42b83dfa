//! Removing everything a runner made on its host (`roost purge`): its
//! containers (killed), their network namespaces and veths, every mount
//! beneath its data dir (the homes' loop-mounted image, root file systems),
//! its secrets tmpfs, and then the data dir itself. Every sandbox's files
//! and home on this host go with it: the caller asks before calling.
//!
//! Refused while a runner uses the data dir (it holds the dir's lock), so
//! a purge never pulls a home from under a running runner. The host's
//! bridge (`roost0`) and its iptables chains are shared by every runner on
//! the host and are left; [`Purged::bridge_left`] names them.

use std::path::{Path, PathBuf};

use oci::config::SandboxId;
use oci::{BridgeConfig, BridgeNetwork, Runtime, RuntimeChoice, RuntimeConfig};

use crate::agent::dirs::DataDir;
use crate::agent::{AgentError, secrets};

/// What a purge removed.
#[derive(Debug, Default)]
pub struct Purged {
    /// The containers deleted (killed first if they ran).
    pub containers: Vec<String>,
    /// Mounts undone beneath the data dir and the secrets tmpfs.
    pub unmounted: Vec<PathBuf>,
    /// The data dir removed, if there was one.
    pub removed: Option<PathBuf>,
    /// The host's bridge, when it exists: shared with any other runner
    /// here, so left for the operator to remove (`ip link delete NAME`).
    pub bridge_left: Option<String>,
}

/// Removes what the runner with data dir `data_dir` made on this host.
/// `runtime`: the OCI runtime its containers were made with. `secrets_dir`:
/// the runner's `--secrets-dir`, if it had one.
pub async fn purge(
    data_dir: &Path,
    runtime: RuntimeChoice,
    secrets_dir: Option<PathBuf>,
) -> Result<Purged, AgentError> {
    let mut purged = Purged::default();
    let bridge = BridgeConfig::new(data_dir.join("network"));
    if std::path::Path::new("/sys/class/net")
        .join(&bridge.bridge)
        .exists()
    {
        purged.bridge_left = Some(bridge.bridge.clone());
    }
    let secrets_root = secrets_dir.unwrap_or_else(|| secrets::default_root(data_dir));
    if !data_dir.exists() {
        unmount_secrets(&secrets_root, &mut purged)?;
        return Ok(purged);
    }
    // Held to the end: no runner starts on the dir while it goes.
    let mut data = DataDir::open(data_dir)?;
    // Sandboxes' root layers in the homes' volume (`agent::dirs`).
    let layers = data.root().join("volumes").join("roots");
    if layers.is_dir() {
        data.place_layers_in(layers, false);
    }
    let containers = oci::runtime::container_ids_under(&data.runtime_root())?;
    // Without a runtime nothing can be killed: fine only if nothing runs.
    let runtime = match Runtime::open(RuntimeConfig::new(runtime, data.runtime_root())) {
        Ok(runtime) => Some(runtime),
        Err(_) if containers.is_empty() => None,
        Err(err) => return Err(err.into()),
    };
    let network = BridgeNetwork::new(bridge)?;
    let mut ids = containers.clone();
    if let Ok(listing) = std::fs::read_dir(data.root().join("sandboxes")) {
        ids.extend(
            listing
                .flatten()
                .filter_map(|entry| entry.file_name().into_string().ok()),
        );
    }
    ids.sort();
    ids.dedup();
    for id in ids {
        let Ok(sandbox_id) = SandboxId::new(id.clone()) else {
            continue;
        };
        if let Some(runtime) = &runtime {
            let paths = data.sandbox_paths(&sandbox_id)?;
            runtime
                .sandbox(sandbox_id.clone(), paths)
                .remove_files()
                .await?;
        }
        network.detach(&sandbox_id)?;
        if containers.contains(&id) {
            purged.containers.push(id);
        }
    }
    // Deepest first: a mount beneath another goes before it.
    let mut mounts = oci::host::mounts_beneath(data.root())?;
    mounts.sort_by_key(|path| std::cmp::Reverse(path.components().count()));
    for mount in mounts {
        // Detached lazily: a loop device goes once nothing holds it. One
        // listed twice (stacked) may be gone by its second turn.
        match rustix::mount::unmount(&mount, rustix::mount::UnmountFlags::DETACH) {
            Ok(()) => purged.unmounted.push(mount),
            Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(oci::Error::io("unmount", &mount, e.into()).into()),
        }
    }
    unmount_secrets(&secrets_root, &mut purged)?;
    // Removed with its lock still held (unlinking a locked file is
    // allowed): no runner can open the dir between the two.
    let root = data.root().to_path_buf();
    // Sandboxes' root layers and homes are in it, of any depth.
    oci::host::remove_tree(&root)?;
    drop(data);
    purged.removed = Some(root);
    Ok(purged)
}

/// Unmounts the secrets tmpfs (what was on it goes with it) and removes
/// its directory.
fn unmount_secrets(root: &Path, purged: &mut Purged) -> Result<(), AgentError> {
    if !root.exists() {
        return Ok(());
    }
    if oci::tmpfs::is_tmpfs_mount(root)? {
        rustix::mount::unmount(root, rustix::mount::UnmountFlags::DETACH)
            .map_err(|e| oci::Error::io("unmount", root, e.into()))?;
        purged.unmounted.push(root.to_path_buf());
    }
    match std::fs::remove_dir_all(root) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(oci::Error::io("remove", root, e).into()),
    }
}
