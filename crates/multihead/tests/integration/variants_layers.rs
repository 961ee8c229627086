//! The attention variants through the Transformer layers' padded forward
//! (`TransformerEncoderLayer::forward_with`, `TransformerEncoder::forward_with`): equal to the
//! block written by hand from the same parameters, fused against composed with gradients, the
//! stack equal to its layers (dropout keys per layer), the nested-tensor path kept, bf16, and
//! bad options as errors naming the argument.

use candle_core::{DType, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use multihead::random::DropoutKey;
use multihead::transformer::{
    LayerConfig, NormConfig, TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer,
};
use multihead::{
    Backend, Error, LayerNorm, Linear, Mask, MhaOptions, MultiheadAttention, Variants,
};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, dev, perturb};

fn cfg() -> LayerConfig {
    LayerConfig::new(16, 4).with_dim_feedforward(24).with_dropout(0.0).with_batch_first(true)
}

/// Every variant at once (window, soft cap, ALiBi, key lengths) and sinks, in `dtype`.
fn all_variants(dtype: DType) -> MhaOptions {
    let v = Variants::default()
        .window(Some(4), Some(1))
        .softcap(0.9)
        .alibi(vec![0.5, 0.25, 0.1, -0.05])
        .kv_lengths(vec![11, 8]);
    let sinks = Tensor::new(&[0.3f64, -1.0, 0.0, 2.0], &dev()).unwrap().to_dtype(dtype).unwrap();
    MhaOptions::default().variants(v).sinks(sinks)
}

/// The post-norm and pre-norm blocks written by hand from the layer's own parameters (the
/// modules built again from the same `VarMap`) equal `forward_with`: the options reach the
/// attention, and only it.
#[test]
fn encoder_layer_forward_with_equals_the_block_by_hand() {
    for norm_first in [false, true] {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F64, &dev());
        let c = cfg().with_norm_first(norm_first);
        let mut layer = TransformerEncoderLayer::new(c.clone(), vb.clone()).unwrap();
        perturb(&vm, DType::F64);
        layer.eval();
        let mut mha = MultiheadAttention::new(
            multihead::MhaConfig::new(16, 4).with_batch_first(true),
            vb.pp("self_attn"),
        )
        .unwrap();
        mha.eval();
        let lin1 = Linear::new(16, 24, true, vb.pp("linear1")).unwrap();
        let lin2 = Linear::new(24, 16, true, vb.pp("linear2")).unwrap();
        let norm1 = LayerNorm::new(16, 1e-5, true, vb.pp("norm1")).unwrap();
        let norm2 = LayerNorm::new(16, 1e-5, true, vb.pp("norm2")).unwrap();
        let x = det(&[2, 11, 16], DType::F64, 1.0);
        let opts = all_variants(DType::F64);
        let attn = |h: &Tensor| mha.forward(h, h, h, &opts).unwrap().output;
        let ff = |h: &Tensor| lin2.forward(&lin1.forward(h).unwrap().relu().unwrap()).unwrap();
        let by_hand = if norm_first {
            let x1 = (&x + attn(&norm1.forward(&x).unwrap())).unwrap();
            (&x1 + ff(&norm2.forward(&x1).unwrap())).unwrap()
        } else {
            let x1 = norm1.forward(&(&x + attn(&x)).unwrap()).unwrap();
            norm2.forward(&(&x1 + ff(&x1)).unwrap()).unwrap()
        };
        let y = layer.forward_with(&x, &opts).unwrap();
        assert_close(&y, &by_hand, Tolerance::F64, &format!("norm_first={norm_first}"));
        // The variants change the output (the test would not see them dropped).
        let plain = layer.forward(&x, None, None, false).unwrap();
        let d = (&y - &plain).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>();
        assert!(d.unwrap() > 1e-3, "the variants had no effect");
        // forward(masks) is forward_with(masks).
        let kpm = Mask::Bool(
            Tensor::new(&[[0u8; 11], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]], &dev()).unwrap(),
        );
        let a = layer.forward(&x, None, Some(&kpm), false).unwrap();
        let b = layer.forward_with(&x, &MhaOptions::default().key_padding_mask(kpm)).unwrap();
        assert_close(&a, &b, Tolerance::F64, "forward is forward_with");
    }
}

/// Output and gradients (input, every parameter, the sinks) of `sum(y ∘ g)` for a layer in
/// training mode (dropout 0) on the given backend.
fn train_step(backend: Backend) -> Vec<Tensor> {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let layer = TransformerEncoderLayer::new(cfg(), vb).unwrap();
    perturb(&vm, DType::F32);
    let x = Var::from_tensor(&det(&[2, 11, 16], DType::F32, 2.0)).unwrap();
    let mut opts = all_variants(DType::F32).backend(backend);
    let sinks = Var::from_tensor(opts.sinks.as_ref().unwrap()).unwrap();
    opts.sinks = Some(sinks.as_tensor().clone());
    let y = layer.forward_with(x.as_tensor(), &opts).unwrap();
    let g = det(y.dims(), DType::F32, 3.0);
    let grads = y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![y, grads.get(x.as_tensor()).expect("dx").clone()];
    out.push(grads.get(sinks.as_tensor()).expect("dsinks").clone());
    let data = vm.data().lock().unwrap();
    let mut names: Vec<_> = data.keys().cloned().collect();
    names.sort();
    for n in names {
        out.push(grads.get(data[&n].as_tensor()).expect("param grad").clone());
    }
    out
}

#[test]
fn encoder_layer_variants_train_the_same_on_both_paths() {
    let fused = train_step(Backend::Fused);
    let composed = train_step(Backend::Composed);
    assert_eq!(fused.len(), composed.len());
    for (i, (a, b)) in fused.iter().zip(&composed).enumerate() {
        let tol = if i == 0 { Tolerance::F32_FORWARD } else { Tolerance::F32_GRAD };
        assert_close(a, b, tol, &format!("tensor {i} (0 output, 1 dx, 2 dsinks, then parameters)"));
    }
}

/// The stack is its layers called in turn with the same options, layer `i`'s attention dropout
/// keyed `(seed, offset + i)`; the global generator is drawn in the same order.
#[test]
fn encoder_stack_forward_with_is_its_layers() {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F64, &dev());
    let c = cfg().with_dropout(0.3);
    let enc = TransformerEncoder::new(c, 3, Some(NormConfig::default()), vb.clone()).unwrap();
    perturb(&vm, DType::F64);
    let norm = LayerNorm::new(16, 1e-5, true, vb.pp("norm")).unwrap();
    let x = det(&[2, 11, 16], DType::F64, 4.0);
    let key = DropoutKey { seed: 5, offset: 100 };
    let opts = all_variants(DType::F64).dropout_key(key);
    let y = enc.forward_with(&x, &opts).unwrap();
    let mut h = x.clone();
    for (i, layer) in enc.layers().iter().enumerate() {
        let k = DropoutKey { seed: 5, offset: 100 + ((i as u64) << 48) };
        h = layer.forward_with(&h, &opts.clone().dropout_key(k)).unwrap();
    }
    assert_close(&y, &norm.forward(&h).unwrap(), Tolerance::F64, "stack");
    // Sharing one key across layers would give other numbers.
    let mut shared = x.clone();
    for layer in enc.layers() {
        shared = layer.forward_with(&shared, &opts).unwrap();
    }
    let shared = norm.forward(&shared).unwrap();
    let d = (&y - &shared).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>();
    assert!(d.unwrap() > 1e-6, "the layers shared a dropout mask");
}

/// In inference with a left-aligned padding mask, the nested-tensor path still applies with
/// the variants: padded rows come out 0 (before the final norm, none here), the others equal
/// each sequence run alone with the same variants.
#[test]
fn encoder_stack_nested_path_keeps_the_variants() {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F64, &dev());
    let mut enc = TransformerEncoder::new(cfg(), 2, None, vb).unwrap();
    perturb(&vm, DType::F64);
    enc.eval();
    let x = det(&[2, 9, 16], DType::F64, 5.0);
    let kpm = Mask::Bool(Tensor::new(&[[0u8; 9], [0, 0, 0, 0, 0, 0, 1, 1, 1]], &dev()).unwrap());
    let v =
        Variants::default().window(Some(2), Some(2)).softcap(0.8).alibi(vec![0.5, 0.2, 0.1, 0.0]);
    let opts = MhaOptions::default().variants(v);
    let y =
        multihead::no_grad(|| enc.forward_with(&x, &opts.clone().key_padding_mask(kpm))).unwrap();
    let pad = y.narrow(0, 1, 1).unwrap().narrow(1, 6, 3).unwrap();
    assert_eq!(pad.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap(), 0.0);
    for (n, len) in [(0usize, 9usize), (1, 6)] {
        let alone = x.narrow(0, n, 1).unwrap().narrow(1, 0, len).unwrap();
        let want = multihead::no_grad(|| enc.forward_with(&alone, &opts)).unwrap();
        let got = y.narrow(0, n, 1).unwrap().narrow(1, 0, len).unwrap();
        assert_close(&got, &want, Tolerance::F64, &format!("sequence {n}"));
    }
}

/// A bf16 layer runs the variants as its f32 twin between one widening and one rounding (bf16
/// sinks widened with it); sinks in another dtype are an error naming them.
#[test]
fn encoder_layer_variants_in_bf16() {
    let vm = VarMap::new();
    let mut layer =
        TransformerEncoderLayer::new(cfg(), VarBuilder::from_varmap(&vm, DType::F32, &dev()))
            .unwrap();
    perturb(&vm, DType::F32);
    layer.eval();
    let vm16 = VarMap::new();
    let mut half =
        TransformerEncoderLayer::new(cfg(), VarBuilder::from_varmap(&vm16, DType::BF16, &dev()))
            .unwrap();
    perturb(&vm16, DType::BF16);
    half.eval();
    let x = det(&[2, 11, 16], DType::F32, 6.0)
        .to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let want = layer.forward_with(&x, &all_variants(DType::F32)).unwrap();
    let got =
        half.forward_with(&x.to_dtype(DType::BF16).unwrap(), &all_variants(DType::BF16)).unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    assert_close(&got.to_dtype(DType::F32).unwrap(), &want, Tolerance::BF16_FORWARD, "bf16 layer");
    let e = half
        .forward_with(&x.to_dtype(DType::BF16).unwrap(), &all_variants(DType::F32))
        .unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    assert!(e.to_string().contains("sinks"), "{e}");
}

/// Bad options are the errors `MultiheadAttention` gives, on both paths.
#[test]
fn encoder_layer_forward_with_rejects_bad_options() {
    let vm = VarMap::new();
    let layer =
        TransformerEncoderLayer::new(cfg(), VarBuilder::from_varmap(&vm, DType::F32, &dev()))
            .unwrap();
    let x = det(&[2, 5, 16], DType::F32, 1.0);
    for backend in [Backend::Fused, Backend::Composed] {
        let o = || MhaOptions::default().backend(backend);
        let e = layer.forward_with(&x, &o().alibi(vec![1.0])).unwrap_err();
        assert!(matches!(e, Error::Config { arg: "alibi_slopes", .. }), "{e}");
        let e = layer
            .forward_with(&x, &o().variants(Variants::default().kv_lengths(vec![5, 6])))
            .unwrap_err();
        assert!(matches!(e, Error::Config { arg: "kv_lengths", .. }), "{e}");
        let e = layer.forward_with(&x, &o().softcap(-1.0)).unwrap_err();
        assert!(e.to_string().contains("softcap"), "{e}");
        let sinks = Tensor::zeros(3, DType::F32, &dev()).unwrap();
        let e = layer.forward_with(&x, &o().sinks(sinks)).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{e}");
    }
}

/// The decoder layer written by hand from its own parameters equals `forward_with`: the self
/// options reach the self-attention, the cross options the cross-attention; the stack is its
/// layers with a dropout key per layer.
#[test]
fn decoder_forward_with_equals_the_block_by_hand_and_its_layers() {
    use multihead::transformer::{TransformerDecoder, TransformerDecoderLayer};
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F64, &dev());
    let mut layer = TransformerDecoderLayer::new(cfg(), vb.clone()).unwrap();
    perturb(&vm, DType::F64);
    layer.eval();
    let build = |name: &str| {
        let c = multihead::MhaConfig::new(16, 4).with_batch_first(true);
        let mut m = MultiheadAttention::new(c, vb.pp(name)).unwrap();
        m.eval();
        m
    };
    let (sa, ca) = (build("self_attn"), build("multihead_attn"));
    let lin1 = Linear::new(16, 24, true, vb.pp("linear1")).unwrap();
    let lin2 = Linear::new(24, 16, true, vb.pp("linear2")).unwrap();
    let norm = |i: usize| LayerNorm::new(16, 1e-5, true, vb.pp(format!("norm{i}"))).unwrap();
    let (tgt, mem) = (det(&[2, 11, 16], DType::F64, 7.0), det(&[2, 8, 16], DType::F64, 8.0));
    let self_opts = all_variants(DType::F64);
    let cross = Variants::default().softcap(0.5).kv_lengths(vec![8, 5]).alibi(vec![0.1; 4]);
    let cross_opts = MhaOptions::default().variants(cross);
    let x1 = sa.forward(&tgt, &tgt, &tgt, &self_opts).unwrap().output;
    let x1 = norm(1).forward(&(&tgt + x1).unwrap()).unwrap();
    let x2 = ca.forward(&x1, &mem, &mem, &cross_opts).unwrap().output;
    let x2 = norm(2).forward(&(&x1 + x2).unwrap()).unwrap();
    let ff = lin2.forward(&lin1.forward(&x2).unwrap().relu().unwrap()).unwrap();
    let by_hand = norm(3).forward(&(&x2 + ff).unwrap()).unwrap();
    let y = layer.forward_with(&tgt, &mem, &self_opts, &cross_opts).unwrap();
    assert_close(&y, &by_hand, Tolerance::F64, "decoder layer");

    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F64, &dev());
    let dec = TransformerDecoder::new(cfg().with_dropout(0.25), 2, None, vb).unwrap();
    perturb(&vm, DType::F64);
    let key = |o: u64| DropoutKey { seed: 3, offset: o };
    let (so, co) = (self_opts.dropout_key(key(10)), cross_opts.dropout_key(key(50)));
    let y = dec.forward_with(&tgt, &mem, &so, &co).unwrap();
    let mut h = tgt.clone();
    for (i, l) in dec.layers().iter().enumerate() {
        let i = i as u64;
        h = l
            .forward_with(
                &h,
                &mem,
                &so.clone().dropout_key(key(10 + (i << 48))),
                &co.clone().dropout_key(key(50 + (i << 48))),
            )
            .unwrap();
    }
    assert_close(&y, &h, Tolerance::F64, "decoder stack");
}

/// `static_k`/`static_v` would replace the layers' own projections: refused in the layers'
/// self-attention options and in the stacks, taken in one decoder layer's cross options.
#[test]
fn layers_refuse_static_keys_where_they_would_replace_projections() {
    use multihead::transformer::{TransformerDecoder, TransformerDecoderLayer};
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let enc_layer = TransformerEncoderLayer::new(cfg(), vb.pp("a")).unwrap();
    let enc = TransformerEncoder::new(cfg(), 2, None, vb.pp("b")).unwrap();
    let dec_layer = TransformerDecoderLayer::new(cfg(), vb.pp("c")).unwrap();
    let dec = TransformerDecoder::new(cfg(), 2, None, vb.pp("d")).unwrap();
    let x = det(&[2, 5, 16], DType::F32, 1.0);
    let kv = det(&[8, 5, 4], DType::F32, 2.0); // (N·H, S, D)
    let st = MhaOptions { static_k: Some(kv.clone()), static_v: Some(kv), ..Default::default() };
    let refused = |r: multihead::Result<Tensor>, arg: &str| {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Config { arg: a, .. } if a == arg), "{e}");
        assert!(e.to_string().contains("static_k"), "{e}");
    };
    let none = MhaOptions::default();
    refused(enc_layer.forward_with(&x, &st), "opts");
    refused(enc.forward_with(&x, &st), "opts");
    refused(dec_layer.forward_with(&x, &x, &st, &none), "self_opts");
    refused(dec.forward_with(&x, &x, &st, &none), "self_opts");
    refused(dec.forward_with(&x, &x, &none, &st), "cross_opts");
    assert_eq!(dec_layer.forward_with(&x, &x, &none, &st).unwrap().dims(), &[2, 5, 16]);
}

/// `Transformer::forward_with` is its encoder's and decoder's `forward_with` in turn, the
/// decoder's dropout keys after the encoder's layers; with masks alone it is `forward`; and it
/// refuses static keys naming the options.
#[test]
fn transformer_forward_with_is_its_stacks() {
    use multihead::transformer::{
        DecoderMasks, Transformer, TransformerConfig, TransformerMasks, TransformerOptions,
    };
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F64, &dev());
    let tc = TransformerConfig {
        layer: cfg().with_dropout(0.25),
        num_encoder_layers: 2,
        num_decoder_layers: 2,
    };
    let mut model = Transformer::new(tc, vb).unwrap();
    perturb(&vm, DType::F64);
    let (src, tgt) = (det(&[2, 11, 16], DType::F64, 1.0), det(&[2, 7, 16], DType::F64, 2.0));
    let key = |o: u64| DropoutKey { seed: 8, offset: o };
    let enc = all_variants(DType::F64).dropout_key(key(0));
    let causal = Variants::default().window(Some(3), Some(0)).softcap(0.7);
    let dec_self = MhaOptions::default().variants(causal).dropout_key(key(1000));
    let cross = MhaOptions::default().variants(Variants::default().kv_lengths(vec![11, 6]));
    let opts = TransformerOptions::default()
        .encoder(enc.clone())
        .decoder_self(dec_self.clone())
        .decoder_cross(cross.clone().dropout_key(key(2000)));
    let y = model.forward_with(&src, &tgt, &opts).unwrap();
    let memory = model.encoder().forward_with(&src, &enc).unwrap();
    let shift = 2u64 << 48; // two encoder layers
    let by_stacks = model
        .decoder()
        .forward_with(
            &tgt,
            &memory,
            &dec_self.clone().dropout_key(key(1000 + shift)),
            &cross.clone().dropout_key(key(2000 + shift)),
        )
        .unwrap();
    assert_close(&y, &by_stacks, Tolerance::F64, "training, dropout keyed per layer");
    // The decoder's keys unshifted (layer i of both stacks sharing a key) give other numbers.
    let same_keys = model
        .decoder()
        .forward_with(&tgt, &memory, &dec_self, &cross.clone().dropout_key(key(2000)))
        .unwrap();
    let d = (&y - &same_keys).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>();
    assert!(d.unwrap() > 1e-6, "the decoder's keys were not shifted past the encoder's");

    // Masks only: forward_with is forward.
    model.eval();
    let tgt_mask = multihead::generate_square_subsequent_mask(7, DType::F64, &dev()).unwrap();
    let kpm =
        Mask::Bool(Tensor::new(&[[0u8; 11], [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]], &dev()).unwrap());
    let decoder = DecoderMasks {
        tgt_mask: Some(Mask::Float(tgt_mask.clone())),
        tgt_is_causal: Some(true),
        memory_key_padding_mask: Some(kpm.clone()),
        ..Default::default()
    };
    let masks =
        TransformerMasks { src_key_padding_mask: Some(kpm.clone()), decoder, ..Default::default() };
    let a = model.forward(&src, &tgt, &masks).unwrap();
    let opts = TransformerOptions::default()
        .encoder(MhaOptions::default().key_padding_mask(kpm.clone()))
        .decoder_self(MhaOptions::default().attn_mask(Mask::Float(tgt_mask)).is_causal(true))
        .decoder_cross(MhaOptions::default().key_padding_mask(kpm));
    let b = model.forward_with(&src, &tgt, &opts).unwrap();
    assert_close(&a, &b, Tolerance::F64, "masks only: forward_with is forward");
    // The variants reach the model.
    let v =
        model.forward_with(&src, &tgt, &opts.clone().encoder(all_variants(DType::F64))).unwrap();
    let d = (&v - &b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>();
    assert!(d.unwrap() > 1e-3, "the encoder's variants had no effect");

    let kv = det(&[8, 7, 4], DType::F64, 2.0);
    let st = MhaOptions { static_k: Some(kv.clone()), static_v: Some(kv), ..Default::default() };
    for (o, arg) in [
        (TransformerOptions::default().encoder(st.clone()), "opts.encoder"),
        (TransformerOptions::default().decoder_self(st.clone()), "opts.decoder_self"),
        (TransformerOptions::default().decoder_cross(st.clone()), "opts.decoder_cross"),
    ] {
        let e = model.forward_with(&src, &tgt, &o).unwrap_err();
        assert!(matches!(e, Error::Config { arg: a, .. } if a == arg), "{e}");
    }
    // Mismatched batches: the shape error of forward.
    let e = model.forward_with(&src, &tgt.narrow(0, 0, 1).unwrap(), &opts).unwrap_err();
    assert!(matches!(e, Error::Shape { arg: "tgt", .. }), "{e}");
}

/// A layer called with a dropout key keys its own dropouts (after each attention block and in
/// the feed-forward block) from it: what the global generator holds does not change the
/// numbers (before, the feed-forward dropouts drew from it, and the keyed tests above failed
/// when other tests drew keys between their seed and their calls).
#[test]
fn keyed_layers_draw_nothing_from_the_global_generator() {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F64, &dev());
    let mut enc = TransformerEncoderLayer::new(cfg().with_dropout(0.3), vb.pp("enc")).unwrap();
    let mut dec = TransformerDecoderLayer::new(cfg().with_dropout(0.3), vb.pp("dec")).unwrap();
    perturb(&vm, DType::F64);
    let (x, mem) = (det(&[2, 9, 16], DType::F64, 3.0), det(&[2, 5, 16], DType::F64, 4.0));
    let keyed = |offset: u64| MhaOptions::default().dropout_key(DropoutKey { seed: 7, offset });
    let cross = MhaOptions::default();
    let run = |enc: &TransformerEncoderLayer, dec: &TransformerDecoderLayer, offset: u64| {
        let e = enc.forward_with(&x, &keyed(offset)).unwrap();
        let d = dec.forward_with(&x, &mem, &keyed(offset), &cross).unwrap();
        (e, d)
    };
    multihead::manual_seed(1);
    let (e1, d1) = run(&enc, &dec, 40);
    multihead::manual_seed(2);
    let _ = multihead::random::next_dropout_key();
    let (e2, d2) = run(&enc, &dec, 40);
    let exact = Tolerance { rel: 0.0, abs: 0.0 };
    assert_close(&e2, &e1, exact, "encoder layer, same key, another global state");
    assert_close(&d2, &d1, exact, "decoder layer, same key, another global state");
    // The dropouts do act, and another key gives another mask.
    let differs = |a: &Tensor, b: &Tensor| {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
        d > 1e-6
    };
    let (e3, d3) = run(&enc, &dec, 41);
    assert!(differs(&e3, &e1) && differs(&d3, &d1), "another key, the same masks");
    enc.eval();
    dec.eval();
    let (e0, d0) = run(&enc, &dec, 40);
    assert!(differs(&e0, &e1) && differs(&d0, &d1), "training drew no dropout");
}
