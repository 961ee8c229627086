//! Porting torchvision's `VisionTransformer` to Rust, twice: once with a hand-written
//! `EncoderBlock` under torchvision's own keys, once with `TransformerEncoderLayer` standing in
//! for it through a `KeyMap`. Both load torchvision's state_dict strictly, match its logits and
//! gradients, and save weights that torchvision loads back strictly.
//!
//! The model is `VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
//! hidden_dim=64, mlp_dim=128, num_classes=10)` of `tools/port_vit.py`, which wrote its
//! state_dict, reference images, logits and gradients under `tests/fixtures/vit`. What a port
//! needs, in order of appearance:
//!
//! - **raw parameters**: `class_token` and `encoder.pos_embedding` are `nn.Parameter`s, read with
//!   `vb.get(shape, name)` and listed in `NamedParameters`;
//! - **a patch embedding**: `conv_proj` is a stride-8 8×8 convolution, so each output is a
//!   `Linear` over one non-overlapping patch: the image cut into patches by a reshape and a
//!   permute, and the conv weight `(64, 3, 8, 8)` read as a `(64, 192)` linear weight (the same
//!   memory, no copy of the file's layout);
//! - **`mlp.0`-style keys**: `nn.Sequential` children are named by index, so the hand-written
//!   block builds its two `Linear`s under `vb.pp("mlp.0")` and `vb.pp("mlp.3")`;
//! - **the usual silent mismatches**: LayerNorm eps 1e-6 (PyTorch's default is 1e-5), batch
//!   first, pre-norm (`norm_first`), GELU, and a head that is not zero (torchvision initialises
//!   it to zeros: a parity check on such a model passes whatever the encoder computes);
//! - **train/eval for the whole model** with `multihead::Train`, and the **gradient of a
//!   parameter looked up by its PyTorch key** in the `VarMap` the load returned;
//! - **saving what was loaded** with `save_loaded` / `save_loaded_with`, which refuse a
//!   `NamedParameters` that forgot a parameter;
//! - **a training step** with `multihead::optim::AdamW` (PyTorch's AdamW) over the `VarMap` the load returned, the whole
//!   step (forward, loss, backward, update) inside one `multihead::on_pool`, timed and checked
//!   to lower the loss.
//!
//! Run with `cargo run --release -p multihead --example port_vit`.

use std::collections::HashMap;
use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder};
use multihead::functional::add;
use multihead::optim::AdamW;
use multihead::state_dict::{load_safetensors, load_strict, prefixed, KeyMap};
use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
use multihead::{
    Activation, LayerNorm, Linear, MhaConfig, MultiheadAttention, NamedParameters, Train,
};

type Res<T> = std::result::Result<T, Box<dyn Error>>;

// Freed large blocks kept for the next call, so that a loop runs on warm memory (the system
// allocator hands them back and every call faults its pages in again).
#[global_allocator]
static GLOBAL: multihead::memory::ReuseLarge<std::alloc::System> =
    multihead::memory::ReuseLarge::new(std::alloc::System, 1 << 30);

// VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64,
// mlp_dim=128, num_classes=10)
const IMAGE: usize = 32;
const PATCH: usize = 8;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const HIDDEN: usize = 64;
const MLP: usize = 128;
const CLASSES: usize = 10;
/// torchvision's `partial(nn.LayerNorm, eps=1e-6)`.
const EPS: f64 = 1e-6;

/// One encoder block, as the ViT calls it.
trait Block: NamedParameters + Train + Sync {
    fn forward(&self, x: &Tensor) -> multihead::Result<Tensor>;
}

/// torchvision's `EncoderBlock`, written by hand under its own keys.
struct EncoderBlock {
    ln_1: LayerNorm,
    self_attention: MultiheadAttention,
    ln_2: LayerNorm,
    mlp_0: Linear,
    mlp_3: Linear,
}

impl EncoderBlock {
    fn new(vb: VarBuilder) -> multihead::Result<Self> {
        // nn.MultiheadAttention(hidden_dim, num_heads, dropout=0.0, batch_first=True)
        let attn = MhaConfig::new(HIDDEN, HEADS).with_batch_first(true);
        Ok(Self {
            ln_1: LayerNorm::new(HIDDEN, EPS, true, vb.pp("ln_1"))?,
            self_attention: MultiheadAttention::new(attn, vb.pp("self_attention"))?,
            ln_2: LayerNorm::new(HIDDEN, EPS, true, vb.pp("ln_2"))?,
            // MLPBlock: Linear (0), GELU (1), Dropout (2), Linear (3), Dropout (4)
            mlp_0: Linear::new(HIDDEN, MLP, true, vb.pp("mlp.0"))?,
            mlp_3: Linear::new(MLP, HIDDEN, true, vb.pp("mlp.3"))?,
        })
    }
}

impl Block for EncoderBlock {
    // Mirrors torchvision.models.vision_transformer.EncoderBlock.forward.
    fn forward(&self, input: &Tensor) -> multihead::Result<Tensor> {
        // Residual sums with `functional::add` (candle's `+` gives the same numbers, slower on
        // few cores: docs/performance.md).
        let x = self.ln_1.forward(input)?;
        let x = add(&self.self_attention.self_attention(&x)?, input)?;
        // mlp: Linear + GELU as one op (the numbers of the two), then the second Linear
        let y = self.mlp_0.forward_act(&self.ln_2.forward(&x)?, Activation::Gelu)?;
        add(&x, &self.mlp_3.forward(&y)?)
    }
}

impl NamedParameters for EncoderBlock {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = prefixed("ln_1", &self.ln_1);
        v.extend(prefixed("self_attention", &self.self_attention));
        v.extend(prefixed("ln_2", &self.ln_2));
        v.extend(prefixed("mlp.0", &self.mlp_0));
        v.extend(prefixed("mlp.3", &self.mlp_3));
        v
    }
}

impl Train for EncoderBlock {
    fn train(&mut self, mode: bool) {
        Train::train(&mut self.self_attention, mode); // the only part with dropout
    }
}

/// `TransformerEncoderLayer` is torchvision's `EncoderBlock` with other names: pre-norm, GELU,
/// eps 1e-6, batch first, dropout 0.
fn layer_config() -> LayerConfig {
    LayerConfig::new(HIDDEN, HEADS)
        .with_dim_feedforward(MLP)
        .with_dropout(0.0)
        .with_activation(Activation::Gelu)
        .with_layer_norm_eps(EPS)
        .with_norm_first(true)
        .with_batch_first(true)
}

impl Block for TransformerEncoderLayer {
    fn forward(&self, x: &Tensor) -> multihead::Result<Tensor> {
        TransformerEncoderLayer::forward(self, x, None, None, false)
    }
}

/// torchvision's names for `TransformerEncoderLayer`'s parts (file side, module side).
fn torchvision_keys() -> KeyMap {
    KeyMap::new()
        .rename("ln_1", "norm1")
        .rename("self_attention", "self_attn")
        .rename("ln_2", "norm2")
        .rename("mlp.0", "linear1")
        .rename("mlp.3", "linear2")
}

struct Vit<B> {
    class_token: Tensor,
    /// `conv_proj` as a linear layer over flattened patches.
    patch: Linear,
    pos_embedding: Tensor,
    layers: Vec<B>,
    ln: LayerNorm,
    head: Linear,
}

impl<B: Block> Vit<B> {
    fn new(
        vb: VarBuilder,
        block: impl Fn(VarBuilder) -> multihead::Result<B>,
    ) -> multihead::Result<Self> {
        let conv = vb.pp("conv_proj");
        // The (64, 3, 8, 8) conv weight read as a (64, 192) linear weight: the same memory.
        let w =
            conv.get((HIDDEN, 3, PATCH, PATCH), "weight")?.reshape((HIDDEN, 3 * PATCH * PATCH))?;
        let patch = Linear::from_weights(w, Some(conv.get(HIDDEN, "bias")?));
        let enc = vb.pp("encoder");
        let seq = (IMAGE / PATCH) * (IMAGE / PATCH) + 1;
        let layers = (0..LAYERS)
            .map(|i| block(enc.pp(format!("layers.encoder_layer_{i}"))))
            .collect::<multihead::Result<Vec<_>>>()?;
        Ok(Self {
            class_token: vb.get((1, 1, HIDDEN), "class_token")?,
            patch,
            pos_embedding: enc.get((1, seq, HIDDEN), "pos_embedding")?,
            layers,
            ln: LayerNorm::new(HIDDEN, EPS, true, enc.pp("ln"))?,
            head: Linear::new(HIDDEN, CLASSES, true, vb.pp("heads").pp("head"))?,
        })
    }

    /// `images` (N, 3, 32, 32) -> logits (N, 10).
    // Mirrors torchvision.models.VisionTransformer.forward.
    fn forward(&self, images: &Tensor) -> multihead::Result<Tensor> {
        // The whole forward on rayon's pool: one hop, not one per module (docs/porting.md).
        multihead::on_pool(|| self.forward_here(images))
    }

    fn forward_here(&self, images: &Tensor) -> multihead::Result<Tensor> {
        // _process_input's checks: (N, 3, IMAGE, IMAGE) images, channels first. A channels-last
        // batch has as many elements and would otherwise be cut into wrong patches.
        let dims = images.dims();
        if dims.len() != 4 || dims[1..] != [3, IMAGE, IMAGE] {
            return Err(multihead::Error::Shape {
                op: "vit",
                arg: "images",
                msg: format!(
                    "expected (N, 3, {IMAGE}, {IMAGE}) images (channels first, as torchvision's \
                     VisionTransformer), got {dims:?}; permute a channels-last batch with \
                     `permute((0, 3, 1, 2))`"
                ),
            });
        }
        let n = images.dim(0)?;
        let g = IMAGE / PATCH;
        // _process_input: (N, 3, 32, 32) -> (N, 16, 64); the conv as a product per patch, its
        // input the patch's (channel, row, column) values in the weight's order.
        let patches = images
            .reshape((n, 3, g, PATCH, g, PATCH))?
            .permute((0, 2, 4, 1, 3, 5))?
            .reshape((n, g * g, 3 * PATCH * PATCH))?;
        let x = self.patch.forward(&patches)?;
        let token = self.class_token.broadcast_as((n, 1, HIDDEN))?;
        let x = Tensor::cat(&[&token, &x], 1)?;
        // input + self.pos_embedding: the broadcast made whole, then `add` (candle's
        // broadcast_add of this many elements runs on candle's pool; docs/porting.md).
        let mut x = add(&x, &self.pos_embedding.broadcast_as(x.shape())?.contiguous()?)?;
        for layer in &self.layers {
            x = layer.forward(&x)?;
        }
        let x = self.ln.forward(&x)?;
        self.head.forward(&x.narrow(1, 0, 1)?.squeeze(1)?)
    }
}

impl<B: Block> NamedParameters for Vit<B> {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let conv_weight = self.patch.weight().reshape((HIDDEN, 3, PATCH, PATCH));
        let mut v = vec![("class_token".to_string(), self.class_token.clone())];
        if let Ok(w) = conv_weight {
            v.push(("conv_proj.weight".to_string(), w));
        }
        v.extend(self.patch.bias().map(|b| ("conv_proj.bias".to_string(), b.clone())));
        v.push(("encoder.pos_embedding".to_string(), self.pos_embedding.clone()));
        for (i, layer) in self.layers.iter().enumerate() {
            v.extend(prefixed(&format!("encoder.layers.encoder_layer_{i}"), layer));
        }
        v.extend(prefixed("encoder.ln", &self.ln));
        v.extend(prefixed("heads.head", &self.head));
        v
    }
}

impl<B: Block> Train for Vit<B> {
    fn train(&mut self, mode: bool) {
        Train::train(&mut self.layers, mode);
    }
}

/// Largest |a - b|.
fn max_diff(a: &Tensor, b: &Tensor) -> Res<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(D::Minus1)?.to_scalar::<f32>()?)
}

/// Loads, checks logits and gradients against PyTorch's, times the eval forward and a training
/// step, and saves.
fn port<B: Block>(
    name: &str,
    map: &KeyMap,
    state: &HashMap<String, Tensor>,
    reference: &HashMap<String, Tensor>,
    block: impl Fn(VarBuilder) -> multihead::Result<B>,
) -> Res<()> {
    let dev = Device::Cpu;
    let get =
        |k: &str| reference.get(k).ok_or_else(|| format!("reference.safetensors lacks {k:?}"));
    let (mut model, vars) =
        load_strict(&map.to_module(state)?, DType::F32, &dev, |vb| Vit::new(vb, &block))?;
    println!("{name}: loaded {} tensors strictly", model.named_parameters().len());

    // Logits in eval mode, as torchvision's `model.eval()` under `torch.no_grad()`.
    Train::eval(&mut model);
    let images = get("images")?;
    let logits = multihead::no_grad(|| model.forward(images))?;
    let diff = max_diff(&logits, get("logits")?)?;
    println!("{name}: logits vs torchvision: max |diff| = {diff:.2e}");
    if diff.is_nan() || diff > 1e-5 {
        return Err(format!("{name}: logits differ by {diff:.3e} (> 1e-5)").into());
    }

    // Gradients of sum(logits * upstream) in training mode, by PyTorch key.
    Train::train(&mut model, true);
    let x = Var::from_tensor(images)?;
    let loss = (model.forward(x.as_tensor())? * get("upstream")?)?.sum_all()?;
    let grads = loss.backward()?;
    let mut worst = (0f32, String::new());
    for key in [
        "images",
        "class_token",
        "conv_proj.weight",
        "encoder.pos_embedding",
        "encoder.layers.encoder_layer_0.self_attention.in_proj_weight",
        "encoder.layers.encoder_layer_1.mlp.0.weight",
        "heads.head.weight",
    ] {
        let got = if key == "images" {
            grads.get(x.as_tensor()).cloned()
        } else {
            // The parameter the module loaded under this PyTorch key.
            let data = vars.data().lock().map_err(|_| "poisoned VarMap")?;
            let var = data.get(&map.to_module_key(key)).ok_or_else(|| format!("no {key}"))?;
            grads.get(var.as_tensor()).cloned()
        };
        let got = got.ok_or_else(|| format!("{name}: no gradient for {key}"))?;
        let d = max_diff(&got, get(&format!("grad.{key}"))?)?;
        if d.is_nan() || d > worst.0 {
            worst = (d, key.to_string());
        }
    }
    println!("{name}: gradients vs torchvision: max |diff| = {:.2e} ({})", worst.0, worst.1);
    if worst.0.is_nan() || worst.0 > 1e-4 {
        return Err(
            format!("{name}: gradient of {} differs by {:.3e} (> 1e-4)", worst.1, worst.0).into()
        );
    }

    // Eval forward at batch 64, the size a user would time.
    Train::eval(&mut model);
    let batch = Tensor::randn(0f32, 1.0, (64, 3, IMAGE, IMAGE), &dev)?;
    let mut best = f64::INFINITY;
    let iters: usize =
        std::env::var("PORT_VIT_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    for _ in 0..iters.max(1) {
        let t = Instant::now();
        multihead::no_grad(|| model.forward(&batch))?;
        best = best.min(t.elapsed().as_secs_f64() * 1e3);
    }
    println!("{name}: eval forward, batch 64: {best:.2} ms (fastest of {iters}; PORT_VIT_ITERS)");
    time_training(name, map, state, &block, iters)?;
    // A channels-last batch (as many elements) is refused, as torchvision refuses it.
    let channels_last = batch.permute((0, 2, 3, 1))?.contiguous()?;
    match multihead::no_grad(|| model.forward(&channels_last)) {
        Err(multihead::Error::Shape { .. }) => {}
        other => return Err(format!("{name}: a channels-last batch gave {other:?}").into()),
    }

    // Save what was loaded under torchvision's keys; check them against the file's.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::create_dir_all(root.join("target"))?;
    let path = root.join(format!("target/vit_saved_{name}.safetensors"));
    multihead::state_dict::save_loaded_with(&model, &vars, map, &path)?;
    let saved = load_safetensors(&path, &dev)?;
    for (k, t) in state {
        let back = saved.get(k).ok_or_else(|| format!("{name}: saved file lacks {k}"))?;
        if back.dims() != t.dims() || max_diff(back, t)? != 0.0 {
            return Err(format!("{name}: saved {k} differs from the loaded one").into());
        }
    }
    if saved.len() != state.len() {
        return Err(format!(
            "{name}: saved {} tensors, torchvision has {}",
            saved.len(),
            state.len()
        )
        .into());
    }
    println!(
        "{name}: saved {} tensors under torchvision's keys to {}",
        saved.len(),
        path.display()
    );
    Ok(())
}

/// Times a whole training step at batch 64 on a fresh copy of the model: the forward, the
/// cross-entropy loss, the backward and an AdamW update of every parameter, as a PyTorch
/// training loop runs them (`tools/bench_small.py` times torchvision's model beside it).
fn time_training<B: Block>(
    name: &str,
    map: &KeyMap,
    state: &HashMap<String, Tensor>,
    block: impl Fn(VarBuilder) -> multihead::Result<B>,
    iters: usize,
) -> Res<()> {
    let dev = Device::Cpu;
    let (model, vars) =
        load_strict(&map.to_module(state)?, DType::F32, &dev, |vb| Vit::new(vb, &block))?;
    let mut opt = AdamW::new(vars.all_vars(), ParamsAdamW { lr: 1e-3, ..Default::default() })?;
    let images = Tensor::randn(0f32, 1.0, (64, 3, IMAGE, IMAGE), &dev)?;
    let labels: Vec<u32> = (0..64).map(|i| (i % CLASSES) as u32).collect();
    let labels = Tensor::from_vec(labels, 64, &dev)?;
    // One training step, on the pool as a whole (docs/porting.md): forward, loss, backward and
    // the update hop once, not once per module.
    let step = |opt: &mut AdamW| -> Res<f32> {
        let run = || -> candle_core::Result<f32> {
            let logits = model.forward_here(&images).map_err(candle_core::Error::wrap)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &labels)?;
            opt.backward_step(&loss)?;
            loss.to_scalar::<f32>()
        };
        Ok(multihead::on_pool(run)?)
    };
    let first = step(&mut opt)?;
    let mut best = f64::INFINITY;
    let mut last = first;
    for _ in 0..iters.max(1) {
        let t = Instant::now();
        last = step(&mut opt)?;
        best = best.min(t.elapsed().as_secs_f64() * 1e3);
    }
    // The same batch over and over: a step that learns nothing is a broken step.
    if last.is_nan() || last >= first {
        return Err(format!("{name}: training did not lower the loss ({first} -> {last})").into());
    }
    println!(
        "{name}: train step (forward, cross-entropy, backward, AdamW), batch 64: {best:.2} ms \
         (fastest of {iters}; loss {first:.3} -> {last:.3})"
    );
    Ok(())
}

fn main() -> Res<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let fixtures = root.join("tests/fixtures/vit");
    let dev = Device::Cpu;
    let state = load_safetensors(fixtures.join("model.safetensors"), &dev)?;
    let reference = load_safetensors(fixtures.join("reference.safetensors"), &dev)?;
    let logits = reference.get("logits").ok_or("reference.safetensors lacks logits")?;
    // A reference that is (nearly) zero proves nothing (torchvision's head starts at zero).
    let scale = logits.abs()?.flatten_all()?.max(D::Minus1)?.to_scalar::<f32>()?;
    if scale < 1e-2 {
        return Err(format!("the reference logits are nearly zero ({scale:e})").into());
    }
    port("hand_written", &KeyMap::new(), &state, &reference, EncoderBlock::new)?;
    let layer = |vb: VarBuilder| TransformerEncoderLayer::new(layer_config(), vb);
    port("encoder_layer", &torchvision_keys(), &state, &reference, layer)?;
    println!("check them in torchvision: python3 tools/port_vit.py --verify target/vit_saved_encoder_layer.safetensors");
    Ok(())
}
