//! Org-scoped access to objects and home pointers: the only place that
//! builds backend keys, so nothing one org names can resolve to another
//! org's object.
//!
//! Key layout:
//! - `orgs/{org}/blocks/{first two hex}/{digest hex}`: file content blocks
//! - `orgs/{org}/trees/{first two hex}/{digest hex}`: directory objects
//! - `orgs/{org}/homes/{home}`: the home's current root digest

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::{self, Backend, ObjectMeta};
use crate::tree::Tree;
use crate::{Digest, Error, HomeName, OrgId, Result, block};

/// Trees and blocks live in separate namespaces so gc can tell them apart
/// without reading (it reads trees, never blocks, to order its sweep).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ObjectKind {
    Block,
    Tree,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId {
    pub kind: ObjectKind,
    pub digest: Digest,
}

impl ObjectId {
    pub fn block(digest: Digest) -> ObjectId {
        ObjectId {
            kind: ObjectKind::Block,
            digest,
        }
    }
    pub fn tree(digest: Digest) -> ObjectId {
        ObjectId {
            kind: ObjectKind::Tree,
            digest,
        }
    }
}

/// Digests per existence request: bounds request size whatever the home.
pub const MISSING_CHECK_BATCH_MAX: usize = 1000;

pub struct Store {
    backend: Arc<dyn Backend>,
    missing_check_requests: AtomicU64,
}

impl Store {
    pub fn new(backend: Arc<dyn Backend>) -> Store {
        Store {
            backend,
            missing_check_requests: AtomicU64::new(0),
        }
    }

    pub fn open(url: &str) -> Result<Store> {
        Ok(Store::new(backend::open(url)?))
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// How many batched existence requests this store has sent.
    pub fn missing_check_requests(&self) -> u64 {
        self.missing_check_requests.load(Ordering::Relaxed)
    }

    pub fn orgs_prefix() -> &'static str {
        "orgs/"
    }

    pub fn object_key(org: &OrgId, object: &ObjectId) -> String {
        let hex = object.digest.to_hex();
        let kind = match object.kind {
            ObjectKind::Block => "blocks",
            ObjectKind::Tree => "trees",
        };
        format!("orgs/{org}/{kind}/{}/{hex}", &hex[..2])
    }

    pub fn home_key(org: &OrgId, home: &HomeName) -> String {
        format!("orgs/{org}/homes/{home}")
    }

    /// Which of `digests` the org's store lacks, asked in bounded batches.
    pub fn missing(&self, org: &OrgId, objects: &[ObjectId]) -> Result<Vec<ObjectId>> {
        let mut missing = Vec::new();
        for batch in objects.chunks(MISSING_CHECK_BATCH_MAX) {
            let keys: Vec<String> = batch.iter().map(|o| Self::object_key(org, o)).collect();
            self.missing_check_requests.fetch_add(1, Ordering::Relaxed);
            let present = self.backend.exists(&keys)?;
            missing.extend(
                batch
                    .iter()
                    .zip(present)
                    .filter(|(_, present)| !present)
                    .map(|(d, _)| *d),
            );
        }
        Ok(missing)
    }

    /// Compresses and stores an object; returns the stored size.
    pub fn put_object(&self, org: &OrgId, object: &ObjectId, plain: &[u8]) -> Result<u64> {
        debug_assert_eq!(Digest::of(plain), object.digest);
        let stored = block::encode(plain);
        self.backend.put(&Self::object_key(org, object), &stored)?;
        Ok(stored.len() as u64)
    }

    /// Stores an already-encoded object after checking it decodes to its digest.
    pub fn put_encoded(&self, org: &OrgId, object: &ObjectId, stored: &[u8]) -> Result<()> {
        block::decode(&object.digest, stored)?;
        self.backend.put(&Self::object_key(org, object), stored)
    }

    /// The stored (encoded) bytes of an object, unverified.
    pub fn get_encoded(&self, org: &OrgId, object: &ObjectId) -> Result<Vec<u8>> {
        self.backend
            .get(&Self::object_key(org, object))?
            .ok_or(Error::MissingObject {
                digest: object.digest,
                path: None,
            })
    }

    /// An object's plain content, verified against its digest.
    pub fn get_object(&self, org: &OrgId, object: &ObjectId) -> Result<Vec<u8>> {
        block::decode(&object.digest, &self.get_encoded(org, object)?)
    }

    pub fn get_tree(&self, org: &OrgId, digest: &Digest) -> Result<Tree> {
        Tree::decode(digest, &self.get_object(org, &ObjectId::tree(*digest))?)
    }

    pub fn read_home(&self, org: &OrgId, home: &HomeName) -> Result<Option<Digest>> {
        let key = Self::home_key(org, home);
        let Some(bytes) = self.backend.get(&key)? else {
            return Ok(None);
        };
        let text = std::str::from_utf8(&bytes)
            .map_err(|_| Error::MalformedPointer { key: key.clone() })?;
        let digest = text
            .trim()
            .parse()
            .map_err(|_| Error::MalformedPointer { key })?;
        Ok(Some(digest))
    }

    /// Durably points the home at `root`. Callers write this last, after
    /// [`Store::sync`], so a pointer only ever names a complete tree.
    pub fn write_home(&self, org: &OrgId, home: &HomeName, root: &Digest) -> Result<()> {
        self.backend
            .put_durable(&Self::home_key(org, home), format!("{root}\n").as_bytes())
    }

    pub fn sync(&self) -> Result<()> {
        self.backend.sync()
    }

    /// Every object and pointer of every org.
    pub fn list_all(&self) -> Result<Vec<ObjectMeta>> {
        self.backend.list(Self::orgs_prefix())
    }
}

/// What a backend key under `orgs/` names.
#[derive(Debug, PartialEq, Eq)]
pub enum KeyKind {
    Object { org: OrgId, object: ObjectId },
    Home { org: OrgId, home: HomeName },
}

/// Parses a key built by [`Store`]; foreign keys give `None` and are left alone.
pub fn parse_key(key: &str) -> Option<KeyKind> {
    let mut parts = key.strip_prefix("orgs/")?.split('/');
    let org: OrgId = parts.next()?.parse().ok()?;
    match (parts.next()?, parts.next()?, parts.next(), parts.next()) {
        (kind @ ("blocks" | "trees"), fanout, Some(hex), None) if hex.starts_with(fanout) => {
            let digest = hex.parse().ok()?;
            let object = if kind == "trees" {
                ObjectId::tree(digest)
            } else {
                ObjectId::block(digest)
            };
            Some(KeyKind::Object { org, object })
        }
        ("homes", home, None, None) => Some(KeyKind::Home {
            org,
            home: home.parse().ok()?,
        }),
        _ => None,
    }
}
