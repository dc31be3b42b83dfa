//! What a backup must carry of the store: every root the records point
//! to, read in one transaction (so, on PostgreSQL, from the same snapshot
//! as the dump that goes with it).

use sqlx::AnyConnection;

use api::lifecycle::SandboxState;

/// A root the records name, with whose it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordRoot {
    /// The sandbox id, snapshot id or image name.
    pub id: String,
    pub org_id: String,
    /// 64 hex digits.
    pub root: String,
}

/// Every root a restored deployment needs whole in its store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordRoots {
    /// Each durable sandbox's last completed save (not deleted ones: their
    /// homes are being released).
    pub sandboxes: Vec<RecordRoot>,
    /// Each replicated snapshot's root.
    pub snapshots: Vec<RecordRoot>,
    /// Each image's tree.
    pub images: Vec<RecordRoot>,
}

impl RecordRoots {
    pub fn len(&self) -> usize {
        self.sandboxes.len() + self.snapshots.len() + self.images.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Reads the roots through `conn` (inside the caller's transaction).
pub async fn roots(conn: &mut AnyConnection) -> Result<RecordRoots, sqlx::Error> {
    let live = SandboxState::sql_in(|s| s != SandboxState::Deleted);
    let read = |rows: Vec<(String, String, String)>| {
        rows.into_iter()
            .map(|(id, org_id, root)| RecordRoot { id, org_id, root })
            .collect()
    };
    let sandboxes = sqlx::query_as(&format!(
        "SELECT id, org_id, home_root FROM sandboxes
         WHERE home_root IS NOT NULL AND state IN {live} ORDER BY id"
    ))
    .fetch_all(&mut *conn)
    .await?;
    let snapshots = sqlx::query_as(
        "SELECT id, org_id, root FROM snapshots
         WHERE durability = 'replicated' AND root IS NOT NULL ORDER BY id",
    )
    .fetch_all(&mut *conn)
    .await?;
    let images = sqlx::query_as("SELECT name, org_id, root FROM images ORDER BY org_id, name")
        .fetch_all(&mut *conn)
        .await?;
    Ok(RecordRoots {
        sandboxes: read(sandboxes),
        snapshots: read(snapshots),
        images: read(images),
    })
}
