//! The block service (`/v1/blocks/{org}/…`): the content store, reached
//! through the control plane so that runners and CLIs never hold store
//! credentials. Objects are addressed `{kind}/{hex}` with kind `blocks` or
//! `trees`, the layout of the store's own keys.
//!
//! [`RemoteBackend`] is a `store::backend::Backend` over this service, so
//! the store engine's upload and materialise run unchanged against it.
//! It offers objects only (put, get, exists); home pointers are committed
//! by the server, which alone can take the store's commit lock.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use store::backend::{Backend, ObjectMeta};
use store::store::{KeyKind, ObjectKind, parse_key};

use crate::client::{Client, ClientError};

/// `POST /v1/blocks/{org}/missing`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MissingRequest {
    /// `blocks/HEX` or `trees/HEX`; at most 4096.
    pub objects: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MissingResponse {
    /// The requested objects the org's store lacks, in request order.
    pub missing: Vec<String>,
}

/// How the service names an object: `blocks/HEX` or `trees/HEX`.
pub fn object_name(kind: ObjectKind, hex: &str) -> String {
    match kind {
        ObjectKind::Block => format!("blocks/{hex}"),
        ObjectKind::Tree => format!("trees/{hex}"),
    }
}

/// A `Backend` that reaches one org's objects through the block service.
/// Its methods block: call them from plain threads (rayon's, or
/// `spawn_blocking`), never from async code.
pub struct RemoteBackend {
    client: Client,
    runtime: tokio::runtime::Handle,
}

impl RemoteBackend {
    /// `runtime` runs the HTTP calls; the caller's threads wait on them.
    pub fn new(client: Client, runtime: tokio::runtime::Handle) -> RemoteBackend {
        RemoteBackend { client, runtime }
    }

    fn object(&self, op: &'static str, key: &str) -> store::Result<(String, String)> {
        match parse_key(key) {
            Some(KeyKind::Object { org, object }) => Ok((
                org.to_string(),
                object_name(object.kind, &object.digest.to_hex()),
            )),
            _ => Err(unsupported(op, key)),
        }
    }
}

fn unsupported(op: &'static str, key: &str) -> store::Error {
    store::Error::Backend {
        op,
        key: key.to_owned(),
        message: "the block service offers objects only; the server commits pointers".to_owned(),
    }
}

fn backend_error(op: &'static str, key: &str, err: ClientError) -> store::Error {
    store::Error::Backend {
        op,
        key: key.to_owned(),
        message: err.to_string(),
    }
}

impl Backend for RemoteBackend {
    fn put(&self, key: &str, data: &[u8]) -> store::Result<()> {
        let (org, name) = self.object("put", key)?;
        self.runtime
            .block_on(self.client.put_object(&org, &name, data.to_vec()))
            .map_err(|e| backend_error("put", key, e))
    }

    fn put_durable(&self, key: &str, _data: &[u8]) -> store::Result<()> {
        Err(unsupported("put", key))
    }

    /// Every put is stored by the server before it answers; the server
    /// syncs before it commits a pointer to them.
    fn sync(&self) -> store::Result<()> {
        Ok(())
    }

    fn get(&self, key: &str) -> store::Result<Option<Vec<u8>>> {
        let (org, name) = self.object("get", key)?;
        self.runtime
            .block_on(self.client.get_object(&org, &name))
            .map_err(|e| backend_error("get", key, e))
    }

    fn exists(&self, keys: &[String]) -> store::Result<Vec<bool>> {
        let Some(first) = keys.first() else {
            return Ok(Vec::new());
        };
        let (org, _) = self.object("exists", first)?;
        let mut names = Vec::with_capacity(keys.len());
        for key in keys {
            let (key_org, name) = self.object("exists", key)?;
            if key_org != org {
                return Err(unsupported("exists", key));
            }
            names.push(name);
        }
        let missing: std::collections::HashSet<String> = self
            .runtime
            .block_on(self.client.missing_objects(&org, &names))
            .map_err(|e| backend_error("exists", first, e))?
            .into_iter()
            .collect();
        Ok(names.iter().map(|name| !missing.contains(name)).collect())
    }

    fn list(&self, prefix: &str) -> store::Result<Vec<ObjectMeta>> {
        Err(unsupported("list", prefix))
    }

    fn head(&self, key: &str) -> store::Result<Option<ObjectMeta>> {
        Err(unsupported("head", key))
    }

    fn delete(&self, key: &str) -> store::Result<()> {
        Err(unsupported("delete", key))
    }
}
