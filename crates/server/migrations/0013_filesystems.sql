-- Shared filesystems an operator bound to an org: its sandboxes may mount
-- them (on runners that declare them, `filesystem:ID`). `read_only`: they
-- are mounted read-only whatever a create asks.
CREATE TABLE filesystem_bindings (
    filesystem_id TEXT NOT NULL,
    org_id TEXT NOT NULL,
    read_only BIGINT NOT NULL,
    bound_at_ms BIGINT NOT NULL,
    PRIMARY KEY (filesystem_id, org_id)
);

-- A sandbox's shared mounts (JSON, `read_only` as enforced), handed to
-- every runner it is placed on: attached again at each launch.
ALTER TABLE sandboxes ADD COLUMN mounts TEXT NOT NULL DEFAULT '[]';
