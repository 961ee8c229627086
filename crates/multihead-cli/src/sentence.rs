//! The sentence-transformers pipeline around the encoder, as a model folder describes it:
//! `modules.json` (a Transformer, a Pooling module, optionally Normalize),
//! `sentence_bert_config.json` (`max_seq_length`, `do_lower_case`) and the Pooling module's
//! `config.json` (which token embeddings make the sentence embedding). Read once at load;
//! [`Pipeline::finish`] then turns one text's final hidden states into its embedding, as
//! sentence-transformers' `Pooling` and `Normalize` modules do.
//!
//! A folder without `modules.json` is a plain Hugging Face model: sentence-transformers wraps
//! it in mean pooling without normalisation, and so does this.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

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
    /// Whether a Normalize module ends the pipeline (L2 normalisation, eps 1e-12).
    pub normalize: bool,
}

fn read_json(path: &Path) -> Result<Value> {
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
        if !modules.is_file() {
            // A plain Hugging Face folder: what sentence-transformers builds around it.
            return Self::with_transformer(dir.to_path_buf(), vec![PoolMode::Mean], None, false);
        }
        let list = read_json(&modules)?;
        let Some(list) = list.as_array() else {
            bail!("modules.json must be a list of modules, got {list}");
        };
        let mut kinds = Vec::new();
        for m in list {
            let t = m.get("type").and_then(Value::as_str).unwrap_or_default();
            let path = m.get("path").and_then(Value::as_str).unwrap_or_default();
            kinds.push((short_type(t).to_string(), path.to_string(), t.to_string()));
        }
        let names: Vec<&str> = kinds.iter().map(|k| k.0.as_str()).collect();
        let normalize = match names.as_slice() {
            ["Transformer", "Pooling"] => false,
            ["Transformer", "Pooling", "Normalize"] => true,
            _ => {
                let full: Vec<&str> = kinds.iter().map(|k| k.2.as_str()).collect();
                bail!(
                    "modules.json lists {full:?}; multihead embed runs a Transformer, a Pooling \
                     module and optionally Normalize, in that order (Dense and other modules are \
                     not supported)"
                );
            }
        };
        let (modes, pooled_dim) = read_pooling(&dir.join(&kinds[1].1).join("config.json"))?;
        Self::with_transformer(dir.join(&kinds[0].1), modes, pooled_dim, normalize)
    }

    fn with_transformer(
        transformer_dir: PathBuf,
        modes: Vec<PoolMode>,
        pooled_dim: Option<usize>,
        normalize: bool,
    ) -> Result<Self> {
        let (mut max_seq_length, mut do_lower_case) = (None, false);
        let sbert = transformer_dir.join("sentence_bert_config.json");
        if sbert.is_file() {
            let v = read_json(&sbert)?;
            max_seq_length = match v.get("max_seq_length") {
                None | Some(Value::Null) => None,
                Some(x) => Some(x.as_u64().and_then(|n| usize::try_from(n).ok()).with_context(
                    || {
                        format!(
                            "sentence_bert_config.json: max_seq_length must be a non-negative integer, got {x}"
                        )
                    },
                )?),
            };
            do_lower_case = match v.get("do_lower_case") {
                None | Some(Value::Null) => false,
                Some(x) => x.as_bool().with_context(|| {
                    format!(
                        "sentence_bert_config.json: do_lower_case must be true or false, got {x}"
                    )
                })?,
            };
        }
        Ok(Self { transformer_dir, max_seq_length, do_lower_case, modes, pooled_dim, normalize })
    }

    /// One text's embedding from its final hidden states `rows` (`len × hidden`, row-major;
    /// a text of no tokens pools to zeros): the pooling modes concatenated, then L2-normalised when the pipeline ends
    /// in Normalize. Sums are taken in f64.
    pub fn finish(&self, rows: &[f32], hidden: usize) -> Vec<f32> {
        let len = rows.len().checked_div(hidden).unwrap_or(0);
        let row = |i: usize| &rows[i * hidden..(i + 1) * hidden];
        let mut out = Vec::with_capacity(self.modes.len() * hidden);
        for mode in &self.modes {
            match mode {
                PoolMode::Cls | PoolMode::LastToken | PoolMode::Max if len == 0 => {
                    out.extend(std::iter::repeat_n(0.0, hidden))
                }
                PoolMode::Cls => out.extend_from_slice(row(0)),
                PoolMode::LastToken => out.extend_from_slice(row(len - 1)),
                PoolMode::Max => out.extend(
                    (0..hidden)
                        .map(|c| (0..len).map(|i| row(i)[c]).fold(f32::NEG_INFINITY, f32::max)),
                ),
                PoolMode::Mean | PoolMode::MeanSqrtLen | PoolMode::WeightedMean => {
                    let weight = |i: usize| match mode {
                        PoolMode::WeightedMean => (i + 1) as f64,
                        _ => 1.0,
                    };
                    let mut sum = vec![0f64; hidden];
                    for i in 0..len {
                        let w = weight(i);
                        sum.iter_mut().zip(row(i)).for_each(|(s, &x)| *s += w * x as f64);
                    }
                    let total: f64 = (0..len).map(weight).sum::<f64>().max(1e-9);
                    let denom = if *mode == PoolMode::MeanSqrtLen { total.sqrt() } else { total };
                    out.extend(sum.iter().map(|s| (s / denom) as f32));
                }
            }
        }
        if self.normalize {
            let norm = out.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt().max(1e-12);
            out.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
        }
        out
    }
}

/// The Pooling module's modes and declared dimension, from its `config.json`: the
/// `pooling_mode` key (a name or a list of names), or the legacy `pooling_mode_*` flags
/// (mean when none is set), as sentence-transformers reads them.
fn read_pooling(path: &Path) -> Result<(Vec<PoolMode>, Option<usize>)> {
    let v = read_json(path)?;
    let name = path.display();
    let dim = match v.get("embedding_dimension").or_else(|| v.get("word_embedding_dimension")) {
        None | Some(Value::Null) => None,
        Some(x) => Some(x.as_u64().and_then(|n| usize::try_from(n).ok()).with_context(|| {
            format!("{name}: the embedding dimension must be a non-negative integer, got {x}")
        })?),
    };
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
            let set: Vec<PoolMode> = MODES
                .iter()
                .filter(|m| v.get(m.2).and_then(Value::as_bool).unwrap_or(false))
                .map(|m| m.0)
                .collect();
            if set.is_empty() {
                vec![PoolMode::Mean]
            } else {
                set
            }
        }
    };
    Ok((modes, dim))
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
            normalize,
        }
    }

    /// Each mode by hand on three tokens of width 2.
    #[test]
    fn each_pooling_mode_matches_its_definition() {
        let rows = [1.0, -2.0, 3.0, 0.5, -1.0, 4.0];
        let p = |m| pipeline(vec![m], false).finish(&rows, 2);
        assert_eq!(p(PoolMode::Cls), vec![1.0, -2.0]);
        assert_eq!(p(PoolMode::LastToken), vec![-1.0, 4.0]);
        assert_eq!(p(PoolMode::Max), vec![3.0, 4.0]);
        assert_eq!(p(PoolMode::Mean), vec![1.0, 2.5 / 3.0]);
        let root3 = 3f64.sqrt();
        assert_eq!(p(PoolMode::MeanSqrtLen), vec![(3.0 / root3) as f32, (2.5 / root3) as f32]);
        // Weights 1, 2, 3 over 6.
        assert_eq!(p(PoolMode::WeightedMean), vec![4.0 / 6.0, 11.0 / 6.0]);
        let both = pipeline(vec![PoolMode::Max, PoolMode::Cls], true).finish(&rows, 2);
        let norm = (9.0f32 + 16.0 + 1.0 + 4.0).sqrt();
        let want = [3.0 / norm, 4.0 / norm, 1.0 / norm, -2.0 / norm];
        for (a, b) in both.iter().zip(want) {
            assert!((a - b).abs() <= 1e-7, "{both:?} vs {want:?}");
        }
    }
}
