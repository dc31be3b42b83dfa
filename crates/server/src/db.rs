//! The records database: one `sqlx::AnyPool` over SQLite (a WAL file in
//! the data dir) or PostgreSQL, and one set of migrations for both. Queries
//! use `$1` placeholders and types both engines share (TEXT, BIGINT).

use std::time::Duration;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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
    (18, include_str!("../migrations/0018_token_revocation.sql")),
    (19, include_str!("../migrations/0019_runner_leases.sql")),
    (20, include_str!("../migrations/0020_kept_by_sandbox.sql")),
    (21, include_str!("../migrations/0021_output_bound.sql")),
    (22, include_str!("../migrations/0022_save_order.sql")),
    (23, include_str!("../migrations/0023_signal_seq.sql")),
    (24, include_str!("../migrations/0024_command_signals.sql")),
    (25, include_str!("../migrations/0025_output_counts.sql")),
    (26, include_str!("../migrations/0026_commands_by_pid.sql")),
    (27, include_str!("../migrations/0027_home_bound.sql")),
    (28, include_str!("../migrations/0028_runner_profiles.sql")),
    (29, include_str!("../migrations/0029_org_store_bound.sql")),
    (30, include_str!("../migrations/0030_deployment_keys.sql")),
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
    pub url: Arc<str>,
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
    /// Lines in which this server's creates wait for a contended row
    /// (`WriteTx::take_turn`).
    turns: Arc<Turns>,
    /// SQLite: hot reads on the request's own thread (`SqliteReads`).
    pub sqlite_reads: Option<Arc<SqliteReads>>,
    /// PostgreSQL: sandboxes read by id, gathered (`GatheredReads`).
    pub sandbox_reads: Option<Arc<GatheredReads>>,
}

/// Reads of a SQLite database on the calling thread, for the hottest
/// requests (a sandbox or a command by id: `GET /v1/sandboxes/{id}`, a
/// long-poll's re-reads; `records::read_optional`).
///
/// sqlx runs every SQLite connection on a worker thread of its own and
/// passes each statement and its rows through channels: two thread
/// wake-ups per query, which profiles of the server under `wrk` showed to
/// be most of a GET's cost (BENCHMARKS.md, "Fleet", GET). A read by
/// primary key from the page cache takes microseconds, less than those
/// hand-offs, so it runs here on a connection of our own.
///
/// What keeps this honest: the database is in WAL mode, so a read never
/// waits for the writer and sees every transaction committed before it
/// began (a long-poll woken at commit reads the commit); the connections
/// are `query_only`; and the busy timeout is short, so the rare read that
/// would wait (a WAL reset in progress) does not hold the async thread:
/// it answers `None` and the caller reads through sqlx instead.
pub struct SqliteReads {
    path: std::path::PathBuf,
    idle: std::sync::Mutex<Vec<rusqlite::Connection>>,
    /// Reads answered here, and declined to sqlx (`/metrics`).
    answered: AtomicU64,
    declined: AtomicU64,
}

/// Idle read connections kept; more are opened under load and closed
/// when returned beyond this.
const SQLITE_READS_IDLE_MAX: usize = 8;

impl SqliteReads {
    /// For a `sqlite://PATH[?…]` (or `sqlite:PATH`) file database; `None`
    /// for an in-memory one, which a second connection cannot see.
    fn for_url(url: &str) -> Option<SqliteReads> {
        let rest = url
            .strip_prefix("sqlite://")
            .or_else(|| url.strip_prefix("sqlite:"))?;
        let (path, options) = rest.split_once('?').unwrap_or((rest, ""));
        if path.is_empty() || path.starts_with(':') || options.contains("mode=memory") {
            return None;
        }
        Some(SqliteReads {
            path: path.into(),
            idle: std::sync::Mutex::new(Vec::new()),
            answered: AtomicU64::new(0),
            declined: AtomicU64::new(0),
        })
    }

    /// Reads answered here and reads declined to sqlx, since start.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.answered.load(Ordering::Relaxed),
            self.declined.load(Ordering::Relaxed),
        )
    }

    fn open(&self) -> rusqlite::Result<rusqlite::Connection> {
        use rusqlite::OpenFlags;
        let conn = rusqlite::Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(Duration::from_millis(20))?;
        conn.pragma_update(None, "query_only", true)?;
        Ok(conn)
    }

    /// Runs `read` on an idle connection. `None` when it could not answer
    /// (the database busy, or any other error, logged): the caller reads
    /// through sqlx, whose answer or error stands.
    pub fn read<T>(
        &self,
        read: impl FnOnce(&rusqlite::Connection) -> rusqlite::Result<T>,
    ) -> Option<T> {
        let answer = self.try_read(read);
        let counter = match answer {
            Some(_) => &self.answered,
            None => &self.declined,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        answer
    }

    fn try_read<T>(
        &self,
        read: impl FnOnce(&rusqlite::Connection) -> rusqlite::Result<T>,
    ) -> Option<T> {
        let idle = self.idle.lock().ok()?.pop();
        let conn = match idle {
            Some(conn) => conn,
            None => match self.open() {
                Ok(conn) => conn,
                Err(err) => {
                    tracing::debug!(%err, "direct SQLite read: cannot open");
                    return None;
                }
            },
        };
        match read(&conn) {
            Ok(value) => {
                if let Ok(mut idle) = self.idle.lock()
                    && idle.len() < SQLITE_READS_IDLE_MAX
                {
                    idle.push(conn);
                }
                Some(value)
            }
            Err(err) => {
                // The connection is closed, not reused: whatever went wrong
                // stays with it.
                tracing::debug!(%err, "direct SQLite read failed; reading through sqlx");
                None
            }
        }
    }
}

/// PostgreSQL: reads of one table's rows by primary key, from requests
/// running at the same time, gathered into one query
/// (`SELECT … WHERE id IN (…)`) — for the hottest read of the API, a
/// sandbox by id (`records::sandboxes::visible`).
///
/// Each query is a round trip to PostgreSQL, and under load most of a
/// GET's cost was PostgreSQL's per-statement work and the two processes'
/// socket wake-ups (BENCHMARKS.md, "Fleet", GET on PostgreSQL). A read
/// is queued to a gatherer; a gatherer takes every read waiting (up to
/// [`GATHER_MAX`]) and answers them with one query. Nothing waits for a
/// batch to fill: a read that finds a gatherer idle is sent at once, and
/// reads arriving while a query is out go in the next one.
///
/// What keeps this honest: a read's query is sent after the read was
/// queued, so it sees every transaction committed before the request
/// asked (read-your-writes across servers, as a query of its own would);
/// the rows are filtered by the caller exactly as its own `WHERE` would
/// have; and a read that cannot be queued (the queue full) or whose
/// gathered query failed reads alone through the pool, whose answer or
/// error stands.
pub struct GatheredReads {
    queue: tokio::sync::mpsc::Sender<Wanted>,
    /// Reads answered by a gathered query, and the queries that did.
    answered: AtomicU64,
    queries: Arc<AtomicU64>,
}

/// One queued read: the id, and where its row (or "not found") goes; an
/// `Err` says the gathered query failed.
struct Wanted {
    id: String,
    answer: tokio::sync::oneshot::Sender<Result<Option<sqlx::any::AnyRow>, ()>>,
}

/// Most reads one gathered query answers.
const GATHER_MAX: usize = 128;
/// Gathering queries in flight at once, each on its own connection.
const GATHERERS: usize = 2;
/// Reads waiting beyond this go alone to the pool.
const GATHER_QUEUE: usize = 4096;

impl GatheredReads {
    /// Starts the gatherers for `SELECT {columns} FROM {table} WHERE id IN
    /// (…)` (`columns` must include `id`). They end when this is dropped.
    pub fn start(pool: &AnyPool, columns: &str, table: &str) -> GatheredReads {
        let (queue, waiting) = tokio::sync::mpsc::channel(GATHER_QUEUE);
        let waiting = Arc::new(Mutex::new(waiting));
        let select: Arc<str> = format!("SELECT {columns} FROM {table} WHERE id IN (").into();
        let queries = Arc::new(AtomicU64::new(0));
        for _ in 0..GATHERERS {
            tokio::spawn(gather(
                pool.clone(),
                select.clone(),
                waiting.clone(),
                queries.clone(),
            ));
        }
        GatheredReads {
            queue,
            answered: AtomicU64::new(0),
            queries,
        }
    }

    /// The row whose id is `id`, or `None` if there is none; `Err(())`
    /// when it could not be read this way (the caller reads alone).
    pub async fn read(&self, id: &str) -> Result<Option<sqlx::any::AnyRow>, ()> {
        let (answer, row) = tokio::sync::oneshot::channel();
        let wanted = Wanted {
            id: id.to_owned(),
            answer,
        };
        self.queue.try_send(wanted).map_err(|_| ())?;
        let row = row.await.map_err(|_| ())??;
        self.answered.fetch_add(1, Ordering::Relaxed);
        Ok(row)
    }

    /// Reads answered by gathered queries, and those queries, since start.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.answered.load(Ordering::Relaxed),
            self.queries.load(Ordering::Relaxed),
        )
    }
}

/// One gatherer: takes what waits, answers it with one query, repeats.
async fn gather(
    pool: AnyPool,
    select: Arc<str>,
    waiting: Arc<Mutex<tokio::sync::mpsc::Receiver<Wanted>>>,
    queries: Arc<AtomicU64>,
) {
    let mut batch = Vec::with_capacity(GATHER_MAX);
    loop {
        if waiting.lock().await.recv_many(&mut batch, GATHER_MAX).await == 0 {
            return; // every sender gone
        }
        let mut ids: Vec<&str> = batch.iter().map(|wanted| wanted.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        // Placeholders in powers of two (the last id repeated), so that
        // PostgreSQL and sqlx's statement cache see a handful of
        // statements, not one per batch size.
        let slots = ids.len().next_power_of_two();
        let mut sql = String::with_capacity(select.len() + slots * 5);
        sql.push_str(&select);
        for slot in 1..=slots {
            if slot > 1 {
                sql.push(',');
            }
            sql.push_str(&format!("${slot}"));
        }
        sql.push(')');
        let mut query = sqlx::query(&sql);
        for slot in 0..slots {
            query = query.bind(ids[slot.min(ids.len() - 1)]);
        }
        let rows = query.fetch_all(&pool).await;
        queries.fetch_add(1, Ordering::Relaxed);
        match rows {
            Ok(rows) => {
                let mut by_id = std::collections::HashMap::with_capacity(rows.len());
                for row in rows {
                    if let Ok(id) = sqlx::Row::try_get::<String, _>(&row, "id") {
                        by_id.insert(id, row);
                    }
                }
                for wanted in batch.drain(..) {
                    let _ = wanted.answer.send(Ok(by_id.get(&wanted.id).cloned()));
                }
            }
            Err(err) => {
                tracing::debug!(%err, reads = batch.len(), "gathered read failed; each reads alone");
                for wanted in batch.drain(..) {
                    let _ = wanted.answer.send(Err(()));
                }
            }
        }
    }
}

/// A write transaction. Keys passed to [`WriteTx::changed`] wake their
/// waiters once the transaction commits: on PostgreSQL through NOTIFY,
/// delivered at commit to every server; locally right after commit.
pub struct WriteTx {
    pub tx: Transaction<'static, Any>,
    changed: std::collections::BTreeSet<String>,
    /// Keys to wake without a change ([`WriteTx::woken`]).
    woken: std::collections::BTreeSet<String>,
    /// Changes to the kept counts, written at commit (`records::counts`).
    pub counts: crate::records::counts::Pending,
    /// The runners as this server last read them (`scheduler::RunnerView`).
    pub runner_view: Arc<crate::scheduler::RunnerView>,
    /// A runner's row changed what placement reads (registration, drain):
    /// the view is cleared at commit.
    pub runners_changed: bool,
    /// The pool this transaction came from: for a read ahead that must not
    /// hold the transaction up (`scheduler::RunnerView`).
    pub pool: AnyPool,
    hub: Hub,
    engine: Engine,
    _writer: Option<OwnedMutexGuard<()>>,
    turns: Arc<Turns>,
    turn: Turn,
}

/// Whether a transaction waits in line for a contended row (`take_turn`).
enum Turn {
    /// It may hold a lock another transaction waits for: it must not.
    NotAllowed,
    Allowed,
    /// Its turn, held until it commits or rolls back.
    Held(#[allow(dead_code)] OwnedMutexGuard<()>),
}

/// Lines for contended rows, one per key's stripe: a bounded set, shared
/// by keys that hash alike (they then take turns with each other, which
/// costs only waiting; a transaction holds one turn at most).
struct Turns([Arc<Mutex<()>>; TURN_STRIPES]);

const TURN_STRIPES: usize = 64;

impl Default for Turns {
    fn default() -> Turns {
        Turns(std::array::from_fn(|_| Arc::default()))
    }
}

impl Turns {
    fn line(&self, key: &str) -> Arc<Mutex<()>> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let hash = BuildHasherDefault::<DefaultHasher>::default().hash_one(key);
        self.0[hash as usize % TURN_STRIPES].clone()
    }
}

impl WriteTx {
    /// Wakes `key`'s waiters once this transaction commits. Nothing is
    /// sent now: the keys go out together at commit (see `commit`).
    pub fn changed(&mut self, key: &str) {
        self.changed.insert(key.to_owned());
    }

    /// Wakes `key`'s waiters once this transaction commits, without
    /// counting as a change to any runner's set remembered by the hub
    /// ([`crate::hub::Hub::wake`]). Only for a write that no runner's set
    /// read elsewhere can be stale for: a hand-over done by the read of
    /// that very set (`records::commands::hand_over`).
    pub fn woken(&mut self, key: &str) {
        self.woken.insert(key.to_owned());
    }

    /// Lets this transaction wait in line (`take_turn`): the caller
    /// vouches that it holds no lock another transaction could wait for
    /// (a create, which so far has only read and written its new rows).
    pub fn allow_turn(&mut self) {
        if matches!(self.turn, Turn::NotAllowed) {
            self.turn = Turn::Allowed;
        }
    }

    /// Before locking a row every transaction of a kind locks (the
    /// admission row, a runner's row): waits for this server's earlier
    /// transactions in the line for `key` to end, first come first served,
    /// and holds the turn until this one ends. Nothing unless allowed
    /// (`allow_turn`), not on SQLite (one writer), and once per transaction.
    ///
    /// Why: PostgreSQL wakes every waiter of a row lock when it is
    /// released and they race for it, so under load some lose many times
    /// over (create p99 six times its p50 with 16 clients in
    /// `bench/fleet/run.sh`, about twice with the line). In line, each
    /// server has one waiter at the row.
    ///
    /// Why it cannot deadlock: a transaction waits in line only while it
    /// holds no lock anyone waits for, and holds one turn at most; so the
    /// holder of a turn waits only for transactions not in any line.
    pub async fn take_turn(&mut self, key: &str) {
        if self.engine == Engine::Postgres && matches!(self.turn, Turn::Allowed) {
            let line = self.turns.line(key);
            self.turn = Turn::Held(line.lock_owned().await);
        }
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
        // Every NOTIFY in one statement (PostgreSQL delivers them at
        // commit whenever they are sent): a round trip per key put
        // several inside a placement's lock on its runner.
        if self.engine == Engine::Postgres && !(self.changed.is_empty() && self.woken.is_empty()) {
            let woken = self
                .woken
                .iter()
                .filter(|key| !self.changed.contains(*key))
                .map(|key| format!("{}{key}", crate::hub::WAKE_ONLY_PREFIX));
            let payloads: Vec<String> = self.changed.iter().cloned().chain(woken).collect();
            notify_all(&mut self.tx, &payloads).await?;
        }
        // The counts last: see `records::counts` (no deadlock, short holds).
        crate::records::counts::flush(&mut self).await?;
        self.tx.commit().await?;
        if self.runners_changed {
            self.runner_view.clear();
        }
        for key in &self.changed {
            self.hub.notify(key);
        }
        for key in self.woken.difference(&self.changed) {
            self.hub.wake(key);
        }
        Ok(())
    }
}

/// Keys sent per NOTIFY statement: bounds the statement's parameters.
const NOTIFY_KEYS_PER_STATEMENT: usize = 256;

/// `SELECT pg_notify($1, $2), pg_notify($1, $3), …` for every key.
async fn notify_all(
    tx: &mut Transaction<'static, Any>,
    keys: &[String],
) -> Result<(), sqlx::Error> {
    for chunk in keys.chunks(NOTIFY_KEYS_PER_STATEMENT) {
        let calls: Vec<String> = (0..chunk.len())
            .map(|i| format!("pg_notify($1, ${})", i + 2))
            .collect();
        let sql = format!("SELECT {}", calls.join(", "));
        let mut query = sqlx::query(&sql).bind(crate::hub::PG_CHANNEL);
        for key in chunk {
            query = query.bind(key);
        }
        query.execute(&mut **tx).await?;
    }
    Ok(())
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
            changed: Default::default(),
            woken: Default::default(),
            counts: Default::default(),
            runner_view: self.runner_view.clone(),
            runners_changed: false,
            pool: self.pool.clone(),
            hub: self.hub.clone(),
            engine: self.engine,
            _writer: writer,
            turns: self.turns.clone(),
            turn: Turn::NotAllowed,
        })
    }
}

/// How long a PostgreSQL connection may sit in the pool before it is
/// pinged as it is handed out (see [`Db::connect`]).
const PING_IDLE_AFTER: Duration = Duration::from_secs(1);

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
            // sqlx pings every connection as it comes back to the pool, so
            // one just released is known to work. Pinging it again before
            // every acquire (sqlx's default) put a second round trip ahead
            // of each query (GET on PostgreSQL: 15k/s with it, 17-18k/s
            // without, BENCHMARKS "Fleet"). A PostgreSQL
            // connection idle for a while may have been cut (a restarted
            // server), so that one is pinged before a request gets it;
            // one that breaks in between fails its query (503
            // `unavailable`, retryable) and is closed at its release ping.
            // A SQLite connection does not break while idle.
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                Box::pin(async move {
                    if engine == Engine::Postgres && meta.idle_for >= PING_IDLE_AFTER {
                        conn.ping().await?;
                    }
                    Ok(true)
                })
            })
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
            engine,
            url: url.into(),
            hub: Hub::default(),
            tokens: Arc::default(),
            runner_view: Arc::default(),
            sqlite_writer: Arc::new(Mutex::new(())),
            turns: Arc::default(),
            sqlite_reads: match engine {
                Engine::Sqlite => SqliteReads::for_url(url).map(Arc::new),
                Engine::Postgres => None,
            },
            sandbox_reads: (engine == Engine::Postgres).then(|| {
                Arc::new(GatheredReads::start(
                    &pool,
                    crate::records::sandboxes::SANDBOX_COLUMNS,
                    "sandboxes",
                ))
            }),
            pool,
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

    /// Direct reads are for file databases: an in-memory one is private
    /// to each connection, so a second connection would read another,
    /// empty database.
    #[test]
    fn direct_reads_are_for_file_databases_only() {
        for (url, path) in [
            (
                "sqlite:///var/lib/roost/roost.db?mode=rwc",
                Some("/var/lib/roost/roost.db"),
            ),
            ("sqlite://roost.db", Some("roost.db")),
            ("sqlite:data/roost.db", Some("data/roost.db")),
            ("sqlite::memory:", None),
            ("sqlite://", None),
            ("sqlite://file.db?mode=memory&cache=shared", None),
            ("postgres://roost@localhost/roost", None),
        ] {
            let reads = SqliteReads::for_url(url);
            assert_eq!(
                reads
                    .as_ref()
                    .map(|r| r.path.display().to_string())
                    .as_deref(),
                path,
                "{url}"
            );
        }
    }

    /// A direct read that cannot answer declines, so the caller reads
    /// through sqlx; a read that fails leaves no connection behind, and
    /// one that answers returns its connection for the next.
    #[test]
    fn a_direct_read_that_cannot_answer_declines() {
        let missing = SqliteReads::for_url("sqlite:///nonexistent/roost.db").expect("a file url");
        assert_eq!(missing.read(|_| Ok(1)), None, "no file: nothing is created");
        assert!(!std::path::Path::new("/nonexistent/roost.db").exists());
        assert_eq!(missing.counts(), (0, 1));

        let dir = tempfile::tempdir().expect("a temp dir");
        let file = dir.path().join("roost.db");
        rusqlite::Connection::open(&file)
            .and_then(|conn| {
                conn.execute_batch("CREATE TABLE t (v BIGINT); INSERT INTO t VALUES (7);")
            })
            .expect("a database");
        let reads =
            SqliteReads::for_url(&format!("sqlite://{}", file.display())).expect("a file url");
        let read = |conn: &rusqlite::Connection| {
            conn.query_row("SELECT v FROM t", [], |row| row.get::<_, i64>(0))
        };
        assert_eq!(reads.read(read), Some(7));
        assert_eq!(
            reads.read(|conn| conn.execute("DELETE FROM t", [])),
            None,
            "the connection is query-only"
        );
        assert_eq!(
            reads.read(|conn| conn.query_row("SELECT nope FROM t", [], |_| Ok(()))),
            None
        );
        assert_eq!(reads.read(read), Some(7), "the row is still there");
        assert_eq!(reads.counts(), (2, 2));
        assert_eq!(
            reads.idle.lock().expect("idle").len(),
            1,
            "one kept, the failed ones closed"
        );
    }

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
