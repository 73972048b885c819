//! Ledger benchmarks: sustained batched insert rate into the ledger, and ingestion lag through a
//! Redis Stream under an open-loop load.
//!
//! Both write synthetic but complete gateway events (every column filled, a mix of tenants,
//! models, finish reasons and error cases) with request ids unique to the run, so they can run
//! against a database that already holds rows. They are measurements, not tests: nothing here
//! asserts a speed. `sluice bench billing` prints them against the target.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

use chrono::{TimeDelta, Utc};
use redis::AsyncCommands;
use serde::Serialize;
use sqlx::{Connection, Executor, PgConnection};
use tokio::sync::watch;

use crate::ingest::{EVENT_FIELD, IngestConfig, UsageConsumer};
use crate::{BillingError, FinishReason, Ledger, UsageEvent};

/// Insert rate the billing issue asks the Postgres ledger to sustain, records per second.
pub const TARGET_RECORDS_PER_SECOND: f64 = 20_000.0;

/// How often the open-loop producer wakes to publish the events that have fallen due.
const PRODUCER_TICK: Duration = Duration::from_millis(1);
/// How long the consumer keeps waiting for stragglers after the last scheduled send.
const DRAIN_GRACE: Duration = Duration::from_secs(30);

const TENANTS: u64 = 64;
/// The synthetic events' prices (micro-units per million tokens): 2, 1 and 8 a token.
const BENCH_RATES: crate::prices::Rates =
    crate::prices::Rates { input: 2_000_000, cached_input: 1_000_000, output: 8_000_000 };
const MODELS: [(&str, &str); 3] = [
    (
        "smollm2-135m-instruct",
        "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    ),
    (
        "qwen2.5-0.5b-instruct",
        "sha256:60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752",
    ),
    (
        "llama-3.2-1b-instruct",
        "sha256:fd61a03af4f77d870fc21e05e7e80678095c92d808cfb3b5c279ee04c74aca13",
    ),
];

/// Percentiles of a latency sample, milliseconds (nearest rank).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Number of samples.
    pub samples: usize,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest sample.
    pub max_ms: f64,
}

impl LatencySummary {
    /// Summarizes durations (any order).
    pub fn from_durations(durations: &[Duration]) -> Self {
        let mut ms: Vec<f64> = durations.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        Self {
            samples: ms.len(),
            p50_ms: nearest_rank(&ms, 0.50),
            p99_ms: nearest_rank(&ms, 0.99),
            max_ms: ms.last().copied().unwrap_or(0.0),
        }
    }
}

/// Nearest-rank percentile of sorted values; 0 for an empty sample.
fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Result of [`bench_insert`].
#[derive(Debug, Clone, Serialize)]
pub struct InsertReport {
    /// Events offered to the ledger.
    pub records: usize,
    /// Events per transaction.
    pub batch: usize,
    /// Transactions committed.
    pub batches: usize,
    /// New rows the ledger reported (equals `records` when every id is unique).
    pub inserted: usize,
    /// Wall time of the whole run, seconds.
    pub elapsed_s: f64,
    /// `records / elapsed_s`.
    pub records_per_second: f64,
    /// Time from starting one `insert_batch` to its commit returning.
    pub commit_latency: LatencySummary,
}

/// Result of [`bench_ingest`].
#[derive(Debug, Clone, Serialize)]
pub struct IngestReport {
    /// Events the producer was asked to publish.
    pub records: usize,
    /// Publish rate offered, events per second.
    pub offered_rate_per_s: f64,
    /// Events published divided by the time from the first scheduled send to the last publish.
    pub achieved_publish_rate_per_s: f64,
    /// Events committed divided by the time from the first scheduled send to the last commit.
    pub achieved_commit_rate_per_s: f64,
    /// Stream entries the consumer committed and acknowledged.
    pub committed: usize,
    /// New ledger rows the consumer reported.
    pub inserted: usize,
    /// Committed entries the ledger already held (redeliveries).
    pub duplicates: usize,
    /// Entries moved to the dead-letter stream.
    pub dead_lettered: usize,
    /// Batches committed.
    pub batches: usize,
    /// Per event: commit (after XACK) minus its scheduled send time.
    pub lag: LatencySummary,
}

/// Inserts `total` unique events in transactions of `batch` (one writer, back to back) and
/// reports the sustained rate and the per-transaction commit latency.
pub async fn bench_insert(
    ledger: &Ledger,
    total: usize,
    batch: usize,
) -> Result<InsertReport, BillingError> {
    let batch = batch.max(1);
    let mut events = EventFactory::new();
    let mut latencies = Vec::with_capacity(total.div_ceil(batch));
    let mut inserted = 0;
    let start = Instant::now();
    let mut done = 0;
    while done < total {
        let n = batch.min(total - done);
        let chunk: Vec<UsageEvent> = (0..n).map(|_| events.next_event()).collect();
        let t = Instant::now();
        inserted += ledger.insert_batch(&chunk).await?;
        latencies.push(t.elapsed());
        done += n;
    }
    let elapsed_s = start.elapsed().as_secs_f64();
    Ok(InsertReport {
        records: total,
        batch,
        batches: latencies.len(),
        inserted,
        elapsed_s,
        records_per_second: rate(total, elapsed_s),
        commit_latency: LatencySummary::from_durations(&latencies),
    })
}

/// Publishes `total` events to `stream` at `rate_per_s` (open loop: send times fixed up front,
/// a late send does not delay the ones after it) while one [`UsageConsumer`] ingests them into
/// `ledger`, and reports the lag from each event's scheduled send to its commit.
///
/// `stream` must be a scratch key: the consumer group `bench` is created on it, and the stream
/// and `{stream}:dead` are deleted afterwards. Give it a hash tag (`{bench-x}:usage`) when
/// running against Redis Cluster.
pub async fn bench_ingest(
    redis_client: redis::Client,
    ledger: Ledger,
    stream: &str,
    rate_per_s: f64,
    total: usize,
) -> Result<IngestReport, BillingError> {
    let rate_per_s = if rate_per_s.is_finite() && rate_per_s > 0.0 { rate_per_s } else { 1.0 };
    let dead = format!("{stream}:dead");
    let config = IngestConfig {
        stream: stream.to_owned(),
        dead_letter_stream: dead.clone(),
        group: "bench".to_owned(),
        batch_size: 500,
        block: Duration::from_millis(100),
        ..IngestConfig::new("bench-0")
    };
    let mut producer = redis_client.get_multiplexed_async_connection().await?;
    let mut consumer = UsageConsumer::new(redis_client, ledger, config).await?;
    let result = run_ingest(&mut producer, &mut consumer, stream, rate_per_s, total).await;
    let _deleted: usize = producer.del(&[stream, dead.as_str()]).await?;
    result
}

async fn run_ingest(
    producer: &mut redis::aio::MultiplexedConnection,
    consumer: &mut UsageConsumer,
    stream: &str,
    rate_per_s: f64,
    total: usize,
) -> Result<IngestReport, BillingError> {
    let stats = consumer.stats();
    let mut events = EventFactory::new();
    // Encoded before the clock starts so the producer's pace is not JSON-bound.
    let payloads = (0..total)
        .map(|_| {
            let event = events.next_event();
            event.validate()?;
            serde_json::to_string(&event).map_err(BillingError::Encode)
        })
        .collect::<Result<Vec<String>, BillingError>>()?;
    let start = Instant::now();
    let scheduled = |i: usize| start + Duration::from_secs_f64(i as f64 / rate_per_s);
    let schedule_end = scheduled(total);

    let produce = async {
        let mut published: Vec<(String, Instant)> = Vec::with_capacity(total);
        let mut next = 0;
        while next < total {
            let now = Instant::now();
            let mut pipe = redis::pipe();
            let first = next;
            while next < total && scheduled(next) <= now {
                pipe.xadd(stream, "*", &[(EVENT_FIELD, payloads[next].as_str())]);
                next += 1;
            }
            if next > first {
                let ids: Vec<String> = pipe.query_async(producer).await?;
                published.extend(ids.into_iter().zip((first..next).map(scheduled)));
            }
            if next < total {
                tokio::time::sleep_until(scheduled(next).max(now + PRODUCER_TICK).into()).await;
            }
        }
        Ok::<_, BillingError>((published, start.elapsed()))
    };

    let consume = async {
        // Never fired: the bench stops the consumer by not calling it any more.
        let (_keep, mut shutdown) = watch::channel(false);
        let mut committed: Vec<(String, Instant)> = Vec::with_capacity(total);
        while committed.len() < total && Instant::now() < schedule_end + DRAIN_GRACE {
            let Some(batch) = consumer.next_batch().await? else { continue };
            let ids: Vec<String> = batch.ids().map(str::to_owned).collect();
            if consumer.commit(batch, &mut shutdown).await?.is_some() {
                let at = Instant::now();
                committed.extend(ids.into_iter().map(|id| (id, at)));
            }
        }
        Ok::<_, BillingError>((committed, start.elapsed()))
    };

    let ((published, publish_elapsed), (committed, commit_elapsed)) =
        tokio::try_join!(produce, consume)?;
    let sent: HashMap<String, Instant> = published.into_iter().collect();
    let lags: Vec<Duration> = committed
        .iter()
        .filter_map(|(id, at)| sent.get(id).map(|s| at.saturating_duration_since(*s)))
        .collect();
    Ok(IngestReport {
        records: total,
        offered_rate_per_s: rate_per_s,
        achieved_publish_rate_per_s: rate(sent.len(), publish_elapsed.as_secs_f64()),
        achieved_commit_rate_per_s: rate(committed.len(), commit_elapsed.as_secs_f64()),
        committed: committed.len(),
        inserted: usize::try_from(stats.inserted()).unwrap_or(usize::MAX),
        duplicates: usize::try_from(stats.duplicates()).unwrap_or(usize::MAX),
        dead_lettered: usize::try_from(stats.dead_lettered()).unwrap_or(usize::MAX),
        batches: usize::try_from(stats.committed_batches()).unwrap_or(usize::MAX),
        lag: LatencySummary::from_durations(&lags),
    })
}

fn rate(n: usize, seconds: f64) -> f64 {
    if seconds > 0.0 { n as f64 / seconds } else { 0.0 }
}

/// A fresh random 64-bit value (std's per-instance hasher keys are drawn from the OS).
fn random_u64() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(Utc::now().timestamp_nanos_opt().unwrap_or_default().unsigned_abs().into());
    hasher.finish()
}

/// SplitMix64: a fast, well-mixed sequence for synthetic field values.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Produces complete, valid usage events with ids unique to this factory's run.
#[derive(Debug)]
pub struct EventFactory {
    run: u64,
    seq: u64,
    rng: u64,
}

impl Default for EventFactory {
    fn default() -> Self {
        Self::new()
    }
}

impl EventFactory {
    /// A factory with a random run id.
    pub fn new() -> Self {
        let run = random_u64();
        Self { run, seq: 0, rng: run }
    }

    /// The next event: what a gateway emits for one finished (or failed) request.
    pub fn next_event(&mut self) -> UsageEvent {
        let seq = self.seq;
        self.seq += 1;
        let r = splitmix64(&mut self.rng);
        let tenant = r % TENANTS;
        let (model_id, model_revision) = MODELS[(r >> 8) as usize % MODELS.len()];
        let prompt_tokens = 16 + (r >> 16) as u32 % 2_000;
        let cached_prompt_tokens = prompt_tokens * ((r >> 28) as u32 % 4) / 4;
        // Mostly successes, with the failure shapes the ledger must bill too.
        let (finish_reason, http_status, error_type, disconnected) = match (r >> 32) % 100 {
            0..=79 => (FinishReason::Stop, 200, None, false),
            80..=91 => (FinishReason::Length, 200, None, false),
            92..=94 => (FinishReason::ClientDisconnected, 499, None, true),
            95..=96 => (FinishReason::Rejected, 429, Some("rate_limit_exceeded"), false),
            97..=98 => (FinishReason::Timeout, 504, Some("timeout"), false),
            _ => (FinishReason::Error, 500, Some("engine_error"), false),
        };
        let rejected = finish_reason == FinishReason::Rejected;
        let completion_tokens = if rejected { 0 } else { 1 + (r >> 40) as u32 % 512 };
        let queue_ms = ((r >> 48) % 50) as f64 / 2.0;
        let prefill_ms = f64::from(prompt_tokens - cached_prompt_tokens) * 0.3;
        let tpot_ms = 8.0 + ((r >> 52) % 40) as f64 / 4.0;
        let decode_ms = f64::from(completion_tokens.saturating_sub(1)) * tpot_ms;
        let ttft_ms = 2.0 + queue_ms + prefill_ms;
        let e2e_ms = if rejected { 1.5 } else { ttft_ms + decode_ms + 1.0 };
        let last_token_at = Utc::now();
        let arrival_at = last_token_at - TimeDelta::microseconds((e2e_ms * 1e3) as i64);
        let hash: String = (0..4).map(|_| format!("{:016x}", splitmix64(&mut self.rng))).collect();
        let trace = format!("{:016x}{:016x}", self.run, seq);
        UsageEvent {
            request_id: format!("req-{:016x}-{seq:010}", self.run),
            idempotency_key: r.is_multiple_of(5).then(|| format!("idem-{:016x}-{seq}", self.run)),
            tenant_id: format!("tenant-{tenant:03}"),
            key_id: format!("key-{tenant:03}-{}", (r >> 4) % 3),
            model_id: model_id.to_owned(),
            model_revision: model_revision.to_owned(),
            tokenizer_revision:
                "sha256:3f39d4a2c1e0b9f8a7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4".to_owned(),
            chat_template_version:
                "sha256:e3b98a4da31a127d4bde6e43033f66ba274cab0eb7eb1c70ec41402bf6273dd8".to_owned(),
            adapter: r.is_multiple_of(7).then(|| format!("support-bot@rev{}", (r >> 12) % 4)),
            engine_version: (!rejected).then(|| "0.1.0+bench".to_owned()),
            engine_worker: (!rejected).then(|| format!("worker-{}", (r >> 20) % 8)),
            prompt_tokens,
            cached_prompt_tokens,
            completion_tokens,
            finish_reason,
            http_status,
            error_type: error_type.map(str::to_owned),
            client_disconnected: disconnected,
            arrival_at,
            first_token_at: (!rejected)
                .then(|| arrival_at + TimeDelta::microseconds((ttft_ms * 1e3) as i64)),
            last_token_at: (!rejected).then_some(last_token_at),
            ttft_ms: (!rejected).then_some(ttft_ms),
            tpot_ms: (completion_tokens > 1).then_some(tpot_ms),
            itl_max_ms: (completion_tokens > 1).then_some(tpot_ms * 3.5),
            itl_p99_ms: (completion_tokens > 1).then_some(tpot_ms * 2.0),
            e2e_ms: Some(e2e_ms),
            engine_queue_ms: (!rejected).then_some(queue_ms),
            engine_prefill_ms: (!rejected).then_some(prefill_ms),
            engine_decode_ms: (!rejected).then_some(decode_ms),
            trace_id: Some(trace),
            prompt_sha256: hash,
            prompt_chars: prompt_tokens * 4 + (r >> 36) as u32 % 4,
            user_sha256: None,
            // Refused requests cost nothing, as the gateway prices them.
            cost_micros: BENCH_RATES.charge(
                http_status,
                u64::from(prompt_tokens),
                u64::from(cached_prompt_tokens),
                u64::from(completion_tokens),
            ),
            price_list_version: "bench-1".to_owned(),
            price_input_micros: BENCH_RATES.input,
            price_cached_input_micros: BENCH_RATES.cached_input,
            price_output_micros: BENCH_RATES.output,
        }
    }
}

/// What `sluice bench billing` runs: the insert-rate run, and the ingestion-lag run when a
/// Redis is given.
#[derive(Clone, Debug)]
pub struct LedgerBenchConfig {
    /// Events inserted in the insert-rate run.
    pub records: usize,
    /// Events per transaction in the insert-rate run.
    pub batch: usize,
    /// Redis for the ingestion-lag run (skipped when `None`).
    pub redis_url: Option<String>,
    /// Events per second the producer offers in the ingestion-lag run.
    pub rate: f64,
    /// Length of the ingestion-lag run, seconds.
    pub seconds: f64,
    /// Writers of the parallel insert run (0 skips it); each inserts `records`.
    pub writers: usize,
    /// Rows of the audit-query run (0 skips it).
    pub audit_rows: i64,
    /// Months the audit rows span.
    pub audit_months: u32,
    /// Queries of each kind the audit run times.
    pub audit_queries: usize,
}

/// The insert rate a ledger benchmark is set against.
#[derive(Clone, Debug, Serialize)]
pub struct LedgerBaseline {
    /// Where the figure comes from.
    pub source: &'static str,
    /// Records per second.
    pub records_per_second: f64,
}

/// Both runs against a scratch database, set against [`TARGET_RECORDS_PER_SECOND`].
#[derive(Clone, Debug, Serialize)]
pub struct LedgerBench {
    /// The scratch database the runs wrote into (dropped afterwards).
    pub scratch_database: String,
    /// What the insert rate is set against.
    pub baseline: LedgerBaseline,
    /// The insert-rate run.
    pub insert: InsertReport,
    /// Insert rate over the baseline.
    pub insert_ratio: f64,
    /// The ingestion-lag run, if a Redis was given.
    pub ingest: Option<IngestReport>,
    /// The parallel insert run (consumers writing side by side), if asked for.
    pub parallel: Option<ParallelInsertReport>,
    /// Parallel rate over the baseline times the writers.
    pub parallel_ratio: Option<f64>,
    /// The audit-query run, if asked for.
    pub audit: Option<AuditReport>,
}

/// A ledger benchmark that failed, and at which stage.
#[derive(Debug, thiserror::Error)]
#[error("{stage}: {error}")]
pub struct BenchFailure {
    /// What was being done.
    pub stage: String,
    /// What went wrong.
    #[source]
    pub error: BillingError,
}

fn at(stage: &str) -> impl FnOnce(BillingError) -> BenchFailure + '_ {
    move |error| BenchFailure { stage: stage.to_owned(), error }
}

/// Runs both benchmarks in a scratch database created through `database_url` (the role needs
/// CREATEDB) and dropped afterwards, whatever the runs did.
pub async fn bench_ledger(
    database_url: &str,
    cfg: &LedgerBenchConfig,
) -> Result<LedgerBench, BenchFailure> {
    let scratch = ScratchDatabase::create(database_url)
        .await
        .map_err(at("creating the scratch database (the role needs CREATEDB)"))?;
    let scratch_database = scratch.name.clone();
    let result = bench_in(&scratch.url, cfg).await;
    let dropped = scratch.drop_database().await;
    let (insert, ingest, parallel, audit) = result?;
    let stage = format!("dropping the scratch database {scratch_database} (drop it by hand)");
    dropped.map_err(at(&stage))?;
    let insert_ratio = insert.records_per_second / TARGET_RECORDS_PER_SECOND;
    Ok(LedgerBench {
        scratch_database,
        baseline: LedgerBaseline {
            source: "billing issue target",
            records_per_second: TARGET_RECORDS_PER_SECOND,
        },
        insert,
        insert_ratio,
        ingest,
        parallel_ratio: parallel
            .as_ref()
            .map(|p| p.records_per_second / (TARGET_RECORDS_PER_SECOND * p.writers as f64)),
        parallel,
        audit,
    })
}

type BenchRuns =
    (InsertReport, Option<IngestReport>, Option<ParallelInsertReport>, Option<AuditReport>);

async fn bench_in(url: &str, cfg: &LedgerBenchConfig) -> Result<BenchRuns, BenchFailure> {
    let ledger = Ledger::connect(url).await.map_err(at("connecting to the ledger"))?;
    let insert =
        bench_insert(&ledger, cfg.records, cfg.batch).await.map_err(at("insert-rate run"))?;
    let ingest = match &cfg.redis_url {
        Some(redis_url) => {
            let client = redis::Client::open(redis_url.as_str())
                .map_err(|e| at("parsing --redis-url")(e.into()))?;
            let stream = format!("{{sluice-bench-{}}}:usage", std::process::id());
            let total = (cfg.rate * cfg.seconds).round().max(1.0) as usize;
            let report = bench_ingest(client, ledger.clone(), &stream, cfg.rate, total).await;
            Some(report.map_err(at("ingestion-lag run"))?)
        }
        None => None,
    };
    let parallel = match cfg.writers {
        0 => None,
        n => Some(
            bench_parallel_insert(&ledger, n, cfg.records, cfg.batch)
                .await
                .map_err(at("parallel insert run"))?,
        ),
    };
    let audit = match cfg.audit_rows {
        ..=0 => None,
        rows => Some(
            bench_audit_queries(&ledger, rows, cfg.audit_months, 100, cfg.audit_queries)
                .await
                .map_err(at("audit-query run"))?,
        ),
    };
    ledger.close().await;
    Ok((insert, ingest, parallel, audit))
}

impl std::fmt::Display for LedgerBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (i, b) = (&self.insert, &self.baseline);
        writeln!(f, "database   {} (scratch, dropped)", self.scratch_database)?;
        writeln!(
            f,
            "baseline   {:.0} records/s into Postgres ({})",
            b.records_per_second, b.source
        )?;
        writeln!(
            f,
            "insert     {:>9.0} records/s   ratio {:.2}x   {} records in batches of {} ({} new rows, {:.2} s, one writer)",
            i.records_per_second, self.insert_ratio, i.records, i.batch, i.inserted, i.elapsed_s
        )?;
        let c = &i.commit_latency;
        writeln!(
            f,
            "commit     p50 {:.1} ms   p99 {:.1} ms   max {:.1} ms per batch of {}",
            c.p50_ms, c.p99_ms, c.max_ms, i.batch
        )?;
        if let (Some(p), Some(r)) = (&self.parallel, self.parallel_ratio) {
            writeln!(
                f,
                "parallel   {:>9.0} records/s   ratio {:.2}x of {:.0}   {} writers x {} records (commit p50 {:.1} ms, p99 {:.1} ms)",
                p.records_per_second,
                r,
                TARGET_RECORDS_PER_SECOND * p.writers as f64,
                p.writers,
                p.records / p.writers.max(1),
                p.commit_latency.p50_ms,
                p.commit_latency.p99_ms
            )?;
        }
        if let Some(a) = &self.audit {
            writeln!(
                f,
                "audit      {} rows over {} monthly partitions, {} tenants (loaded in {:.0} s); target p99 < {:.0} ms",
                a.rows, a.months, a.tenants, a.load_s, TARGET_AUDIT_P99_MS
            )?;
            for (name, l) in [
                ("tenant-day records page", &a.tenant_day_records),
                ("tenant-month usage", &a.tenant_month_usage),
                ("key-month tokens", &a.key_month_tokens),
            ] {
                writeln!(
                    f,
                    "  {name:<24} p50 {:>6.2} ms   p99 {:>6.2} ms   max {:>6.2} ms   ratio p99/target {:.3}   ({} queries)",
                    l.p50_ms,
                    l.p99_ms,
                    l.max_ms,
                    l.p99_ms / TARGET_AUDIT_P99_MS,
                    l.samples
                )?;
            }
            writeln!(f, "  tenant-day plan:")?;
            for line in a.tenant_day_plan.lines() {
                writeln!(f, "    {line}")?;
            }
        }
        let Some(g) = &self.ingest else {
            return writeln!(f, "ingest     skipped (no --redis-url)");
        };
        writeln!(
            f,
            "ingest     offered {:.0}/s for {} events; achieved publish {:.0}/s, commit {:.0}/s ({} committed, {} new, {} duplicates, {} dead-lettered, {} batches)",
            g.offered_rate_per_s,
            g.records,
            g.achieved_publish_rate_per_s,
            g.achieved_commit_rate_per_s,
            g.committed,
            g.inserted,
            g.duplicates,
            g.dead_lettered,
            g.batches
        )?;
        writeln!(
            f,
            "lag        p50 {:.1} ms   p99 {:.1} ms   max {:.1} ms (scheduled send -> commit and ack, {} samples)",
            g.lag.p50_ms, g.lag.p99_ms, g.lag.max_ms, g.lag.samples
        )
    }
}

/// Result of [`bench_parallel_insert`]: writers inserting side by side, as two billing
/// consumers do (each its own batches, into one ledger).
#[derive(Debug, Clone, Serialize)]
pub struct ParallelInsertReport {
    /// Concurrent writers.
    pub writers: usize,
    /// Events inserted, all writers together.
    pub records: usize,
    /// Wall time from the first writer's start to the last one's end, seconds.
    pub elapsed_s: f64,
    /// `records / elapsed_s`.
    pub records_per_second: f64,
    /// Commit latency over every writer's transactions.
    pub commit_latency: LatencySummary,
}

/// `writers` tasks each inserting `per_writer` unique events in transactions of `batch`.
pub async fn bench_parallel_insert(
    ledger: &Ledger,
    writers: usize,
    per_writer: usize,
    batch: usize,
) -> Result<ParallelInsertReport, BillingError> {
    let batch = batch.max(1);
    let start = Instant::now();
    let tasks: Vec<_> = (0..writers.max(1))
        .map(|_| {
            let ledger = ledger.clone();
            tokio::spawn(async move {
                let mut events = EventFactory::new();
                let mut latencies = Vec::new();
                let mut done = 0;
                while done < per_writer {
                    let n = batch.min(per_writer - done);
                    let chunk: Vec<UsageEvent> = (0..n).map(|_| events.next_event()).collect();
                    let t = Instant::now();
                    ledger.insert_batch(&chunk).await?;
                    latencies.push(t.elapsed());
                    done += n;
                }
                Ok::<_, BillingError>(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for t in tasks {
        let got = t.await.map_err(|e| BillingError::Bench(format!("a writer task failed: {e}")))?;
        latencies.extend(got?);
    }
    let elapsed_s = start.elapsed().as_secs_f64();
    let records = per_writer * writers.max(1);
    Ok(ParallelInsertReport {
        writers: writers.max(1),
        records,
        elapsed_s,
        records_per_second: rate(records, elapsed_s),
        commit_latency: LatencySummary::from_durations(&latencies),
    })
}

/// The audit-query bound the year-of-records issue sets, milliseconds at p99.
pub const TARGET_AUDIT_P99_MS: f64 = 100.0;

/// Result of [`bench_audit_queries`]: the audit queries over a year of records.
#[derive(Debug, Clone, Serialize)]
pub struct AuditReport {
    /// Rows in `request_records` while the queries ran.
    pub rows: i64,
    /// Months they span (one partition each).
    pub months: u32,
    /// Tenants they belong to.
    pub tenants: u32,
    /// Seconds spent writing them (and their rollups) with `generate_series`.
    pub load_s: f64,
    /// A tenant's records of one day, first page of 100 (`GET /v1/records`).
    pub tenant_day_records: LatencySummary,
    /// A tenant's day rollups over one month (`GET /v1/usage?period=day`).
    pub tenant_month_usage: LatencySummary,
    /// One key's billed tokens this day and month (the limiter's cold start).
    pub key_month_tokens: LatencySummary,
    /// The first tenant-day plan, as Postgres explains it.
    pub tenant_day_plan: String,
}

/// Fills the scratch ledger with `rows` records spread evenly over the `months` months up to
/// now across `tenants` tenants (three keys each) with `generate_series`, builds their hour and
/// day rollups, analyzes, then times `queries` of each audit query on random tenants, days
/// and keys.
pub async fn bench_audit_queries(
    ledger: &Ledger,
    rows: i64,
    months: u32,
    tenants: u32,
    queries: usize,
) -> Result<AuditReport, BillingError> {
    use chrono::{Datelike, Months, NaiveDate, TimeZone};
    let crate::store::Pool::Postgres(pool) = ledger.pool() else {
        return Err(BillingError::Bench("the audit benchmark needs Postgres".into()));
    };
    let now = Utc::now();
    let first = NaiveDate::from_ymd_opt(now.year(), now.month(), 1)
        .and_then(|d| d.checked_sub_months(Months::new(months.max(1) - 1)))
        .ok_or_else(|| BillingError::Bench("month out of range".into()))?;
    let start = Utc.from_utc_datetime(&first.and_time(chrono::NaiveTime::MIN));
    ledger.create_record_partitions(start, now).await?;
    let span_s = (now - start).num_seconds().max(1);
    let tenants = tenants.max(1);
    let t0 = Instant::now();
    // A million rows a statement: each stays a few seconds, and the WAL bounded.
    let chunk = 1_000_000i64;
    let mut from = 0i64;
    while from < rows {
        let to = (from + chunk).min(rows);
        sqlx::query(
            "INSERT INTO request_records (request_id, tenant_id, key_id, model_id, \
             model_revision, tokenizer_revision, chat_template_version, prompt_tokens, \
             cached_prompt_tokens, completion_tokens, finish_reason, http_status, \
             client_disconnected, arrival_at, first_token_at, last_token_at, ttft_ms, e2e_ms, \
             prompt_sha256, prompt_chars, cost_micros) \
             SELECT 'audit-' || g, 'tenant-' || (g % $3), 'key-' || (g % $3) || '-' || (g / $3 % 3), \
             'smollm2-135m-instruct', 'sha256:bench', 'sha256:tok', 'v1', 50 + g % 950, \
             (g % 7) * 16, 1 + g % 256, CASE WHEN g % 41 = 0 THEN 'length' ELSE 'stop' END, \
             200, false, t, t + interval '40 ms', t + interval '900 ms', 40, 900, \
             md5(g::text), 200 + g % 3000, 2 * (50 + g % 950) + 8 * (1 + g % 256) \
             FROM (SELECT g, $4::timestamptz + make_interval(secs => (g * $5::float8) / $6) AS t \
                   FROM generate_series($1::bigint, $2::bigint - 1) AS g) AS s",
        )
        .bind(from)
        .bind(to)
        .bind(i64::from(tenants))
        .bind(start)
        .bind(span_s as f64)
        .bind(rows as f64)
        .execute(pool)
        .await?;
        from = to;
    }
    for (period, unit) in [("hour", "hour"), ("day", "day")] {
        sqlx::query(&format!(
            "INSERT INTO usage_rollups (period, bucket_start, tenant_id, model_id, requests, \
             prompt_tokens, cached_prompt_tokens, completion_tokens, cost_micros) \
             SELECT '{period}', date_trunc('{unit}', arrival_at, 'UTC'), tenant_id, model_id, \
             COUNT(*), SUM(prompt_tokens), SUM(cached_prompt_tokens), SUM(completion_tokens), \
             SUM(cost_micros) FROM request_records WHERE request_id LIKE 'audit-%' \
             GROUP BY 2, 3, 4 \
             ON CONFLICT (period, bucket_start, tenant_id, model_id) DO UPDATE SET \
             requests = usage_rollups.requests + EXCLUDED.requests, \
             prompt_tokens = usage_rollups.prompt_tokens + EXCLUDED.prompt_tokens, \
             cached_prompt_tokens = usage_rollups.cached_prompt_tokens + EXCLUDED.cached_prompt_tokens, \
             completion_tokens = usage_rollups.completion_tokens + EXCLUDED.completion_tokens, \
             cost_micros = usage_rollups.cost_micros + EXCLUDED.cost_micros"
        ))
        .execute(pool)
        .await?;
    }
    sqlx::query("ANALYZE").execute(pool).await?;
    let load_s = t0.elapsed().as_secs_f64();
    let total: i64 = sqlx::query_scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records")
        .fetch_one(pool)
        .await?;

    let mut rng = random_u64();
    let days = (now - start).num_days().max(1) as u64;
    let mut pick = |n: u64| splitmix64(&mut rng) % n.max(1);
    let mut day_lat = Vec::with_capacity(queries);
    let mut month_lat = Vec::with_capacity(queries);
    let mut key_lat = Vec::with_capacity(queries);
    let mut plan = String::new();
    for i in 0..queries {
        let tenant = pick(u64::from(tenants));
        let day = start + TimeDelta::days(pick(days) as i64);
        let filter = crate::query::RecordFilter {
            tenant: Some(format!("tenant-{tenant}")),
            since: Some(day),
            until: Some(day + TimeDelta::days(1)),
            limit: 100,
            ..crate::query::RecordFilter::default()
        };
        if i == 0 {
            plan = ledger.explain(&filter, None).await.map_err(admin)?.unwrap_or_default();
        }
        let t = Instant::now();
        let page = ledger.records(&filter).await.map_err(admin)?;
        day_lat.push(t.elapsed());
        std::hint::black_box(page);

        let month = NaiveDate::from_ymd_opt(day.year(), day.month(), 1)
            .map(|d| Utc.from_utc_datetime(&d.and_time(chrono::NaiveTime::MIN)))
            .unwrap_or(day);
        let usage = crate::query::UsageFilter {
            period: "day".into(),
            tenant: Some(format!("tenant-{tenant}")),
            model: None,
            since: Some(month),
            until: Some(month + Months::new(1)),
        };
        let t = Instant::now();
        let rows = ledger.usage(&usage).await.map_err(admin)?;
        month_lat.push(t.elapsed());
        std::hint::black_box(rows);

        let key = format!("key-{tenant}-{}", pick(3));
        let t = Instant::now();
        let used = ledger
            .tokens_used(&format!("tenant-{tenant}"), Some(&key), day, month)
            .await
            .map_err(admin)?;
        key_lat.push(t.elapsed());
        std::hint::black_box(used);
    }
    Ok(AuditReport {
        rows: total,
        months: months.max(1),
        tenants,
        load_s,
        tenant_day_records: LatencySummary::from_durations(&day_lat),
        tenant_month_usage: LatencySummary::from_durations(&month_lat),
        key_month_tokens: LatencySummary::from_durations(&key_lat),
        tenant_day_plan: plan,
    })
}

fn admin(e: crate::control::AdminError) -> BillingError {
    BillingError::Bench(e.to_string())
}

/// A throwaway Postgres database on the server a base URL points at, so a benchmark never
/// writes into real data. Call [`ScratchDatabase::drop_database`] when done.
#[derive(Debug)]
pub struct ScratchDatabase {
    /// URL of the scratch database.
    pub url: String,
    /// Its name (`sluice_bench_<random hex>`).
    pub name: String,
    admin_url: String,
}

impl ScratchDatabase {
    /// Creates `sluice_bench_<random>` through `admin_url` (any database on the server the
    /// connecting role may create databases from, e.g. `postgres://postgres@host/postgres`).
    pub async fn create(admin_url: &str) -> Result<Self, BillingError> {
        let name = format!("sluice_bench_{:016x}", random_u64());
        let url = with_database(admin_url, &name).ok_or(BillingError::UnsupportedUrl)?;
        let mut admin = PgConnection::connect(admin_url).await?;
        // The name is generated above from hex digits; CREATE DATABASE takes no binds.
        admin.execute(format!("CREATE DATABASE {name}").as_str()).await?;
        admin.close().await?;
        Ok(Self { url, name, admin_url: admin_url.to_owned() })
    }

    /// Drops the database, disconnecting anything still attached.
    pub async fn drop_database(self) -> Result<(), BillingError> {
        let mut admin = PgConnection::connect(&self.admin_url).await?;
        admin
            .execute(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name).as_str())
            .await?;
        admin.close().await?;
        Ok(())
    }
}

/// `postgres://user@host:port/db?params` with the database replaced by `name`.
fn with_database(url: &str, name: &str) -> Option<String> {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let scheme_end = base.find("://")? + 3;
    if !base.starts_with("postgres://") && !base.starts_with("postgresql://") {
        return None;
    }
    let authority_end = base[scheme_end..].find('/').map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{name}", &base[..authority_end]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_database_in_a_url() {
        let cases = [
            (
                "postgres://postgres@127.0.0.1:5432/test",
                Some("postgres://postgres@127.0.0.1:5432/x"),
            ),
            ("postgresql://u:p@h/db?sslmode=disable", Some("postgresql://u:p@h/x?sslmode=disable")),
            ("postgres://h", Some("postgres://h/x")),
            ("sqlite://ledger.db", None),
        ];
        for (url, want) in cases {
            assert_eq!(with_database(url, "x").as_deref(), want, "{url}");
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let d: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let s = LatencySummary::from_durations(&d);
        assert_eq!((s.samples, s.p50_ms, s.p99_ms, s.max_ms), (100, 50.0, 99.0, 100.0));
        assert_eq!(LatencySummary::from_durations(&[]), LatencySummary::default());
    }

    #[test]
    fn synthetic_events_are_valid_and_unique() -> Result<(), BillingError> {
        let mut factory = EventFactory::new();
        let events: Vec<UsageEvent> = (0..2_000).map(|_| factory.next_event()).collect();
        for e in &events {
            e.validate()?;
        }
        let ids: std::collections::HashSet<&str> =
            events.iter().map(|e| e.request_id.as_str()).collect();
        assert_eq!(ids.len(), events.len());
        assert!(events.iter().any(|e| e.finish_reason == FinishReason::ClientDisconnected));
        assert!(events.iter().any(|e| e.idempotency_key.is_some()));
        Ok(())
    }
}
