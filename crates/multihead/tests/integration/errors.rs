//! Every bad input of `docs/pytorch-behaviour.md` §2 gets a typed error whose message names the
//! argument and the shapes; never a panic. Each is tried with every backend forced: validation
//! runs before the path is chosen, so the error is the same on every path.

use candle_core::{DType, Tensor};
use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
use multihead::{Backend, Error, Mask, MhaConfig, MhaOptions};

use crate::common::{det, dev, mha};

fn t(shape: &[usize]) -> Tensor {
    det(shape, DType::F32, 0.3)
}

fn u8s(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, DType::U8, &dev()).expect("zeros")
}

/// Runs an 8-wide, 2-head MHA (packed unless `cfg` says otherwise) and returns the error text.
fn mha_err(
    cfg: MhaConfig,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: MhaOptions,
) -> (Error, String) {
    let (m, _vm) = mha(cfg, DType::F32);
    let mut first: Option<(Error, String)> = None;
    for backend in [Backend::Auto, Backend::Composed, Backend::Fused] {
        let e = m.forward(q, k, v, &opts.clone().backend(backend)).expect_err("must be rejected");
        let s = e.to_string();
        match &first {
            Some((_, s0)) => assert_eq!(&s, s0, "{backend:?} gives another error"),
            None => first = Some((e, s)),
        }
    }
    first.expect("three backends ran")
}

fn contains_all(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} should contain {p:?}");
    }
}

#[test]
fn query_rank() {
    for shape in [&[8][..], &[1, 2, 3, 8]] {
        let q = t(shape);
        let (e, s) = mha_err(MhaConfig::new(8, 2), &q, &q, &q, MhaOptions::default());
        assert!(matches!(e, Error::Shape { arg: "query", .. }), "{e:?}");
        contains_all(&s, &["multi_head_attention_forward", "query", &format!("{}-D", shape.len())]);
    }
}

#[test]
fn key_value_rank_batched_and_unbatched() {
    let (e, s) = mha_err(
        MhaConfig::new(8, 2),
        &t(&[3, 2, 8]),
        &t(&[5, 8]),
        &t(&[5, 2, 8]),
        MhaOptions::default(),
    );
    assert!(matches!(e, Error::Shape { arg: "key", .. }));
    contains_all(&s, &["batched (3-D)", "3-D but found 2-D and 3-D", "(5, 8)"]);
    let (_, s) = mha_err(
        MhaConfig::new(8, 2),
        &t(&[3, 8]),
        &t(&[5, 2, 8]),
        &t(&[5, 2, 8]),
        MhaOptions::default(),
    );
    contains_all(&s, &["unbatched (2-D)", "2-D but found 3-D and 3-D"]);
}

#[test]
fn key_padding_mask_rank() {
    let q = t(&[3, 2, 8]);
    let opts = MhaOptions::default().key_padding_mask(Mask::Bool(u8s(&[2, 3, 3])));
    let (e, s) = mha_err(MhaConfig::new(8, 2), &q, &q, &q, opts);
    assert!(matches!(e, Error::Shape { arg: "key_padding_mask", .. }));
    contains_all(&s, &["key_padding_mask", "2-D but found 3-D", "(2, 3, 3)"]);
    let q = t(&[3, 8]);
    let opts = MhaOptions::default().key_padding_mask(Mask::Bool(u8s(&[1, 3])));
    let (_, s) = mha_err(MhaConfig::new(8, 2), &q, &q, &q, opts);
    contains_all(&s, &["key_padding_mask", "1-D but found 2-D"]);
}

#[test]
fn attn_mask_rank_and_unbatched_3d_shape() {
    let q = t(&[3, 2, 8]);
    let opts = MhaOptions::default().attn_mask(Mask::Bool(u8s(&[3])));
    let (e, s) = mha_err(MhaConfig::new(8, 2), &q, &q, &q, opts);
    assert!(matches!(e, Error::Shape { arg: "attn_mask", .. }));
    contains_all(&s, &["attn_mask", "2-D or 3-D but found 1-D"]);
    let q = t(&[3, 8]);
    let k = t(&[5, 8]);
    let opts = MhaOptions::default().attn_mask(Mask::Bool(u8s(&[1, 3, 5])));
    let (_, s) = mha_err(MhaConfig::new(8, 2), &q, &k, &k, opts);
    contains_all(&s, &["attn_mask", "(2, 3, 5)", "(1, 3, 5)"]);
}

#[test]
fn mask_dtypes_must_be_bool_or_float() {
    let q = t(&[3, 2, 8]);
    let int_mask = Tensor::zeros((3, 3), DType::I64, &dev()).expect("zeros");
    for (arg, opts) in [
        ("attn_mask", MhaOptions::default().attn_mask(Mask::Bool(int_mask.clone()))),
        ("attn_mask", MhaOptions::default().attn_mask(Mask::Float(u8s(&[3, 3])))),
        ("key_padding_mask", MhaOptions::default().key_padding_mask(Mask::Bool(t(&[2, 3])))),
    ] {
        let (e, s) = mha_err(MhaConfig::new(8, 2), &q, &q, &q, opts);
        assert!(matches!(e, Error::DType { .. }), "{e:?}");
        contains_all(&s, &[arg, "must hold a", "Mask::Bool", "Mask::Float"]);
        // ... and says what to use instead.
        assert!(s.contains("convert") && s.contains("Mask::"), "{s}");
    }
}

#[test]
fn is_causal_needs_a_mask() {
    let q = t(&[3, 2, 8]);
    let (e, s) = mha_err(MhaConfig::new(8, 2), &q, &q, &q, MhaOptions::default().is_causal(true));
    assert!(matches!(e, Error::Config { arg: "is_causal", .. }));
    contains_all(&s, &["need attn_mask", "is_causal", "generate_square_subsequent_mask"]);
}

#[test]
fn query_embedding_dim() {
    let q = t(&[3, 2, 10]);
    let (e, s) = mha_err(MhaConfig::new(8, 2), &q, &q, &q, MhaOptions::default());
    assert!(matches!(e, Error::Shape { arg: "query", .. }));
    contains_all(&s, &["was expecting embedding dimension of 8, but got 10", "(3, 2, 10)"]);
}

#[test]
fn packed_key_value_shapes() {
    let (e, s) = mha_err(
        MhaConfig::new(8, 2),
        &t(&[3, 2, 8]),
        &t(&[5, 2, 8]),
        &t(&[6, 2, 8]),
        MhaOptions::default(),
    );
    assert!(matches!(e, Error::Shape { arg: "value", .. }));
    contains_all(&s, &["key shape (5, 2, 8) does not match value shape (6, 2, 8)"]);
    let k = t(&[5, 2, 10]);
    let (e, s) = mha_err(MhaConfig::new(8, 2), &t(&[3, 2, 8]), &k, &k, MhaOptions::default());
    assert!(matches!(e, Error::Shape { arg: "key", .. }));
    contains_all(&s, &["key has 10 features", "(24, 8)", "(5, 2, 10)"]);
}

#[test]
fn separate_key_value_shapes() {
    let cfg = MhaConfig::new(8, 2).with_kdim(3).with_vdim(5);
    let (e, s) =
        mha_err(cfg.clone(), &t(&[3, 2, 8]), &t(&[5, 2, 3]), &t(&[6, 2, 5]), MhaOptions::default());
    assert!(matches!(e, Error::Shape { arg: "value", .. }));
    contains_all(&s, &["(5, 2)", "(6, 2)"]);
    let (e, s) =
        mha_err(cfg, &t(&[3, 2, 8]), &t(&[5, 2, 4]), &t(&[5, 2, 5]), MhaOptions::default());
    assert!(matches!(e, Error::Shape { arg: "key", .. }));
    contains_all(&s, &["expecting key weights shape of (8, 4), but got (8, 3)"]);
}

#[test]
fn batch_mismatch() {
    let k = t(&[5, 4, 8]);
    let (e, s) = mha_err(MhaConfig::new(8, 2), &t(&[3, 2, 8]), &k, &k, MhaOptions::default());
    assert!(matches!(e, Error::Shape { arg: "key", .. }));
    contains_all(&s, &["batch size 4", "batch size 2", "(3, 2, 8)", "(5, 4, 8)"]);
}

#[test]
fn attn_mask_shapes() {
    let q = t(&[3, 2, 8]);
    let k = t(&[5, 2, 8]);
    let opts = MhaOptions::default().attn_mask(Mask::Bool(u8s(&[5, 3])));
    let (_, s) = mha_err(MhaConfig::new(8, 2), &q, &k, &k, opts);
    contains_all(&s, &["attn_mask", "(3, 5)", "(5, 3)"]);
    // (1, L, S) and (N, L, S) are both rejected: only (N*H, L, S).
    for bad in [[1, 3, 5], [2, 3, 5]] {
        let opts = MhaOptions::default().attn_mask(Mask::Bool(u8s(&bad)));
        let (e, s) = mha_err(MhaConfig::new(8, 2), &q, &k, &k, opts);
        assert!(matches!(e, Error::Shape { arg: "attn_mask", .. }));
        contains_all(&s, &["(4, 3, 5)", &format!("({}, 3, 5)", bad[0])]);
    }
}

#[test]
fn key_padding_mask_shapes() {
    let q = t(&[3, 2, 8]);
    let k = t(&[5, 2, 8]);
    for bad in [[3, 5], [2, 6]] {
        let opts = MhaOptions::default().key_padding_mask(Mask::Bool(u8s(&bad)));
        let (e, s) = mha_err(MhaConfig::new(8, 2), &q, &k, &k, opts);
        assert!(matches!(e, Error::Shape { arg: "key_padding_mask", .. }));
        contains_all(&s, &["(2, 5)", &format!("({}, {})", bad[0], bad[1])]);
    }
}

#[test]
fn dtype_mismatches() {
    let q = det(&[3, 2, 8], DType::F64, 0.1);
    let (e, s) = mha_err(MhaConfig::new(8, 2), &q, &q, &q, MhaOptions::default());
    assert!(matches!(e, Error::DType { arg: "query", .. }));
    contains_all(&s, &["F64", "F32"]);
    let q = t(&[3, 2, 8]);
    for need_weights in [true, false] {
        let opts = MhaOptions::default()
            .attn_mask(Mask::Float(det(&[3, 3], DType::F64, 0.2)))
            .need_weights(need_weights);
        let (e, s) = mha_err(MhaConfig::new(8, 2), &q, &q, &q, opts);
        assert!(matches!(e, Error::DType { arg: "attn_mask", .. }));
        contains_all(&s, &["attn_mask", "F32", "F64"]);
    }
}

#[test]
fn constructor_checks() {
    use candle_nn::{VarBuilder, VarMap};
    let build = |cfg: MhaConfig| {
        let vm = VarMap::new();
        multihead::MultiheadAttention::new(cfg, VarBuilder::from_varmap(&vm, DType::F32, &dev()))
            .expect_err("invalid config")
            .to_string()
    };
    contains_all(&build(MhaConfig::new(0, 1)), &[": embed_dim: ", "embed_dim=0", "greater than 0"]);
    contains_all(&build(MhaConfig::new(8, 0)), &[": num_heads: ", "num_heads=0"]);
    contains_all(&build(MhaConfig::new(8, 3)), &["divisible", "embed_dim=8", "num_heads=3"]);
    for p in [1.5, -0.1, 1.0, f64::NAN] {
        contains_all(&build(MhaConfig::new(8, 2).with_dropout(p)), &["dropout", "[0, 1)"]);
    }
}

#[test]
fn sdpa_checks() {
    let q = t(&[2, 4, 3, 8]);
    let k = t(&[2, 4, 5, 8]);
    let sd = |q: &Tensor, k: &Tensor, v: &Tensor, o: SdpaOptions| {
        let errs: Vec<String> = [Backend::Auto, Backend::Composed, Backend::Fused]
            .into_iter()
            .map(|b| {
                let o = o.clone().backend(b);
                scaled_dot_product_attention(q, k, v, &o).expect_err("rejected").to_string()
            })
            .collect();
        assert!(errs.iter().all(|e| e == &errs[0]), "backends disagree: {errs:?}");
        errs[0].clone()
    };
    contains_all(&sd(&t(&[8]), &k, &k, SdpaOptions::default()), &["at least 2 dimensional", "1-D"]);
    let k64 = det(&[2, 4, 5, 8], DType::F64, 0.0);
    contains_all(&sd(&q, &k64, &k64, SdpaOptions::default()), &["same dtype", "F32", "F64"]);
    let mask = Mask::Bool(u8s(&[3, 5]));
    contains_all(
        &sd(&q, &k, &k, SdpaOptions::default().attn_mask(mask).is_causal(true)),
        &["attn_mask", "is_causal"],
    );
    let k3 = t(&[2, 3, 5, 8]);
    contains_all(
        &sd(&q, &k3, &k3, SdpaOptions::default().enable_gqa(true)),
        &["must divide the number of heads in query", "(2, 3, 5, 8)"],
    );
    contains_all(
        &sd(&q, &k3, &k3, SdpaOptions::default()),
        &["do not broadcast", "(2, 4, 3, 8)", "(2, 3, 5, 8)"],
    );
    contains_all(
        &sd(&q, &k, &k, SdpaOptions::default().attn_mask(Mask::Float(t(&[3, 4])))),
        &["attn_mask", "(3, 4)", "(2, 4, 3, 5)"],
    );
    contains_all(&sd(&q, &k, &k, SdpaOptions::default().dropout_p(1.5)), &["dropout", "1.5"]);
    contains_all(&sd(&q, &t(&[2, 4, 5, 7]), &k, SdpaOptions::default()), &["key", "(2, 4, 5, 7)"]);
}

/// candle attaches a backtrace to its errors when `RUST_BACKTRACE` is set; through
/// `multihead::Error` the message stays one line (the sweep of 2026-12-04 saw 18).
#[test]
fn candle_errors_lose_their_backtrace_in_the_message() {
    let inner = candle_core::Error::Msg("shape mismatch in mul".into());
    let with = candle_core::Error::WithBacktrace {
        inner: Box::new(inner),
        backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
    };
    assert!(with.to_string().lines().count() > 1, "candle's own message carries the frames");
    let e = Error::from(with);
    assert_eq!(e.to_string(), "candle: shape mismatch in mul");
    assert_eq!(format!("{e:?}"), "candle: shape mismatch in mul");
}

/// A Transformer layer's mask errors name the layer's own argument (PyTorch's name for it), not
/// `attn_mask` or `key_padding_mask` of the attention that checks it: a decoder hands both its
/// `tgt_mask` and its `memory_mask` to a `MultiheadAttention` as `attn_mask`.
#[test]
fn layer_mask_errors_name_the_layer_arguments() {
    use candle_nn::{VarBuilder, VarMap};
    use multihead::transformer::{
        DecoderMasks, LayerConfig, TransformerDecoderLayer, TransformerEncoderLayer,
    };
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let cfg = LayerConfig::new(8, 2).with_dim_feedforward(16);
    let enc = TransformerEncoderLayer::new(cfg.clone(), vb.pp("e")).unwrap();
    let dec = TransformerDecoderLayer::new(cfg, vb.pp("d")).unwrap();
    // Sequence-first: tgt (L=3, N=2, E=8), memory (S=5, N=2, E=8).
    let (tgt, memory) = (t(&[3, 2, 8]), t(&[5, 2, 8]));
    let bad = || Some(Mask::Bool(u8s(&[4, 4])));
    let bad_kpm = || Some(Mask::Bool(u8s(&[2, 9])));
    let cases: Vec<(&str, DecoderMasks)> = vec![
        ("tgt_mask", DecoderMasks { tgt_mask: bad(), ..Default::default() }),
        ("memory_mask", DecoderMasks { memory_mask: bad(), ..Default::default() }),
        (
            "tgt_key_padding_mask",
            DecoderMasks { tgt_key_padding_mask: bad_kpm(), ..Default::default() },
        ),
        (
            "memory_key_padding_mask",
            DecoderMasks { memory_key_padding_mask: bad_kpm(), ..Default::default() },
        ),
    ];
    for (name, masks) in cases {
        let e = dec.forward(&tgt, &memory, &masks).expect_err("must be rejected").to_string();
        assert!(e.contains(&format!(": {name}: ")), "{name}: {e}");
    }
    let e = enc.forward(&tgt, bad().as_ref(), None, false).expect_err("rejected").to_string();
    assert!(e.contains(": src_mask: ") && e.contains("got (4, 4)"), "{e}");
    let e = enc.forward(&tgt, None, bad_kpm().as_ref(), false).expect_err("rejected").to_string();
    assert!(e.contains(": src_key_padding_mask: "), "{e}");
}

/// An explicit scale must be finite, and within f32's range unless the inputs are f64 (the
/// scores are f32 products there: 1e300 made every row NaN, silently); SDPA and the packed
/// attention alike, on every backend.
#[test]
fn a_scale_past_the_inputs_range_is_refused() {
    use multihead::functional::{varlen_attention, CuSeqlens};
    let cu = CuSeqlens::from_lengths(&[3]);
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let x = det(&[1, 2, 3, 4], dtype, 0.3);
        let rows = det(&[3, 2, 4], dtype, 0.4);
        for backend in [Backend::Auto, Backend::Composed, Backend::Fused] {
            for scale in [1e300, f64::NAN, f64::INFINITY] {
                let o = SdpaOptions::default().scale(scale).backend(backend);
                let r = scaled_dot_product_attention(&x, &x, &x, &o);
                let what = format!("{dtype:?} {backend:?} scale {scale:e}");
                if dtype == DType::F64 && scale == 1e300 {
                    // f64 inputs hold it (the fused kernels take f32 only: their refusal is
                    // about the dtype).
                    if backend != Backend::Fused {
                        r.expect(&what);
                    }
                    continue;
                }
                let e = r.expect_err(&what).to_string();
                assert!(e.contains("scaled_dot_product_attention: scale: "), "{what}: {e}");
                let e = varlen_attention(&rows, &rows, &rows, &cu, &cu, &o).expect_err(&what);
                assert!(e.to_string().contains("varlen_attention: scale: "), "{what}: {e}");
            }
        }
    }
}

/// Messages name the shapes as given: an unbatched `(L, E)` query of the wrong width was
/// reported as "(3, 1, 1)", the shape after the batch dimension this library adds.
#[test]
fn shape_errors_name_the_shapes_as_given() {
    let (m, _vm) = mha(MhaConfig::new(8, 2), DType::F32);
    let (q, kv) = (det(&[3, 1], DType::F32, 1.0), det(&[4, 8], DType::F32, 2.0));
    let err = m.forward(&q, &kv, &kv, &MhaOptions::default()).unwrap_err().to_string();
    assert!(err.contains("(query shape (3, 1))"), "{err}");
}

/// A layer's attention rules are reported as the layer's, by its own arguments (they read
/// `MultiheadAttention: dropout` for a `TransformerEncoderLayer`), and cached decoding names the
/// flag that is set (it named `add_bias_kv` for `add_zero_attn`).
#[test]
fn layer_and_cached_config_errors_name_what_the_user_set() {
    use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
    let vm = candle_nn::VarMap::new();
    let vb = || candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &dev());
    for (cfg, arg) in [
        (LayerConfig::new(16, 4).with_dropout(1.0), "dropout"),
        (LayerConfig::new(16, 5), "nhead"),
        (LayerConfig::new(16, 0), "nhead"),
    ] {
        let e = TransformerEncoderLayer::new(cfg, vb()).map(|_| ()).unwrap_err().to_string();
        assert!(e.starts_with(&format!("TransformerLayer: {arg}: ")), "{e}");
    }
    for (cfg, arg) in [
        (MhaConfig::new(16, 4).with_add_zero_attn(true), "add_zero_attn"),
        (MhaConfig::new(16, 4).with_add_bias_kv(true), "add_bias_kv"),
    ] {
        let (mut m, _vm) = mha(cfg, DType::F32);
        m.eval();
        let mut cache = m.new_cache(1, 4).unwrap();
        let x = t(&[1, 1, 16]);
        let e = m.forward_cached(&x, &mut cache, None).unwrap_err().to_string();
        assert!(e.contains(&format!(": {arg}: cached decoding")), "{e}");
    }
}
