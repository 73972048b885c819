-- Sluice billing ledger, SQLite flavour (embedded default for `sluice up`). Keep in step with
-- ../postgres/0001_ledger.sql: same tables, same column names, same constraints.
-- Timestamps are RFC 3339 UTC text (what sqlx writes for chrono::DateTime<Utc>), JSON is text,
-- booleans are 0/1. Money is integer micro-units, never floating point.

CREATE TABLE tenants (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    status      TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'suspended')),
    tier        TEXT NOT NULL,
    overrides   TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(overrides)),
    created_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now'))
);

-- Only a hash of the secret is stored; `prefix` is the short public part shown in listings.
CREATE TABLE api_keys (
    id           TEXT PRIMARY KEY,
    tenant_id    TEXT NOT NULL REFERENCES tenants (id),
    prefix       TEXT NOT NULL UNIQUE,
    secret_hash  TEXT NOT NULL,
    scopes       TEXT NOT NULL DEFAULT '[]' CHECK (json_valid(scopes)),
    created_at   TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now')),
    expires_at   TEXT,
    revoked_at   TEXT
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id);

-- NULL limit = no per-tenant override (the tier default applies).
CREATE TABLE quotas (
    tenant_id          TEXT PRIMARY KEY REFERENCES tenants (id),
    rpm                INTEGER CHECK (rpm >= 0),
    tpm                INTEGER CHECK (tpm >= 0),
    daily_tokens       INTEGER CHECK (daily_tokens >= 0),
    monthly_tokens     INTEGER CHECK (monthly_tokens >= 0),
    concurrency        INTEGER CHECK (concurrency >= 0),
    max_prompt_tokens  INTEGER CHECK (max_prompt_tokens >= 0),
    max_output_tokens  INTEGER CHECK (max_output_tokens >= 0),
    max_n              INTEGER CHECK (max_n >= 0),
    allowed_models     TEXT NOT NULL DEFAULT '[]' CHECK (json_valid(allowed_models)),
    priority           INTEGER NOT NULL DEFAULT 0,
    updated_at         TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now'))
);

-- One row per request that reached admission. No foreign keys on purpose: a billed fact must
-- never be refused because of the state of the control-plane tables.
CREATE TABLE request_records (
    request_id             TEXT PRIMARY KEY NOT NULL,
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
    prompt_tokens          INTEGER NOT NULL CHECK (prompt_tokens >= 0),
    cached_prompt_tokens   INTEGER NOT NULL CHECK (cached_prompt_tokens >= 0),
    completion_tokens      INTEGER NOT NULL CHECK (completion_tokens >= 0),
    finish_reason          TEXT NOT NULL,
    http_status            INTEGER NOT NULL,
    error_type             TEXT,
    client_disconnected    INTEGER NOT NULL CHECK (client_disconnected IN (0, 1)),
    arrival_at             TEXT NOT NULL,
    first_token_at         TEXT,
    last_token_at          TEXT,
    ttft_ms                REAL,
    tpot_ms                REAL,
    itl_max_ms             REAL,
    itl_p99_ms             REAL,
    e2e_ms                 REAL,
    engine_queue_ms        REAL,
    engine_prefill_ms      REAL,
    engine_decode_ms       REAL,
    trace_id               TEXT,
    prompt_sha256          TEXT NOT NULL,
    prompt_chars           INTEGER NOT NULL CHECK (prompt_chars >= 0),
    cost_micros            INTEGER NOT NULL CHECK (cost_micros >= 0),
    ingested_at            TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now'))
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
    bucket_start          TEXT NOT NULL,
    tenant_id             TEXT NOT NULL,
    model_id              TEXT NOT NULL,
    requests              INTEGER NOT NULL,
    prompt_tokens         INTEGER NOT NULL,
    cached_prompt_tokens  INTEGER NOT NULL,
    completion_tokens     INTEGER NOT NULL,
    cost_micros           INTEGER NOT NULL,
    PRIMARY KEY (period, bucket_start, tenant_id, model_id)
);

CREATE TABLE admin_audit_log (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at      TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now')),
    actor   TEXT NOT NULL,
    role    TEXT NOT NULL,
    action  TEXT NOT NULL,
    target  TEXT NOT NULL,
    before  TEXT CHECK (before IS NULL OR json_valid(before)),
    after   TEXT CHECK (after IS NULL OR json_valid(after))
);
CREATE INDEX admin_audit_log_at ON admin_audit_log (at);
CREATE INDEX admin_audit_log_target ON admin_audit_log (target, at);
