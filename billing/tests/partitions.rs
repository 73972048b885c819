//! A year of records in real Postgres: monthly partitions created ahead and for past rows,
//! the audit queries' plans (one partition, by index), and retention archiving old months to
//! SQLite files an auditor can query, with nothing lost or counted twice.

mod common;

use anyhow::{Context, ensure};
use chrono::{DateTime, Datelike, Months, TimeDelta, TimeZone, Utc};
use common::{Inspect, PgDatabase, event};
use sluice_billing::query::{RecordFilter, UsageFilter};
use sluice_billing::retention::{RetentionOptions, cutoff};
use sluice_billing::{Ledger, UsageEvent};

const TENANTS: usize = 10;

/// The first instant of the month `back` months before `now`'s.
fn month_start(now: DateTime<Utc>, back: u32) -> anyhow::Result<DateTime<Utc>> {
    let first = chrono::NaiveDate::from_ymd_opt(now.year(), now.month(), 1)
        .and_then(|d| d.checked_sub_months(Months::new(back)))
        .context("month out of range")?;
    Ok(Utc.from_utc_datetime(&first.and_time(chrono::NaiveTime::MIN)))
}

/// `n` events spread evenly over the 12 months up to `now`, round-robin over the tenants.
fn year_of_events(now: DateTime<Utc>, n: usize) -> anyhow::Result<Vec<UsageEvent>> {
    let start = month_start(now, 11)?;
    let span = (now - start).num_seconds();
    let n_i64 = i64::try_from(n)?;
    (0..n)
        .map(|i| {
            let at = start + TimeDelta::seconds(span * i64::try_from(i)? / n_i64);
            let mut e = event(&format!("req-{i:07}"), &format!("tenant-{}", i % TENANTS));
            let shift = at - e.arrival_at;
            e.arrival_at = at;
            e.first_token_at = e.first_token_at.map(|t| t + shift);
            e.last_token_at = e.last_token_at.map(|t| t + shift);
            e.completion_tokens = u32::try_from(i % 97)? + 1;
            Ok(e)
        })
        .collect()
}

async fn insert(ledger: &Ledger, events: &[UsageEvent]) -> anyhow::Result<()> {
    for chunk in events.chunks(2_000) {
        ensure!(ledger.insert_batch(chunk).await? == chunk.len(), "every event is new");
    }
    Ok(())
}

/// The distinct `request_records_YYYY_MM` names a plan reads.
fn partitions_in(plan: &str) -> Vec<String> {
    let mut names: Vec<String> = plan
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| {
            w.strip_prefix("request_records_")
                .is_some_and(|rest| rest.len() == 7 && rest.as_bytes()[4] == b'_')
        })
        .map(str::to_owned)
        .collect();
    names.sort();
    names.dedup();
    names
}

#[tokio::test]
async fn a_year_of_records_is_partitioned_indexed_and_archived_whole() -> anyhow::Result<()> {
    let db = PgDatabase::create().await?;
    let ledger = Ledger::connect(&db.url).await?;
    let inspect = Inspect::open(&db.url).await?;
    let now = Utc::now();
    let attached = "SELECT CAST(COUNT(*) AS BIGINT) FROM pg_inherits \
                    WHERE inhparent = 'request_records'::regclass";
    // Connect created this month's partition, the next three's and the default one.
    ensure!(inspect.scalar(attached).await? >= 5, "months ahead exist at connect");

    // A year of rows: the past months have no partition yet, so they land in the default one;
    // creating their partitions moves them.
    let events = year_of_events(now, 24_000)?;
    insert(&ledger, &events).await?;
    let in_default = "SELECT CAST(COUNT(*) AS BIGINT) FROM request_records_default";
    ensure!(inspect.scalar(in_default).await? > 0, "past rows wait in the default partition");
    let created = ledger.create_record_partitions(month_start(now, 11)?, now).await?;
    ensure!(created == 11, "the 11 past months' partitions are created ({created})");
    ensure!(inspect.scalar(in_default).await? == 0, "their rows moved out of the default");
    ensure!(ledger.create_record_partitions(month_start(now, 11)?, now).await? == 0);
    let total = i64::try_from(events.len())?;
    ensure!(inspect.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records").await? == total);
    let Inspect::Postgres(pg) = &inspect else { anyhow::bail!("a Postgres ledger") };
    sqlx::query("ANALYZE").execute(pg).await?;

    // The audit queries read one month's partition, by index.
    let day = month_start(now, 5)? + TimeDelta::days(10);
    let tenant_day = RecordFilter {
        tenant: Some("tenant-3".to_owned()),
        since: Some(day),
        until: Some(day + TimeDelta::days(1)),
        limit: 100,
        ..RecordFilter::default()
    };
    let plan = ledger.explain(&tenant_day, None).await?.context("Postgres explains")?;
    let read = partitions_in(&plan);
    let month = format!("request_records_{}", day.format("%Y_%m"));
    ensure!(read == [month.clone()], "tenant-day reads only {month}: {read:?}\n{plan}");
    ensure!(plan.contains("Index") && !plan.contains("Seq Scan"), "by index:\n{plan}");
    let page = ledger.records(&tenant_day).await?;
    let expected = events
        .iter()
        .filter(|e| {
            e.tenant_id == "tenant-3"
                && e.arrival_at >= day
                && e.arrival_at < day + TimeDelta::days(1)
        })
        .count();
    ensure!(page.records.len() == expected.min(100) && expected > 0, "the day's rows");

    let tenant_month = UsageFilter {
        period: "day".to_owned(),
        tenant: Some("tenant-3".to_owned()),
        model: None,
        since: Some(month_start(now, 5)?),
        until: Some(month_start(now, 4)?),
    };
    let plan = ledger
        .explain(&RecordFilter::default(), Some(&tenant_month))
        .await?
        .context("Postgres explains")?;
    ensure!(plan.contains("Index") && !plan.contains("Seq Scan"), "usage by index:\n{plan}");

    // Retention keeps 6 months; the 6 before leave for archive files.
    let dir = tempfile::tempdir()?;
    let options = RetentionOptions {
        keep_months: 6,
        archive_dir: dir.path().join("archive"),
        dry_run: true,
        now,
    };
    let cut = cutoff(now, 6)?;
    let old = i64::try_from(events.iter().filter(|e| e.arrival_at < cut).count())?;
    let dry = ledger.apply_retention(&options).await?;
    ensure!(dry.months.len() == 6 && dry.months.iter().all(|m| m.action == "would archive"));
    ensure!(dry.months.iter().map(|m| m.sums.rows).sum::<i64>() == old);
    ensure!(inspect.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records").await? == total);
    ensure!(!options.archive_dir.exists(), "a dry run writes nothing");

    let report =
        ledger.apply_retention(&RetentionOptions { dry_run: false, ..options.clone() }).await?;
    ensure!(report.months.len() == 6, "{report:?}");
    ensure!(report.kept.len() >= 6 + 3, "this month, 5 before and the months ahead stay");
    // Each archive is one whole file: no write-ahead log or partial copy beside it.
    let mut files: Vec<String> = std::fs::read_dir(&options.archive_dir)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    files.sort();
    ensure!(files.len() == 6 && files.iter().all(|f| f.ends_with(".sqlite")), "{files:?}");
    let rows_left = inspect.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records").await?;
    ensure!(rows_left == total - old, "the archived rows left Postgres");
    let mut archived = 0;
    let mut completion = 0;
    for m in &report.months {
        ensure!(m.action == "archived", "{m:?}");
        let file = m.archive.as_deref().context("an archive file")?;
        // The auditor's view: the file alone, as a ledger, through the records query.
        let archive = Ledger::connect(&format!("sqlite://{file}")).await?;
        let a = Inspect::open(&format!("sqlite://{file}")).await?;
        let rows = a.scalar("SELECT COUNT(*) FROM request_records").await?;
        let tokens = a.scalar("SELECT SUM(completion_tokens) FROM request_records").await?;
        ensure!(rows == m.sums.rows && tokens == m.sums.completion_tokens, "{rows} {tokens} {m:?}");
        let page = archive
            .records(&RecordFilter {
                tenant: Some("tenant-0".to_owned()),
                limit: 5,
                ..RecordFilter::default()
            })
            .await?;
        ensure!(page.records.len() == 5 && page.next_cursor.is_some(), "archive is queryable");
        a.close().await;
        archive.close().await;
        archived += rows;
        completion += tokens;
    }
    let expected_completion: i64 =
        events.iter().filter(|e| e.arrival_at < cut).map(|e| i64::from(e.completion_tokens)).sum();
    ensure!(archived == old && completion == expected_completion, "every old row once");
    let again =
        ledger.apply_retention(&RetentionOptions { dry_run: false, ..options.clone() }).await?;
    ensure!(again.months.is_empty(), "a second run finds nothing: {again:?}");

    // A late row for an archived month lands in the default partition, and the next run
    // archives it to a second file; a partition a cut-off run left detached is finished.
    let mut late = events[0].clone();
    late.request_id = "req-late".to_owned();
    insert(&ledger, &[late.clone()]).await?;
    ensure!(inspect.scalar(in_default).await? == 1);
    let kept_oldest = report.kept.first().context("a kept partition")?.clone();
    let options_later = RetentionOptions {
        dry_run: false,
        now: month_start(now, 0)? + Months::new(1),
        ..options.clone()
    };
    sqlx::query(&format!("ALTER TABLE request_records DETACH PARTITION {kept_oldest}"))
        .execute(pg)
        .await?;
    let later = ledger.apply_retention(&options_later).await?;
    let names: Vec<&str> = later.months.iter().map(|m| m.partition.as_str()).collect();
    let late_name = format!("request_records_{}", late.arrival_at.format("%Y_%m"));
    ensure!(names == [late_name.as_str(), kept_oldest.as_str()], "{names:?}");
    let late_file = later.months[0].archive.as_deref().context("late archive")?;
    ensure!(
        late_file.ends_with(&format!("{late_name}-2.sqlite")),
        "never overwritten: {late_file}"
    );
    ensure!(later.moved_from_default == 1 && later.months[0].sums.rows == 1);
    ensure!(inspect.scalar(in_default).await? == 0);
    inspect.close().await;
    ledger.close().await;
    Ok(())
}

#[tokio::test]
async fn retention_refuses_the_sqlite_ledger_and_a_zero_keep() -> anyhow::Result<()> {
    let file = common::SqliteFile::create()?;
    let ledger = Ledger::connect(&file.url).await?;
    let dir = tempfile::tempdir()?;
    let options = RetentionOptions {
        keep_months: 13,
        archive_dir: dir.path().into(),
        dry_run: false,
        now: Utc::now(),
    };
    let err = ledger.apply_retention(&options).await.err().context("refused")?;
    ensure!(err.to_string().contains("Postgres"), "{err}");
    ensure!(ledger.create_record_partitions(Utc::now(), Utc::now()).await? == 0);
    ensure!(cutoff(Utc::now(), 0).is_err());
    ledger.close().await;
    Ok(())
}
