//! `multihead demo --seq2seq`: train a small encoder-decoder `Transformer` to reverse digit
//! sequences with teacher forcing, then decode held-out sequences greedily, with the KV cache
//! and by recomputing the prefix, and compare accuracy, tokens and speed.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder, VarMap};
use multihead::optim::AdamW;
use multihead::transformer::{
    DecoderMasks, GenerateOptions, LayerConfig, Transformer, TransformerConfig, TransformerMasks,
};
use multihead::Mask;

use crate::demo::{accuracy, batch, cross_entropy, seeded_init, DemoArgs, VOCAB};

/// The decoder's start token (the target vocabulary is the ten digits and this).
const BOS: u32 = VOCAB as u32;
/// Held-out sequences decoded at the end.
const HELD_OUT: usize = 1000;

struct Seq2Seq {
    src_embed: Tensor,
    tgt_embed: Tensor,
    pos: Tensor,
    model: Transformer,
    head: multihead::Linear,
}

impl Seq2Seq {
    fn new(vb: VarBuilder, d: usize, seq_len: usize) -> Result<Self> {
        let init = candle_nn::Init::Const(0.0);
        let layer = LayerConfig::new(d, 4)
            .with_dim_feedforward(2 * d)
            .with_dropout(0.0)
            .with_batch_first(true);
        let cfg = TransformerConfig { layer, num_encoder_layers: 2, num_decoder_layers: 2 };
        Ok(Self {
            src_embed: vb.get_with_hints((VOCAB, d), "src_embed.weight", init)?,
            tgt_embed: vb.get_with_hints((VOCAB + 1, d), "tgt_embed.weight", init)?,
            pos: vb.get_with_hints((seq_len, d), "pos", init)?,
            model: Transformer::new(cfg, vb.pp("transformer"))?,
            head: multihead::Linear::new(d, VOCAB, true, vb.pp("head"))?,
        })
    }

    /// Token ids `(N, L)` → embeddings plus positions `(N, L, d)`.
    fn embed(&self, table: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let (n, l) = ids.dims2()?;
        let x = table.index_select(&ids.flatten_all()?, 0)?.reshape((n, l, ()))?;
        Ok(x.broadcast_add(&self.pos.narrow(0, 0, l)?)?)
    }

    /// Teacher-forced logits `(N, L, VOCAB)`: the decoder sees BOS and the first L-1 targets.
    fn logits(&self, src: &Tensor, tgt: &Tensor) -> Result<Tensor> {
        let (n, l) = tgt.dims2()?;
        let bos = Tensor::full(BOS, (n, 1), src.device())?;
        let tgt_in = Tensor::cat(&[&bos, &tgt.narrow(1, 0, l - 1)?], 1)?;
        let mask = multihead::generate_square_subsequent_mask(l, DType::F32, src.device())?;
        let masks = TransformerMasks {
            decoder: DecoderMasks {
                tgt_mask: Some(Mask::Float(mask)),
                tgt_is_causal: Some(true),
                ..Default::default()
            },
            ..Default::default()
        };
        let h = self.model.forward(
            &self.embed(&self.src_embed, src)?,
            &self.embed(&self.tgt_embed, &tgt_in)?,
            &masks,
        )?;
        Ok(self.head.forward(&h)?)
    }

    /// Greedy decoding of `src` `(N, L)`: the tokens and the seconds it took.
    fn decode(&self, src: &Tensor, use_cache: bool) -> Result<(Vec<Vec<u32>>, f64)> {
        let (n, l) = src.dims2()?;
        let start = Instant::now();
        // One hop onto the pool for the whole loop, the embedding and the head included: each
        // step's operations then split their work without waking another pool's threads.
        let tokens = multihead::on_pool(|| {
            multihead::no_grad(|| -> multihead::Result<_> {
                let memory = self.model.encode(
                    &self.embed(&self.src_embed, src).map_err(wrap)?,
                    None,
                    None,
                )?;
                let opts = GenerateOptions { max_new_tokens: l, use_cache, ..Default::default() };
                let embed = |toks: &[u32], p: usize| -> multihead::Result<Tensor> {
                    let ids = Tensor::new(toks, src.device())?;
                    Ok(self.tgt_embed.index_select(&ids, 0)?.broadcast_add(&self.pos.get(p)?)?)
                };
                let logits = |h: &Tensor| self.head.forward(h);
                self.model.generate(&memory, None, &vec![BOS; n], &opts, embed, logits)
            })
        })?;
        Ok((tokens, start.elapsed().as_secs_f64()))
    }
}

fn wrap(e: anyhow::Error) -> multihead::Error {
    multihead::Error::Config { op: "demo", arg: "embed", msg: e.to_string() }
}

pub fn run(args: DemoArgs) -> Result<()> {
    let dev = Device::Cpu;
    let steps = args.steps.unwrap_or(400);
    let (d, l) = (64, args.seq_len);
    multihead::manual_seed(args.seed);
    let vm = VarMap::new();
    let mut model = Seq2Seq::new(VarBuilder::from_varmap(&vm, DType::F32, &dev), d, l)?;
    seeded_init(&vm, args.seed)?;
    let n_params: usize = vm.all_vars().iter().map(|v| v.elem_count()).sum();
    let mut opt = AdamW::new(
        vm.all_vars(),
        ParamsAdamW { lr: 3e-3, weight_decay: 0.01, ..Default::default() },
    )?;
    say!(
        "multihead demo --seq2seq: a Transformer (2+2 layers, d_model {d}, 4 heads, {n_params} parameters) learns to reverse {l}-digit sequences, then decodes them with a KV cache"
    );
    let start = Instant::now();
    for step in 0..steps {
        let warm = ((step + 1) as f64 / 100.0).min(1.0);
        let decay = 1.0 - step as f64 / steps as f64;
        opt.set_learning_rate(3e-3 * warm * (0.1 + 0.9 * decay));
        let (x, y) = batch(args.seed, step as u64, args.batch, l, &dev)?;
        let logits = model.logits(&x, &y)?;
        let loss = cross_entropy(&logits, &y)?;
        opt.backward_step(&loss)?;
        if !args.quiet && (step % 100 == 0 || step + 1 == steps) {
            let acc = accuracy(&logits, &y)?;
            say!(
                "step {:>5}/{}  loss {:.4}  teacher-forced train acc {:5.1}%",
                step + 1,
                steps,
                loss.to_scalar::<f32>()?,
                100.0 * acc
            );
        }
    }
    say!("trained {} steps in {:.1} s", steps, start.elapsed().as_secs_f64());

    model.model.eval();
    let (held_x, held_y) = batch(args.seed, u64::MAX, HELD_OUT, l, &dev)?;
    // A process's first decoding at this size runs on fresh memory (the recompute's growing
    // prefixes: 0.30-0.42 s the first time, half of it clearing fresh pages, against
    // 0.08-0.09 s after): each way runs once untimed, and the timed runs compare steady states.
    model.decode(&held_x, true)?;
    model.decode(&held_x, false)?;
    let (cached, t_cached) = model.decode(&held_x, true)?;
    let (recomputed, t_recomputed) = model.decode(&held_x, false)?;
    let want = held_y.to_vec2::<u32>()?;
    let (mut hits, mut exact) = (0usize, 0usize);
    for (got, want) in cached.iter().zip(&want) {
        hits += got.iter().zip(want).filter(|(a, b)| a == b).count();
        exact += usize::from(got == want);
    }
    let acc = hits as f32 / (HELD_OUT * l) as f32;
    let tokens = (HELD_OUT * l) as f64;
    say!(
        "greedy decoding of {HELD_OUT} unseen sequences: token accuracy {:.2}%, {exact} of {HELD_OUT} sequences exact",
        100.0 * acc
    );
    say!(
        "  with the KV cache {:.0} tokens/s, recomputing the prefix {:.0} tokens/s ({:.1}x); the tokens are {}",
        tokens / t_cached,
        tokens / t_recomputed,
        t_recomputed / t_cached,
        if cached == recomputed { "identical" } else { "DIFFERENT" }
    );
    for (r, (src, got)) in held_x.to_vec2::<u32>()?.iter().zip(&cached).take(5).enumerate() {
        let show = |v: &[u32]| v.iter().map(|d| d.to_string()).collect::<String>();
        let ok = got == &want[r];
        say!("  {} -> {} {}", show(src), show(got), if ok { "ok" } else { "(wrong)" });
    }
    if cached != recomputed {
        anyhow::bail!("cached and recomputed decoding disagree");
    }
    if let Some(min) = args.require_accuracy {
        if acc < min {
            anyhow::bail!(
                "greedy token accuracy {:.2}% is below the required {:.2}%",
                100.0 * acc,
                100.0 * min
            );
        }
    }
    Ok(())
}
