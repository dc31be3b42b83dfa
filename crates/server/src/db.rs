//! The records database: one `sqlx::AnyPool` over SQLite (a WAL file in
//! the data dir) or PostgreSQL, and one set of migrations for both. Queries
//! use `$1` placeholders and types both engines share (TEXT, BIGINT).

use std::time::Duration;

use std::sync::Arc;

use sqlx::any::{AnyPoolOptions, install_default_drivers};
use sqlx::{Any, AnyPool, Connection, Executor, Transaction};
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::ServerError;
use crate::hub::Hub;

/// Migrations in order; each runs once, in its own transaction, recorded
/// in `schema_migrations` (a concurrent server loses the race on the
/// primary key and finds the migration applied).
const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("../migrations/0001_orgs_and_tokens.sql")),
    (2, include_str!("../migrations/0002_sandboxes.sql")),
    (3, include_str!("../migrations/0003_counting_indexes.sql")),
    (4, include_str!("../migrations/0004_images.sql")),
    (5, include_str!("../migrations/0005_homes.sql")),
    (6, include_str!("../migrations/0006_failover.sql")),
    (7, include_str!("../migrations/0007_runner_credentials.sql")),
    (8, include_str!("../migrations/0008_kept_copies.sql")),
    (9, include_str!("../migrations/0009_salvage.sql")),
    (10, include_str!("../migrations/0010_state_message.sql")),
    (11, include_str!("../migrations/0011_observed.sql")),
    (12, include_str!("../migrations/0012_secrets.sql")),
    (13, include_str!("../migrations/0013_filesystems.sql")),
    (14, include_str!("../migrations/0014_agent.sql")),
    (15, include_str!("../migrations/0015_idle.sql")),
    (16, include_str!("../migrations/0016_counts.sql")),
    (17, include_str!("../migrations/0017_start_after_stop.sql")),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
}

#[derive(Clone)]
pub struct Db {
    pub pool: AnyPool,
    pub engine: Engine,
    pub url: String,
    /// Wakes long-poll waiters when a record they watch changes.
    pub hub: Hub,
    /// Tokens verified lately (`auth::TokenCache`): most requests
    /// authenticate without a query.
    pub tokens: Arc<crate::auth::TokenCache>,
    /// Runners as lately read, for placement (`scheduler::RunnerView`).
    pub runner_view: Arc<crate::scheduler::RunnerView>,
    /// SQLite has one writer: taking turns in-process turns would-be
    /// `SQLITE_BUSY` upgrades into a short queue. PostgreSQL needs none.
    sqlite_writer: Arc<Mutex<()>>,
}

/// A write transaction. Keys passed to [`WriteTx::changed`] wake their
/// waiters once the transaction commits: on PostgreSQL through NOTIFY,
/// delivered at commit to every server; locally right after commit.
pub struct WriteTx {
    pub tx: Transaction<'static, Any>,
    changed: Vec<String>,
    /// Changes to the kept counts, written at commit (`records::counts`).
    pub counts: crate::records::counts::Pending,
    /// The runners as this server last read them (`scheduler::RunnerView`).
    pub runner_view: Arc<crate::scheduler::RunnerView>,
    /// A runner's row changed what placement reads (registration, drain):
    /// the view is cleared at commit.
    pub runners_changed: bool,
    hub: Hub,
    engine: Engine,
    _writer: Option<OwnedMutexGuard<()>>,
}

impl WriteTx {
    pub async fn changed(&mut self, key: &str) -> Result<(), sqlx::Error> {
        if self.engine == Engine::Postgres {
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(crate::hub::PG_CHANNEL)
                .bind(key)
                .execute(&mut *self.tx)
                .await?;
        }
        self.changed.push(key.to_owned());
        Ok(())
    }

    /// A sandbox row's counted fields went from `before` to `after`
    /// (`None`: no row); the counts follow at commit.
    pub fn count(
        &mut self,
        before: Option<&crate::records::counts::Counted>,
        after: Option<&crate::records::counts::Counted>,
    ) {
        self.counts.change(before, after);
    }

    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        // The counts last: see `records::counts` (no deadlock, short holds).
        crate::records::counts::flush(&mut self).await?;
        self.tx.commit().await?;
        if self.runners_changed {
            self.runner_view.clear();
        }
        for key in &self.changed {
            self.hub.notify(key);
        }
        Ok(())
    }
}

impl Db {
    /// Whether the database answers.
    pub async fn ping(&self) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    pub async fn write(&self) -> Result<WriteTx, sqlx::Error> {
        let writer = match self.engine {
            Engine::Sqlite => Some(self.sqlite_writer.clone().lock_owned().await),
            Engine::Postgres => None,
        };
        // SQLite: take the write lock at BEGIN, where the busy timeout
        // applies. A deferred transaction that reads first and then writes
        // gets SQLITE_BUSY at once if another connection still holds the
        // lock (a dropped transaction's rollback runs when its connection
        // returns to the pool, just after our in-process lock is free).
        let tx = match self.engine {
            Engine::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await?,
            Engine::Postgres => self.pool.begin().await?,
        };
        Ok(WriteTx {
            tx,
            changed: Vec::new(),
            counts: Default::default(),
            runner_view: self.runner_view.clone(),
            runners_changed: false,
            hub: self.hub.clone(),
            engine: self.engine,
            _writer: writer,
        })
    }
}

impl Db {
    pub async fn connect(url: &str) -> Result<Db, ServerError> {
        install_default_drivers();
        let engine = if url.starts_with("sqlite:") {
            Engine::Sqlite
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Engine::Postgres
        } else {
            return Err(ServerError::UnsupportedDatabase(url.to_owned()));
        };
        let pool = AnyPoolOptions::new()
            .max_connections(if engine == Engine::Sqlite { 4 } else { 16 })
            .acquire_timeout(Duration::from_secs(10))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if engine == Engine::Sqlite {
                        // A busy timeout instead of immediate SQLITE_BUSY
                        // errors (the WAL mode is set once, below).
                        conn.execute("PRAGMA busy_timeout = 5000").await?;
                        conn.execute("PRAGMA foreign_keys = ON").await?;
                    }
                    Ok(())
                })
            })
            // A request dropped mid-`begin` (its client went away) can leave
            // the BEGIN run but no `Transaction` to end it: on SQLite that
            // connection would hold the write lock until reused, and every
            // other writer would wait out the busy timeout. Such a
            // connection is closed (which ends its transaction), not reused.
            .after_release(|conn, _| Box::pin(async move { Ok(!conn.is_in_transaction()) }))
            .connect(url)
            .await?;
        if engine == Engine::Sqlite {
            // WAL (readers never block the writer) is a property of the
            // database file: set once at start-up, because switching needs
            // an exclusive lock that the busy timeout does not wait for,
            // so doing it on every new connection fails under load.
            pool.execute("PRAGMA journal_mode = WAL").await?;
        }
        Ok(Db {
            pool,
            engine,
            url: url.to_owned(),
            hub: Hub::default(),
            tokens: Arc::default(),
            runner_view: Arc::default(),
            sqlite_writer: Arc::new(Mutex::new(())),
        })
    }

    /// Applies pending migrations. On PostgreSQL an advisory lock makes
    /// servers starting together take turns (concurrent `CREATE TABLE`s
    /// race inside the catalog); SQLite's file lock does the same there.
    pub async fn migrate(&self) -> Result<(), ServerError> {
        let mut conn = self.pool.acquire().await?;
        if self.engine == Engine::Postgres {
            sqlx::query("SELECT pg_advisory_lock($1)")
                .bind(MIGRATION_LOCK_ID)
                .execute(&mut *conn)
                .await?;
        }
        let result = apply_migrations(&mut conn).await;
        if self.engine == Engine::Postgres {
            sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(MIGRATION_LOCK_ID)
                .execute(&mut *conn)
                .await?;
        }
        result
    }
}

/// Any fixed number all roost servers agree on.
const MIGRATION_LOCK_ID: i64 = 0x0072_6f6f_7374; // "roost"

async fn apply_migrations(conn: &mut sqlx::AnyConnection) -> Result<(), ServerError> {
    use sqlx::Connection;
    conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY, applied_at_ms BIGINT NOT NULL)")
        .await?;
    for (version, sql) in MIGRATIONS {
        let applied: Option<(i64,)> =
            sqlx::query_as("SELECT version FROM schema_migrations WHERE version = $1")
                .bind(version)
                .fetch_optional(&mut *conn)
                .await?;
        if applied.is_some() {
            continue;
        }
        let mut tx = conn.begin().await?;
        sqlx::query("INSERT INTO schema_migrations (version, applied_at_ms) VALUES ($1, $2)")
            .bind(version)
            .bind(now_ms())
            .execute(&mut *tx)
            .await?;
        // Whole-line comments go first, so a `;` in prose splits nothing.
        let code: Vec<&str> = sql
            .lines()
            .filter(|line| !line.trim_start().starts_with("--"))
            .collect();
        for statement in code
            .join("\n")
            .split(';')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            tx.execute(statement).await?;
        }
        tx.commit().await?;
    }
    Ok(())
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    /// Writers whose requests are dropped at every point of `write()`
    /// never leave the database locked for the next one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_dropped_while_it_begins_leaves_no_lock_behind() {
        let path = std::env::temp_dir().join(format!(
            "roost-db-cancel-{}-{}.db",
            std::process::id(),
            crate::auth::random_hex(4).expect("random")
        ));
        let db = Db::connect(&format!("sqlite://{}?mode=rwc", path.display()))
            .await
            .expect("open");
        db.migrate().await.expect("migrate");
        for attempt in 0..300u32 {
            // Poll a write a few times, letting the worker run between
            // polls, then drop it wherever it got to.
            let mut pending = Box::pin(db.write());
            let mut cx = Context::from_waker(Waker::noop());
            for _ in 0..(attempt % 12) {
                if let Poll::Ready(tx) = pending.as_mut().poll(&mut cx) {
                    drop(tx);
                    break;
                }
                tokio::time::sleep(Duration::from_micros(u64::from(attempt % 5) * 100)).await;
            }
            drop(pending);
            let next = tokio::time::timeout(Duration::from_secs(2), async {
                let mut tx = db.write().await?;
                sqlx::query("UPDATE schema_migrations SET version = version WHERE version = 0")
                    .execute(&mut *tx.tx)
                    .await?;
                tx.commit().await
            })
            .await;
            assert!(
                matches!(next, Ok(Ok(()))),
                "attempt {attempt}: the next writer found the database locked: {next:?}"
            );
        }
        let _ = std::fs::remove_file(&path);
    }
}
