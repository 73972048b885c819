-- request_records partitioned by month of arrival (UTC), so a year of records stays fast to
-- query and old months leave the database whole (`sluice billing retention`). SQLite (the
-- embedded `sluice up` ledger) keeps one table: same columns, see ../sqlite/0005.
--
-- A partitioned table's unique indexes must hold its partition key, so the request id is
-- unique together with its arrival time. That is the same rule: a request's usage event has
-- one arrival time, fixed by the gateway at admission and carried by every delivery of the
-- event (the stream, the direct fallback, a replay), so a re-delivered event still clashes and
-- is skipped. `sluice audit reconcile` checks that no request id has two rows.

-- The old table's constraint and index names are taken by the new table's.
ALTER TABLE request_records RENAME TO request_records_unpartitioned;
ALTER TABLE request_records_unpartitioned DROP CONSTRAINT request_records_pkey;
DROP INDEX request_records_idempotency;
DROP INDEX request_records_tenant_arrival;
DROP INDEX request_records_model_revision;
DROP INDEX request_records_finish_reason;

-- Same columns in the same order, defaults and checks included.
CREATE TABLE request_records
    (LIKE request_records_unpartitioned INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (arrival_at);
ALTER TABLE request_records ADD PRIMARY KEY (request_id, arrival_at);
CREATE UNIQUE INDEX request_records_idempotency
    ON request_records (tenant_id, idempotency_key, arrival_at)
    WHERE idempotency_key IS NOT NULL;
-- The records API's order (arrival, request id) within a tenant: a tenant-day page is one
-- index range read in order, stopping at the page's end.
CREATE INDEX request_records_tenant_arrival ON request_records (tenant_id, arrival_at, request_id);
CREATE INDEX request_records_key_arrival ON request_records (key_id, arrival_at);
CREATE INDEX request_records_request_id ON request_records (request_id);
CREATE INDEX request_records_model_revision ON request_records (model_revision);
CREATE INDEX request_records_finish_reason ON request_records (finish_reason);
-- Rows whose month has no partition (one not created ahead, or long past): never refused.
CREATE TABLE request_records_default PARTITION OF request_records DEFAULT;

-- A tenant's usage over a month reads its own day rollups, not every tenant's.
CREATE INDEX usage_rollups_tenant ON usage_rollups (tenant_id, period, bucket_start);

-- Creates the monthly partitions covering [first, last] (each month's start, UTC), those that
-- do not exist yet, moving any rows the default partition holds for a new month into it.
-- Billing calls it at start and every hour for the current month and the next three;
-- concurrent callers take turns on an advisory lock. Returns the partitions created.
CREATE FUNCTION sluice_create_record_partitions(first TIMESTAMPTZ, last TIMESTAMPTZ)
RETURNS INTEGER LANGUAGE plpgsql AS $$
DECLARE
    month_start TIMESTAMPTZ := date_trunc('month', first, 'UTC');
    month_end   TIMESTAMPTZ;
    name        TEXT;
    created     INTEGER := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('sluice_create_record_partitions'));
    WHILE month_start <= last LOOP
        month_end := (month_start AT TIME ZONE 'UTC' + INTERVAL '1 month') AT TIME ZONE 'UTC';
        name := 'request_records_' || to_char(month_start AT TIME ZONE 'UTC', 'YYYY_MM');
        IF to_regclass(name) IS NULL THEN
            EXECUTE format('CREATE TABLE %I (LIKE request_records INCLUDING DEFAULTS '
                           'INCLUDING CONSTRAINTS)', name);
            EXECUTE format('WITH moved AS (DELETE FROM request_records_default '
                           'WHERE arrival_at >= $1 AND arrival_at < $2 RETURNING *) '
                           'INSERT INTO %I SELECT * FROM moved', name)
                USING month_start, month_end;
            EXECUTE format('ALTER TABLE request_records ATTACH PARTITION %I '
                           'FOR VALUES FROM (%L) TO (%L)', name, month_start, month_end);
            created := created + 1;
        END IF;
        month_start := month_end;
    END LOOP;
    RETURN created;
END $$;

-- Partitions for every month the old rows cover and the months ahead, then the rows.
SELECT sluice_create_record_partitions(
    LEAST(COALESCE((SELECT MIN(arrival_at) FROM request_records_unpartitioned), now()), now()),
    now() + INTERVAL '3 months');
INSERT INTO request_records SELECT * FROM request_records_unpartitioned;
DROP TABLE request_records_unpartitioned;
