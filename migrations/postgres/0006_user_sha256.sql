-- A request's `user` (the tenant's end user) as lowercase hex SHA-256 of the tenant id, a
-- newline and the value: auditors filter by it, the value itself is never stored. NULL when
-- the request named none (and on every row written before this migration).
-- Keep in step with ../sqlite/0006_user_sha256.sql.
ALTER TABLE request_records ADD COLUMN user_sha256 TEXT;
CREATE INDEX request_records_tenant_user ON request_records (tenant_id, user_sha256, arrival_at);
