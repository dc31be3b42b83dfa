-- A sandbox's bound on its home (`resources.home_mib`), enforced by its
-- runner; NULL: unbounded.
ALTER TABLE sandboxes ADD COLUMN home_mib BIGINT;
