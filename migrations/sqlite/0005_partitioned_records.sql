-- The Postgres flavour partitions request_records by month (../postgres/0005); the embedded
-- SQLite ledger keeps one table with the same columns and takes the same query indexes.
DROP INDEX request_records_tenant_arrival;
CREATE INDEX request_records_tenant_arrival ON request_records (tenant_id, arrival_at, request_id);
CREATE INDEX request_records_key_arrival ON request_records (key_id, arrival_at);
CREATE INDEX usage_rollups_tenant ON usage_rollups (tenant_id, period, bucket_start);
