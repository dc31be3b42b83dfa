//! Any S3-compatible object store, through the `object_store` crate.
//!
//! Endpoint, region and credentials come from the standard AWS environment
//! variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_REGION`, `AWS_ALLOW_HTTP=true` for a plain-http endpoint). The
//! backend owns a small tokio runtime and blocks on it, so the synchronous
//! engine can use it from any non-async thread.

use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ObjectStore, PutPayload, RetryConfig};

use super::{Backend, ObjectMeta};
use crate::{Error, Result};

/// Concurrent HEAD requests for one existence batch.
const EXISTS_CONCURRENCY_MAX: usize = 32;
/// Concurrent GET requests for one batch.
const GET_CONCURRENCY_MAX: usize = 16;
/// Retries of one request that failed in a way that may pass (a refused
/// or dropped connection, a 5xx, throttling), pausing 0.1 s doubling to
/// [`RETRY_PAUSE_MAX_MS`], for at most [`RETRY_SECONDS_MAX`]. The
/// library's own default retries for up to three minutes: a store that
/// is down then holds every request of a caller that retries by itself
/// anyway (the block service answers 503, a runner tries again later and
/// says so) for minutes before anyone learns of it.
const RETRIES_MAX: usize = 5;
const RETRY_PAUSE_MAX_MS: u64 = 2_000;
const RETRY_SECONDS_MAX: u64 = 15;

pub struct S3Backend {
    client: AmazonS3,
    prefix: String,
    runtime: tokio::runtime::Runtime,
}

fn backend_error(op: &'static str, key: &str, err: object_store::Error) -> Error {
    Error::Backend {
        op,
        key: key.to_owned(),
        // object_store's Display spans lines; the CLI prints one line.
        message: err.to_string().replace('\n', " "),
    }
}

impl S3Backend {
    pub fn open(bucket: &str, prefix: &str) -> Result<S3Backend> {
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: std::time::Duration::from_millis(100),
                max_backoff: std::time::Duration::from_millis(RETRY_PAUSE_MAX_MS),
                base: 2.0,
            },
            max_retries: RETRIES_MAX,
            retry_timeout: std::time::Duration::from_secs(RETRY_SECONDS_MAX),
        };
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_retry(retry);
        if std::env::var_os("AWS_REGION").is_none()
            && std::env::var_os("AWS_DEFAULT_REGION").is_none()
        {
            builder = builder.with_region("us-east-1");
        }
        let client = builder.build().map_err(|err| Error::InvalidUrl {
            url: format!("s3://{bucket}/{prefix}"),
            reason: err.to_string().replace('\n', " "),
        })?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("roost-s3")
            .enable_all()
            .build()
            .map_err(|e| Error::Io {
                path: "tokio runtime".into(),
                source: e,
            })?;
        let prefix = prefix.trim_matches('/');
        let prefix = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        Ok(S3Backend {
            client,
            prefix,
            runtime,
        })
    }

    fn path(&self, key: &str) -> ObjectPath {
        ObjectPath::from(format!("{}{key}", self.prefix))
    }

    async fn get_async(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match self.client.get(&self.path(key)).await {
            Ok(result) => match result.bytes().await {
                Ok(bytes) => Ok(Some(bytes.to_vec())),
                Err(err) => Err(backend_error("get", key, err)),
            },
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(err) => Err(backend_error("get", key, err)),
        }
    }

    /// A ranged GET, its body not yet read: `None` when the object does
    /// not exist; `Some(None)` for a range that starts past the object's
    /// end (S3 refuses it: it reads nothing, and the caller, knowing the
    /// length it expected, names the truncation).
    async fn open_range(
        &self,
        key: &str,
        offset: u64,
        len: u64,
    ) -> Result<Option<Option<object_store::GetResult>>> {
        let options = object_store::GetOptions {
            range: Some(object_store::GetRange::Bounded(offset..offset + len.max(1))),
            ..Default::default()
        };
        match self.client.get_opts(&self.path(key), options).await {
            Ok(result) => Ok(Some(Some(result))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(err @ object_store::Error::Generic { .. })
                if err.to_string().contains("416") || err.to_string().contains("Range") =>
            {
                Ok(Some(None))
            }
            Err(err) => Err(backend_error("get", key, err)),
        }
    }

    async fn get_range_async(&self, key: &str, offset: u64, len: u64) -> Result<Option<Vec<u8>>> {
        let Some(opened) = self.open_range(key, offset, len).await? else {
            return Ok(None);
        };
        let Some(result) = opened else {
            return Ok(Some(Vec::new()));
        };
        match result.bytes().await {
            Ok(bytes) => {
                // The body as is (no copy when it is one buffer).
                let mut bytes: Vec<u8> = bytes.into();
                bytes.truncate(len as usize);
                Ok(Some(bytes))
            }
            Err(err) => Err(backend_error("get", key, err)),
        }
    }

    fn meta(&self, meta: object_store::ObjectMeta) -> ObjectMeta {
        let full = meta.location.to_string();
        ObjectMeta {
            key: full.strip_prefix(&self.prefix).unwrap_or(&full).to_owned(),
            size: meta.size,
            last_modified: meta.last_modified.into(),
        }
    }
}

impl Backend for S3Backend {
    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        self.put_owned(key, data.to_vec())
    }

    /// The buffer becomes the request body as it is (no copy; a retry
    /// sends the same shared bytes again).
    fn put_owned(&self, key: &str, data: Vec<u8>) -> Result<()> {
        let payload = PutPayload::from(data);
        self.runtime
            .block_on(self.client.put(&self.path(key), payload))
            .map(drop)
            .map_err(|e| backend_error("put", key, e))
    }

    fn put_owned_durable(&self, key: &str, data: Vec<u8>) -> Result<()> {
        // A successful S3 PUT is durable.
        self.put_owned(key, data)
    }

    fn put_durable(&self, key: &str, data: &[u8]) -> Result<()> {
        // A successful S3 PUT is durable and atomically replaces the object.
        self.put(key, data)
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.runtime.block_on(self.get_async(key))
    }

    /// Several GETs at once (the block service hands out batches).
    fn get_batch(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>> {
        self.runtime.block_on(
            futures::stream::iter(keys)
                .map(|key| self.get_async(key))
                .buffered(GET_CONCURRENCY_MAX)
                .try_collect(),
        )
    }

    fn get_range(&self, key: &str, offset: u64, len: u64) -> Result<Option<Vec<u8>>> {
        self.runtime
            .block_on(self.get_range_async(key, offset, len))
    }

    /// One ranged GET, its body handed on as it arrives.
    fn get_range_each(
        &self,
        key: &str,
        offset: u64,
        len: u64,
        each: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<bool> {
        self.runtime.block_on(async {
            let Some(opened) = self.open_range(key, offset, len).await? else {
                return Ok(false);
            };
            let Some(result) = opened else {
                return Ok(true);
            };
            let mut body = result.into_stream();
            let mut left = len;
            while let Some(piece) = body.next().await {
                let piece = piece.map_err(|err| backend_error("get", key, err))?;
                let take = piece.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                if take > 0 {
                    each(&piece[..take])?;
                    left -= take as u64;
                }
            }
            Ok(true)
        })
    }

    /// One ranged GET per range, several at once.
    fn get_ranges(&self, ranges: &[(String, u64, u64)]) -> Result<Vec<Option<Vec<u8>>>> {
        self.runtime.block_on(
            futures::stream::iter(ranges)
                .map(|(key, offset, len)| self.get_range_async(key, *offset, *len))
                .buffered(GET_CONCURRENCY_MAX)
                .try_collect(),
        )
    }

    /// One LIST request, whatever lies under the prefix.
    fn any_under(&self, prefix: &str) -> Result<bool> {
        self.runtime.block_on(async {
            let mut listing = self
                .client
                .list(Some(&self.path(prefix.trim_end_matches('/'))));
            match listing.next().await {
                None => Ok(false),
                Some(Ok(_)) => Ok(true),
                Some(Err(err)) => Err(backend_error("list", prefix, err)),
            }
        })
    }

    /// A request is a round trip: read packs in ranges of many objects.
    fn reads_in_batches(&self) -> bool {
        true
    }

    fn exists(&self, keys: &[String]) -> Result<Vec<bool>> {
        self.runtime.block_on(async {
            futures::stream::iter(keys)
                .map(|key| async move {
                    match self.client.head(&self.path(key)).await {
                        Ok(_) => Ok(true),
                        Err(object_store::Error::NotFound { .. }) => Ok(false),
                        Err(err) => Err(backend_error("exists", key, err)),
                    }
                })
                .buffered(EXISTS_CONCURRENCY_MAX)
                .try_collect()
                .await
        })
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let metas: Vec<object_store::ObjectMeta> = self
            .runtime
            .block_on(
                self.client
                    .list(Some(&self.path(prefix.trim_end_matches('/'))))
                    .try_collect(),
            )
            .map_err(|e| backend_error("list", prefix, e))?;
        Ok(metas.into_iter().map(|meta| self.meta(meta)).collect())
    }

    fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        match self.runtime.block_on(self.client.head(&self.path(key))) {
            Ok(meta) => Ok(Some(self.meta(meta))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(err) => Err(backend_error("head", key, err)),
        }
    }

    fn delete(&self, key: &str) -> Result<()> {
        match self.runtime.block_on(self.client.delete(&self.path(key))) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(err) => Err(backend_error("delete", key, err)),
        }
    }
}
