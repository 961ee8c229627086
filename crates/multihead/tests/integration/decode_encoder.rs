//! Incremental causal decoding through encoder layers (a decoder-only, GPT-style model built
//! from `TransformerEncoderLayer`s): each step equals the stack over the whole prefix with a
//! causal mask at the new positions, ragged rows included, and a refused step changes no cache.

use candle_core::{DType, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead::transformer::{LayerConfig, NormConfig, TransformerEncoder};
use multihead::{generate_square_subsequent_mask, no_grad, Mask};

use crate::common::{det, dev, perturb};

/// A 2-layer GELU stack with a final norm, batch-first, in eval mode.
fn stack(norm_first: bool, dtype: DType) -> (TransformerEncoder, VarMap) {
    let cfg = LayerConfig::new(16, 4)
        .with_dim_feedforward(32)
        .with_batch_first(true)
        .with_norm_first(norm_first)
        .with_activation(multihead::Activation::Gelu);
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, dtype, &dev());
    let mut enc = TransformerEncoder::new(cfg, 2, Some(NormConfig::default()), vb).unwrap();
    perturb(&vm, dtype);
    enc.eval();
    (enc, vm)
}

/// The stack over `prefix` (N, P, E) with the causal mask, as PyTorch runs a decoder-only model.
fn full(enc: &TransformerEncoder, prefix: &Tensor) -> Tensor {
    let p = prefix.dim(1).unwrap();
    let causal = Mask::Float(generate_square_subsequent_mask(p, prefix.dtype(), &dev()).unwrap());
    no_grad(|| enc.forward(prefix, Some(&causal), None, Some(true))).unwrap()
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap();
    d.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

#[test]
fn encoder_steps_equal_the_causal_stack_over_the_prefix() {
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
        for norm_first in [false, true] {
            let (enc, _vm) = stack(norm_first, dtype);
            let x = (det(&[2, 24, 16], dtype, 1.0) * 1.5).unwrap();
            let mut caches = enc.new_caches(2, 24).unwrap();
            // A prefill of 5 tokens, then one token per step.
            let mut pos = 0;
            while pos < 24 {
                let t = if pos == 0 { 5 } else { 1 };
                let out = enc.forward_cached(&x.narrow(1, pos, t).unwrap(), &mut caches, None);
                pos += t;
                let want = full(&enc, &x.narrow(1, 0, pos).unwrap()).narrow(1, pos - t, t).unwrap();
                let d = max_abs(&out.unwrap(), &want);
                assert!(d <= tol, "{dtype:?} norm_first={norm_first} at {pos}: {d:e}");
            }
            assert!(caches.iter().all(|c| c.positions() == [24, 24]));
        }
    }
}

/// Rows of different lengths: `lengths` says how many of a step's tokens are real; each row's
/// outputs are those of the stack over its own prefix.
#[test]
fn ragged_rows_decode_as_their_own_prefixes() {
    let (enc, _vm) = stack(true, DType::F64);
    let x = det(&[2, 6, 16], DType::F64, 3.0);
    let mut caches = enc.new_caches(2, 8).unwrap();
    // Row 0 prefills 3 tokens, row 1 one (its other two are padding, not cached).
    let first = enc.forward_cached(&x.narrow(1, 0, 3).unwrap(), &mut caches, Some(&[3, 1]));
    let first = first.unwrap();
    assert_eq!(caches[1].positions(), &[3, 1]);
    let row = |t: &Tensor, b: usize| t.narrow(0, b, 1).unwrap();
    let want0 = full(&enc, &row(&x, 0).narrow(1, 0, 3).unwrap());
    assert!(max_abs(&row(&first, 0), &want0) <= 1e-12);
    let want1 = full(&enc, &row(&x, 1).narrow(1, 0, 1).unwrap());
    assert!(max_abs(&row(&first, 1).narrow(1, 0, 1).unwrap(), &want1) <= 1e-12);
    // One more token each: row 0's fourth, row 1's second (its token at index 1).
    let next = Tensor::cat(&[x.i_row(0, 3), x.i_row(1, 1)], 0).unwrap();
    let out = enc.forward_cached(&next, &mut caches, None).unwrap();
    let want0 = full(&enc, &row(&x, 0).narrow(1, 0, 4).unwrap()).narrow(1, 3, 1).unwrap();
    let want1 = full(&enc, &row(&x, 1).narrow(1, 0, 2).unwrap()).narrow(1, 1, 1).unwrap();
    assert!(max_abs(&row(&out, 0), &want0) <= 1e-12);
    assert!(max_abs(&row(&out, 1), &want1) <= 1e-12);
}

/// Token `t` of row `b` of an `(N, L, E)` tensor, as `(1, 1, E)`.
trait Row {
    fn i_row(&self, b: usize, t: usize) -> Tensor;
}
impl Row for Tensor {
    fn i_row(&self, b: usize, t: usize) -> Tensor {
        self.narrow(0, b, 1).unwrap().narrow(1, t, 1).unwrap()
    }
}

/// A step that any layer refuses (its cache too small, the wrong number of caches, training
/// mode with dropout, a wrong width) is an error before any cache changes.
#[test]
fn a_refused_encoder_step_leaves_every_cache_unchanged() {
    let (mut enc, _vm) = stack(false, DType::F32);
    let x = det(&[1, 3, 16], DType::F32, 2.0);
    // The second layer's cache holds 2 tokens: the first layer's must not take the 3.
    let mut caches =
        vec![enc.layers()[0].new_cache(1, 8).unwrap(), enc.layers()[1].new_cache(1, 2).unwrap()];
    let e = enc.forward_cached(&x, &mut caches, None).map(|_| ()).expect_err("full");
    let named =
        matches!(e, multihead::Error::CacheFull { op: "TransformerEncoder::forward_cached", .. });
    assert!(named, "{e}");
    assert_eq!((caches[0].lens(), caches[1].lens()), (&[0][..], &[0][..]));
    let e = enc.forward_cached(&x, &mut caches[..1], None).map(|_| ()).expect_err("one cache");
    assert!(e.to_string().contains("new_caches"), "{e}");
    let e = enc.forward_cached(&det(&[1, 3, 8], DType::F32, 2.0), &mut caches, None);
    let e = e.map(|_| ()).expect_err("width").to_string();
    assert!(e.starts_with("TransformerEncoder::forward_cached: "), "{e}");
    assert_eq!(caches[0].lens(), &[0]);
    // A layer's own step names itself.
    let mut one = enc.layers()[0].new_cache(1, 8).unwrap();
    let e = enc.layers()[0].forward_cached(&det(&[1, 3, 8], DType::F32, 2.0), &mut one, None);
    let e = e.map(|_| ()).expect_err("layer width").to_string();
    assert!(e.starts_with("TransformerEncoderLayer::forward_cached: "), "{e}");
    enc.train(true);
    let e = enc.forward_cached(&x.narrow(1, 0, 1).unwrap(), &mut caches, None);
    assert!(e.map(|_| ()).expect_err("training").to_string().contains("eval()"));
    assert_eq!(caches[0].lens(), &[0]);
}

/// Steps with attention variants (ALiBi, a soft cap, a left window) equal the stack's
/// `forward_with` over the prefix with the same variants, causal, in both layouts.
#[test]
fn encoder_steps_with_variants_equal_the_stack_with_them() {
    use multihead::multihead_attention::CachedOptions;
    use multihead::{MhaOptions, Variants};
    let slopes = Variants::alibi_slopes_for(4);
    let cases: Vec<(&str, CachedOptions, Variants)> = vec![
        (
            "alibi",
            CachedOptions::default().alibi(slopes.clone()),
            Variants::default().alibi(slopes),
        ),
        ("softcap", CachedOptions::default().softcap(3.0), Variants::default().softcap(3.0)),
        ("window", CachedOptions::default().window(3), Variants::default().window(Some(3), None)),
    ];
    for batch_first in [true, false] {
        for (what, step_opts, variants) in &cases {
            let cfg = LayerConfig::new(16, 4)
                .with_dim_feedforward(32)
                .with_batch_first(batch_first)
                .with_norm_first(true)
                .with_activation(multihead::Activation::Gelu);
            let vm = VarMap::new();
            let vb = VarBuilder::from_varmap(&vm, DType::F64, &dev());
            let mut enc = TransformerEncoder::new(cfg, 2, Some(NormConfig::default()), vb).unwrap();
            perturb(&vm, DType::F64);
            enc.eval();
            let seq = if batch_first { 1 } else { 0 };
            let x = det(if batch_first { &[2, 9, 16] } else { &[9, 2, 16] }, DType::F64, 4.0);
            let mut caches = enc.new_caches(2, 9).unwrap();
            for t in 0..9 {
                let xt = x.narrow(seq, t, 1).unwrap();
                let y = enc.forward_cached_with(&xt, &mut caches, None, step_opts).unwrap();
                let prefix = x.narrow(seq, 0, t + 1).unwrap();
                let v = variants.clone().window(variants.window.left, Some(0));
                let full =
                    no_grad(|| enc.forward_with(&prefix, &MhaOptions::default().variants(v)));
                let want = full.unwrap().narrow(seq, t, 1).unwrap();
                let d = max_abs(&y, &want);
                assert!(d <= 1e-12, "{what} batch_first={batch_first} step {t}: {d:e}");
            }
        }
    }
}

/// Bad and unusual input to a cached encoder step, on the fused and the composed path alike:
/// a broadcast view is read as its values, a NaN token stays in its own row, and a view too
/// large to allocate is an error that changes no cache.
#[test]
fn views_nan_and_huge_steps_on_both_paths() {
    use multihead::{with_backend, Backend};
    for backend in [Backend::Auto, Backend::Composed] {
        let (enc, _vm) = stack(true, DType::F32);
        let run = |x: &Tensor, caches: &mut [multihead::KvCache]| {
            with_backend(backend, || enc.forward_cached(x, caches, None))
        };
        // A token broadcast over the batch: the contiguous copy's bits.
        let row = det(&[1, 1, 16], DType::F32, 2.0);
        let view = row.broadcast_as((2, 1, 16)).unwrap();
        let (mut a, mut b) = (enc.new_caches(2, 4).unwrap(), enc.new_caches(2, 4).unwrap());
        let ya = run(&view, &mut a).unwrap();
        let yb = run(&view.contiguous().unwrap(), &mut b).unwrap();
        assert_eq!(crate::common::bits(&ya), crate::common::bits(&yb), "{backend:?}: view");
        // NaN in row 1's token: row 0 stays finite, now and at the next step.
        let mut vals =
            det(&[2, 1, 16], DType::F32, 3.0).flatten_all().unwrap().to_vec1::<f32>().unwrap();
        vals[20] = f32::NAN;
        let nan = Tensor::from_vec(vals, (2, 1, 16), &dev()).unwrap();
        let y = run(&nan, &mut a).unwrap();
        let finite = |t: &Tensor, r: usize| {
            let v = t.narrow(0, r, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().all(|x| x.is_finite())
        };
        assert!(finite(&y, 0) && !finite(&y, 1), "{backend:?}: NaN row");
        // 2^31 tokens per row (a broadcast view): an error, every cache as it was.
        let huge = row.broadcast_as((2, 1usize << 31, 16)).unwrap();
        let before: Vec<Vec<usize>> = a.iter().map(|c| c.lens().to_vec()).collect();
        let e = run(&huge, &mut a).map(|_| ()).expect_err("huge");
        let after: Vec<Vec<usize>> = a.iter().map(|c| c.lens().to_vec()).collect();
        assert_eq!(before, after, "{backend:?}: {e}");
        assert!(
            e.to_string().starts_with("TransformerEncoder::forward_cached"),
            "{backend:?}: {e}"
        );
    }
}
