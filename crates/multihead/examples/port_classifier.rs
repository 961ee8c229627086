//! Porting a whole small PyTorch model to Rust: load its weights, check its numbers, fine-tune
//! it, and hand the weights back to PyTorch.
//!
//! The model is `Classifier` in `tools/port_classifier.py`: `nn.Embedding`, a two-layer
//! `nn.TransformerEncoder` (`batch_first=True`), masked mean pooling and an `nn.Linear` head.
//! A PyTorch user ports it in four steps:
//!
//! 1. **Export the state_dict** from Python, once:
//!    `safetensors.torch.save_file(model.state_dict(), "model.safetensors")`
//!    (`python3 tools/port_classifier.py` does this and records reference logits).
//! 2. **Write the module** in Rust: a struct with one field per sub-module, built from a
//!    `VarBuilder` under the same names PyTorch uses (`vb.pp("encoder")`, ...), and a
//!    `forward` that is the Python `forward` line by line. `NamedParameters` lists the
//!    parameters under PyTorch's keys by chaining `prefixed(name, &child)`.
//! 3. **Load strictly** with `load_strict_file`: every key in the file must be asked for by the
//!    module and vice versa, as `load_state_dict(strict=True)` demands. It returns the module
//!    and the `VarMap` holding its (trainable) parameters. Compare with PyTorch's logits.
//! 4. **Train and save**: any candle optimiser over `vars.all_vars()`; `save_state_dict` writes
//!    PyTorch's keys, so `model.load_state_dict(load_file(path), strict=True)` takes them back.
//!
//! Run with `cargo run --release -p multihead --example port_classifier`.

use std::error::Error;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder};
use multihead::optim::AdamW;
use multihead::state_dict::{
    load_safetensors, load_strict_file, prefixed, save_safetensors, save_state_dict,
};
use multihead::transformer::{LayerConfig, TransformerEncoder};
use multihead::{Embedding, Linear, Mask, NamedParameters};

type Res<T> = std::result::Result<T, Box<dyn Error>>;

const VOCAB: usize = 40;
const CLASSES: usize = 3;

/// `Classifier(vocab=40, d=32, heads=4, ff=64, layers=2, classes=3)` of the Python script.
struct Classifier {
    embedding: Embedding,
    encoder: TransformerEncoder,
    head: Linear,
}

impl Classifier {
    fn new(vb: VarBuilder) -> multihead::Result<Self> {
        let (d, heads, ff, layers) = (32, 4, 64, 2);
        // nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        let layer = LayerConfig::new(d, heads)
            .with_dim_feedforward(ff)
            .with_dropout(0.0)
            .with_batch_first(true);
        // nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        let mut encoder = TransformerEncoder::new(layer, layers, None, vb.pp("encoder"))?;
        encoder.set_enable_nested_tensor(false);
        Ok(Self {
            embedding: Embedding::new(VOCAB, d, vb.pp("embedding"))?,
            encoder,
            head: Linear::new(d, CLASSES, true, vb.pp("head"))?,
        })
    }

    /// `ids` (N, L) u32 or i64; `pad` (N, L) u8 with 1 for padding, PyTorch's bool mask.
    fn forward(&self, ids: &Tensor, pad: &Tensor) -> multihead::Result<Tensor> {
        let x = self.embedding.forward(ids)?;
        let x = self.encoder.forward(&x, None, Some(&Mask::Bool(pad.clone())), None)?;
        // keep = (~pad).unsqueeze(-1).to(x.dtype)
        let keep = pad.eq(0f64)?.to_dtype(x.dtype())?.unsqueeze(D::Minus1)?;
        // pooled = (x * keep).sum(1) / keep.sum(1).clamp(min=1)
        let count = keep.sum(1)?.clamp(1f64, f64::INFINITY)?;
        let pooled = x.broadcast_mul(&keep)?.sum(1)?.broadcast_div(&count)?;
        self.head.forward(&pooled)
    }
}

impl NamedParameters for Classifier {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = prefixed("embedding", &self.embedding);
        v.extend(prefixed("encoder", &self.encoder));
        v.extend(prefixed("head", &self.head));
        v
    }
}

/// A tiny xorshift generator, so the synthetic data is the same on every machine.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A batch of the synthetic task: random lengths 1..=len, tokens 1..40, padding token 0 on
/// the right; the label is the third of the vocabulary (1..=13, 14..=26, 27..=39) that most
/// of the row's tokens come from (ties go to the lower third).
fn batch(rng: &mut XorShift, n: usize, len: usize) -> Res<(Tensor, Tensor, Tensor)> {
    let (mut ids, mut pad, mut labels) = (vec![0u32; n * len], vec![1u8; n * len], Vec::new());
    for b in 0..n {
        let real = 1 + rng.below(len as u64) as usize;
        let mut counts = [0usize; CLASSES];
        for t in 0..real {
            let tok = 1 + rng.below(VOCAB as u64 - 1) as u32;
            counts[(tok as usize - 1) / 13] += 1;
            ids[b * len + t] = tok;
            pad[b * len + t] = 0;
        }
        let top = (0..CLASSES).fold(0, |best, c| if counts[c] > counts[best] { c } else { best });
        labels.push(top as u32);
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(ids, (n, len), &dev)?,
        Tensor::from_vec(pad, (n, len), &dev)?,
        Tensor::from_vec(labels, n, &dev)?,
    ))
}

fn loss_on(model: &Classifier, data: &(Tensor, Tensor, Tensor)) -> Res<Tensor> {
    let logits = model.forward(&data.0, &data.1)?;
    Ok(candle_nn::loss::cross_entropy(&logits, &data.2)?)
}

fn main() -> Res<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let fixtures = root.join("tests/fixtures/classifier");
    let dev = Device::Cpu;

    // (a) Load PyTorch's state_dict strictly and compare with PyTorch's logits.
    let weights = fixtures.join("model.safetensors");
    let (model, vars) = load_strict_file(weights, DType::F32, &dev, |vb| Classifier::new(vb))?;
    println!("loaded {} parameters by PyTorch's keys", model.named_parameters().len());
    let reference = load_safetensors(fixtures.join("reference.safetensors"), &dev)?;
    let get =
        |k: &str| reference.get(k).ok_or_else(|| format!("reference.safetensors lacks {k:?}"));
    let (ids, pad, expected) = (get("ids")?, get("pad")?, get("logits")?);
    // The dropout is 0, so training mode computes what PyTorch's eval mode does.
    let logits = multihead::no_grad(|| model.forward(ids, pad))?;
    let diff = (&logits - expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("logits vs PyTorch: max |diff| = {diff:.3e}");
    if diff.is_nan() || diff > 1e-5 {
        return Err(format!("logits differ from PyTorch's by {diff:.3e} (> 1e-5)").into());
    }

    // (b) Fine-tune on a synthetic task with AdamW and cross-entropy.
    let mut opt = AdamW::new(vars.all_vars(), ParamsAdamW { lr: 1e-3, ..Default::default() })?;
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let held_out = batch(&mut rng, 256, 12)?;
    let first = loss_on(&model, &held_out)?.to_scalar::<f32>()?;
    println!("held-out loss before training: {first:.4}");
    for step in 1..=150 {
        let loss = loss_on(&model, &batch(&mut rng, 32, 12)?)?;
        opt.backward_step(&loss)?;
        if step % 25 == 0 {
            println!("step {step:3}: training loss {:.4}", loss.to_scalar::<f32>()?);
        }
    }
    let last = loss_on(&model, &held_out)?.to_scalar::<f32>()?;
    println!("held-out loss after training:  {last:.4}");
    if last.is_nan() || last >= first {
        return Err(format!("training did not lower the loss ({first:.4} -> {last:.4})").into());
    }

    // (c) Save under PyTorch's keys, for `model.load_state_dict(load_file(path), strict=True)`,
    // and our logits on the reference ids next to them, for the verifier to compare.
    let trained = multihead::no_grad(|| model.forward(ids, pad))?;
    println!("trained logits on the reference ids (PyTorch should print the same):\n{trained}");
    std::fs::create_dir_all(root.join("target"))?;
    save_state_dict(&model, root.join("target/classifier_trained.safetensors"))?;
    let logits_path = root.join("target/classifier_trained.logits.safetensors");
    save_safetensors([("logits", &trained)], logits_path)?;
    println!("saved target/classifier_trained.safetensors; check it in PyTorch with");
    println!("  python3 tools/port_classifier.py --verify target/classifier_trained.safetensors");
    Ok(())
}
