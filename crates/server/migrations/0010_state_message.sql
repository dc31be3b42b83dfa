-- One line for a person about a sandbox's state and reason: what the report
-- or verdict that set them said (a failure's cause and what can be done, what
-- a `starting` sandbox waits for and when its runner tries again). Written
-- with every state change, and by a runner's "still starting, waiting for the
-- store" report, which changes the reason and this line only.
ALTER TABLE sandboxes ADD COLUMN state_message TEXT;
