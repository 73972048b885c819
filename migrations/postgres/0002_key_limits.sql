-- Per-key limits, enforced beside the tenant's quota (a key never gets more than its tenant).
-- JSON object with any of rpm, tpm, daily_tokens, monthly_tokens, concurrency; {} = none.
ALTER TABLE api_keys ADD COLUMN limits JSONB NOT NULL DEFAULT '{}'::jsonb;
