-- What the deployment observed of itself (`GET /v1/deployment`): every
-- completed save of a durable home, kept for the observation window,
-- with its capture and commit times and the previous save's capture (the
-- work at risk just before it committed); and events by time, for the
-- recoveries and wakes they record.
CREATE TABLE saves (
    sandbox_id TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    captured_at_ms BIGINT NOT NULL,
    completed_at_ms BIGINT NOT NULL,
    previous_captured_at_ms BIGINT
);
CREATE INDEX saves_by_time ON saves (completed_at_ms);
CREATE INDEX events_by_time ON events (at_ms);
