//! The operator's policy files: `models.json` (aliases), `prices.json`, `sampling.json`,
//! `scheduling.json` and `tiers.json`. Every service reads them through [`text`]: from the
//! directory named at start (`--policies DIR` or `SLUICE_POLICIES`) where it holds the file,
//! else the copy in this folder, compiled into the binary. Each is read once, at its first use
//! after start: a change takes effect on restart (no reload on a signal), and a service
//! refuses to start on a file that does not parse (its checker names the file and the field).
//!
//! Beside them, what the gateway and billing both need and neither owns: the price list in
//! force and its one charging rule ([`prices`]), and the Redis connection ([`redis_conn`]).

pub mod prices;
pub mod redis_conn;

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Every policy file, with its compiled-in copy.
pub const FILES: [(&str, &str); 5] = [
    ("models.json", include_str!("../models.json")),
    ("prices.json", include_str!("../prices.json")),
    ("sampling.json", include_str!("../sampling.json")),
    ("scheduling.json", include_str!("../scheduling.json")),
    ("tiers.json", include_str!("../tiers.json")),
];

static DIR: OnceLock<PathBuf> = OnceLock::new();

/// Reads the policy files from `dir` from now on (those it holds; the others stay the
/// compiled-in copies). Once per process, before the first read: a second directory is an
/// error, as is a path that is not a directory.
pub fn use_dir(dir: &Path) -> Result<(), String> {
    if !dir.is_dir() {
        return Err(format!("{}: not a directory", dir.display()));
    }
    let dir = dir.to_path_buf();
    let set = DIR.get_or_init(|| dir.clone());
    if *set != dir {
        return Err(format!("policies already read from {}", set.display()));
    }
    Ok(())
}

/// The directory the policy files are read from, if one was named.
pub fn dir() -> Option<&'static Path> {
    DIR.get().map(PathBuf::as_path)
}

/// The compiled-in copy of `name`.
pub fn compiled(name: &str) -> Option<&'static str> {
    FILES.iter().find(|(n, _)| *n == name).map(|&(_, text)| text)
}

/// Where `name` is read from: the named directory's file, or the compiled-in copy.
pub fn source(name: &str) -> String {
    match dir().map(|d| d.join(name)).filter(|p| p.is_file()) {
        Some(p) => p.display().to_string(),
        None => format!("policies/{name} (compiled in)"),
    }
}

/// The text of policy file `name`: the named directory's copy when it has one, else the
/// compiled-in one. An unknown name, or a file there that cannot be read, is an error naming it.
pub fn text(name: &str) -> Result<Cow<'static, str>, String> {
    let shipped = compiled(name).ok_or_else(|| format!("{name} is not a policy file"))?;
    match dir().map(|d| d.join(name)) {
        Some(p) if p.exists() => {
            std::fs::read_to_string(&p).map(Cow::Owned).map_err(|e| format!("{}: {e}", p.display()))
        }
        _ => Ok(Cow::Borrowed(shipped)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_come_from_the_directory_where_it_has_them() -> Result<(), String> {
        for (name, text) in FILES {
            assert!(text.trim_start().starts_with('{'), "{name}");
        }
        assert_eq!(text("prices.json")?, compiled("prices.json").unwrap_or_default());
        assert!(source("prices.json").ends_with("(compiled in)"));
        assert!(text("passwd").is_err());
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        std::fs::write(dir.path().join("prices.json"), "{\"version\": \"mine\"}")
            .map_err(|e| e.to_string())?;
        assert!(use_dir(&dir.path().join("nope")).is_err());
        use_dir(dir.path())?;
        assert!(use_dir(Path::new("/")).is_err(), "a second directory");
        assert_eq!(text("prices.json")?, "{\"version\": \"mine\"}");
        assert_eq!(source("prices.json"), dir.path().join("prices.json").display().to_string());
        // A file the directory does not have stays the compiled-in copy.
        assert_eq!(text("tiers.json")?, compiled("tiers.json").unwrap_or_default());
        Ok(())
    }
}
