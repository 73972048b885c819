//! The price list (`policies/prices.json`, compiled in): what a request costs, per model and
//! tier. Each ledger row carries the list's version and the three rates it was priced at, so an
//! auditor recomputes its cost from the row alone ([`Rates::cost`]).
//!
//! Rates are US dollars per million tokens in the file, integer micro-dollars per million in
//! memory and on rows. The rates for a request are the first found of: its model's entry for
//! its tier, its model's default, the tier's entry, the list's default; a request under a
//! tenant adapter adds the list's `adapter` surcharge (its tier's entry, else its default),
//! and its row carries the sums.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use serde::Deserialize;

/// Whether a request answered with `http_status` was refused: an error status the client got
/// (a gateway refusal, an engine's validation error, an unreachable engine). A refused request
/// costs nothing and counts apart from billed usage; its row still records it. 499 (the client
/// went away before the response began) is not a refusal: the engine may have worked for it,
/// and it is billed for what it did.
pub fn is_refused(http_status: u16) -> bool {
    http_status >= 400 && http_status != 499
}

/// Prices in micro-dollars per million tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rates {
    /// Uncached prompt tokens.
    pub input: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_input: u64,
    /// Completion tokens.
    pub output: u64,
}

impl Rates {
    /// The cost in micro-dollars of `prompt` prompt tokens (`cached` of them from the prefix
    /// cache) and `completion` generated ones, rounded up to the micro-dollar: the sum of the
    /// charges is never below the exact cost (rounded down, a request under a micro-dollar was
    /// free, and a tenant splitting its work into tiny requests paid nothing).
    pub fn cost(&self, prompt: u64, cached: u64, completion: u64) -> u64 {
        let p = u128::from(prompt.saturating_sub(cached)) * u128::from(self.input)
            + u128::from(cached.min(prompt)) * u128::from(self.cached_input)
            + u128::from(completion) * u128::from(self.output);
        u64::try_from(p.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }

    /// What a request that got `http_status` is charged: nothing when it was refused
    /// ([`is_refused`]), else its [`cost`](Self::cost). The one rule the gateway charges by
    /// and the auditor recomputes by.
    pub fn charge(&self, http_status: u16, prompt: u64, cached: u64, completion: u64) -> u64 {
        if is_refused(http_status) { 0 } else { self.cost(prompt, cached, completion) }
    }
}

/// A price list: its version and the rates by model and tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PriceList {
    /// Written on every ledger row priced by it.
    pub version: String,
    default: Rates,
    tiers: BTreeMap<String, Rates>,
    models: BTreeMap<String, ModelRates>,
    /// Added to a request's rates when it runs under a tenant adapter.
    adapter: Option<ModelRates>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct ModelRates {
    default: Option<Rates>,
    tiers: BTreeMap<String, Rates>,
}

/// The most a rate may be, in dollars per million tokens.
const MAX_DOLLARS: f64 = 1_000_000.0;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RatesFile {
    input: f64,
    cached_input: f64,
    output: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFile {
    #[serde(default)]
    default: Option<RatesFile>,
    #[serde(default)]
    tiers: BTreeMap<String, RatesFile>,
}

#[derive(Deserialize)]
struct ListFile {
    version: String,
    default: RatesFile,
    #[serde(default)]
    tiers: BTreeMap<String, RatesFile>,
    #[serde(default)]
    models: BTreeMap<String, ModelFile>,
    #[serde(default)]
    adapter: Option<ModelFile>,
}

fn micros(dollars: f64, what: &str) -> Result<u64, String> {
    if !dollars.is_finite() || !(0.0..=MAX_DOLLARS).contains(&dollars) {
        return Err(format!("{what}: a rate must be 0 to {MAX_DOLLARS} dollars per million"));
    }
    let m = (dollars * 1e6).round();
    // In range: at most 1e12 micro-dollars.
    Ok(m as u64)
}

impl RatesFile {
    fn rates(&self, what: &str) -> Result<Rates, String> {
        Ok(Rates {
            input: micros(self.input, &format!("{what}.input"))?,
            cached_input: micros(self.cached_input, &format!("{what}.cached_input"))?,
            output: micros(self.output, &format!("{what}.output"))?,
        })
    }
}

fn tier_rates(
    tiers: &BTreeMap<String, RatesFile>,
    what: &str,
) -> Result<BTreeMap<String, Rates>, String> {
    tiers.iter().map(|(t, r)| Ok((t.clone(), r.rates(&format!("{what}.tiers.{t}"))?))).collect()
}

impl PriceList {
    /// Parses a price list (keys starting with `_` are comments). The error names the field.
    pub fn parse(text: &str) -> Result<PriceList, String> {
        let mut raw: BTreeMap<String, serde_json::Value> =
            serde_json::from_str(text).map_err(|e| format!("price list: {e}"))?;
        raw.retain(|k, _| !k.starts_with('_'));
        let value = serde_json::Value::Object(raw.into_iter().collect());
        let file: ListFile =
            serde_json::from_value(value).map_err(|e| format!("price list: {e}"))?;
        let version = file.version.trim().to_owned();
        if version.is_empty() || version.len() > 64 {
            return Err("price list: version must be 1 to 64 characters".into());
        }
        let models = file
            .models
            .iter()
            .map(|(m, f)| {
                let what = format!("models.{m}");
                let default = f.default.as_ref().map(|r| r.rates(&format!("{what}.default")));
                let rates = ModelRates {
                    default: default.transpose()?,
                    tiers: tier_rates(&f.tiers, &what)?,
                };
                Ok((m.clone(), rates))
            })
            .collect::<Result<_, String>>()?;
        let adapter = match &file.adapter {
            None => None,
            Some(f) => Some(ModelRates {
                default: f.default.as_ref().map(|r| r.rates("adapter.default")).transpose()?,
                tiers: tier_rates(&f.tiers, "adapter")?,
            }),
        };
        Ok(PriceList {
            version,
            default: file.default.rates("default")?,
            tiers: tier_rates(&file.tiers, "")?,
            models,
            adapter,
        })
    }

    /// Whether the list names `model`: only a priced model is served (the list's default and
    /// tier entries price a named model's tiers, never a model the list does not know).
    pub fn priced(&self, model: &str) -> bool {
        self.models.contains_key(model)
    }

    /// The rates for a request of `model` by a tenant of `tier`.
    pub fn rates(&self, model: &str, tier: &str) -> Rates {
        let m = self.models.get(model);
        m.and_then(|m| m.tiers.get(tier))
            .or_else(|| m.and_then(|m| m.default.as_ref()))
            .or_else(|| self.tiers.get(tier))
            .copied()
            .unwrap_or(self.default)
    }

    /// [`rates`](Self::rates), plus the adapter surcharge (the tier's entry, else the
    /// default, else nothing) when the request runs under a tenant adapter.
    pub fn rates_under(&self, model: &str, tier: &str, adapter: bool) -> Rates {
        let base = self.rates(model, tier);
        let extra = self
            .adapter
            .as_ref()
            .filter(|_| adapter)
            .and_then(|a| a.tiers.get(tier).or(a.default.as_ref()));
        match extra {
            None => base,
            Some(e) => Rates {
                input: base.input.saturating_add(e.input),
                cached_input: base.cached_input.saturating_add(e.cached_input),
                output: base.output.saturating_add(e.output),
            },
        }
    }
}

/// The price list in force (`prices.json`, see [`crate`]): the operator's, or the
/// compiled-in one. Services check it at start ([`check_policy`]) and refuse to start on one
/// that does not parse; should it still fail here, every request is priced at nothing rather
/// than at a guess, under a version that says so.
pub static PRICES: LazyLock<PriceList> = LazyLock::new(|| {
    crate::text("prices.json").and_then(|t| PriceList::parse(&t)).unwrap_or_else(|e| {
        tracing::error!(error = %e, "prices.json does not parse");
        PriceList {
            version: "unparsed".into(),
            default: Rates { input: 0, cached_input: 0, output: 0 },
            tiers: BTreeMap::new(),
            models: BTreeMap::new(),
            adapter: None,
        }
    })
});

/// Checks the price list in force: an error names the file and the field at fault.
pub fn check_policy() -> Result<(), String> {
    let text = crate::text("prices.json")?;
    PriceList::parse(&text)
        .map(|_| ())
        .map_err(|e| format!("{}: {e}", crate::source("prices.json")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compiled_in_list_parses_and_prices_by_model_then_tier() -> Result<(), String> {
        let shipped = PriceList::parse(crate::compiled("prices.json").unwrap_or_default())?;
        assert_eq!(shipped, *PRICES);
        // The shipped surcharge for a tenant adapter's requests.
        let m = "smollm2-135m-instruct";
        let (plain, under) =
            (shipped.rates(m, "standard"), shipped.rates_under(m, "standard", true));
        assert_eq!((under.input - plain.input, under.output - plain.output), (20_000, 40_000));
        let list = PriceList::parse(
            r#"{"_comment": "x", "version": "v7",
                "default": {"input": 0.1, "cached_input": 0.05, "output": 0.2},
                "tiers": {"enterprise": {"input": 0.08, "cached_input": 0.04, "output": 0.16}},
                "models": {
                  "big": {"default": {"input": 1, "cached_input": 0.5, "output": 2},
                          "tiers": {"free": {"input": 3, "cached_input": 3, "output": 3}}},
                  "tiered": {"tiers": {"free": {"input": 0, "cached_input": 0, "output": 0}}}}}"#,
        )?;
        assert_eq!(list.version, "v7");
        // No surcharge in this list: an adapter's request is priced as its model's.
        assert_eq!(list.rates_under("big", "free", true), list.rates("big", "free"));
        let surcharged = PriceList::parse(
            r#"{"version": "v8",
                "default": {"input": 0.1, "cached_input": 0.05, "output": 0.2},
                "adapter": {"default": {"input": 0.02, "cached_input": 0.01, "output": 0.04},
                            "tiers": {"enterprise": {"input": 0, "cached_input": 0, "output": 0}}}}"#,
        )?;
        let under = |t: &str, a: bool| {
            let r = surcharged.rates_under("m", t, a);
            (r.input, r.cached_input, r.output)
        };
        assert_eq!(under("standard", false), (100_000, 50_000, 200_000), "no adapter");
        assert_eq!(under("standard", true), (120_000, 60_000, 240_000), "the surcharge");
        assert_eq!(under("enterprise", true), (100_000, 50_000, 200_000), "the tier's (none)");
        let bad = PriceList::parse(
            r#"{"version": "v9", "default": {"input": 0, "cached_input": 0, "output": 0},
                "adapter": {"default": {"input": -1, "cached_input": 0, "output": 0}}}"#,
        );
        assert!(bad.is_err_and(|e| e.contains("adapter.default.input")));
        let r = |m: &str, t: &str| {
            let r = list.rates(m, t);
            (r.input, r.cached_input, r.output)
        };
        assert_eq!(r("small", "standard"), (100_000, 50_000, 200_000), "the default");
        assert_eq!(r("small", "enterprise"), (80_000, 40_000, 160_000), "the tier's");
        assert_eq!(r("big", "enterprise"), (1_000_000, 500_000, 2_000_000), "the model's");
        assert_eq!(r("big", "free"), (3_000_000, 3_000_000, 3_000_000), "the model's tier's");
        assert_eq!(r("tiered", "enterprise"), (80_000, 40_000, 160_000), "no model default");
        assert_eq!(r("tiered", "free"), (0, 0, 0));
        Ok(())
    }

    #[test]
    fn costs_round_up_to_the_micro_dollar_and_cached_tokens_are_cheaper() {
        let r = Rates { input: 100_000, cached_input: 50_000, output: 200_000 };
        // 90 uncached at 0.1, 10 cached at 0.05, 64 out at 0.2 micro-dollars: 9 + 0.5 + 12.8.
        assert_eq!(r.cost(100, 10, 64), 23);
        assert_eq!(r.cost(0, 0, 0), 0);
        // Under a micro-dollar is not free: a thousand tiny requests cost at least their sum.
        assert_eq!(r.cost(1, 0, 0), 1);
        let tiny: u64 = (0..1000).map(|_| r.cost(3, 1, 1)).sum();
        assert!(tiny * 1_000_000 >= 1000 * (2 * 100_000 + 50_000 + 200_000));
        // More cached than prompt (never valid) does not charge the difference twice.
        assert_eq!(r.cost(10, 20, 0), 1);
        // A refused request is charged nothing; a disconnect (499) what it used.
        assert_eq!((r.charge(429, 100, 10, 64), r.charge(499, 100, 10, 64)), (0, 23));
        let huge = Rates { input: u64::MAX, cached_input: 0, output: 0 };
        assert_eq!(huge.cost(u64::MAX, 0, 0), u64::MAX);
    }

    #[test]
    fn a_bad_list_names_the_field() {
        let rates = r#"{"input": 1, "cached_input": 1, "output": 1}"#;
        let cases = [
            (format!(r#"{{"default": {rates}}}"#), "version"),
            (format!(r#"{{"version": " ", "default": {rates}}}"#), "version"),
            (
                r#"{"version": "v", "default": {"input": -1, "cached_input": 1, "output": 1}}"#
                    .to_owned(),
                "default.input",
            ),
            (
                format!(
                    r#"{{"version": "v", "default": {rates}, "models": {{"m": {{"tiers":
                        {{"free": {{"input": 1, "cached_input": 1e9, "output": 1}}}}}}}}}}"#
                ),
                "models.m.tiers.free.cached_input",
            ),
            (
                r#"{"version": "v", "default": {"input": 1, "cached_input": 1}}"#.to_owned(),
                "output",
            ),
            (
                r#"{"version": "v", "default": {"input": 1, "cached_input": 1, "output": 1,
                    "x": 1}}"#
                    .to_owned(),
                "x",
            ),
        ];
        for (text, field) in cases {
            let e = PriceList::parse(&text).err().unwrap_or_default();
            assert!(e.contains(field), "{text}: {e}");
        }
    }
}
