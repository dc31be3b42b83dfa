-- What the runners a runner token enrols may declare (JSON of an
-- `api::orgs::RunnerProfile`; NULL: anything), kept on each runner it
-- enrolled for every later registration.
ALTER TABLE tokens ADD COLUMN runner_profile TEXT;
ALTER TABLE runners ADD COLUMN profile TEXT;
