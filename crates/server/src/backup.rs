//! Backups of a deployment's records and what a restored store needs:
//! the online copy of the database (SQLite `VACUUM INTO`; PostgreSQL a
//! `pg_dump` from a snapshot this module exports), the roots the copy
//! names, read from that same copy or snapshot, and the store pins that
//! keep those roots from gc once restored.
//!
//! `roost admin backup|restore|check` call these on the server's own data
//! dir and database (as `roost server` is configured), not through a
//! running server's API: a consistent copy of the database is the
//! database's to make, and the store copy reads the store directly.
//!
//! Why records first, then the store, is consistent: a root enters the
//! records only after its tree is whole in the store and pinned there
//! (`control::saves`: objects, then the `{id}-next` pin under the commit
//! lock, then the record; snapshots and images pin before their record).
//! So every root in a records copy was whole in the store before the copy
//! was taken, and a store copy started after it finds it, unless gc took
//! it in between, which it can only do once the root is no longer pinned
//! (a later save moved the sandbox's pins on, the snapshot was deleted)
//! and older than gc's grace period. The backup therefore checks every
//! root of its records copy in the copied store and, should one be
//! incomplete, takes the records and the (incremental) store copy again.
//! A save completing during the backup is in the records copy (and then
//! whole in the store before it) or not referenced by it.

use std::path::Path;

use crate::ServerError;
use crate::db::{Db, Engine};
use crate::records::backup::{RecordRoots, roots};

/// The database `roost server` uses in `data_dir` when none is named.
pub fn default_database_url(data_dir: &Path) -> String {
    format!("sqlite://{}?mode=rwc", data_dir.join("roost.db").display())
}

/// The records database at `url`, unmigrated (a backup changes nothing).
pub async fn connect(url: &str) -> Result<Db, ServerError> {
    Db::connect(url).await
}

/// The roots the records name now, read in one transaction.
pub async fn read_roots(db: &Db) -> Result<RecordRoots, ServerError> {
    let mut tx = db.pool.begin().await?;
    let read = roots(&mut tx).await?;
    tx.commit().await?;
    Ok(read)
}

/// SQLite: an online, consistent copy of the database into the new file
/// `dest` (`VACUUM INTO` reads in one transaction; writers go on, WAL),
/// and the roots that copy names, read from the copy itself.
pub async fn dump_sqlite(db: &Db, dest: &Path) -> Result<RecordRoots, ServerError> {
    if db.engine != Engine::Sqlite {
        return Err(ServerError::UnsupportedDatabase(db.url.to_string()));
    }
    let path = dest.to_str().ok_or_else(|| ServerError::Io {
        path: dest.to_owned(),
        source: std::io::Error::other("not a UTF-8 path"),
    })?;
    let quoted = path.replace('\'', "''");
    sqlx::query(&format!("VACUUM INTO '{quoted}'"))
        .execute(&db.pool)
        .await?;
    // Read-write: connecting sets WAL mode, which a read-only open refuses.
    let copy = Db::connect(&format!("sqlite://{path}?mode=rw")).await?;
    let read = read_roots(&copy).await;
    copy.pool.close().await;
    read
}

/// PostgreSQL: exports a snapshot from a read-only repeatable-read
/// transaction, reads the roots in it, and runs `dump(snapshot)` (the
/// caller's `pg_dump --snapshot`) while the transaction holds it, so the
/// dump and the roots are the same instant of the database.
pub async fn dump_postgres<F>(db: &Db, dump: F) -> Result<RecordRoots, ServerError>
where
    F: FnOnce(String) -> Result<(), String> + Send + 'static,
{
    use sqlx::Executor;
    if db.engine != Engine::Postgres {
        return Err(ServerError::UnsupportedDatabase(db.url.to_string()));
    }
    let mut conn = db.pool.acquire().await?;
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .await?;
    let result = async {
        let (snapshot,): (String,) = sqlx::query_as("SELECT pg_export_snapshot()")
            .fetch_one(&mut *conn)
            .await?;
        let read = roots(&mut conn).await?;
        tokio::task::spawn_blocking(move || dump(snapshot))
            .await
            .map_err(|err| ServerError::Store(format!("dump task failed: {err}")))?
            .map_err(|err| ServerError::Io {
                path: "pg_dump".into(),
                source: std::io::Error::other(err),
            })?;
        Ok::<_, ServerError>(read)
    }
    .await;
    // Read only: ending it either way changes nothing.
    let _ = conn.execute("ROLLBACK").await;
    result
}

/// Whether the database holds no roost tables (a restore's target).
pub async fn is_empty(db: &Db) -> Result<bool, ServerError> {
    let sql = match db.engine {
        Engine::Sqlite => "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'",
        Engine::Postgres => {
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = current_schema()"
        }
    };
    let (tables,): (i64,) = sqlx::query_as(sql).fetch_one(&db.pool).await?;
    Ok(tables == 0)
}

/// Points the store homes that pin each root at it, as the control plane
/// names them (a sandbox's `{id}`, a snapshot's `{id}`, an image's
/// `image-…`): a restored store's pointers may be newer than its records
/// (the store copy came after the records), and gc keeps only what a
/// pointer reaches. Blocking. Answers how many were written.
pub fn pin_roots(store: &store::Store, roots: &RecordRoots) -> Result<u64, String> {
    let mut pinned = 0;
    let pins = roots
        .sandboxes
        .iter()
        .map(|r| {
            (
                r,
                crate::control::home_store::home_names(&r.id).map(|(h, _)| h),
            )
        })
        .chain(
            roots
                .snapshots
                .iter()
                .map(|r| (r, crate::control::snapshots::snapshot_home(&r.id))),
        )
        .chain(
            roots
                .images
                .iter()
                .map(|r| (r, crate::control::images::image_home(&r.id))),
        );
    for (record, home) in pins {
        let home = home.map_err(|e| format!("{}: {}", record.id, e.message))?;
        let org: store::OrgId = record
            .org_id
            .parse()
            .map_err(|_| format!("{}: org {:?} is not a store org", record.id, record.org_id))?;
        let root: store::Digest = record
            .root
            .parse()
            .map_err(|_| format!("{}: root {:?} is not a digest", record.id, record.root))?;
        store
            .write_home(&org, &home, &root)
            .map_err(|e| format!("{}: {e}", record.id))?;
        pinned += 1;
    }
    Ok(pinned)
}
