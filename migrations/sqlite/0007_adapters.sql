-- Tenants' LoRA adapters (issue 50); see ../postgres/0007_adapters.sql.
CREATE TABLE adapters (
    tenant_id      TEXT NOT NULL REFERENCES tenants (id),
    name           TEXT NOT NULL,
    revision       TEXT NOT NULL,
    base_model     TEXT NOT NULL,
    base_revision  TEXT NOT NULL,
    rank           INTEGER NOT NULL CHECK (rank > 0),
    targets        TEXT NOT NULL DEFAULT '[]' CHECK (json_valid(targets)),
    bytes          INTEGER NOT NULL CHECK (bytes >= 0),
    shared_with    TEXT NOT NULL DEFAULT '[]' CHECK (json_valid(shared_with)),
    status         TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'retired')),
    created_at     TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now')),
    retired_at     TEXT,
    PRIMARY KEY (tenant_id, name, revision)
);
CREATE INDEX adapters_newest ON adapters (tenant_id, name, created_at);
CREATE INDEX request_records_tenant_adapter ON request_records (tenant_id, adapter, arrival_at);
