//! The named scenarios of `sluice bench isolation --scenario`: the floods a multi-tenant
//! platform meets, each a fixed mix of tenants (tier, rate, prompt and output lengths), and
//! the targets each must meet, judged from the figures measured in the same run (every
//! tenant alone, then together). The tenants are `iso-ROLE`: created (or moved to the role's
//! tier) through the admin API with a fresh key each, revoked at the end, or their keys read
//! from `SLUICE_KEY_ROLE` without admin access.

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// One tenant of a scenario.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Load {
    /// Its role, and the tenant's name without the `iso-` prefix.
    pub role: &'static str,
    /// The quota tier it is created in.
    pub tier: &'static str,
    /// Requests per second (Poisson).
    pub rate: f64,
    /// Prompt and output tokens (with `shared-prefix`, after one of the prefixes).
    pub input: u32,
    pub output: u32,
    /// `random` prompts, or `shared-prefix` (one of `bench serve`'s 8 prefixes of 256 tokens
    /// before each).
    pub workload: &'static str,
    /// The tenant's own fair-order weight (`overrides.weight`), or `None` for its tier's.
    pub weight: Option<u32>,
}

/// A standard tenant at a tenth of the machine's decode capacity (2-core CPU, default model).
const QUIET: Load = Load {
    role: "quiet",
    tier: "standard",
    rate: 0.5,
    input: 128,
    output: 64,
    workload: "random",
    weight: None,
};
/// The quiet tenant's load after shared prefixes, which its prefix cache should serve.
const QUIET_SHARING: Load = Load { workload: "shared-prefix", ..QUIET };
/// Ten times the quiet tenant's rate, of the same shape.
const DECODE_FLOOD: Load = Load { role: "decode-flood", rate: 5.0, ..QUIET };
/// Long prompts at about twice the machine's prefill capacity.
const PREFILL_FLOOD: Load = Load { role: "prefill-flood", rate: 2.0, input: 1024, ..QUIET };
/// The standard tier's weight (`policies/scheduling.json`), which the weighted floods' lighter
/// tenant keeps and the heavier one doubles.
const STANDARD_WEIGHT: u32 = 2;
/// The quiet tenant's load in the enterprise tier (priority 1).
const VIP: Load = Load { role: "vip", tier: "enterprise", ..QUIET };

/// A named scenario.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Scenario {
    pub name: &'static str,
    pub about: &'static str,
    pub tenants: Vec<Load>,
    /// Whether its requests are spread over two gateways (`--failover-url`).
    pub two_gateways: bool,
}

/// The scenarios, in the order `all` runs them.
pub(crate) fn catalog() -> Vec<Scenario> {
    let s = |name, about, tenants: &[Load], two_gateways| Scenario {
        name,
        about,
        tenants: tenants.to_vec(),
        two_gateways,
    };
    let flood = |role| Load { role, ..DECODE_FLOOD };
    vec![
        s(
            "decode-flood",
            "a quiet tenant beside ten times its rate",
            &[QUIET, DECODE_FLOOD],
            false,
        ),
        s(
            "prefill-flood",
            "a quiet tenant beside 1,024-token prompts at about twice the prefill capacity",
            &[QUIET, PREFILL_FLOOD],
            false,
        ),
        s(
            "priority-flood",
            "a priority-1 (enterprise) tenant beside a priority-0 decode and prefill flood",
            &[VIP, DECODE_FLOOD, PREFILL_FLOOD],
            false,
        ),
        s(
            "three-tenants",
            "a quiet tenant beside a decode flood and a prefill flood at once",
            &[QUIET, DECODE_FLOOD, PREFILL_FLOOD],
            false,
        ),
        s(
            "shared-prefix",
            "a quiet tenant whose prompts share prefixes beside the prefill flood: its prefix \
             cache keeps its hit rate",
            &[QUIET_SHARING, PREFILL_FLOOD],
            false,
        ),
        s(
            "equal-floods",
            "two floods of equal weight: each keeps half",
            &[flood("flood-a"), flood("flood-b")],
            false,
        ),
        s(
            "weighted-floods",
            "two floods, one with twice the other's weight: each keeps its weighted share",
            &[
                Load { weight: Some(2 * STANDARD_WEIGHT), ..flood("flood-double") },
                Load { weight: Some(STANDARD_WEIGHT), ..flood("flood-single") },
            ],
            false,
        ),
        s(
            "two-gateways",
            "the prefill flood with every tenant's requests spread over two gateways",
            &[QUIET, PREFILL_FLOOD],
            true,
        ),
    ]
}

/// The scenarios `--scenario` names (comma-separated, repeatable; `all`: every one).
pub(crate) fn chosen(names: &[String]) -> anyhow::Result<Vec<Scenario>> {
    let all = catalog();
    let mut out: Vec<Scenario> = Vec::new();
    for name in names.iter().flat_map(|n| n.split(',')).map(str::trim).filter(|n| !n.is_empty()) {
        let picked: Vec<Scenario> = if name == "all" {
            all.clone()
        } else {
            let known = all.iter().find(|s| s.name == name).cloned();
            let Some(s) = known else {
                let names: Vec<&str> = all.iter().map(|s| s.name).collect();
                bail!("--scenario: no scenario {name:?} (all, {})", names.join(", "));
            };
            vec![s]
        };
        for s in picked {
            if !out.contains(&s) {
                out.push(s);
            }
        }
    }
    Ok(out)
}

/// The tenant a role runs as.
pub(crate) fn tenant_id(role: &str) -> String {
    format!("iso-{role}")
}

/// The variable a role's key is read from without admin access: `SLUICE_KEY_PREFILL_FLOOD`.
pub(crate) fn key_var(role: &str) -> String {
    format!("SLUICE_KEY_{}", role.to_uppercase().replace('-', "_"))
}

/// The mix entries of a scenario, with each tenant's key.
pub(crate) fn mix(s: &Scenario, keys: &Keys) -> anyhow::Result<Vec<Value>> {
    s.tenants
        .iter()
        .map(|t| {
            let key = keys.key(t.role)?;
            Ok(json!({
                "name": t.role,
                "api_key": key,
                "request_rate": t.rate,
                "input_len": t.input.to_string(),
                "output_len": t.output.to_string(),
                "workload": t.workload,
            }))
        })
        .collect()
}

/// The scenario's tenants as the JSON result shows them (no keys).
pub(crate) fn describe(s: &Scenario) -> Value {
    json!({
        "name": s.name,
        "about": s.about,
        "two_gateways": s.two_gateways,
        "tenants": s.tenants.iter().map(|t| json!({
            "role": t.role, "tenant": tenant_id(t.role), "tier": t.tier, "weight": t.weight,
            "request_rate": t.rate, "input_len": t.input, "output_len": t.output,
            "workload": t.workload,
        })).collect::<Vec<_>>(),
    })
}

/// The keys the scenarios' tenants send with: issued for this run through the admin API (and
/// revoked by [`Keys::revoke`]), or read from the environment.
#[derive(Clone, Debug, Default)]
pub(crate) struct Keys {
    keys: Vec<Issued>,
    admin: Option<Admin>,
}

/// A role's key for the run.
#[derive(Clone, Debug)]
struct Issued {
    role: String,
    secret: String,
    /// The tenant and the key's id, when this run issued it.
    revoke: Option<(String, String)>,
}

/// The admin API and an ops token for it.
#[derive(Clone, Debug)]
pub(crate) struct Admin {
    pub url: String,
    pub token: String,
}

impl Keys {
    fn key(&self, role: &str) -> anyhow::Result<String> {
        if let Some(k) = self.keys.iter().find(|k| k.role == role) {
            return Ok(k.secret.clone());
        }
        let var = key_var(role);
        std::env::var(&var).with_context(|| {
            format!(
                "no key for the scenario tenant {role}: set ${var}, or give --admin-url and \
                 --admin-token (an ops token, SLUICE_ADMIN_TOKEN) to create {}",
                tenant_id(role)
            )
        })
    }

    /// Gets a key for every role of `scenarios`: through `admin` when given (each tenant
    /// created in its tier, or moved to it, and a key issued), else from the environment.
    pub(crate) fn for_scenarios(
        scenarios: &[Scenario],
        admin: Option<Admin>,
    ) -> anyhow::Result<Self> {
        let mut roles: Vec<Load> = Vec::new();
        for t in scenarios.iter().flat_map(|s| &s.tenants) {
            if let Some(other) = roles.iter().find(|r| r.role == t.role && r.tier != t.tier) {
                bail!("scenario role {} is in two tiers ({} and {})", t.role, other.tier, t.tier);
            }
            if roles.iter().any(|r| r.role == t.role && r.weight != t.weight) {
                bail!("scenario role {} has two weights", t.role);
            }
            if !roles.iter().any(|r| r.role == t.role) {
                roles.push(*t);
            }
        }
        let mut keys = Keys { keys: Vec::new(), admin: admin.clone() };
        let Some(admin) = admin else {
            for r in &roles {
                keys.key(r.role)?;
            }
            return Ok(keys);
        };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let client = reqwest::Client::new();
        for r in &roles {
            let provisioned = rt
                .block_on(provision(&client, &admin, &tenant_id(r.role), r.tier, r.weight))
                .with_context(|| format!("creating the scenario tenant {}", tenant_id(r.role)));
            let (id, secret) = match provisioned {
                Ok(issued) => issued,
                Err(e) => {
                    // The keys issued so far are not left behind.
                    keys.revoke();
                    return Err(e);
                }
            };
            let revoke = Some((tenant_id(r.role), id));
            keys.keys.push(Issued { role: r.role.to_owned(), secret, revoke });
        }
        Ok(keys)
    }

    /// Revokes these keys if the process is interrupted (Ctrl-C or SIGTERM) before it ends,
    /// then ends it (status 130): a run cut short leaves no live key behind. The watch lasts
    /// until the process ends; a normal end revokes the keys itself.
    pub(crate) fn revoke_on_interrupt(sets: Vec<Keys>) {
        if sets.iter().all(|k| k.admin.is_none()) {
            return;
        }
        let watch = move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            let signal = rt.block_on(async {
                #[cfg(unix)]
                {
                    use tokio::signal::unix::{SignalKind, signal};
                    let mut term = signal(SignalKind::terminate()).ok()?;
                    tokio::select! {
                        r = tokio::signal::ctrl_c() => r.ok().map(|()| "interrupt"),
                        _ = term.recv() => Some("terminate"),
                    }
                }
                #[cfg(not(unix))]
                tokio::signal::ctrl_c().await.ok().map(|()| "interrupt")
            });
            drop(rt);
            let Some(signal) = signal else { return };
            eprintln!("{signal}: revoking the keys this run issued");
            for k in &sets {
                k.revoke();
            }
            std::process::exit(130);
        };
        if let Err(e) = std::thread::Builder::new().name("revoke-on-interrupt".into()).spawn(watch)
        {
            eprintln!("warning: no interrupt watch ({e}): a run cut short leaves its keys live");
        }
    }

    /// Revokes the keys this run issued (a failure is reported, not fatal: the run's figures
    /// stand).
    pub(crate) fn revoke(&self) {
        let Some(admin) = &self.admin else { return };
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
            return;
        };
        let client = reqwest::Client::new();
        for k in &self.keys {
            let Some((tenant, id)) = &k.revoke else { continue };
            let base = admin.url.trim_end_matches('/');
            let url = format!("{base}/v1/tenants/{tenant}/keys/{id}/revoke");
            let sent = rt.block_on(client.post(&url).bearer_auth(&admin.token).send());
            match sent {
                Ok(r) if r.status().is_success() => {}
                Ok(r) => eprintln!("revoking key {id} of {tenant}: {}", r.status()),
                Err(e) => eprintln!("revoking key {id} of {tenant}: {e}"),
            }
        }
    }
}

/// Creates `tenant` in `tier` with its own `weight` or its tier's (or moves it there and sets
/// that weight, when it exists) and issues it a key: its id and secret.
async fn provision(
    c: &reqwest::Client,
    admin: &Admin,
    tenant: &str,
    tier: &str,
    weight: Option<u32>,
) -> anyhow::Result<(String, String)> {
    let base = admin.url.trim_end_matches('/');
    let answer = |r: reqwest::Response| async move {
        let status = r.status();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        (status, body)
    };
    let own = match weight {
        Some(w) => json!({"weight": w}),
        None => json!({}),
    };
    let created = c
        .post(format!("{base}/v1/tenants"))
        .bearer_auth(&admin.token)
        .json(&json!({"id": tenant, "tier": tier, "overrides": own}))
        .send()
        .await
        .context("POST /v1/tenants")?;
    let (status, body) = answer(created).await;
    if status == reqwest::StatusCode::CONFLICT {
        let got = c.get(format!("{base}/v1/tenants/{tenant}")).bearer_auth(&admin.token);
        let (status, body) = answer(got.send().await.context("GET the tenant")?).await;
        if !status.is_success() {
            bail!("GET /v1/tenants/{tenant}: {status}: {body}");
        }
        let has = body["overrides"]["weight"].as_u64();
        if body["tier"].as_str() != Some(tier) || has != weight.map(u64::from) {
            // The role's weight, or its tier's (`null` removes the tenant's own).
            let change = c
                .patch(format!("{base}/v1/tenants/{tenant}"))
                .bearer_auth(&admin.token)
                .json(&json!({"tier": tier, "overrides": {"weight": weight}}));
            let (status, body) = answer(change.send().await.context("PATCH the tenant")?).await;
            if !status.is_success() {
                bail!("moving {tenant} to the {tier} tier, weight {weight:?}: {status}: {body}");
            }
        }
        if body["status"].as_str().is_some_and(|s| s != "active") {
            bail!("{tenant} is {}: activate it first", body["status"]);
        }
    } else if !status.is_success() {
        bail!("POST /v1/tenants: {status}: {body}");
    }
    let issued = c
        .post(format!("{base}/v1/tenants/{tenant}/keys"))
        .bearer_auth(&admin.token)
        .json(&json!({}))
        .send()
        .await
        .context("POST /v1/tenants/{tenant}/keys")?;
    let (status, body) = answer(issued).await;
    if !status.is_success() {
        bail!("issuing a key for {tenant}: {status}: {body}");
    }
    let id = body["id"].as_str().context("the issued key has no id")?;
    let secret = body["secret"].as_str().context("the issued key has no secret")?;
    Ok((id.to_owned(), secret.to_owned()))
}

/// One target of a scenario and what was measured against it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub(crate) struct Check {
    /// What is measured, in words.
    pub what: String,
    pub value: f64,
    /// The bound, and whether the value must be at most (true) or at least it.
    pub bound: f64,
    pub at_most: bool,
}

impl Check {
    pub(crate) fn passes(&self) -> bool {
        self.value.is_finite()
            && if self.at_most { self.value <= self.bound } else { self.value >= self.bound }
    }

    pub(crate) fn line(&self) -> String {
        let verdict = if self.passes() { "PASS" } else { "FAIL" };
        let op = if self.at_most { "<=" } else { ">=" };
        format!("{verdict}  {} {:.3} {op} {}", self.what, self.value, self.bound)
    }
}

/// What the checks read of one tenant in one round.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Measured {
    /// SLO attainment together.
    pub attainment: f64,
    /// TTFT p99 together, milliseconds, and over its value alone.
    pub ttft_p99_ms: f64,
    pub ttft_p99_ratio: f64,
    /// TPOT p99 together, milliseconds.
    pub tpot_p99_ms: f64,
    /// Share of the tokens (prompt and output) served together, and of the capacity the others left
    /// (NaN where its demand, not the capacity, bounds it).
    pub share: f64,
    pub of_left: f64,
    /// Prompt tokens its prefix cache served, together and alone (NaN without any prompt).
    pub hit_rate: f64,
    pub hit_rate_alone: f64,
}

/// The SLO the attainment is judged by (milliseconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Targets {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

/// The checks of scenario `s` on its tenants' figures (in the scenario's order); with the
/// aggregate throughput over FCFS's where that was measured.
pub(crate) fn checks(s: &Scenario, m: &[Measured], over_fcfs: f64, slo: Targets) -> Vec<Check> {
    let mut out = Vec::new();
    let at_least = |what: String, value, bound| Check { what, value, bound, at_most: false };
    let at_most = |what: String, value, bound| Check { what, value, bound, at_most: true };
    let by_role = |role: &str| s.tenants.iter().position(|t| t.role == role).and_then(|i| m.get(i));
    let quiet = by_role(QUIET.role);
    match s.name {
        "decode-flood" => {
            if let Some(q) = quiet {
                out.push(at_least("quiet attainment".into(), q.attainment, 0.95));
                out.push(at_most("quiet TTFT p99 / alone".into(), q.ttft_p99_ratio, 1.2));
                let what = format!("quiet TPOT p99 ms (the SLO's {} ms)", slo.tpot_ms);
                out.push(at_most(what, q.tpot_p99_ms, slo.tpot_ms));
            }
        }
        "prefill-flood" | "two-gateways" => {
            if let Some(q) = quiet {
                out.push(at_least("quiet attainment".into(), q.attainment, 0.95));
                let what = format!("quiet TTFT p99 ms (the SLO's {} ms)", slo.ttft_ms);
                out.push(at_most(what, q.ttft_p99_ms, slo.ttft_ms));
                out.push(at_most("quiet TTFT p99 / alone".into(), q.ttft_p99_ratio, 3.0));
            }
            if let Some(f) = by_role(PREFILL_FLOOD.role) {
                let what = "prefill-flood's share of the capacity the quiet tenant left";
                out.push(at_least(what.into(), f.of_left, 0.8));
            }
        }
        "priority-flood" => {
            if let Some(v) = by_role(VIP.role) {
                out.push(at_most("vip TTFT p99 / alone".into(), v.ttft_p99_ratio, 1.2));
            }
        }
        "shared-prefix" => {
            if let Some(q) = quiet {
                out.push(at_least("quiet attainment".into(), q.attainment, 0.95));
                let what = "quiet prefix-cache hit rate together / alone";
                out.push(at_least(what.into(), q.hit_rate / q.hit_rate_alone, 0.9));
            }
        }
        "three-tenants" => {
            if let Some(q) = quiet {
                out.push(at_least("quiet attainment".into(), q.attainment, 0.95));
            }
        }
        "equal-floods" | "weighted-floods" => {
            let weight = |t: &Load| f64::from(t.weight.unwrap_or(STANDARD_WEIGHT));
            let total: f64 = s.tenants.iter().map(weight).sum();
            for (t, f) in s.tenants.iter().zip(m) {
                let what = format!("{}'s share of the tokens served / its weight's", t.role);
                out.push(at_least(what, f.share / (weight(t) / total), 0.9));
            }
        }
        _ => {}
    }
    if over_fcfs.is_finite() {
        out.push(at_least("aggregate throughput / FCFS".into(), over_fcfs, 0.9));
    }
    out
}

/// Two-gateway checks against the same scenario through one gateway: the quiet tenant's
/// attainment and TTFT p99 over its value alone no more than 10% worse (at most 1.1 times one
/// gateway's, at least 0.9 times it). Its TTFT in milliseconds is left out (each run has its
/// own alone, against which the ratio is the figure), and so is the flood's share of the
/// capacity left (a ratio whose scale past 1 says nothing; it has its own bound in both).
pub(crate) fn against_one_gateway(two: &[Check], one: &[Check]) -> Vec<Check> {
    let compared = ["quiet attainment", "quiet TTFT p99 / alone"];
    two.iter()
        .filter(|c| compared.contains(&c.what.as_str()))
        .filter_map(|c| {
            let base = one.iter().find(|o| o.what == c.what)?;
            let what = format!("{}: two gateways' / one gateway's", c.what);
            let bound = if c.at_most { 1.1 } else { 0.9 };
            Some(Check { what, value: c.value / base.value, bound, at_most: c.at_most })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(attainment: f64, ttft: f64, ratio: f64) -> Measured {
        Measured {
            attainment,
            ttft_p99_ms: ttft,
            ttft_p99_ratio: ratio,
            tpot_p99_ms: 40.0,
            share: 0.5,
            of_left: f64::NAN,
            hit_rate: 0.8,
            hit_rate_alone: 0.8,
        }
    }

    const SLO: Targets = Targets { ttft_ms: 1000.0, tpot_ms: 100.0 };

    #[test]
    fn names_pick_scenarios_once_and_unknown_ones_are_refused() -> anyhow::Result<()> {
        let picked = chosen(&["prefill-flood,decode-flood".into(), "prefill-flood".into()])?;
        let names: Vec<&str> = picked.iter().map(|s| s.name).collect();
        assert_eq!(names, ["prefill-flood", "decode-flood"]);
        assert_eq!(chosen(&["all".into()])?.len(), catalog().len());
        let err = chosen(&["flood".into()]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("\"flood\"") && err.contains("two-gateways"), "{err}");
        assert_eq!(key_var("prefill-flood"), "SLUICE_KEY_PREFILL_FLOOD");
        Ok(())
    }

    #[test]
    fn every_scenario_has_targets_and_each_role_one_tier() -> anyhow::Result<()> {
        for s in catalog() {
            let m = vec![measured(1.0, 100.0, 1.0); s.tenants.len()];
            assert!(!checks(&s, &m, f64::NAN, SLO).is_empty(), "{} has no target", s.name);
        }
        // A role keeps its tier across scenarios, so one tenant serves them all.
        let keys = Keys::for_scenarios(&catalog(), None);
        let err = keys.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("SLUICE_KEY_") && !err.contains("two tiers"), "{err}");
        Ok(())
    }

    #[test]
    fn the_prefill_flood_passes_and_fails_by_its_targets() -> anyhow::Result<()> {
        let s = chosen(&["prefill-flood".into()])?.remove(0);
        let flood = Measured { of_left: 0.85, ..measured(0.0, 9000.0, 9.0) };
        let good = checks(&s, &[measured(0.97, 400.0, 2.5), flood], 0.95, SLO);
        assert!(good.iter().all(Check::passes), "{good:?}");
        assert_eq!(good.len(), 5);
        // Over the SLO, over 3x alone, and the flood starved: three failures.
        let starved = Measured { of_left: 0.5, ..flood };
        let bad = checks(&s, &[measured(0.97, 1200.0, 3.5), starved], f64::NAN, SLO);
        let failed: Vec<&str> =
            bad.iter().filter(|c| !c.passes()).map(|c| c.what.as_str()).collect();
        assert_eq!(failed.len(), 3, "{bad:?}");
        // An unmeasured figure never passes.
        let none = checks(&s, &[measured(f64::NAN, 400.0, 2.5), flood], f64::NAN, SLO);
        assert!(!none[0].passes() && none[0].line().starts_with("FAIL"), "{none:?}");
        Ok(())
    }

    #[test]
    fn weighted_floods_are_judged_by_their_own_weights() -> anyhow::Result<()> {
        let s = chosen(&["weighted-floods".into()])?.remove(0);
        let share = |share| Measured { share, ..measured(1.0, 100.0, 1.0) };
        // Served 2:1, both keep their shares.
        let good = checks(&s, &[share(0.64), share(0.36)], f64::NAN, SLO);
        assert!(good.iter().all(Check::passes), "{good:?}");
        // Served evenly, the heavier tenant has 0.75 of its share and fails; the lighter,
        // 1.5 of its own, passes.
        let even = checks(&s, &[share(0.5), share(0.5)], f64::NAN, SLO);
        let failed: Vec<&str> =
            even.iter().filter(|c| !c.passes()).map(|c| c.what.as_str()).collect();
        assert_eq!(failed, ["flood-double's share of the tokens served / its weight's"]);
        Ok(())
    }

    #[test]
    fn two_gateways_are_judged_against_one() -> anyhow::Result<()> {
        let s = chosen(&["two-gateways".into()])?.remove(0);
        let flood = Measured { of_left: 0.9, ..measured(0.0, 9000.0, 9.0) };
        let one = checks(&s, &[measured(1.0, 300.0, 1.5), flood], f64::NAN, SLO);
        let two = checks(&s, &[measured(0.95, 320.0, 1.7), flood], f64::NAN, SLO);
        let joint = against_one_gateway(&two, &one);
        let verdicts: Vec<(bool, &str)> =
            joint.iter().map(|c| (c.passes(), c.what.as_str())).collect();
        // Attainment 0.05 lower passes; the ratio to alone, 13% higher, does not.
        assert_eq!(joint.len(), 2, "{verdicts:?}");
        assert_eq!(joint.iter().filter(|c| !c.passes()).count(), 1, "{verdicts:?}");
        assert!(joint.iter().any(|c| !c.passes() && c.what.contains("/ alone")), "{verdicts:?}");
        Ok(())
    }
}
