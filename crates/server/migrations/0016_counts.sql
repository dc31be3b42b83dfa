-- Counts kept as rows (issue 21), so admission and placement read a few
-- rows instead of counting sandboxes. Written by `records::counts` in the
-- transaction of every change to what a sandbox counts toward (its
-- state, desired state or runner), at commit, in one order; `roost admin
-- counts` recomputes them from the sandboxes and reports any drift.
--
-- Quota counts: scope `fleet` or `org:ID`, spread over a few slots so
-- concurrent transactions rarely wait on one row; a count is the sum of
-- its scope's slots. `running`: wanted running in a state that counts as
-- running (pending, recovering, starting, running, stopping); `held`:
-- not wanted deleted, in any state but deleting and deleted.
CREATE TABLE sandbox_counts (
    scope TEXT NOT NULL,
    slot BIGINT NOT NULL,
    running BIGINT NOT NULL,
    held BIGINT NOT NULL,
    PRIMARY KEY (scope, slot)
);
INSERT INTO sandbox_counts (scope, slot, running, held)
SELECT 'org:' || org_id, 0,
    SUM(CASE WHEN desired = 'running' AND state IN ('pending', 'recovering', 'starting', 'running', 'stopping') THEN 1 ELSE 0 END),
    SUM(CASE WHEN desired <> 'deleted' AND state NOT IN ('deleting', 'deleted') THEN 1 ELSE 0 END)
FROM sandboxes GROUP BY org_id;
INSERT INTO sandbox_counts (scope, slot, running, held)
SELECT 'fleet', 0,
    COALESCE(SUM(CASE WHEN desired = 'running' AND state IN ('pending', 'recovering', 'starting', 'running', 'stopping') THEN 1 ELSE 0 END), 0),
    COALESCE(SUM(CASE WHEN desired <> 'deleted' AND state NOT IN ('deleting', 'deleted') THEN 1 ELSE 0 END), 0)
FROM sandboxes;
-- What each runner's sandboxes in compute states (starting, running,
-- stopping) use of its capacity.
CREATE TABLE runner_usage (
    runner_id TEXT PRIMARY KEY,
    sandboxes BIGINT NOT NULL,
    memory_mib BIGINT NOT NULL,
    millicpus BIGINT NOT NULL,
    pids BIGINT NOT NULL
);
INSERT INTO runner_usage (runner_id, sandboxes, memory_mib, millicpus, pids)
SELECT runner_id, COUNT(*), COALESCE(SUM(memory_mib), 0), COALESCE(SUM(millicpus), 0), COALESCE(SUM(pids), 0)
FROM sandboxes WHERE runner_id IS NOT NULL AND state IN ('starting', 'running', 'stopping')
GROUP BY runner_id;
-- The passes read only what is due: runners by lease expiry, sandboxes by
-- TTL deadline (while one may still be due) and by end (until retention
-- deletes them), deleted sandboxes whose home is still pinned.
CREATE INDEX runners_by_lease ON runners (state, lease_expires_at_ms);
CREATE INDEX sandboxes_ttl_due ON sandboxes (expires_at_ms) WHERE expires_at_ms IS NOT NULL AND desired NOT IN ('terminated', 'deleted') AND state NOT IN ('failed', 'terminated', 'deleted');
CREATE INDEX sandboxes_retention_due ON sandboxes (state, ended_at_ms) WHERE ended_at_ms IS NOT NULL AND desired <> 'deleted';
CREATE INDEX sandboxes_homes_to_release ON sandboxes (state, home_root) WHERE home_root IS NOT NULL
