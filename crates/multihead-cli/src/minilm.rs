//! all-MiniLM-L6-v2 (BERT) from this crate's `TransformerEncoderLayer`s: its configuration,
//! its weights checked at load, tokenization as sentence-transformers does it, and the
//! embedding of a batch.
//!
//! The model is BERT: token, position and token-type embeddings with a LayerNorm, six post-norm
//! encoder layers (GELU, LayerNorm eps 1e-12), mean pooling over real tokens, L2
//! normalisation. BERT's separate query/key/value weights are concatenated into PyTorch's packed
//! `in_proj_weight` at load time, so each layer is a plain [`TransformerEncoderLayer`]. The
//! pooling, the normalisation, the token limit and lowercasing are read from the folder's
//! sentence-transformers files (`crate::sentence`), so another BERT sentence model with a
//! different pipeline is embedded as sentence-transformers embeds it.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use multihead::functional::CuSeqlens;
use multihead::multihead_attention::PackedOptions;
use multihead::state_dict::{load_safetensors, load_strict};
use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
use multihead::{Activation, LayerNorm, Mask};
use tokenizers::Tokenizer;

use crate::bert_tokenizer::{self, load_tokenizer, Cuts};
use crate::sentence::{read_json, whole, Pipeline};

/// The BERT hyper-parameters read from `config.json`.
struct BertConfig {
    hidden: usize,
    layers: usize,
    heads: usize,
    intermediate: usize,
    eps: f64,
    /// The table sizes the config declares (checked against the weights when given).
    vocab: Option<usize>,
    positions: Option<usize>,
    token_types: Option<usize>,
}

fn read_config(dir: &Path) -> Result<BertConfig> {
    crate::sentence::plain_file(&dir.join("config.json"))?;
    let text = std::fs::read_to_string(dir.join("config.json")).context("reading config.json")?;
    let v: serde_json::Value = serde_json::from_str(&text).context("parsing config.json")?;
    if !v.is_object() {
        bail!("config.json must be a JSON object of the model's settings (a BERT config), got {v}");
    }
    let get = |k: &str| -> Result<usize> {
        match v.get(k) {
            None => bail!("config.json lacks {k}"),
            Some(x) => x.as_u64().and_then(|n| usize::try_from(n).ok()).with_context(|| {
                format!("config.json: {k} must be a non-negative integer, got {x}")
            }),
        }
    };
    if let Some(t) = v.get("model_type").filter(|t| t.as_str() != Some("bert")) {
        bail!("config.json: model_type {t} is not supported; multihead embed runs BERT models (model_type \"bert\")");
    }
    // A decoder BERT attends causally (and may cross-attend): not what this encoder runs.
    if let Some(d) = v.get("is_decoder").filter(|d| d.as_bool() != Some(false)) {
        bail!("config.json: is_decoder {d} is not supported; multihead embed runs BERT encoders (is_decoder false or absent)");
    }
    if v.get("hidden_act").and_then(|x| x.as_str()) != Some("gelu") {
        bail!("config.json: only hidden_act \"gelu\" is supported");
    }
    if let Some(t) = v.get("position_embedding_type").filter(|t| t.as_str() != Some("absolute")) {
        bail!("config.json: position_embedding_type {t} is not supported; this BERT has absolute position embeddings only");
    }
    let declared = |k: &str| v.get(k).map(|_| get(k)).transpose();
    let cfg = BertConfig {
        hidden: get("hidden_size")?,
        layers: get("num_hidden_layers")?,
        heads: get("num_attention_heads")?,
        intermediate: get("intermediate_size")?,
        eps: match v.get("layer_norm_eps") {
            None => 1e-12,
            Some(x) => x.as_f64().context("config.json: layer_norm_eps must be a number")?,
        },
        vocab: declared("vocab_size")?,
        positions: declared("max_position_embeddings")?,
        token_types: declared("type_vocab_size")?,
    };
    cfg.validate()?;
    Ok(cfg)
}

impl BertConfig {
    /// Rejects what would give NaN or absurd sizes instead of embeddings.
    fn validate(&self) -> Result<()> {
        if !(self.eps.is_finite() && self.eps > 0.0) {
            bail!("config.json: layer_norm_eps must be a positive finite number, got {}", self.eps);
        }
        if self.hidden == 0 || self.heads == 0 || !self.hidden.is_multiple_of(self.heads) {
            bail!(
                "config.json: hidden_size ({}) must be a positive multiple of num_attention_heads ({})",
                self.hidden,
                self.heads
            );
        }
        if self.intermediate == 0 || self.layers == 0 || self.layers > 1024 {
            bail!(
                "config.json: intermediate_size ({}) must be positive and num_hidden_layers ({}) between 1 and 1024",
                self.intermediate,
                self.layers
            );
        }
        Ok(())
    }
}

/// all-MiniLM-L6-v2 built from this crate's layers.
pub struct MiniLm {
    tokenizer: Tokenizer,
    /// Where long texts may be cut before tokenizing.
    cuts: Cuts,
    /// The weights' dtype.
    dtype: DType,
    /// Pooling and normalisation after the encoder.
    pipeline: Pipeline,
    /// The most tokens of a text, `[CLS]` and `[SEP]` included (longer ones are truncated).
    max_tokens: usize,
    /// The hidden and feed-forward widths.
    widths: (usize, usize),
    /// Put before every text (empty: none).
    prompt: String,
    /// The prompt's tokens at the start of every text (`[CLS]` included).
    prompt_len: usize,
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    norm: LayerNorm,
    layers: Vec<TransformerEncoderLayer>,
}

/// The most tokens of a text, as sentence-transformers sets it: `sentence_bert_config.json`'s
/// `max_seq_length` when given (it must fit the position table), else the smaller of
/// `tokenizer_config.json`'s `model_max_length` and `config.json`'s `max_position_embeddings`
/// (the position table's rows when neither is given).
fn token_limit(pipeline: &Pipeline, cfg: &BertConfig, position_rows: usize) -> Result<usize> {
    let limit = match pipeline.max_seq_length {
        Some(n) => {
            if n > position_rows {
                bail!(
                    "model.safetensors: embeddings.position_embeddings.weight has {position_rows} rows, fewer than sentence_bert_config.json's max_seq_length {n}; lower max_seq_length to at most {position_rows}"
                );
            }
            n
        }
        None => {
            let path = pipeline.transformer_dir.join("tokenizer_config.json");
            let declared = match path.exists() {
                false => None,
                true => whole(
                    read_json(&path)?.get("model_max_length"),
                    "tokenizer_config.json: model_max_length",
                )?,
            };
            let mut n = cfg.positions.unwrap_or(position_rows).min(position_rows);
            if let Some(d) = declared {
                n = n.min(d);
            }
            n
        }
    };
    if limit < 2 {
        bail!("the token limit is {limit}; it must be at least 2 ([CLS] and [SEP]): raise max_seq_length (or tokenizer_args' model_max_length) in sentence_bert_config.json, or model_max_length in tokenizer_config.json");
    }
    Ok(limit)
}

/// An embedding table `embeddings.{name}.weight` must be `(rows, hidden)` with at least
/// `rows` rows (every token id, position or token type the model looks up), and exactly the
/// rows `config.json` declares when it declares them.
fn check_table(
    t: &Tensor,
    name: &str,
    (rows, declared): (usize, Option<usize>),
    hidden: usize,
) -> Result<()> {
    let full = format!("embeddings.{name}.weight");
    let &[n, h] = t.dims() else {
        bail!(
            "model.safetensors: {full} has shape {:?}; it must be (rows, hidden_size {hidden})",
            t.dims()
        );
    };
    if h != hidden {
        bail!(
            "model.safetensors: {full} has shape {:?}; its width must be hidden_size {hidden}",
            t.dims()
        );
    }
    if n < rows {
        bail!("model.safetensors: {full} has {n} rows, fewer than the {rows} the model looks up (shape {:?})", t.dims());
    }
    if let Some(d) = declared.filter(|&d| d != n) {
        bail!("model.safetensors: {full} has {n} rows but config.json declares {d}");
    }
    Ok(())
}

/// Every weight must be finite: a NaN or infinite weight makes every embedding NaN.
fn check_finite(w: &HashMap<String, Tensor>) -> Result<()> {
    let mut names: Vec<&String> = w.keys().collect();
    names.sort();
    for name in names {
        let t = &w[name];
        if !t.dtype().is_float() {
            continue;
        }
        let bad = match &*t.storage_and_layout().0 {
            // The loaded tensors are whole and contiguous: read them in place.
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => {
                v.iter().any(|x| !x.is_finite())
            }
            _ => t
                .to_dtype(DType::F64)?
                .flatten_all()?
                .to_vec1::<f64>()?
                .iter()
                .any(|x| !x.is_finite()),
        };
        if bad {
            bail!("model.safetensors: {name} holds NaN or infinite values; the embeddings would be NaN");
        }
    }
    Ok(())
}

fn take(w: &mut HashMap<String, Tensor>, key: &str) -> Result<Tensor> {
    w.remove(key).with_context(|| format!("model.safetensors lacks {key}"))
}

/// `model.safetensors` by BertModel's keys (a `bert.` prefix removed), every weight finite.
fn load_weights(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let mut w = load_safetensors(dir.join("model.safetensors"), &Device::Cpu)?;
    let strip: Vec<String> = w.keys().filter(|k| k.starts_with("bert.")).cloned().collect();
    for k in strip {
        let short = &k["bert.".len()..];
        if w.contains_key(short) {
            bail!("model.safetensors has both {k} and {short}; keep one of them");
        }
        if let Some(t) = w.remove(&k) {
            w.insert(short.to_string(), t);
        }
    }
    check_finite(&w)?;
    Ok(w)
}

/// Encoder layer `i` from BERT's keys: the query/key/value weights joined into PyTorch's
/// packed `in_proj_weight`, every part shape-checked under the file's own key first.
fn load_layer(
    w: &mut HashMap<String, Tensor>,
    i: usize,
    cfg: &BertConfig,
    dtype: DType,
) -> Result<TransformerEncoderLayer> {
    let (h, f) = (cfg.hidden, cfg.intermediate);
    let p = |s: &str| format!("encoder.layer.{i}.{s}");
    let take_shaped = |w: &mut HashMap<String, Tensor>, key: &str, want: &[usize]| {
        let t = take(w, key)?;
        if t.dims() != want {
            bail!("model.safetensors: {key} is {:?}, expected {want:?}", t.dims());
        }
        Ok(t)
    };
    let mut st = HashMap::new();
    for (what, want) in [("weight", &[h, h][..]), ("bias", &[h][..])] {
        // Converted to f32 before they are joined: the file may mix dtypes, and every weight
        // is converted on load as PyTorch's `load_state_dict` copies it into the model's.
        let parts = ["query", "key", "value"]
            .iter()
            .map(|n| {
                Ok(take_shaped(w, &p(&format!("attention.self.{n}.{what}")), want)?
                    .to_dtype(DType::F32)?)
            })
            .collect::<Result<Vec<_>>>()?;
        st.insert(format!("self_attn.in_proj_{what}"), Tensor::cat(&parts, 0)?);
    }
    for (ours, theirs, weight, bias) in [
        ("self_attn.out_proj", "attention.output.dense", &[h, h][..], h),
        ("norm1", "attention.output.LayerNorm", &[h][..], h),
        ("linear1", "intermediate.dense", &[f, h][..], f),
        ("linear2", "output.dense", &[h, f][..], h),
        ("norm2", "output.LayerNorm", &[h][..], h),
    ] {
        st.insert(
            format!("{ours}.weight"),
            take_shaped(w, &p(&format!("{theirs}.weight")), weight)?,
        );
        st.insert(format!("{ours}.bias"), take_shaped(w, &p(&format!("{theirs}.bias")), &[bias])?);
    }
    let layer_cfg = LayerConfig::new(h, cfg.heads)
        .with_dim_feedforward(f)
        .with_dropout(0.0)
        .with_activation(Activation::Gelu)
        .with_layer_norm_eps(cfg.eps)
        .with_batch_first(true);
    let (mut layer, _) =
        load_strict(&st, dtype, &Device::Cpu, |vb| TransformerEncoderLayer::new(layer_cfg, vb))?;
    layer.eval();
    Ok(layer)
}

impl MiniLm {
    /// Loads a sentence-transformers folder: its pipeline (`modules.json`, the Pooling config,
    /// `sentence_bert_config.json`) and the Transformer module's `config.json`,
    /// `tokenizer.json` and `model.safetensors`.
    pub fn load(dir: &Path, dtype: DType) -> Result<Self> {
        let pipeline = Pipeline::read(dir)?;
        let tdir = pipeline.transformer_dir.clone();
        let cfg = read_config(&tdir)?;
        if let Some(d) = pipeline.pooled_dim.filter(|&d| d != cfg.hidden) {
            bail!(
                "the Pooling config's embedding dimension is {d} but config.json's hidden_size is {}; they must match",
                cfg.hidden
            );
        }
        let mut pipeline = pipeline;
        pipeline.load_dense(cfg.hidden)?;
        let mut w = load_weights(&tdir)?;
        let position_key = "embeddings.position_embeddings.weight";
        let position_rows = w.get(position_key).and_then(|t| t.dims().first().copied());
        let max_tokens = token_limit(&pipeline, &cfg, position_rows.unwrap_or(usize::MAX))?;
        let tokenizer = load_tokenizer(&tdir, max_tokens, pipeline.do_lower_case)?;
        // Rows for every id the tokenizer can give (its largest id + 1: ids need not be dense).
        let vocab = tokenizer.get_vocab(true).into_values().max().map_or(0, |id| id as usize + 1);
        let table = |w: &mut HashMap<String, Tensor>, name: &str, rows: usize, declared| {
            let t = take(w, &format!("embeddings.{name}.weight"))?;
            check_table(&t, name, (rows, declared), cfg.hidden)?;
            Ok::<_, anyhow::Error>(multihead::cast(&t, dtype)?)
        };
        let word = table(&mut w, "word_embeddings", vocab, cfg.vocab)?;
        let position = table(&mut w, "position_embeddings", max_tokens, cfg.positions)?;
        let token_type = table(&mut w, "token_type_embeddings", 1, cfg.token_types)?;
        let mut norm_state = HashMap::new();
        norm_state.insert("weight".to_string(), take(&mut w, "embeddings.LayerNorm.weight")?);
        norm_state.insert("bias".to_string(), take(&mut w, "embeddings.LayerNorm.bias")?);
        let (norm, _) = load_strict(&norm_state, dtype, &Device::Cpu, |vb| {
            LayerNorm::new(cfg.hidden, cfg.eps, true, vb)
        })?;
        let layers =
            (0..cfg.layers).map(|i| load_layer(&mut w, i, &cfg, dtype)).collect::<Result<_>>()?;
        w.remove("embeddings.position_ids");
        w.retain(|k, _| !k.starts_with("pooler."));
        if !w.is_empty() {
            let mut extra: Vec<&String> = w.keys().collect();
            extra.sort();
            bail!("model.safetensors has tensors this model does not use: {extra:?}");
        }
        let cuts = Cuts::of(&tokenizer);
        Ok(Self {
            tokenizer,
            cuts,
            dtype,
            pipeline,
            max_tokens,
            widths: (cfg.hidden, cfg.intermediate),
            prompt: String::new(),
            prompt_len: 0,
            word,
            position,
            token_type,
            norm,
            layers,
        })
    }

    /// The weights' dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// About how many bytes of temporaries one token of a packed batch makes in a layer: 48
    /// KiB for all-MiniLM-L6-v2 (hidden 384, feed-forward 1536), in proportion to the two
    /// widths for another model.
    pub fn temporaries_per_token(&self) -> usize {
        (48usize << 10).saturating_mul(self.widths.0 + self.widths.1) / (384 + 1536)
    }

    /// The folder's sentence-transformers pipeline.
    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }

    /// Puts `prompt` before every text from now on (sentence-transformers' `encode(...,
    /// prompt=...)`); its tokens count as the prompt's for a Pooling module that leaves them
    /// out: the prompt tokenized alone, without a trailing special token (`[SEP]`).
    pub fn set_prompt(&mut self, prompt: String) -> Result<()> {
        if prompt.is_empty() {
            // No prompt, no prompt tokens (sentence-transformers sets no prompt length then).
            self.prompt_len = 0;
            self.prompt = prompt;
            return Ok(());
        }
        let e = self
            .tokenizer
            .encode(prompt.as_str(), true)
            .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
        let ids = e.get_ids();
        let specials = self.tokenizer.get_added_tokens_decoder();
        let last_special = ids.last().is_some_and(|id| specials.get(id).is_some_and(|t| t.special));
        self.prompt_len = ids.len() - usize::from(last_special);
        self.prompt = prompt;
        Ok(())
    }

    /// Tokenizes texts, the prompt put before each, truncated at the model's
    /// `max_seq_length` as sentence-transformers does (long texts from a prefix:
    /// [`bert_tokenizer::tokenize`]).
    pub fn tokenize(&self, texts: &[String]) -> Result<Vec<Vec<u32>>> {
        if self.prompt.is_empty() {
            return self.tokenize_texts(texts);
        }
        let prompted: Vec<String> = texts.iter().map(|t| format!("{}{t}", self.prompt)).collect();
        self.tokenize_texts(&prompted)
    }

    fn tokenize_texts(&self, texts: &[String]) -> Result<Vec<Vec<u32>>> {
        bert_tokenizer::tokenize(&self.tokenizer, &self.cuts, texts, self.max_tokens)
    }

    /// Embeds a batch of tokenized texts: padded to the longest, masked with a key padding
    /// mask, pooled over each text's tokens and normalised as the folder's pipeline says
    /// ([`Pipeline::finish`]), under `no_grad` (no autograd graph is kept). One embedding per
    /// text (the hidden size times the number of pooling modes).
    pub fn embed_ids(&self, ids: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        // One hop onto rayon's pool for the whole batch (multihead::on_pool).
        multihead::on_pool(|| multihead::no_grad(|| self.embed_ids_graded(ids)))
    }

    /// Embeds tokenized texts as one packed batch: their tokens one after another, each
    /// attending to its own text only (`forward_packed`), so no padding is computed; pooled
    /// and normalised as [`embed_ids`](Self::embed_ids), under `no_grad`. A bf16 model runs
    /// each layer in f32 between one widening and one rounding, as its padded batches do.
    pub fn embed_ids_packed(&self, seqs: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        multihead::on_pool(|| multihead::no_grad(|| self.embed_packed_graded(seqs)))
    }

    /// `words + positions + token type 0` (positions broadcast over the words' leading
    /// dimensions), each addition rounded to the model's dtype as PyTorch's bf16 additions are.
    /// A bf16 model adds in f32 between fast conversions: candle's own bf16 additions took a
    /// tenth of a bf16 embedding run, for a few hundred thousand elements per batch.
    fn embedding_sum(&self, words: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let token_type = self.token_type.get(0)?;
        if self.dtype != DType::BF16 {
            return Ok(words.broadcast_add(positions)?.broadcast_add(&token_type)?);
        }
        let wide = |t: &Tensor| multihead::cast(t, DType::F32);
        let sum = wide(words)?.broadcast_add(&wide(positions)?)?;
        let sum = wide(&multihead::cast(&sum, self.dtype)?)?;
        Ok(multihead::cast(&sum.broadcast_add(&wide(&token_type)?)?, self.dtype)?)
    }

    fn embed_packed_graded(&self, seqs: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        let dev = Device::Cpu;
        let lens: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        let (t, hidden) = (lens.iter().sum::<usize>(), self.word.dim(1)?);
        if t == 0 {
            return Ok(seqs.iter().map(|_| self.pipeline.finish(&[], hidden, 0)).collect());
        }
        let cu = CuSeqlens::from_lengths(&lens);
        let ids: Vec<u32> = seqs.concat();
        let pos: Vec<u32> = lens.iter().flat_map(|&l| 0..l as u32).collect();
        let ids = Tensor::from_vec(ids, (t,), &dev)?;
        let pos = Tensor::from_vec(pos, (t,), &dev)?;
        let x = self.embedding_sum(
            &self.word.index_select(&ids, 0)?,
            &self.position.index_select(&pos, 0)?,
        )?;
        let mut x = self.norm.forward(&x)?;
        for layer in &self.layers {
            x = layer.forward_packed(&x, &cu, &PackedOptions::default())?;
        }
        // Pooling and normalisation in f32, each text over its own rows.
        let rows = multihead::cast(&x, DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(cu
            .offsets()
            .windows(2)
            .map(|w| {
                self.pipeline.finish(&rows[w[0] * hidden..w[1] * hidden], hidden, self.prompt_len)
            })
            .collect())
    }

    fn embed_ids_graded(&self, seqs: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        let dev = Device::Cpu;
        let n = seqs.len();
        let len = seqs.iter().map(|e| e.len()).max().unwrap_or(0).max(1);
        let mut ids = vec![0u32; n * len];
        let mut pad = vec![1u8; n * len];
        for (r, e) in seqs.iter().enumerate() {
            for (c, &id) in e.iter().enumerate() {
                ids[r * len + c] = id;
                pad[r * len + c] = 0;
            }
        }
        let ids = Tensor::from_vec(ids, (n * len,), &dev)?;
        let x = self.word.index_select(&ids, 0)?.reshape((n, len, ()))?;
        let x = self.embedding_sum(&x, &self.position.narrow(0, 0, len)?)?;
        let mut x = self.norm.forward(&x)?;
        let kpm = Mask::Bool(Tensor::from_vec(pad, (n, len), &dev)?);
        for layer in &self.layers {
            x = layer.forward(&x, None, Some(&kpm), false)?;
        }
        // Pooling and normalisation in f32 whatever the model's dtype, over real tokens only.
        let hidden = x.dim(2)?;
        let rows = multihead::cast(&x, DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(seqs
            .iter()
            .enumerate()
            .map(|(r, e)| {
                let at = r * len * hidden;
                self.pipeline.finish(&rows[at..at + e.len() * hidden], hidden, self.prompt_len)
            })
            .collect())
    }
}
