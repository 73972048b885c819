//! The README's start path, run literally: every shell block marked `<!-- readme-test: NAME -->`
//! is run as written, in order, by a fresh `bash --noprofile --norc` with an empty environment
//! (only `PATH`, with this build's `sluice` on it, and `HOME`), in the directory whose `.sluice/`
//! a running `sluice up` wrote, as a newcomer's second shell would be. A block that fails, or
//! whose output is not what the README promises, fails the test: the README and this test change
//! together.

mod support;

use std::path::Path;
use std::process::Command;

use anyhow::{Context, ensure};
use support::{ensure_sdk, start_up};

/// The marked blocks of a Markdown text: (name, script).
fn marked_blocks(readme: &str) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        let Some(name) = line.trim().strip_prefix("<!-- readme-test: ") else { continue };
        let name = name.strip_suffix("-->").context("unclosed marker")?.trim().to_owned();
        let fence = lines.next().context("marker at the end")?;
        ensure!(fence.trim() == "```sh", "block {name}: the marker must precede a ```sh fence");
        let mut script = String::new();
        for l in lines.by_ref() {
            if l.trim() == "```" {
                break;
            }
            script.push_str(l);
            script.push('\n');
        }
        out.push((name, script));
    }
    Ok(out)
}

fn run_block(cwd: &Path, name: &str, script: &str) -> anyhow::Result<String> {
    let bin = Path::new(env!("CARGO_BIN_EXE_sluice")).parent().context("bin dir")?;
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let file = cwd.join(format!("readme-{name}.sh"));
    std::fs::write(&file, script)?;
    let out = Command::new("bash")
        .args(["--noprofile", "--norc", "-e", "-o", "pipefail"])
        .arg(&file)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", path)
        .env("HOME", std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
        .output()?;
    let stdout = String::from_utf8(out.stdout)?;
    ensure!(
        out.status.success(),
        "README block {name} failed ({}):\n{script}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

#[test]
fn the_readme_start_path_runs_as_written() -> anyhow::Result<()> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))?;
    let blocks = marked_blocks(&readme)?;
    let names: Vec<&str> = blocks.iter().map(|(n, _)| n.as_str()).collect();
    ensure!(names == ["sdk", "admin"], "the README's tested blocks changed: {names:?}");
    ensure_sdk()?;
    let tmp = tempfile::tempdir()?;
    let _up = start_up(&tmp.path().join(".sluice"))?;
    for (name, script) in &blocks {
        let out = run_block(tmp.path(), name, script)?;
        match name.as_str() {
            "sdk" => {
                // The model's answer to the README's question, sampled as the README says.
                let answer = out.trim();
                ensure!(
                    answer.len() > 3 && answer.contains('4'),
                    "the newcomer's first answer: {answer:?}"
                );
            }
            "admin" => {
                ensure!(out.contains("acme"), "tenant and key not shown:\n{out}");
                ensure!(out.contains("sk-sluice-"), "no key secret shown:\n{out}");
                // The auditor's CSV holds the SDK block's request, billed to the demo tenant.
                let csv: Vec<&str> =
                    out.lines().skip_while(|l| !l.starts_with("request_id,")).collect();
                let header = csv.first().context("no CSV header in the output")?;
                let cols: Vec<&str> = header.split(',').collect();
                let at = |c: &str| cols.iter().position(|h| *h == c).context(c.to_owned());
                let (tenant, finish) = (at("tenant_id")?, at("finish_reason")?);
                let rows: Vec<Vec<&str>> =
                    csv[1..].iter().map(|l| l.split(',').collect()).collect();
                ensure!(
                    rows.iter().any(|r| r.get(tenant) == Some(&"demo")
                        && r.get(finish).is_some_and(|f| *f == "stop" || *f == "length")),
                    "the SDK request is not in the auditor's records:\n{out}"
                );
            }
            _ => {}
        }
    }
    Ok(())
}
