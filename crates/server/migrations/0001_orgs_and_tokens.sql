-- Organisations and the hashed tokens of every principal.
CREATE TABLE orgs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    max_running BIGINT,
    max_total BIGINT,
    created_at_ms BIGINT NOT NULL
);
CREATE TABLE tokens (
    hash TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    org_id TEXT REFERENCES orgs (id),
    created_at_ms BIGINT NOT NULL
);
-- One row per one-time bootstrap step, so several servers starting at once
-- on one database create the admin token exactly once.
CREATE TABLE bootstrap (
    step TEXT PRIMARY KEY,
    done_at_ms BIGINT NOT NULL
);
