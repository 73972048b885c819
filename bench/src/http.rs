//! `sluice bench engine`'s HTTP-through points: `sluice engine` and, given `--llama-server`,
//! llama.cpp's `llama-server` on the same model file, each started here as a child process
//! and driven in turn by the same closed-loop client (`sluice bench serve`'s, streamed
//! completions of token-id prompts, `ignore_eos`), so the ratio is measured in one run over
//! the interface users use.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::metrics::Summary;
use crate::serve::BenchServeArgs;
use anyhow::{Context, bail};
use clap::Parser;

/// A server started for the benchmark, killed when dropped.
pub struct Server {
    /// What it is, for the table.
    pub name: String,
    /// `http://127.0.0.1:PORT`.
    pub base_url: String,
    child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the servers are started with.
pub struct ServerSpec<'a> {
    /// The `sluice` executable that serves `sluice engine`.
    pub sluice: &'a Path,
    /// The model file both load.
    pub model: &'a Path,
    /// Compute threads.
    pub threads: usize,
    /// Most concurrent streams.
    pub streams: usize,
    /// Longest request (prompt and output), tokens.
    pub max_request_tokens: usize,
    /// The engine's KV cache, MiB.
    pub kv_cache_mb: usize,
    /// The engine's KV cache element type.
    pub kv_cache_dtype: String,
}

/// `sluice engine` on a free port.
pub fn start_sluice(spec: &ServerSpec<'_>) -> anyhow::Result<Server> {
    let mut cmd = Command::new(spec.sluice);
    cmd.arg("engine")
        .arg("--model")
        .arg(spec.model)
        .args(["--listen", "127.0.0.1:0", "--threads", &spec.threads.to_string()])
        .args(["--max-num-seqs", &spec.streams.to_string()])
        .args(["--kv-cache-mb", &spec.kv_cache_mb.to_string()])
        .args(["--kv-cache-dtype", &spec.kv_cache_dtype])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().context("starting sluice engine")?;
    let stdout = child.stdout.take().context("sluice engine's stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let addr = loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some(a) = line.strip_prefix("listening on ") {
                    break a.trim().to_owned();
                }
            }
            _ => {
                let _ = child.kill();
                bail!("sluice engine exited before listening");
            }
        }
    };
    // Keep reading its stdout so it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    Ok(Server { name: "sluice engine".into(), base_url: addr, child })
}

/// `llama-server` (`bin`) on a free port, waited for until it serves.
pub fn start_llama_server(bin: &Path, spec: &ServerSpec<'_>) -> anyhow::Result<Server> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let ctx = spec.streams * spec.max_request_tokens;
    let mut cmd = Command::new(bin);
    cmd.arg("-m")
        .arg(spec.model)
        .args(["-t", &spec.threads.to_string(), "-np", &spec.streams.to_string()])
        .args(["-c", &ctx.to_string(), "--host", "127.0.0.1", "--port", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // Its shared libraries sit beside it.
    if let Some(dir) = bin.parent() {
        let mut path = std::ffi::OsString::from(dir);
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            path.push(":");
            path.push(old);
        }
        cmd.env("LD_LIBRARY_PATH", path);
    }
    let child = cmd.spawn().with_context(|| format!("starting {}", bin.display()))?;
    let mut server =
        Server { name: "llama-server".into(), base_url: format!("http://127.0.0.1:{port}"), child };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = server.child.try_wait()? {
            bail!("{} exited with {status} before serving", bin.display());
        }
        if health_ok(port) {
            return Ok(server);
        }
        if Instant::now() > deadline {
            bail!("{} did not become healthy within 120 s", bin.display());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Whether `GET /health` on `port` answers 200.
fn health_ok(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req =
        format!("GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// One closed-loop level against `server`: `streams` streams of `rounds` requests each (the
/// model named as the server lists it).
pub fn measure(
    server: &Server,
    streams: usize,
    rounds: usize,
    prompt_tokens: usize,
    output_tokens: usize,
) -> anyhow::Result<Summary> {
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        args: BenchServeArgs,
    }
    let argv: Vec<String> = [
        "bench-serve",
        "--base-url",
        &server.base_url,
        "--endpoint",
        "completions",
        "--request-rate",
        "inf",
        "--max-concurrency",
        &streams.to_string(),
        "--num-prompts",
        &(streams * rounds).to_string(),
        "--input-len",
        &prompt_tokens.to_string(),
        "--output-len",
        &output_tokens.to_string(),
        "--warmup",
        "1",
        "--seed",
        &format!("{streams}{prompt_tokens}"),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let args = Wrap::try_parse_from(argv).context("the closed-loop client's arguments")?.args;
    let run = crate::serve::measure(&args, true)
        .with_context(|| format!("measuring {} at {streams} streams", server.name))?;
    if run.summary.failed > 0 || run.summary.completed == 0 {
        bail!(
            "{} at {streams} streams: {} of {} requests failed",
            server.name,
            run.summary.failed,
            streams * rounds
        );
    }
    Ok(run.summary)
}

/// One row of the HTTP table: both servers at one level.
pub struct HttpRow {
    /// Streams.
    pub streams: usize,
    /// Prompt and output tokens per request.
    pub shape: (usize, usize),
    /// Sluice's figures.
    pub sluice: Summary,
    /// llama-server's, when it ran.
    pub llama: Option<Summary>,
}

impl HttpRow {
    /// The table's header.
    pub const HEADER: &str = "streams  prompt/out  sluice tok/s  llama tok/s  ratio  \
                              TTFT p50 sluice/llama     TPOT p50 sluice/llama   decode ratio";

    /// As JSON.
    pub fn json(&self) -> serde_json::Value {
        let part = |s: &Summary| {
            serde_json::json!({
                "output_tokens_per_second": s.output_throughput,
                "ttft_p50_ms": s.ttft_ms.median,
                "ttft_p99_ms": s.ttft_ms.p99,
                "tpot_p50_ms": s.tpot_ms.median,
                "completed": s.completed,
            })
        };
        serde_json::json!({
            "point": "http",
            "streams": self.streams,
            "prompt_tokens": self.shape.0,
            "output_tokens": self.shape.1,
            "sluice": part(&self.sluice),
            "llama_server": self.llama.as_ref().map(part),
            "throughput_ratio": self.llama.as_ref().map(|l| self.sluice.output_throughput / l.output_throughput),
            "decode_ratio": self.llama.as_ref().map(|l| l.tpot_ms.median / self.sluice.tpot_ms.median),
        })
    }
}

impl std::fmt::Display for HttpRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.sluice;
        let shape = format!("{}/{}", self.shape.0, self.shape.1);
        match &self.llama {
            Some(l) => write!(
                f,
                "{:>7}  {:>10}  {:>12.1}  {:>11.1}  {:>4.2}x  {:>8.0} / {:>6.0} ms  {:>8.1} / {:>6.1} ms   {:>5.2}x",
                self.streams,
                shape,
                s.output_throughput,
                l.output_throughput,
                s.output_throughput / l.output_throughput,
                s.ttft_ms.median,
                l.ttft_ms.median,
                s.tpot_ms.median,
                l.tpot_ms.median,
                l.tpot_ms.median / s.tpot_ms.median,
            ),
            None => write!(
                f,
                "{:>7}  {:>10}  {:>12.1}  {:>11}  {:>5}  {:>8.0} / {:>6} ms  {:>8.1} / {:>6} ms   {:>6}",
                self.streams,
                shape,
                s.output_throughput,
                "-",
                "-",
                s.ttft_ms.median,
                "-",
                s.tpot_ms.median,
                "-",
                "-"
            ),
        }
    }
}

/// Every level through HTTP: Sluice's server first, then llama-server's, at each
/// (streams, prompt, output) level of `levels`.
pub fn run(
    spec: &ServerSpec<'_>,
    llama_server: Option<&PathBuf>,
    levels: &[(usize, usize, usize)],
    rounds: usize,
) -> anyhow::Result<Vec<HttpRow>> {
    let mut sluice = Vec::new();
    {
        let server = start_sluice(spec)?;
        for &(streams, p, o) in levels {
            sluice.push(measure(&server, streams, rounds, p, o)?);
        }
    }
    let mut llama = Vec::new();
    if let Some(bin) = llama_server {
        // Sluice's figures are kept (with no ratio) when the baseline cannot run.
        match start_llama_server(bin, spec) {
            Ok(server) => {
                for &(streams, p, o) in levels {
                    llama.push(measure(&server, streams, rounds, p, o)?);
                }
            }
            Err(e) => eprintln!("the baseline did not run: {e:#}"),
        }
    }
    let mut llama = llama.into_iter();
    Ok(levels
        .iter()
        .zip(sluice)
        .map(|(&(streams, p, o), s)| HttpRow {
            streams,
            shape: (p, o),
            sluice: s,
            llama: llama.next(),
        })
        .collect())
}
