-- Each row carries the price list it was priced by: its version and the three rates used
-- (micro-units per million tokens), so an auditor recomputes its cost from the row alone.
-- Rows written before this migration were all priced by the one table compiled into the
-- gateway until then: $0.10 in, $0.05 cached in, $0.20 out per million, named 'builtin-1'.
-- Keep in step with ../postgres/0004_price_list.sql.
ALTER TABLE request_records ADD COLUMN price_list_version TEXT NOT NULL DEFAULT 'builtin-1';
ALTER TABLE request_records ADD COLUMN price_input_micros INTEGER NOT NULL DEFAULT 100000
    CHECK (price_input_micros >= 0);
ALTER TABLE request_records ADD COLUMN price_cached_input_micros INTEGER NOT NULL DEFAULT 50000
    CHECK (price_cached_input_micros >= 0);
ALTER TABLE request_records ADD COLUMN price_output_micros INTEGER NOT NULL DEFAULT 200000
    CHECK (price_output_micros >= 0);
