-- Durable homes: the last completed save of a sandbox's home (its root in
-- the store, pinned by the store home named after the sandbox) and how
-- saving goes. NULL interval: not a durable sandbox.
ALTER TABLE sandboxes ADD COLUMN home_root TEXT;
ALTER TABLE sandboxes ADD COLUMN home_saved_at_ms BIGINT;
ALTER TABLE sandboxes ADD COLUMN save_interval_s BIGINT;
ALTER TABLE sandboxes ADD COLUMN save_attempt_at_ms BIGINT;
ALTER TABLE sandboxes ADD COLUMN save_error TEXT;
ALTER TABLE sandboxes ADD COLUMN save_bytes_pending BIGINT;
ALTER TABLE sandboxes ADD COLUMN from_snapshot TEXT;

-- Snapshots: a receipt per request, whose durability moves pending, local
-- (captured on the host), replicated (committed in the store), or failed.
CREATE TABLE snapshots (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    requested TEXT NOT NULL,
    durability TEXT NOT NULL,
    reason TEXT,
    deadline_at_ms BIGINT,
    root TEXT,
    files BIGINT,
    logical_bytes BIGINT,
    captured_at_ms BIGINT,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);
CREATE INDEX snapshots_by_sandbox ON snapshots (sandbox_id, durability);
CREATE INDEX snapshots_by_org ON snapshots (org_id, id);
