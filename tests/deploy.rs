//! The deployment files (deploy/): `deploy/validate` checks the Kubernetes manifests against a
//! pinned Kubernetes schema, the kustomization, Prometheus and Grafana files, and that they
//! agree with the code (policies byte for byte, metric names, flags, probe paths). Its first
//! run installs its validator into a private virtual environment; later runs are offline.

use std::path::Path;
use std::process::Command;

#[test]
fn the_deployment_files_validate() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = root.join("deploy").join("validate");
    anyhow::ensure!(script.is_file(), "{} is missing", script.display());
    let out = Command::new("bash").arg(&script).current_dir(root).output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        out.status.success(),
        "deploy/validate failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    // It checked something: a validator that ran nothing is no check.
    anyhow::ensure!(
        stdout.contains("all checks passed") && stdout.contains("ok   schema"),
        "deploy/validate exited 0 without its checks:\n{stdout}\n{stderr}"
    );
    Ok(())
}
