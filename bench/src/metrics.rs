//! Per-request measurements and their aggregates, with MISSION.md's definitions as
//! `sluice_text::stream` states them (shared with the gateway's ledger): a one-token response
//! has no TPOT and stays out of TPOT aggregates; ITL is every chunk gap (never p99 ITL in place
//! of p99 TPOT). Times are taken from each request's scheduled send (no coordinated omission). SLO attainment counts failed,
//! timed-out and rejected requests in its denominator. Field names follow `vllm bench serve`.

use serde::Serialize;
use sluice_text::stream::TokenEvents;

/// What the client saw of one request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    /// Scheduled send, seconds from the start of the run.
    pub scheduled_s: f64,
    /// Completed with a 2xx and a whole response.
    pub ok: bool,
    /// Refused by admission (429, 503).
    pub rejected: bool,
    /// What went wrong, if anything.
    pub error: Option<String>,
    /// Prompt tokens.
    pub input_len: u64,
    /// Of them, those the server's prefix cache served (its `cached_tokens`).
    pub cached_len: u64,
    /// Output tokens (the server's usage when given, else the events' counts).
    pub output_len: u64,
    /// Each token-carrying event: seconds since the scheduled send, and tokens it carried.
    pub events: TokenEvents,
    /// End of the response, seconds since the scheduled send.
    pub end_s: f64,
    /// How late the client sent it, seconds after the scheduled send (a client that could
    /// not keep up shows here).
    pub lateness_s: f64,
    /// Ended by the client's timeout.
    pub timed_out: bool,
}

impl Outcome {
    /// Time to first token, seconds.
    pub fn ttft(&self) -> Option<f64> {
        self.events.ttft()
    }

    /// Tokens the events carried.
    pub fn streamed_tokens(&self) -> u64 {
        self.events.tokens()
    }

    /// Time per output token after the first, seconds; `None` for one token.
    pub fn tpot(&self) -> Option<f64> {
        self.events.tpot()
    }

    /// Gaps between token-carrying events, seconds, each with the tokens of the later event.
    pub fn itls(&self) -> Vec<(f64, u64)> {
        self.events.itls()
    }
}

/// Thresholds of a "good" request (milliseconds; `None` = no threshold).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Slo {
    /// TTFT at most.
    pub ttft_ms: Option<f64>,
    /// TPOT at most (a one-token response has no TPOT and passes).
    pub tpot_ms: Option<f64>,
    /// E2E at most.
    pub e2el_ms: Option<f64>,
}

impl Slo {
    /// Whether `o` completed within every threshold.
    pub fn good(&self, o: &Outcome) -> bool {
        let within = |v: Option<f64>, t: Option<f64>| match (v, t) {
            (_, None) => true,
            (Some(v), Some(t)) => v * 1000.0 <= t,
            (None, Some(_)) => false,
        };
        o.ok && within(o.ttft(), self.ttft_ms)
            && (o.tpot().is_none() || within(o.tpot(), self.tpot_ms))
            && within(Some(o.end_s), self.e2el_ms)
    }
}

/// Percentiles of one metric, milliseconds, with the sample count.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Dist {
    /// Samples.
    pub count: usize,
    /// Mean.
    pub mean: f64,
    /// p50.
    pub median: f64,
    /// p90.
    pub p90: f64,
    /// p95.
    pub p95: f64,
    /// p99.
    pub p99: f64,
    /// p99.9.
    pub p999: f64,
    /// 95% bootstrap confidence interval of the median.
    pub median_ci95: [f64; 2],
    /// 95% bootstrap confidence interval of p99.
    pub p99_ci95: [f64; 2],
}

/// Bootstrap resamples for the confidence intervals.
const RESAMPLES: usize = 400;

/// Largest sample resampled: bigger sets (ITL gaps of long runs) are thinned evenly to this
/// many sorted values first, which keeps their quantiles and bounds the work (the interval is
/// then that of this many samples: wider than the whole set's, never narrower).
const MAX_RESAMPLED: usize = 20_000;

/// 95% percentile-bootstrap interval of the `p`th percentile of `v` (fixed seed: the same
/// samples give the same interval).
fn bootstrap(v: &[f64], p: f64) -> [f64; 2] {
    if v.len() < 2 {
        let x = v.first().copied().unwrap_or(0.0);
        return [x, x];
    }
    let thinned: Vec<f64>;
    let v = if v.len() > MAX_RESAMPLED {
        thinned = (0..MAX_RESAMPLED).map(|i| v[i * v.len() / MAX_RESAMPLED]).collect();
        &thinned[..]
    } else {
        v
    };
    let mut rng = crate::arrivals::Rng::new(0xB007);
    let mut stats = Vec::with_capacity(RESAMPLES);
    let mut sample = vec![0.0; v.len()];
    let rank = (((p / 100.0) * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    for _ in 0..RESAMPLES {
        for x in &mut sample {
            *x = v[(rng.next_u64() % v.len() as u64) as usize];
        }
        let (_, nth, _) = sample.select_nth_unstable_by(rank, f64::total_cmp);
        stats.push(*nth);
    }
    stats.sort_by(f64::total_cmp);
    [pct(&stats, 2.5), pct(&stats, 97.5)]
}

/// Nearest-rank percentile of sorted values.
fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Dist {
    /// From samples in seconds.
    pub fn of_seconds(mut v: Vec<f64>) -> Self {
        for x in &mut v {
            *x *= 1000.0;
        }
        v.sort_by(f64::total_cmp);
        let mean = if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
        Self {
            count: v.len(),
            mean,
            median: pct(&v, 50.0),
            p90: pct(&v, 90.0),
            p95: pct(&v, 95.0),
            p99: pct(&v, 99.0),
            p999: pct(&v, 99.9),
            median_ci95: bootstrap(&v, 50.0),
            p99_ci95: bootstrap(&v, 99.0),
        }
    }
}

/// The run's aggregates.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Requests that completed.
    pub completed: usize,
    /// Requests that failed (errors, timeouts), rejections excluded.
    pub failed: usize,
    /// Requests refused by admission.
    pub rejected: usize,
    /// Seconds from the first scheduled send to the last response end.
    pub duration: f64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Prompt tokens of completed requests per second.
    pub input_throughput: f64,
    /// Output tokens of completed requests per second.
    pub output_throughput: f64,
    /// Both per second.
    pub total_token_throughput: f64,
    /// Time to first token.
    pub ttft_ms: Dist,
    /// Time per output token (requests with more than one token).
    pub tpot_ms: Dist,
    /// Every gap between token-carrying events.
    pub itl_ms: Dist,
    /// End to end.
    pub e2el_ms: Dist,
    /// How late sends were against the schedule.
    pub send_lateness_ms: Dist,
    /// Failed requests / all requests.
    pub error_rate: f64,
    /// Rejected requests / all requests.
    pub rejection_rate: f64,
    /// Requests the client gave up on (timeout) / all requests.
    pub timeout_rate: f64,
    /// Good requests per second.
    pub request_goodput: f64,
    /// Output tokens of good requests per second.
    pub output_goodput: f64,
    /// Good requests / all requests (failed and rejected included).
    pub slo_attainment: f64,
    /// The thresholds used.
    pub slo: Slo,
    /// Little's law: mean requests in flight measured over the window...
    pub mean_in_flight: f64,
    /// ...and offered rate x mean latency; far apart means a measurement problem.
    pub littles_law_estimate: f64,
    /// Prompt tokens the server's prefix cache served over all prompt tokens of the completed
    /// requests (NaN without any).
    pub prefix_hit_rate: f64,
}

/// Aggregates `outcomes` of a run offered at `offered_rate` requests per second.
pub fn summarize(outcomes: &[Outcome], offered_rate: f64, slo: Slo) -> Summary {
    let start = outcomes.iter().map(|o| o.scheduled_s).fold(f64::INFINITY, f64::min);
    let end = outcomes.iter().map(|o| o.scheduled_s + o.end_s).fold(f64::NEG_INFINITY, f64::max);
    let duration = if outcomes.is_empty() { 0.0 } else { (end - start).max(1e-9) };
    let done: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
    let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };
    let input: u64 = done.iter().map(|o| o.input_len).sum();
    let cached: u64 = done.iter().map(|o| o.cached_len.min(o.input_len)).sum();
    let output: u64 = done.iter().map(|o| o.output_len).sum();
    let good = outcomes.iter().filter(|o| slo.good(o)).count();
    let good_tokens: u64 = outcomes.iter().filter(|o| slo.good(o)).map(|o| o.output_len).sum();
    let share = |n: usize| if outcomes.is_empty() { 0.0 } else { n as f64 / outcomes.len() as f64 };
    let failed = outcomes.iter().filter(|o| !o.ok && !o.rejected).count();
    let busy: f64 = outcomes.iter().map(|o| o.end_s).sum();
    let mean_e2e = if outcomes.is_empty() { 0.0 } else { busy / outcomes.len() as f64 };
    Summary {
        completed: done.len(),
        failed,
        rejected: outcomes.iter().filter(|o| o.rejected).count(),
        duration,
        request_throughput: per_s(done.len() as f64),
        input_throughput: per_s(input as f64),
        output_throughput: per_s(output as f64),
        total_token_throughput: per_s((input + output) as f64),
        ttft_ms: Dist::of_seconds(done.iter().filter_map(|o| o.ttft()).collect()),
        tpot_ms: Dist::of_seconds(done.iter().filter_map(|o| o.tpot()).collect()),
        itl_ms: Dist::of_seconds(done.iter().flat_map(|o| o.itls()).map(|g| g.0).collect()),
        e2el_ms: Dist::of_seconds(done.iter().map(|o| o.end_s).collect()),
        send_lateness_ms: Dist::of_seconds(outcomes.iter().map(|o| o.lateness_s).collect()),
        error_rate: share(failed),
        rejection_rate: share(outcomes.iter().filter(|o| o.rejected).count()),
        timeout_rate: share(outcomes.iter().filter(|o| o.timed_out).count()),
        request_goodput: per_s(good as f64),
        output_goodput: per_s(good_tokens as f64),
        slo_attainment: share(good),
        slo,
        mean_in_flight: per_s(busy),
        littles_law_estimate: offered_rate * mean_e2e,
        prefix_hit_rate: if input > 0 { cached as f64 / input as f64 } else { f64::NAN },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(at: f64, events: &[(f64, u64)], end: f64) -> Outcome {
        Outcome {
            scheduled_s: at,
            ok: true,
            input_len: 10,
            output_len: events.iter().map(|e| e.1).sum(),
            events: TokenEvents(events.to_vec()),
            end_s: end,
            ..Outcome::default()
        }
    }

    #[test]
    fn per_request_metrics_follow_the_definitions() {
        // Tokens at 100 ms (1), 120 ms (1) and a chunk of 3 at 180 ms: O = 5.
        let o = streamed(0.0, &[(0.1, 1), (0.12, 1), (0.18, 3)], 0.2);
        assert_eq!(o.ttft(), Some(0.1));
        let tpot = o.tpot().unwrap_or_default();
        assert!((tpot - 0.02).abs() < 1e-12, "{tpot}");
        let itl: Vec<(f64, u64)> = o.itls();
        assert_eq!(itl.len(), 2, "a chunk of 3 tokens is one gap");
        assert!((itl[0].0 - 0.02).abs() < 1e-12 && (itl[1].0 - 0.06).abs() < 1e-12);
        assert_eq!(itl[1].1, 3);
        // E2E = TTFT + (O - 1) TPOT when the last token ends the response.
        let e2e = o.ttft().unwrap_or_default() + 4.0 * tpot;
        assert!((e2e - 0.18).abs() < 1e-12);
    }

    #[test]
    fn single_token_responses_have_no_tpot_and_stay_out_of_its_aggregate() {
        let one = streamed(0.0, &[(0.05, 1)], 0.05);
        assert_eq!(one.tpot(), None);
        let two = streamed(0.0, &[(0.1, 1), (0.13, 1)], 0.13);
        let s = summarize(&[one, two], 1.0, Slo::default());
        assert_eq!(s.tpot_ms.count, 1);
        assert!((s.tpot_ms.mean - 30.0).abs() < 1e-9);
        assert_eq!(s.ttft_ms.count, 2);
    }

    #[test]
    fn failures_and_rejections_count_against_attainment() {
        let good = |t: f64| streamed(t, &[(0.1, 1), (0.2, 1)], 0.2);
        let slow = streamed(3.0, &[(2.0, 1), (2.1, 1)], 2.1);
        let failed = Outcome {
            scheduled_s: 4.0,
            error: Some("timeout".into()),
            end_s: 1.0,
            ..Outcome::default()
        };
        let rejected =
            Outcome { scheduled_s: 4.5, rejected: true, end_s: 0.01, ..Outcome::default() };
        let all = [good(0.0), good(1.0), good(2.0), slow, failed, rejected];
        let slo = Slo { ttft_ms: Some(500.0), tpot_ms: Some(150.0), e2el_ms: None };
        let s = summarize(&all, 1.0, slo);
        assert_eq!((s.completed, s.failed, s.rejected), (4, 1, 1));
        assert!((s.slo_attainment - 0.5).abs() < 1e-12, "3 good of 6: {}", s.slo_attainment);
        assert!((s.duration - 5.1).abs() < 1e-9, "{}", s.duration);
        assert!((s.request_goodput - 3.0 / 5.1).abs() < 1e-9);
        assert!((s.output_throughput - 8.0 / 5.1).abs() < 1e-9);
    }

    #[test]
    fn bootstrap_intervals_bracket_the_estimate_and_narrow_with_samples() {
        let mut rng = crate::arrivals::Rng::new(3);
        let small: Vec<f64> = (0..100).map(|_| rng.uniform()).collect();
        let large: Vec<f64> = (0..10_000).map(|_| rng.uniform()).collect();
        let (a, b) = (Dist::of_seconds(small), Dist::of_seconds(large));
        for d in [&a, &b] {
            assert!(d.median_ci95[0] <= d.median && d.median <= d.median_ci95[1], "{d:?}");
            assert!(d.p99_ci95[0] <= d.p99 && d.p99 <= d.p99_ci95[1], "{d:?}");
        }
        let width = |d: &Dist| d.median_ci95[1] - d.median_ci95[0];
        assert!(width(&b) < width(&a) / 4.0, "{} vs {}", width(&b), width(&a));
        // Uniform(0, 1 s): the true median 500 ms lies in the large sample's interval.
        assert!(b.median_ci95[0] < 500.0 && 500.0 < b.median_ci95[1], "{b:?}");
    }

    #[test]
    fn littles_law_on_the_seeds_worked_example() {
        // 20 requests per second, each taking 4 s: about 80 in flight (over a window long
        // enough that the ramp-up and the tail are small).
        let outcomes: Vec<Outcome> =
            (0..20_000).map(|i| streamed(i as f64 / 20.0, &[(0.5, 1), (4.0, 1)], 4.0)).collect();
        let s = summarize(&outcomes, 20.0, Slo::default());
        assert!((s.littles_law_estimate - 80.0).abs() < 1e-9);
        assert!((s.mean_in_flight - 80.0).abs() / 80.0 < 0.01, "{}", s.mean_in_flight);
        assert!((s.request_throughput - 20.0).abs() / 20.0 < 0.01);
    }
}
