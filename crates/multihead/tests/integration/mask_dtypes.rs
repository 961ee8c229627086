//! An f32 float mask with a bf16, f16 or f64 query, as PyTorch's SDPA takes it ("bool, float32
//! or the query's dtype", added in f32 by its kernels to reduced scores, promoted beside f64
//! ones; a bf16 `TransformerEncoderLayer` takes the f32 `generate_square_subsequent_mask`). The
//! f32 mask is read as it is with a reduced query (not rounded) and widened with an f64 one; a
//! mask of another dtype (f64 with a bf16 query, or bf16 with an f16 query) stays an error
//! naming both dtypes.

use candle_core::{DType, Tensor};
use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
use multihead::{Mask, MhaConfig, MhaOptions, MultiheadAttention};

use crate::common::{bits, det, dev, var};

#[test]
fn an_f32_mask_goes_with_a_reduced_query_unrounded() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::BF16, &dev());
    let bf = DType::BF16;
    let mha =
        MultiheadAttention::new(MhaConfig::new(16, 4).with_batch_first(true), vb.pp("m")).unwrap();
    let cfg =
        LayerConfig::new(16, 4).with_dim_feedforward(32).with_dropout(0.0).with_batch_first(true);
    let enc = TransformerEncoderLayer::new(cfg, vb.pp("e")).unwrap();
    let x = det(&[2, 5, 16], bf, 1.0);
    let q = det(&[2, 2, 5, 8], bf, 2.0);
    // bf16 values in an f32 tensor: the same call as the bf16 mask, bit for bit.
    let held = det(&[5, 5], bf, 3.0);
    let as_f32 = held.to_dtype(DType::F32).unwrap();
    // Values bf16 cannot hold: read as they are, so not the call with the mask rounded.
    let fine = (det(&[5, 5], DType::F32, 4.0) * 0.37).unwrap();
    let rounded = fine.to_dtype(bf).unwrap();
    type Run<'a> = Box<dyn Fn(&Tensor) -> Tensor + 'a>;
    let runs: Vec<(&str, Run)> = vec![
        (
            "mha",
            Box::new(|m: &Tensor| {
                let o = MhaOptions::default().attn_mask(Mask::Float(m.clone()));
                mha.forward(&x, &x, &x, &o).unwrap().output
            }),
        ),
        (
            "sdpa",
            Box::new(|m: &Tensor| {
                let o = SdpaOptions::default().attn_mask(Mask::Float(m.clone()));
                scaled_dot_product_attention(&q, &q, &q, &o).unwrap()
            }),
        ),
        (
            "encoder layer",
            Box::new(|m: &Tensor| {
                enc.forward(&x, Some(&Mask::Float(m.clone())), None, false).unwrap()
            }),
        ),
    ];
    for (what, run) in &runs {
        let a = run(&as_f32);
        assert_eq!(a.dtype(), bf, "{what}");
        assert_eq!(bits(&a), bits(&run(&held)), "{what}: an f32 mask of bf16 values");
        assert_ne!(bits(&run(&fine)), bits(&run(&rounded)), "{what}: the f32 mask was rounded");
    }
    // Other dtypes stay errors that name both.
    let o = MhaOptions::default().attn_mask(Mask::Float(fine.to_dtype(DType::F64).unwrap()));
    let e = mha.forward(&x, &x, &x, &o).map(|_| ()).expect_err("f64 mask").to_string();
    assert!(e.contains("query's dtype BF16") && e.contains("got F64"), "{e}");
    let o = SdpaOptions::default().attn_mask(Mask::Float(rounded.clone()));
    let qh = q.to_dtype(DType::F16).unwrap();
    let e = scaled_dot_product_attention(&qh, &qh, &qh, &o).map(|_| ()).expect_err("bf16 mask");
    assert!(e.to_string().contains("got BF16"), "{e}");
}

/// The paths with checks of their own take the f32 mask too: a bf16 encoder stack's
/// nested-tensor path (eval, no gradient, a float key padding mask: padded positions are zero,
/// as PyTorch's), and cached decoding's memory mask; both give the bf16 mask's bits.
#[test]
fn an_f32_padding_mask_goes_with_a_bf16_stack_and_cached_decoding() {
    use multihead::transformer::{TransformerDecoder, TransformerEncoder};
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::BF16, &dev());
    let bf = DType::BF16;
    let cfg =
        LayerConfig::new(16, 4).with_dim_feedforward(32).with_dropout(0.0).with_batch_first(true);
    let mut enc = TransformerEncoder::new(cfg.clone(), 2, None, vb.pp("enc")).unwrap();
    let mut dec = TransformerDecoder::new(cfg, 2, None, vb.pp("dec")).unwrap();
    multihead::Train::eval(&mut enc);
    multihead::Train::eval(&mut dec);
    let x = det(&[2, 5, 16], bf, 1.0);
    let pad = Tensor::new(
        &[[0f32, 0., 0., 0., 0.], [0., 0., 0., f32::NEG_INFINITY, f32::NEG_INFINITY]],
        &dev(),
    )
    .unwrap();
    let (p32, p16) = (Mask::Float(pad.clone()), Mask::Float(pad.to_dtype(bf).unwrap()));
    let run = |m: &Mask| multihead::no_grad(|| enc.forward(&x, None, Some(m), None)).unwrap();
    let (a, b) = (run(&p32), run(&p16));
    assert_eq!(bits(&a), bits(&b), "encoder stack");
    let padded = a.narrow(0, 1, 1).unwrap().narrow(1, 3, 2).unwrap();
    assert!(bits(&padded).iter().all(|&v| v == 0), "padded positions are zero");
    let tgt = det(&[2, 1, 16], bf, 3.0);
    let step = |m: &Mask| {
        let mut state = dec.start(&x, Some(m), 4).unwrap();
        dec.forward_step(&tgt, &mut state, None).unwrap()
    };
    assert_eq!(bits(&step(&p32)), bits(&step(&p16)), "cached decoding");
    let p64 = Mask::Float(pad.to_dtype(DType::F64).unwrap());
    let e = dec.start(&x, Some(&p64), 4).map(|_| ()).expect_err("f64 mask").to_string();
    assert!(e.contains("got F64"), "{e}");
}

/// Errors name the argument the caller passed: a layer's `src_mask` in the message's text as in
/// its argument, and SDPA's odd one out among query, key and value.
#[test]
fn dtype_errors_name_the_callers_argument() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let cfg =
        LayerConfig::new(8, 2).with_dim_feedforward(16).with_dropout(0.0).with_batch_first(true);
    let enc = TransformerEncoderLayer::new(cfg, vb.pp("enc")).unwrap();
    let x = det(&[2, 3, 8], DType::F32, 1.0);
    let ints = Mask::Float(Tensor::zeros((3, 3), DType::I64, &dev()).unwrap());
    let e = enc.forward(&x, Some(&ints), None, false).map(|_| ()).expect_err("int mask");
    let msg = e.to_string();
    assert!(msg.contains(": src_mask: ") && !msg.contains("attn_mask"), "{msg}");
    // A stack's causal-mask detection names the stack's forward and its argument.
    let dec = multihead::transformer::TransformerDecoder::new(
        LayerConfig::new(8, 2).with_dim_feedforward(16).with_batch_first(true),
        1,
        None,
        vb.pp("dec"),
    )
    .unwrap();
    let u8s = Mask::Float(Tensor::zeros((3, 3), DType::U8, &dev()).unwrap());
    let masks = multihead::transformer::DecoderMasks { tgt_mask: Some(u8s), ..Default::default() };
    let msg = dec.forward(&x, &x, &masks).map(|_| ()).expect_err("u8 float mask").to_string();
    assert!(msg.starts_with("TransformerDecoder.forward: tgt_mask: a Mask::Float"), "{msg}");
    let q = det(&[1, 2, 3, 4], DType::F32, 2.0);
    let k = q.to_dtype(DType::F64).unwrap();
    let e = scaled_dot_product_attention(&q, &k, &q, &SdpaOptions::default()).map(|_| ());
    let msg = e.expect_err("f64 key").to_string();
    assert!(msg.starts_with("scaled_dot_product_attention: key: "), "{msg}");
    let e = scaled_dot_product_attention(&q, &q, &k, &SdpaOptions::default()).map(|_| ());
    let msg = e.expect_err("f64 value").to_string();
    assert!(msg.starts_with("scaled_dot_product_attention: value: "), "{msg}");
}

/// An f32 mask with a bf16 query, wrong: a bad shape is the shape error, a broadcast view is
/// read as a view (no copy at its full size), a NaN in it gives the bf16 mask's NaN rows; on
/// the fused and the composed path alike.
#[test]
fn a_bad_f32_mask_with_a_bf16_query_gets_the_plain_calls_answer_on_both_paths() {
    use multihead::{with_backend, Backend};
    let bf = DType::BF16;
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, bf, &dev());
    let mha = MultiheadAttention::new(MhaConfig::new(16, 4).with_batch_first(true), vb).unwrap();
    let x = det(&[2, 5, 16], bf, 1.0);
    let mut vals = det(&[5, 5], DType::F32, 2.0).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    vals[7] = f32::NAN;
    let nan = Tensor::from_vec(vals, (5, 5), &dev()).unwrap();
    let wide = det(&[1, 5], DType::F32, 3.0).broadcast_as((5, 5)).unwrap();
    for backend in [Backend::Auto, Backend::Composed] {
        let run = |m: &Tensor| {
            let o = MhaOptions::default().attn_mask(Mask::Float(m.clone()));
            with_backend(backend, || mha.forward(&x, &x, &x, &o)).map(|o| o.output)
        };
        let e = run(&det(&[5, 4], DType::F32, 4.0)).map(|_| ()).expect_err("shape").to_string();
        assert!(e.contains("attn_mask") && e.contains("(L, S)"), "{backend:?}: {e}");
        let a = run(&wide).unwrap();
        let b = run(&wide.contiguous().unwrap()).unwrap();
        assert_eq!(bits(&a), bits(&b), "{backend:?}: broadcast view");
        let y = run(&nan).unwrap();
        let flat = y.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(flat.iter().any(|v| v.is_nan()), "{backend:?}: the NaN was lost");
        assert!(flat.iter().any(|v| v.is_finite()), "{backend:?}: every row NaN");
    }
}

/// The f64 bits of every element of `t`.
fn bits64(t: &Tensor) -> Vec<u64> {
    let t = t.flatten_all().unwrap();
    t.to_vec1::<f64>().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// An f32 float mask with an f64 query, as PyTorch promotes it: the call with the mask widened
/// to f64, bit for bit, on the fused and the composed path (weights too); a broadcast view and
/// a padding mask alike; and the mask's gradient is the f64 mask's, in f32.
#[test]
fn an_f32_mask_goes_with_an_f64_query_widened() {
    use candle_core::backprop::GradStore;
    use multihead::{with_backend, Backend};
    let f64_ = DType::F64;
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, f64_, &dev());
    let mha =
        MultiheadAttention::new(MhaConfig::new(8, 2).with_batch_first(true), vb.pp("m")).unwrap();
    let cfg =
        LayerConfig::new(8, 2).with_dim_feedforward(16).with_dropout(0.0).with_batch_first(true);
    let enc = TransformerEncoderLayer::new(cfg, vb.pp("e")).unwrap();
    let x = det(&[2, 5, 8], f64_, 1.0);
    let q = det(&[2, 2, 5, 4], f64_, 2.0);
    let m32 = (det(&[5, 5], DType::F32, 4.0) * 0.37).unwrap();
    let pad32 = det(&[2, 5], DType::F32, 5.0);
    let view32 = det(&[1, 5], DType::F32, 6.0).broadcast_as((5, 5)).unwrap();
    let wide = |t: &Tensor| t.to_dtype(f64_).unwrap();
    for backend in [Backend::Auto, Backend::Composed] {
        let b = |f: &dyn Fn() -> multihead::Result<Tensor>| with_backend(backend, f).unwrap();
        for (what, m) in [("mask", &m32), ("broadcast view", &view32)] {
            for need in [false, true] {
                let run = |m: &Tensor| {
                    let o = MhaOptions::default()
                        .attn_mask(Mask::Float(m.clone()))
                        .key_padding_mask(Mask::Float(pad32.clone()))
                        .need_weights(need);
                    with_backend(backend, || mha.forward(&x, &x, &x, &o)).unwrap()
                };
                let (a, e) = (run(m), run(&wide(m)));
                assert_eq!(a.output.dtype(), f64_);
                let w = |o: &multihead::MhaOutput| o.attn_weights.as_ref().map(bits64);
                let ctx = format!("{backend:?} {what} need_weights {need}");
                assert_eq!(bits64(&a.output), bits64(&e.output), "mha {ctx}");
                assert_eq!(w(&a), w(&e), "mha weights {ctx}");
            }
            let sdpa = |m: &Tensor| {
                let o = SdpaOptions::default().attn_mask(Mask::Float(m.clone()));
                b(&|| scaled_dot_product_attention(&q, &q, &q, &o))
            };
            assert_eq!(bits64(&sdpa(m)), bits64(&sdpa(&wide(m))), "sdpa {backend:?} {what}");
            let layer =
                |m: &Tensor| b(&|| enc.forward(&x, Some(&Mask::Float(m.clone())), None, false));
            assert_eq!(bits64(&layer(m)), bits64(&layer(&wide(m))), "layer {backend:?} {what}");
        }
        // The mask's gradient: the f64 mask's, rounded to f32.
        let grad = |m: &Tensor| -> (Tensor, GradStore) {
            let v = var(m);
            let o = SdpaOptions::default().attn_mask(Mask::Float(v.as_tensor().clone()));
            let y = b(&|| scaled_dot_product_attention(&q, &q, &q, &o));
            let loss = (y.sqr().unwrap().sum_all().unwrap() * 0.5).unwrap();
            (v.as_tensor().clone(), loss.backward().unwrap())
        };
        let (v32, g32) = grad(&m32);
        let (v64, g64) = grad(&wide(&m32));
        let (g32, g64) = (g32.get(&v32).unwrap(), g64.get(&v64).unwrap());
        assert_eq!(g32.dtype(), DType::F32, "{backend:?}");
        assert_eq!(bits(g32), bits(&g64.to_dtype(DType::F32).unwrap()), "{backend:?} gradient");
    }
}

/// The paths with checks of their own take an f32 mask with f64 inputs too: an encoder stack's
/// nested-tensor path and cached decoding's memory mask give the f64 mask's bits.
#[test]
fn an_f32_padding_mask_goes_with_an_f64_stack_and_cached_decoding() {
    use multihead::transformer::{TransformerDecoder, TransformerEncoder};
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F64, &dev());
    let cfg =
        LayerConfig::new(8, 2).with_dim_feedforward(16).with_dropout(0.0).with_batch_first(true);
    let mut enc = TransformerEncoder::new(cfg.clone(), 2, None, vb.pp("enc")).unwrap();
    let mut dec = TransformerDecoder::new(cfg, 2, None, vb.pp("dec")).unwrap();
    multihead::Train::eval(&mut enc);
    multihead::Train::eval(&mut dec);
    let x = det(&[2, 5, 8], DType::F64, 1.0);
    let pad = Tensor::new(
        &[[0f32, 0., 0., 0., 0.], [0., 0., 0., f32::NEG_INFINITY, f32::NEG_INFINITY]],
        &dev(),
    )
    .unwrap();
    let (p32, p64) = (Mask::Float(pad.clone()), Mask::Float(pad.to_dtype(DType::F64).unwrap()));
    let run = |m: &Mask| multihead::no_grad(|| enc.forward(&x, None, Some(m), None)).unwrap();
    assert_eq!(bits64(&run(&p32)), bits64(&run(&p64)), "encoder stack");
    let tgt = det(&[2, 1, 8], DType::F64, 3.0);
    let step = |m: &Mask| {
        let mut state = dec.start(&x, Some(m), 4).unwrap();
        dec.forward_step(&tgt, &mut state, None).unwrap()
    };
    assert_eq!(bits64(&step(&p32)), bits64(&step(&p64)), "cached decoding");
}
