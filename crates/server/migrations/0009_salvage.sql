-- Salvage: a snapshot whose content is a kept copy of the sandbox's home
-- (not the home its placement holds). `kept_copy_id` names the copy,
-- `kept_runner_id` the runner holding it (the only one whose report it
-- takes) and `kept_at_ms` when that runner set it aside; all NULL for
-- every other snapshot.
ALTER TABLE snapshots ADD COLUMN kept_copy_id TEXT;
ALTER TABLE snapshots ADD COLUMN kept_runner_id TEXT;
ALTER TABLE snapshots ADD COLUMN kept_at_ms BIGINT;
CREATE INDEX snapshots_by_kept_copy ON snapshots (kept_copy_id, durability);
