//! Sluice assembled from its crates, for the `sluice` binary to call: the whole platform in
//! one process ([`up`]: engines, billing on SQLite and the gateway, and `sluice gateway`
//! alone), the benchmark of the gateway with an engine and the ledger in the same process
//! ([`gateway_bench`]), the billing service's command and the admin and audit client of its
//! API ([`admin`]), the ledger's reconciliation against the engines' outcome journals
//! ([`reconcile`]), and tracing's setup ([`telemetry`]). Every command's flags are parsed by
//! the binary with the clap types defined here.

pub mod admin;
pub mod gateway_bench;
pub mod reconcile;
pub mod telemetry;
pub mod up;

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
