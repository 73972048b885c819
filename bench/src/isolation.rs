//! `sluice bench isolation`: what one tenant's load does to another's. Each tenant of a mix
//! runs alone, then all run together, against the same target in one run, each tenant with the
//! same schedule and requests both times; per tenant the ratios mixed / alone of TTFT p50 and
//! p99, TPOT p50 and p99 and SLO attainment, its share of the tokens served together, and how
//! much of the capacity the others left it got. With `--fcfs-url` (a second target whose
//! engines schedule first come, first served: `sluice up --scheduling fcfs`) the mix runs
//! there too, and the aggregate throughput of the target's policy is set against FCFS's.
//! `--rounds N` repeats the comparison, every second round in the other order, and reports
//! the medians of the per-round ratios.

use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};

use crate::metrics::Summary;
use crate::scenario;
use crate::serve::{BenchServeArgs, brief, brief_line, measure_tenants, parse_slo, tenant_names};

/// `sluice bench isolation`.
#[derive(Args, Debug, Clone)]
pub struct BenchIsolationArgs {
    /// The load: `--mix` with at least two tenants (or `--scenario`), and the usual `bench
    /// serve` flags.
    #[command(flatten)]
    serve: BenchServeArgs,
    /// Named scenarios instead of a mix, each judged against its targets with PASS or FAIL:
    /// decode-flood, prefill-flood, priority-flood, three-tenants, shared-prefix (the prefix
    /// cache's hit rate under contention), equal-floods, weighted-floods (2:1 by the
    /// tenants' own weights), two-gateways (its second gateway is --failover-url), or all (comma-separated, repeatable). Each
    /// runs --duration seconds (60 when not given) per phase, with the SLO of --goodput
    /// (ttft:1000,tpot:100, the standard tier's targets, when not given).
    #[arg(long, value_name = "NAME")]
    scenario: Vec<String>,
    /// The admin API where the scenarios' tenants (`iso-ROLE`) are created and issued keys
    /// for the run (revoked at its end, or on Ctrl-C or SIGTERM); without it their keys are
    /// read from `SLUICE_KEY_ROLE` (`SLUICE_KEY_PREFILL_FLOOD`).
    #[arg(long, env = "SLUICE_ADMIN_URL")]
    admin_url: Option<String>,
    /// An ops token for --admin-url.
    #[arg(long, env = "SLUICE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// With --scenario and --fcfs-url: the FCFS platform's admin API and ops token, where the
    /// same tenants are created there.
    #[arg(long, requires = "fcfs_url")]
    fcfs_admin_url: Option<String>,
    #[arg(long, requires = "fcfs_admin_url", hide_env_values = true)]
    fcfs_admin_token: Option<String>,
    /// The FCFS target's mix in memory (a scenario's).
    #[arg(skip)]
    fcfs_entries: Option<(String, Vec<Value>)>,
    /// Where this comparison's prompt salts start (each phase of each round has its own).
    #[arg(skip)]
    salt_base: u64,
    /// A second target whose engines schedule FCFS: the mix runs there too, for the aggregate
    /// throughput of the first target's policy against FCFS in the same run.
    #[arg(long)]
    fcfs_url: Option<String>,
    /// The mix for `--fcfs-url`, when its keys differ (the same tenants, in the same order).
    #[arg(long, requires = "fcfs_url")]
    fcfs_mix: Option<std::path::PathBuf>,
    /// Rounds of the whole comparison; every second one runs the mix first and the tenants
    /// alone after, so a machine drifting over a round's minutes weighs on both sides of the
    /// ratios alike. With more than one, the medians of the per-round ratios are reported.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
}

/// One tenant's figures: alone, together, and together under FCFS.
#[derive(Debug)]
struct TenantFigures {
    name: String,
    alone: Summary,
    mixed: Summary,
    fcfs: Option<Summary>,
}

/// `mixed / alone`, or NaN when either is not a number or the base is zero.
fn ratio(mixed: f64, alone: f64) -> f64 {
    if mixed.is_finite() && alone.is_finite() && alone != 0.0 { mixed / alone } else { f64::NAN }
}

/// Tokens per second the tenant was served, prompt and output alike: a flood of long
/// prompts is served its prompts (counting output alone, its capacity would look like a
/// trickle beside a quiet tenant's answers).
fn served(s: &Summary) -> f64 {
    s.total_token_throughput
}

/// A tenant's figures together over alone (NaN, written as null, where undefined).
#[derive(Clone, Copy, Debug, serde::Serialize)]
struct Ratios {
    ttft_p50: f64,
    ttft_p99: f64,
    tpot_p50: f64,
    tpot_p99: f64,
    attainment: f64,
}

impl TenantFigures {
    fn ratios(&self) -> Ratios {
        let (a, m) = (&self.alone, &self.mixed);
        Ratios {
            ttft_p50: ratio(m.ttft_ms.median, a.ttft_ms.median),
            ttft_p99: ratio(m.ttft_ms.p99, a.ttft_ms.p99),
            tpot_p50: ratio(m.tpot_ms.median, a.tpot_ms.median),
            tpot_p99: ratio(m.tpot_ms.p99, a.tpot_ms.p99),
            attainment: ratio(m.slo_attainment, a.slo_attainment),
        }
    }
}

/// Each tenant's share of the tokens served together, and for the tenant that was
/// served the most alone (the one that shows the target's capacity, as far as this load can)
/// what it got of the capacity the others left it: that capacity less what the others were
/// served together. NaN for the other tenants: their demand, not the capacity, bounds them.
fn shares(figures: &[TenantFigures]) -> Vec<(f64, f64)> {
    let total: f64 = figures.iter().map(|f| served(&f.mixed)).sum();
    let capacity = figures.iter().map(|f| served(&f.alone)).fold(0.0, f64::max);
    figures
        .iter()
        .map(|f| {
            let others = total - served(&f.mixed);
            let left = (capacity - others).max(0.0);
            let saturating = served(&f.alone) == capacity;
            let of_left = if saturating { ratio(served(&f.mixed), left) } else { f64::NAN };
            (ratio(served(&f.mixed), total), of_left)
        })
        .collect()
}

/// One round: every tenant alone, the mix together, and the mix under FCFS.
struct Round {
    figures: Vec<TenantFigures>,
    /// Aggregate output throughput together, and under FCFS.
    throughput: f64,
    fcfs_throughput: Option<f64>,
    result: Value,
}

impl Round {
    /// The target's aggregate throughput over FCFS's (NaN without FCFS).
    fn over_fcfs(&self) -> f64 {
        self.fcfs_throughput.map_or(f64::NAN, |f| ratio(self.throughput, f))
    }
}

/// Runs `sluice bench isolation`.
pub fn run_bench_isolation(args: BenchIsolationArgs) -> anyhow::Result<()> {
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    // Each phase's prompts get a first token of their own: the same requests alone and
    // together, but never a prefix-cache hit on another phase's (or an earlier run's).
    let mut args = args;
    args.salt_base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() % 1_000_000)
        * 7_919;
    let args = args;
    let result = if args.scenario.is_empty() {
        if args.serve.mix.is_none() {
            bail!("--mix (or --scenario) is required: isolation is measured between tenants");
        }
        let (rounds, names) = rounds(&args)?;
        let mut result = match rounds.as_slice() {
            [one] => one.result.clone(),
            all => json!({"rounds": all.iter().map(|r| r.result.clone()).collect::<Vec<_>>()}),
        };
        if rounds.len() > 1 {
            result["median"] = report_medians(&names, &rounds);
        }
        result
    } else {
        run_scenarios(&args)?
    };
    if let Some(path) = &args.serve.save_result {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("result written to {}", path.display());
    }
    Ok(())
}

/// Every round of the comparison, and the tenants' names.
fn rounds(args: &BenchIsolationArgs) -> anyhow::Result<(Vec<Round>, Vec<String>)> {
    let names = tenant_names(&args.serve)?;
    if names.len() < 2 {
        bail!("the mix lists {} tenant(s); isolation needs at least two", names.len());
    }
    let mut rounds = Vec::new();
    for r in 0..args.rounds {
        if args.rounds > 1 {
            println!("round {} of {} ...", r + 1, args.rounds);
        }
        let mut a = args.clone();
        a.salt_base = args.salt_base + 100 * r as u64;
        rounds.push(round(&a, &names, r % 2 == 1)?);
    }
    Ok((rounds, names))
}

/// Runs the named scenarios, each judged against its targets; the keys issued for them are
/// revoked at the end, whatever happened.
fn run_scenarios(args: &BenchIsolationArgs) -> anyhow::Result<Value> {
    let scenarios = scenario::chosen(&args.scenario)?;
    if scenarios.is_empty() {
        bail!("--scenario names no scenario");
    }
    if args.serve.mix.is_some() {
        bail!("--scenario and --mix: a scenario brings its own mix");
    }
    if scenarios.iter().any(|s| s.two_gateways) && args.serve.failover_urls.is_empty() {
        bail!("scenario two-gateways needs a second gateway of the platform: --failover-url");
    }
    let admin = |url: &Option<String>, token: &Option<String>, what: &str| match (url, token) {
        (Some(url), Some(token)) => {
            Ok(Some(scenario::Admin { url: url.clone(), token: token.clone() }))
        }
        (Some(_), None) => bail!("{what} needs its ops token"),
        _ => Ok(None),
    };
    let ours = admin(&args.admin_url, &args.admin_token, "--admin-url (SLUICE_ADMIN_URL)")?;
    let keys = scenario::Keys::for_scenarios(&scenarios, ours)?;
    let fcfs_keys = match &args.fcfs_url {
        Some(_) => {
            let theirs = admin(&args.fcfs_admin_url, &args.fcfs_admin_token, "--fcfs-admin-url")?;
            let Some(theirs) = theirs else {
                keys.revoke();
                bail!("--scenario with --fcfs-url needs --fcfs-admin-url and --fcfs-admin-token");
            };
            match scenario::Keys::for_scenarios(&scenarios, Some(theirs)) {
                Ok(k) => Some(k),
                Err(e) => {
                    keys.revoke();
                    return Err(e);
                }
            }
        }
        None => None,
    };
    scenario::Keys::revoke_on_interrupt(
        std::iter::once(keys.clone()).chain(fcfs_keys.clone()).collect(),
    );
    let result = scenarios_with(args, &scenarios, &keys, fcfs_keys.as_ref());
    keys.revoke();
    if let Some(k) = &fcfs_keys {
        k.revoke();
    }
    result
}

/// Each scenario's rounds and checks, then every verdict together.
fn scenarios_with(
    args: &BenchIsolationArgs,
    scenarios: &[scenario::Scenario],
    keys: &scenario::Keys,
    fcfs_keys: Option<&scenario::Keys>,
) -> anyhow::Result<Value> {
    let goodput = args.serve.goodput.clone().unwrap_or_else(|| "ttft:1000,tpot:100".into());
    let slo = parse_slo(Some(&goodput))?;
    let targets = scenario::Targets {
        ttft_ms: slo.ttft_ms.unwrap_or(f64::INFINITY),
        tpot_ms: slo.tpot_ms.unwrap_or(f64::INFINITY),
    };
    let mut done: Vec<(&scenario::Scenario, Vec<scenario::Check>, Value)> = Vec::new();
    for (k, s) in scenarios.iter().enumerate() {
        println!("\n=== scenario {}: {} ===", s.name, s.about);
        let mut a = args.clone();
        a.salt_base = args.salt_base + 1000 * k as u64;
        a.serve.mix_entries = Some((format!("scenario {}", s.name), scenario::mix(s, keys)?));
        a.serve.goodput = Some(goodput.clone());
        a.serve.duration = Some(args.serve.duration.unwrap_or(60.0));
        // Every tenant has its own rate; the command line's (`inf` unless given) is unused.
        a.serve.request_rate = 1.0;
        if !s.two_gateways {
            a.serve.failover_urls.clear();
        }
        if let Some(k) = fcfs_keys {
            a.fcfs_entries = Some((format!("scenario {} (FCFS)", s.name), scenario::mix(s, k)?));
        }
        let (rounds, _) = rounds(&a)?;
        let per_round: Vec<Vec<scenario::Check>> = rounds
            .iter()
            .map(|r| scenario::checks(s, &measured(&r.figures), r.over_fcfs(), targets))
            .collect();
        let mut checks = median_checks(&per_round);
        if s.two_gateways {
            match done.iter().find(|(d, _, _)| d.name == "prefill-flood") {
                Some((_, one, _)) => checks.extend(scenario::against_one_gateway(&checks, one)),
                None => println!(
                    "\n(two-gateways is set against one gateway only when prefill-flood runs \
                     before it in the same command)"
                ),
            }
        }
        println!("\nscenario {}: {}", s.name, verdict(&checks));
        for c in &checks {
            println!("  {}", c.line());
        }
        let result = json!({
            "scenario": scenario::describe(s),
            "rounds": rounds.iter().map(|r| r.result.clone()).collect::<Vec<_>>(),
            "checks": checks.iter().map(|c| json!({
                "what": c.what, "value": num(c.value), "bound": c.bound,
                "at_most": c.at_most, "pass": c.passes(),
            })).collect::<Vec<_>>(),
            "pass": checks.iter().all(scenario::Check::passes),
        });
        done.push((s, checks, result));
    }
    println!("\nscenarios (baselines: each tenant alone, measured in the same run)");
    for (s, checks, _) in &done {
        let failed = checks.iter().filter(|c| !c.passes()).count();
        println!(
            "  {:<15} {}  ({} of {} targets met)",
            s.name,
            verdict(checks),
            checks.len() - failed,
            checks.len()
        );
    }
    Ok(json!({
        "baseline": "each tenant alone, measured in the same run against the same target",
        "goodput_slo": goodput,
        "scenarios": done.into_iter().map(|(_, _, r)| r).collect::<Vec<_>>(),
    }))
}

/// PASS when every check passes.
fn verdict(checks: &[scenario::Check]) -> &'static str {
    if checks.iter().all(scenario::Check::passes) { "PASS" } else { "FAIL" }
}

/// What the scenario checks read of each tenant of one round.
fn measured(figures: &[TenantFigures]) -> Vec<scenario::Measured> {
    figures
        .iter()
        .zip(shares(figures))
        .map(|(f, (share, of_left))| scenario::Measured {
            attainment: f.mixed.slo_attainment,
            ttft_p99_ms: f.mixed.ttft_ms.p99,
            ttft_p99_ratio: f.ratios().ttft_p99,
            tpot_p99_ms: f.mixed.tpot_ms.p99,
            share,
            of_left,
            hit_rate: f.mixed.prefix_hit_rate,
            hit_rate_alone: f.alone.prefix_hit_rate,
        })
        .collect()
}

/// The checks of several rounds as one: each value the median of its rounds'.
fn median_checks(rounds: &[Vec<scenario::Check>]) -> Vec<scenario::Check> {
    let Some(first) = rounds.first() else { return Vec::new() };
    first
        .iter()
        .enumerate()
        .map(|(i, c)| scenario::Check {
            value: median(rounds.iter().filter_map(|r| r.get(i)).map(|c| c.value).collect()),
            ..c.clone()
        })
        .collect()
}

/// The median of the finite values (NaN when there are none).
fn median(mut values: Vec<f64>) -> f64 {
    values.retain(|v| v.is_finite());
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// A tenant's ratios together / alone, its share of the tokens served and, where defined,
/// of the capacity the others left.
fn ratios_line(r: &Ratios, share: f64, left: f64) -> String {
    let left = if left.is_nan() {
        String::new()
    } else {
        format!(", {:.0}% of the capacity the others left", 100.0 * left)
    };
    format!(
        "together / alone: TTFT p50 {:.2}x p99 {:.2}x, TPOT p50 {:.2}x p99 {:.2}x, attainment {:.2}x; {:.0}% of the tokens served{left}",
        r.ttft_p50,
        r.ttft_p99,
        r.tpot_p50,
        r.tpot_p99,
        r.attainment,
        100.0 * share,
    )
}

/// A value as JSON: null where it is not a number.
fn num(v: f64) -> Value {
    if v.is_finite() { json!(v) } else { Value::Null }
}

/// Prints and returns, per tenant, the medians over the rounds of its ratios and shares,
/// and the median of the aggregate throughput over FCFS.
fn report_medians(names: &[String], rounds: &[Round]) -> Value {
    println!("\nmedians over {} rounds", rounds.len());
    let ratios: Vec<Vec<Ratios>> =
        rounds.iter().map(|r| r.figures.iter().map(TenantFigures::ratios).collect()).collect();
    let round_shares: Vec<Vec<(f64, f64)>> = rounds.iter().map(|r| shares(&r.figures)).collect();
    let mut tenants = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let of = |f: &dyn Fn(&Ratios) -> f64| {
            median(ratios.iter().filter_map(|r| r.get(i)).map(f).collect())
        };
        let r = Ratios {
            ttft_p50: of(&|r| r.ttft_p50),
            ttft_p99: of(&|r| r.ttft_p99),
            tpot_p50: of(&|r| r.tpot_p50),
            tpot_p99: of(&|r| r.tpot_p99),
            attainment: of(&|r| r.attainment),
        };
        let share = median(round_shares.iter().filter_map(|s| s.get(i)).map(|s| s.0).collect());
        let left = median(round_shares.iter().filter_map(|s| s.get(i)).map(|s| s.1).collect());
        println!("  {name:<12} {}", ratios_line(&r, share, left));
        tenants.push(json!({
            "name": name,
            "mixed_over_alone": r,
            "share_of_served_tokens": num(share),
            "share_of_capacity_left": num(left),
        }));
    }
    let over_fcfs = median(rounds.iter().map(Round::over_fcfs).collect());
    if over_fcfs.is_finite() {
        let each: Vec<String> = rounds.iter().map(|r| format!("{:.2}", r.over_fcfs())).collect();
        println!("  aggregate throughput / FCFS {over_fcfs:.2} (rounds: {})", each.join(", "));
    }
    json!({"tenants": tenants, "throughput_over_fcfs": num(over_fcfs)})
}

/// One round, printed: the tenants alone then the mix (`mixed_first`: the mix, FCFS's, then
/// the tenants alone, so that over an even number of rounds a machine drifting within a
/// round weighs on both sides of the ratios alike).
fn round(args: &BenchIsolationArgs, names: &[String], mixed_first: bool) -> anyhow::Result<Round> {
    let mut base = args.serve.clone();
    // The gateway's records are not read per phase.
    base.records_url = None;
    let run_alone = || -> anyhow::Result<Vec<Summary>> {
        let mut alone = Vec::new();
        for (i, name) in names.iter().enumerate() {
            println!("{name} alone ...");
            let mut alone_args = base.clone();
            alone_args.prompt_salt = Some(args.salt_base + 2 + i as u64);
            let run = measure_tenants(&alone_args, Some(i), true)
                .with_context(|| format!("running {name} alone"))?;
            println!("  {}", brief_line(&run.summary));
            alone.push(run.summary);
        }
        Ok(alone)
    };
    let run_mixed = || -> anyhow::Result<_> {
        println!("all together ...");
        let mut mixed_args = base.clone();
        mixed_args.prompt_salt = Some(args.salt_base);
        let mixed = measure_tenants(&mixed_args, None, true).context("running the mix")?;
        let fcfs = match &args.fcfs_url {
            Some(url) => {
                println!("all together against the FCFS target {url} ...");
                let mut a = base.clone();
                a.base_url = url.clone();
                a.prompt_salt = Some(args.salt_base + 1);
                if let Some(entries) = &args.fcfs_entries {
                    a.mix_entries = Some(entries.clone());
                }
                if let Some(m) = &args.fcfs_mix {
                    a.mix = Some(m.clone());
                    let theirs = tenant_names(&a)?;
                    if theirs != names {
                        bail!("--fcfs-mix names {theirs:?}, not the tenants of --mix {names:?}");
                    }
                }
                let run = measure_tenants(&a, None, true);
                Some(run.context("running the mix against --fcfs-url")?)
            }
            None => None,
        };
        Ok((mixed, fcfs))
    };
    let (alone, (mixed, fcfs)) = if mixed_first {
        let m = run_mixed()?;
        (run_alone()?, m)
    } else {
        let a = run_alone()?;
        (a, run_mixed()?)
    };
    let figures: Vec<TenantFigures> = names
        .iter()
        .zip(alone)
        .enumerate()
        .map(|(i, (name, alone))| TenantFigures {
            name: name.clone(),
            alone,
            mixed: mixed.per_tenant.get(i).map(|t| t.1.clone()).unwrap_or_default(),
            fcfs: fcfs.as_ref().and_then(|r| r.per_tenant.get(i).map(|t| t.1.clone())),
        })
        .collect();
    let shares = shares(&figures);
    println!();
    for (f, (share, left)) in figures.iter().zip(&shares) {
        let r = f.ratios();
        println!("{}", f.name);
        println!("  alone     {}", brief_line(&f.alone));
        println!("  together  {}", brief_line(&f.mixed));
        println!("  {}", ratios_line(&r, *share, *left));
    }
    let fair_tput = mixed.summary.output_throughput;
    println!("\naggregate output throughput together: {fair_tput:.1} tok/s");
    let mut result = json!({
        "mix": args.serve.mix,
        "base_url": args.serve.base_url,
        "goodput_slo": mixed.summary.slo,
        "mixed_first": mixed_first,
        "aggregate": {"mixed": brief(&mixed.summary)},
        "tenants": figures.iter().zip(&shares).map(|(f, (share, left))| json!({
            "name": f.name,
            "alone": brief(&f.alone),
            "mixed": brief(&f.mixed),
            "fcfs": f.fcfs.as_ref().map(brief),
            "mixed_over_alone": f.ratios(),
            "share_of_served_tokens": share,
            "share_of_capacity_left": num(*left),
        })).collect::<Vec<_>>(),
    });
    let fcfs_throughput = fcfs.as_ref().map(|fc| fc.summary.output_throughput);
    if let (Some(fc), Some(fcfs_tput)) = (&fcfs, fcfs_throughput) {
        println!(
            "aggregate output throughput under FCFS: {fcfs_tput:.1} tok/s; this target / FCFS = {:.2}",
            ratio(fair_tput, fcfs_tput)
        );
        for f in &figures {
            if let Some(s) = &f.fcfs {
                println!("  under FCFS {:<12} {}", f.name, brief_line(s));
            }
        }
        result["aggregate"]["fcfs"] = brief(&fc.summary);
        result["aggregate"]["throughput_over_fcfs"] = json!(ratio(fair_tput, fcfs_tput));
    }
    Ok(Round { figures, throughput: fair_tput, fcfs_throughput, result })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(tps: f64) -> Summary {
        Summary { total_token_throughput: tps, ..Summary::default() }
    }

    #[test]
    fn shares_and_the_capacity_left() {
        // The noisy tenant alone saturates at 200 tok/s; together the quiet one gets 20 and
        // the noisy one 150: 150 of the 180 the quiet one left.
        let f = |name: &str, alone: f64, mixed: f64| TenantFigures {
            name: name.into(),
            alone: summary(alone),
            mixed: summary(mixed),
            fcfs: None,
        };
        let s = shares(&[f("quiet", 20.0, 20.0), f("noisy", 200.0, 150.0)]);
        assert!((s[0].0 - 20.0 / 170.0).abs() < 1e-12 && (s[1].0 - 150.0 / 170.0).abs() < 1e-12);
        assert!((s[1].1 - 150.0 / 180.0).abs() < 1e-12, "{s:?}");
        assert!(s[0].1.is_nan(), "the quiet tenant's demand bounds it: {s:?}");
        assert!(ratio(1.0, 0.0).is_nan() && ratio(f64::NAN, 1.0).is_nan());
        assert_eq!(ratio(3.0, 2.0), 1.5);
    }

    #[test]
    fn medians_skip_what_is_not_a_number() {
        assert_eq!(median(vec![3.0, f64::NAN, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(vec![f64::NAN]).is_nan() && median(Vec::new()).is_nan());
        assert_eq!(num(f64::NAN), Value::Null);
    }
}
