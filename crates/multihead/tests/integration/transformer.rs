//! Behaviour tests for the Transformer layers.

use candle_core::{DType, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead::transformer::{
    DecoderMasks, LayerConfig, NormConfig, Transformer, TransformerConfig, TransformerDecoderLayer,
    TransformerEncoder, TransformerEncoderLayer, TransformerMasks,
};
use multihead::{Activation, Mask, NamedParameters};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, dev};

const F64: DType = DType::F64;

fn vb(vm: &VarMap) -> VarBuilder<'static> {
    VarBuilder::from_varmap(vm, F64, &dev())
}

fn perturb(vm: &VarMap) {
    crate::common::perturb(vm, F64);
}

fn cfg() -> LayerConfig {
    LayerConfig::new(8, 2).with_dim_feedforward(16).with_dropout(0.0)
}

#[test]
fn encoder_layer_is_causal_equals_its_mask_and_padding_equals_no_padding() {
    let vm = VarMap::new();
    let mut layer = TransformerEncoderLayer::new(cfg().with_batch_first(true), vb(&vm)).unwrap();
    perturb(&vm);
    layer.eval();
    let x = det(&[2, 5, 8], F64, 1.0);
    let causal = Mask::Float(multihead::generate_square_subsequent_mask(5, F64, &dev()).unwrap());
    let a = layer.forward(&x, Some(&causal), None, true).unwrap();
    let b = layer.forward(&x, Some(&causal), None, false).unwrap();
    assert_close(&a, &b, Tolerance::F64, "is_causal");

    let short = x.narrow(1, 0, 3).unwrap();
    let kpm = Mask::Bool(Tensor::new(&[[0u8, 0, 0, 1, 1], [0, 0, 0, 1, 1]], &dev()).unwrap());
    let padded = layer.forward(&x, None, Some(&kpm), false).unwrap();
    let plain = layer.forward(&short, None, None, false).unwrap();
    assert_close(&padded.narrow(1, 0, 3).unwrap(), &plain, Tolerance::F64, "padding");
}

#[test]
fn decoder_layer_unbatched_equals_a_batch_of_one() {
    let vm = VarMap::new();
    let layer = TransformerDecoderLayer::new(
        cfg().with_norm_first(true).with_activation(Activation::Gelu),
        vb(&vm),
    )
    .unwrap();
    perturb(&vm);
    let tgt = det(&[4, 8], F64, 1.0);
    let mem = det(&[6, 8], F64, 2.0);
    let masks = DecoderMasks {
        tgt_mask: Some(Mask::Float(
            multihead::generate_square_subsequent_mask(4, F64, &dev()).unwrap(),
        )),
        memory_key_padding_mask: Some(Mask::Bool(
            Tensor::new(&[0u8, 0, 0, 0, 1, 1], &dev()).unwrap(),
        )),
        ..Default::default()
    };
    let un = layer.forward(&tgt, &mem, &masks).unwrap();
    let masks1 = DecoderMasks {
        memory_key_padding_mask: Some(Mask::Bool(
            Tensor::new(&[[0u8, 0, 0, 0, 1, 1]], &dev()).unwrap(),
        )),
        ..masks
    };
    let b1 =
        layer.forward(&tgt.unsqueeze(1).unwrap(), &mem.unsqueeze(1).unwrap(), &masks1).unwrap();
    assert_close(&un, &b1.squeeze(1).unwrap(), Tolerance::F64, "unbatched");
}

#[test]
fn encoder_detects_causal_masks_like_pytorch() {
    let vm = VarMap::new();
    let enc = TransformerEncoder::new(cfg(), 2, Some(NormConfig::default()), vb(&vm)).unwrap();
    perturb(&vm);
    let x = det(&[5, 2, 8], F64, 1.0);
    let float = Mask::Float(multihead::generate_square_subsequent_mask(5, F64, &dev()).unwrap());
    let bits: Vec<u8> = (0..5).flat_map(|i| (0..5).map(move |j| (j > i) as u8)).collect();
    let boolean = Mask::Bool(Tensor::from_vec(bits, (5, 5), &dev()).unwrap());
    let hinted = enc.forward(&x, Some(&float), None, Some(true)).unwrap();
    for m in [&float, &boolean] {
        let detected = enc.forward(&x, Some(m), None, None).unwrap();
        assert_close(&detected, &hinted, Tolerance::F64, "detected");
    }
    // A non-causal mask is used as given with is_causal=None.
    let zeros = Mask::Float(Tensor::zeros((5, 5), F64, &dev()).unwrap());
    let none = enc.forward(&x, None, None, None).unwrap();
    assert_close(
        &enc.forward(&x, Some(&zeros), None, None).unwrap(),
        &none,
        Tolerance::F64,
        "zeros",
    );
}

#[test]
fn encoder_inference_zeroes_padded_positions_like_pytorchs_nested_path() {
    let vm = VarMap::new();
    let mut enc = TransformerEncoder::new(cfg().with_batch_first(true), 2, None, vb(&vm)).unwrap();
    perturb(&vm);
    enc.eval();
    let x = det(&[2, 4, 8], F64, 1.0);
    let kpm = Mask::Bool(Tensor::new(&[[0u8, 0, 1, 1], [0, 0, 0, 0]], &dev()).unwrap());
    let training_like = enc.forward(&x, None, Some(&kpm), None).unwrap();
    // PyTorch's `with torch.no_grad():` in eval mode.
    let inference = multihead::no_grad(|| enc.forward(&x, None, Some(&kpm), None)).unwrap();
    assert_close(
        &inference.narrow(1, 0, 2).unwrap(),
        &training_like.narrow(1, 0, 2).unwrap(),
        Tolerance::F64,
        "kept",
    );
    let pad = inference.get(0).unwrap().narrow(0, 2, 2).unwrap();
    assert_eq!(pad.abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap(), 0.0);
    assert!(
        training_like
            .get(0)
            .unwrap()
            .narrow(0, 2, 2)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
            > 0.0
    );
}

#[test]
fn transformer_checks_its_arguments_and_trains_every_parameter() {
    let vm = VarMap::new();
    let tcfg = TransformerConfig { layer: cfg(), num_encoder_layers: 2, num_decoder_layers: 1 };
    let model = Transformer::new(tcfg, vb(&vm)).unwrap();
    perturb(&vm);
    let src = det(&[5, 2, 8], F64, 1.0);
    let bad_batch = det(&[4, 3, 8], F64, 2.0);
    let e = model.forward(&src, &bad_batch, &TransformerMasks::default()).unwrap_err().to_string();
    assert!(e.contains("the batch number of src and tgt must be equal"), "{e}");
    let bad_feat = det(&[4, 2, 6], F64, 2.0);
    let e = model.forward(&src, &bad_feat, &TransformerMasks::default()).unwrap_err().to_string();
    assert!(e.contains("the feature number of src and tgt must be equal to d_model 8"), "{e}");
    let e = Activation::from_name("tanh").unwrap_err().to_string();
    assert!(e.contains("activation should be relu/gelu, not tanh"), "{e}");

    let tgt = det(&[4, 2, 8], F64, 3.0);
    let out = model.forward(&src, &tgt, &TransformerMasks::default()).unwrap();
    let grads = out.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let params = model.named_parameters();
    assert_eq!(params.len(), vm.all_vars().len());
    assert!(params.iter().any(|(k, _)| k == "decoder.layers.0.multihead_attn.in_proj_weight"));
    assert!(params.iter().any(|(k, _)| k == "encoder.norm.bias"));
    for (k, t) in params {
        assert!(grads.get(&t).is_some(), "no gradient for {k}");
    }
}

#[test]
fn layer_norm_and_gelu_match_naive_formulas() {
    let vm = VarMap::new();
    let ln = multihead::LayerNorm::new(4, 1e-5, true, vb(&vm)).unwrap();
    perturb(&vm);
    let x = det(&[3, 4], F64, 1.0);
    let y = ln.forward(&x).unwrap().to_vec2::<f64>().unwrap();
    let p: std::collections::HashMap<String, Tensor> = ln.named_parameters().into_iter().collect();
    let w = p["weight"].to_vec1::<f64>().unwrap();
    let b = p["bias"].to_vec1::<f64>().unwrap();
    for (r, row) in x.to_vec2::<f64>().unwrap().iter().enumerate() {
        let mean = row.iter().sum::<f64>() / 4.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 4.0;
        for c in 0..4 {
            let expect = (row[c] - mean) / (var + 1e-5).sqrt() * w[c] + b[c];
            assert!(Tolerance::F64.close(y[r][c], expect));
        }
    }
    // Exact GELU: x Φ(x), with Φ(1) = 0.8413447460685429.
    let g = Activation::Gelu
        .forward(&Tensor::new(&[1f64, 0.0, -1.0], &dev()).unwrap())
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    assert!(Tolerance::F64.close(g[0], 0.8413447460685429));
    assert_eq!(g[1], 0.0);
    assert!(Tolerance::F64.close(g[2], -0.15865525393145707));
}

/// `dim_feedforward=0`, which PyTorch accepts: the feed-forward block is `linear2.bias` alone
/// (`Linear(d, 0)` gives no features and `Linear(0, d)` its bias), so the layer must equal one
/// with a single hidden unit whose weights are zero, forward and backward, in f32, bf16 and
/// f64, both norm placements, both activations (`relu(0) = gelu(0) = 0`), on the fused and the
/// composed paths.
#[test]
fn a_zero_width_feed_forward_is_its_output_bias_alone() {
    use multihead::state_dict::load_strict;
    for dtype in [DType::F32, DType::BF16, F64] {
        for (norm_first, act) in [(false, Activation::Relu), (true, Activation::Gelu)] {
            for backend in [multihead::Backend::Auto, multihead::Backend::Composed] {
                let base = LayerConfig::new(8, 2)
                    .with_dropout(0.0)
                    .with_batch_first(true)
                    .with_norm_first(norm_first)
                    .with_activation(act);
                let vm = VarMap::new();
                TransformerEncoderLayer::new(base.clone().with_dim_feedforward(1), vb(&vm))
                    .unwrap();
                perturb(&vm);
                let mut one: std::collections::HashMap<String, Tensor> = vm
                    .data()
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
                    .collect();
                for k in ["linear1.weight", "linear1.bias", "linear2.weight"] {
                    let z = one[k].zeros_like().unwrap();
                    one.insert(k.to_string(), z);
                }
                let mut zero = one.clone();
                zero.insert("linear1.weight".into(), Tensor::zeros((0, 8), F64, &dev()).unwrap());
                zero.insert("linear1.bias".into(), Tensor::zeros(0, F64, &dev()).unwrap());
                zero.insert("linear2.weight".into(), Tensor::zeros((8, 0), F64, &dev()).unwrap());
                let run = |state: &std::collections::HashMap<String, Tensor>, ff: usize| {
                    let cfg = base.clone().with_dim_feedforward(ff);
                    let (layer, _) = load_strict(state, dtype, &dev(), |vb| {
                        TransformerEncoderLayer::new(cfg, vb)
                    })
                    .unwrap();
                    let x = candle_core::Var::from_tensor(&det(&[2, 5, 8], dtype, 1.0)).unwrap();
                    let y = multihead::with_backend(backend, || {
                        layer.forward(x.as_tensor(), None, None, false)
                    })
                    .unwrap();
                    let up = det(&[2, 5, 8], dtype, 2.0);
                    let g = y.mul(&up).unwrap().sum_all().unwrap().backward().unwrap();
                    let mut grads = vec![("x".to_string(), g.get(x.as_tensor()).unwrap().clone())];
                    for (n, t) in layer.named_parameters() {
                        if !n.starts_with("linear1") && n != "linear2.weight" {
                            grads.push((n, g.get(&t).unwrap().clone()));
                        }
                    }
                    (y, grads)
                };
                let (y1, g1) = run(&one, 1);
                let (y0, g0) = run(&zero, 0);
                let what = format!("{dtype:?} norm_first={norm_first} {act:?} {backend:?}");
                let f64s = |t: &Tensor| {
                    t.to_dtype(F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
                };
                assert_eq!(f64s(&y0), f64s(&y1), "output, {what}");
                for ((n, a), (_, b)) in g0.iter().zip(&g1) {
                    assert_eq!(f64s(a), f64s(b), "grad {n}, {what}");
                }
            }
        }
    }
    // A fresh layer initialises `Linear(0, d)`'s bias to zero, as PyTorch's bound of 0 does.
    let vm = VarMap::new();
    let layer = TransformerEncoderLayer::new(cfg().with_dim_feedforward(0), vb(&vm)).unwrap();
    let params: std::collections::HashMap<String, Tensor> =
        layer.named_parameters().into_iter().collect();
    let bias = params["linear2.bias"].to_vec1::<f64>().unwrap();
    assert_eq!(bias, vec![0.0; 8]);
    assert_eq!(params["linear1.weight"].dims(), &[0, 8]);
}

/// The layers' sub-modules under PyTorch's attribute names hold the parameters of PyTorch's
/// state_dict keys (`layer.linear1.weight` is `linear1().weight()`).
#[test]
fn layer_submodules_are_reachable_by_pytorchs_names() {
    use multihead::transformer::{LayerConfig, TransformerDecoderLayer, TransformerEncoderLayer};
    use multihead::NamedParameters;
    let vm = candle_nn::VarMap::new();
    let vb =
        candle_nn::VarBuilder::from_varmap(&vm, candle_core::DType::F32, &candle_core::Device::Cpu);
    let cfg = LayerConfig::new(8, 2).with_dim_feedforward(16);
    let enc = TransformerEncoderLayer::new(cfg.clone(), vb.pp("e")).unwrap();
    let dec = TransformerDecoderLayer::new(cfg, vb.pp("d")).unwrap();
    let same = |params: &[(String, candle_core::Tensor)], key: &str, t: &candle_core::Tensor| {
        let p = &params.iter().find(|(k, _)| k == key).unwrap_or_else(|| panic!("{key}")).1;
        assert_eq!(p.id(), t.id(), "{key}");
    };
    let e = enc.named_parameters();
    same(&e, "linear1.weight", enc.linear1().weight());
    same(&e, "linear2.weight", enc.linear2().weight());
    same(&e, "norm1.weight", enc.norm1().weight());
    same(&e, "norm2.weight", enc.norm2().weight());
    same(
        &e,
        "self_attn.out_proj.weight",
        enc.self_attn()
            .named_parameters()
            .iter()
            .find(|(k, _)| k == "out_proj.weight")
            .map(|(_, t)| t)
            .unwrap(),
    );
    let d = dec.named_parameters();
    same(&d, "linear1.weight", dec.linear1().weight());
    same(&d, "linear2.weight", dec.linear2().weight());
    same(&d, "norm1.weight", dec.norm1().weight());
    same(&d, "norm2.weight", dec.norm2().weight());
    same(&d, "norm3.weight", dec.norm3().weight());
    let inner = dec.multihead_attn().named_parameters();
    same(
        &d,
        "multihead_attn.in_proj_weight",
        &inner.iter().find(|(k, _)| k == "in_proj_weight").unwrap().1,
    );
    let inner = dec.self_attn().named_parameters();
    same(
        &d,
        "self_attn.in_proj_weight",
        &inner.iter().find(|(k, _)| k == "in_proj_weight").unwrap().1,
    );
}
