-- Keys every server of a deployment shares, made once by the first to
-- start (`auth::envd_key`): `envd` signs the access tokens of E2B's envd,
-- each good for one sandbox.
CREATE TABLE deployment_keys (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
