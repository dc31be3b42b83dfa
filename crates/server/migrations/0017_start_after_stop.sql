-- 1: a start was asked while a stop was under way (decided, its runner
-- still holding the compute). The stop goes on, since the runner may be
-- acting on it already; once it is done the sandbox starts again. A later
-- stop clears it.
ALTER TABLE sandboxes ADD COLUMN start_after_stop BIGINT NOT NULL DEFAULT 0;
