-- E2B addresses a process by its pid: found by an indexed read of the
-- sandbox's commands with that pid, not a scan of all of them.
CREATE INDEX commands_by_pid ON commands (sandbox_id, pid);
