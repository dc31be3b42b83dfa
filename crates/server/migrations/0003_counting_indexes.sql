-- Admission counts and placement sums read only these indexes (covering),
-- not the table's rows. They still grow with the sandboxes counted.
CREATE INDEX sandboxes_by_org_state ON sandboxes (org_id, state, desired);
CREATE INDEX sandboxes_by_state_desired ON sandboxes (state, desired);
CREATE INDEX sandboxes_usage_by_runner ON sandboxes (runner_id, state, memory_mib, millicpus, pids)
