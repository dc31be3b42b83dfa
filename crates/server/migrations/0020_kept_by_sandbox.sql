-- A sandbox's kept copies by its id: every change to one rewrites the
-- sandbox's list of those still kept, and a new one is counted against
-- the bound per sandbox (`control::kept`). Only the runner's index and the
-- one unique by (runner, sandbox, name) existed, so each read the whole
-- table, discarded copies (kept as rows, so a report again is answered)
-- and all.
CREATE INDEX kept_copies_by_sandbox ON kept_copies (sandbox_id, state);
