//! A small generation loop over the incremental decoder: greedy or seeded sampling, with the
//! KV cache or (for comparison) recomputing the whole prefix at every step.

use candle_core::{DType, Tensor};

use super::{StepOptions, Transformer};
use crate::error::{Error, Result};
use crate::mask::Mask;
use crate::random::DropoutKey;

const OP: &str = "Transformer::generate";

/// How the next token is picked from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token (the first one on ties, like `torch.argmax`).
    Greedy,
    /// A draw from `softmax(logits / temperature)` from the crate's counter-based generator
    /// keyed by `seed`: the same seed gives the same tokens.
    Sample {
        /// Must be positive and finite.
        temperature: f64,
        /// The generator's seed.
        seed: u64,
    },
}

/// The options of [`Transformer::generate`].
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    /// New tokens per row at most. Default 32.
    pub max_new_tokens: usize,
    /// How tokens are picked. Default greedy.
    pub sampling: Sampling,
    /// A row stops after emitting this token (it is included). Default `None`.
    pub eos: Option<u32>,
    /// Decode with the KV cache (`true`, the default) or recompute the decoder over the whole
    /// prefix at every step, as a model without a cache must. Both give the same tokens.
    pub use_cache: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self { max_new_tokens: 32, sampling: Sampling::Greedy, eos: None, use_cache: true }
    }
}

/// Picks one token per row from logits `(N, V)` at step `step`. Sampling draws from the
/// crate's counter-based generator ([`DropoutKey`]) keyed by the seed: the draw of row `b` at
/// step `t` is element `(0, t, b)`, whatever else is drawn.
fn pick(logits: &Tensor, n: usize, sampling: Sampling, step: usize) -> Result<Vec<u32>> {
    match logits.dims() {
        &[rows, v] if rows == n && v > 0 => {}
        dims => {
            return Err(Error::Shape {
                op: OP,
                arg: "logits",
                msg: format!(
                    "the logits closure must return (N, V) = ({n}, V) scores with V >= 1, one row per sequence, got {dims:?}"
                ),
            })
        }
    }
    // The rows are read in f64: a broadcast view of a few values can stand for more.
    let hint = "return the logits of one position per row, (N, V)";
    crate::alloc::ensure(OP, "logits", logits.dims(), DType::F64, 1, hint)?;
    let rows = logits.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    rows.iter()
        .enumerate()
        .map(|(b, row)| {
            if row.iter().any(|x| x.is_nan()) {
                return Err(Error::Config {
                    op: OP,
                    arg: "logits",
                    msg: format!("row {b} of the logits contains NaN; check the model's output"),
                });
            }
            let sampled = matches!(sampling, Sampling::Sample { .. });
            if sampled && (row.contains(&f64::INFINITY) || row.iter().all(|&x| x == f64::NEG_INFINITY)) {
                // softmax is NaN there, and torch.multinomial refuses it.
                return Err(Error::Config {
                    op: OP,
                    arg: "logits",
                    msg: format!(
                        "row {b} of the logits has +inf or only -inf: it is no distribution to sample from; use Sampling::Greedy or finite logits"
                    ),
                });
            }
            let best = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let first_best = || row.iter().position(|&x| x == best).unwrap_or(0) as u32;
            match sampling {
                Sampling::Greedy => Ok(first_best()),
                Sampling::Sample { temperature: t, seed } => {
                    let w: Vec<f64> = row.iter().map(|&x| ((x - best) / t).exp()).collect();
                    let draw = DropoutKey { seed, offset: 0 }.uniform(0, step as u64, b as u64);
                    let mut u = f64::from(draw) * w.iter().sum::<f64>();
                    for (i, wi) in w.iter().enumerate() {
                        if u < *wi {
                            return Ok(i as u32);
                        }
                        u -= wi;
                    }
                    Ok(first_best())
                }
            }
        })
        .collect()
}

impl Transformer {
    /// Generates up to `max_new_tokens` tokens per row, starting from `bos[b]`, decoding
    /// against an encoded `memory` (from [`encode`](Self::encode), batched, in the model's
    /// layout) with the KV cache.
    ///
    /// `embed(tokens, position)` turns one token per row (at `position`, from 0 for `bos`)
    /// into `(N, E)` decoder input (a token embedding plus any positional encoding);
    /// `logits(h)` turns the decoder output `(N, E)` into `(N, V)` scores. Returns each row's
    /// new tokens.
    ///
    /// # Shapes
    /// * memory: `(S, N, E)`, or `(N, S, E)` with `batch_first`; memory_key_padding_mask
    ///   `(N, S)`; `bos` has `N` tokens; `embed` returns `(N, E)`, `logits` takes `(N, E)` and
    ///   returns `(N, V)`.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::transformer::{GenerateOptions, LayerConfig, Transformer, TransformerConfig};
    ///
    /// let dev = Device::Cpu;
    /// let vm = VarMap::new();
    /// let layer = LayerConfig::new(16, 2).with_dim_feedforward(32).with_batch_first(true);
    /// let cfg = TransformerConfig { layer, num_encoder_layers: 1, num_decoder_layers: 1 };
    /// let mut model = Transformer::new(cfg, VarBuilder::from_varmap(&vm, DType::F32, &dev))?;
    /// model.eval();
    /// let table = Tensor::randn(0f32, 1.0, (10, 16), &dev)?; // a toy vocabulary of 10
    /// let embed = |toks: &[u32], _pos: usize| -> multihead::Result<Tensor> {
    ///     Ok(table.index_select(&Tensor::new(toks, &dev)?, 0)?)
    /// };
    /// let logits = |h: &Tensor| -> multihead::Result<Tensor> { Ok(h.matmul(&table.t()?)?) };
    ///
    /// let memory = model.encode(&Tensor::randn(0f32, 1.0, (2, 5, 16), &dev)?, None, None)?;
    /// let opts = GenerateOptions { max_new_tokens: 6, ..Default::default() };
    /// let cached = model.generate(&memory, None, &[1, 2], &opts, embed, logits)?;
    /// let recomputed = model.generate(&memory, None, &[1, 2], &GenerateOptions { use_cache: false, ..opts }, embed, logits)?;
    /// assert_eq!(cached, recomputed);
    /// assert_eq!(cached[0].len(), 6);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // PyTorch's nn.Transformer has no generate: this is the decoding loop users write around
    // torch.nn.Transformer.decoder (greedy or sampled, one token per step), with a KV cache.
    pub fn generate(
        &self,
        memory: &Tensor,
        memory_key_padding_mask: Option<&Mask>,
        bos: &[u32],
        opts: &GenerateOptions,
        embed: impl Fn(&[u32], usize) -> Result<Tensor>,
        logits: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Vec<Vec<u32>>> {
        let how = (opts, &StepOptions::default());
        self.generate_with(memory, memory_key_padding_mask, bos, how, embed, logits)
    }

    /// [`generate`](Self::generate) with attention variants in every decoder layer
    /// ([`StepOptions`], as [`decode_step_with`](Self::decode_step_with) takes them): with the
    /// cache each step runs `decode_step_with`; without it (`use_cache: false`) each step
    /// recomputes the prefix with [`StepOptions::prefix_options`], giving the same tokens.
    ///
    /// # Shapes
    /// * As in [`generate`](Self::generate).
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::multihead_attention::CachedOptions;
    /// use multihead::transformer::{GenerateOptions, LayerConfig, StepOptions, Transformer, TransformerConfig};
    ///
    /// let dev = Device::Cpu;
    /// let vm = VarMap::new();
    /// let layer = LayerConfig::new(8, 2).with_dim_feedforward(16).with_batch_first(true);
    /// let cfg = TransformerConfig { layer, num_encoder_layers: 1, num_decoder_layers: 1 };
    /// let mut model = Transformer::new(cfg, VarBuilder::from_varmap(&vm, DType::F32, &dev))?;
    /// model.eval();
    /// let memory = model.encode(&Tensor::randn(0f32, 1.0, (1, 4, 8), &dev)?, None, None)?;
    /// let table = Tensor::randn(0f32, 1.0, (5, 8), &dev)?; // 5 tokens
    /// let embed = |ids: &[u32], _pos: usize| Ok(table.index_select(&Tensor::new(ids, &dev)?, 0)?);
    /// let logits = |h: &Tensor| Ok(h.matmul(&table.t()?)?);
    /// let step = StepOptions::default().self_attn(CachedOptions::default().softcap(5.0).window(2));
    /// let opts = GenerateOptions { max_new_tokens: 4, ..Default::default() };
    /// let out = model.generate_with(&memory, None, &[0], (&opts, &step), embed, logits)?;
    /// assert_eq!(out[0].len(), 4);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // The decoding loop users write around torch.nn.Transformer.decoder, with the attention
    // variants.
    pub fn generate_with(
        &self,
        memory: &Tensor,
        memory_key_padding_mask: Option<&Mask>,
        bos: &[u32],
        (opts, step): (&GenerateOptions, &StepOptions),
        embed: impl Fn(&[u32], usize) -> Result<Tensor>,
        logits: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Vec<Vec<u32>>> {
        // The step's own refusals, with the cache or without (recomputing would apply them).
        super::incremental::check_step_cross(&step.cross_attn)?;
        let bf = self.cfg.layer.batch_first;
        let n = bos.len();
        if memory.rank() != 3 || memory.dim(if bf { 0 } else { 1 })? != n {
            return Err(Error::Shape {
                op: OP,
                arg: "memory",
                msg: format!(
                    "expected a batched memory with one row per bos token ({n}), got {:?}",
                    memory.dims()
                ),
            });
        }
        if let Sampling::Sample { temperature, .. } = opts.sampling {
            if !(temperature.is_finite() && temperature > 0.0) {
                return Err(Error::Config {
                    op: OP,
                    arg: "temperature",
                    msg: format!("temperature must be positive and finite, got {temperature}"),
                });
            }
        }
        let seq_dim = if bf { 1 } else { 0 };
        let mut state = match opts.use_cache {
            true => {
                let state =
                    self.start_decoding(memory, memory_key_padding_mask, opts.max_new_tokens);
                // The caches hold max_new_tokens positions: too many is this argument's doing.
                // (Only the caches' own allocation: another, the memory's projection say, keeps
                // its error.)
                Some(state.map_err(|e| match e {
                    Error::Alloc { what: "keys and values", msg, .. } => Error::Alloc {
                        op: OP,
                        what: "max_new_tokens",
                        msg: format!(
                            "the decoder's caches for {} new tokens cannot be allocated ({msg}); \
                             ask for fewer tokens",
                            opts.max_new_tokens
                        ),
                    },
                    e => e,
                })?)
            }
            false => None,
        };
        let mut inputs: Vec<Tensor> = Vec::new(); // every position's input, without the cache
        let (mut cur, mut out, mut done) = (bos.to_vec(), vec![Vec::new(); n], vec![false; n]);
        for pos in 0..opts.max_new_tokens {
            let x = embed(&cur, pos).map_err(|e| in_closure(e, "embed", pos))?;
            if x.rank() != 2 || x.dim(0)? != n {
                return Err(Error::Shape {
                    op: OP,
                    arg: "embed",
                    msg: format!(
                        "the embed closure must return (N, E) = ({n}, E) inputs, one row per sequence, got {:?}",
                        x.dims()
                    ),
                });
            }
            let x = x.unsqueeze(seq_dim)?; // (N, 1, E) or (1, N, E)
            let h = match &mut state {
                Some(state) => self.decode_step_with(&x, state, None, step)?,
                None => {
                    inputs.push(x);
                    let prefix = Tensor::cat(&inputs, seq_dim)?;
                    self.recompute_last(&prefix, memory, memory_key_padding_mask, step)?
                }
            };
            let scores = logits(&h.squeeze(seq_dim)?).map_err(|e| in_closure(e, "logits", pos))?;
            let next = pick(&scores, n, opts.sampling, pos)?;
            for (b, &tok) in next.iter().enumerate() {
                if !done[b] {
                    out[b].push(tok);
                    done[b] = opts.eos == Some(tok);
                }
            }
            if done.iter().all(|&d| d) {
                break;
            }
            cur = next;
        }
        Ok(out)
    }

    /// The decoder over a whole prefix with a causal mask (and the options that `step`'s
    /// steps equal), at its last position.
    fn recompute_last(
        &self,
        prefix: &Tensor,
        memory: &Tensor,
        kpm: Option<&Mask>,
        step: &StepOptions,
    ) -> Result<Tensor> {
        let seq_dim = if self.cfg.layer.batch_first { 1 } else { 0 };
        let len = prefix.dim(seq_dim)?;
        let mask = crate::generate_square_subsequent_mask(len, prefix.dtype(), prefix.device())?;
        let (mut self_opts, cross_opts) = step.prefix_options(kpm);
        // The causal mask as PyTorch's decoder takes it (the window's right side says so too).
        self_opts = self_opts.attn_mask(Mask::Float(mask)).is_causal(true);
        // The cached steps take sinks of any float dtype; the full forward, the model's.
        if let Some(s) = &self_opts.sinks {
            self_opts.sinks = Some(s.to_dtype(prefix.dtype())?);
        }
        let h = crate::mode::no_grad(|| {
            self.decoder.forward_with(prefix, memory, &self_opts, &cross_opts)
        })?;
        Ok(h.narrow(seq_dim, len - 1, 1)?)
    }
}

/// A candle error out of the caller's `embed` or `logits` closure, with the closure and the
/// position it failed at as its context (it was candle's bare message, e.g. an invalid index;
/// still `Error::Candle`, its source kept); this crate's own errors already name their
/// operation.
fn in_closure(e: Error, closure: &'static str, pos: usize) -> Error {
    match e {
        Error::Candle(c) => Error::Candle(
            c.context(format!("{OP}: the {closure} closure failed at position {pos}")),
        ),
        e => e,
    }
}
