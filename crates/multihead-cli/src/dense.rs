//! sentence-transformers' `Dense` module: a linear layer and an activation applied to the
//! pooled sentence embedding (`activation(linear(x))`, plus `x` or a projection of it with
//! `use_residual`), read from its folder's `config.json` and `model.safetensors`.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

/// The activations a Dense config may name (by their PyTorch class).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    Identity,
    Tanh,
    Relu,
    Sigmoid,
}

/// One Dense module.
#[derive(Debug, Clone)]
pub(crate) struct Dense {
    in_features: usize,
    out_features: usize,
    /// `(out, in)`, row-major.
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    act: Act,
    /// `use_residual`: `None` without; `Some(None)` adds the input itself (`in == out`),
    /// `Some(Some(w))` its projection by `w` (`(out, in)`, no bias).
    residual: Option<Option<Vec<f32>>>,
}

/// A weight of `file` as f32 values, checked against `shape`.
fn take(
    file: &Path,
    w: &std::collections::HashMap<String, Tensor>,
    key: &str,
    shape: &[usize],
) -> Result<Vec<f32>> {
    let t = w.get(key).with_context(|| format!("{}: lacks {key}", file.display()))?;
    if t.dims() != shape {
        bail!("{}: {key} is {:?}, expected {shape:?}", file.display(), t.dims());
    }
    if !t.dtype().is_float() {
        bail!(
            "{}: {key} is {:?}; a Dense weight must be a float tensor",
            file.display(),
            t.dtype()
        );
    }
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    // As for the encoder's weights: a NaN or infinite one would make every embedding NaN.
    if v.iter().any(|x| !x.is_finite()) {
        bail!(
            "{}: {key} holds NaN or infinite values; the embeddings would be NaN",
            file.display()
        );
    }
    Ok(v)
}

impl Dense {
    /// Reads the module in `dir`, whose input is `input` values wide.
    pub fn read(dir: &Path, input: usize) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        crate::sentence::plain_file(&cfg_path)?;
        let text = std::fs::read_to_string(&cfg_path)
            .with_context(|| format!("reading {}", cfg_path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", cfg_path.display()))?;
        let name = cfg_path.display();
        let size = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(Value::as_u64)
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| *n > 0)
                .with_context(|| format!("{name}: {k} must be a positive integer"))
        };
        let (in_features, out_features) = (size("in_features")?, size("out_features")?);
        if in_features != input {
            bail!("{name}: in_features is {in_features} but the embedding before it has {input} values");
        }
        for k in ["module_input_name", "module_output_name"] {
            match v.get(k) {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) if s == "sentence_embedding" => {}
                Some(x) => bail!("{name}: {k} {x} is not supported; only \"sentence_embedding\""),
            }
        }
        let act = match v.get("activation_function").and_then(Value::as_str) {
            None => Act::Identity,
            Some(a) => match a.rsplit('.').next().unwrap_or(a) {
                "Identity" => Act::Identity,
                "Tanh" => Act::Tanh,
                "ReLU" => Act::Relu,
                "Sigmoid" => Act::Sigmoid,
                _ => bail!("{name}: activation_function {a} is not supported; Tanh, Identity, ReLU and Sigmoid are"),
            },
        };
        let has_bias = v.get("bias").is_none_or(|b| b.as_bool().unwrap_or(true));
        let use_residual = v.get("use_residual").and_then(Value::as_bool).unwrap_or(false);
        let file = dir.join("model.safetensors");
        if !file.is_file() {
            bail!("{}: not found; multihead embed reads a Dense module's weights from model.safetensors (convert pytorch_model.bin with safetensors' save_file)", file.display());
        }
        let w = multihead::state_dict::load_safetensors(&file, &Device::Cpu)?;
        let weight = take(&file, &w, "linear.weight", &[out_features, in_features])?;
        let bias = match has_bias {
            true => Some(take(&file, &w, "linear.bias", &[out_features])?),
            false => None,
        };
        let residual = match (use_residual, in_features == out_features) {
            (false, _) => None,
            (true, true) => Some(None),
            (true, false) => {
                Some(Some(take(&file, &w, "residual.weight", &[out_features, in_features])?))
            }
        };
        Ok(Self { in_features, out_features, weight, bias, act, residual })
    }

    /// The width of the module's output.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// `activation(x·Wᵀ + b)` (plus the residual), products summed in f64.
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        let product = |w: &[f32]| -> Vec<f64> {
            w.chunks(self.in_features)
                .map(|row| row.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>())
                .collect()
        };
        let mut y = product(&self.weight);
        if let Some(b) = &self.bias {
            y.iter_mut().zip(b).for_each(|(y, &b)| *y += b as f64);
        }
        let mut out: Vec<f32> = y
            .iter()
            .map(|&z| {
                let z = z as f32;
                match self.act {
                    Act::Identity => z,
                    Act::Tanh => z.tanh(),
                    Act::Relu => {
                        if z.is_nan() || z > 0.0 {
                            z
                        } else {
                            0.0
                        }
                    }
                    Act::Sigmoid => 1.0 / (1.0 + (-z).exp()),
                }
            })
            .collect();
        match &self.residual {
            None => {}
            Some(None) => out.iter_mut().zip(x).for_each(|(o, &x)| *o += x),
            Some(Some(w)) => {
                out.iter_mut().zip(product(w)).for_each(|(o, r)| *o += r as f32);
            }
        }
        out
    }
}
