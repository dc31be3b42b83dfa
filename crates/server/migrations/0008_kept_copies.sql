-- Kept copies: a home a runner set aside instead of deleting when it came
-- back to find the sandbox no longer its own (it may be the newest copy of
-- the work). `state` is `kept` until discarded (by its org, an admin, the
-- sandbox's deletion, expiry, or once a new placement runs from the store).
-- `sandboxes.kept_copies` is the record's list of the kept ones (JSON),
-- rewritten with every change here.
CREATE TABLE kept_copies (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    org_id TEXT NOT NULL,
    runner_id TEXT NOT NULL,
    name TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    kept_at_ms BIGINT NOT NULL,
    reason TEXT NOT NULL,
    state TEXT NOT NULL,
    ended_reason TEXT,
    UNIQUE (runner_id, sandbox_id, name)
);
CREATE INDEX kept_copies_by_runner ON kept_copies (runner_id, state);
ALTER TABLE sandboxes ADD COLUMN kept_copies TEXT;
