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
use tokenizers::normalizers::{Lowercase, Sequence};
use tokenizers::{NormalizerWrapper, Tokenizer, TruncationParams};

use crate::sentence::Pipeline;

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
    let text = std::fs::read_to_string(dir.join("config.json")).context("reading config.json")?;
    let v: serde_json::Value = serde_json::from_str(&text).context("parsing config.json")?;
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
                true => {
                    let text = std::fs::read_to_string(&path)
                        .with_context(|| format!("reading {}", path.display()))?;
                    let v: serde_json::Value = serde_json::from_str(&text)
                        .with_context(|| format!("parsing {}", path.display()))?;
                    match v.get("model_max_length") {
                        None | Some(serde_json::Value::Null) => None,
                        // Tokenizers without a limit say 1e30: a whole number too.
                        Some(x) => match x.as_f64() {
                            Some(f) if f >= 0.0 && f.fract() == 0.0 => {
                                Some(if f >= usize::MAX as f64 { usize::MAX } else { f as usize })
                            }
                            _ => bail!(
                                "tokenizer_config.json: model_max_length must be a whole number, got {x}"
                            ),
                        },
                    }
                }
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

/// Lowercases texts before the tokenizer's own normaliser, as sentence-transformers does for
/// `do_lower_case` (unless the normaliser already starts from a `Lowercase` step).
fn lowercase_first(tokenizer: &mut Tokenizer) -> Result<()> {
    let steps: Vec<NormalizerWrapper> = match tokenizer.get_normalizer().cloned() {
        None => Vec::new(),
        Some(NormalizerWrapper::Sequence(s)) => s.into_iter().collect(),
        Some(n) => vec![n],
    };
    if steps.iter().any(|n| matches!(n, NormalizerWrapper::Lowercase(_))) {
        return Ok(());
    }
    let mut all = vec![NormalizerWrapper::Lowercase(Lowercase)];
    all.extend(steps);
    tokenizer
        .with_normalizer(Some(NormalizerWrapper::Sequence(Sequence::new(all))))
        .map_err(|e| anyhow::anyhow!("do_lower_case: {e}"))?;
    Ok(())
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

/// The length from which a text is tokenized from a prefix first (see `MiniLm::tokenize`):
/// 256 tokens of ordinary text take a few kilobytes.
const PREFIX_BYTES: usize = 16 << 10;

/// Where a long text may be cut before tokenizing (see [`word_prefix`]).
#[derive(Debug, Default)]
struct Cuts {
    /// The tokenizer's added tokens (`[CLS]`, `[MASK]`, ...), matched in the raw text before
    /// anything else: a cut must not split one.
    specials: Vec<String>,
    /// The normaliser puts spaces around CJK ideographs (BERT's `handle_chinese_chars`), so
    /// the point between two of them is a word boundary too.
    cjk: bool,
    /// The tokenizer is not BERT's (its normaliser and pre-tokenizer): no cut is known to be
    /// safe, so texts are tokenized whole.
    whole: bool,
}

impl Cuts {
    fn of(tokenizer: &Tokenizer) -> Self {
        let mut specials: Vec<String> =
            tokenizer.get_added_tokens_decoder().into_values().map(|t| t.content).collect();
        specials.retain(|s| !s.is_empty());
        // BERT's normaliser, alone or after the `Lowercase` step `do_lower_case` puts first
        // (lowercasing moves no boundary).
        let steps: &[NormalizerWrapper] = match tokenizer.get_normalizer() {
            Some(NormalizerWrapper::Sequence(s)) => s.as_ref(),
            Some(n) => std::slice::from_ref(n),
            None => &[],
        };
        let isolates = |n: &NormalizerWrapper| matches!(n, NormalizerWrapper::BertNormalizer(b) if b.handle_chinese_chars);
        let bert_steps = steps.iter().all(|n| {
            matches!(n, NormalizerWrapper::BertNormalizer(_) | NormalizerWrapper::Lowercase(_))
        });
        let cjk = bert_steps && steps.iter().any(isolates);
        let bert_split = matches!(
            tokenizer.get_pre_tokenizer(),
            Some(tokenizers::PreTokenizerWrapper::BertPreTokenizer(_))
        );
        Self { specials, cjk, whole: !(bert_steps && bert_split) }
    }

    /// Whether an added token occurs in `text` across byte `i` (in any ASCII case: a token
    /// matched after a lowercasing normaliser must not be split either).
    fn splits_special(&self, text: &[u8], i: usize) -> bool {
        self.specials.iter().any(|s| {
            let s = s.as_bytes();
            (i.saturating_sub(s.len() - 1)..i)
                .any(|at| text[at..].get(..s.len()).is_some_and(|w| w.eq_ignore_ascii_case(s)))
        })
    }
}

/// A character BERT's pre-tokenizer makes a token of its own: ASCII punctuation or any
/// Unicode punctuation (`。`, `、`, `«`, ...), as its `is_bert_punc` says.
fn is_bert_punctuation(c: char) -> bool {
    use unicode_categories::UnicodeCategories;
    c.is_ascii_punctuation() || c.is_punctuation()
}

/// BERT's CJK ideographs (the ranges of its normaliser's `handle_chinese_chars`).
fn is_cjk_ideograph(c: char) -> bool {
    matches!(
        c as u32,
        0x4E00..=0x9FFF
            | 0x3400..=0x4DBF
            | 0x20000..=0x2A6DF
            | 0x2A700..=0x2B73F
            | 0x2B740..=0x2B81F
            | 0x2B920..=0x2CEAF
            | 0xF900..=0xFAFF
            | 0x2F800..=0x2FA1F
    )
}

/// The longest prefix of `text` of at least `limit` bytes that ends at a word boundary BERT's
/// tokenizer cannot move: before an ASCII space or tab, after punctuation (ASCII or Unicode,
/// a token of its own), or between two CJK ideographs when the normaliser isolates them; never inside
/// an added token such as `[MASK]` (matched in the raw text first). The normaliser and
/// pre-tokenizer work character by character and split there, and WordPiece works within
/// words, so the prefix's tokens are the first tokens of the whole text. The whole text when
/// it is shorter or has no such boundary past `limit`.
fn word_prefix<'t>(text: &'t str, limit: usize, cuts: &Cuts) -> &'t str {
    if text.len() <= limit || cuts.whole {
        return text;
    }
    let mut start = limit.max(1);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    let bytes = text.as_bytes();
    let mut prev = text[..start].chars().next_back();
    for (at, c) in text[start..].char_indices() {
        let i = start + at;
        let boundary = matches!(c, ' ' | '\t')
            || prev.is_some_and(is_bert_punctuation)
            || (cuts.cjk && is_cjk_ideograph(c) && prev.is_some_and(is_cjk_ideograph));
        if boundary && !cuts.splits_special(bytes, i) {
            return &text[..i];
        }
        prev = Some(c);
    }
    text
}

fn take(w: &mut HashMap<String, Tensor>, key: &str) -> Result<Tensor> {
    w.remove(key).with_context(|| format!("model.safetensors lacks {key}"))
}

/// The file's tokenizer, truncating at `max_tokens` and padding nothing (batches are padded
/// or packed here), lowercasing first for `do_lower_case`.
fn load_tokenizer(dir: &Path, max_tokens: usize, do_lower_case: bool) -> Result<Tokenizer> {
    let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("loading tokenizer.json: {e}"))?;
    tokenizer
        .with_truncation(Some(TruncationParams { max_length: max_tokens, ..Default::default() }))
        .map_err(|e| anyhow::anyhow!("truncation: {e}"))?;
    tokenizer.with_padding(None);
    if do_lower_case {
        lowercase_first(&mut tokenizer)?;
    }
    Ok(tokenizer)
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
        let mut w = load_weights(&tdir)?;
        let position_key = "embeddings.position_embeddings.weight";
        let position_rows = w.get(position_key).and_then(|t| t.dims().first().copied());
        let max_tokens = token_limit(&pipeline, &cfg, position_rows.unwrap_or(usize::MAX))?;
        let tokenizer = load_tokenizer(&tdir, max_tokens, pipeline.do_lower_case)?;
        let vocab = tokenizer.get_vocab_size(true);
        let table = |w: &mut HashMap<String, Tensor>, name: &str, rows: usize, declared| {
            let t = take(w, &format!("embeddings.{name}.weight"))?;
            check_table(&t, name, (rows, declared), cfg.hidden)?;
            Ok::<_, anyhow::Error>(t.to_dtype(dtype)?)
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

    /// Tokenizes texts (truncated at the model's `max_seq_length`, as sentence-transformers
    /// does).
    ///
    /// A long text is tokenized from a prefix ending at a word boundary: a prefix of
    /// [`PREFIX_BYTES`], then four times as long, until its tokens fill the limit (then they
    /// are the full text's first tokens) or the prefix is the whole text. The tokenizer's
    /// memory grows with what it is given (about a hundred bytes per input byte), so a
    /// megabyte-long line costs what its first few kilobytes do, unless it has no boundary
    /// [`word_prefix`] may cut at (a line of kana or Thai without spaces or punctuation is
    /// tokenized whole).
    pub fn tokenize(&self, texts: &[String]) -> Result<Vec<Vec<u32>>> {
        if self.prompt.is_empty() {
            return self.tokenize_texts(texts);
        }
        let prompted: Vec<String> = texts.iter().map(|t| format!("{}{t}", self.prompt)).collect();
        self.tokenize_texts(&prompted)
    }

    fn tokenize_texts(&self, texts: &[String]) -> Result<Vec<Vec<u32>>> {
        let mut limits = vec![PREFIX_BYTES; texts.len()];
        let mut ids: Vec<Option<Vec<u32>>> = vec![None; texts.len()];
        loop {
            let todo: Vec<usize> = (0..texts.len()).filter(|&i| ids[i].is_none()).collect();
            if todo.is_empty() {
                return Ok(ids.into_iter().flatten().collect());
            }
            let inputs: Vec<&str> =
                todo.iter().map(|&i| word_prefix(&texts[i], limits[i], &self.cuts)).collect();
            let encodings = self
                .tokenizer
                .encode_batch(inputs.clone(), true)
                .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
            for ((&i, input), e) in todo.iter().zip(&inputs).zip(&encodings) {
                if input.len() == texts[i].len() || e.get_ids().len() >= self.max_tokens {
                    ids[i] = Some(e.get_ids().to_vec());
                } else {
                    limits[i] = limits[i].saturating_mul(4);
                }
            }
        }
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
    /// and normalised as [`embed_ids`](Self::embed_ids), under `no_grad`. f32 models (a bf16
    /// model takes the padded path).
    pub fn embed_ids_packed(&self, seqs: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        multihead::on_pool(|| multihead::no_grad(|| self.embed_packed_graded(seqs)))
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
        let x = (self.word.index_select(&ids, 0)? + self.position.index_select(&pos, 0)?)?
            .broadcast_add(&self.token_type.get(0)?)?;
        let mut x = self.norm.forward(&x)?;
        for layer in &self.layers {
            x = layer.forward_packed(&x, &cu, &PackedOptions::default())?;
        }
        // Pooling and normalisation in f32, each text over its own rows.
        let rows = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
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
        let x = x
            .broadcast_add(&self.position.narrow(0, 0, len)?)?
            .broadcast_add(&self.token_type.get(0)?)?;
        let mut x = self.norm.forward(&x)?;
        let kpm = Mask::Bool(Tensor::from_vec(pad, (n, len), &dev)?);
        for layer in &self.layers {
            x = layer.forward(&x, None, Some(&kpm), false)?;
        }
        // Pooling and normalisation in f32 whatever the model's dtype, over real tokens only.
        let hidden = x.dim(2)?;
        let rows = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
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

#[cfg(test)]
mod tests {
    use super::{word_prefix, Cuts};

    #[test]
    fn word_prefix_ends_at_a_boundary_the_tokenizer_keeps() {
        let plain = Cuts::default();
        let wp = |t: &str, limit: usize| word_prefix(t, limit, &plain).to_string();
        // Short texts, and texts without a boundary past the limit, are whole.
        assert_eq!(wp("short text", 64), "short text");
        assert_eq!(wp(&"x".repeat(100), 10), "x".repeat(100));
        // Before a space or a tab, never inside a word.
        assert_eq!(wp("aaaa bbbbbbbb cc", 6), "aaaa bbbbbbbb");
        assert_eq!(wp("aaaa\tbbbbbbbb\tcc", 6), "aaaa\tbbbbbbbb");
        // After ASCII punctuation (a token of its own).
        assert_eq!(wp("aaaa.bbbbbbbb.cc", 6), "aaaa.bbbbbbbb.");
        // Multi-byte characters are never split.
        assert_eq!(wp("éééééé ü", 3), "éééééé");
        // The limit is a minimum: a boundary right at it counts.
        assert_eq!(wp("abc def", 3), "abc");
        // CJK ideographs are not boundaries unless the normaliser isolates them.
        assert_eq!(wp("中文中文中文", 4), "中文中文中文");
        let bert =
            Cuts { specials: vec!["[MASK]".into(), "[CLS]".into()], cjk: true, whole: false };
        assert_eq!(word_prefix("中文中文中文", 4, &bert), "中文");
        assert_eq!(word_prefix("中文かな", 4, &bert), "中文かな");
        // After Unicode punctuation too (a kana line with its full stops).
        assert_eq!(wp("かなかな。かなかな。かな", 4), "かなかな。");
        assert_eq!(wp("aaaa«bb cc", 3), "aaaa«");
        // Never inside an added token: "[" is punctuation, "[MASK]" one token.
        assert_eq!(word_prefix("aaaa [MASK] bb", 6, &bert), "aaaa [MASK]");
        assert_eq!(word_prefix("aaaa [mask] bb", 6, &bert), "aaaa [mask]");
        assert_eq!(word_prefix("aaaa[MASK][CLS]x", 5, &bert), "aaaa[MASK]");
        assert_eq!(word_prefix("aaaa[MASK][CLS]x", 11, &bert), "aaaa[MASK][CLS]");
        assert_eq!(wp("aaaa [MASK] bb", 6), "aaaa [");
        // Another tokenizer's texts are never cut.
        let other = Cuts { whole: true, ..Cuts::default() };
        assert_eq!(word_prefix("aaaa bbbb cccc", 4, &other), "aaaa bbbb cccc");
    }
}
