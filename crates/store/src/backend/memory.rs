//! In-memory backend for tests. Its clock can be moved so tests can age
//! objects past a gc grace period without sleeping.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use super::{Backend, ObjectMeta};
use crate::Result;

#[derive(Default)]
pub struct MemoryBackend {
    objects: Mutex<BTreeMap<String, (Vec<u8>, SystemTime)>>,
    clock_offset: Mutex<Duration>,
}

impl MemoryBackend {
    /// Makes every object written from now on look `by` younger relative to
    /// the real clock, so earlier objects look older.
    pub fn advance_clock(&self, by: Duration) {
        *lock(&self.clock_offset) += by;
    }

    fn now(&self) -> SystemTime {
        SystemTime::now() + *lock(&self.clock_offset)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data that is still valid.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Backend for MemoryBackend {
    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        let now = self.now();
        lock(&self.objects).insert(key.to_owned(), (data.to_vec(), now));
        Ok(())
    }

    fn put_durable(&self, key: &str, data: &[u8]) -> Result<()> {
        self.put(key, data)
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(lock(&self.objects).get(key).map(|(data, _)| data.clone()))
    }

    fn exists(&self, keys: &[String]) -> Result<Vec<bool>> {
        let objects = lock(&self.objects);
        Ok(keys.iter().map(|key| objects.contains_key(key)).collect())
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let objects = lock(&self.objects);
        Ok(objects
            .range(prefix.to_owned()..)
            .take_while(|(key, _)| key.starts_with(prefix))
            .map(|(key, (data, modified))| ObjectMeta {
                key: key.clone(),
                size: data.len() as u64,
                last_modified: *modified,
            })
            .collect())
    }

    fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        Ok(lock(&self.objects)
            .get(key)
            .map(|(data, modified)| ObjectMeta {
                key: key.to_owned(),
                size: data.len() as u64,
                last_modified: *modified,
            }))
    }

    fn delete(&self, key: &str) -> Result<()> {
        lock(&self.objects).remove(key);
        Ok(())
    }
}
