-- Refused requests (an error status the client got: a gateway refusal, an engine's validation
-- error, an unreachable engine) cost nothing and are counted apart from billed usage: from
-- this migration on, `requests` and the token and cost sums of a rollup count billed requests
-- only, and `refused_requests` the refused ones. Rows written before it are left as they were.
-- Keep in step with ../sqlite/0003_refused_usage.sql.
ALTER TABLE usage_rollups ADD COLUMN refused_requests BIGINT NOT NULL DEFAULT 0;
