//! `sluice bench sweep`: the highest sustained arrival rate at which SLO attainment meets a
//! target (DistServe's capacity). The rate doubles from a start until a point misses the
//! target (which also stops it early once the server is over-saturated), then bisects between
//! the last good and the first bad rate; every point is repeated and judged by its median
//! attainment. Reports the capacity, the whole curve and its knee, as JSON, Markdown and SVG.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};
use sluice_bench::svg::{Series, line_chart};

use crate::bench_serve::{BenchServeArgs, measure, parse_slo};

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

/// One rate's runs, summarized.
#[derive(Clone, Debug)]
struct Point {
    rate: f64,
    runs: Vec<Value>,
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
    fn stat(&self, key: &str) -> f64 {
        median(self.runs.iter().filter_map(|r| r[key].as_f64()).collect())
    }

    fn json(&self) -> Value {
        let mut v = json!({"rate": self.rate, "runs": self.runs.len()});
        for k in [
            "slo_attainment",
            "request_throughput",
            "output_throughput",
            "request_goodput",
            "output_goodput",
            "rejection_rate",
            "error_rate",
            "median_ttft_ms",
            "p99_ttft_ms",
            "median_tpot_ms",
            "p99_tpot_ms",
            "median_e2el_ms",
            "p99_e2el_ms",
        ] {
            v[k] = json!(self.stat(k));
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
        if p.stat("slo_attainment") >= target {
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
    let base = sorted.first()?.stat("median_ttft_ms");
    let mut last = None;
    for p in sorted {
        let saturated = p.stat("request_throughput") < 0.8 * p.rate
            || (base.is_finite() && p.stat("median_ttft_ms") > 2.0 * base.max(1.0));
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
            runs.push(run.result);
        }
        let p = Point { rate, runs };
        let att = p.stat("slo_attainment");
        println!(
            "rate {rate:>8.2} req/s: attainment {att:.3}, throughput {:.2} req/s, goodput {:.2} req/s, TTFT p50 {:.1} ms, TPOT p50 {:.1} ms",
            p.stat("request_throughput"),
            p.stat("request_goodput"),
            p.stat("median_ttft_ms"),
            p.stat("median_tpot_ms"),
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
    let series = |pairs: &[(&str, &str)]| -> Vec<Series> {
        pairs
            .iter()
            .map(|(name, key)| Series {
                name: (*name).to_owned(),
                points: points.iter().map(|p| (p.rate, p.stat(key))).collect(),
            })
            .collect()
    };
    let offered = Series {
        name: "offered".into(),
        points: points.iter().map(|p| (p.rate, p.rate)).collect(),
    };
    let mut tput = series(&[("achieved", "request_throughput"), ("goodput", "request_goodput")]);
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
                    ("TTFT p50", "median_ttft_ms"),
                    ("TTFT p99", "p99_ttft_ms"),
                    ("TPOT p50", "median_tpot_ms"),
                    ("TPOT p99", "p99_tpot_ms"),
                ]),
            ),
        ),
        (
            "attainment.svg",
            line_chart(
                "SLO attainment",
                "offered rate (req/s)",
                "fraction within SLO",
                &series(&[("attainment", "slo_attainment")]),
            ),
        ),
        (
            "goodput.svg",
            line_chart(
                "Goodput",
                "offered rate (req/s)",
                "output tokens/s",
                &series(&[("output goodput", "output_goodput"), ("output", "output_throughput")]),
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
            p.stat("slo_attainment"),
            p.stat("request_throughput"),
            p.stat("request_goodput"),
            p.stat("output_throughput"),
            p.stat("median_ttft_ms"),
            p.stat("p99_ttft_ms"),
            p.stat("median_tpot_ms"),
            p.stat("p99_tpot_ms"),
            p.stat("rejection_rate"),
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
        Point {
            rate,
            runs: vec![json!({"slo_attainment": attainment, "request_throughput": tput,
                "median_ttft_ms": ttft})],
        }
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
