//! Incremental decoding: a KV cache gives the numbers of the full causal recompute, at every
//! step, on both paths; grouped-query attention is attention over repeated kv heads; static
//! keys give the numbers of projecting the memory each time.

use candle_core::{DType, Tensor, D};
use multihead::{
    generate_square_subsequent_mask, no_grad, with_backend, Backend, Error, KvCache, Mask,
    MhaConfig, MhaOptions, MultiheadAttention, NamedParameters, Path,
};

use candle_nn::{VarBuilder, VarMap};

use crate::common::{det, dev, mha};

/// The largest |a - b| relative to the largest |b| (at least 1): f32 results that differ only
/// in summation order agree to about 1e-7 of their scale.
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let scale = b
        .to_dtype(DType::F64)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    max_diff(a, b) / scale.max(1.0)
}

/// Seeded uniform values in `[-amp, amp)` (xorshift), so that sums cancel as with random
/// weights and activations.
fn rand_t(shape: &[usize], dtype: DType, seed: u64, amp: f64) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let n: usize = shape.iter().product();
    let data: Vec<f64> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * amp
        })
        .collect();
    Tensor::from_vec(data, shape, &dev()).unwrap().to_dtype(dtype).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap();
    d.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

/// The full causal recompute of one row's prefix `(P, E)` (unbatched), last `t` positions.
fn full_causal(m: &MultiheadAttention, prefix: &Tensor, t: usize, window: Option<usize>) -> Tensor {
    let p = prefix.dim(0).unwrap();
    let mask = match window {
        None => generate_square_subsequent_mask(p, prefix.dtype(), &dev()).unwrap(),
        Some(w) => {
            let v: Vec<f32> = (0..p)
                .flat_map(|i| {
                    (0..p).map(move |j| if j <= i && i - j < w { 0.0 } else { f32::NEG_INFINITY })
                })
                .collect();
            Tensor::from_vec(v, (p, p), &dev()).unwrap().to_dtype(prefix.dtype()).unwrap()
        }
    };
    let opts = MhaOptions::default().need_weights(false).attn_mask(Mask::Float(mask));
    let out = m.forward(prefix, prefix, prefix, &opts).unwrap().output;
    out.narrow(0, p - t, t).unwrap()
}

/// A batch-first module in eval mode with seeded random weights of PyTorch's initial scale
/// (uniform in `±√(3/E)`, about Xavier's bound), so outputs are of order one.
fn module(e: usize, h: usize, kv: Option<usize>, dtype: DType) -> MultiheadAttention {
    let mut cfg = MhaConfig::new(e, h).with_batch_first(true).with_dropout(0.1);
    cfg.num_kv_heads = kv;
    let vm = VarMap::new();
    let mut m = MultiheadAttention::new(cfg, VarBuilder::from_varmap(&vm, dtype, &dev())).unwrap();
    let amp = (3.0 / e as f64).sqrt();
    let data = vm.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for (i, name) in names.into_iter().enumerate() {
        let var = &data[name];
        var.set(&rand_t(var.dims(), dtype, i as u64 + 11, amp)).unwrap();
    }
    m.eval();
    m
}

/// Prefill ragged prompts, then decode `steps` tokens one at a time; at every step compare
/// each row with its full recompute. Returns the largest difference seen.
fn decode_against_recompute(m: &MultiheadAttention, steps: usize, window: Option<usize>) -> f64 {
    let (e, dtype) = (m.config().embed_dim, m.dtype());
    let prompt_lens = [7usize, 3, 5];
    let n = prompt_lens.len();
    let total = 7 + steps;
    let seqs = rand_t(&[n, total, e], dtype, 3, 3f64.sqrt()); // row b's tokens: seqs[b, :len]
    let mut cache = match window {
        None => m.new_cache(n, total).unwrap(),
        Some(w) => m.new_sliding_cache(n, w).unwrap(),
    };
    let prompt = seqs.narrow(1, 0, 7).unwrap();
    let out = m.forward_cached(&prompt, &mut cache, Some(&prompt_lens)).unwrap();
    let mut worst = 0.0f64;
    for (b, &len) in prompt_lens.iter().enumerate() {
        let want = full_causal(m, &seqs.get(b).unwrap().narrow(0, 0, len).unwrap(), len, window);
        worst = worst.max(rel_diff(&out.get(b).unwrap().narrow(0, 0, len).unwrap(), &want));
        // Padding rows give out_proj.bias.
        if len < 7 {
            let pad = out.get(b).unwrap().narrow(0, len, 7 - len).unwrap();
            let bias = m
                .out_proj()
                .bias()
                .unwrap()
                .unsqueeze(0)
                .unwrap()
                .broadcast_as(pad.dims())
                .unwrap();
            assert_eq!(max_diff(&pad, &bias), 0.0, "padding rows of row {b}");
        }
    }
    let mut pos = prompt_lens.to_vec();
    for _ in 0..steps {
        let idx: Vec<Tensor> =
            (0..n).map(|b| seqs.get(b).unwrap().narrow(0, pos[b], 1).unwrap()).collect();
        let x = Tensor::stack(&idx, 0).unwrap(); // (N, 1, E)
        let out = m.forward_cached(&x, &mut cache, None).unwrap();
        for (b, p) in pos.iter_mut().enumerate() {
            *p += 1;
            let want = full_causal(m, &seqs.get(b).unwrap().narrow(0, 0, *p).unwrap(), 1, window);
            worst = worst.max(rel_diff(&out.get(b).unwrap(), &want));
        }
    }
    assert_eq!(cache.positions(), pos.as_slice());
    worst
}

#[test]
fn cached_decoding_equals_the_full_causal_recompute_at_every_step() {
    for (e, h, kv) in [(32, 4, None), (48, 6, Some(2)), (16, 2, Some(1))] {
        let m = module(e, h, kv, DType::F32);
        assert_eq!(
            m.explain_cached(&det(&[3, 1, e], DType::F32, 0.0), &m.new_cache(3, 4).unwrap(), None)
                .unwrap()
                .path,
            Path::Fused
        );
        let fused = decode_against_recompute(&m, 300, None);
        assert!(fused <= 1e-6, "E={e} H={h} kv={kv:?}: fused max diff {fused:e}");
        let composed = with_backend(Backend::Composed, || decode_against_recompute(&m, 40, None));
        assert!(composed <= 1e-6, "E={e} H={h} kv={kv:?}: composed max diff {composed:e}");
    }
}

#[test]
fn cached_decoding_in_f64_takes_the_composed_path_and_agrees_to_1e_12() {
    let m = module(24, 3, Some(3), DType::F64);
    let err = decode_against_recompute(&m, 60, None);
    assert!(err <= 1e-12, "f64 max diff {err:e}");
}

#[test]
fn a_sliding_cache_equals_a_sliding_window_mask() {
    let m = module(32, 4, Some(2), DType::F32);
    for w in [1, 5, 16] {
        let err = decode_against_recompute(&m, 40, Some(w));
        assert!(err <= 1e-6, "window {w}: max diff {err:e}");
        let err = with_backend(Backend::Composed, || decode_against_recompute(&m, 20, Some(w)));
        assert!(err <= 1e-6, "window {w}, composed: max diff {err:e}");
    }
}

#[test]
fn one_token_at_a_time_equals_one_prefill_bit_for_bit_for_any_thread_count() {
    let m = module(64, 8, None, DType::F32);
    let x = det(&[2, 40, 64], DType::F32, 1.0);
    let run_all = || {
        let mut c = m.new_cache(2, 40).unwrap();
        m.forward_cached(&x, &mut c, None).unwrap()
    };
    let run_steps = || {
        let mut c = m.new_cache(2, 40).unwrap();
        let outs: Vec<Tensor> = (0..40)
            .map(|i| m.forward_cached(&x.narrow(1, i, 1).unwrap(), &mut c, None).unwrap())
            .collect();
        Tensor::cat(&outs, 1).unwrap()
    };
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    };
    let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
    let one = pool(1).install(run_steps);
    assert_eq!(bits(&one), bits(&pool(2).install(run_steps)), "1 vs 2 threads");
    assert_eq!(bits(&one), bits(&pool(3).install(run_steps)), "1 vs 3 threads");
    // A prefill projects all tokens in one product, a step one token: the projections may round
    // differently, the attention does not.
    let err = rel_diff(&one, &run_all());
    assert!(err <= 1e-6, "steps vs prefill: {err:e}");
}

#[test]
fn a_full_cache_is_an_error_and_is_left_unchanged() {
    let m = module(16, 2, None, DType::F32);
    let mut cache = m.new_cache(2, 4).unwrap();
    m.forward_cached(&det(&[2, 3, 16], DType::F32, 1.0), &mut cache, Some(&[3, 1])).unwrap();
    let before = cache.keys().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let err = m.forward_cached(&det(&[2, 2, 16], DType::F32, 2.0), &mut cache, None).unwrap_err();
    assert!(matches!(err, Error::CacheFull { .. }), "{err}");
    assert!(err.to_string().contains("row 0 holds 3 of 4 tokens and cannot take 2 more"), "{err}");
    assert_eq!(cache.lens(), &[3, 1]);
    assert_eq!(before, cache.keys().flatten_all().unwrap().to_vec1::<f32>().unwrap());
    // Growing explicitly keeps the tokens.
    let mut big = cache.with_capacity(8).unwrap();
    m.forward_cached(&det(&[2, 2, 16], DType::F32, 2.0), &mut big, None).unwrap();
    assert_eq!(big.lens(), &[5, 3]);
}

/// The composed path's sizes (its mask and scores) are checked before the cache changes, by
/// the call and by `explain_cached` alike: a call whose mask cannot be allocated left its tokens
/// in the cache (an adversarial run), and the next call found it full.
#[test]
fn a_composed_step_too_large_to_allocate_leaves_the_cache_unchanged() {
    let m = module(4, 2, None, DType::F64);
    let t = 200_000;
    let x = Tensor::zeros((1, t, 4), DType::F64, &dev()).unwrap(); // (N, T, E): batch_first
    let mut cache = m.new_cache(1, t).unwrap();
    let plan = m.explain_cached(&x, &cache, None).unwrap_err();
    let err = m.forward_cached(&x, &mut cache, None).unwrap_err();
    assert!(matches!(err, Error::Alloc { .. }), "{err}");
    assert_eq!(plan.to_string(), err.to_string());
    assert_eq!(cache.lens(), &[0]);
    // The cache takes the next call as if nothing had happened.
    let y = m.forward_cached(&det(&[1, 3, 4], DType::F64, 1.0), &mut cache, None).unwrap();
    assert_eq!((y.dims(), cache.lens()), (&[1, 3, 4][..], &[3][..]));
}

/// A two-layer f32 decoder of width `e` (2 heads, feed-forward 16) with seeded weights, in
/// eval mode.
fn small_decoder(e: usize) -> (multihead::transformer::TransformerDecoder, VarMap) {
    use multihead::transformer::{LayerConfig, TransformerDecoder};
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let cfg = LayerConfig::new(e, 2).with_dim_feedforward(16);
    let mut dec = TransformerDecoder::new(cfg, 2, None, vb).unwrap();
    seed_vars(&vm, DType::F32);
    dec.eval();
    (dec, vm)
}

/// A decoder step whose cross-attention refuses its arguments (a batched token over an
/// unbatched memory, a memory mask of the wrong shape) is an error before any layer's cache
/// changes: the first layer's self-attention appended first, and the steps that followed the
/// error were silently wrong (an adversarial run).
#[test]
fn a_refused_decoder_step_leaves_every_cache_unchanged() {
    use multihead::transformer::DecoderMasks;
    let (dec, _vm) = small_decoder(8);
    let (mem, tgt) = (det(&[5, 8], DType::F32, 2.0), det(&[3, 8], DType::F32, 4.0));
    let mut state = dec.start(&mem, None, 8).unwrap();
    let batched = tgt.narrow(0, 0, 1).unwrap().unsqueeze(1).unwrap();
    assert!(dec.forward_step(&batched, &mut state, None).is_err());
    let lens: Vec<Vec<usize>> = state.caches().iter().map(|c| c.lens().to_vec()).collect();
    assert_eq!(lens, vec![vec![0], vec![0]]);
    // One layer with a memory mask of the wrong shape, called directly.
    let layer = &dec.layers()[0];
    let memory = layer.static_memory(&mem).unwrap();
    let mut cache = layer.new_cache(1, 8).unwrap();
    let bad = Mask::Bool(Tensor::zeros(4, DType::U8, &dev()).unwrap());
    let x = tgt.narrow(0, 0, 1).unwrap();
    assert!(layer.forward_step(&x, &memory, &mut cache, Some(&bad), None).is_err());
    assert_eq!(cache.lens(), &[0]);
    // Steps after the errors give the full decoder's numbers.
    let ys: Vec<Tensor> = (0..3)
        .map(|t| dec.forward_step(&tgt.narrow(0, t, 1).unwrap(), &mut state, None).unwrap())
        .collect();
    let causal = generate_square_subsequent_mask(3, DType::F32, &dev()).unwrap();
    let masks = DecoderMasks { tgt_mask: Some(Mask::Float(causal)), ..Default::default() };
    let full = no_grad(|| dec.forward(&tgt, &mem, &masks)).unwrap();
    let d = rel_diff(&Tensor::cat(&ys, 0).unwrap(), &full);
    assert!(d <= 1e-6, "max diff {d:e}");
}

/// A decoder step's own bad input is the step's error, naming `x` or the cache its batch does
/// not fit (it was reported as the cross-attention's query against the memory given to
/// `start`), and changes no cache.
#[test]
fn a_decoder_steps_bad_input_is_named_as_the_steps() {
    let (dec, _vm) = small_decoder(16);
    let mut state = dec.start(&det(&[5, 2, 16], DType::F32, 2.0), None, 8).unwrap();
    for (x, what) in [
        (det(&[1, 2, 8], DType::F32, 1.0), "features"),
        (det(&[1, 2, 16], DType::F64, 1.0), "dtype"),
        (det(&[1, 16], DType::F32, 1.0), "batch"),
        (det(&[1, 3, 16], DType::F32, 1.0), "batch"),
        (det(&[1, 1, 2, 16], DType::F32, 1.0), "2-D"),
    ] {
        let e = dec.forward_step(&x, &mut state, None).unwrap_err().to_string();
        let named = ["x", "cache"].map(|a| format!("TransformerDecoder::forward_step: {a}: "));
        assert!(named.iter().any(|n| e.starts_with(n.as_str())), "{:?}: {e}", x.dims());
        assert!(e.contains(what), "{:?}: {e}", x.dims());
        let lens: Vec<Vec<usize>> = state.caches().iter().map(|c| c.lens().to_vec()).collect();
        assert_eq!(lens, vec![vec![0, 0], vec![0, 0]]);
    }
    let y = dec.forward_step(&det(&[1, 2, 16], DType::F32, 1.0), &mut state, None).unwrap();
    assert_eq!(y.dims(), &[1, 2, 16]);
}

/// Empty caches (no capacity, no rows) take calls that append nothing, on both paths; a token
/// that does not fit is `CacheFull`. (An adversarial sweep found candle's "dst has repeated
/// elements" instead: an in-place write into an empty tensor.)
#[test]
fn empty_caches_take_calls_that_append_nothing() {
    let m = module(16, 2, None, DType::F32);
    let bias = || m.named_parameters().into_iter().find(|(n, _)| n == "out_proj.bias").unwrap().1;
    for backend in [Backend::Auto, Backend::Composed] {
        let run = |cache: &mut KvCache, x: &Tensor, counts: Option<&[usize]>| {
            multihead::with_backend(backend, || m.forward_cached(x, cache, counts))
        };
        let mut zero = m.new_cache(2, 0).unwrap();
        let y = run(&mut zero, &det(&[2, 1, 16], DType::F32, 1.0), Some(&[0, 0])).unwrap();
        assert_eq!(y.dims(), &[2, 1, 16]);
        // A row with nothing to attend to gives the output projection's bias, as S = 0 does.
        let want = bias().to_vec1::<f32>().unwrap();
        assert_eq!(y.flatten_to(1).unwrap().to_vec2::<f32>().unwrap(), vec![want.clone(), want]);
        let y = run(&mut zero, &det(&[2, 0, 16], DType::F32, 1.0), None).unwrap();
        assert_eq!(y.dims(), &[2, 0, 16]);
        let e = run(&mut zero, &det(&[2, 1, 16], DType::F32, 1.0), None).unwrap_err();
        assert!(matches!(e, Error::CacheFull { .. }), "{e}");
        assert_eq!(zero.lens(), &[0, 0]);
        let empty = Tensor::zeros((2, 2, 0, 8), DType::F32, &dev()).unwrap();
        zero.append_kv(&empty, &empty, None).unwrap();
        let mut none = m.new_cache(0, 0).unwrap();
        let y = run(&mut none, &det(&[0, 1, 16], DType::F32, 1.0), None).unwrap();
        assert_eq!(y.dims(), &[0, 1, 16]);
        let mut rows0 = m.new_cache(0, 4).unwrap();
        run(&mut rows0, &det(&[0, 3, 16], DType::F32, 1.0), None).unwrap();
    }
    // Integer sinks are refused, as scaled_dot_product_attention refuses them.
    let mut cache = m.new_cache(2, 4).unwrap();
    let opts = multihead::multihead_attention::CachedOptions::default()
        .sinks(Tensor::new(&[1u8, 2], &dev()).unwrap());
    let x = det(&[2, 1, 16], DType::F32, 1.0);
    let e = m.forward_cached_with(&x, &mut cache, None, &opts).unwrap_err().to_string();
    assert!(e.contains("sinks") && e.contains("expected a float tensor"), "{e}");
}

/// A step of no new tokens is an empty output on a sliding cache too (it failed with an untyped
/// "cat expects at least one tensor"); and a NaN in a padding token (beyond `lengths`) leaves
/// that row at the output projection's bias on every dtype and path (the composed path, which
/// f64 and f16 take, attended it and gave NaN).
#[test]
fn empty_steps_and_nan_padding_rows_on_every_cache_and_dtype() {
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let m = module(16, 2, None, dtype);
        let bias = m.named_parameters().into_iter().find(|(n, _)| n == "out_proj.bias").unwrap().1;
        let bias = bias.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        let x0 = det(&[2, 0, 16], dtype, 1.0);
        let mut ring = m.new_sliding_cache(2, 4).unwrap();
        assert_eq!(m.forward_cached(&x0, &mut ring, None).unwrap().dims(), &[2, 0, 16]);
        assert_eq!(ring.lens(), &[0, 0]);
        let flat = det(&[2, 2, 16], DType::F32, 2.0).flatten_all().unwrap();
        let mut vals = flat.to_vec1::<f32>().unwrap();
        vals[(2 + 1) * 16] = f32::NAN; // entry 1, token 1: padding under lengths [2, 1]
        let x = Tensor::from_vec(vals, (2, 2, 16), &dev()).unwrap().to_dtype(dtype).unwrap();
        for backend in [Backend::Auto, Backend::Composed] {
            let mut cache = m.new_cache(2, 4).unwrap();
            let y = with_backend(backend, || m.forward_cached(&x, &mut cache, Some(&[2, 1])));
            let y = y.unwrap().to_dtype(DType::F32).unwrap();
            let pad = y.get(1).unwrap().get(1).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(pad, bias, "{dtype:?} {backend:?}: the padding row");
            let real = y.narrow(1, 0, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(real.iter().all(|v| v.is_finite()), "{dtype:?} {backend:?}: {real:?}");
        }
    }
}

#[test]
fn bad_cached_calls_are_typed_errors() {
    let mut m = module(16, 2, None, DType::F32);
    let mut cache = m.new_cache(2, 8).unwrap();
    let x = det(&[2, 1, 16], DType::F32, 1.0);
    let msg = |r: multihead::Result<Tensor>| r.unwrap_err().to_string();
    assert!(
        msg(m.forward_cached(&x.to_dtype(DType::F64).unwrap(), &mut cache, None)).contains("dtype")
    );
    assert!(msg(m.forward_cached(&det(&[3, 1, 16], DType::F32, 1.0), &mut cache, None))
        .contains("(N, Hkv, D) = (3, 2, 8)"));
    assert!(msg(m.forward_cached(&det(&[2, 1, 8], DType::F32, 1.0), &mut cache, None))
        .contains("expected 16 features"));
    assert!(msg(m.forward_cached(&x, &mut cache, Some(&[2, 1]))).contains("at most T=1"));
    m.train(true);
    assert!(msg(m.forward_cached(&x, &mut cache, None)).contains("call eval() first"));
    assert_eq!(cache.lens(), &[0, 0]);
    let bad = MhaConfig::new(16, 4).with_num_kv_heads(3).validate().unwrap_err().to_string();
    assert!(bad.contains("num_kv_heads must be greater than 0 and divide num_heads"), "{bad}");
    assert!(KvCache::sliding_window(1, 1, 4, 0, DType::F32, &dev()).is_err());
    assert!(cache.truncate_rows(&[1, 0]).is_err());
}

#[test]
fn truncate_and_reorder_roll_rows_back_and_select_them() {
    let m = module(16, 2, None, DType::F32);
    let x = det(&[2, 6, 16], DType::F32, 1.0);
    let mut a = m.new_cache(2, 8).unwrap();
    m.forward_cached(&x.narrow(1, 0, 4).unwrap(), &mut a, None).unwrap();
    let mut b = a.try_clone().unwrap();
    m.forward_cached(&x.narrow(1, 4, 2).unwrap(), &mut b, None).unwrap();
    b.truncate(4).unwrap(); // reject two speculated tokens
    let next = det(&[2, 1, 16], DType::F32, 9.0);
    let ya = m.forward_cached(&next, &mut a, None).unwrap();
    let yb = m.forward_cached(&next, &mut b, None).unwrap();
    assert_eq!(max_diff(&ya, &yb), 0.0);
    // Beam search: both rows continue from row 1, with the same token.
    let mut c = b.try_clone().unwrap();
    b.reorder(&[1, 1]).unwrap();
    let tok = next.narrow(0, 1, 1).unwrap();
    let yr = m.forward_cached(&Tensor::cat(&[&tok, &tok], 0).unwrap(), &mut b, None).unwrap();
    let want = m.forward_cached(&Tensor::cat(&[&tok, &tok], 0).unwrap(), &mut c, None).unwrap();
    assert_eq!(max_diff(&yr.get(0).unwrap(), &want.get(1).unwrap()), 0.0);
    assert_eq!(max_diff(&yr.get(1).unwrap(), &want.get(1).unwrap()), 0.0);
    assert_eq!(b.lens(), &[6, 6]);
}

/// Grouped-query attention is attention with each kv head repeated for its query heads
/// (`repeat_interleave`, what PyTorch's `enable_gqa` does): compare with a plain module whose
/// key/value weights are repeated that way.
#[test]
fn grouped_query_attention_equals_attention_over_repeated_kv_heads() {
    let (e, h, hk) = (24, 6, 2);
    let (g, hd) = (h / hk, e / h);
    for dtype in [DType::F32, DType::F64] {
        let (gqa, _) = mha(MhaConfig::new(e, h).with_num_kv_heads(hk), dtype);
        let p: std::collections::HashMap<String, Tensor> =
            gqa.named_parameters().into_iter().collect();
        let repeat = |w: &Tensor| -> Tensor {
            let rest = &w.dims()[1..];
            let mut dims = vec![hk, 1, hd];
            dims.extend_from_slice(rest);
            let mut to = vec![hk, g, hd];
            to.extend_from_slice(rest);
            let mut flat = vec![e];
            flat.extend_from_slice(rest);
            w.reshape(dims)
                .unwrap()
                .broadcast_as(to)
                .unwrap()
                .contiguous()
                .unwrap()
                .reshape(flat)
                .unwrap()
        };
        let b = &p["in_proj_bias"];
        let w_in = Tensor::cat(
            &[&p["q_proj_weight"], &repeat(&p["k_proj_weight"]), &repeat(&p["v_proj_weight"])],
            0,
        )
        .unwrap();
        let b_in = Tensor::cat(
            &[
                &b.narrow(0, 0, e).unwrap(),
                &repeat(&b.narrow(0, e, hk * hd).unwrap()),
                &repeat(&b.narrow(0, e + hk * hd, hk * hd).unwrap()),
            ],
            0,
        )
        .unwrap();
        let params = multihead::functional::MhaParams {
            embed_dim_to_check: e,
            num_heads: h,
            num_kv_heads: None,
            in_proj: multihead::functional::InProj::Packed(&w_in),
            in_proj_bias: Some(&b_in),
            bias_k: None,
            bias_v: None,
            add_zero_attn: false,
            dropout_p: 0.0,
            out_proj_weight: &p["out_proj.weight"],
            out_proj_bias: Some(&p["out_proj.bias"]),
        };
        let x = det(&[5, 2, e], dtype, 1.0);
        let mem = det(&[7, 2, e], dtype, 2.0);
        let kpm = Mask::Bool(Tensor::new(&[[0u8, 0, 0, 0, 0, 1, 1], [0; 7]], &dev()).unwrap());
        for need_weights in [false, true] {
            let opts =
                MhaOptions::default().need_weights(need_weights).key_padding_mask(kpm.clone());
            let want = multihead::functional::multi_head_attention_forward(
                &x, &mem, &mem, &params, &opts, false,
            )
            .unwrap();
            for backend in [Backend::Auto, Backend::Composed] {
                let got = gqa.forward(&x, &mem, &mem, &opts.clone().backend(backend)).unwrap();
                let tol = if dtype == DType::F32 { 2e-6 } else { 1e-12 };
                let err = rel_diff(&got.output, &want.output);
                assert!(err <= tol, "{dtype:?} {backend:?} output: {err:e}");
                if need_weights {
                    let (gw, ww) = (got.attn_weights.unwrap(), want.attn_weights.clone().unwrap());
                    assert!(rel_diff(&gw, &ww) <= tol, "{dtype:?} {backend:?} weights");
                }
            }
        }
    }
}

#[test]
fn static_keys_give_the_numbers_of_projecting_the_memory() {
    for (kv, dtype) in [(None, DType::F32), (Some(2), DType::F32), (Some(1), DType::F64)] {
        let m = module(32, 4, kv, dtype);
        let x = det(&[3, 4, 32], dtype, 1.0);
        let mem = det(&[3, 9, 32], dtype, 2.0);
        let kpm = Mask::Bool(
            Tensor::new(
                &[[0u8, 0, 0, 0, 0, 0, 0, 1, 1], [0; 9], [0, 0, 1, 1, 1, 1, 1, 1, 1]],
                &dev(),
            )
            .unwrap(),
        );
        let st = m.static_kv(&mem).unwrap();
        assert_eq!(st.k.dims(), &[3 * kv.unwrap_or(4), 9, 8]);
        let want = m.cross_attention(&x, &mem, Some(&kpm)).unwrap();
        for backend in [Backend::Auto, Backend::Composed] {
            let got = with_backend(backend, || m.forward_static(&x, &st, Some(&kpm))).unwrap();
            let err = rel_diff(&got, &want);
            assert!(err <= 1e-6, "{kv:?} {dtype:?} {backend:?}: {err:e}");
        }
        // Wrong static shapes are errors naming the argument.
        let bad = MhaOptions::default().static_kv(st.k.narrow(1, 0, 8).unwrap(), st.v.clone());
        let err = m.forward(&x, &mem, &mem, &bad).unwrap_err().to_string();
        assert!(err.contains("static_v") || err.contains("static_k"), "{err}");
        // A key of another rank: the message names S, not a made-up length.
        let flat = st.k.flatten(1, 2).unwrap();
        let bad = MhaOptions::default().static_kv(flat.clone(), flat);
        let err = m.forward(&x, &mem, &mem, &bad).unwrap_err().to_string();
        let nh = 3 * kv.unwrap_or(4);
        assert!(err.contains(&format!("expected shape ({nh}, S, 8)")), "{err}");
    }
}

#[test]
fn the_cache_gives_the_softmax_of_a_grad_free_forward() {
    // forward_cached runs without a graph even when grad mode is on.
    let m = module(16, 2, None, DType::F32);
    let mut cache = m.new_cache(1, 4).unwrap();
    let x = det(&[1, 2, 16], DType::F32, 1.0);
    let y = m.forward_cached(&x, &mut cache, None).unwrap();
    let z = no_grad(|| {
        let mut c = m.new_cache(1, 4).unwrap();
        m.forward_cached(&x, &mut c, None)
    })
    .unwrap();
    assert_eq!(max_diff(&y, &z), 0.0);
    assert!(!y.track_op());
    let _ = y.sum(D::Minus1).unwrap();
}

/// Sets every variable of `vm` to seeded uniform values: `±√(3/fan_in)` for matrices, `±0.1`
/// around 1 for vectors named `*norm*.weight`, `±0.1` for the other vectors.
fn seed_vars(vm: &VarMap, dtype: DType) {
    let data = vm.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for (i, name) in names.into_iter().enumerate() {
        let var = &data[name];
        let dims = var.dims().to_vec();
        let t = match dims.as_slice() {
            [_, fan_in] => rand_t(&dims, dtype, i as u64 + 5, (3.0 / *fan_in as f64).sqrt()),
            _ if name.contains("norm") && name.ends_with("weight") => {
                (rand_t(&dims, dtype, i as u64 + 5, 0.1) + 1.0).unwrap()
            }
            _ => rand_t(&dims, dtype, i as u64 + 5, 0.1),
        };
        var.set(&t).unwrap();
    }
}

fn transformer(norm_first: bool, dtype: DType) -> (multihead::transformer::Transformer, VarMap) {
    use multihead::transformer::{LayerConfig, Transformer, TransformerConfig};
    let layer = LayerConfig::new(32, 4)
        .with_dim_feedforward(64)
        .with_batch_first(true)
        .with_norm_first(norm_first)
        .with_activation(multihead::Activation::Gelu);
    let cfg = TransformerConfig { layer, num_encoder_layers: 2, num_decoder_layers: 2 };
    let vm = VarMap::new();
    let mut model = Transformer::new(cfg, VarBuilder::from_varmap(&vm, dtype, &dev())).unwrap();
    seed_vars(&vm, dtype);
    model.eval();
    (model, vm)
}

#[test]
fn decoder_steps_equal_the_full_decoder_over_the_prefix() {
    use multihead::transformer::DecoderMasks;
    for norm_first in [false, true] {
        let (model, _vm) = transformer(norm_first, DType::F32);
        let (n, s, steps) = (3, 9, 120);
        let src = rand_t(&[n, s, 32], DType::F32, 1, 1.7);
        let pad = Tensor::new(
            &[[0u8, 0, 0, 0, 0, 0, 0, 1, 1], [0; 9], [0, 0, 0, 1, 1, 1, 1, 1, 1]],
            &dev(),
        )
        .unwrap();
        let kpm = Mask::Bool(pad);
        let memory = model.encode(&src, None, Some(&kpm)).unwrap();
        let tgt = rand_t(&[n, steps, 32], DType::F32, 2, 1.7);
        let mut state = model.start_decoding(&memory, Some(&kpm), steps).unwrap();
        let mut worst = 0.0f64;
        // A prefill of 4 tokens, then one token per step.
        let mut pos = 0;
        while pos < steps {
            let t = if pos == 0 { 4 } else { 1 };
            let out = model.decode_step(&tgt.narrow(1, pos, t).unwrap(), &mut state, None).unwrap();
            pos += t;
            let prefix = tgt.narrow(1, 0, pos).unwrap();
            let mask = generate_square_subsequent_mask(pos, DType::F32, &dev()).unwrap();
            let masks = DecoderMasks {
                tgt_mask: Some(Mask::Float(mask)),
                tgt_is_causal: Some(true),
                memory_key_padding_mask: Some(kpm.clone()),
                ..Default::default()
            };
            let full = no_grad(|| model.decoder().forward(&prefix, &memory, &masks)).unwrap();
            worst = worst.max(rel_diff(&out, &full.narrow(1, pos - t, t).unwrap()));
        }
        assert_eq!(state.positions(), &[steps; 3]);
        assert!(worst <= 1e-6, "norm_first={norm_first}: max diff {worst:e}");
    }
}

#[test]
fn generation_with_the_cache_gives_the_tokens_of_recomputing() {
    use multihead::transformer::{GenerateOptions, Sampling};
    let (model, _vm) = transformer(false, DType::F32);
    let table = rand_t(&[11, 32], DType::F32, 9, 1.7);
    let pos_enc = rand_t(&[64, 32], DType::F32, 10, 0.5);
    let embed = |toks: &[u32], p: usize| -> multihead::Result<Tensor> {
        let e = table.index_select(&Tensor::new(toks, &dev())?, 0)?;
        Ok(e.broadcast_add(&pos_enc.get(p)?)?)
    };
    let logits = |h: &Tensor| -> multihead::Result<Tensor> { Ok(h.matmul(&table.t()?)?) };
    let memory = model.encode(&rand_t(&[3, 7, 32], DType::F32, 3, 1.7), None, None).unwrap();
    for sampling in [Sampling::Greedy, Sampling::Sample { temperature: 0.8, seed: 42 }] {
        let opts = GenerateOptions { max_new_tokens: 40, sampling, eos: Some(10), use_cache: true };
        let cached = model.generate(&memory, None, &[0, 1, 2], &opts, embed, logits).unwrap();
        let again = model.generate(&memory, None, &[0, 1, 2], &opts, embed, logits).unwrap();
        let recomputed = model
            .generate(
                &memory,
                None,
                &[0, 1, 2],
                &GenerateOptions { use_cache: false, ..opts.clone() },
                embed,
                logits,
            )
            .unwrap();
        assert_eq!(cached, recomputed, "{sampling:?}");
        assert_eq!(cached, again, "{sampling:?}: seeded generation is reproducible");
        for row in &cached {
            assert!(row.len() == 40 || row.last() == Some(&10), "{row:?}");
        }
    }
    let bad = GenerateOptions {
        sampling: Sampling::Sample { temperature: 0.0, seed: 1 },
        ..Default::default()
    };
    let err = model.generate(&memory, None, &[0, 1, 2], &bad, embed, logits).unwrap_err();
    assert!(err.to_string().contains("temperature must be positive"), "{err}");
    // Caches for too many tokens: an allocation error that names max_new_tokens.
    let huge = GenerateOptions { max_new_tokens: 1 << 40, ..Default::default() };
    let err = model.generate(&memory, None, &[0, 1, 2], &huge, embed, logits).unwrap_err();
    assert!(matches!(err, Error::Alloc { what: "max_new_tokens", .. }), "{err}");
    assert!(err.to_string().starts_with("Transformer::generate: max_new_tokens: "), "{err}");
    // A memory too large to project keeps its own error (it was renamed max_new_tokens).
    let wide = Tensor::ones((1, 1, 32), DType::F32, &dev()).unwrap();
    let wide = wide.broadcast_as((3, 1 << 36, 32)).unwrap();
    let opts = GenerateOptions { max_new_tokens: 1, ..Default::default() };
    let err = model.generate(&wide, None, &[0, 1, 2], &opts, embed, logits).unwrap_err();
    assert!(matches!(err, Error::Alloc { .. }), "{err}");
    assert!(!err.to_string().contains("max_new_tokens"), "{err}");
    // A closure's own candle error names the closure and the position it failed at.
    let short = rand_t(&[3, 32], DType::F32, 11, 1.0);
    let bad_embed = |toks: &[u32], _p: usize| -> multihead::Result<Tensor> {
        Ok(short.index_select(&Tensor::new(toks, &dev())?, 0)?)
    };
    let opts = GenerateOptions { max_new_tokens: 3, ..Default::default() };
    let err = model.generate(&memory, None, &[0, 1, 7], &opts, bad_embed, logits).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Candle(_)), "{msg}");
    assert!(msg.contains("Transformer::generate: the embed closure failed at position 0"), "{msg}");
}

#[test]
fn empty_and_oversized_caches_are_handled() {
    let m = module(16, 2, None, DType::F32);
    // A cache larger than memory is an allocation error, not an abort.
    let err = m.new_cache(1 << 20, 1 << 30).unwrap_err();
    assert!(matches!(err, Error::Alloc { .. }), "{err}");
    let err = KvCache::new(usize::MAX, 2, 8, 2, DType::F32, &dev()).unwrap_err();
    assert!(matches!(err, Error::Alloc { .. }), "{err}");
    // No new tokens, or no rows: empty outputs, the cache unchanged.
    let mut cache = m.new_cache(2, 4).unwrap();
    let y = m
        .forward_cached(&Tensor::zeros((2, 0, 16), DType::F32, &dev()).unwrap(), &mut cache, None)
        .unwrap();
    assert_eq!((y.dims(), cache.lens()), (&[2, 0, 16][..], &[0, 0][..]));
    let mut none = m.new_cache(0, 4).unwrap();
    let y = m
        .forward_cached(&Tensor::zeros((0, 3, 16), DType::F32, &dev()).unwrap(), &mut none, None)
        .unwrap();
    assert_eq!(y.dims(), &[0, 3, 16]);
    // A capacity of zero takes nothing.
    let mut zero = m.new_cache(1, 0).unwrap();
    let err = m.forward_cached(&det(&[1, 1, 16], DType::F32, 1.0), &mut zero, None).unwrap_err();
    assert!(matches!(err, Error::CacheFull { .. }), "{err}");
    // Unbatched input is a batch of one.
    let mut one = m.new_cache(1, 4).unwrap();
    let x = det(&[3, 16], DType::F32, 2.0);
    let y = m.forward_cached(&x, &mut one, None).unwrap();
    assert_eq!(y.dims(), &[3, 16]);
    let mut other = m.new_cache(1, 4).unwrap();
    let yb = m.forward_cached(&x.unsqueeze(0).unwrap(), &mut other, None).unwrap();
    assert_eq!(max_diff(&y, &yb.squeeze(0).unwrap()), 0.0);
}

#[test]
fn a_grouped_query_module_saves_and_loads_under_its_documented_keys() {
    let m = module(32, 8, Some(2), DType::F32);
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let path = dir.join("gqa.safetensors");
    multihead::state_dict::save_state_dict(&m, &path).unwrap();
    let shapes: std::collections::BTreeMap<String, Vec<usize>> =
        m.named_parameters().into_iter().map(|(k, t)| (k, t.dims().to_vec())).collect();
    let want: std::collections::BTreeMap<String, Vec<usize>> = [
        ("q_proj_weight", vec![32, 32]),
        ("k_proj_weight", vec![8, 32]),
        ("v_proj_weight", vec![8, 32]),
        ("in_proj_bias", vec![48]),
        ("out_proj.weight", vec![32, 32]),
        ("out_proj.bias", vec![32]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(shapes, want);
    let (mut loaded, _vm) =
        multihead::state_dict::load_strict_file(&path, DType::F32, &dev(), |vb| {
            MultiheadAttention::new(
                MhaConfig::new(32, 8).with_num_kv_heads(2).with_batch_first(true),
                vb,
            )
        })
        .unwrap();
    loaded.eval();
    let x = det(&[2, 5, 32], DType::F32, 1.0);
    let (a, b) = (m.self_attention(&x).unwrap(), loaded.self_attention(&x).unwrap());
    assert_eq!(max_diff(&a, &b), 0.0);
    // A plain module does not load it: it has a packed in_proj_weight instead.
    let err = match multihead::state_dict::load_strict_file(&path, DType::F32, &dev(), |vb| {
        MultiheadAttention::new(MhaConfig::new(32, 8), vb)
    }) {
        Ok(_) => panic!("a plain module loaded grouped-query weights"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("missing keys [\"in_proj_weight\"]"), "{err}");
}

#[test]
fn a_bf16_cache_decodes_close_to_the_f32_module() {
    let m32 = module(32, 4, Some(2), DType::F32);
    let vm = VarMap::new();
    let mut cfg = MhaConfig::new(32, 4).with_batch_first(true).with_num_kv_heads(2);
    cfg.dropout = 0.0;
    let mut m16 =
        MultiheadAttention::new(cfg, VarBuilder::from_varmap(&vm, DType::BF16, &dev())).unwrap();
    m16.eval();
    // The bf16 module holds the f32 module's weights, rounded.
    let p32: std::collections::HashMap<String, Tensor> =
        m32.named_parameters().into_iter().collect();
    for (name, var) in vm.data().lock().unwrap().iter() {
        var.set(&p32[name].to_dtype(DType::BF16).unwrap()).unwrap();
    }
    let x = rand_t(&[2, 20, 32], DType::F32, 4, 1.0);
    let (mut c32, mut c16) = (m32.new_cache(2, 20).unwrap(), m16.new_cache(2, 20).unwrap());
    assert_eq!(c16.dtype(), DType::BF16);
    for i in 0..20 {
        let xi = x.narrow(1, i, 1).unwrap();
        let y32 = m32.forward_cached(&xi, &mut c32, None).unwrap();
        let y16 = m16.forward_cached(&xi.to_dtype(DType::BF16).unwrap(), &mut c16, None).unwrap();
        // A few bf16 roundings (2^-8 relative each) of order-one values.
        let err = rel_diff(&y16, &y32);
        assert!(err < 0.05, "step {i}: {err}");
    }
}

/// A bf16 cache takes the fused kernel (read as bf16, widened in registers) and gives the
/// composed path's numbers to a bf16 rounding; the few-rows product of bf16 rows gives the
/// bits of the f32 product of the widened operands, rounded once.
#[test]
fn a_bf16_cache_takes_the_fused_kernel_and_agrees_with_the_composed_path() {
    for kv in [None, Some(2)] {
        let m = module(32, 4, kv, DType::BF16);
        let x = rand_t(&[2, 30, 32], DType::BF16, 9, 1.0);
        let (mut fused, mut composed) = (m.new_cache(2, 30).unwrap(), m.new_cache(2, 30).unwrap());
        let prefill = x.narrow(1, 0, 5).unwrap();
        let plan = m.explain_cached(&prefill, &fused, None).unwrap();
        assert_eq!(plan.path, Path::Fused, "{plan}");
        let step = |cache: &mut multihead::KvCache, xi: &Tensor, lens: Option<&[usize]>| {
            m.forward_cached(xi, cache, lens).unwrap()
        };
        let lens = [5, 3];
        let a = step(&mut fused, &prefill, Some(&lens));
        let b = with_backend(Backend::Composed, || step(&mut composed, &prefill, Some(&lens)));
        assert!(rel_diff(&a, &b) < 2e-2, "prefill {kv:?}: {}", rel_diff(&a, &b));
        for i in 5..30 {
            let xi = x.narrow(1, i, 1).unwrap();
            let a = step(&mut fused, &xi, None);
            let b = with_backend(Backend::Composed, || step(&mut composed, &xi, None));
            assert_eq!(a.dtype(), DType::BF16);
            // Both compute in f32 and round once; the orders of summation differ.
            assert!(rel_diff(&a, &b) < 2e-2, "step {i} {kv:?}: {}", rel_diff(&a, &b));
        }
    }
    // The few-rows product of bf16 rows: the f32 product of the widened operands, rounded.
    let w = rand_t(&[24, 40], DType::BF16, 3, 0.3);
    let b = rand_t(&[24], DType::BF16, 4, 0.3);
    let x = rand_t(&[3, 40], DType::BF16, 5, 1.0);
    let lin16 = multihead::Linear::from_weights(w.clone(), Some(b.clone()));
    let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let lin32 = multihead::Linear::from_weights(wide(&w), Some(wide(&b)));
    let y16 = multihead::no_grad(|| lin16.forward(&x)).unwrap();
    let y32 = multihead::no_grad(|| lin32.forward(&wide(&x))).unwrap();
    let bits = |t: &Tensor| -> Vec<u16> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    assert_eq!(bits(&y16), bits(&y32.to_dtype(DType::BF16).unwrap()));
    // Strided and broadcast bf16 rows, a broadcast bias, and NaN: as the widened product.
    let wide_x = rand_t(&[3, 50], DType::BF16, 6, 1.0);
    let strided = wide_x.narrow(1, 5, 40).unwrap();
    let bcast = rand_t(&[1, 40], DType::BF16, 7, 1.0).broadcast_as((4, 40)).unwrap();
    let mut nan = rand_t(&[2, 40], DType::F32, 8, 1.0).to_vec2::<f32>().unwrap();
    nan[1][7] = f32::NAN;
    let nan = Tensor::new(nan, &dev()).unwrap().to_dtype(DType::BF16).unwrap();
    let b_view = rand_t(&[1, 24], DType::BF16, 9, 0.3).broadcast_as((1, 24)).unwrap();
    let lin16b = multihead::Linear::from_weights(w.clone(), Some(b_view.squeeze(0).unwrap()));
    let lin32b = multihead::Linear::from_weights(wide(&w), Some(wide(&b_view.squeeze(0).unwrap())));
    for x in [&strided, &bcast, &nan] {
        let y16 = multihead::no_grad(|| lin16b.forward(x)).unwrap();
        let y32 = multihead::no_grad(|| lin32b.forward(&wide(x))).unwrap();
        assert_eq!(bits(&y16), bits(&y32.to_dtype(DType::BF16).unwrap()));
    }
    let y = multihead::no_grad(|| lin16b.forward(&nan)).unwrap();
    let y = y.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    assert!(y[0].iter().all(|v| v.is_finite()) && y[1].iter().all(|v| v.is_nan()));
    // Wrong feature size and a dtype that differs from the weight's: the typed errors of
    // every other path.
    let err = multihead::no_grad(|| lin16b.forward(&rand_t(&[2, 39], DType::BF16, 1, 1.0)));
    assert!(matches!(err, Err(Error::Shape { .. })), "{err:?}");
    let err = multihead::no_grad(|| lin16b.forward(&rand_t(&[2, 40], DType::F32, 1, 1.0)));
    assert!(matches!(err, Err(Error::DType { .. })), "{err:?}");
}

#[test]
fn a_bf16_layer_refuses_an_f64_float_mask_and_takes_an_f32_one_as_pytorch_does() {
    use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
    let vm = VarMap::new();
    let cfg = LayerConfig::new(16, 2).with_dim_feedforward(32).with_batch_first(true);
    let layer =
        TransformerEncoderLayer::new(cfg, VarBuilder::from_varmap(&vm, DType::BF16, &dev()))
            .unwrap();
    let x = rand_t(&[2, 5, 16], DType::BF16, 1, 1.0);
    let bad = Mask::Float(Tensor::zeros((5, 5), DType::F64, &dev()).unwrap());
    let err = layer.forward(&x, Some(&bad), None, false).unwrap_err();
    assert!(matches!(err, Error::DType { .. }), "{err}");
    let good = Mask::Float(Tensor::zeros((5, 5), DType::BF16, &dev()).unwrap());
    let y = layer.forward(&x, Some(&good), None, false).unwrap();
    assert_eq!((y.dtype(), y.dims()), (DType::BF16, &[2, 5, 16][..]));
    // The f32 mask of the same values: the same bits (in eval: the layer's dropout is 0.1).
    let mut layer = layer;
    multihead::Train::eval(&mut layer);
    let y = layer.forward(&x, Some(&good), None, false).unwrap();
    let f32_mask = Mask::Float(Tensor::zeros((5, 5), DType::F32, &dev()).unwrap());
    let y32 = layer.forward(&x, Some(&f32_mask), None, false).unwrap();
    let flat = |t: &Tensor| {
        t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    assert_eq!(flat(&y32), flat(&y));
}

#[test]
fn nan_and_broadcast_tokens_behave_alike_on_both_cached_paths() {
    // f32, and bf16 (whose cache the fused kernel reads as bf16).
    for dtype in [DType::F32, DType::BF16] {
        let m = module(16, 4, Some(2), dtype);
        for backend in [Backend::Auto, Backend::Composed] {
            with_backend(backend, || {
                let mut cache = m.new_cache(2, 8).unwrap();
                // A broadcast (stride-0) batch: both rows see the same token.
                let tok = rand_t(&[1, 1, 16], dtype, 3, 1.0).broadcast_as((2, 1, 16)).unwrap();
                let y = m.forward_cached(&tok, &mut cache, None).unwrap();
                let d = max_diff(&y.get(0).unwrap(), &y.get(1).unwrap());
                assert_eq!(d, 0.0, "{dtype:?} {backend:?}");
                // NaN in row 1's next token: row 1 is NaN from then on (its key is cached),
                // row 0 not.
                let mut v = rand_t(&[2, 1, 16], DType::F32, 4, 1.0).to_vec3::<f32>().unwrap();
                v[1][0][5] = f32::NAN;
                let x = Tensor::new(v, &dev()).unwrap().to_dtype(dtype).unwrap();
                for step in 0..3 {
                    let inp = if step == 0 { x.clone() } else { tok.clone() };
                    let y = m.forward_cached(&inp, &mut cache, None).unwrap();
                    let y = y.to_dtype(DType::F32).unwrap().to_vec3::<f32>().unwrap();
                    assert!(y[0][0].iter().all(|x| x.is_finite()), "{dtype:?} {backend:?} {step}");
                    assert!(y[1][0].iter().all(|x| x.is_nan()), "{dtype:?} {backend:?} {step}");
                }
            });
        }
    }
}

/// What the closures return is checked: logits with more rows than sequences panicked (an
/// index out of bounds), fewer rows blamed the cache, a huge broadcast view of logits aborted
/// the process (copied to f64 unchecked), a wrong rank gave candle's bare message, and
/// sampling from all -inf or +inf logits returned token 0.
#[test]
fn generate_checks_what_its_closures_return() {
    use multihead::transformer::{GenerateOptions, Sampling};
    let (model, _vm) = transformer(false, DType::F32);
    let table = rand_t(&[11, 32], DType::F32, 9, 1.7);
    let embed = |toks: &[u32], _p: usize| -> multihead::Result<Tensor> {
        Ok(table.index_select(&Tensor::new(toks, &dev())?, 0)?)
    };
    let memory = model.encode(&rand_t(&[3, 7, 32], DType::F32, 3, 1.7), None, None).unwrap();
    let opts = GenerateOptions { max_new_tokens: 2, ..Default::default() };
    let run = |opts: &GenerateOptions, logits: &dyn Fn(&Tensor) -> multihead::Result<Tensor>| {
        model.generate(&memory, None, &[0, 1, 2], opts, embed, logits).unwrap_err().to_string()
    };
    for rows in [2usize, 4] {
        let err = run(&opts, &|_h| Ok(Tensor::zeros((rows, 11), DType::F32, &dev())?));
        assert!(err.contains("logits") && err.contains("(3, V)"), "{rows} rows: {err}");
    }
    let err = run(&opts, &|_h| Ok(Tensor::zeros(11, DType::F32, &dev())?));
    assert!(err.contains("logits") && err.contains("[11]"), "{err}");
    let err = run(&opts, &|_h| {
        Ok(Tensor::zeros((3, 1), DType::F32, &dev())?.broadcast_as((3, 1usize << 40))?)
    });
    assert!(err.contains("cannot be allocated"), "{err}");
    let sample =
        GenerateOptions { sampling: Sampling::Sample { temperature: 1.0, seed: 3 }, ..opts };
    for fill in [f32::NEG_INFINITY, f32::INFINITY] {
        let err = run(&sample, &|_h| Ok(Tensor::full(fill, (3, 11), &dev())?));
        assert!(err.contains("no distribution to sample from"), "{fill}: {err}");
    }
    let bad_embed = |_t: &[u32], _p: usize| -> multihead::Result<Tensor> {
        Ok(Tensor::zeros((2, 32), DType::F32, &dev())?)
    };
    let logits = |h: &Tensor| -> multihead::Result<Tensor> { Ok(h.matmul(&table.t()?)?) };
    let err = model.generate(&memory, None, &[0, 1, 2], &opts, bad_embed, logits).unwrap_err();
    assert!(err.to_string().contains("embed closure must return (N, E) = (3, E)"), "{err}");
}

/// A memory padding mask of the wrong shape is refused when decoding starts, not at the
/// first step.
#[test]
fn start_decoding_checks_the_memory_padding_mask() {
    let (model, _vm) = transformer(false, DType::F32);
    let memory = model.encode(&rand_t(&[2, 7, 32], DType::F32, 3, 1.7), None, None).unwrap();
    for dims in [(3usize, 7usize), (2, 6)] {
        let kpm = Mask::Bool(Tensor::zeros(dims, DType::U8, &dev()).unwrap());
        let err = model.start_decoding(&memory, Some(&kpm), 4).unwrap_err();
        assert!(
            matches!(err, Error::Shape { arg: "memory_key_padding_mask", .. })
                && err.to_string().contains("[2, 7]"),
            "{dims:?}: {err}"
        );
    }
    let kpm = Mask::Bool(Tensor::zeros((2, 7), DType::U8, &dev()).unwrap());
    assert!(model.start_decoding(&memory, Some(&kpm), 4).is_ok());
    // A float mask of another dtype (it failed only at the first step, named
    // key_padding_mask).
    for dt in [DType::U32, DType::F64] {
        let kpm = Mask::Float(Tensor::zeros((2, 7), dt, &dev()).unwrap());
        let err = model.start_decoding(&memory, Some(&kpm), 4).unwrap_err();
        assert!(matches!(err, Error::DType { arg: "memory_key_padding_mask", .. }), "{err}");
    }
}

/// `append_kv` and the cached forward read strided keys and values in place (a transposed
/// `(N, T, Hkv, D)` tensor, a narrowed one, a last dimension with a stride, a batch
/// broadcast): every view
/// writes exactly the elements its contiguous copy writes, in a plain cache and a ring.
#[test]
fn appended_views_write_what_their_contiguous_copies_write() {
    let (n, hk, t, d) = (2usize, 3usize, 5usize, 4usize);
    let src = rand_t(&[n, t + 2, hk, 2 * d], DType::F32, 7, 1.0);
    // (N, Hk, T, D) views: a transpose of a narrow, and one whose last stride is 2.
    let wide = src.narrow(1, 1, t).unwrap().transpose(1, 2).unwrap(); // (N, Hk, T, 2D)
    let one = rand_t(&[1, hk, t, d], DType::F32, 8, 1.0);
    let views = [
        wide.narrow(3, d, d).unwrap(),
        wide.reshape((n, hk, t, d, 2)).unwrap().narrow(4, 1, 1).unwrap().squeeze(4).unwrap(),
        one.broadcast_as((n, hk, t, d)).unwrap(), // a stride of 0 over the batch
    ];
    for (i, view) in views.iter().enumerate() {
        assert!(!view.is_contiguous(), "view {i} is a view");
        let copy = view.contiguous().unwrap();
        for ring in [false, true] {
            let make = || match ring {
                false => KvCache::new(n, hk, d, 9, DType::F32, &dev()).unwrap(),
                true => KvCache::sliding_window(n, hk, d, 4, DType::F32, &dev()).unwrap(),
            };
            let (mut a, mut b) = (make(), make());
            for counts in [Some(&[2usize, 5][..]), Some(&[3, 0]), None] {
                if !ring && counts.is_none() {
                    continue; // 2 + 3 + 5 tokens would not fit in 9
                }
                a.append_kv(view, view, counts).unwrap();
                b.append_kv(&copy, &copy, counts).unwrap();
            }
            assert_eq!(a.lens(), b.lens());
            // A wrong shape or dtype is a typed error that changes nothing.
            let before = a.lens().to_vec();
            let short = view.narrow(3, 0, d - 1).unwrap();
            let e = a.append_kv(&short, &short, None).unwrap_err();
            assert!(matches!(e, Error::Shape { arg: "k", .. }), "{e}");
            let f64s = view.to_dtype(DType::F64).unwrap();
            let e = a.append_kv(&f64s, &f64s, None).unwrap_err();
            assert!(matches!(e, Error::DType { arg: "k", .. }), "{e}");
            assert_eq!(a.lens(), &before[..]);
            for (x, y) in [(a.keys(), b.keys()), (a.values(), b.values())] {
                let (x, y) = (x.flatten_all().unwrap(), y.flatten_all().unwrap());
                assert_eq!(x.to_vec1::<f32>().unwrap(), y.to_vec1::<f32>().unwrap(), "view {i}");
            }
        }
    }
}

/// `append_kv` with keys of another rank names `T` as a letter: it read "(1, 2, 0, 4)", as if
/// the tokens had to be 0 (an adversarial run).
#[test]
fn append_kv_of_another_rank_names_the_expected_shape() {
    let m = module(8, 2, None, DType::F32);
    let mut cache = m.new_cache(1, 4).unwrap();
    let k = det(&[1, 3, 8], DType::F32, 1.0);
    let err = cache.append_kv(&k, &k, None).unwrap_err().to_string();
    assert!(err.contains("expected (N, Hkv, T, D) = (1, 2, T, 4), got (1, 3, 8)"), "{err}");
    assert_eq!(cache.lens(), &[0]);
}
