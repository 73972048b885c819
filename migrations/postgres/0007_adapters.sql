-- Tenants' LoRA adapters (issue 50): one row per registered revision of a tenant's adapter.
-- The revision is the SHA-256 of the adapter's canonical form (the engines' store names its
-- files by it); the base model is the one it was checked against at registration. A request
-- naming `tenant/name` runs the newest active revision, `tenant/name@REV` that one; retiring
-- the newest rolls the name back to the one before. `shared_with` lists the other tenants
-- that may use the name (kept the same on every revision of it).
-- Keep in step with ../sqlite/0007_adapters.sql.
CREATE TABLE adapters (
    tenant_id      TEXT NOT NULL REFERENCES tenants (id),
    name           TEXT NOT NULL,
    revision       TEXT NOT NULL,
    base_model     TEXT NOT NULL,
    base_revision  TEXT NOT NULL,
    rank           BIGINT NOT NULL CHECK (rank > 0),
    targets        JSONB NOT NULL DEFAULT '[]'::jsonb,
    bytes          BIGINT NOT NULL CHECK (bytes >= 0),
    shared_with    JSONB NOT NULL DEFAULT '[]'::jsonb,
    status         TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'retired')),
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    retired_at     TIMESTAMPTZ,
    PRIMARY KEY (tenant_id, name, revision)
);
CREATE INDEX adapters_newest ON adapters (tenant_id, name, created_at);
CREATE INDEX request_records_tenant_adapter ON request_records (tenant_id, adapter, arrival_at);
