-- A revoked token keeps its row (the hash and when it was revoked): a
-- retried revoke answers the same, and the record says what was revoked.
ALTER TABLE tokens ADD COLUMN revoked_at_ms BIGINT;
