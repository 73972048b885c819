//! The adapters an engine serves: read from a content-addressed store, loaded off the step
//! thread, kept in a bounded residency set.
//!
//! The gateway resolves a tenant's adapter name to `tenant/name@sha256:HEX` and sends it in
//! [`ADAPTER_HEADER`]; the engine finds `STORE/HEX` (a PEFT directory) or `STORE/HEX.gguf` (a
//! GGUF LoRA), loads it against its base model on a blocking thread (the request waits, the
//! step thread and everyone else's requests do not), checks that its canonical revision is the
//! one named (a store entry that does not hash to its name is refused, never served), and keeps
//! it while it fits `--adapter-memory-mb`. An adapter some request holds is never evicted:
//! when the set is full of adapters in use, a request for another waits until one is let go
//! (or [`MEMORY_WAIT`] passes: a 503), so a flood of distinct adapters cannot evict everyone's
//! working set.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use sluice_wire::header::ADAPTER as ADAPTER_HEADER;

use crate::lora::LoraAdapter;
use crate::model::LlamaConfig;
use crate::server::error::ApiError;

/// How long a request waits for room in a set full of adapters in use.
pub const MEMORY_WAIT: Duration = Duration::from_secs(30);
/// The longest tenant or adapter name.
const MAX_NAME: usize = 64;

/// An adapter as a request names it: `tenant/name@sha256:HEX`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AdapterRef {
    /// The owning tenant.
    pub tenant: String,
    /// Its name within the tenant.
    pub name: String,
    /// 64 lowercase hex digits: the canonical revision's SHA-256.
    pub hex: String,
}

impl AdapterRef {
    /// Parses `tenant/name@sha256:HEX`; the message says what is wrong.
    pub fn parse(s: &str) -> Result<AdapterRef, String> {
        let bad = || {
            format!(
                "{ADAPTER_HEADER} must be TENANT/NAME@sha256:HEX (names of 1 to {MAX_NAME} \
                 characters of [A-Za-z0-9-_.], 64 lowercase hex digits)"
            )
        };
        let (path, rev) = s.split_once('@').ok_or_else(bad)?;
        let (tenant, name) = path.split_once('/').ok_or_else(bad)?;
        let hex = rev.strip_prefix("sha256:").ok_or_else(bad)?;
        let name_ok = |n: &str| {
            !n.is_empty()
                && n.len() <= MAX_NAME
                && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        };
        let hex_ok = hex.len() == 64
            && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !(name_ok(tenant) && name_ok(name) && hex_ok) {
            return Err(bad());
        }
        Ok(AdapterRef { tenant: tenant.into(), name: name.into(), hex: hex.into() })
    }

    /// `sha256:HEX`.
    pub fn revision(&self) -> String {
        format!("sha256:{}", self.hex)
    }
}

impl std::fmt::Display for AdapterRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}@sha256:{}", self.tenant, self.name, self.hex)
    }
}

/// Where a revision lives in a store: a PEFT directory named by its hex digits, or a GGUF
/// LoRA file named by them with `.gguf`.
pub fn store_entry(store: &Path, hex: &str) -> Option<PathBuf> {
    let dir = store.join(hex);
    if dir.is_dir() {
        return Some(dir);
    }
    let file = store.join(format!("{hex}.gguf"));
    file.is_file().then_some(file)
}

/// What the set has done, for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AdapterStats {
    /// Adapters loaded from the store.
    pub loads: u64,
    /// Seconds spent loading them.
    pub load_seconds: f64,
    /// Adapters evicted to make room.
    pub evictions: u64,
    /// Requests that waited for room.
    pub memory_waits: u64,
    /// Adapters resident now.
    pub resident: usize,
    /// Their bytes.
    pub resident_bytes: usize,
}

impl AdapterStats {
    /// The figures as OpenMetrics text (`sluice_engine_adapter_*`).
    pub fn exposition(&self) -> String {
        let mut out = String::new();
        for (name, kind, help, value) in [
            (
                "sluice_engine_adapter_loads",
                "counter",
                "Tenant adapters loaded from the store",
                self.loads.to_string(),
            ),
            (
                "sluice_engine_adapter_load_seconds",
                "counter",
                "Seconds spent loading tenant adapters",
                self.load_seconds.to_string(),
            ),
            (
                "sluice_engine_adapter_evictions",
                "counter",
                "Tenant adapters evicted to make room",
                self.evictions.to_string(),
            ),
            (
                "sluice_engine_adapter_memory_waits",
                "counter",
                "Requests that waited for adapter memory held by running requests",
                self.memory_waits.to_string(),
            ),
            (
                "sluice_engine_adapters_resident",
                "gauge",
                "Tenant adapters resident",
                self.resident.to_string(),
            ),
            (
                "sluice_engine_adapter_resident_bytes",
                "gauge",
                "Bytes the resident tenant adapters take",
                self.resident_bytes.to_string(),
            ),
        ] {
            let sample = if kind == "counter" { format!("{name}_total") } else { name.to_owned() };
            out.push_str(&format!(
                "# HELP {name} {help}.\n# TYPE {name} {kind}\n{sample} {value}\n"
            ));
        }
        out
    }
}

struct Resident {
    adapter: Arc<LoraAdapter>,
    last_used: u64,
}

#[derive(Default)]
struct Inner {
    resident: HashMap<String, Resident>,
    loading: HashSet<String>,
    clock: u64,
    stats: AdapterStats,
}

/// The engine's adapters: the store it reads and the set it keeps.
pub struct AdapterSet {
    store: PathBuf,
    base: LlamaConfig,
    budget: usize,
    inner: Mutex<Inner>,
    changed: tokio::sync::Notify,
}

impl std::fmt::Debug for AdapterSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdapterSet")
            .field("store", &self.store)
            .field("budget", &self.budget)
            .finish()
    }
}

fn not_found(r: &AdapterRef) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("the adapter `{}/{}` does not exist on this engine", r.tenant, r.name),
        kind: "invalid_request_error",
        param: Some("model".into()),
        code: Some("model_not_found"),
    }
}

impl AdapterSet {
    /// A set over `store` for a base of configuration `base`, holding at most `budget` bytes.
    pub fn new(store: PathBuf, base: LlamaConfig, budget: usize) -> AdapterSet {
        AdapterSet {
            store,
            base,
            budget,
            inner: Mutex::new(Inner::default()),
            changed: tokio::sync::Notify::new(),
        }
    }

    /// The store it reads.
    pub fn store(&self) -> &Path {
        &self.store
    }

    /// What it has done so far.
    pub fn stats(&self) -> AdapterStats {
        let g = self.lock();
        AdapterStats {
            resident: g.resident.len(),
            resident_bytes: g.resident.values().map(|e| e.adapter.memory_bytes()).sum(),
            ..g.stats
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The adapter `r` names, loaded if it is not resident; a 404 when the store has no such
    /// revision, a 500 when its entry does not load or hash to its name, a 503 when no room
    /// is let go within [`MEMORY_WAIT`].
    pub async fn get(self: &Arc<Self>, r: &AdapterRef) -> Result<Arc<LoraAdapter>, ApiError> {
        // Resident, or loading for another request (then wait for it), or ours to load.
        loop {
            let notified = self.changed.notified();
            {
                let mut g = self.lock();
                g.clock += 1;
                let now = g.clock;
                if let Some(e) = g.resident.get_mut(&r.hex) {
                    e.last_used = now;
                    return Ok(Arc::clone(&e.adapter));
                }
                if !g.loading.contains(&r.hex) {
                    g.loading.insert(r.hex.clone());
                    break;
                }
            }
            // A lost wake-up costs at most this long.
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
        let loaded = self.load(r).await;
        let adapter = match loaded {
            Ok(a) => a,
            Err(e) => {
                self.lock().loading.remove(&r.hex);
                self.changed.notify_waiters();
                return Err(e);
            }
        };
        let admitted = self.admit(r, &adapter).await;
        self.lock().loading.remove(&r.hex);
        self.changed.notify_waiters();
        admitted.map(|()| adapter)
    }

    async fn load(&self, r: &AdapterRef) -> Result<Arc<LoraAdapter>, ApiError> {
        let Some(path) = store_entry(&self.store, &r.hex) else {
            return Err(not_found(r));
        };
        let base = self.base.clone();
        let began = Instant::now();
        let loaded = tokio::task::spawn_blocking(move || LoraAdapter::load(&path, &base))
            .await
            .map_err(|e| ApiError::internal(format!("loading adapter {r} failed: {e}")))?;
        let adapter = loaded.map_err(|e| {
            tracing::error!(adapter = %r, error = %e, "adapter store entry does not load");
            ApiError::internal(format!("adapter {}/{} does not load: {e}", r.tenant, r.name))
        })?;
        if adapter.revision != r.revision() {
            tracing::error!(adapter = %r, found = %adapter.revision, "adapter store entry does not hash to its name");
            return Err(ApiError::internal(format!(
                "adapter {}/{}: the store's entry hashes to {}, not the revision named",
                r.tenant, r.name, adapter.revision
            )));
        }
        let mut g = self.lock();
        g.stats.loads += 1;
        g.stats.load_seconds += began.elapsed().as_secs_f64();
        Ok(Arc::new(adapter))
    }

    /// Makes room for `adapter` (evicting the least recently used adapters no request holds)
    /// and keeps it; waits while every resident adapter is held.
    async fn admit(&self, r: &AdapterRef, adapter: &Arc<LoraAdapter>) -> Result<(), ApiError> {
        let bytes = adapter.memory_bytes();
        if bytes > self.budget {
            return Err(ApiError {
                status: StatusCode::INSUFFICIENT_STORAGE,
                message: format!(
                    "adapter {}/{} takes {} MiB, more than this engine's --adapter-memory-mb",
                    r.tenant,
                    r.name,
                    bytes.div_ceil(1 << 20)
                ),
                kind: "server_error",
                param: None,
                code: Some("adapter_too_large"),
            });
        }
        let deadline = Instant::now() + MEMORY_WAIT;
        let mut waited = false;
        loop {
            let notified = self.changed.notified();
            {
                let mut g = self.lock();
                let mut used: usize = g.resident.values().map(|e| e.adapter.memory_bytes()).sum();
                while used + bytes > self.budget {
                    // The least recently used adapter no request holds (the set's own
                    // reference is the only one).
                    let victim = g
                        .resident
                        .iter()
                        .filter(|(_, e)| Arc::strong_count(&e.adapter) == 1)
                        .min_by_key(|(_, e)| e.last_used)
                        .map(|(k, _)| k.clone());
                    let Some(v) = victim else { break };
                    if let Some(e) = g.resident.remove(&v) {
                        used -= e.adapter.memory_bytes();
                        g.stats.evictions += 1;
                    }
                }
                if used + bytes <= self.budget {
                    g.clock += 1;
                    let last_used = g.clock;
                    g.resident.insert(
                        r.hex.clone(),
                        Resident { adapter: Arc::clone(adapter), last_used },
                    );
                    return Ok(());
                }
                if !waited {
                    g.stats.memory_waits += 1;
                    waited = true;
                }
            }
            if Instant::now() >= deadline {
                return Err(ApiError {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    message: format!(
                        "adapter {}/{}: this engine's adapter memory is held by running requests; \
                         retry later",
                        r.tenant, r.name
                    ),
                    kind: "server_error",
                    param: None,
                    code: Some("adapter_memory_full"),
                });
            }
            // Requests let adapters go when they end, without a signal: look again soon.
            let _ = tokio::time::timeout(Duration::from_millis(20), notified).await;
        }
    }
}

/// Checks the adapter at `src` (a PEFT directory or a GGUF LoRA) against a base of
/// configuration `base` and copies it into `store` under its revision (`HEX/` with PEFT's two
/// files, or `HEX.gguf`), through a temporary name and a rename, so an engine never reads a
/// half-written entry. An entry already there is kept. Returns the adapter.
pub fn put_in_store(src: &Path, base: &LlamaConfig, store: &Path) -> crate::Result<LoraAdapter> {
    use crate::error::EngineError;
    use crate::lora::{PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE};
    let adapter = LoraAdapter::load(src, base)?;
    let hex = adapter.revision.trim_start_matches("sha256:");
    std::fs::create_dir_all(store).map_err(|e| EngineError::io(store, e))?;
    if store_entry(store, hex).is_some() {
        return Ok(adapter);
    }
    let tmp = store.join(format!(".{hex}.{}", std::process::id()));
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to).map(|_| ()).map_err(|e| EngineError::io(from, e))
    };
    let dst = if src.is_dir() {
        std::fs::create_dir_all(&tmp).map_err(|e| EngineError::io(&tmp, e))?;
        for f in [PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE] {
            copy(&src.join(f), &tmp.join(f))?;
        }
        store.join(hex)
    } else {
        copy(src, &tmp)?;
        store.join(format!("{hex}.gguf"))
    };
    std::fs::rename(&tmp, &dst).map_err(|e| EngineError::io(&dst, e))?;
    Ok(adapter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapter_refs_parse_strictly() {
        let hex = "ab".repeat(32);
        let r = AdapterRef::parse(&format!("acme/support-v2@sha256:{hex}"));
        assert_eq!(
            r,
            Ok(AdapterRef { tenant: "acme".into(), name: "support-v2".into(), hex: hex.clone() })
        );
        assert_eq!(r.map(|r| r.to_string()), Ok(format!("acme/support-v2@sha256:{hex}")));
        for bad in [
            "acme/support".to_string(),
            format!("acme@sha256:{hex}"),
            format!("acme/support@{hex}"),
            format!("acme/support@sha256:{}", "AB".repeat(32)),
            format!("acme/support@sha256:{}", &hex[..62]),
            format!("acme/../x@sha256:{hex}"),
            format!("/support@sha256:{hex}"),
            format!("acme/sup port@sha256:{hex}"),
            format!("{}/x@sha256:{hex}", "a".repeat(65)),
        ] {
            let e = AdapterRef::parse(&bad);
            assert!(e.as_ref().is_err_and(|m| m.contains(ADAPTER_HEADER)), "{bad}: {e:?}");
        }
    }
}
