-- Each runner's own credential (issue 14, point 3): the BLAKE3 hash of the
-- secret the server hands a runner when it first registers. Runner tokens
-- (the `tokens` rows of kind `runner`) only enrol runners; every other
-- call of the runner protocol, and the block service, takes a runner's
-- credential and acts for that runner alone. Rows registered before this
-- migration have none, so no one can speak for them.
ALTER TABLE runners ADD COLUMN credential_hash TEXT;
CREATE UNIQUE INDEX runners_by_credential ON runners (credential_hash);
