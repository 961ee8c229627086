//! Packed variable-length attention (`varlen_attention`): the fused op against the composed
//! path (outputs and gradients) with every option, against a padded batch through SDPA, and
//! bad offsets as errors.

use candle_core::{DType, Tensor};
use multihead::functional::{
    explain_varlen, scaled_dot_product_attention, varlen_attention, CuSeqlens, SdpaOptions,
};
use multihead::random::DropoutKey;
use multihead::{Backend, CausalAlign, Error, Path, Variants};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, var};

/// Output and the gradients of q, k, v of `sum(out ∘ g)`.
fn run(
    shapes: [&[usize]; 3],
    cu: (&CuSeqlens, &CuSeqlens),
    opts: &SdpaOptions,
) -> (Tensor, Vec<Tensor>) {
    let [q, k, v] =
        [1.0, 2.0, 3.0].map(|salt| var(&det(shapes[salt as usize - 1], DType::F32, salt)));
    let out = varlen_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), cu.0, cu.1, opts)
        .expect("varlen");
    let g = det(out.dims(), DType::F32, 4.0);
    let grads = out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let gs = [&q, &k, &v].map(|t| grads.get(t.as_tensor()).expect("grad").clone());
    (out, gs.to_vec())
}

fn compare(lq: &[usize], lk: &[usize], heads: (usize, usize), opts: SdpaOptions, what: &str) {
    let (cq, ck) = (CuSeqlens::from_lengths(lq), CuSeqlens::from_lengths(lk));
    let (tq, tk) = (lq.iter().sum::<usize>(), lk.iter().sum::<usize>());
    let (q, kv) = ([tq, heads.0, 16], [tk, heads.1, 16]);
    let shapes: [&[usize]; 3] = [&q, &kv, &kv];
    let probe = shapes.map(|s| Tensor::zeros(s, DType::F32, &candle_core::Device::Cpu).unwrap());
    let plan = explain_varlen(&probe[0], &probe[1], &probe[2], &cq, &ck, &opts).expect("plan");
    assert_eq!(plan.path, Path::Fused, "{what}");
    let (a, ga) = run(shapes, (&cq, &ck), &opts.clone().backend(Backend::Fused));
    let (b, gb) = run(shapes, (&cq, &ck), &opts.backend(Backend::Composed));
    assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("{what}: output"));
    for (name, (x, y)) in ["dq", "dk", "dv"].iter().zip(ga.iter().zip(&gb)) {
        assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: {name}"));
    }
}

#[test]
fn varlen_fused_matches_composed() {
    let lens = [17, 1, 0, 130, 64, 65];
    let o = SdpaOptions::default;
    compare(&lens, &lens, (4, 4), o(), "plain");
    compare(&lens, &lens, (4, 4), o().is_causal(true), "causal");
    let key = DropoutKey { seed: 11, offset: 3 };
    compare(&lens, &lens, (4, 4), o().dropout_p(0.25).dropout_key(key), "dropout");
    let v = Variants::default().window(Some(9), None).softcap(1.5).alibi(vec![0.2, 0.1, 0.05, 0.0]);
    compare(
        &lens,
        &lens,
        (4, 2),
        o().is_causal(true).variants(v).enable_gqa(true),
        "variants, gqa",
    );
    // Cross-attention: other key lengths (and a sequence with queries but no keys), aligned
    // bottom-right per sequence.
    let lk = [40, 3, 5, 0, 64, 200];
    let br = o().is_causal(true).causal_align(CausalAlign::BottomRight).scale(0.3);
    compare(&lens, &lk, (2, 2), br, "cross, bottom-right");
}

/// Each packed sequence gives what a padded batch gives through SDPA with key lengths.
#[test]
fn varlen_equals_a_padded_batch() {
    let lens = [5usize, 12, 1, 9];
    let (h, e, max) = (2usize, 8usize, 12usize);
    let cu = CuSeqlens::from_lengths(&lens);
    let t: usize = lens.iter().sum();
    let x = det(&[t, h, e], DType::F32, 5.0);
    for backend in [Backend::Fused, Backend::Composed] {
        let opts = SdpaOptions::default().is_causal(true).window(Some(3), None).backend(backend);
        let packed = varlen_attention(&x, &x, &x, &cu, &cu, &opts).unwrap();
        // The same rows padded to (N, H, max, E), keys beyond each length hidden.
        let mut rows = Vec::new();
        for (b, &n) in lens.iter().enumerate() {
            let part = x.narrow(0, cu.offsets()[b], n).unwrap();
            let pad = Tensor::zeros((max - n, h, e), DType::F32, x.device()).unwrap();
            rows.push(Tensor::cat(&[&part, &pad], 0).unwrap().transpose(0, 1).unwrap());
        }
        let padded = Tensor::stack(&rows, 0).unwrap().contiguous().unwrap();
        let o = opts.clone().kv_lengths(lens.to_vec());
        let out = scaled_dot_product_attention(&padded, &padded, &padded, &o).unwrap();
        for (b, &n) in lens.iter().enumerate() {
            let want = out.get(b).unwrap().narrow(1, 0, n).unwrap().transpose(0, 1).unwrap();
            let got = packed.narrow(0, cu.offsets()[b], n).unwrap();
            assert_close(&got, &want.contiguous().unwrap(), Tolerance::F32_FORWARD, "sequence");
        }
    }
}

#[test]
fn bad_packed_batches_are_errors() {
    let x = det(&[6, 2, 4], DType::F32, 1.0);
    let ok = CuSeqlens::from_lengths(&[2, 4]);
    for backend in [Backend::Fused, Backend::Composed] {
        let o = || SdpaOptions::default().backend(backend);
        for bad in [vec![1, 6], vec![0, 4, 3, 6], vec![0, 5], vec![]] {
            let cu = CuSeqlens::from_offsets(bad);
            let e = varlen_attention(&x, &x, &x, &cu, &ok, &o()).unwrap_err();
            assert!(matches!(e, Error::Config { arg: "cu_seqlens_q", .. }), "{e}");
        }
        let three = CuSeqlens::from_lengths(&[2, 2, 2]);
        let e = varlen_attention(&x, &x, &x, &ok, &three, &o()).unwrap_err();
        assert!(matches!(e, Error::Config { arg: "cu_seqlens_k", .. }), "{e}");
        let e = varlen_attention(&x, &x, &x, &ok, &ok, &o().kv_lengths(vec![1, 1])).unwrap_err();
        assert!(matches!(e, Error::Config { arg: "kv_lengths", .. }), "{e}");
        let k3 = det(&[6, 3, 4], DType::F32, 2.0);
        let e = varlen_attention(&x, &k3, &k3, &ok, &ok, &o().enable_gqa(true)).unwrap_err();
        assert!(e.to_string().contains("varlen_attention"), "{e}");
        let x2 = det(&[6, 8], DType::F32, 1.0);
        assert!(varlen_attention(&x2, &x2, &x2, &ok, &ok, &o()).is_err());
    }
}

/// A packed batch too large to allocate (a zero-strided view of 2^34 rows, f32 and bf16) is
/// `Error::Alloc` naming `varlen_attention` on both paths; the composed path copied each
/// sequence's rows first, and the process aborted.
#[test]
fn an_unallocatable_packed_batch_is_an_error_on_both_paths() {
    let cu = CuSeqlens::from_offsets(vec![0, 1 << 34]);
    for dtype in [DType::F32, DType::BF16] {
        let z = Tensor::zeros((1, 1, 1), dtype, &candle_core::Device::Cpu).unwrap();
        let x = z.broadcast_as((1usize << 34, 1, 1)).unwrap();
        for backend in [Backend::Fused, Backend::Composed] {
            let o = SdpaOptions::default().is_causal(true).backend(backend);
            let e = varlen_attention(&x, &x, &x, &cu, &cu, &o).unwrap_err();
            let what = format!("{dtype:?} {backend:?}: {e}");
            assert!(matches!(e, Error::Alloc { op: "varlen_attention", .. }), "{what}");
            assert!(e.to_string().contains("cannot be allocated"), "{what}");
        }
    }
}

/// A bf16 packed batch takes the path it is given: the composed twin (SDPA per sequence on
/// the widened rows) when asked, within bf16's tolerance of the fused kernels (with direct
/// bf16 products, which the composed path does not take), and `explain` says which.
#[test]
fn a_bf16_packed_batch_takes_the_composed_path_when_asked() {
    use multihead::{with_bf16_products, Bf16Products};
    let cu = CuSeqlens::from_lengths(&[3, 17, 40]);
    let x = det(&[60, 2, 16], DType::BF16, 1.0);
    let go = |backend: Backend| {
        let o = SdpaOptions::default().is_causal(true).backend(backend);
        let plan = explain_varlen(&x, &x, &x, &cu, &cu, &o).unwrap();
        let y =
            with_bf16_products(Bf16Products::Direct, || varlen_attention(&x, &x, &x, &cu, &cu, &o));
        (plan.path, y.unwrap())
    };
    let ((pf, f), (pc, c)) = (go(Backend::Fused), go(Backend::Composed));
    assert_eq!((pf, pc), (Path::Fused, Path::Composed));
    assert_close(&f, &c, Tolerance::BF16_FORWARD, "bf16 fused vs composed");
    let diff = (f.to_dtype(DType::F32).unwrap() - c.to_dtype(DType::F32).unwrap()).unwrap();
    let diff = diff.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(diff > 0.0, "the composed path did not run (the same bits as the fused one)");
}

/// `MultiheadAttention::forward_packed` gives what `forward` gives on each sequence alone,
/// on both paths; the gradients of the input and every parameter agree between the paths,
/// with dropout in training and grouped-query heads.
#[test]
fn packed_mha_equals_each_sequence_alone() {
    use multihead::multihead_attention::PackedOptions;
    use multihead::{MhaConfig, MhaOptions};
    let lens = [5usize, 1, 0, 33, 17];
    let cu = CuSeqlens::from_lengths(&lens);
    let t: usize = lens.iter().sum();
    for cfg in [MhaConfig::new(16, 4), MhaConfig::new(16, 4).with_num_kv_heads(2)] {
        let (mut m, vm) = crate::common::mha(cfg.clone(), DType::F32);
        m.eval();
        let x = det(&[t, 16], DType::F32, 3.0);
        for backend in [Backend::Fused, Backend::Composed] {
            let o = PackedOptions::default().is_causal(true).backend(backend);
            let packed = m.forward_packed(&x, &cu, &o).unwrap();
            for (b, &n) in lens.iter().enumerate().filter(|(_, &n)| n > 0) {
                let xs = x.narrow(0, cu.offsets()[b], n).unwrap().unsqueeze(1).unwrap();
                let mask = multihead::generate_square_subsequent_mask(n, DType::F32, x.device());
                let opts = MhaOptions::default()
                    .need_weights(false)
                    .attn_mask(multihead::Mask::Float(mask.unwrap()));
                let want = m.forward(&xs, &xs, &xs, &opts.backend(backend)).unwrap().output;
                let got = packed.narrow(0, cu.offsets()[b], n).unwrap();
                assert_close(&got, &want.squeeze(1).unwrap(), Tolerance::F32_FORWARD, "sequence");
            }
        }
        // Training with dropout: fused and composed agree on outputs and every gradient.
        let (mut m, vm2) = crate::common::mha(cfg.with_dropout(0.3), DType::F32);
        m.train(true);
        let grads = |backend| {
            let xv = var(&x);
            let o = PackedOptions::default()
                .dropout_key(DropoutKey { seed: 4, offset: 1 })
                .backend(backend);
            let y = m.forward_packed(xv.as_tensor(), &cu, &o).unwrap();
            let g = det(y.dims(), DType::F32, 6.0);
            let store = y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            let data = vm2.data().lock().unwrap();
            let mut names: Vec<_> = data.keys().cloned().collect();
            names.sort();
            let mut gs = vec![y.clone(), store.get(xv.as_tensor()).unwrap().clone()];
            gs.extend(names.iter().map(|n| store.get(data[n].as_tensor()).unwrap().clone()));
            gs
        };
        let (a, b) = (grads(Backend::Fused), grads(Backend::Composed));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_close(x, y, Tolerance::F32_GRAD, &format!("training, tensor {i}"));
        }
        drop(vm);
    }
}

/// A `TransformerEncoderLayer` (E = 16, 4 heads, feed-forward 32, eval) of `dtype` on the
/// packed sequences `lens` of `x`, and on the same sequences as a padded batch with its key
/// padding mask: `(packed (T, E), padded output (3, max, E), offsets)`.
fn packed_and_padded_layer(
    dtype: DType,
    norm_first: bool,
    lens: &[usize],
) -> (Tensor, Tensor, Vec<usize>) {
    use multihead::multihead_attention::PackedOptions;
    use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
    let e = 16usize;
    let max = lens.iter().copied().max().unwrap_or(0);
    let cu = CuSeqlens::from_lengths(lens);
    let t: usize = lens.iter().sum();
    let x = det(&[t, e], DType::F32, 7.0).to_dtype(dtype).unwrap();
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, dtype, x.device());
    let cfg = LayerConfig::new(e, 4).with_dim_feedforward(32).with_batch_first(true);
    let mut layer = TransformerEncoderLayer::new(cfg.with_norm_first(norm_first), vb).unwrap();
    layer.eval();
    let packed = layer.forward_packed(&x, &cu, &PackedOptions::default()).unwrap();
    let mut rows = Vec::new();
    let mut pad = Vec::new();
    for (b, &n) in lens.iter().enumerate() {
        let part = x.narrow(0, cu.offsets()[b], n).unwrap();
        let zeros = Tensor::zeros((max - n, e), dtype, x.device()).unwrap();
        rows.push(Tensor::cat(&[&part, &zeros], 0).unwrap());
        pad.extend((0..max).map(|i| u8::from(i >= n)));
    }
    let padded = Tensor::stack(&rows, 0).unwrap();
    let kpm = Tensor::from_vec(pad, (lens.len(), max), x.device()).unwrap();
    let out = layer.forward(&padded, None, Some(&multihead::Mask::Bool(kpm)), false).unwrap();
    (packed, out, cu.offsets().to_vec())
}

/// `TransformerEncoderLayer::forward_packed` gives what a padded batch with its key padding
/// mask gives, post-norm and pre-norm.
#[test]
fn packed_encoder_layer_equals_the_padded_batch() {
    let lens = [6usize, 13, 2];
    for norm_first in [false, true] {
        let (packed, out, offsets) = packed_and_padded_layer(DType::F32, norm_first, &lens);
        for (b, &n) in lens.iter().enumerate() {
            let want = out.get(b).unwrap().narrow(0, 0, n).unwrap();
            let got = packed.narrow(0, offsets[b], n).unwrap();
            assert_close(&got, &want, Tolerance::F32_FORWARD, "layer");
        }
    }
}

/// A bf16 `TransformerEncoderLayer::forward_packed` computes as the padded batch does (the
/// f32 layer between one widening and one rounding, bf16 products where they are taken): the
/// same bf16 bits for every real token, post-norm and pre-norm.
#[test]
fn packed_bf16_encoder_layer_has_the_padded_batchs_bits() {
    let lens = [6usize, 13, 2];
    let bits = |t: &Tensor| -> Vec<u16> {
        let v = t.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
        v.iter().map(|v| v.to_bits()).collect()
    };
    for norm_first in [false, true] {
        let (packed, out, offsets) = packed_and_padded_layer(DType::BF16, norm_first, &lens);
        assert_eq!(packed.dtype(), DType::BF16);
        for (b, &n) in lens.iter().enumerate() {
            let want = out.get(b).unwrap().narrow(0, 0, n).unwrap();
            let got = packed.narrow(0, offsets[b], n).unwrap();
            assert_eq!(bits(&got), bits(&want), "sequence {b}, norm_first {norm_first}");
        }
    }
}

/// Degenerate packed batches run on both paths and agree: no rows at all (no sequences, or
/// only empty ones), an empty view of a larger tensor, and head size 0 (PyTorch's SDPA then
/// averages the values).
#[test]
fn empty_batches_and_empty_heads_agree_between_the_paths() {
    let o = || SdpaOptions::default().is_causal(true);
    for cu in [vec![0], vec![0, 0, 0]] {
        let cu = CuSeqlens::from_offsets(cu);
        for backend in [Backend::Fused, Backend::Composed] {
            let q = var(&det(&[0, 2, 4], DType::F32, 1.0));
            let out = varlen_attention(q.as_tensor(), &q, &q, &cu, &cu, &o().backend(backend));
            let out = out.expect("empty batch");
            assert_eq!(out.dims(), [0, 2, 4]);
            // The backward runs and gives the (empty) input its (empty) gradient.
            let grads = out.sum_all().unwrap().backward().expect("empty backward");
            assert_eq!(grads.get(&q).expect("a gradient").dims(), [0, 2, 4]);
            // An empty view that starts past a larger tensor's first row.
            let x = det(&[5, 2, 4], DType::F32, 1.0).narrow(0, 5, 0).unwrap();
            let y = varlen_attention(&x, &x, &x, &cu, &cu, &o().backend(backend)).unwrap();
            assert_eq!(y.dims(), [0, 2, 4]);
        }
    }
    // A module on an empty packed batch (its projections' outputs are empty storages; the
    // attention runs on `(T, H·E)` rows): the input and the parameters get zero gradients.
    let (m, vm) = crate::common::mha(multihead::MhaConfig::new(16, 4), DType::F32);
    for cu in [vec![0], vec![0, 0, 0]] {
        let cu = CuSeqlens::from_offsets(cu);
        for backend in [Backend::Fused, Backend::Composed] {
            let x = var(&det(&[0, 16], DType::F32, 1.0));
            let po = multihead::multihead_attention::PackedOptions::default().backend(backend);
            let y = m.forward_packed(&x, &cu, &po.is_causal(true)).expect("empty packed batch");
            assert_eq!(y.dims(), [0, 16]);
            let grads = y.sum_all().unwrap().backward().unwrap();
            assert_eq!(grads.get(&x).expect("dx").dims(), [0, 16], "{backend:?}");
            let data = vm.data().lock().unwrap();
            let w = grads.get(data["in_proj_weight"].as_tensor()).expect("d in_proj_weight");
            let w = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(w.iter().all(|&v| v == 0.0), "{backend:?}: d in_proj_weight");
        }
    }
    // No query rows but keys, and value heads of size 0: no output element, and zero
    // gradients for every input (and the sinks) on both paths, as PyTorch gives.
    // (query lengths, key lengths, shapes of q, k, v)
    type Case<'a> = (&'a [usize], &'a [usize], [&'a [usize]; 3]);
    for backend in [Backend::Fused, Backend::Composed] {
        let cases: [Case; 2] = [
            (&[0, 0], &[0, 3], [&[0, 2, 4], &[3, 2, 4], &[3, 2, 4]]),
            (&[3, 5], &[3, 5], [&[8, 2, 4], &[8, 2, 4], &[8, 2, 0]]),
        ];
        for ((lq, lk, shapes), dtype) in
            cases.into_iter().flat_map(|c| [(c, DType::F32), (c, DType::BF16)])
        {
            let (cq, ck) = (CuSeqlens::from_lengths(lq), CuSeqlens::from_lengths(lk));
            let [q, k, v] = [0, 1, 2].map(|i| var(&det(shapes[i], dtype, 1.0 + i as f64)));
            let sinks = var(&det(&[2], dtype, 5.0));
            let opts = o().sinks(sinks.as_tensor().clone()).backend(backend);
            let out = varlen_attention(&q, &k, &v, &cq, &ck, &opts).expect("an empty output");
            assert_eq!((out.elem_count(), out.dtype()), (0, dtype));
            let grads = out.sum_all().unwrap().backward().unwrap();
            for (t, name) in [(&q, "q"), (&k, "k"), (&v, "v"), (&sinks, "sinks")] {
                let g = grads.get(t).unwrap_or_else(|| panic!("{backend:?} {lq:?}: no d{name}"));
                assert_eq!(g.dims(), t.dims(), "{backend:?} {lq:?}: d{name}");
                let g = g.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                let g = g.to_vec1::<f32>().unwrap();
                assert!(g.iter().all(|&x| x == 0.0), "{backend:?} {lq:?}: d{name} {g:?}");
            }
        }
    }
    let lens = [3usize, 0, 5];
    let cu = CuSeqlens::from_lengths(&lens);
    let shapes: [&[usize]; 3] = [&[8, 2, 0], &[8, 2, 0], &[8, 2, 4]];
    let (a, ga) = run(shapes, (&cu, &cu), &o().backend(Backend::Fused));
    let (b, gb) = run(shapes, (&cu, &cu), &o().backend(Backend::Composed));
    assert_close(&a, &b, Tolerance::F32_FORWARD, "head size 0: output");
    assert_close(&ga[2], &gb[2], Tolerance::F32_GRAD, "head size 0: dv");
    // Equal to PyTorch's rule: with no features every visible key scores the same.
    let v = det(&[8, 2, 4], DType::F32, 3.0);
    let first = v.narrow(0, 0, 1).unwrap();
    assert_close(
        &a.narrow(0, 0, 1).unwrap(),
        &first,
        Tolerance::F32_FORWARD,
        "first row sees itself",
    );
}

/// Attention sinks over a packed batch: the fused op (sinks folded into each sequence's
/// statistics, their gradient summed over the sequences) against the composed path (SDPA
/// with the sinks per sequence): outputs and the gradients of q, k, v and the sinks, with
/// empty sequences, a sequence without keys, grouped heads, a window and dropout.
#[test]
fn varlen_sinks_match_between_the_paths() {
    let (lq, lk) = ([9usize, 0, 70, 1, 33], [9usize, 4, 70, 0, 40]);
    let (cq, ck) = (CuSeqlens::from_lengths(&lq), CuSeqlens::from_lengths(&lk));
    let (tq, tk) = (lq.iter().sum::<usize>(), lk.iter().sum::<usize>());
    let key = DropoutKey { seed: 3, offset: 9 };
    for (what, opts) in [
        ("plain", SdpaOptions::default()),
        ("causal, window, gqa", SdpaOptions::default().is_causal(true).window(Some(5), None)),
        ("dropout", SdpaOptions::default().dropout_p(0.2).dropout_key(key)),
    ] {
        let run = |backend| {
            let q = var(&det(&[tq, 4, 16], DType::F32, 1.0));
            let k = var(&det(&[tk, 2, 16], DType::F32, 2.0));
            let v = var(&det(&[tk, 2, 16], DType::F32, 3.0));
            let sinks = var(&Tensor::new(
                &[0.5f32, -1.0, 2.0, f32::NEG_INFINITY],
                &candle_core::Device::Cpu,
            )
            .unwrap());
            let o = opts.clone().enable_gqa(true).sinks(sinks.as_tensor().clone()).backend(backend);
            let out = varlen_attention(&q, &k, &v, &cq, &ck, &o).expect("varlen with sinks");
            let g = det(out.dims(), DType::F32, 4.0);
            let grads = out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            let mut all = vec![out];
            all.extend([&q, &k, &v, &sinks].map(|t| grads.get(t).expect("grad").clone()));
            all
        };
        let (a, b) = (run(Backend::Fused), run(Backend::Composed));
        for (name, (x, y)) in ["output", "dq", "dk", "dv", "dsinks"].iter().zip(a.iter().zip(&b)) {
            assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: {name}"));
        }
        let ds = a[4].to_vec1::<f32>().unwrap();
        assert!(ds[..3].iter().all(|g| g.abs() > 1e-4) && ds[3] == 0.0, "{what}: {ds:?}");
    }
    // bf16 inputs and sinks: widened to f32 with the sinks (both paths), close to f32.
    let x = det(&[tq, 4, 16], DType::F32, 1.0);
    let s32 = Tensor::new(&[0.5f32, -1.0, 2.0, 0.0], x.device()).unwrap();
    let f32_out =
        varlen_attention(&x, &x, &x, &cq, &cq, &SdpaOptions::default().sinks(s32.clone()));
    let (xb, sb) = (x.to_dtype(DType::BF16).unwrap(), s32.to_dtype(DType::BF16).unwrap());
    for backend in [Backend::Fused, Backend::Composed] {
        let o = SdpaOptions::default().sinks(sb.clone()).backend(backend);
        let y = varlen_attention(&xb, &xb, &xb, &cq, &cq, &o).expect("bf16 with sinks");
        let y = y.to_dtype(DType::F32).unwrap();
        assert_close(&y, f32_out.as_ref().unwrap(), Tolerance::BF16_FORWARD, "bf16 sinks");
    }
    // Wrong shape or dtype: errors naming the packed call and the sinks.
    for bad in [det(&[3], DType::F32, 1.0), det(&[4], DType::F64, 1.0)] {
        let o = SdpaOptions::default().sinks(bad);
        let e = varlen_attention(&x, &x, &x, &cq, &cq, &o).unwrap_err();
        assert!(
            e.to_string().contains("varlen_attention") && e.to_string().contains("sinks"),
            "{e}"
        );
    }
}

/// `forward_packed` with sinks gives what `forward` with the same sinks gives on each
/// sequence alone, on both paths, and the sinks' gradient agrees between the paths.
#[test]
fn packed_mha_takes_sinks() {
    use multihead::functional::MhaOptions;
    use multihead::multihead_attention::PackedOptions;
    use multihead::MhaConfig;
    let lens = [6usize, 0, 21, 1];
    let cu = CuSeqlens::from_lengths(&lens);
    let t: usize = lens.iter().sum();
    let (mut m, _vm) = crate::common::mha(MhaConfig::new(16, 4).with_num_kv_heads(2), DType::F32);
    m.eval();
    let x = det(&[t, 16], DType::F32, 7.0);
    let dev = x.device().clone();
    let mut dsinks = Vec::new();
    for backend in [Backend::Fused, Backend::Composed] {
        let sinks = var(&Tensor::new(&[1.0f32, -0.5, 0.0, 3.0], &dev).unwrap());
        let o = PackedOptions::default().is_causal(true).sinks(sinks.as_tensor().clone());
        let packed = m.forward_packed(&x, &cu, &o.backend(backend)).unwrap();
        for (b, &n) in lens.iter().enumerate().filter(|(_, &n)| n > 0) {
            let xs = x.narrow(0, cu.offsets()[b], n).unwrap().unsqueeze(1).unwrap();
            let mask = multihead::generate_square_subsequent_mask(n, DType::F32, &dev).unwrap();
            let opts = MhaOptions::default()
                .need_weights(false)
                .attn_mask(multihead::Mask::Float(mask))
                .sinks(sinks.as_tensor().clone())
                .backend(backend);
            let want = m.forward(&xs, &xs, &xs, &opts).unwrap().output;
            let got = packed.narrow(0, cu.offsets()[b], n).unwrap();
            assert_close(&got, &want.squeeze(1).unwrap(), Tolerance::F32_FORWARD, "sequence");
        }
        let g = det(packed.dims(), DType::F32, 2.0);
        let grads = packed.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
        dsinks.push(grads.get(&sinks).expect("dsinks").clone());
    }
    assert_close(&dsinks[0], &dsinks[1], Tolerance::F32_GRAD, "dsinks, fused vs composed");
    // Wrong sinks: an error naming the module's call and the sinks.
    for bad in [det(&[2], DType::F32, 1.0), det(&[4], DType::F64, 1.0)] {
        let o = PackedOptions::default().sinks(bad);
        let e = m.forward_packed(&x, &cu, &o).unwrap_err().to_string();
        assert!(e.starts_with("MultiheadAttention: sinks"), "{e}");
    }
}

/// Inside `no_grad` the fused kernels keep no row statistics for inputs that carry no graph
/// (inference): the outputs have the bits they have with gradients enabled, a graph that
/// still reaches them through tracked sinks gets an error naming `no_grad` from its backward
/// (not a panic), and tracked inputs keep the statistics and their gradients.
#[test]
fn no_grad_keeps_no_statistics_and_says_so_if_asked_for_a_gradient() {
    let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (lq, lk) = ([9usize, 0, 70, 1, 33], [9usize, 4, 70, 0, 40]);
    let (cq, ck) = (CuSeqlens::from_lengths(&lq), CuSeqlens::from_lengths(&lk));
    let (tq, tk) = (lq.iter().sum::<usize>(), lk.iter().sum::<usize>());
    let packed = [det(&[tq, 4, 16], DType::F32, 1.0), det(&[tk, 2, 16], DType::F32, 2.0)];
    let batched = [det(&[2, 4, 70, 16], DType::F32, 1.0), det(&[2, 2, 50, 16], DType::F32, 2.0)];
    let sinks = var(&Tensor::new(&[0.5f32, -1.0, 2.0, 0.0], &candle_core::Device::Cpu).unwrap());
    let opts = SdpaOptions::default().enable_gqa(true).is_causal(true).backend(Backend::Fused);
    let with_sinks = opts.clone().sinks(sinks.as_tensor().clone());
    type Call<'a> = Box<dyn Fn(&Tensor, &Tensor, &SdpaOptions) -> multihead::Result<Tensor> + 'a>;
    let calls: [(&str, [Tensor; 2], Call); 2] = [
        ("varlen", packed, Box::new(|q, kv, o| varlen_attention(q, kv, kv, &cq, &ck, o))),
        ("sdpa", batched, Box::new(|q, kv, o| scaled_dot_product_attention(q, kv, kv, o))),
    ];
    for (what, [q, kv], call) in calls {
        let graded = call(&q, &kv, &with_sinks).expect("forward");
        let bare = multihead::no_grad(|| call(&q, &kv, &with_sinks)).expect("no_grad forward");
        assert_eq!(bits(&bare), bits(&graded), "{what}: no_grad changed the output");
        let e = bare.sum_all().unwrap().backward().expect_err("no statistics").to_string();
        assert!(e.contains("no row statistics") && e.contains("no_grad"), "{what}: {e}");
        // Tracked inputs inside no_grad: the statistics are kept, the gradient is the same.
        let (qv, kvv) = (var(&q), var(&kv));
        let grad = |out: Tensor| {
            let g = out.sum_all().unwrap().backward().expect("backward");
            bits(g.get(qv.as_tensor()).expect("dq"))
        };
        let outside = grad(call(qv.as_tensor(), kvv.as_tensor(), &opts).unwrap());
        let inside =
            grad(multihead::no_grad(|| call(qv.as_tensor(), kvv.as_tensor(), &opts)).unwrap());
        assert_eq!(inside, outside, "{what}: dq inside no_grad");
    }
}

#[test]
fn strided_feature_views_run_as_their_dense_copies_and_explain_checks_the_calls_sizes() {
    // A view whose feature dimension is strided (a broadcast, a transpose) was refused by the
    // fused path ("the feature dimension must be contiguous") while explain said Fused and SDPA
    // took the same input: it is now copied first, with the dense tensor's bits, gradients too.
    let cu = CuSeqlens::from_lengths(&[3, 2]);
    let opts = SdpaOptions::default().is_causal(true);
    let base = det(&[5, 2, 1], DType::F32, 1.0);
    let wide = base.broadcast_as((5, 2, 8)).unwrap();
    let flipped = det(&[5, 8, 2], DType::F32, 2.0).transpose(1, 2).unwrap();
    for (what, x) in [("broadcast", wide), ("transposed", flipped)] {
        let dense = x.contiguous().unwrap();
        let plan = explain_varlen(&x, &x, &x, &cu, &cu, &opts).unwrap();
        assert_eq!(plan.path, Path::Fused, "{what}");
        let a = varlen_attention(&x, &x, &x, &cu, &cu, &opts).unwrap();
        let b = varlen_attention(&dense, &dense, &dense, &cu, &cu, &opts).unwrap();
        let bits = |t: &Tensor| {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&a), bits(&b), "{what}");
        // Gradients reach the view's source.
        let src = var(&det(&[5, 8, 2], DType::F32, 3.0));
        let view = src.as_tensor().transpose(1, 2).unwrap();
        let y = varlen_attention(&view, &view, &view, &cu, &cu, &opts).unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        assert!(g.get(src.as_tensor()).is_some(), "{what}");
    }
    // An output that cannot be allocated: the plan gives the call's error (it said Ok before).
    let rows = 1usize << 38;
    let q = Tensor::zeros((1, 1, 8), DType::F32, &crate::common::dev())
        .unwrap()
        .broadcast_as((rows, 1, 8))
        .unwrap();
    let kv = Tensor::zeros((1, 1, 8), DType::F32, &crate::common::dev()).unwrap();
    let (cq, ck) = (CuSeqlens::from_offsets(vec![0, rows]), CuSeqlens::from_lengths(&[1]));
    let o = SdpaOptions::default();
    let plan = explain_varlen(&q, &kv, &kv, &cq, &ck, &o).unwrap_err();
    let call = varlen_attention(&q, &kv, &kv, &cq, &ck, &o).unwrap_err();
    assert!(matches!(call, Error::Alloc { .. }), "{call}");
    assert_eq!(plan.to_string(), call.to_string());
}
