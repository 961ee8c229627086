//! all-MiniLM-L6-v2 (BERT) from this crate's `TransformerEncoderLayer`s: its configuration,
//! its weights checked at load, tokenization as sentence-transformers does it, and the
//! embedding of a batch.
//!
//! The model is BERT: token, position and token-type embeddings with a LayerNorm, six post-norm
//! encoder layers (GELU, LayerNorm eps 1e-12), mean pooling over real tokens, L2
//! normalisation. BERT's separate query/key/value weights are concatenated into PyTorch's packed
//! `in_proj_weight` at load time, so each layer is a plain [`TransformerEncoderLayer`].

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use multihead::state_dict::{load_safetensors, load_strict};
use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
use multihead::{Activation, LayerNorm, Mask};
use tokenizers::{Tokenizer, TruncationParams};

/// The BERT hyper-parameters read from `config.json`.
struct BertConfig {
    hidden: usize,
    layers: usize,
    heads: usize,
    intermediate: usize,
    eps: f64,
}

fn read_config(dir: &Path) -> Result<BertConfig> {
    let text = std::fs::read_to_string(dir.join("config.json")).context("reading config.json")?;
    let v: serde_json::Value = serde_json::from_str(&text).context("parsing config.json")?;
    let get = |k: &str| {
        v.get(k)
            .and_then(|x| x.as_u64())
            .map(|x| x as usize)
            .with_context(|| format!("config.json lacks {k}"))
    };
    if v.get("hidden_act").and_then(|x| x.as_str()) != Some("gelu") {
        bail!("config.json: only hidden_act \"gelu\" is supported");
    }
    let cfg = BertConfig {
        hidden: get("hidden_size")?,
        layers: get("num_hidden_layers")?,
        heads: get("num_attention_heads")?,
        intermediate: get("intermediate_size")?,
        eps: match v.get("layer_norm_eps") {
            None => 1e-12,
            Some(x) => x.as_f64().context("config.json: layer_norm_eps must be a number")?,
        },
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
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    norm: LayerNorm,
    layers: Vec<TransformerEncoderLayer>,
}

fn take(w: &mut HashMap<String, Tensor>, key: &str) -> Result<Tensor> {
    w.remove(key).with_context(|| format!("model.safetensors lacks {key}"))
}

impl MiniLm {
    /// Loads `config.json`, `tokenizer.json` and `model.safetensors` from `dir`.
    pub fn load(dir: &Path, dtype: DType) -> Result<Self> {
        let cfg = read_config(dir)?;
        let dev = Device::Cpu;
        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| anyhow::anyhow!("loading tokenizer.json: {e}"))?;
        // sentence-transformers: truncate at max_seq_length 256, pad per batch (we pad ourselves).
        tokenizer
            .with_truncation(Some(TruncationParams { max_length: 256, ..Default::default() }))
            .map_err(|e| anyhow::anyhow!("truncation: {e}"))?;
        tokenizer.with_padding(None);
        let mut w = load_safetensors(dir.join("model.safetensors"), &dev)?;
        let strip: Vec<String> = w.keys().filter(|k| k.starts_with("bert.")).cloned().collect();
        for k in strip {
            if let Some(t) = w.remove(&k) {
                w.insert(k["bert.".len()..].to_string(), t);
            }
        }
        let word = take(&mut w, "embeddings.word_embeddings.weight")?.to_dtype(dtype)?;
        let position = take(&mut w, "embeddings.position_embeddings.weight")?.to_dtype(dtype)?;
        let token_type =
            take(&mut w, "embeddings.token_type_embeddings.weight")?.to_dtype(dtype)?;
        let mut norm_state = HashMap::new();
        norm_state.insert("weight".to_string(), take(&mut w, "embeddings.LayerNorm.weight")?);
        norm_state.insert("bias".to_string(), take(&mut w, "embeddings.LayerNorm.bias")?);
        let (norm, _) = load_strict(&norm_state, dtype, &dev, |vb| {
            LayerNorm::new(cfg.hidden, cfg.eps, true, vb)
        })?;
        let layer_cfg = LayerConfig::new(cfg.hidden, cfg.heads)
            .with_dim_feedforward(cfg.intermediate)
            .with_dropout(0.0)
            .with_activation(Activation::Gelu)
            .with_layer_norm_eps(cfg.eps)
            .with_batch_first(true);
        let mut layers = Vec::new();
        for i in 0..cfg.layers {
            let p = |s: &str| format!("encoder.layer.{i}.{s}");
            let mut st = HashMap::new();
            let cat = |w: &mut HashMap<String, Tensor>, what: &str| -> Result<Tensor> {
                let parts = ["query", "key", "value"]
                    .iter()
                    .map(|n| take(w, &p(&format!("attention.self.{n}.{what}"))))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&parts, 0)?)
            };
            st.insert("self_attn.in_proj_weight".to_string(), cat(&mut w, "weight")?);
            st.insert("self_attn.in_proj_bias".to_string(), cat(&mut w, "bias")?);
            for (ours, theirs) in [
                ("self_attn.out_proj", "attention.output.dense"),
                ("norm1", "attention.output.LayerNorm"),
                ("linear1", "intermediate.dense"),
                ("linear2", "output.dense"),
                ("norm2", "output.LayerNorm"),
            ] {
                for what in ["weight", "bias"] {
                    st.insert(
                        format!("{ours}.{what}"),
                        take(&mut w, &p(&format!("{theirs}.{what}")))?,
                    );
                }
            }
            let (mut layer, _) = load_strict(&st, dtype, &dev, |vb| {
                TransformerEncoderLayer::new(layer_cfg.clone(), vb)
            })?;
            layer.eval();
            layers.push(layer);
        }
        w.remove("embeddings.position_ids");
        w.retain(|k, _| !k.starts_with("pooler."));
        if !w.is_empty() {
            let mut extra: Vec<&String> = w.keys().collect();
            extra.sort();
            bail!("model.safetensors has tensors this model does not use: {extra:?}");
        }
        Ok(Self { tokenizer, word, position, token_type, norm, layers })
    }

    /// Tokenizes texts (truncated at 256 tokens, as sentence-transformers does).
    pub fn tokenize(&self, texts: &[String]) -> Result<Vec<Vec<u32>>> {
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        Ok(encodings.iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// Embeds a batch of tokenized texts: padded to the longest, masked with a key padding
    /// mask, mean pooled over real tokens and L2-normalised, under `no_grad` (no autograd
    /// graph is kept). Returns `(N, hidden)`.
    pub fn embed_ids(&self, ids: &[&[u32]]) -> Result<Tensor> {
        multihead::no_grad(|| self.embed_ids_graded(ids))
    }

    fn embed_ids_graded(&self, seqs: &[&[u32]]) -> Result<Tensor> {
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
        let pad = Tensor::from_vec(pad, (n, len), &dev)?;
        let kpm = Mask::Bool(pad.clone());
        for layer in &self.layers {
            x = layer.forward(&x, None, Some(&kpm), false)?;
        }
        // Pooling and normalisation in f32 whatever the model's dtype.
        let x = x.to_dtype(DType::F32)?;
        // Mean over real tokens.
        let keep = pad.eq(0u8)?.to_dtype(DType::F32)?.unsqueeze(2)?;
        let summed = x.broadcast_mul(&keep)?.sum(1)?;
        let counts = keep.sum(1)?.clamp(1e-9, f64::INFINITY)?;
        let mean = summed.broadcast_div(&counts)?;
        let norm = mean.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.clamp(1e-12, f64::INFINITY)?;
        Ok(mean.broadcast_div(&norm)?)
    }
}

