-- The signals asked of a command, each with its number (`signal_seq` of
-- the request): a runner delivers every one it has not delivered yet, in
-- order, so several asked between two of its polls all arrive. Only the
-- latest `api::commands::SIGNALS_KEPT` of a command are kept.
CREATE TABLE command_signals (
    command_id TEXT NOT NULL REFERENCES commands (id) ON DELETE CASCADE,
    seq BIGINT NOT NULL,
    signal TEXT NOT NULL,
    PRIMARY KEY (command_id, seq)
);
