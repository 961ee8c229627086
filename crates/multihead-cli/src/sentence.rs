//! The sentence-transformers pipeline around the encoder, as a model folder describes it:
//! `modules.json` (a Transformer, a Pooling module, Dense modules, optionally Normalize),
//! `sentence_bert_config.json` (`max_seq_length`, `do_lower_case`), the Pooling module's
//! `config.json` (which token embeddings make the sentence embedding) and
//! `config_sentence_transformers.json` (named prompts, the default one). Read once at load;
//! [`Pipeline::finish`] then turns one text's final hidden states into its embedding, as
//! sentence-transformers' `Pooling` and `Normalize` modules do.
//!
//! A folder without `modules.json` is a plain Hugging Face model: sentence-transformers wraps
//! it in mean pooling without normalisation and reads none of its own files there, and so
//! does this. Flags and numbers are read as Python reads them (`1` and `"true"` are true,
//! `128.0` is 128), since sentence-transformers passes them on unchecked.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::dense::Dense;

/// One pooling mode of sentence-transformers' `Pooling` module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PoolMode {
    /// The first token's hidden state (`[CLS]`).
    Cls,
    /// The largest value of each channel over the text's tokens.
    Max,
    /// The mean over the text's tokens.
    Mean,
    /// The sum over the text's tokens divided by the square root of their count.
    MeanSqrtLen,
    /// The mean weighted by position (1 for the first token, 2 for the second, ...).
    WeightedMean,
    /// The last token's hidden state.
    LastToken,
}

/// The modes in the order sentence-transformers concatenates the legacy `pooling_mode_*`
/// flags, with their names in the new `pooling_mode` key and the legacy ones.
const MODES: [(PoolMode, &str, &str); 6] = [
    (PoolMode::Cls, "cls", "pooling_mode_cls_token"),
    (PoolMode::Max, "max", "pooling_mode_max_tokens"),
    (PoolMode::Mean, "mean", "pooling_mode_mean_tokens"),
    (PoolMode::MeanSqrtLen, "mean_sqrt_len_tokens", "pooling_mode_mean_sqrt_len_tokens"),
    (PoolMode::WeightedMean, "weightedmean", "pooling_mode_weightedmean_tokens"),
    (PoolMode::LastToken, "lasttoken", "pooling_mode_lasttoken"),
];

/// What surrounds the encoder in a sentence-transformers folder.
#[derive(Debug, Clone)]
pub(crate) struct Pipeline {
    /// The Transformer module's folder (config.json, tokenizer.json, model.safetensors).
    pub transformer_dir: PathBuf,
    /// `sentence_bert_config.json`'s `max_seq_length`, when it gives one.
    pub max_seq_length: Option<usize>,
    /// `sentence_bert_config.json`'s `do_lower_case`: texts are lowercased before the
    /// tokenizer's own normaliser.
    pub do_lower_case: bool,
    /// The pooling modes, concatenated in this order.
    pub modes: Vec<PoolMode>,
    /// The Pooling config's embedding dimension, when it gives one (checked against the
    /// encoder's hidden size).
    pub pooled_dim: Option<usize>,
    /// The Dense modules' folders, in order (loaded by [`Pipeline::load_dense`]).
    pub dense_dirs: Vec<PathBuf>,
    /// The Dense modules, applied to the pooled embedding in order.
    pub dense: Vec<Dense>,
    /// Whether a Normalize module ends the pipeline (L2 normalisation, eps 1e-12).
    pub normalize: bool,
    /// Whether a prompt's tokens are pooled with the text's (the Pooling config's
    /// `include_prompt`, default true).
    pub include_prompt: bool,
    /// `config_sentence_transformers.json`'s named prompts (`"query": "query: "`).
    pub prompts: Prompts,
    /// The prompt `encode` puts before every text when none is asked for, by name.
    pub default_prompt_name: Option<String>,
}

/// Python's truth value of a JSON value (sentence-transformers reads flags with `if x:`).
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|x| x != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// A non-negative whole number (`128` or `128.0`; one past `usize`, such as the `1e30` of a
/// tokenizer without a limit, is `usize::MAX`), or `None` for `null` or absent; anything else
/// is an error naming `what`.
pub(crate) fn whole(v: Option<&Value>, what: &str) -> Result<Option<usize>> {
    let v = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let n = match v.as_u64() {
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => v.as_f64().filter(|x| *x >= 0.0 && x.fract() == 0.0).map(|x| {
            if x >= usize::MAX as f64 {
                usize::MAX
            } else {
                x as usize
            }
        }),
    };
    n.map(Some).with_context(|| format!("{what} must be a non-negative whole number, got {v}"))
}

/// sentence-transformers' own prompts, both empty until a folder gives them text.
fn builtin_prompts() -> Prompts {
    ["query", "document"].map(|n| (n.to_string(), String::new())).to_vec()
}

/// Refuses a path that names a FIFO, a socket or a device: a model folder holds plain files,
/// and reading a FIFO that nobody writes would wait for ever. (A missing path passes: its
/// reader names it.)
pub(crate) fn plain_file(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() && !m.is_dir() => bail!(
            "{}: not a regular file (a FIFO, a socket or a device); a model folder holds plain files",
            path.display()
        ),
        _ => Ok(()),
    }
}

pub(crate) fn read_json(path: &Path) -> Result<Value> {
    plain_file(path)?;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The last component of a module's type (`sentence_transformers.models.Pooling` -> `Pooling`).
fn short_type(t: &str) -> &str {
    t.rsplit('.').next().unwrap_or(t)
}

impl Pipeline {
    /// Reads the pipeline of the model folder `dir`.
    pub fn read(dir: &Path) -> Result<Self> {
        let modules = dir.join("modules.json");
        if !modules.exists() {
            // A plain Hugging Face folder: what sentence-transformers builds around it.
            return Ok(Self {
                transformer_dir: dir.to_path_buf(),
                max_seq_length: None,
                do_lower_case: false,
                modes: vec![PoolMode::Mean],
                pooled_dim: None,
                dense_dirs: Vec::new(),
                dense: Vec::new(),
                normalize: false,
                include_prompt: true,
                prompts: builtin_prompts(),
                default_prompt_name: None,
            });
        }
        let list = read_json(&modules)?;
        let Some(list) = list.as_array() else {
            bail!("modules.json must be a list of modules, got {list}");
        };
        let mut kinds = Vec::new();
        for (i, m) in list.iter().enumerate() {
            let t = m.get("type").and_then(Value::as_str).unwrap_or_default();
            let Some(path) = m.get("path").and_then(Value::as_str) else {
                bail!("modules.json: module {i} ({t}) has no \"path\"");
            };
            // A module lies inside the model folder (as sentence-transformers requires): "" or
            // a relative path without "..".
            let inside = std::path::Path::new(path).components().all(|c| {
                matches!(c, std::path::Component::Normal(_) | std::path::Component::CurDir)
            });
            if !inside {
                bail!("modules.json: module {i} ({t}) has path {path:?}, outside the model folder; give a path relative to it, without \"..\"");
            }
            let ours = t.strip_prefix("sentence_transformers.").map(short_type).unwrap_or("");
            kinds.push((ours.to_string(), path.to_string(), t.to_string()));
        }
        let names: Vec<&str> = kinds.iter().map(|k| k.0.as_str()).collect();
        // Transformer, Pooling, Dense..., and Normalize last if at all.
        let normalize = names.len() > 2 && names.last() == Some(&"Normalize");
        let end = names.len() - usize::from(normalize);
        let dense = names.get(2..end).unwrap_or_default();
        match (names.get(..2), dense.iter().all(|n| *n == "Dense")) {
            (Some(["Transformer", "Pooling"]), true) => {}
            _ => {
                let full: Vec<&str> = kinds.iter().map(|k| k.2.as_str()).collect();
                bail!(
                    "modules.json lists {full:?}; multihead embed runs sentence-transformers' \
                     Transformer, Pooling, any Dense modules and optionally Normalize, in that \
                     order (custom and other modules are not supported)"
                );
            }
        };
        let dense_dirs = kinds[2..end].iter().map(|k| dir.join(&k.1)).collect();
        let pooling = read_pooling(&dir.join(&kinds[1].1).join("config.json"))?;
        let transformer_dir = dir.join(&kinds[0].1);
        let (max_seq_length, do_lower_case) = read_transformer_config(&transformer_dir)?;
        let (prompts, default_prompt_name) = read_prompts(dir)?;
        Ok(Self {
            transformer_dir,
            max_seq_length,
            do_lower_case,
            modes: pooling.modes,
            pooled_dim: Some(pooling.dim),
            dense_dirs,
            dense: Vec::new(),
            normalize,
            include_prompt: pooling.include_prompt,
            prompts,
            default_prompt_name,
        })
    }

    /// Loads the Dense modules for an encoder of width `hidden`; returns the embedding's width.
    pub fn load_dense(&mut self, hidden: usize) -> Result<usize> {
        let mut width = self.modes.len() * hidden;
        self.dense.clear();
        for dir in &self.dense_dirs {
            let d = Dense::read(dir, width)?;
            width = d.out_features();
            self.dense.push(d);
        }
        Ok(width)
    }

    /// The prompt to put before every text: `--prompt` as given, else the prompt named by
    /// `--prompt-name` (an empty name means none), else the folder's default prompt, if any.
    pub fn choose_prompt(&self, text: Option<&str>, name: Option<&str>) -> Result<String> {
        if let Some(t) = text {
            return Ok(t.to_string());
        }
        let Some(name) = name.or(self.default_prompt_name.as_deref()).filter(|n| !n.is_empty())
        else {
            return Ok(String::new());
        };
        match self.prompts.iter().find(|p| p.0 == name) {
            Some(p) => Ok(p.1.clone()),
            None => {
                let names: Vec<&str> = self.prompts.iter().map(|p| p.0.as_str()).collect();
                bail!("no prompt named {name:?}; config_sentence_transformers.json has {names:?}")
            }
        }
    }

    /// One text's embedding from its final hidden states `rows` (`len × hidden`, row-major;
    /// a text of no tokens pools to zeros), whose first `prompt_len` tokens are the prompt's:
    /// the pooling modes concatenated, then L2-normalised when the pipeline ends in
    /// Normalize. Sums are taken in f64.
    pub fn finish(&self, rows: &[f32], hidden: usize, prompt_len: usize) -> Vec<f32> {
        let len = rows.len().checked_div(hidden).unwrap_or(0);
        let row = |i: usize| &rows[i * hidden..(i + 1) * hidden];
        // Pooled tokens: the prompt's are left out when the Pooling config says so (then the
        // weighted mean keeps each token's own position as its weight, and CLS pooling takes
        // the first token after the prompt, as sentence-transformers does).
        let first = if self.include_prompt { 0 } else { prompt_len.min(len) };
        let mut out = Vec::with_capacity(self.modes.len() * hidden);
        let zeros = || std::iter::repeat_n(0.0, hidden);
        for mode in &self.modes {
            match mode {
                _ if len == 0 => out.extend(zeros()),
                // All tokens left out: the first (sentence-transformers' argmax of an empty
                // mask), no last token (zeros), a maximum over nothing (-inf).
                PoolMode::Cls => out.extend_from_slice(row(if first < len { first } else { 0 })),
                PoolMode::LastToken if first == len => out.extend(zeros()),
                PoolMode::LastToken => out.extend_from_slice(row(len - 1)),
                PoolMode::Max => out
                    .extend((0..hidden).map(|c| {
                        (first..len).map(|i| row(i)[c]).fold(f32::NEG_INFINITY, f32::max)
                    })),
                PoolMode::Mean | PoolMode::MeanSqrtLen | PoolMode::WeightedMean => {
                    let weight = |i: usize| match mode {
                        PoolMode::WeightedMean => (i + 1) as f64,
                        _ => 1.0,
                    };
                    let mut sum = vec![0f64; hidden];
                    for i in first..len {
                        let w = weight(i);
                        sum.iter_mut().zip(row(i)).for_each(|(s, &x)| *s += w * x as f64);
                    }
                    let total: f64 = (first..len).map(weight).sum::<f64>().max(1e-9);
                    let denom = if *mode == PoolMode::MeanSqrtLen { total.sqrt() } else { total };
                    out.extend(sum.iter().map(|s| (s / denom) as f32));
                }
            }
        }
        for d in &self.dense {
            out = d.apply(&out);
        }
        if self.normalize {
            let norm = out.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt().max(1e-12);
            out.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
        }
        out
    }
}

/// What a Pooling module's `config.json` says.
struct PoolingConfig {
    modes: Vec<PoolMode>,
    dim: usize,
    include_prompt: bool,
}

/// The Pooling module's config: the `pooling_mode` key (a name or a list of names), or the
/// legacy `pooling_mode_*` flags (mean when none is set), as sentence-transformers reads
/// them; its embedding dimension (required, as sentence-transformers requires it).
fn read_pooling(path: &Path) -> Result<PoolingConfig> {
    let v = read_json(path)?;
    let name = path.display();
    if !v.is_object() {
        bail!("{name}: the Pooling config must be a JSON object, got {v}");
    }
    let key = ["embedding_dimension", "word_embedding_dimension"]
        .into_iter()
        .find(|k| v.get(*k).is_some())
        .unwrap_or("word_embedding_dimension");
    let dim = whole(v.get(key), &format!("{name}: {key}"))?
        .with_context(|| format!("{name}: the Pooling config lacks {key}"))?;
    let by_name = |s: &Value| -> Result<PoolMode> {
        let s = s.as_str().unwrap_or_default();
        MODES.iter().find(|m| m.1 == s).map(|m| m.0).with_context(|| {
            let valid: Vec<&str> = MODES.iter().map(|m| m.1).collect();
            format!("{name}: unknown pooling mode {s:?}; valid modes are {valid:?}")
        })
    };
    let modes = match v.get("pooling_mode") {
        Some(Value::Array(list)) if !list.is_empty() => {
            list.iter().map(by_name).collect::<Result<Vec<_>>>()?
        }
        Some(s @ Value::String(_)) => vec![by_name(s)?],
        Some(x) => bail!("{name}: pooling_mode must be a mode's name or a list of them, got {x}"),
        None => {
            let set: Vec<PoolMode> =
                MODES.iter().filter(|m| v.get(m.2).is_some_and(truthy)).map(|m| m.0).collect();
            if set.is_empty() {
                vec![PoolMode::Mean]
            } else {
                set
            }
        }
    };
    let include_prompt = v.get("include_prompt").is_none_or(truthy);
    Ok(PoolingConfig { modes, dim, include_prompt })
}

/// `sentence_bert_config.json` in the Transformer's folder: the token limit and
/// `do_lower_case`. The limit is `tokenizer_args` / `processor_kwargs`' `model_max_length`
/// when given (sentence-transformers lets it override `max_seq_length`), else
/// `max_seq_length`.
fn read_transformer_config(dir: &Path) -> Result<(Option<usize>, bool)> {
    let path = dir.join("sentence_bert_config.json");
    if !path.exists() {
        return Ok((None, false));
    }
    let v = read_json(&path)?;
    if !v.is_object() {
        bail!("sentence_bert_config.json must be a JSON object, got {v}");
    }
    let mut limit = whole(v.get("max_seq_length"), "sentence_bert_config.json: max_seq_length")?;
    // sentence-transformers moves `tokenizer_args` into `processor_kwargs`, replacing it.
    let kw = if v.get("tokenizer_args").is_some() { "tokenizer_args" } else { "processor_kwargs" };
    let what = format!("sentence_bert_config.json: {kw}.model_max_length");
    if let Some(n) = whole(v.get(kw).and_then(|a| a.get("model_max_length")), &what)? {
        limit = Some(n);
    }
    Ok((limit, v.get("do_lower_case").is_some_and(truthy)))
}

/// Named prompts: `(name, text)`.
type Prompts = Vec<(String, String)>;

/// `config_sentence_transformers.json`'s named prompts (over sentence-transformers' own
/// `query` and `document`, both empty) and default prompt name.
fn read_prompts(dir: &Path) -> Result<(Prompts, Option<String>)> {
    let path = dir.join("config_sentence_transformers.json");
    if !path.exists() {
        return Ok((builtin_prompts(), None));
    }
    let v = read_json(&path)?;
    // sentence-transformers' own prompts, empty unless the file gives them.
    let mut prompts = builtin_prompts();
    match v.get("prompts") {
        None | Some(Value::Null) | Some(Value::Object(_)) => {}
        Some(x) => bail!(
            "config_sentence_transformers.json: prompts must be an object of named texts, got {x}"
        ),
    }
    if let Some(map) = v.get("prompts").and_then(Value::as_object) {
        for (k, p) in map {
            // A null prompt is an empty one (sentence-transformers' `_validate_prompts`).
            let text = match p {
                Value::Null => String::new(),
                Value::String(t) => t.clone(),
                other => bail!(
                    "config_sentence_transformers.json: prompt {k:?} must be text, got {other}"
                ),
            };
            match prompts.iter_mut().find(|p| &p.0 == k) {
                Some(p) => p.1 = text,
                None => prompts.push((k.clone(), text)),
            }
        }
    }
    let default = match v.get("default_prompt_name") {
        None | Some(Value::Null) => None,
        Some(Value::String(n)) => Some(n.clone()),
        Some(x) => {
            bail!("config_sentence_transformers.json: default_prompt_name must be text, got {x}")
        }
    };
    if let Some(n) = default.as_ref().filter(|n| !prompts.iter().any(|p| &p.0 == *n)) {
        let names: Vec<&str> = prompts.iter().map(|p| p.0.as_str()).collect();
        bail!("config_sentence_transformers.json: the default prompt {n:?} is not among the prompts {names:?}");
    }
    Ok((prompts, default))
}

#[cfg(test)]
mod tests {
    use super::{Pipeline, PoolMode};

    fn pipeline(modes: Vec<PoolMode>, normalize: bool) -> Pipeline {
        Pipeline {
            transformer_dir: Default::default(),
            max_seq_length: None,
            do_lower_case: false,
            modes,
            pooled_dim: None,
            dense_dirs: Vec::new(),
            dense: Vec::new(),
            normalize,
            include_prompt: true,
            prompts: Vec::new(),
            default_prompt_name: None,
        }
    }

    /// Each mode by hand on three tokens of width 2.
    #[test]
    fn each_pooling_mode_matches_its_definition() {
        let rows = [1.0, -2.0, 3.0, 0.5, -1.0, 4.0];
        let p = |m| pipeline(vec![m], false).finish(&rows, 2, 1);
        assert_eq!(p(PoolMode::Cls), vec![1.0, -2.0]);
        assert_eq!(p(PoolMode::LastToken), vec![-1.0, 4.0]);
        assert_eq!(p(PoolMode::Max), vec![3.0, 4.0]);
        assert_eq!(p(PoolMode::Mean), vec![1.0, 2.5 / 3.0]);
        let root3 = 3f64.sqrt();
        assert_eq!(p(PoolMode::MeanSqrtLen), vec![(3.0 / root3) as f32, (2.5 / root3) as f32]);
        // Weights 1, 2, 3 over 6.
        assert_eq!(p(PoolMode::WeightedMean), vec![4.0 / 6.0, 11.0 / 6.0]);
        let both = pipeline(vec![PoolMode::Max, PoolMode::Cls], true).finish(&rows, 2, 0);
        // Without the prompt's first token: the weighted mean keeps weights 2 and 3.
        let mut no_prompt = pipeline(vec![PoolMode::Cls, PoolMode::WeightedMean], false);
        no_prompt.include_prompt = false;
        assert_eq!(no_prompt.finish(&rows, 2, 1), vec![3.0, 0.5, 0.6, 2.6]);
        assert_eq!(no_prompt.finish(&rows, 2, 3), vec![1.0, -2.0, 0.0, 0.0]);
        let norm = (9.0f32 + 16.0 + 1.0 + 4.0).sqrt();
        let want = [3.0 / norm, 4.0 / norm, 1.0 / norm, -2.0 / norm];
        for (a, b) in both.iter().zip(want) {
            assert!((a - b).abs() <= 1e-7, "{both:?} vs {want:?}");
        }
    }
}
