-- An org's bound on the bytes its objects take in the content store
-- (`max_store_mib` at create); NULL: unbounded.
ALTER TABLE orgs ADD COLUMN max_store_mib BIGINT;
