-- A command's record keeps at most `api::commands::OUTPUT_STREAM_BYTES_MAX`
-- of each stream; these say some was not stored.
ALTER TABLE commands ADD COLUMN stdout_truncated BIGINT NOT NULL DEFAULT 0;
ALTER TABLE commands ADD COLUMN stderr_truncated BIGINT NOT NULL DEFAULT 0;
