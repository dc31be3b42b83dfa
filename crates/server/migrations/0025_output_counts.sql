-- The command output each org keeps in the records (`command_output`),
-- spread over a few slots per org as the quota counts are, so appends
-- rarely wait on one row; an org's total is the sum of its slots. Bounded
-- by the server's `org_output_bytes_max`; a purged sandbox's commands give
-- theirs back.
CREATE TABLE output_counts (
    org_id TEXT NOT NULL,
    slot BIGINT NOT NULL,
    bytes BIGINT NOT NULL,
    PRIMARY KEY (org_id, slot)
);
INSERT INTO output_counts (org_id, slot, bytes)
SELECT org_id, 0, SUM(stdout_bytes + stderr_bytes) FROM commands GROUP BY org_id;
