-- A running command's pid inside its sandbox, as its runner reported it
-- (the sandbox's agent runs commands; NULL for commands run by the
-- runtime's exec, or not started).
ALTER TABLE commands ADD COLUMN pid BIGINT;
-- Whether the command reads a stdin its client writes (the data path).
ALTER TABLE commands ADD COLUMN stdin BIGINT NOT NULL DEFAULT 0;
-- Its terminal's size as asked at creation (JSON {rows, cols}), if any.
ALTER TABLE commands ADD COLUMN tty TEXT;

-- Each runner's data path: the URL of its data listener and the key it
-- checks the servers' per-request tokens with (api::data_path), as given
-- at its last registration. NULL: a runner without one.
ALTER TABLE runners ADD COLUMN data_url TEXT;
ALTER TABLE runners ADD COLUMN data_key TEXT;
