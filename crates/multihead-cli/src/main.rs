//! The `multihead` command: the demo, sentence embeddings, benchmarks, and PyTorch parity
//! cases (replay, check).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// `println!` for the command's output: when standard output is closed (`multihead check |
/// head -1`), the process ends quietly with success instead of panicking.
macro_rules! say {
    ($($arg:tt)*) => { $crate::say(format_args!($($arg)*)) };
}

mod bench;
mod bench_decode;
mod bench_linear;
mod bench_sdpa;
mod bert_tokenizer;
mod demo;
mod demo_seq2seq;
mod dense;
mod embed;
mod limits;
mod minilm;
mod plot;
mod sentence;
use multihead::Backend;
use multihead_parity::{self as parity, Case};

/// mimalloc, with freed blocks of 128 KiB and more kept for reuse (up to 4 GiB): every training
/// or inference step allocates the same large tensors again, and reusing them avoids faulting
/// fresh pages in each time (see `multihead::memory`).
#[global_allocator]
pub(crate) static GLOBAL: multihead::memory::ReuseLarge<mimalloc::MiMalloc> =
    multihead::memory::ReuseLarge::new(mimalloc::MiMalloc, 4 << 30);

/// PyTorch-exact multi-head attention: tools around the `multihead` library.
///
/// demo: train a small Transformer and draw its attention; embed: all-MiniLM-L6-v2 sentence
/// embeddings; bench: time MultiheadAttention, a Transformer layer or a decoding step;
/// replay: run one PyTorch parity case; check: replay parity cases and compare with PyTorch's
/// numbers.
#[derive(Parser, Debug)]
#[command(name = "multihead", version)]
struct Cli {
    /// Which attention implementation runs: auto (fused kernels where they apply), composed
    /// (candle operations only) or fused (the kernels, or an error). Without the flag, the
    /// environment variable MULTIHEAD_NO_FUSED set to anything but empty or 0 means composed.
    #[arg(long, global = true)]
    backend: Option<Backend>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a small Transformer built from this crate to reverse digit sequences, then draw
    /// its attention.
    Demo(demo::DemoArgs),
    /// Sentence embeddings with all-MiniLM-L6-v2 (or another BERT sentence-transformers
    /// model) built from this crate's encoder layers.
    Embed(embed::EmbedArgs),
    /// Time MultiheadAttention, a Transformer layer or one decoding step (batch_first, f32 or
    /// bf16) on one shape.
    Bench(bench::BenchArgs),
    /// Replay one PyTorch parity case and write what this library computes.
    Replay {
        /// The case directory (case.json + case.safetensors).
        case_dir: PathBuf,
        /// Where to write the results (safetensors).
        #[arg(long)]
        out: PathBuf,
    },
    /// Replay cases and compare with PyTorch's expected tensors. A directory without a
    /// case.json is searched for cases below it.
    Check {
        /// Case directories, or directories holding case directories.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// Print every compared tensor, not just the worst per case.
        #[arg(long)]
        verbose: bool,
    },
}

fn main() -> ExitCode {
    pin_thread_count();
    let cli = Cli::parse();
    // A misspelt MULTIHEAD_BF16_PRODUCTS or MULTIHEAD_BF16_KERNEL is refused, not ignored.
    if let Err(e) = multihead::check_bf16_environment() {
        eprintln!("multihead: {e}");
        return ExitCode::from(2);
    }
    let backend = match cli.backend {
        Some(b) => b,
        None if std::env::var_os("MULTIHEAD_NO_FUSED")
            .is_some_and(|v| !v.is_empty() && v != "0") =>
        {
            Backend::Composed
        }
        None => Backend::Auto,
    };
    multihead::with_backend(backend, || run(cli.command))
}

/// Sets RAYON_NUM_THREADS to candle's own choice when it is unset, before any thread starts:
/// candle asks for its thread count on every matrix product, and without the variable each
/// ask parses /proc/cpuinfo (measured: 4.7% of the demo's training time). The count itself is
/// unchanged.
fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        // The first statement of `main`: no other thread reads the environment yet.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

fn run(command: Command) -> ExitCode {
    match command {
        Command::Demo(args) => finish("demo", demo::run(args)),
        Command::Embed(args) => finish("embed", embed::run(args)),
        Command::Bench(args) => finish("bench", bench::run(args)),
        Command::Replay { case_dir, out } => replay(&case_dir, &out),
        Command::Check { dirs, verbose } => check(&dirs, verbose),
    }
}

/// Writes one line of the command's output (see `say!`): a closed standard output ends the
/// process with success, as the reader has all it wanted; any other write error ends it with
/// failure and a message.
pub(crate) fn say(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.write_all(b"\n")) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("multihead: cannot write the output: {e}");
        std::process::exit(1);
    }
}

/// Whether an error is (or was caused by) writing to a closed pipe.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Turns a command's result into the exit code, printing the error chain on stderr (a closed
/// standard output is a quiet success, as in `say`).
fn finish(command: &str, result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("multihead {command}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn replay(case_dir: &Path, out: &Path) -> ExitCode {
    let run = || -> multihead::Result<()> {
        let case = Case::load(case_dir)?;
        refuse_own_files(case_dir, out)?;
        let result = parity::replay(&case)?;
        multihead::state_dict::save_safetensors(result.iter().map(|(k, t)| (k.as_str(), t)), out)
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Errors about the case's files already name its directory.
            match e {
                multihead::Error::File { .. } => eprintln!("multihead replay: {e}"),
                _ => eprintln!("multihead replay: {}: {e}", case_dir.display()),
            }
            ExitCode::FAILURE
        }
    }
}

/// `--out` must not be one of the case's own files: the results would replace its tensors
/// (or its case.json), and the case could not be checked again.
fn refuse_own_files(case_dir: &Path, out: &Path) -> multihead::Result<()> {
    // An output that does not exist yet cannot be one of the case's files.
    let Ok(target) = std::fs::canonicalize(out) else { return Ok(()) };
    for own in ["case.safetensors", "case.json"] {
        if std::fs::canonicalize(case_dir.join(own)).is_ok_and(|p| p == target) {
            return Err(multihead::Error::File {
                path: out.to_path_buf(),
                msg: format!("--out is the case's own {own}; write the results to another file"),
            });
        }
    }
    Ok(())
}

fn check(dirs: &[PathBuf], verbose: bool) -> ExitCode {
    let found = parity::find_cases(dirs);
    for note in &found.notes {
        eprintln!("multihead check: {note}");
    }
    if found.cases.is_empty() {
        let roots: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        eprintln!(
            "multihead check: no case found under {} (a case is a directory holding case.json and case.safetensors)",
            roots.join(", ")
        );
        say!("0 passed, 0 failed");
        return ExitCode::FAILURE;
    }
    let (mut passed, mut failed) = (0usize, 0usize);
    for dir in &found.cases {
        let outcome = Case::load(dir).and_then(|case| parity::check(&case));
        match outcome {
            Ok(checks) if !checks.is_empty() => {
                let ok = checks.iter().all(|c| c.passed);
                let Some(worst) =
                    checks.iter().max_by(|a, b| a.worst_ratio.total_cmp(&b.worst_ratio))
                else {
                    continue;
                };
                say!(
                    "{} {}: worst {} max|diff| {:.3e} ({:.3} of tolerance){}",
                    if ok { "ok  " } else { "FAIL" },
                    dir.display(),
                    worst.name,
                    worst.max_abs,
                    worst.worst_ratio,
                    worst.note.as_deref().map(|n| format!(" [{n}]")).unwrap_or_default()
                );
                if verbose || !ok {
                    for c in checks.iter().filter(|c| verbose || !c.passed) {
                        say!(
                            "     {} {}: max|diff| {:.3e} ({:.3} of tolerance){}",
                            if c.passed { "ok  " } else { "FAIL" },
                            c.name,
                            c.max_abs,
                            c.worst_ratio,
                            c.note.as_deref().map(|n| format!(" [{n}]")).unwrap_or_default()
                        );
                    }
                }
                if ok {
                    passed += 1;
                } else {
                    failed += 1;
                }
            }
            Ok(_) => {
                say!("FAIL {}: the case has no expect.* tensors", dir.display());
                failed += 1;
            }
            Err(e) => {
                // An error about the case directory itself names it once.
                let reason = match &e {
                    multihead::Error::File { path, msg } if path.as_path() == dir.as_path() => {
                        msg.clone()
                    }
                    _ => e.to_string(),
                };
                say!("FAIL {}: {reason}", dir.display());
                failed += 1;
            }
        }
    }
    say!("{passed} passed, {failed} failed");
    if failed == 0 && passed > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
