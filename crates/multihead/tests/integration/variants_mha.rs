//! The attention variants through `MultiheadAttention`: fused against composed (outputs,
//! weights, and the gradients of the input and every parameter), a window equal to the
//! explicit band mask PyTorch users would pass, and bad combinations as errors.

use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use multihead::functional::MhaOptions;
use multihead::random::DropoutKey;
use multihead::{Backend, CausalAlign, Error, Mask, MhaConfig, Variants};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, mha, var};

/// Output, weights, and the gradients of the input and of every parameter of `sum(out ∘ g)`.
fn run(cfg: MhaConfig, x: &Var, opts: &MhaOptions) -> (Tensor, Option<Tensor>, Vec<Tensor>) {
    let (mut m, vm): (_, VarMap) = mha(cfg, DType::F32);
    m.train(true);
    let xt = x.as_tensor();
    let out = m.forward(xt, xt, xt, opts).expect("mha");
    let g = det(out.output.dims(), DType::F32, 4.0);
    let grads = out.output.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let mut gs = vec![grads.get(xt).expect("dx").clone()];
    let data = vm.data().lock().unwrap();
    let mut names: Vec<_> = data.keys().cloned().collect();
    names.sort();
    for n in names {
        gs.push(grads.get(data[&n].as_tensor()).expect("param grad").clone());
    }
    (out.output, out.attn_weights, gs)
}

fn compare(cfg: MhaConfig, shape: &[usize], opts: MhaOptions, what: &str) {
    let x = var(&det(shape, DType::F32, 1.0));
    let (a, wa, ga) = run(cfg.clone(), &x, &opts.clone().backend(Backend::Fused));
    let (b, wb, gb) = run(cfg, &x, &opts.backend(Backend::Composed));
    assert_close(&a, &b, Tolerance::F32_FORWARD, &format!("{what}: output"));
    if let (Some(wa), Some(wb)) = (wa, wb) {
        assert_close(&wa, &wb, Tolerance::F32_FORWARD, &format!("{what}: weights"));
    }
    assert_eq!(ga.len(), gb.len());
    for (i, (x, y)) in ga.iter().zip(&gb).enumerate() {
        assert_close(x, y, Tolerance::F32_GRAD, &format!("{what}: gradient {i}"));
    }
}

#[test]
fn mha_variants_match_between_paths() {
    let cfg = MhaConfig::new(32, 4).with_batch_first(true);
    let o = || MhaOptions::default().need_weights(false);
    let shape = [2, 40, 32];
    compare(cfg.clone(), &shape, o().softcap(0.7), "softcap");
    compare(cfg.clone(), &shape, o().window(Some(5), Some(2)), "window");
    compare(cfg.clone(), &shape, o().alibi(Variants::alibi_slopes_for(4)), "alibi");
    let pad: Vec<u8> = (0..80).map(|i| u8::from(i % 40 >= 33 && i >= 40)).collect();
    let pad = Mask::Bool(Tensor::from_vec(pad, (2, 40), &candle_core::Device::Cpu).unwrap());
    let all = Variants::default()
        .window(Some(9), None)
        .softcap(1.3)
        .alibi(vec![0.3, 0.1, 0.05, -0.02])
        .kv_lengths(vec![40, 31]);
    compare(cfg.clone(), &shape, o().variants(all.clone()).key_padding_mask(pad), "all + kpm");
    let causal = Mask::Float(det(&[40, 40], DType::F32, 5.0));
    let hint = o().variants(all.clone()).attn_mask(causal).is_causal(true);
    compare(cfg.clone(), &shape, hint, "causal hint");
    // With the weights, with dropout (training), and grouped-query heads, sequence-first.
    let w = MhaOptions::default().variants(all.clone()).average_attn_weights(false);
    let drop = cfg.clone().with_dropout(0.2);
    compare(
        drop,
        &shape,
        o().variants(all.clone()).dropout_key(DropoutKey { seed: 1, offset: 0 }),
        "dropout",
    );
    let gqa = MhaConfig::new(32, 4).with_num_kv_heads(2);
    compare(gqa, &[40, 2, 32], o().variants(all.align(CausalAlign::BottomRight)), "gqa");
    let x = det(&shape, DType::F32, 1.0);
    let (m, _vm) = mha(cfg, DType::F32);
    // The fused weights carry no gradient: under no_grad.
    let fwd = |o: &MhaOptions| multihead::no_grad(|| m.forward(&x, &x, &x, o)).unwrap();
    let fused = fwd(&w.clone().backend(Backend::Fused));
    let composed = fwd(&w.backend(Backend::Composed));
    let (a, b) = (fused.attn_weights.unwrap(), composed.attn_weights.unwrap());
    assert_eq!(a.dims(), &[2, 4, 40, 40]);
    assert_close(&a, &b, Tolerance::F32_FORWARD, "per-head weights");
}

/// A causal sliding window is the band mask a PyTorch user passes as `attn_mask`.
#[test]
fn a_window_is_the_explicit_band_mask() {
    let cfg = MhaConfig::new(16, 2);
    let (m, _vm) = mha(cfg, DType::F32);
    let x = det(&[12, 3, 16], DType::F32, 2.0);
    let (l, w) = (12usize, 3usize);
    let band: Vec<f32> = (0..l * l)
        .map(|x| {
            let (i, j) = (x / l, x % l);
            if j > i || i - j > w {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let band = Mask::Float(Tensor::from_vec(band, (l, l), &candle_core::Device::Cpu).unwrap());
    for backend in [Backend::Fused, Backend::Composed] {
        let o = MhaOptions::default().backend(backend);
        let fwd = |o: &MhaOptions| multihead::no_grad(|| m.forward(&x, &x, &x, o)).unwrap();
        let a = fwd(&o.clone().window(Some(w), Some(0)));
        let b = fwd(&o.attn_mask(band.clone()));
        assert_close(&a.output, &b.output, Tolerance::F32_FORWARD, "output");
        let (wa, wb) = (a.attn_weights.unwrap(), b.attn_weights.unwrap());
        assert_close(&wa, &wb, Tolerance::F32_FORWARD, "weights");
    }
}

#[test]
fn mha_variants_reject_bad_combinations() {
    let x = det(&[5, 2, 8], DType::F32, 1.0);
    for backend in [Backend::Fused, Backend::Composed] {
        let o = || MhaOptions::default().backend(backend);
        let (kv, _vm) = mha(MhaConfig::new(8, 2).with_add_bias_kv(true), DType::F32);
        let e = kv.forward(&x, &x, &x, &o().softcap(1.0)).map(|_| ()).unwrap_err();
        assert!(matches!(e, Error::Config { arg: "variants", .. }), "{e}");
        let (m, _vm) = mha(MhaConfig::new(8, 2), DType::F32);
        let e = m.forward(&x, &x, &x, &o().alibi(vec![1.0])).map(|_| ()).unwrap_err();
        assert!(matches!(e, Error::Config { arg: "alibi_slopes", .. }), "{e}");
        let lens = Variants::default().kv_lengths(vec![5, 6]);
        let e = m.forward(&x, &x, &x, &o().variants(lens)).map(|_| ()).unwrap_err();
        assert!(matches!(e, Error::Config { arg: "kv_lengths", .. }), "{e}");
        assert!(e.to_string().contains("multi_head_attention_forward"), "{e}");
    }
}

/// `forward_cached_with`: a soft cap step by step equals the full forward with the cap and a
/// causal mask over the prefix; with sinks too, the decode kernel (f32) equals the composed
/// path (the same module in f64), token by token and in chunks.
#[test]
fn cached_decoding_takes_the_softcap_and_sinks() {
    use multihead::multihead_attention::CachedOptions;
    let cfg = MhaConfig::new(16, 4).with_num_kv_heads(2);
    let (mut m32, _v32) = mha(cfg.clone(), DType::F32);
    let (mut m64, _v64) = mha(cfg, DType::F64);
    m32.eval();
    m64.eval();
    let x = det(&[9, 2, 16], DType::F32, 3.0); // (T, N, E)
    let sinks = Tensor::new(&[0.3f32, -1.0, 2.0, f32::NEG_INFINITY], x.device()).unwrap();
    // The soft cap alone against the full forward over the prefix.
    let cap = CachedOptions::default().softcap(0.9);
    let mut cache = m32.new_cache(2, 16).unwrap();
    let mut steps = Vec::new();
    for (from, n) in [(0, 4), (4, 1), (5, 4)] {
        steps.push(
            m32.forward_cached_with(&x.narrow(0, from, n).unwrap(), &mut cache, None, &cap)
                .unwrap(),
        );
    }
    let stepped = Tensor::cat(&steps, 0).unwrap();
    let mask = multihead::generate_square_subsequent_mask(9, DType::F32, x.device()).unwrap();
    let full = MhaOptions::default().need_weights(false).attn_mask(Mask::Float(mask)).softcap(0.9);
    let want = m32.forward(&x, &x, &x, &full).unwrap().output;
    assert_close(&stepped, &want, Tolerance::F32_FORWARD, "soft cap, stepped vs full");
    // Cap and sinks: the fused decode kernel (f32) against the composed path (f64).
    let both = CachedOptions::default().softcap(0.9).sinks(sinks.clone());
    let both64 = CachedOptions::default().softcap(0.9).sinks(sinks.to_dtype(DType::F64).unwrap());
    let (mut c32, mut c64) = (m32.new_cache(2, 16).unwrap(), m64.new_cache(2, 16).unwrap());
    let x64 = x.to_dtype(DType::F64).unwrap();
    let lens = [2usize, 1];
    for (from, n) in [(0, 3), (3, 1), (4, 5)] {
        let l = (n == 3).then_some(&lens[..]);
        let a =
            m32.forward_cached_with(&x.narrow(0, from, n).unwrap(), &mut c32, l, &both).unwrap();
        let b = m64
            .forward_cached_with(&x64.narrow(0, from, n).unwrap(), &mut c64, l, &both64)
            .unwrap();
        let b = b.to_dtype(DType::F32).unwrap();
        assert_close(&a, &b, Tolerance::F32_FORWARD, "cap + sinks, fused vs composed");
    }
    // The sinks change the result; bad options are errors naming them.
    let mut c = m32.new_cache(2, 16).unwrap();
    let plain = m32.forward_cached(&x, &mut c, None).unwrap();
    let mut c = m32.new_cache(2, 16).unwrap();
    let sunk =
        m32.forward_cached_with(&x, &mut c, None, &CachedOptions::default().sinks(sinks)).unwrap();
    let diff =
        (plain - sunk).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(diff > 1e-3, "sinks had no effect");
    let mut c = m32.new_cache(2, 16).unwrap();
    let bad = CachedOptions::default().softcap(-1.0);
    let e = m32.forward_cached_with(&x, &mut c, None, &bad).map(|_| ()).unwrap_err();
    assert!(matches!(e, Error::Config { arg: "softcap", .. }), "{e}");
    let bad = CachedOptions::default().sinks(det(&[3], DType::F32, 1.0));
    let e = m32.forward_cached_with(&x, &mut c, None, &bad).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("sinks"), "{e}");
    assert_eq!(c.lens(), &[0, 0], "a refused call leaves the cache unchanged");
}

/// `forward_cached_with` with ALiBi (BLOOM, MPT decoding): step by step, in chunks of several
/// tokens, equals the full forward with the slopes and a causal mask over the prefix; the
/// decode kernel (f32) equals the composed path (f64) with padded rows; bad slopes and a
/// sliding cache are refused before the cache changes.
#[test]
fn cached_decoding_takes_alibi() {
    use multihead::multihead_attention::CachedOptions;
    let cfg = MhaConfig::new(16, 4).with_num_kv_heads(2);
    let (mut m32, _v32) = mha(cfg.clone(), DType::F32);
    let (mut m64, _v64) = mha(cfg, DType::F64);
    m32.eval();
    m64.eval();
    let x = det(&[11, 2, 16], DType::F32, 5.0); // (T, N, E)
    let slopes = Variants::alibi_slopes_for(4).into_iter().map(|m| m * 4.0).collect::<Vec<_>>();
    let opts = CachedOptions::default().alibi(slopes.clone());
    let mut cache = m32.new_cache(2, 16).unwrap();
    let mut steps = Vec::new();
    for (from, n) in [(0, 5), (5, 1), (6, 1), (7, 4)] {
        let xs = x.narrow(0, from, n).unwrap();
        steps.push(m32.forward_cached_with(&xs, &mut cache, None, &opts).unwrap());
    }
    let stepped = Tensor::cat(&steps, 0).unwrap();
    let mask = multihead::generate_square_subsequent_mask(11, DType::F32, x.device()).unwrap();
    let full = MhaOptions::default().need_weights(false).attn_mask(Mask::Float(mask));
    let want = m32.forward(&x, &x, &x, &full.clone().alibi(slopes.clone())).unwrap().output;
    assert_close(&stepped, &want, Tolerance::F32_FORWARD, "ALiBi, stepped vs full");
    let plain = m32.forward(&x, &x, &x, &full).unwrap().output;
    let diff = (plain - &stepped).unwrap().abs().unwrap().max_all().unwrap();
    assert!(diff.to_scalar::<f32>().unwrap() > 1e-3, "ALiBi had no effect");
    // With a soft cap and padded rows: the decode kernel (f32) against the composed path (f64).
    let both = opts.clone().softcap(1.2);
    let (mut c32, mut c64) = (m32.new_cache(2, 16).unwrap(), m64.new_cache(2, 16).unwrap());
    let x64 = x.to_dtype(DType::F64).unwrap();
    let lens = [3usize, 1];
    for (from, n) in [(0, 3), (3, 1), (4, 7)] {
        let l = (n == 3).then_some(&lens[..]);
        let a =
            m32.forward_cached_with(&x.narrow(0, from, n).unwrap(), &mut c32, l, &both).unwrap();
        let b =
            m64.forward_cached_with(&x64.narrow(0, from, n).unwrap(), &mut c64, l, &both).unwrap();
        let b = b.to_dtype(DType::F32).unwrap();
        assert_close(&a, &b, Tolerance::F32_FORWARD, "ALiBi + cap, fused vs composed");
    }
    // f64 (the composed path): slopes f32 cannot hold, equal to the full forward to 1e-10.
    let odd = vec![0.3, 0.7, 0.11, 1.3];
    let mut c64 = m64.new_cache(2, 16).unwrap();
    let o64 = CachedOptions::default().alibi(odd.clone());
    let steps: Vec<Tensor> = [(0, 5), (5, 6)]
        .iter()
        .map(|&(from, n)| {
            m64.forward_cached_with(&x64.narrow(0, from, n).unwrap(), &mut c64, None, &o64).unwrap()
        })
        .collect();
    let mask64 = multihead::generate_square_subsequent_mask(11, DType::F64, x.device()).unwrap();
    let full64 =
        MhaOptions::default().need_weights(false).attn_mask(Mask::Float(mask64)).alibi(odd);
    let want64 = m64.forward(&x64, &x64, &x64, &full64).unwrap().output;
    let got64 = Tensor::cat(&steps, 0).unwrap();
    assert_close(&got64, &want64, Tolerance::F64, "ALiBi in f64, stepped vs full");
    let mut c = m32.new_cache(2, 16).unwrap();
    for bad in [vec![0.5; 3], vec![0.5, f64::NAN, 0.1, 0.2], vec![1e300; 4]] {
        let e = m32.forward_cached_with(&x, &mut c, None, &CachedOptions::default().alibi(bad));
        let e = e.map(|_| ()).unwrap_err();
        assert!(matches!(e, Error::Config { arg: "alibi_slopes", .. }), "{e}");
    }
    assert_eq!(c.lens(), &[0, 0], "a refused call leaves the cache unchanged");
    let mut ring = m32.new_sliding_cache(2, 4).unwrap();
    let e = m32.forward_cached_with(&x, &mut ring, None, &opts).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("sliding cache"), "{e}");
}

/// `forward_cached_with` with a left window over a full cache: decoded in chunks, it equals
/// the full forward with the causal window, and a sliding cache of `left + 1` decoded token
/// by token; the decode kernel (f32) equals the composed path (f64) with padded rows, ALiBi
/// and a cap; a window with a sliding cache is refused.
#[test]
fn cached_decoding_takes_a_window_over_a_full_cache() {
    use multihead::multihead_attention::CachedOptions;
    let cfg = MhaConfig::new(16, 4).with_num_kv_heads(2);
    let (mut m32, _v32) = mha(cfg.clone(), DType::F32);
    let (mut m64, _v64) = mha(cfg, DType::F64);
    m32.eval();
    m64.eval();
    let x = det(&[13, 2, 16], DType::F32, 6.0); // (T, N, E)
    let left = 3usize;
    let opts = CachedOptions::default().window(left);
    let chunks = [(0, 6), (6, 1), (7, 6)];
    let mut cache = m32.new_cache(2, 16).unwrap();
    let stepped: Vec<Tensor> = chunks
        .iter()
        .map(|&(from, n)| {
            m32.forward_cached_with(&x.narrow(0, from, n).unwrap(), &mut cache, None, &opts)
                .unwrap()
        })
        .collect();
    let stepped = Tensor::cat(&stepped, 0).unwrap();
    let full = MhaOptions::default().need_weights(false).window(Some(left), Some(0));
    let want = m32.forward(&x, &x, &x, &full).unwrap().output;
    assert_close(&stepped, &want, Tolerance::F32_FORWARD, "window, chunks vs full");
    let mut ring = m32.new_sliding_cache(2, left + 1).unwrap();
    let one: Vec<Tensor> = (0..13)
        .map(|i| m32.forward_cached(&x.narrow(0, i, 1).unwrap(), &mut ring, None).unwrap())
        .collect();
    let one = Tensor::cat(&one, 0).unwrap();
    assert_close(&stepped, &one, Tolerance::F32_FORWARD, "window vs the sliding cache");
    // Fused (f32) against composed (f64), with padded rows, ALiBi and a cap.
    let more = opts.clone().alibi(vec![0.5, 0.25, 0.125, 0.0625]).softcap(2.0);
    let (mut c32, mut c64) = (m32.new_cache(2, 16).unwrap(), m64.new_cache(2, 16).unwrap());
    let x64 = x.to_dtype(DType::F64).unwrap();
    let lens = [6usize, 2];
    for &(from, n) in &chunks {
        let l = (n == 6 && from == 0).then_some(&lens[..]);
        let a =
            m32.forward_cached_with(&x.narrow(0, from, n).unwrap(), &mut c32, l, &more).unwrap();
        let b =
            m64.forward_cached_with(&x64.narrow(0, from, n).unwrap(), &mut c64, l, &more).unwrap();
        let b = b.to_dtype(DType::F32).unwrap();
        assert_close(&a, &b, Tolerance::F32_FORWARD, "window + ALiBi + cap, fused vs composed");
    }
    let mut ring = m32.new_sliding_cache(2, 4).unwrap();
    let e = m32.forward_cached_with(&x, &mut ring, None, &opts).map(|_| ()).unwrap_err();
    assert!(matches!(e, Error::Config { arg: "window", .. }), "{e}");
    assert_eq!(ring.lens(), &[0, 0], "a refused call leaves the cache unchanged");
}

/// Sinks through `MultiheadAttention::forward`: fused against composed (output, per-head
/// weights under no_grad, and the gradients of the input, the sinks and every parameter), and
/// the cached decode with sinks equals the full forward with them over the prefix.
#[test]
fn mha_sinks_match_between_paths_and_the_cache() {
    use multihead::multihead_attention::CachedOptions;
    let cfg = MhaConfig::new(16, 4);
    let x = det(&[7, 2, 16], DType::F32, 2.0);
    let (mut m, vm) = mha(cfg, DType::F32);
    m.eval();
    let sink_vals = Tensor::new(&[0.4f32, -0.7, 1.9, 0.0], x.device()).unwrap();
    let run = |backend| {
        let (xv, sv) = (var(&x), var(&sink_vals));
        let o = MhaOptions::default().need_weights(false).sinks(sv.as_tensor().clone());
        let xt = xv.as_tensor();
        let y = m.forward(xt, xt, xt, &o.backend(backend)).unwrap().output;
        let g = det(y.dims(), DType::F32, 5.0);
        let store = y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
        let data = vm.data().lock().unwrap();
        let mut names: Vec<_> = data.keys().cloned().collect();
        names.sort();
        let mut out = vec![
            y.clone(),
            store.get(xt).unwrap().clone(),
            store.get(sv.as_tensor()).unwrap().clone(),
        ];
        out.extend(names.iter().map(|n| store.get(data[n].as_tensor()).unwrap().clone()));
        out
    };
    let (a, b) = (run(Backend::Fused), run(Backend::Composed));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_close(x, y, Tolerance::F32_GRAD, &format!("sinks, tensor {i}"));
    }
    let w = MhaOptions::default().sinks(sink_vals.clone()).average_attn_weights(false);
    let fwd = |o: MhaOptions| multihead::no_grad(|| m.forward(&x, &x, &x, &o)).unwrap();
    let (wf, wc) = (fwd(w.clone().backend(Backend::Fused)), fwd(w.backend(Backend::Composed)));
    assert_close(
        &wf.attn_weights.unwrap(),
        &wc.attn_weights.unwrap(),
        Tolerance::F32_FORWARD,
        "weights",
    );
    // Cached decoding with the sinks equals the full causal forward with them.
    let mut cache = m.new_cache(2, 8).unwrap();
    let opts = CachedOptions::default().sinks(sink_vals.clone());
    let steps: Vec<Tensor> = [(0, 3), (3, 1), (4, 3)]
        .iter()
        .map(|&(f, n)| {
            m.forward_cached_with(&x.narrow(0, f, n).unwrap(), &mut cache, None, &opts).unwrap()
        })
        .collect();
    let mask = multihead::generate_square_subsequent_mask(7, DType::F32, x.device()).unwrap();
    let full =
        MhaOptions::default().need_weights(false).attn_mask(Mask::Float(mask)).sinks(sink_vals);
    let want = m.forward(&x, &x, &x, &full).unwrap().output;
    assert_close(&Tensor::cat(&steps, 0).unwrap(), &want, Tolerance::F32_FORWARD, "cached vs full");
    // A wrong shape or dtype is an error naming the sinks.
    for bad in [det(&[3], DType::F32, 1.0), det(&[4], DType::F64, 1.0)] {
        let e = m.forward(&x, &x, &x, &MhaOptions::default().sinks(bad)).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("sinks"), "{e}");
    }
}
