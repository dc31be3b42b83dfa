-- Org secrets: only ciphertext and nonce (XChaCha20-Poly1305 under the
-- server's secret key, kept outside the database; the associated data
-- binds each ciphertext to its org, name and version), hex-encoded.
-- `sandbox_secrets`: what a sandbox asked for at create (names and where
-- each goes: an env variable or a file under /run/secrets), never values.
CREATE TABLE secrets (
    org_id TEXT NOT NULL REFERENCES orgs (id),
    name TEXT NOT NULL,
    version BIGINT NOT NULL,
    nonce TEXT NOT NULL,
    ciphertext TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (org_id, name)
);
CREATE TABLE sandbox_secrets (
    sandbox_id TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    position BIGINT NOT NULL,
    name TEXT NOT NULL,
    env TEXT,
    file TEXT,
    PRIMARY KEY (sandbox_id, position)
);
