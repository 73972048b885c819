//! The policies in force come from `--policies DIR` where it has the files: the price list's
//! version (written on every ledger row) and its rates, the tiers, are the directory's. One
//! process per test binary: the directory is set once, before the first read.

use sluice_billing::control::{TIERS, check_policies};
use sluice_billing::prices::{PRICES, check_policy};

#[test]
fn the_directory_s_price_list_and_tiers_are_the_ones_in_force() -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let prices = r#"{"version": "ops-2026-12-05",
        "default": {"input": 1.0, "cached_input": 0.5, "output": 2.0}}"#;
    let tiers = r#"{"_comment": "ops", "gold": {"rpm": 7, "max_n": 2}}"#;
    std::fs::write(dir.path().join("prices.json"), prices).map_err(|e| e.to_string())?;
    std::fs::write(dir.path().join("tiers.json"), tiers).map_err(|e| e.to_string())?;
    sluice_policies::use_dir(dir.path())?;
    check_policy()?;
    check_policies()?;
    assert_eq!(PRICES.version, "ops-2026-12-05");
    let r = PRICES.rates("any-model", "gold");
    assert_eq!((r.input, r.cached_input, r.output), (1_000_000, 500_000, 2_000_000));
    assert_eq!(TIERS.keys().collect::<Vec<_>>(), ["gold"]);
    assert_eq!(TIERS["gold"].limits.rpm, Some(7));
    Ok(())
}
