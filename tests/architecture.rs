//! The crate graph's rules (ARCHITECTURE.md), read from the manifests: the gateway, billing,
//! the load generator and the text crate never depend on the engine, the engine never on the
//! gateway or billing, and the text and wire crates on no other Sluice crate; the gateway
//! links billing without its server; only the binary uses the platform crate. And from the
//! code: the wire's names are written once (no internal header or internal route outside
//! `sluice-wire`), the gateway calls its engines only through its engine client, and no
//! function of the gateway, the platform or the binary is over 120 lines.

use std::collections::BTreeSet;
use std::path::Path;

/// The `sluice-*` crates a manifest lists in any dependency table (normal, dev or build; the
/// root's `[workspace.dependencies]` too).
fn sluice_deps(manifest: &Path) -> anyhow::Result<BTreeSet<String>> {
    Ok(deps_in(&std::fs::read_to_string(manifest)?, |_| true))
}

/// [`sluice_deps`] of the tables a package asks for itself (not `[workspace.dependencies]`,
/// which names every crate of the workspace for the others to use).
fn own_deps(manifest: &Path) -> anyhow::Result<BTreeSet<String>> {
    Ok(deps_in(&std::fs::read_to_string(manifest)?, own_table))
}

/// Whether a dependency table is the package's own (not the workspace's list).
fn own_table(section: &str) -> bool {
    section != "workspace.dependencies"
}

/// The `sluice-*` crates of a manifest's dependency tables that `table` keeps.
fn deps_in(text: &str, table: fn(&str) -> bool) -> BTreeSet<String> {
    let mut section = String::new();
    let mut deps = BTreeSet::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.trim_matches(|c| c == '[' || c == ']').to_owned();
            continue;
        }
        if !section.ends_with("dependencies") || !table(&section) {
            continue;
        }
        let name = line.split(['=', '.', ' ']).next().unwrap_or_default();
        if name.starts_with("sluice-") {
            deps.insert(name.to_owned());
        }
    }
    deps
}

#[test]
fn the_crate_graph_keeps_its_rules() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let deps = |dir: &str| sluice_deps(&root.join(dir).join("Cargo.toml"));
    // The parser sees what the manifests say (a check that cannot fail is no check).
    assert!(deps("engine")?.contains("sluice-text"), "engine: {:?}", deps("engine")?);
    assert!(deps(".")?.contains("sluice-engine"));
    assert_eq!(deps("text")?, BTreeSet::new(), "the text crate is the bottom");
    assert_eq!(deps("wire")?, BTreeSet::new(), "the wire crate is the bottom");
    let own = |dir: &str| own_deps(&root.join(dir).join("Cargo.toml"));
    // A package's own tables, not the workspace's list of every crate (which would make a
    // check of what the root asks for pass whatever it asks for).
    let sample = "[workspace.dependencies]\nsluice-a = { path = \"a\" }\n[dependencies]\n\
                  sluice-b.workspace = true\n[dev-dependencies]\nsluice-c = { path = \"c\" }\n";
    let names = |n: &[&str]| n.iter().map(|s| (*s).to_owned()).collect::<BTreeSet<_>>();
    assert_eq!(deps_in(sample, |_| true), names(&["sluice-a", "sluice-b", "sluice-c"]));
    assert_eq!(deps_in(sample, own_table), names(&["sluice-b", "sluice-c"]));
    for dir in ["engine", "gateway", "billing", "bench", "."] {
        assert!(own(dir)?.contains("sluice-wire"), "{dir} speaks the wire another way");
    }
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
    // The platform crate assembles the others for the binary, and only the binary uses it.
    assert!(own(".")?.contains("sluice-platform"));
    for part in ["sluice-engine", "sluice-gateway", "sluice-billing", "sluice-bench"] {
        assert!(deps("platform")?.contains(part), "the platform assembles no {part}");
    }
    for dir in ["wire", "policies", "text", "engine", "billing", "gateway", "bench"] {
        let d = deps(dir)?;
        assert!(!d.contains("sluice-platform"), "{dir} depends on the platform: {d:?}");
    }
    Ok(())
}

/// The code lines of the Rust files under `dir` (recursively), lowercased: comment lines and
/// trailing ` // ` comments left out, and a file's test module (`#[cfg(test)]` before a `mod`)
/// and what follows it. `(file, line number, line)`.
fn code_lines(dir: &Path, out: &mut Vec<(String, usize, String)>) -> anyhow::Result<()> {
    code_lines_cased(dir, out, true)
}

/// [`code_lines`], lowercased only when `lower` is set.
fn code_lines_cased(
    dir: &Path,
    out: &mut Vec<(String, usize, String)>,
    lower: bool,
) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            code_lines_cased(&path, out, lower)?;
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let next = lines[i + 1..].iter().find(|l| !l.trim().is_empty());
            if line.trim() == "#[cfg(test)]" && next.is_some_and(|l| l.trim().starts_with("mod ")) {
                break;
            }
            if line.trim_start().starts_with("//") {
                continue;
            }
            let code = line.split(" // ").next().unwrap_or_default();
            let code = if lower { code.to_lowercase() } else { code.to_owned() };
            out.push((path.display().to_string(), i + 1, code));
        }
    }
    Ok(())
}

#[test]
fn internal_headers_and_routes_are_written_only_in_the_wire_crate() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut lines = Vec::new();
    let dirs = ["engine/src", "gateway/src", "billing/src", "bench/src", "text/src"];
    for dir in dirs.into_iter().chain(["policies/src", "platform/src", "src"]) {
        code_lines(&root.join(dir), &mut lines)?;
    }
    // The scan sees the code it judges (a check that cannot fail is no check).
    assert!(lines.iter().any(|(_, _, l)| l.contains("route::load")), "the engine's router");
    assert!(lines.iter().any(|(_, _, l)| l.contains("internal::tenant")), "the gateway's headers");
    // Anywhere in a line of code: in a literal of its own, in a format string, in a label.
    let written: Vec<String> = lines
        .iter()
        .filter(|(_, _, l)| l.contains("x-sluice-") || l.contains("/v1/internal/"))
        .map(|(f, n, l)| format!("{f}:{n}: {}", l.trim()))
        .collect();
    assert!(written.is_empty(), "write these through sluice_wire:\n{}", written.join("\n"));
    let mut wire = Vec::new();
    code_lines(&root.join("wire/src"), &mut wire)?;
    assert!(wire.iter().any(|(_, _, l)| l.contains("\"x-sluice-tenant\"")));
    Ok(())
}

/// The engine routes a gateway calls, as `sluice_wire::route` names them.
const ENGINE_ROUTES: [&str; 6] = [
    "route::HEALTH",
    "route::MODELS",
    "route::TEXT",
    "route::LOAD",
    "route::outcome",
    "route::abort",
];

#[test]
fn the_gateway_calls_its_engines_only_through_its_engine_client() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut lines = Vec::new();
    // As written: `route::MODELS` is a call, admission's `Route::Models` is not.
    code_lines_cased(&root.join("gateway/src"), &mut lines, false)?;
    let client = |f: &str| f.ends_with("engine_client.rs");
    // The scan sees the client it exempts (a check that cannot fail is no check).
    assert!(lines.iter().any(|(f, _, l)| client(f) && l.contains("route::outcome")));
    // An internal route is named, a request built, or a URL written only in the client; the
    // others may only make the HTTP client it is given.
    let elsewhere: Vec<String> = lines
        .iter()
        .filter(|(f, _, l)| {
            // A use of the module (in any import form), or a call of an engine route.
            let route = (l.contains("sluice_wire") && l.contains("route"))
                || l.trim() == "route,"
                || l.trim_start().starts_with("route}")
                || ENGINE_ROUTES.iter().any(|r| l.contains(r));
            let makes = ["reqwest::Client::new()", "reqwest::Client::builder()"];
            let makes = makes.iter().any(|m| l.contains(m));
            let calls = [".get(", ".post(", ".request(", ".send("].iter().any(|c| l.contains(c));
            let request = l.contains("reqwest::") && (!makes || calls);
            !client(f) && (route || request || l.contains("http://"))
        })
        .map(|(f, n, l)| format!("{f}:{n}: {}", l.trim()))
        .collect();
    assert!(
        elsewhere.is_empty(),
        "call engines through engine_client.rs:\n{}",
        elsewhere.join("\n")
    );
    Ok(())
}

#[test]
fn the_gateway_links_billing_without_its_server() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |f: &str| std::fs::read_to_string(root.join(f));
    let dep = |manifest: &str, name: &str| -> anyhow::Result<Option<String>> {
        let text = read(manifest)?;
        Ok(text.lines().map(str::trim).find(|l| l.starts_with(name)).map(str::to_owned))
    };
    // The workspace declares billing without its default features; only the binary, which
    // runs the billing service, asks for the server.
    let declared = dep("Cargo.toml", "sluice-billing = { path")?.unwrap_or_default();
    assert!(declared.contains("default-features = false"), "workspace: {declared:?}");
    assert!(!declared.contains("server"), "the workspace gives everyone billing's server");
    // Every mention in the gateway's manifest, in any dependency table.
    let gateway = read("gateway/Cargo.toml")?;
    let mentions: Vec<&str> =
        gateway.lines().map(str::trim).filter(|l| l.contains("sluice-billing")).collect();
    assert_eq!(
        mentions,
        ["sluice-billing.workspace = true"],
        "the gateway asks for more of billing"
    );
    let binary = read("Cargo.toml")?;
    assert!(binary.contains(r#"sluice-billing = { workspace = true, features = ["server"] }"#));
    // The server's parts are behind the feature, and so are the crates only they need.
    let lib = read("billing/src/lib.rs")?;
    for module in ["api", "auth", "bench", "retention"] {
        let gated = format!("#[cfg(feature = \"server\")]\npub mod {module};");
        assert!(lib.contains(&gated), "billing's {module} is not behind the server feature");
    }
    let manifest = read("billing/Cargo.toml")?;
    for server_only in ["axum", "jsonwebtoken"] {
        let optional = format!("{server_only} = {{ workspace = true, optional = true }}");
        assert!(manifest.contains(&optional), "billing needs {server_only} without its server");
    }
    assert!(manifest.contains(r#"server = ["dep:axum", "dep:jsonwebtoken"]"#), "{manifest}");
    // Prices and the Redis connection are the policies crate's: the gateway does not reach
    // for them through billing.
    let mut lines = Vec::new();
    code_lines_cased(&root.join("gateway/src"), &mut lines, false)?;
    assert!(lines.iter().any(|(.., l)| l.contains("sluice_policies::redis_conn")));
    let through: Vec<String> = lines
        .iter()
        .filter(|(.., l)| {
            let named = ["prices", "redis_conn", "is_refused"].iter().any(|m| l.contains(m));
            named && l.contains("sluice_billing::")
        })
        .map(|(f, n, l)| format!("{f}:{n}: {}", l.trim()))
        .collect();
    assert!(through.is_empty(), "read these from sluice_policies:\n{}", through.join("\n"));
    Ok(())
}

/// The name of the function `line` (trimmed) declares, if it declares one.
fn declared_fn(line: &str) -> Option<&str> {
    let mut rest = line;
    loop {
        let before = rest;
        for prefix in ["pub(crate) ", "pub(super) ", "pub ", "const ", "async ", "unsafe "] {
            rest = rest.strip_prefix(prefix).unwrap_or(rest);
        }
        if rest == before {
            break;
        }
    }
    let rest = rest.strip_prefix("fn ")?;
    rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().filter(|n| !n.is_empty())
}

/// The functions in `lines` ([`code_lines_cased`]) longer than `max` lines, from the `fn` line
/// to the `}` at its indent, comments counted: `(file, line, name, length)`. A declaration
/// without a body (a trait's) has none.
fn long_functions(
    lines: &[(String, usize, String)],
    max: usize,
) -> Vec<(String, usize, String, usize)> {
    let mut long = Vec::new();
    for (i, (file, at, line)) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let Some(name) = declared_fn(trimmed) else { continue };
        let indent = &line[..line.len() - trimmed.len()];
        let rest = || lines[i..].iter().take_while(|(f, ..)| f == file);
        let opens = rest().find(|(.., l)| l.contains('{') || l.trim_end().ends_with(';'));
        let Some((.., opening)) = opens.filter(|(.., l)| l.contains('{')) else { continue };
        // A body closed on the line that opens it (`fn f() {}`) is one line.
        if opening.matches('{').count() == opening.matches('}').count() {
            continue;
        }
        let close = rest().skip(1).find(|(.., l)| l.strip_prefix(indent) == Some("}"));
        if let Some((_, end, _)) = close
            && end - at + 1 > max
        {
            long.push((file.clone(), *at, name.to_owned(), end - at + 1));
        }
    }
    long
}

#[test]
fn no_function_of_the_gateway_the_platform_or_the_binary_is_over_120_lines() -> anyhow::Result<()> {
    // The measure itself: a 130-line function is long; a 10-line one, a one-line body and a
    // trait's declaration are not.
    let mut sample = vec![(1, "trait T {".to_owned()), (2, "    fn declared(&self);".to_owned())];
    sample.push((3, "}".to_owned()));
    sample.push((4, "fn empty() {}".to_owned()));
    sample.push((5, "pub async fn long() {".to_owned()));
    sample.extend((6..134).map(|n| (n, format!("    let _x{n} = {n};"))));
    sample.push((134, "}".to_owned()));
    sample.push((135, "    fn short() {".to_owned()));
    sample.extend((136..144).map(|n| (n, "        ();".to_owned())));
    sample.push((144, "    }".to_owned()));
    let sample: Vec<_> = sample.into_iter().map(|(n, l)| ("s.rs".to_owned(), n, l)).collect();
    assert_eq!(long_functions(&sample, 120), [("s.rs".to_owned(), 5, "long".to_owned(), 130)]);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut lines = Vec::new();
    for dir in ["gateway/src", "platform/src", "src"] {
        code_lines_cased(&root.join(dir), &mut lines, false)?;
    }
    let measured = lines.iter().filter(|(.., l)| declared_fn(l.trim_start()).is_some()).count();
    assert!(measured > 200, "only {measured} functions found");
    let long = long_functions(&lines, 120);
    assert!(long.is_empty(), "functions over 120 lines (split them): {long:#?}");
    Ok(())
}

#[test]
fn the_binary_only_parses_flags_and_calls_libraries() -> anyhow::Result<()> {
    // Its size is the measure: 1,500 lines hold the commands' flags and their wiring.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut lines = 0;
    for entry in std::fs::read_dir(root.join("src"))? {
        let path = entry?.path();
        lines += std::fs::read_to_string(&path)?.lines().count();
    }
    assert!(lines > 500, "src/ read as {lines} lines");
    assert!(lines <= 1_500, "src/ is {lines} lines: move what is not flags into a library");
    Ok(())
}
