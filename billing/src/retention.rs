//! Retention of request records: `sluice billing retention --keep 13mo --archive-dir DIR`.
//!
//! In Postgres `request_records` is partitioned by UTC month (`migrations/postgres/0005`).
//! Retention keeps the current month and the `keep - 1` months before it. Each older month's
//! partition is detached (a late row for that month lands in the default partition from then
//! on, and the next run archives it), copied into an archive file, verified, and only then
//! dropped. The archive, `DIR/request_records_YYYY_MM.sqlite`, is a SQLite ledger with the
//! embedded ledger's schema: an auditor reads it with `sqlite3`, or serves it with `sluice
//! billing --database-url sqlite://FILE` and uses the records API as on the live ledger. An
//! archive is never overwritten: a second one for the same month (late rows) gets `-2`, `-3`.
//!
//! Crash safety: a partition is dropped only after its archive file is complete (the copy's
//! row count and token and cost sums equal the partition's) and renamed from `.partial` to
//! its final name. A run cut off before that leaves a detached table, which the next run finds
//! by its name and finishes, and perhaps a `.partial` file, which it writes again.
//!
//! Usage rollups stay in Postgres: they are small, and the invoice, quota and dashboard
//! figures read them.

use std::path::{Path, PathBuf};

use chrono::{DateTime, Datelike, Months, NaiveDate, TimeZone, Utc};
use futures_util::TryStreamExt;
use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::{PgPool, QueryBuilder, Row, Sqlite, SqlitePool};

use crate::query::{Col, RECORD_COLUMNS};
use crate::store::Pool;
use crate::{BillingError, Ledger};

/// Rows per statement written to the archive (38 columns each: well under SQLite's limit on
/// bound parameters).
const ARCHIVE_ROWS_PER_STATEMENT: usize = 400;

/// What went wrong in a retention run.
#[derive(Debug, thiserror::Error)]
pub enum RetentionError {
    /// The ledger is the embedded SQLite one, which is one table with no months to detach.
    #[error("retention applies to a Postgres ledger; the SQLite ledger is not partitioned")]
    NotPartitioned,
    /// `--keep` is out of range.
    #[error("--keep must keep at least the current month (1mo or more)")]
    KeepTooShort,
    /// The database failed.
    #[error(transparent)]
    Billing(#[from] BillingError),
    /// The archive directory or file could not be written.
    #[error("archive {path}: {source}")]
    Archive {
        /// The file or directory.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
    /// The copy did not add up; the partition is kept (detached) and the file left `.partial`.
    #[error(
        "archive of {partition} does not match it (rows, prompt, completion, cost: \
         database {database:?}, archive {archive:?}); the partition is kept"
    )]
    Mismatch {
        /// The partition.
        partition: String,
        /// Its sums.
        database: Sums,
        /// The archive's sums.
        archive: Sums,
    },
}

/// What a run keeps, and where.
#[derive(Clone, Debug)]
pub struct RetentionOptions {
    /// Months kept, the current one included.
    pub keep_months: u32,
    /// Where archives are written.
    pub archive_dir: PathBuf,
    /// Report what would be done, change nothing.
    pub dry_run: bool,
    /// The current time (the current month is never archived).
    pub now: DateTime<Utc>,
}

/// Row count and billed sums of a set of records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Sums {
    /// Rows.
    pub rows: i64,
    /// Prompt tokens.
    pub prompt_tokens: i64,
    /// Completion tokens.
    pub completion_tokens: i64,
    /// Cost in micros.
    pub cost_micros: i64,
}

/// One month past the kept window.
#[derive(Clone, Debug, Serialize)]
pub struct ArchivedMonth {
    /// The partition's table name.
    pub partition: String,
    /// `YYYY-MM`.
    pub month: String,
    /// Its rows and sums, equal in the archive.
    pub sums: Sums,
    /// The archive file written (none for an empty partition or a dry run).
    pub archive: Option<String>,
    /// `archived`, `dropped empty`, `would archive` or `would drop empty`.
    pub action: &'static str,
}

/// What a run did.
#[derive(Clone, Debug, Serialize)]
pub struct RetentionReport {
    /// Months kept, the current one included.
    pub keep_months: u32,
    /// Records arriving before this are archived.
    pub cutoff: DateTime<Utc>,
    /// Rows of past months moved out of the default partition into their month's first.
    pub moved_from_default: i64,
    /// The months archived (or that would be), oldest first.
    pub months: Vec<ArchivedMonth>,
    /// The partitions kept, oldest first.
    pub kept: Vec<String>,
}

/// Parses `--keep`: `13mo` (months), `2y` (years) or a bare number of months.
pub fn parse_keep(text: &str) -> Result<u32, String> {
    let t = text.trim();
    let (digits, per) = if let Some(n) = t.strip_suffix("mo") {
        (n, 1)
    } else if let Some(n) = t.strip_suffix('y') {
        (n, 12)
    } else {
        (t, 1)
    };
    let n: u32 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a duration in months (13mo) or years (2y)"))?;
    match n.checked_mul(per) {
        Some(months) if (1..=1200).contains(&months) => Ok(months),
        _ => Err(format!("{text:?}: keep between 1mo and 100y")),
    }
}

/// The first instant of the oldest kept month.
pub fn cutoff(now: DateTime<Utc>, keep_months: u32) -> Result<DateTime<Utc>, RetentionError> {
    let first = NaiveDate::from_ymd_opt(now.year(), now.month(), 1)
        .and_then(|d| d.checked_sub_months(Months::new(keep_months.checked_sub(1)?)))
        .ok_or(RetentionError::KeepTooShort)?;
    Ok(Utc.from_utc_datetime(&first.and_time(chrono::NaiveTime::MIN)))
}

/// `request_records_YYYY_MM` -> the month's first day, for the names partitions are given.
fn partition_month(name: &str) -> Option<NaiveDate> {
    let rest = name.strip_prefix("request_records_")?;
    let (y, m) = rest.split_once('_')?;
    if y.len() != 4 || m.len() != 2 {
        return None;
    }
    NaiveDate::from_ymd_opt(y.parse().ok()?, m.parse().ok()?, 1)
}

/// A month partition, attached or left detached by a run that was cut off.
struct Partition {
    name: String,
    month: NaiveDate,
    attached: bool,
}

async fn partitions(pool: &PgPool) -> Result<Vec<Partition>, BillingError> {
    let rows = sqlx::query(
        "SELECT c.relname::TEXT AS name, EXISTS (SELECT 1 FROM pg_inherits i \
         WHERE i.inhrelid = c.oid AND i.inhparent = 'request_records'::regclass) AS attached \
         FROM pg_class c WHERE c.relkind = 'r' AND c.relnamespace = current_schema()::regnamespace \
         AND c.relname ~ '^request_records_[0-9]{4}_[0-9]{2}$' ORDER BY c.relname",
    )
    .fetch_all(pool)
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let name: String = row.try_get("name")?;
        if let Some(month) = partition_month(&name) {
            out.push(Partition { name, month, attached: row.try_get("attached")? });
        }
    }
    Ok(out)
}

/// The table's rows and sums. `table` is a partition name matched by [`partition_month`] or
/// `request_records_default`: never user input.
async fn pg_sums(
    pool: &PgPool,
    table: &str,
    before: Option<DateTime<Utc>>,
) -> Result<Sums, BillingError> {
    let mut q = QueryBuilder::new(format!(
        "SELECT CAST(COUNT(*) AS BIGINT), CAST(COALESCE(SUM(prompt_tokens), 0) AS BIGINT), \
         CAST(COALESCE(SUM(completion_tokens), 0) AS BIGINT), \
         CAST(COALESCE(SUM(cost_micros), 0) AS BIGINT) FROM \"{table}\""
    ));
    if let Some(at) = before {
        q.push(" WHERE arrival_at < ").push_bind(at);
    }
    let row = q.build().fetch_one(pool).await?;
    Ok(Sums {
        rows: row.try_get(0)?,
        prompt_tokens: row.try_get(1)?,
        completion_tokens: row.try_get(2)?,
        cost_micros: row.try_get(3)?,
    })
}

async fn sqlite_sums(pool: &SqlitePool) -> Result<Sums, BillingError> {
    let row = sqlx::query(
        "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0), \
         COALESCE(SUM(cost_micros), 0) FROM request_records",
    )
    .fetch_one(pool)
    .await?;
    Ok(Sums {
        rows: row.try_get(0)?,
        prompt_tokens: row.try_get(1)?,
        completion_tokens: row.try_get(2)?,
        cost_micros: row.try_get(3)?,
    })
}

/// One value of a record, read from Postgres as its column's type.
enum Cell {
    Text(String),
    OptText(Option<String>),
    Int(i64),
    Int32(i32),
    Bool(bool),
    Time(DateTime<Utc>),
    OptTime(Option<DateTime<Utc>>),
    OptFloat(Option<f64>),
}

fn read_cells(row: &PgRow) -> Result<Vec<Cell>, sqlx::Error> {
    let mut cells = Vec::with_capacity(RECORD_COLUMNS.len());
    for (i, (_, col)) in RECORD_COLUMNS.iter().enumerate() {
        cells.push(match col {
            Col::Text => Cell::Text(row.try_get(i)?),
            Col::OptText => Cell::OptText(row.try_get(i)?),
            Col::Int => Cell::Int(row.try_get(i)?),
            Col::Int32 => Cell::Int32(row.try_get(i)?),
            Col::Bool => Cell::Bool(row.try_get(i)?),
            Col::Time => Cell::Time(row.try_get(i)?),
            Col::OptTime => Cell::OptTime(row.try_get(i)?),
            Col::OptFloat => Cell::OptFloat(row.try_get(i)?),
        });
    }
    Ok(cells)
}

async fn write_rows(
    archive: &mut sqlx::SqliteConnection,
    rows: Vec<Vec<Cell>>,
) -> Result<(), BillingError> {
    if rows.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = RECORD_COLUMNS.iter().map(|(n, _)| *n).collect();
    let mut q: QueryBuilder<Sqlite> =
        QueryBuilder::new(format!("INSERT INTO request_records ({}) ", names.join(", ")));
    q.push_values(rows, |mut b, cells| {
        for cell in cells {
            match cell {
                Cell::Text(v) => b.push_bind(v),
                Cell::OptText(v) => b.push_bind(v),
                Cell::Int(v) => b.push_bind(v),
                Cell::Int32(v) => b.push_bind(v),
                Cell::Bool(v) => b.push_bind(v),
                Cell::Time(v) => b.push_bind(v),
                Cell::OptTime(v) => b.push_bind(v),
                Cell::OptFloat(v) => b.push_bind(v),
            };
        }
    });
    q.build().execute(&mut *archive).await?;
    Ok(())
}

fn archive_err(path: &Path) -> impl FnOnce(std::io::Error) -> RetentionError + '_ {
    move |source| RetentionError::Archive { path: path.display().to_string(), source }
}

/// The first `DIR/NAME.sqlite`, `DIR/NAME-2.sqlite`, ... that does not exist.
fn archive_path(dir: &Path, name: &str) -> PathBuf {
    let mut n = 1u32;
    loop {
        let file = if n == 1 { format!("{name}.sqlite") } else { format!("{name}-{n}.sqlite") };
        let path = dir.join(file);
        if !path.exists() {
            return path;
        }
        n += 1;
    }
}

fn remove_if_present(path: &Path) -> Result<(), RetentionError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(archive_err(path)(e)),
        _ => Ok(()),
    }
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// Copies a detached partition into a new archive file and verifies it; returns the file.
async fn archive_partition(
    pool: &PgPool,
    name: &str,
    dir: &Path,
    expected: Sums,
) -> Result<PathBuf, RetentionError> {
    let path = archive_path(dir, name);
    let partial = with_suffix(&path, ".partial");
    for p in [partial.clone(), with_suffix(&partial, "-journal")] {
        remove_if_present(&p)?;
    }
    let archive = Ledger::open_archive(&partial).await?;
    let Pool::Sqlite(sqlite) = archive.pool() else {
        return Err(BillingError::UnsupportedUrl.into());
    };
    let names: Vec<&str> = RECORD_COLUMNS.iter().map(|(n, _)| *n).collect();
    // Nobody writes a detached partition: one pass over it, streamed, in its key's order.
    let select =
        format!("SELECT {} FROM \"{name}\" ORDER BY request_id, arrival_at", names.join(", "));
    let mut stream = sqlx::query(&select).fetch(pool);
    let mut page = Vec::with_capacity(ARCHIVE_ROWS_PER_STATEMENT);
    let mut tx_rows = 0usize;
    // Large transactions: the file is only renamed into place once complete anyway.
    let mut tx = sqlite.begin().await.map_err(BillingError::from)?;
    while let Some(row) = stream.try_next().await.map_err(BillingError::from)? {
        page.push(read_cells(&row).map_err(BillingError::from)?);
        if page.len() == ARCHIVE_ROWS_PER_STATEMENT {
            write_rows(&mut tx, std::mem::take(&mut page)).await?;
            tx_rows += ARCHIVE_ROWS_PER_STATEMENT;
            if tx_rows >= 100_000 {
                tx.commit().await.map_err(BillingError::from)?;
                tx = sqlite.begin().await.map_err(BillingError::from)?;
                tx_rows = 0;
            }
        }
    }
    drop(stream);
    write_rows(&mut tx, page).await?;
    tx.commit().await.map_err(BillingError::from)?;
    archive.close().await;
    // What is verified is the file as it will be read: opened afresh.
    let reopened = Ledger::open_archive(&partial).await?;
    let got = match reopened.pool() {
        Pool::Sqlite(p) => sqlite_sums(p).await,
        Pool::Postgres(_) => Err(BillingError::UnsupportedUrl),
    };
    reopened.close().await;
    let got = got?;
    if got != expected {
        return Err(RetentionError::Mismatch {
            partition: name.to_owned(),
            database: expected,
            archive: got,
        });
    }
    std::fs::rename(&partial, &path).map_err(archive_err(&path))?;
    if let Ok(d) = std::fs::File::open(dir) {
        // The rename reaches the disk before the partition is dropped.
        let _ = d.sync_all();
    }
    Ok(path)
}

impl Ledger {
    /// Archives and drops the months before the kept window; see the module docs.
    pub async fn apply_retention(
        &self,
        options: &RetentionOptions,
    ) -> Result<RetentionReport, RetentionError> {
        let Pool::Postgres(pool) = self.pool() else {
            return Err(RetentionError::NotPartitioned);
        };
        if options.keep_months == 0 {
            return Err(RetentionError::KeepTooShort);
        }
        let cutoff = cutoff(options.now, options.keep_months)?;
        let cutoff_month = cutoff.date_naive();
        if !options.dry_run {
            std::fs::create_dir_all(&options.archive_dir)
                .map_err(archive_err(&options.archive_dir))?;
        }
        let mut months = Vec::new();
        // Leftovers of a run cut off after detaching first: their names are taken.
        for p in partitions(pool).await?.into_iter().filter(|p| !p.attached) {
            months.push(self.retire(pool, &p, options).await?);
        }
        // Past months' rows in the default partition go to their months' partitions.
        let old_default = pg_sums(pool, "request_records_default", Some(cutoff)).await?;
        let mut moved_from_default = 0;
        if old_default.rows > 0 && !options.dry_run {
            let starts: Vec<DateTime<Utc>> = sqlx::query_scalar(
                "SELECT DISTINCT date_trunc('month', arrival_at, 'UTC') \
                 FROM request_records_default WHERE arrival_at < $1",
            )
            .bind(cutoff)
            .fetch_all(pool)
            .await
            .map_err(BillingError::from)?;
            for start in starts {
                self.create_record_partitions(start, start).await?;
            }
            moved_from_default = old_default.rows
                - pg_sums(pool, "request_records_default", Some(cutoff)).await?.rows;
        }
        let mut kept = Vec::new();
        for p in partitions(pool).await? {
            if p.month >= cutoff_month {
                kept.push(p.name);
            } else if p.attached || options.dry_run {
                months.push(self.retire(pool, &p, options).await?);
            }
        }
        months.sort_by(|a, b| a.partition.cmp(&b.partition));
        if options.dry_run {
            moved_from_default = old_default.rows;
        }
        Ok(RetentionReport {
            keep_months: options.keep_months,
            cutoff,
            moved_from_default,
            months,
            kept,
        })
    }

    /// Detaches, archives and drops one partition (or reports what it would do).
    async fn retire(
        &self,
        pool: &PgPool,
        p: &Partition,
        options: &RetentionOptions,
    ) -> Result<ArchivedMonth, RetentionError> {
        let month = p.month.format("%Y-%m").to_string();
        if options.dry_run {
            let sums = pg_sums(pool, &p.name, None).await?;
            let action = if sums.rows == 0 { "would drop empty" } else { "would archive" };
            return Ok(ArchivedMonth {
                partition: p.name.clone(),
                month,
                sums,
                archive: None,
                action,
            });
        }
        if p.attached {
            let detach = format!("ALTER TABLE request_records DETACH PARTITION \"{}\"", p.name);
            sqlx::query(&detach).execute(pool).await.map_err(BillingError::from)?;
        }
        // Detached: no writer can reach it any more, so its sums are final.
        let sums = pg_sums(pool, &p.name, None).await?;
        let (archive, action) = if sums.rows == 0 {
            (None, "dropped empty")
        } else {
            let path = archive_partition(pool, &p.name, &options.archive_dir, sums).await?;
            (Some(path.display().to_string()), "archived")
        };
        let drop = format!("DROP TABLE \"{}\"", p.name);
        sqlx::query(&drop).execute(pool).await.map_err(BillingError::from)?;
        tracing::info!(partition = %p.name, rows = sums.rows, action, "request records retired");
        Ok(ArchivedMonth { partition: p.name.clone(), month, sums, archive, action })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_parses_months_and_years_and_refuses_the_rest() {
        assert_eq!(parse_keep("13mo"), Ok(13));
        assert_eq!(parse_keep("2y"), Ok(24));
        assert_eq!(parse_keep("6"), Ok(6));
        for bad in ["0mo", "", "13 months", "-1mo", "1.5y", "101y"] {
            assert!(parse_keep(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cutoff_keeps_the_current_month_and_the_ones_before() {
        let now = Utc.with_ymd_and_hms(2026, 12, 4, 12, 0, 0).single();
        let Some(now) = now else { return assert!(now.is_some()) };
        let at = |y, m| Utc.with_ymd_and_hms(y, m, 1, 0, 0, 0).single();
        assert_eq!(cutoff(now, 1).ok(), at(2026, 12));
        assert_eq!(cutoff(now, 13).ok(), at(2025, 12));
        assert_eq!(cutoff(now, 24).ok(), at(2025, 1));
        assert!(cutoff(now, 0).is_err());
    }

    #[test]
    fn only_month_partition_names_parse() {
        assert_eq!(partition_month("request_records_2026_02"), NaiveDate::from_ymd_opt(2026, 2, 1));
        for bad in ["request_records_default", "request_records_2026_13", "request_records_26_01"] {
            assert_eq!(partition_month(bad), None, "{bad}");
        }
    }
}
