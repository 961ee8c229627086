//! The attention variants in incremental decoding through the decoder layers
//! (`TransformerDecoder::forward_step_with`, `Transformer::decode_step_with`): every step equals
//! the decoder's `forward_with` over the whole prefix with the matching options, and bad
//! options are errors that leave the caches unchanged.

use candle_core::{DType, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead::multihead_attention::CachedOptions;
use multihead::transformer::{
    LayerConfig, StepOptions, Transformer, TransformerConfig, TransformerOptions,
};
use multihead::{Error, Mask, MhaOptions, Variants};
use multihead_parity::Tolerance;

use crate::common::{assert_close, det, dev, perturb};

fn model(norm_first: bool, dtype: DType) -> (Transformer, VarMap) {
    let layer = LayerConfig::new(16, 4)
        .with_dim_feedforward(24)
        .with_batch_first(true)
        .with_norm_first(norm_first);
    let cfg = TransformerConfig { layer, num_encoder_layers: 1, num_decoder_layers: 2 };
    let vm = VarMap::new();
    let mut m = Transformer::new(cfg, VarBuilder::from_varmap(&vm, dtype, &dev())).unwrap();
    perturb(&vm, dtype);
    m.eval();
    (m, vm)
}

/// Chunks of 3, then 1, then 2 tokens, ... against `forward_with` over the prefix: soft cap,
/// sinks, ALiBi and a left window in the self-attention, soft cap, sinks and key lengths in
/// the cross-attention, a memory padding mask from `start`; f64 (composed) and f32 (kernels).
#[test]
fn decoding_steps_with_variants_equal_the_decoder_over_the_prefix() {
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 5e-6)] {
        for norm_first in [false, true] {
            let (m, _vm) = model(norm_first, dtype);
            let (n, s, steps) = (2, 9, 13);
            let src = det(&[n, s, 16], dtype, 1.0);
            let kpm =
                Mask::Bool(Tensor::new(&[[0u8; 9], [0, 0, 0, 0, 0, 0, 0, 1, 1]], &dev()).unwrap());
            let memory = m
                .encoder()
                .forward_with(&src, &MhaOptions::default().key_padding_mask(kpm.clone()))
                .unwrap();
            let tgt = det(&[n, steps, 16], dtype, 2.0);
            let sinks =
                Tensor::new(&[0.3f64, -1.0, 0.0, 2.0], &dev()).unwrap().to_dtype(dtype).unwrap();
            let slopes = vec![0.5, 0.25, 0.1, 0.05];
            let step = StepOptions::default()
                .self_attn(
                    CachedOptions::default()
                        .softcap(0.8)
                        .sinks(sinks.clone())
                        .alibi(slopes.clone())
                        .window(4),
                )
                .cross_attn(
                    MhaOptions::default()
                        .variants(Variants::default().softcap(1.5).kv_lengths(vec![9, 6]))
                        .sinks(sinks.clone()),
                );
            let self_full = MhaOptions::default()
                .variants(Variants::default().window(Some(4), Some(0)).softcap(0.8).alibi(slopes))
                .sinks(sinks.clone());
            let cross_full = step.cross_attn.clone().key_padding_mask(kpm.clone());
            let mut state = m.start_decoding(&memory, Some(&kpm), steps).unwrap();
            let (mut pos, mut k) = (0, 0);
            let mut worst = 0f64;
            while pos < steps {
                let t = [3, 1, 2][k % 3].min(steps - pos);
                let out = m
                    .decode_step_with(&tgt.narrow(1, pos, t).unwrap(), &mut state, None, &step)
                    .unwrap();
                pos += t;
                k += 1;
                let prefix = tgt.narrow(1, 0, pos).unwrap();
                let full = multihead::no_grad(|| {
                    m.decoder().forward_with(&prefix, &memory, &self_full, &cross_full)
                })
                .unwrap();
                let want = full.narrow(1, pos - t, t).unwrap();
                let d = (&out - &want).unwrap().abs().unwrap().flatten_all().unwrap();
                let d = d.to_dtype(DType::F64).unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
                worst = worst.max(d);
            }
            assert!(worst <= tol, "{dtype:?} norm_first={norm_first}: max diff {worst:e}");
            // The variants changed the numbers (a dropped option would not be seen otherwise).
            let mut plain = m.start_decoding(&memory, Some(&kpm), steps).unwrap();
            let a = m.decode_step(&tgt, &mut plain, None).unwrap();
            let mut with = m.start_decoding(&memory, Some(&kpm), steps).unwrap();
            let b = m.decode_step_with(&tgt, &mut with, None, &step).unwrap();
            let d = (&a - &b).unwrap().abs().unwrap().flatten_all().unwrap();
            let d = d.to_dtype(DType::F64).unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
            assert!(d > 1e-3, "the step's variants had no effect");
        }
    }
}

/// The model's `forward_with` and its steps agree too (the decoder's part of the options).
#[test]
fn transformer_forward_with_and_decode_step_with_agree() {
    let (m, _vm) = model(false, DType::F64);
    let (src, tgt) = (det(&[2, 7, 16], DType::F64, 3.0), det(&[2, 6, 16], DType::F64, 4.0));
    let enc = MhaOptions::default().variants(Variants::default().alibi(vec![0.2; 4]));
    let opts = TransformerOptions::default()
        .encoder(enc.clone())
        .decoder_self(MhaOptions::default().softcap(0.9).window(Some(2), Some(0)))
        .decoder_cross(MhaOptions::default().softcap(0.6));
    let full = multihead::no_grad(|| m.forward_with(&src, &tgt, &opts)).unwrap();
    let memory = m.encoder().forward_with(&src, &enc).unwrap();
    let mut state = m.start_decoding(&memory, None, 6).unwrap();
    let step = StepOptions::default()
        .self_attn(CachedOptions::default().softcap(0.9).window(2))
        .cross_attn(MhaOptions::default().softcap(0.6));
    let rows: Vec<Tensor> = (0..6)
        .map(|t| {
            m.decode_step_with(&tgt.narrow(1, t, 1).unwrap(), &mut state, None, &step).unwrap()
        })
        .collect();
    assert_close(&Tensor::cat(&rows, 1).unwrap(), &full, Tolerance::F64, "stepped");
}

/// Options a step cannot honour, and options that are wrong for the shapes, are errors naming
/// them, and no layer's cache changes.
#[test]
fn bad_step_options_are_errors_before_any_cache_changes() {
    let (m, _vm) = model(false, DType::F32);
    let memory = det(&[2, 5, 16], DType::F32, 1.0);
    let x = det(&[2, 1, 16], DType::F32, 2.0);
    let mut state = m.start_decoding(&memory, None, 4).unwrap();
    m.decode_step(&x, &mut state, None).unwrap();
    let mask = Mask::Bool(Tensor::zeros((1, 5), DType::U8, &dev()).unwrap());
    let refused = [
        (MhaOptions::default().attn_mask(mask.clone()), "attn_mask"),
        (
            MhaOptions::default()
                .key_padding_mask(Mask::Bool(Tensor::zeros((2, 5), DType::U8, &dev()).unwrap())),
            "start()",
        ),
        (MhaOptions::default().window(Some(2), None), "variants.window"),
        (MhaOptions::default().alibi(vec![0.1; 4]), "variants.alibi_slopes"),
        (MhaOptions::default().is_causal(true), "is_causal"),
    ];
    for (cross, name) in refused {
        let o = StepOptions::default().cross_attn(cross);
        let e = m.decode_step_with(&x, &mut state, None, &o).unwrap_err();
        assert!(matches!(&e, Error::Config { arg: "cross_attn", .. }), "{e}");
        assert!(e.to_string().contains(name), "{name}: {e}");
    }
    // Shaped wrong: sinks of 3 heads, key lengths of 3 rows, a negative soft cap.
    let bad_sinks = Tensor::zeros(3, DType::F32, &dev()).unwrap();
    let wrong = [
        StepOptions::default().cross_attn(MhaOptions::default().sinks(bad_sinks.clone())),
        StepOptions::default().cross_attn(
            MhaOptions::default().variants(Variants::default().kv_lengths(vec![5, 5, 5])),
        ),
        StepOptions::default().cross_attn(MhaOptions::default().softcap(-1.0)),
        StepOptions::default().self_attn(CachedOptions::default().sinks(bad_sinks)),
        StepOptions::default().self_attn(CachedOptions::default().alibi(vec![0.1; 3])),
    ];
    for o in wrong {
        let e = m.decode_step_with(&x, &mut state, None, &o).unwrap_err();
        assert!(matches!(&e, Error::Shape { .. } | Error::Config { .. }), "{e}");
    }
    assert_eq!(state.positions(), &[1, 1], "a refused step changed a cache");
    for c in state.caches() {
        assert_eq!(c.positions(), &[1, 1]);
    }
}

/// `generate_with`: the cached steps with the variants give the tokens of recomputing the
/// prefix with `StepOptions::prefix_options`, greedy and sampled, and the variants change
/// what is generated.
#[test]
fn generation_with_variants_gives_the_tokens_of_recomputing() {
    use multihead::transformer::{GenerateOptions, Sampling};
    let (m, _vm) = model(true, DType::F32);
    let table = det(&[9, 16], DType::F32, 5.0);
    let embed = |toks: &[u32], p: usize| -> multihead::Result<Tensor> {
        let e = table.index_select(&Tensor::new(toks, &dev())?, 0)?;
        Ok((e + 0.1 * p as f64)?)
    };
    let logits = |h: &Tensor| -> multihead::Result<Tensor> { Ok((h.matmul(&table.t()?)? * 4.0)?) };
    let src = det(&[2, 6, 16], DType::F32, 6.0);
    let memory = m.encoder().forward_with(&src, &MhaOptions::default()).unwrap();
    let sinks = Tensor::new(&[0.5f32, -0.5, 1.0, 0.0], &dev()).unwrap();
    let step = StepOptions::default()
        .self_attn(
            CachedOptions::default()
                .softcap(0.7)
                .window(3)
                .alibi(vec![0.3, 0.2, 0.1, 0.05])
                .sinks(sinks),
        )
        .cross_attn(MhaOptions::default().softcap(0.9));
    let mut any_change = false;
    for sampling in [Sampling::Greedy, Sampling::Sample { temperature: 0.9, seed: 7 }] {
        let opts = GenerateOptions { max_new_tokens: 24, sampling, eos: None, use_cache: true };
        let cached =
            m.generate_with(&memory, None, &[0, 1], (&opts, &step), embed, logits).unwrap();
        let no_cache = GenerateOptions { use_cache: false, ..opts.clone() };
        let recomputed =
            m.generate_with(&memory, None, &[0, 1], (&no_cache, &step), embed, logits).unwrap();
        assert_eq!(cached, recomputed, "{sampling:?}");
        assert_eq!(cached[0].len(), 24);
        let plain = m.generate(&memory, None, &[0, 1], &opts, embed, logits).unwrap();
        any_change |= plain != cached;
    }
    assert!(any_change, "the variants did not change a single token");
}

/// `generate_with` refuses what a step refuses whether or not it uses the cache, and an f64
/// model given f32 sinks (which the cached steps take) generates the same tokens both ways.
#[test]
fn generation_refuses_step_options_and_takes_sinks_of_any_dtype_both_ways() {
    use multihead::transformer::GenerateOptions;
    let (m, _vm) = model(false, DType::F64);
    let table = det(&[7, 16], DType::F64, 8.0);
    let embed = |toks: &[u32], _p: usize| -> multihead::Result<Tensor> {
        Ok(table.index_select(&Tensor::new(toks, &dev())?, 0)?)
    };
    let logits = |h: &Tensor| -> multihead::Result<Tensor> { Ok((h.matmul(&table.t()?)? * 3.0)?) };
    let memory = m
        .encoder()
        .forward_with(&det(&[2, 5, 16], DType::F64, 9.0), &MhaOptions::default())
        .unwrap();
    let mask = Mask::Bool(Tensor::zeros((1, 5), DType::U8, &dev()).unwrap());
    let bad = StepOptions::default().cross_attn(MhaOptions::default().attn_mask(mask));
    for use_cache in [true, false] {
        let opts = GenerateOptions { max_new_tokens: 3, use_cache, ..Default::default() };
        let e = m.generate_with(&memory, None, &[0, 1], (&opts, &bad), embed, logits).unwrap_err();
        assert!(
            matches!(&e, Error::Config { arg: "cross_attn", .. }),
            "use_cache={use_cache}: {e}"
        );
    }
    let sinks = Tensor::new(&[0.25f32, -0.5, 1.5, 0.0], &dev()).unwrap();
    let step = StepOptions::default().self_attn(CachedOptions::default().sinks(sinks).softcap(0.8));
    let run = |use_cache| {
        let opts = GenerateOptions { max_new_tokens: 12, use_cache, ..Default::default() };
        m.generate_with(&memory, None, &[0, 1], (&opts, &step), embed, logits).unwrap()
    };
    assert_eq!(run(true), run(false));
}
