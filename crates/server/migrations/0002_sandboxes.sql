-- Runners, sandboxes, their events, commands and output, idempotency keys.
-- Types both engines share: TEXT, BIGINT, BYTEA (a BLOB in SQLite).
CREATE TABLE runners (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    placement_class TEXT NOT NULL,
    labels TEXT NOT NULL,
    capabilities TEXT NOT NULL,
    capacity_sandboxes BIGINT NOT NULL,
    capacity_memory_mib BIGINT NOT NULL,
    capacity_millicpus BIGINT NOT NULL,
    capacity_pids BIGINT NOT NULL,
    state TEXT NOT NULL,
    lease_expires_at_ms BIGINT NOT NULL,
    registered_at_ms BIGINT NOT NULL,
    -- Bumped by every placement on this runner: an UPDATE that takes the
    -- row lock, so two servers never overfill one runner.
    placements BIGINT NOT NULL
);
CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL REFERENCES orgs (id),
    image TEXT NOT NULL,
    storage_class TEXT NOT NULL,
    memory_mib BIGINT,
    millicpus BIGINT,
    pids BIGINT,
    network TEXT NOT NULL,
    placement TEXT NOT NULL,
    env TEXT NOT NULL,
    labels TEXT NOT NULL,
    state TEXT NOT NULL,
    state_reason TEXT,
    desired TEXT NOT NULL,
    runner_id TEXT,
    last_runner_id TEXT,
    epoch BIGINT NOT NULL,
    quarantined BIGINT NOT NULL,
    quarantine_reason TEXT,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT,
    ended_at_ms BIGINT
);
CREATE INDEX sandboxes_by_org ON sandboxes (org_id, id);
CREATE INDEX sandboxes_by_runner ON sandboxes (runner_id);
CREATE INDEX sandboxes_by_state ON sandboxes (state);
CREATE TABLE sandbox_labels (
    sandbox_id TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, key)
);
CREATE INDEX sandbox_labels_by_pair ON sandbox_labels (key, value);
CREATE TABLE events (
    sandbox_id TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    seq BIGINT NOT NULL,
    at_ms BIGINT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    message TEXT,
    epoch BIGINT NOT NULL,
    runner_id TEXT,
    PRIMARY KEY (sandbox_id, seq)
);
CREATE TABLE commands (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    org_id TEXT NOT NULL,
    argv TEXT NOT NULL,
    env TEXT NOT NULL,
    cwd TEXT,
    timeout_s BIGINT,
    state TEXT NOT NULL,
    state_reason TEXT,
    exit_code BIGINT,
    signal TEXT,
    signal_requested TEXT,
    epoch BIGINT,
    stdout_bytes BIGINT NOT NULL,
    stderr_bytes BIGINT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    started_at_ms BIGINT,
    ended_at_ms BIGINT
);
CREATE INDEX commands_by_sandbox ON commands (sandbox_id, id);
CREATE TABLE command_output (
    command_id TEXT NOT NULL REFERENCES commands (id) ON DELETE CASCADE,
    stream TEXT NOT NULL,
    start_offset BIGINT NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (command_id, stream, start_offset)
);
-- Written in the same transaction as the effect it guards.
CREATE TABLE idempotency_keys (
    org_id TEXT NOT NULL,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    status BIGINT NOT NULL,
    response TEXT NOT NULL,
    resource_id TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (org_id, scope, key)
);
-- One row: creates lock it (an UPDATE) so quota and fleet-ceiling counts
-- are taken one transaction at a time across every server.
CREATE TABLE admission (
    id BIGINT PRIMARY KEY,
    creates BIGINT NOT NULL
);
INSERT INTO admission (id, creates) VALUES (1, 0)
