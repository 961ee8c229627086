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
