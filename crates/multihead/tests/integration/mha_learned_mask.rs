//! A learned float mask (a bias that requires grad) through `MultiheadAttention` on the fused
//! path: outputs, weights and the gradients of the inputs, every parameter and each learned
//! mask against the composed path (candle's autograd through PyTorch's explicit arithmetic),
//! for self-, cross- and separate-key attention, 2-D and 3-D attention masks, float key
//! padding masks, both at once, extra key columns, static keys, grouped-query heads, dropout,
//! a soft cap and the weights with their gradient.

use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use multihead::functional::MhaOptions;
use multihead::random::DropoutKey;
use multihead::{Backend, Mask, MhaConfig, Path};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, mha, var};

/// The learned masks of one case: an attention mask and a key padding mask, either a Var.
#[derive(Clone, Default)]
struct Learned {
    attn: Option<Var>,
    kpm: Option<Var>,
}

impl Learned {
    fn opts(&self, base: MhaOptions) -> MhaOptions {
        let mut o = base;
        if let Some(a) = &self.attn {
            o = o.attn_mask(Mask::Float(a.as_tensor().clone()));
        }
        if let Some(p) = &self.kpm {
            o = o.key_padding_mask(Mask::Float(p.as_tensor().clone()));
        }
        o
    }

    fn vars(&self) -> Vec<&Var> {
        self.attn.iter().chain(&self.kpm).collect()
    }
}

/// The query and the memory (key and value, or key only with `separate_value`).
struct Inputs {
    x: Var,
    mem: Option<Var>,
    separate_value: Option<Var>,
}

/// Output, weights, and the gradients of the inputs, every parameter and each learned mask.
fn run(
    cfg: &MhaConfig,
    inp: &Inputs,
    learned: &Learned,
    opts: MhaOptions,
) -> (Tensor, Option<Tensor>, Vec<Tensor>) {
    let (mut m, vm): (_, VarMap) = mha(cfg.clone(), DType::F32);
    m.train(true);
    let x = inp.x.as_tensor();
    let k = inp.mem.as_ref().map_or(x, |v| v.as_tensor());
    let v = inp.separate_value.as_ref().map_or(k, |v| v.as_tensor());
    let out = m.forward(x, k, v, &learned.opts(opts)).expect("mha");
    let g = det(out.output.dims(), DType::F32, 4.0);
    let mut loss = out.output.mul(&g).unwrap().sum_all().unwrap();
    if let Some(w) = &out.attn_weights {
        let gw = det(w.dims(), DType::F32, 6.0);
        loss = (loss + w.mul(&gw).unwrap().sum_all().unwrap()).unwrap();
    }
    let grads = loss.backward().unwrap();
    let mut gs = Vec::new();
    let inputs = [Some(&inp.x), inp.mem.as_ref(), inp.separate_value.as_ref()];
    for t in inputs.into_iter().flatten().chain(learned.vars()) {
        gs.push(grads.get(t.as_tensor()).expect("input or mask gradient").clone());
    }
    let data = vm.data().lock().unwrap();
    let mut names: Vec<_> = data.keys().cloned().collect();
    names.sort();
    for n in names {
        gs.push(grads.get(data[&n].as_tensor()).expect("parameter gradient").clone());
    }
    (out.output, out.attn_weights, gs)
}

/// Fused against composed; the fused plan must be the fused path.
fn compare(cfg: MhaConfig, inp: Inputs, learned: Learned, opts: MhaOptions, what: &str) {
    let (mut m, _vm) = mha(cfg.clone(), DType::F32);
    m.train(true);
    let x = inp.x.as_tensor();
    let k = inp.mem.as_ref().map_or(x, |v| v.as_tensor());
    let v = inp.separate_value.as_ref().map_or(k, |v| v.as_tensor());
    let plan = m.explain(x, k, v, &learned.opts(opts.clone())).expect("plan");
    assert_eq!(plan.path, Path::Fused, "{what}: {plan}");
    let (a, wa, ga) = run(&cfg, &inp, &learned, opts.clone().backend(Backend::Fused));
    let (b, wb, gb) = run(&cfg, &inp, &learned, opts.backend(Backend::Composed));
    assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("{what}: output"));
    assert_eq!(wa.is_some(), wb.is_some(), "{what}: weights on one path only");
    if let (Some(wa), Some(wb)) = (wa, wb) {
        assert_close(&wa, &wb, Tolerance::F32_FORWARD, &format!("{what}: weights"));
    }
    assert_eq!(ga.len(), gb.len());
    for (i, (x, y)) in ga.iter().zip(&gb).enumerate() {
        assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: gradient {i}"));
    }
    // The mask gradients are not trivially zero.
    let nonzero =
        ga.iter().all(|g| g.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);
    assert!(nonzero, "{what}: a gradient is identically zero");
}

fn self_inputs(shape: &[usize]) -> Inputs {
    Inputs { x: var(&det(shape, DType::F32, 1.0)), mem: None, separate_value: None }
}

fn mask(shape: &[usize], salt: f64) -> Option<Var> {
    Some(var(&det(shape, DType::F32, salt).affine(0.8, 0.0).unwrap()))
}

fn no_weights() -> MhaOptions {
    MhaOptions::default().need_weights(false)
}

#[test]
fn a_learned_attention_mask_gets_its_gradient_on_the_fused_path() {
    let (l, n, e, h) = (11, 2, 16, 4);
    let cfg = MhaConfig::new(e, h);
    let two_d = Learned { attn: mask(&[l, l], 2.0), kpm: None };
    compare(cfg.clone(), self_inputs(&[l, n, e]), two_d.clone(), no_weights(), "(L, S) mask");
    let three_d = Learned { attn: mask(&[n * h, l, l], 3.0), kpm: None };
    let bf = cfg.clone().with_batch_first(true);
    compare(bf, self_inputs(&[n, l, e]), three_d, no_weights(), "(N*H, L, S), batch_first");
    let kpm = Learned { attn: None, kpm: mask(&[n, l], 5.0) };
    compare(cfg.clone(), self_inputs(&[l, n, e]), kpm, no_weights(), "float kpm");
    let both = Learned { attn: mask(&[l, l], 2.0), kpm: mask(&[n, l], 5.0) };
    compare(cfg.clone(), self_inputs(&[l, n, e]), both.clone(), no_weights(), "both");
    // A learned mask beside a boolean padding mask.
    let pad: Vec<u8> = (0..n * l).map(|i| u8::from(i % l >= 8 && i >= l)).collect();
    let pad = Mask::Bool(Tensor::from_vec(pad, (n, l), &crate::common::dev()).unwrap());
    let o = no_weights().key_padding_mask(pad);
    compare(cfg.clone(), self_inputs(&[l, n, e]), two_d.clone(), o, "learned + bool kpm");
    // Unbatched input takes an (H, L, S) mask.
    let unbatched = Learned { attn: mask(&[h, l, l], 7.0), kpm: None };
    compare(cfg, self_inputs(&[l, e]), unbatched, no_weights(), "unbatched (H, L, S)");
}

#[test]
fn a_learned_mask_on_cross_attention_and_extra_keys() {
    let (l, s, n, e, h) = (9, 13, 2, 16, 4);
    let cfg = MhaConfig::new(e, h);
    let cross = || Inputs {
        x: var(&det(&[l, n, e], DType::F32, 1.0)),
        mem: Some(var(&det(&[s, n, e], DType::F32, 8.0))),
        separate_value: None,
    };
    let both = Learned { attn: mask(&[l, s], 2.0), kpm: mask(&[n, s], 5.0) };
    compare(cfg.clone(), cross(), both.clone(), no_weights(), "cross (packed k/v)");
    let separate =
        Inputs { separate_value: Some(var(&det(&[s, n, e], DType::F32, 9.0))), ..cross() };
    compare(cfg.clone(), separate, both.clone(), no_weights(), "separate k, v");
    let extra = cfg.clone().with_add_bias_kv(true).with_add_zero_attn(true);
    compare(extra, cross(), both.clone(), no_weights(), "bias_kv + zero_attn");
    let gqa = MhaConfig::new(e, h).with_num_kv_heads(2);
    compare(gqa, cross(), both, no_weights(), "grouped-query heads");
}

#[test]
fn a_learned_mask_with_weights_dropout_softcap_and_static_keys() {
    let (l, n, e, h) = (10, 2, 16, 4);
    let cfg = MhaConfig::new(e, h);
    let both = Learned { attn: mask(&[n * h, l, l], 2.0), kpm: mask(&[n, l], 5.0) };
    let x = || self_inputs(&[l, n, e]);
    let w = MhaOptions::default();
    compare(cfg.clone(), x(), both.clone(), w.clone(), "averaged weights with gradient");
    let per_head = w.average_attn_weights(false);
    compare(cfg.clone(), x(), both.clone(), per_head, "per-head weights with gradient");
    let key = DropoutKey { seed: 3, offset: 0 };
    let drop = cfg.clone().with_dropout(0.25);
    compare(drop, x(), both.clone(), no_weights().dropout_key(key), "dropout");
    compare(cfg.clone(), x(), both.clone(), no_weights().softcap(0.9), "softcap");
    // Static keys and values `(N·H, S, hd)`, as PyTorch's static_k/static_v.
    let (s, hd) = (7, e / h);
    let sk = det(&[n * h, s, hd], DType::F32, 11.0);
    let sv = det(&[n * h, s, hd], DType::F32, 12.0);
    let stat = Learned { attn: mask(&[l, s], 2.0), kpm: mask(&[n, s], 5.0) };
    let o = no_weights().static_kv(sk, sv);
    compare(cfg, x(), stat, o, "static keys");
}

/// `-inf` entries and a fully masked row in a learned mask: the same output and gradients on
/// both paths (masked entries get a zero gradient; the masked row attends to nothing).
#[test]
fn a_learned_mask_with_minus_infinity_and_a_fully_masked_row() {
    let (l, n, e, h) = (6, 2, 8, 2);
    let mut m = det(&[l, l], DType::F32, 2.0).to_vec2::<f32>().unwrap();
    m[1][2] = f32::NEG_INFINITY;
    m[3] = vec![f32::NEG_INFINITY; l];
    let bias = var(&Tensor::new(m, &crate::common::dev()).unwrap());
    let learned = Learned { attn: Some(bias), kpm: None };
    let cfg = MhaConfig::new(e, h);
    compare(cfg.clone(), self_inputs(&[l, n, e]), learned.clone(), no_weights(), "-inf");
    let (_, _, g) = run(&cfg, &self_inputs(&[l, n, e]), &learned, no_weights());
    let dmask = g[1].to_vec2::<f32>().unwrap();
    assert_eq!(dmask[1][2], 0.0);
    assert!(dmask[3].iter().all(|&x| x == 0.0), "{:?}", dmask[3]);
}

/// A learned `src_mask` through `TransformerEncoderLayer::forward_with`: the mask's, the
/// input's and every parameter's gradients equal between the paths.
#[test]
fn a_learned_src_mask_through_the_encoder_layer() {
    use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
    let (n, l, e) = (2, 9, 16);
    let run = |backend: Backend| -> (Tensor, Vec<Tensor>) {
        let vm = VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &crate::common::dev());
        let c = LayerConfig::new(e, 4).with_dim_feedforward(24).with_dropout(0.0);
        let layer = TransformerEncoderLayer::new(c.with_batch_first(true), vb).unwrap();
        crate::common::perturb(&vm, DType::F32);
        let x = var(&det(&[n, l, e], DType::F32, 1.0));
        let bias = mask(&[l, l], 2.0).unwrap();
        let opts =
            MhaOptions::default().attn_mask(Mask::Float(bias.as_tensor().clone())).backend(backend);
        let out = layer.forward_with(x.as_tensor(), &opts).unwrap();
        let g = det(out.dims(), DType::F32, 4.0);
        let grads = out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
        let mut gs = vec![grads.get(x.as_tensor()).unwrap().clone()];
        gs.push(grads.get(bias.as_tensor()).expect("the mask's gradient").clone());
        let data = vm.data().lock().unwrap();
        let mut names: Vec<_> = data.keys().cloned().collect();
        names.sort();
        for k in names {
            gs.push(grads.get(data[&k].as_tensor()).expect("parameter gradient").clone());
        }
        (out, gs)
    };
    let (a, ga) = run(Backend::Fused);
    let (b, gb) = run(Backend::Composed);
    assert_close(&a, &b, Tolerance::F32_FORWARD, "encoder layer output");
    for (i, (x, y)) in ga.iter().zip(&gb).enumerate() {
        assert_close(x, y, Tolerance::F32_GRAD, &format!("encoder layer gradient {i}"));
    }
}

/// Bad or unusual learned masks: a broadcast view of a smaller `Var` (its gradient summed), a
/// NaN entry (the same NaN rows on both paths), a wrong dtype and a wrong shape (the same
/// typed error on both paths).
#[test]
fn learned_masks_as_views_with_nan_and_wrong_dtype_or_shape() {
    let (l, n, e, h) = (7, 2, 8, 2);
    let cfg = MhaConfig::new(e, h);
    // A (1, S) Var broadcast to (L, S): a view with stride 0.
    let small = var(&det(&[1, l], DType::F32, 3.0));
    let view = small.as_tensor().broadcast_as((l, l)).unwrap();
    let grads = |b: Backend| {
        let (m, _vm) = mha(cfg.clone(), DType::F32);
        let x = det(&[l, n, e], DType::F32, 1.0);
        let o = no_weights().attn_mask(Mask::Float(view.clone())).backend(b);
        let out = m.forward(&x, &x, &x, &o).unwrap().output;
        let g = out.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        (out, g.get(small.as_tensor()).expect("the small bias's gradient").clone())
    };
    let ((oa, ga), (ob, gb)) = (grads(Backend::Fused), grads(Backend::Composed));
    assert_close(&oa, &ob, Tolerance::F32_FORWARD, "broadcast view: output");
    assert_eq!(ga.dims(), &[1, l]);
    assert_close(&ga, &gb, Tolerance::F32_GRAD, "broadcast view: gradient");
    // A NaN in the bias: row 2 of every head is NaN on both paths, the other rows are not.
    let mut m = det(&[l, l], DType::F32, 2.0).to_vec2::<f32>().unwrap();
    m[2][4] = f32::NAN;
    let nan = var(&Tensor::new(m, &crate::common::dev()).unwrap());
    let learned = Learned { attn: Some(nan), kpm: None };
    let rows = |b: Backend| {
        let (o, _, _) = run(&cfg, &self_inputs(&[l, n, e]), &learned, no_weights().backend(b));
        let o = o.to_dtype(DType::F64).unwrap();
        let v: Vec<Vec<f64>> =
            (0..l).map(|i| o.get(i).unwrap().flatten_all().unwrap().to_vec1().unwrap()).collect();
        v.iter().map(|r| r.iter().any(|x| x.is_nan())).collect::<Vec<bool>>()
    };
    let nan_rows = rows(Backend::Fused);
    assert_eq!(nan_rows, rows(Backend::Composed));
    assert!(nan_rows[2] && nan_rows.iter().filter(|&&r| r).count() == 1, "{nan_rows:?}");
    // A wrong dtype and a wrong shape: one error, whatever the path.
    let errs = |mask: Tensor| -> Vec<String> {
        [Backend::Fused, Backend::Composed]
            .map(|b| {
                let (m, _vm) = mha(cfg.clone(), DType::F32);
                let x = det(&[l, n, e], DType::F32, 1.0);
                let o = no_weights().attn_mask(Mask::Float(mask.clone())).backend(b);
                m.forward(&x, &x, &x, &o).expect_err("a bad mask").to_string()
            })
            .to_vec()
    };
    let f64_mask = var(&det(&[l, l], DType::F64, 2.0));
    let e64 = errs(f64_mask.as_tensor().clone());
    assert_eq!(e64[0], e64[1]);
    assert!(e64[0].contains("attn_mask"), "{}", e64[0]);
    let wrong = var(&det(&[l, l + 1], DType::F32, 2.0));
    let es = errs(wrong.as_tensor().clone());
    assert_eq!(es[0], es[1]);
    assert!(es[0].contains("attn_mask") && es[0].contains(&format!("{}", l + 1)), "{}", es[0]);
}
