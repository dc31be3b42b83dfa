-- Host failure: a runner being emptied (`drain` for maintenance, `preempt`
-- when its host is going away) takes no new sandboxes and gives up its
-- durable ones; and the lease watcher's hold when a large share of the
-- fleet loses its lease at once (one row, id 'fleet', while it lasts).
ALTER TABLE runners ADD COLUMN drain TEXT;
CREATE TABLE lease_hold (
    id TEXT PRIMARY KEY,
    since_ms BIGINT NOT NULL
);
