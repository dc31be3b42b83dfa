-- Sleeping when idle and waking on use (README "Idle sandboxes").
-- Seconds without activity after which a running sandbox is stopped
-- (`state_reason: idle`); 0: never. Sandboxes made before this never sleep.
ALTER TABLE sandboxes ADD COLUMN idle_timeout_s BIGINT NOT NULL DEFAULT 0;
-- 1: a command sent while it is stopped starts it; 0: refused (409).
ALTER TABLE sandboxes ADD COLUMN auto_wake BIGINT NOT NULL DEFAULT 1;
-- The last activity (README's list, nothing else) and what it was.
ALTER TABLE sandboxes ADD COLUMN last_activity_at_ms BIGINT;
ALTER TABLE sandboxes ADD COLUMN last_activity TEXT;
-- When it goes to sleep unless something happens first: set only while it
-- is `running` with a timeout, so the idle pass reads only what is due and
-- a sleeping fleet costs it nothing.
ALTER TABLE sandboxes ADD COLUMN idle_deadline_ms BIGINT;
CREATE INDEX sandboxes_idle_deadline ON sandboxes (idle_deadline_ms) WHERE idle_deadline_ms IS NOT NULL;
-- The reason `desired` was last set with (`idle`, `woken_by_command`, …):
-- what the runner's stop or the next placement is for.
ALTER TABLE sandboxes ADD COLUMN desired_reason TEXT;
-- And that event's message (which command woke it).
ALTER TABLE sandboxes ADD COLUMN desired_message TEXT;
-- When a scheduled save last found the home exactly as the last completed
-- save left it (nothing uploaded, nothing committed).
ALTER TABLE sandboxes ADD COLUMN home_unchanged_at_ms BIGINT;
-- 1: the command was created while its sandbox was not running and waited
-- for it to wake.
ALTER TABLE commands ADD COLUMN waited_for_wake BIGINT NOT NULL DEFAULT 0;
