//! `multihead demo`: train a small Transformer encoder, built from this crate, to reverse digit
//! sequences; print held-out accuracy and examples; draw the learned attention.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder, VarMap};
use multihead::optim::AdamW;
use multihead::transformer::{LayerConfig, TransformerEncoder};
use multihead::MhaOptions;

use crate::plot::{save_grid, Panel};

/// Settings of the demo run.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Training steps (default 600, which reach 100% held-out accuracy from 400 on for every
    /// seed tried; 400 with `--seq2seq`).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Seed for data, initialisation and dropout: the same seed gives the same run.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where to write the attention heat maps (default attention.png; the encoder demo only).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Sequences per training step, 1 to 65536.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Digits per sequence, 1 to 512.
    #[arg(long, default_value_t = 10)]
    pub seq_len: usize,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Exit with an error when the held-out accuracy ends below this fraction (0 to 1).
    #[arg(long)]
    pub require_accuracy: Option<f32>,
    /// Train an encoder-decoder `Transformer` instead and decode greedily with the KV cache,
    /// printing accuracy and tokens/s cached against recomputed.
    #[arg(long)]
    pub seq2seq: bool,
    /// The compute dtype. bf16 is mixed precision: f32 master weights updated by AdamW, the
    /// encoder and the output head computed under `multihead::autocast(BF16)` (parameters and
    /// activations rounded to bfloat16 at every module, gradients reaching the f32 weights).
    #[arg(long, value_enum, default_value_t = crate::bench::DTypeArg::F32)]
    pub dtype: crate::bench::DTypeArg,
}

pub(crate) const VOCAB: usize = 10;

/// A counter-based uniform draw, so data and initialisation follow `--seed` exactly.
pub(crate) fn uniform(seed: u64, stream: u64, i: u64) -> f32 {
    multihead::random::DropoutKey { seed, offset: stream }.uniform(0, 0, i)
}

struct Model {
    embed: Tensor,
    pos: Tensor,
    encoder: TransformerEncoder,
    head: multihead::Linear,
}

impl Model {
    fn new(vb: VarBuilder, d: usize, seq_len: usize) -> Result<Self> {
        let init = candle_nn::Init::Const(0.0);
        let embed = vb.get_with_hints((VOCAB, d), "embed.weight", init)?;
        let pos = vb.get_with_hints((seq_len, d), "pos", init)?;
        let cfg = LayerConfig::new(d, 4)
            .with_dim_feedforward(2 * d)
            .with_dropout(0.0)
            .with_batch_first(true);
        let encoder = TransformerEncoder::new(cfg, 2, None, vb.pp("encoder"))?;
        let head = multihead::Linear::new(d, VOCAB, true, vb.pp("head"))?;
        Ok(Self { embed, pos, encoder, head })
    }

    /// Token ids `(N, L)` → embeddings `(N, L, d)`.
    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (n, l) = ids.dims2()?;
        let x = self.embed.index_select(&ids.flatten_all()?, 0)?.reshape((n, l, ()))?;
        Ok(x.broadcast_add(&self.pos)?)
    }

    fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        let h = self.encoder.forward(&self.embed(ids)?, None, None, None)?;
        Ok(self.head.forward(&h)?)
    }

    /// Per layer, the per-head attention weights `(H, L, L)` of the first sequence in `ids`.
    fn attention(&self, ids: &Tensor) -> Result<Vec<Tensor>> {
        let mut x = self.embed(ids)?;
        let mut out = Vec::new();
        for layer in self.encoder.layers() {
            let o = layer.self_attn().forward(
                &x,
                &x,
                &x,
                &MhaOptions::default().average_attn_weights(false),
            )?;
            out.push(o.attn_weights.context("weights were asked for")?.get(0)?);
            x = layer.forward(&x, None, None, false)?;
        }
        Ok(out)
    }
}

/// Re-draws every parameter from `seed`: matrices Xavier-uniform (as `nn.Transformer`'s
/// `_reset_parameters`), biases zero, LayerNorm weights one.
pub(crate) fn seeded_init(vm: &VarMap, seed: u64) -> Result<()> {
    let data = vm.data().lock().map_err(|_| anyhow::anyhow!("poisoned var map"))?;
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for (stream, name) in names.iter().enumerate() {
        let var = &data[*name];
        let dims = var.dims().to_vec();
        let n: usize = dims.iter().product();
        let values: Vec<f32> = if dims.len() >= 2 {
            let (fan_out, fan_in) = (dims[0], dims[1..].iter().product::<usize>());
            let bound = (6.0 / (fan_in + fan_out) as f32).sqrt();
            (0..n)
                .map(|i| (2.0 * uniform(seed, 1000 + stream as u64, i as u64) - 1.0) * bound)
                .collect()
        } else if name.contains("norm") && name.ends_with("weight") {
            vec![1.0; n]
        } else {
            vec![0.0; n]
        };
        var.set(&Tensor::from_vec(values, dims, var.device())?)?;
    }
    Ok(())
}

/// A batch of random digit sequences and their reversals, `(N, L)` u32 each.
pub(crate) fn batch(
    seed: u64,
    stream: u64,
    n: usize,
    l: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let x: Vec<u32> = (0..n * l)
        .map(|i| (uniform(seed, stream, i as u64) * VOCAB as f32) as u32 % VOCAB as u32)
        .collect();
    let y: Vec<u32> =
        (0..n).flat_map(|r| (0..l).rev().map(move |c| (r, c))).map(|(r, c)| x[r * l + c]).collect();
    Ok((Tensor::from_vec(x, (n, l), dev)?, Tensor::from_vec(y, (n, l), dev)?))
}

pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (n, l, v) = logits.dims3()?;
    let logits = logits.reshape((n * l, v))?;
    let log_p = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let picked = log_p.gather(&targets.reshape((n * l, 1))?, 1)?;
    Ok(picked.mean_all()?.neg()?)
}

pub(crate) fn accuracy(logits: &Tensor, targets: &Tensor) -> Result<f32> {
    let pred = logits.argmax(D::Minus1)?;
    let hits = pred.eq(targets)?.to_dtype(DType::F32)?.mean_all()?;
    Ok(hits.to_scalar::<f32>()?)
}

/// The flags checked before training: sizes in range, the accuracy a fraction, and the
/// picture's path writable (not found out after the whole run).
fn check_args(args: &DemoArgs) -> Result<()> {
    use crate::limits::in_range;
    in_range("--batch", args.batch, 1, 1 << 16)?;
    in_range("--seq-len", args.seq_len, 1, 512)?;
    if let Some(a) = args.require_accuracy.filter(|a| !(0.0..=1.0).contains(a)) {
        anyhow::bail!("--require-accuracy must be a fraction between 0 and 1, got {a}");
    }
    if args.seq2seq {
        if args.dtype != crate::bench::DTypeArg::F32 {
            anyhow::bail!("--dtype bf16 applies to the encoder demo; run --seq2seq without it");
        }
        if args.out.is_some() {
            anyhow::bail!("--out names the encoder demo's picture; --seq2seq draws none");
        }
    }
    let out = args.out.as_deref().unwrap_or(Path::new(DEFAULT_OUT));
    let dir = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if out.is_dir() || !dir.is_dir() {
        anyhow::bail!("--out {}: not a file in an existing directory", out.display());
    }
    Ok(())
}

/// Where the encoder demo draws its attention without `--out`.
const DEFAULT_OUT: &str = "attention.png";

pub fn run(args: DemoArgs) -> Result<()> {
    check_args(&args)?;
    if args.seq2seq {
        return crate::demo_seq2seq::run(args);
    }
    let compute = args.dtype.candle();
    let dev = Device::Cpu;
    let steps = args.steps.unwrap_or(600);
    let (d, l) = (64, args.seq_len);
    multihead::manual_seed(args.seed);
    let vm = VarMap::new();
    let model = Model::new(VarBuilder::from_varmap(&vm, DType::F32, &dev), d, l)?;
    seeded_init(&vm, args.seed)?;
    let n_params: usize = vm.all_vars().iter().map(|v| v.elem_count()).sum();
    let mut opt = AdamW::new(
        vm.all_vars(),
        ParamsAdamW { lr: 3e-3, weight_decay: 0.01, ..Default::default() },
    )?;

    say!(
        "multihead demo: a 2-layer Transformer encoder (d_model {d}, 4 heads, {n_params} parameters) learns to reverse {l}-digit sequences"
    );
    if compute != DType::F32 {
        say!("mixed precision: f32 master weights, {compute:?} compute (multihead::autocast)");
    }
    // The model's logits, under autocast when the compute dtype is reduced.
    let logits = |x: &Tensor| -> Result<Tensor> {
        if compute == DType::F32 {
            model.logits(x)
        } else {
            multihead::autocast(compute, || model.logits(x))
        }
    };
    let (held_x, held_y) = batch(args.seed, u64::MAX, 1000, l, &dev)?;
    let start = Instant::now();
    // The whole loop on rayon's pool, backward passes included (multihead::on_pool): one hop,
    // not one per parallel operation.
    let held = (&held_x, &held_y);
    multihead::on_pool(|| train(&args, steps, &logits, &mut opt, held))?;
    let secs = start.elapsed().as_secs_f64();
    let held_acc = accuracy(&logits(&held_x)?, &held_y)?;
    say!(
        "held-out token accuracy: {:.2}% on 1000 unseen sequences after {} steps in {secs:.1} s",
        100.0 * held_acc,
        steps
    );

    show_examples(&held_x, &logits)?;
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_OUT));
    draw_attention(&model, &held_x, &out)?;
    if let Some(min) = args.require_accuracy {
        if held_acc < min {
            anyhow::bail!(
                "held-out accuracy {:.2}% is below the required {:.2}%",
                100.0 * held_acc,
                100.0 * min
            );
        }
    }
    Ok(())
}

/// The training loop: AdamW with a warm-up and a linear decay of the learning rate, a
/// progress bar on a terminal, plain lines (one per 100 steps) when stdout is a file or a pipe.
fn train(
    args: &DemoArgs,
    steps: usize,
    logits: &dyn Fn(&Tensor) -> Result<Tensor>,
    opt: &mut AdamW,
    (held_x, held_y): (&Tensor, &Tensor),
) -> Result<()> {
    use std::io::IsTerminal;
    let plain = !args.quiet && !std::io::stdout().is_terminal();
    let pb = if args.quiet || plain {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(steps as u64)
    };
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40.cyan/blue} {pos:>5}/{len} steps  {msg}  [{elapsed_precise}]",
        )
        .context("progress template")?,
    );
    let mut shown_held = 0.0;
    for step in 0..steps {
        // Warm up the learning rate over the first 100 steps, then decay it linearly.
        let warm = ((step + 1) as f64 / 100.0).min(1.0);
        let decay = 1.0 - step as f64 / steps as f64;
        opt.set_learning_rate(3e-3 * warm * (0.1 + 0.9 * decay));
        let (x, y) = batch(args.seed, step as u64, args.batch, args.seq_len, &Device::Cpu)?;
        let out = logits(&x)?;
        let loss = cross_entropy(&out, &y)?;
        opt.backward_step(&loss)?;
        // Loss and training accuracy every 25 steps; the held-out accuracy (a forward pass
        // over 1000 sequences) every 100, and only when it is shown.
        if !args.quiet && (step % 25 == 0 || step + 1 == steps) {
            let acc = accuracy(&out, &y)?;
            if step % 100 == 0 || step + 1 == steps {
                shown_held = accuracy(&logits(held_x)?, held_y)?;
            }
            let msg = format!(
                "loss {:.4}  train acc {:5.1}%  held-out acc {:5.1}%",
                loss.to_scalar::<f32>()?,
                100.0 * acc,
                100.0 * shown_held
            );
            if plain && (step % 100 == 0 || step + 1 == steps) {
                say!("step {:>5}/{}  {msg}", step + 1, steps);
            }
            pb.set_message(msg);
        }
        pb.inc(1);
    }
    pb.finish();
    Ok(())
}

/// Prints five held-out sequences with the model's reversal of each.
fn show_examples(held_x: &Tensor, logits: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<()> {
    let examples = held_x.narrow(0, 0, 5)?;
    let pred = logits(&examples)?.argmax(D::Minus1)?;
    let show = |t: &Tensor, r: usize| -> Result<String> {
        Ok(t.get(r)?.to_vec1::<u32>()?.iter().map(|d| d.to_string()).collect::<String>())
    };
    for r in 0..5 {
        let (input, output) = (show(&examples, r)?, show(&pred, r)?);
        let expect: String = input.chars().rev().collect();
        say!("  {input} -> {output} {}", if output == expect { "ok" } else { "(wrong)" });
    }
    Ok(())
}

/// Draws the attention of every layer and head on the first held-out sequence into `out`.
fn draw_attention(model: &Model, held_x: &Tensor, out: &std::path::Path) -> Result<()> {
    let first = held_x.narrow(0, 0, 1)?;
    let digits: Vec<String> =
        first.get(0)?.to_vec1::<u32>()?.iter().map(|d| d.to_string()).collect();
    let mut panels = Vec::new();
    for (li, w) in model.attention(&first)?.iter().enumerate() {
        let (h, rows, cols) = w.dims3()?;
        for hi in 0..h {
            panels.push(Panel {
                title: format!("layer {} head {}", li + 1, hi + 1),
                rows,
                cols,
                values: w.get(hi)?.flatten_all()?.to_vec1::<f32>()?,
                row_labels: (0..rows).map(|i| i.to_string()).collect(),
                col_labels: digits.clone(),
            });
        }
    }
    let caption = format!("attention weights, query rows x key columns, input {}", digits.concat());
    save_grid(&panels, 4, &caption, out).with_context(|| format!("writing {}", out.display()))?;
    say!("wrote {} ({} panels: one per layer and head)", out.display(), panels.len());
    Ok(())
}
