-- Images imported into an org's content store. The store's home pointer
-- `image-{hash of name}` keeps the tree alive for gc, and this row names it.
CREATE TABLE images (
    org_id TEXT NOT NULL,
    name TEXT NOT NULL,
    root TEXT NOT NULL,
    files BIGINT NOT NULL,
    logical_bytes BIGINT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (org_id, name)
);

-- The image tree a sandbox was admitted with: pinned at create, so a
-- re-import never changes what an existing sandbox runs.
ALTER TABLE sandboxes ADD COLUMN image_root TEXT;
