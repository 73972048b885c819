//! The crate graph's rules (ARCHITECTURE.md), read from the manifests: the gateway, billing,
//! the load generator and the text crate never depend on the engine, the engine never on the
//! gateway or billing, and the text crate on no other Sluice crate.

use std::collections::BTreeSet;
use std::path::Path;

/// The `sluice-*` crates a manifest lists in any dependency table (normal, dev or build).
fn sluice_deps(manifest: &Path) -> anyhow::Result<BTreeSet<String>> {
    let text = std::fs::read_to_string(manifest)?;
    let mut section = String::new();
    let mut deps = BTreeSet::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.trim_matches(|c| c == '[' || c == ']').to_owned();
            continue;
        }
        if !section.ends_with("dependencies") {
            continue;
        }
        let name = line.split(['=', '.', ' ']).next().unwrap_or_default();
        if name.starts_with("sluice-") {
            deps.insert(name.to_owned());
        }
    }
    Ok(deps)
}

#[test]
fn the_crate_graph_keeps_its_rules() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let deps = |dir: &str| sluice_deps(&root.join(dir).join("Cargo.toml"));
    // The parser sees what the manifests say (a check that cannot fail is no check).
    assert!(deps("engine")?.contains("sluice-text"), "engine: {:?}", deps("engine")?);
    assert!(deps(".")?.contains("sluice-engine"));
    assert_eq!(deps("text")?, BTreeSet::new(), "the text crate is the bottom");
    for dir in ["gateway", "billing", "bench"] {
        let d = deps(dir)?;
        assert!(!d.contains("sluice-engine"), "{dir} depends on the engine: {d:?}");
    }
    // The policies crate is below everything that reads a policy, and depends on nothing.
    assert_eq!(deps("policies")?, BTreeSet::new(), "the policies crate depends on nothing");
    for dir in ["engine", "gateway", "billing"] {
        assert!(deps(dir)?.contains("sluice-policies"), "{dir} reads policies another way");
    }
    let engine = deps("engine")?;
    for other in ["sluice-gateway", "sluice-billing", "sluice-bench"] {
        assert!(!engine.contains(other), "the engine depends on {other}");
    }
    Ok(())
}
