//! The runtime's ownership of the runner bridge: the configured
//! [`BridgeNetwork`] and, when its setup on this host failed, why. `bridge`
//! sandboxes are then refused with that reason (fail closed, never `none`);
//! the network is kept either way so that deleting a sandbox still frees
//! what an earlier run gave it. Attaching and detaching run the blocking
//! `ip` commands of [`crate::network`] off the async workers.

use std::sync::Arc;

use crate::config::{SandboxId, SandboxPaths};
use crate::error::{Error, Result};
use crate::host::blocking;
use crate::network::{BridgeConfig, BridgeNetwork};

/// The bridge a runtime owns, if one is configured.
#[derive(Debug)]
pub(crate) struct OwnedBridge {
    configured: Option<Configured>,
}

#[derive(Debug)]
struct Configured {
    network: Arc<BridgeNetwork>,
    unavailable: Option<String>,
}

impl OwnedBridge {
    /// Checks `config` and sets the bridge up. A malformed bridge config is
    /// an error; a host that cannot do bridging is not: the runtime still
    /// runs `none` sandboxes and says why `bridge` is unavailable.
    pub(crate) fn open(config: Option<BridgeConfig>) -> Result<OwnedBridge> {
        let configured = match config {
            Some(bridge) => {
                let network = BridgeNetwork::new(bridge)?;
                let unavailable = network.setup().err().map(|e| match e {
                    // Refused again at create as Unsupported: no need to
                    // say "unsupported" twice.
                    Error::Unsupported(reason) => reason,
                    other => other.to_string(),
                });
                Some(Configured {
                    network: Arc::new(network),
                    unavailable,
                })
            }
            None => None,
        };
        Ok(OwnedBridge { configured })
    }

    /// Why `bridge` sandboxes are refused, or `None` when they are not.
    pub(crate) fn unavailable_reason(&self) -> Option<String> {
        match &self.configured {
            None => Some("no bridge is configured for this runner".to_owned()),
            Some(configured) => configured.unavailable.clone(),
        }
    }

    /// The configured bridge, whether or not its setup worked.
    pub(crate) fn network(&self) -> Option<&BridgeNetwork> {
        self.configured
            .as_ref()
            .map(|configured| configured.network.as_ref())
    }

    /// The bridge, for a sandbox that asks for one; fails closed.
    pub(crate) fn usable(&self) -> Result<Arc<BridgeNetwork>> {
        match (&self.configured, self.unavailable_reason()) {
            (Some(configured), None) => Ok(configured.network.clone()),
            (_, reason) => Err(Error::Unsupported(format!(
                "network bridge is not available on this runner: {}",
                reason.unwrap_or_default()
            ))),
        }
    }

    /// Plumbs sandbox `id` into `network` (a lease, its named namespace,
    /// the veth): before `create`, which joins that namespace.
    pub(crate) async fn attach(
        network: Arc<BridgeNetwork>,
        id: &SandboxId,
        paths: &SandboxPaths,
    ) -> Result<()> {
        let (id, owned_paths) = (id.clone(), paths.clone());
        blocking("set up the network of", paths.dir(), move || {
            network.attach(&id, &owned_paths).map(drop)
        })
        .await
    }

    /// Takes the sandbox off the bridge (its veth, namespace and address
    /// lease), if it is on it. Runs for every sandbox of a runtime with a
    /// bridge, since a handle made after a restart does not know the
    /// sandbox's network mode; for a `none` sandbox it finds nothing.
    pub(crate) async fn release(&self, id: &SandboxId, paths: &SandboxPaths) -> Result<()> {
        let Some(configured) = &self.configured else {
            return Ok(());
        };
        let network = configured.network.clone();
        let id = id.clone();
        blocking("release the network of", paths.dir(), move || {
            network.detach(&id)
        })
        .await
    }
}
