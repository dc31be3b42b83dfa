-- How many signals were asked of the command: each request adds one, so a
-- runner tells a second request for the same signal from the first (it
-- delivers each once, and never one twice, even across its restart).
ALTER TABLE commands ADD COLUMN signal_seq BIGINT NOT NULL DEFAULT 0;
