-- Per-key limits, enforced beside the tenant's quota (a key never gets more than its tenant).
-- JSON object with any of rpm, tpm, daily_tokens, monthly_tokens, concurrency; {} = none.
-- Keep in step with ../postgres/0002_key_limits.sql.
ALTER TABLE api_keys ADD COLUMN limits TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(limits));
