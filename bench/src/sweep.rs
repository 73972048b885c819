//! `sluice bench sweep`: the highest sustained arrival rate at which SLO attainment meets a
//! target (DistServe's capacity). The rate doubles from a start until a point misses the
//! target (which also stops it early once the server is over-saturated), then bisects between
//! the last good and the first bad rate; every point is repeated and judged by its median
//! attainment. Reports the capacity, the whole curve and its knee, as JSON, Markdown and SVG.

use std::path::PathBuf;

use crate::svg::{Series, line_chart};
use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};

use crate::metrics::Summary;
use crate::serve::{BenchServeArgs, measure, parse_slo};

/// `sluice bench sweep`.
#[derive(Args, Debug)]
pub struct BenchSweepArgs {
    #[command(flatten)]
    serve: BenchServeArgs,
    /// Attainment a rate must reach (fraction of all requests within the --goodput SLO).
    #[arg(long, default_value_t = 0.9)]
    target: f64,
    /// First rate tried, requests per second.
    #[arg(long, default_value_t = 1.0)]
    start_rate: f64,
    /// Highest rate tried.
    #[arg(long, default_value_t = 256.0)]
    max_rate: f64,
    /// Runs per rate; a rate is judged by their median attainment.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Bisection steps between the last good and the first bad rate.
    #[arg(long, default_value_t = 4)]
    bisect: usize,
    /// Directory for sweep.json, sweep.md and the plots.
    #[arg(long, default_value = "sweep")]
    out: PathBuf,
}

/// A figure of a run, as `sweep.json` names it.
#[derive(Clone, Copy, Debug)]
enum Stat {
    Attainment,
    RequestThroughput,
    OutputThroughput,
    RequestGoodput,
    OutputGoodput,
    RejectionRate,
    ErrorRate,
    TtftP50,
    TtftP99,
    TpotP50,
    TpotP99,
    E2elP50,
    E2elP99,
}

impl Stat {
    const ALL: [Stat; 13] = [
        Stat::Attainment,
        Stat::RequestThroughput,
        Stat::OutputThroughput,
        Stat::RequestGoodput,
        Stat::OutputGoodput,
        Stat::RejectionRate,
        Stat::ErrorRate,
        Stat::TtftP50,
        Stat::TtftP99,
        Stat::TpotP50,
        Stat::TpotP99,
        Stat::E2elP50,
        Stat::E2elP99,
    ];

    fn key(self) -> &'static str {
        match self {
            Stat::Attainment => "slo_attainment",
            Stat::RequestThroughput => "request_throughput",
            Stat::OutputThroughput => "output_throughput",
            Stat::RequestGoodput => "request_goodput",
            Stat::OutputGoodput => "output_goodput",
            Stat::RejectionRate => "rejection_rate",
            Stat::ErrorRate => "error_rate",
            Stat::TtftP50 => "median_ttft_ms",
            Stat::TtftP99 => "p99_ttft_ms",
            Stat::TpotP50 => "median_tpot_ms",
            Stat::TpotP99 => "p99_tpot_ms",
            Stat::E2elP50 => "median_e2el_ms",
            Stat::E2elP99 => "p99_e2el_ms",
        }
    }

    fn of(self, s: &Summary) -> f64 {
        match self {
            Stat::Attainment => s.slo_attainment,
            Stat::RequestThroughput => s.request_throughput,
            Stat::OutputThroughput => s.output_throughput,
            Stat::RequestGoodput => s.request_goodput,
            Stat::OutputGoodput => s.output_goodput,
            Stat::RejectionRate => s.rejection_rate,
            Stat::ErrorRate => s.error_rate,
            Stat::TtftP50 => s.ttft_ms.median,
            Stat::TtftP99 => s.ttft_ms.p99,
            Stat::TpotP50 => s.tpot_ms.median,
            Stat::TpotP99 => s.tpot_ms.p99,
            Stat::E2elP50 => s.e2el_ms.median,
            Stat::E2elP99 => s.e2el_ms.p99,
        }
    }
}

/// One rate's runs, summarized.
#[derive(Clone, Debug)]
struct Point {
    rate: f64,
    runs: Vec<Summary>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

impl Point {
    /// The median of `stat` over the point's runs.
    fn stat(&self, stat: Stat) -> f64 {
        median(self.runs.iter().map(|r| stat.of(r)).collect())
    }

    fn json(&self) -> Value {
        let mut v = json!({"rate": self.rate, "runs": self.runs.len()});
        for stat in Stat::ALL {
            v[stat.key()] = json!(self.stat(stat));
        }
        v
    }
}

/// The capacity: the highest tested rate such that every tested rate up to it met the target
/// (noise above a failure does not count). 0 when even the lowest failed.
fn capacity(points: &[Point], target: f64) -> f64 {
    let mut sorted: Vec<&Point> = points.iter().collect();
    sorted.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let mut cap = 0.0;
    for p in sorted {
        if p.stat(Stat::Attainment) >= target {
            cap = p.rate;
        } else {
            break;
        }
    }
    cap
}

/// The knee: the last tested rate before the server stops keeping up, i.e. before median
/// TTFT exceeds twice the lowest rate's or achieved throughput falls under 80% of the offered
/// rate (short windows of random arrivals miss the nominal rate by 10-15% on their own).
fn knee(points: &[Point]) -> Option<f64> {
    let mut sorted: Vec<&Point> = points.iter().collect();
    sorted.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let base = sorted.first()?.stat(Stat::TtftP50);
    let mut last = None;
    for p in sorted {
        let saturated = p.stat(Stat::RequestThroughput) < 0.8 * p.rate
            || (base.is_finite() && p.stat(Stat::TtftP50) > 2.0 * base.max(1.0));
        if saturated {
            break;
        }
        last = Some(p.rate);
    }
    last
}

/// Runs `sluice bench sweep`.
pub fn run_bench_sweep(args: BenchSweepArgs) -> anyhow::Result<()> {
    if args.serve.goodput.is_none() {
        bail!(
            "--goodput is required: the sweep looks for the rate meeting an SLO (e.g. ttft:500,tpot:50)"
        );
    }
    parse_slo(args.serve.goodput.as_deref())?;
    if !(0.0 < args.target && args.target <= 1.0) {
        bail!("--target must be in (0, 1]");
    }
    if !(args.start_rate > 0.0 && args.start_rate.is_finite() && args.max_rate >= args.start_rate) {
        bail!("--start-rate must be positive and at most --max-rate");
    }
    if args.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    if args.serve.mix.is_some() {
        bail!(
            "--mix: a sweep varies one offered rate; run the mix with bench serve at chosen rates"
        );
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("--out: creating {}", args.out.display()))?;
    // The gateway's records are not read per point.
    let mut base = args.serve.clone();
    base.records_url = None;
    let mut points: Vec<Point> = Vec::new();
    let run_point = |rate: f64, points: &mut Vec<Point>| -> anyhow::Result<f64> {
        let mut runs = Vec::new();
        for k in 0..args.repeats {
            let mut a = base.clone();
            a.request_rate = rate;
            a.seed = base.seed.wrapping_add(k as u64).wrapping_add((rate * 1000.0) as u64);
            let run = measure(&a, true)?;
            runs.push(run.summary);
        }
        let p = Point { rate, runs };
        let att = p.stat(Stat::Attainment);
        println!(
            "rate {rate:>8.2} req/s: attainment {att:.3}, throughput {:.2} req/s, goodput {:.2} req/s, TTFT p50 {:.1} ms, TPOT p50 {:.1} ms",
            p.stat(Stat::RequestThroughput),
            p.stat(Stat::RequestGoodput),
            p.stat(Stat::TtftP50),
            p.stat(Stat::TpotP50),
        );
        points.push(p);
        Ok(att)
    };
    // Doubling until a rate misses the target (or the ceiling).
    let (mut good, mut bad) = (None::<f64>, None::<f64>);
    let mut rate = args.start_rate;
    loop {
        if run_point(rate, &mut points)? >= args.target {
            good = Some(rate);
            if rate >= args.max_rate {
                break;
            }
            rate = (rate * 2.0).min(args.max_rate);
        } else {
            bad = Some(rate);
            break;
        }
    }
    // Bisection between the last good and the first bad rate.
    if let (Some(mut lo), Some(mut hi)) = (good, bad) {
        for _ in 0..args.bisect {
            let mid = (lo + hi) / 2.0;
            if run_point(mid, &mut points)? >= args.target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
    }
    points.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let cap = capacity(&points, args.target);
    let knee = knee(&points);
    let curve: Vec<Value> = points.iter().map(Point::json).collect();
    let result = json!({
        "target_attainment": args.target, "goodput_slo": args.serve.goodput,
        "repeats": args.repeats, "capacity_rps": cap, "knee_rps": knee,
        "capacity_is_ceiling": bad.is_none(), "points": curve,
    });
    std::fs::write(args.out.join("sweep.json"), serde_json::to_string_pretty(&result)?)?;
    let series = |pairs: &[(&str, Stat)]| -> Vec<Series> {
        pairs
            .iter()
            .map(|(name, stat)| Series {
                name: (*name).to_owned(),
                points: points.iter().map(|p| (p.rate, p.stat(*stat))).collect(),
            })
            .collect()
    };
    let offered = Series {
        name: "offered".into(),
        points: points.iter().map(|p| (p.rate, p.rate)).collect(),
    };
    let mut tput =
        series(&[("achieved", Stat::RequestThroughput), ("goodput", Stat::RequestGoodput)]);
    tput.push(offered);
    let plots = [
        ("throughput.svg", line_chart("Throughput", "offered rate (req/s)", "req/s", &tput)),
        (
            "latency.svg",
            line_chart(
                "Latency percentiles",
                "offered rate (req/s)",
                "ms",
                &series(&[
                    ("TTFT p50", Stat::TtftP50),
                    ("TTFT p99", Stat::TtftP99),
                    ("TPOT p50", Stat::TpotP50),
                    ("TPOT p99", Stat::TpotP99),
                ]),
            ),
        ),
        (
            "attainment.svg",
            line_chart(
                "SLO attainment",
                "offered rate (req/s)",
                "fraction within SLO",
                &series(&[("attainment", Stat::Attainment)]),
            ),
        ),
        (
            "goodput.svg",
            line_chart(
                "Goodput",
                "offered rate (req/s)",
                "output tokens/s",
                &series(&[
                    ("output goodput", Stat::OutputGoodput),
                    ("output", Stat::OutputThroughput),
                ]),
            ),
        ),
    ];
    for (name, svg) in &plots {
        std::fs::write(args.out.join(name), svg)?;
    }
    let mut md = format!(
        "# sluice bench sweep\n\nTarget: {:.0}% of requests within `{}` (failed, timed-out and rejected requests count against it); {} run(s) per rate, judged by the median.\n\n\
         **Capacity: {cap:.2} req/s**{}. Knee (last rate before median TTFT doubles or throughput falls under 80% of offered): {}.\n\n\
         | offered (req/s) | attainment | achieved (req/s) | goodput (req/s) | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | rejected |\n|---|---|---|---|---|---|---|---|\n",
        args.target * 100.0,
        args.serve.goodput.as_deref().unwrap_or(""),
        args.repeats,
        if bad.is_none() {
            " (the ceiling --max-rate; the real capacity may be higher)"
        } else {
            ""
        },
        knee.map_or("none (saturated from the start)".to_owned(), |k| format!("{k:.2} req/s")),
    );
    for p in &points {
        md.push_str(&format!(
            "| {:.2} | {:.3} | {:.2} | {:.2} | {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {:.3} |\n",
            p.rate,
            p.stat(Stat::Attainment),
            p.stat(Stat::RequestThroughput),
            p.stat(Stat::RequestGoodput),
            p.stat(Stat::OutputThroughput),
            p.stat(Stat::TtftP50),
            p.stat(Stat::TtftP99),
            p.stat(Stat::TpotP50),
            p.stat(Stat::TpotP99),
            p.stat(Stat::RejectionRate),
        ));
    }
    md.push_str("\n![throughput](throughput.svg)\n![latency](latency.svg)\n![attainment](attainment.svg)\n![goodput](goodput.svg)\n");
    std::fs::write(args.out.join("sweep.md"), md)?;
    println!(
        "capacity {cap:.2} req/s at {:.0}% attainment{}; knee {}; results in {}",
        args.target * 100.0,
        if bad.is_none() { " (ceiling reached)" } else { "" },
        knee.map_or("none".into(), |k| format!("{k:.2} req/s")),
        args.out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(rate: f64, attainment: f64, tput: f64, ttft: f64) -> Point {
        let mut s =
            Summary { slo_attainment: attainment, request_throughput: tput, ..Summary::default() };
        s.ttft_ms.median = ttft;
        Point { rate, runs: vec![s] }
    }

    #[test]
    fn capacity_stops_at_the_first_miss_and_the_knee_at_saturation() {
        let pts = [
            point(1.0, 1.0, 1.0, 50.0),
            point(2.0, 0.97, 2.0, 55.0),
            point(4.0, 0.95, 3.5, 90.0),
            point(8.0, 0.5, 7.0, 900.0),
            // Noise above a miss does not raise the capacity.
            point(16.0, 0.92, 5.0, 2000.0),
        ];
        assert_eq!(capacity(&pts, 0.9), 4.0);
        assert_eq!(capacity(&pts, 0.99), 1.0);
        assert_eq!(capacity(&pts[3..4], 0.9), 0.0);
        assert_eq!(knee(&pts), Some(4.0));
        assert_eq!(median(vec![3.0, 1.0, 2.0, f64::NAN]), 2.0);
    }
}
