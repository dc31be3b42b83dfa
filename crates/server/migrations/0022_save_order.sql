-- The placement (epoch) whose save the record's home_root is. Within one
-- placement a save only ever replaces an older capture: a save whose
-- commit waited (on gc, on a slow store) behind a later one of the same
-- placement must not move the home back (`records::sandboxes::record_save`).
-- NULL: recorded before this column, or the root a snapshot gave at create.
ALTER TABLE sandboxes ADD COLUMN home_saved_epoch BIGINT;
