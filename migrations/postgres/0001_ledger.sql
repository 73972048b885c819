-- Sluice billing ledger, Postgres flavour. Keep in step with ../sqlite/0001_ledger.sql:
-- same tables, same column names, same constraints; only the types differ.
-- Money is integer micro-units (BIGINT), never floating point.

CREATE TABLE tenants (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    status      TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'suspended')),
    tier        TEXT NOT NULL,
    overrides   JSONB NOT NULL DEFAULT '{}'::jsonb,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Only a hash of the secret is stored; `prefix` is the short public part shown in listings.
CREATE TABLE api_keys (
    id           TEXT PRIMARY KEY,
    tenant_id    TEXT NOT NULL REFERENCES tenants (id),
    prefix       TEXT NOT NULL UNIQUE,
    secret_hash  TEXT NOT NULL,
    scopes       JSONB NOT NULL DEFAULT '[]'::jsonb,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at   TIMESTAMPTZ,
    revoked_at   TIMESTAMPTZ
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id);

-- NULL limit = no per-tenant override (the tier default applies).
CREATE TABLE quotas (
    tenant_id          TEXT PRIMARY KEY REFERENCES tenants (id),
    rpm                BIGINT CHECK (rpm >= 0),
    tpm                BIGINT CHECK (tpm >= 0),
    daily_tokens       BIGINT CHECK (daily_tokens >= 0),
    monthly_tokens     BIGINT CHECK (monthly_tokens >= 0),
    concurrency        BIGINT CHECK (concurrency >= 0),
    max_prompt_tokens  BIGINT CHECK (max_prompt_tokens >= 0),
    max_output_tokens  BIGINT CHECK (max_output_tokens >= 0),
    max_n              BIGINT CHECK (max_n >= 0),
    allowed_models     JSONB NOT NULL DEFAULT '[]'::jsonb,
    priority           BIGINT NOT NULL DEFAULT 0,
    updated_at         TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- One row per request that reached admission. No foreign keys on purpose: a billed fact must
-- never be refused because of the state of the control-plane tables.
CREATE TABLE request_records (
    request_id             TEXT PRIMARY KEY,
    idempotency_key        TEXT,
    tenant_id              TEXT NOT NULL,
    key_id                 TEXT NOT NULL,
    model_id               TEXT NOT NULL,
    model_revision         TEXT NOT NULL,
    tokenizer_revision     TEXT NOT NULL,
    chat_template_version  TEXT NOT NULL,
    adapter                TEXT,
    engine_version         TEXT,
    engine_worker          TEXT,
    prompt_tokens          BIGINT NOT NULL CHECK (prompt_tokens >= 0),
    cached_prompt_tokens   BIGINT NOT NULL CHECK (cached_prompt_tokens >= 0),
    completion_tokens      BIGINT NOT NULL CHECK (completion_tokens >= 0),
    finish_reason          TEXT NOT NULL,
    http_status            INTEGER NOT NULL,
    error_type             TEXT,
    client_disconnected    BOOLEAN NOT NULL,
    arrival_at             TIMESTAMPTZ NOT NULL,
    first_token_at         TIMESTAMPTZ,
    last_token_at          TIMESTAMPTZ,
    ttft_ms                DOUBLE PRECISION,
    tpot_ms                DOUBLE PRECISION,
    itl_max_ms             DOUBLE PRECISION,
    itl_p99_ms             DOUBLE PRECISION,
    e2e_ms                 DOUBLE PRECISION,
    engine_queue_ms        DOUBLE PRECISION,
    engine_prefill_ms      DOUBLE PRECISION,
    engine_decode_ms       DOUBLE PRECISION,
    trace_id               TEXT,
    prompt_sha256          TEXT NOT NULL,
    prompt_chars           BIGINT NOT NULL CHECK (prompt_chars >= 0),
    cost_micros            BIGINT NOT NULL CHECK (cost_micros >= 0),
    ingested_at            TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- A retried request carrying the same Idempotency-Key is billed once per tenant.
CREATE UNIQUE INDEX request_records_idempotency
    ON request_records (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX request_records_tenant_arrival ON request_records (tenant_id, arrival_at);
CREATE INDEX request_records_model_revision ON request_records (model_revision);
CREATE INDEX request_records_finish_reason ON request_records (finish_reason);

-- Written only in the transaction that inserts the request_records rows they count.
CREATE TABLE usage_rollups (
    period                TEXT NOT NULL CHECK (period IN ('hour', 'day')),
    bucket_start          TIMESTAMPTZ NOT NULL,
    tenant_id             TEXT NOT NULL,
    model_id              TEXT NOT NULL,
    requests              BIGINT NOT NULL,
    prompt_tokens         BIGINT NOT NULL,
    cached_prompt_tokens  BIGINT NOT NULL,
    completion_tokens     BIGINT NOT NULL,
    cost_micros           BIGINT NOT NULL,
    PRIMARY KEY (period, bucket_start, tenant_id, model_id)
);

CREATE TABLE admin_audit_log (
    id      BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    actor   TEXT NOT NULL,
    role    TEXT NOT NULL,
    action  TEXT NOT NULL,
    target  TEXT NOT NULL,
    before  JSONB,
    after   JSONB
);
CREATE INDEX admin_audit_log_at ON admin_audit_log (at);
CREATE INDEX admin_audit_log_target ON admin_audit_log (target, at);
