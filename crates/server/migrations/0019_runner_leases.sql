-- A live runner's lease in a narrow table of its own. Every heartbeat
-- renews it, and the lease watcher reads it by its end, so the end is
-- indexed and no renewal can be a heap-only update: in the runners table
-- each renewal wrote a new version of the whole wide row (labels,
-- capabilities, credential) and of each of its indexes, 3,333 a second at
-- 10,000 runners, bloating the table placement reads whole. A row here
-- exists exactly while its runner is live; `runners.lease_expires_at_ms`
-- keeps the lease as written at registration and, once the runner is
-- lost, as it ended.
CREATE TABLE runner_leases (
    runner_id TEXT PRIMARY KEY,
    expires_at_ms BIGINT NOT NULL
);
INSERT INTO runner_leases (runner_id, expires_at_ms)
    SELECT id, lease_expires_at_ms FROM runners WHERE state = 'live';
CREATE INDEX runner_leases_by_end ON runner_leases (expires_at_ms);
DROP INDEX runners_by_lease;
