//! Fuzzing: random (valid and invalid) Linear and MultiheadAttention calls, with strided,
//! broadcast and transposed views, wrong dtypes, masks of every kind and shape, and NaN/Inf
//! values; and byte-level corruptions of safetensors files and `case.json`.
//!
//! The invariant: a typed error, or a result equal to the composed reference (the same NaN
//! positions, the finite values within tolerance); never a panic, an abort or a hang. The
//! fused (`Auto`) and the composed path must agree on which calls they reject and with which
//! message.
//!
//! CI runs `MULTIHEAD_FUZZ_CASES` cases per property (default 200); before a release run
//! 20,000 or more: `MULTIHEAD_FUZZ_CASES=20000 cargo test --release -p multihead fuzz`.

use candle_core::{DType, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead::{
    no_grad, with_backend, Backend, Linear, Mask, MhaConfig, MhaOptions, MultiheadAttention,
};
use proptest::prelude::*;

use crate::common::{det, dev};

fn cases() -> u32 {
    std::env::var("MULTIHEAD_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(200)
}

fn config() -> ProptestConfig {
    ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() }
}

/// How a tensor argument is presented.
#[derive(Clone, Copy, Debug)]
enum View {
    /// Contiguous.
    Plain,
    /// A narrow of a wider tensor (non-contiguous rows).
    Narrowed,
    /// Built transposed and transposed back (swapped strides).
    Transposed,
    /// A stride-0 broadcast of a smaller tensor along the first dimension.
    Broadcast,
}

fn view() -> impl Strategy<Value = View> {
    prop_oneof![4 => Just(View::Plain), 1 => Just(View::Narrowed), 1 => Just(View::Transposed), 1 => Just(View::Broadcast)]
}

/// A special value written at one position.
#[derive(Clone, Copy, Debug)]
enum Poison {
    None,
    Nan(usize),
    PosInf(usize),
    NegInf(usize),
}

fn poison() -> impl Strategy<Value = Poison> {
    prop_oneof![
        8 => Just(Poison::None),
        1 => any::<usize>().prop_map(Poison::Nan),
        1 => any::<usize>().prop_map(Poison::PosInf),
        1 => any::<usize>().prop_map(Poison::NegInf),
    ]
}

/// A deterministic tensor of `shape` and `dtype`, presented as `view`, with `poison`.
fn make(shape: &[usize], dtype: DType, salt: f64, v: View, p: Poison) -> Tensor {
    let n: usize = shape.iter().product();
    let mut data = det(&[n.max(1)], DType::F64, salt).to_vec1::<f64>().unwrap_or_default();
    data.truncate(n);
    match p {
        Poison::Nan(i) if n > 0 => data[i % n] = f64::NAN,
        Poison::PosInf(i) if n > 0 => data[i % n] = f64::INFINITY,
        Poison::NegInf(i) if n > 0 => data[i % n] = f64::NEG_INFINITY,
        _ => {}
    }
    let t = Tensor::from_vec(data, shape, &dev()).and_then(|t| t.to_dtype(dtype)).expect("tensor");
    let rank = shape.len();
    match v {
        View::Plain => t,
        View::Narrowed if rank >= 1 => {
            let last = rank - 1;
            let wide = Tensor::cat(&[&t, &t], last).expect("cat");
            wide.narrow(last, 0, shape[last]).expect("narrow")
        }
        View::Transposed if rank >= 2 => {
            let mut dims = shape.to_vec();
            dims.swap(0, rank - 1);
            t.transpose(0, rank - 1)
                .and_then(|x| x.contiguous())
                .and_then(|x| x.transpose(0, rank - 1))
                .expect("transpose")
        }
        View::Broadcast if rank >= 1 && shape[0] > 0 => {
            t.narrow(0, 0, 1).and_then(|x| x.broadcast_as(shape)).expect("broadcast")
        }
        _ => t,
    }
}

/// Same NaN positions, same infinities, finite values within a tolerance.
fn same(a: &Tensor, b: &Tensor) -> Result<(), String> {
    if a.dims() != b.dims() || a.dtype() != b.dtype() {
        return Err(format!(
            "shape/dtype {:?} {:?} vs {:?} {:?}",
            a.dims(),
            a.dtype(),
            b.dims(),
            b.dtype()
        ));
    }
    let x = a.flatten_all().and_then(|t| t.to_dtype(DType::F64)).and_then(|t| t.to_vec1::<f64>());
    let y = b.flatten_all().and_then(|t| t.to_dtype(DType::F64)).and_then(|t| t.to_vec1::<f64>());
    let (x, y) = (x.map_err(|e| e.to_string())?, y.map_err(|e| e.to_string())?);
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        let ok = if p.is_nan() || q.is_nan() {
            p.is_nan() && q.is_nan()
        } else if p.is_infinite() || q.is_infinite() {
            p == q
        } else {
            (p - q).abs() <= 2e-4 * (1.0 + q.abs())
        };
        if !ok {
            return Err(format!("element {i}: {p} vs {q}"));
        }
    }
    Ok(())
}

/// Both paths reject with the same message, or both succeed with the same numbers (values are
/// compared only when no infinity was injected: ±inf propagates through sums in an order
/// that differs between the paths, NaN does not).
fn agree<T>(
    composed: multihead::Result<T>,
    fused: multihead::Result<T>,
    tensors: impl Fn(&T) -> Vec<Tensor>,
    compare_values: bool,
) -> Result<(), TestCaseError> {
    match (composed, fused) {
        (Err(a), Err(b)) => {
            prop_assert_eq!(a.to_string(), b.to_string());
            let msg = a.to_string();
            prop_assert!(msg.contains(':'), "untyped-looking message {msg}");
        }
        (Ok(a), Ok(b)) => {
            for (x, y) in tensors(&b).iter().zip(tensors(&a).iter()) {
                prop_assert_eq!(x.dims(), y.dims());
                if compare_values {
                    if let Err(e) = same(x, y) {
                        return Err(TestCaseError::fail(e));
                    }
                }
            }
        }
        (a, b) => {
            return Err(TestCaseError::fail(format!(
                "paths disagree: composed {:?}, fused {:?}",
                a.err().map(|e| e.to_string()),
                b.err().map(|e| e.to_string())
            )))
        }
    }
    Ok(())
}

fn is_inf(p: Poison) -> bool {
    matches!(p, Poison::PosInf(_) | Poison::NegInf(_))
}

#[derive(Clone, Debug)]
struct LinearDraw {
    lead: Vec<usize>,
    in_f: usize,
    out_f: usize,
    w_rows_off: i8,
    w_cols_off: i8,
    bias: u8, // 0 none, 1 right, 2 wrong length, 3 2-D
    x_f64: bool,
    w_f64: bool,
    xv: View,
    wv: View,
    bv: View,
    px: Poison,
    pw: Poison,
}

fn linear_draw() -> impl Strategy<Value = LinearDraw> {
    (
        prop::collection::vec(0usize..4, 0..3),
        0usize..6,
        0usize..6,
        prop_oneof![6 => Just(0i8), 1 => -1i8..=1],
        prop_oneof![6 => Just(0i8), 1 => -1i8..=1],
        0u8..4,
        prop_oneof![9 => Just(false), 1 => Just(true)],
        prop_oneof![9 => Just(false), 1 => Just(true)],
        (view(), view(), view(), poison(), poison()),
    )
        .prop_map(|(lead, in_f, out_f, wr, wc, bias, x_f64, w_f64, (xv, wv, bv, px, pw))| {
            LinearDraw {
                lead,
                in_f,
                out_f,
                w_rows_off: wr,
                w_cols_off: wc,
                bias,
                x_f64,
                w_f64,
                xv,
                wv,
                bv,
                px,
                pw,
            }
        })
}

fn off(n: usize, d: i8) -> usize {
    (n as i64 + d as i64).max(0) as usize
}

fn run_linear(d: &LinearDraw) -> Result<(), TestCaseError> {
    let dt = |f64_: bool| if f64_ { DType::F64 } else { DType::F32 };
    let mut xs = d.lead.clone();
    xs.push(d.in_f);
    let x = make(&xs, dt(d.x_f64), 1.0, d.xv, d.px);
    let w = make(
        &[off(d.out_f, d.w_rows_off), off(d.in_f, d.w_cols_off)],
        dt(d.w_f64),
        2.0,
        d.wv,
        d.pw,
    );
    let b = match d.bias {
        0 => None,
        1 => Some(make(&[off(d.out_f, d.w_rows_off)], dt(d.w_f64), 3.0, d.bv, Poison::None)),
        2 => Some(make(&[d.out_f + 1], dt(d.w_f64), 3.0, d.bv, Poison::None)),
        _ => Some(make(&[1, d.out_f], dt(d.w_f64), 3.0, d.bv, Poison::None)),
    };
    let lin = Linear::from_weights(w, b);
    let composed = with_backend(Backend::Composed, || lin.forward(&x));
    let fused = with_backend(Backend::Auto, || lin.forward(&x));
    agree(composed, fused, |t| vec![t.clone()], !is_inf(d.px) && !is_inf(d.pw))
}

#[derive(Clone, Debug)]
struct MhaDraw {
    e: usize,
    h: usize,
    kdim: Option<usize>,
    vdim: Option<usize>,
    bias: bool,
    bias_kv: bool,
    zero_attn: bool,
    batch_first: bool,
    unbatched: bool,
    n: usize,
    l: usize,
    s: usize,
    bad_feat: bool,
    input_f64: bool,
    attn_mask: u8, // 0 none, 1 (L, S), 2 (N·H, L, S), 3 wrong
    mask_kind: u8, // 0 bool, 1 float, 2 float of the wrong dtype, 3 integer
    kpm: u8,       // 0 none, 1 right, 2 wrong
    kpm_float: bool,
    need_weights: bool,
    average: bool,
    is_causal: bool,
    self_attn: bool,
    grad: bool,
    views: (View, View, View),
    poisons: (Poison, Poison, Poison, Poison),
}

fn mha_draw() -> impl Strategy<Value = MhaDraw> {
    let a = (
        1usize..=3,
        1usize..=4,
        prop::option::of(1usize..=5),
        prop::option::of(1usize..=5),
        any::<bool>(),
        prop_oneof![4 => Just(false), 1 => Just(true)],
        prop_oneof![4 => Just(false), 1 => Just(true)],
        any::<bool>(),
    );
    let b = (
        prop_oneof![5 => Just(false), 1 => Just(true)],
        0usize..=3,
        0usize..=6,
        0usize..=300,
        prop_oneof![12 => Just(false), 1 => Just(true)],
        prop_oneof![12 => Just(false), 1 => Just(true)],
    );
    let c = (0u8..=3, 0u8..=3, 0u8..=2, any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>());
    let d = (
        any::<bool>(),
        any::<bool>(),
        (view(), view(), view()),
        (poison(), poison(), poison(), poison()),
    );
    (a, b, c, d).prop_map(|(a, b, c, d)| MhaDraw {
        e: a.1 * a.0, // heads·head_dim
        h: a.1,
        kdim: a.2,
        vdim: a.3,
        bias: a.4,
        bias_kv: a.5,
        zero_attn: a.6,
        batch_first: a.7,
        unbatched: b.0,
        n: b.1,
        l: b.2,
        // Mostly short key sequences, sometimes past a 256-key tile.
        s: if b.3 > 40 && b.3 % 7 != 0 { b.3 % 9 } else { b.3 },
        bad_feat: b.4,
        input_f64: b.5,
        attn_mask: c.0,
        mask_kind: c.1,
        kpm: c.2,
        kpm_float: c.3,
        need_weights: c.4,
        average: c.5,
        is_causal: c.6,
        self_attn: d.0,
        grad: d.1,
        views: d.2,
        poisons: d.3,
    })
}

fn mask_tensor(shape: &[usize], kind: u8, salt: f64) -> Mask {
    let n: usize = shape.iter().product();
    let bits: Vec<u8> =
        (0..n).map(|i| (((i as f64 + salt) * 0.618).fract() < 0.35) as u8).collect();
    let b = Tensor::from_vec(bits, shape, &dev()).expect("mask");
    match kind {
        0 => Mask::Bool(b),
        1 => Mask::Float(b.to_dtype(DType::F32).and_then(|t| t.affine(-1e9, 0.0)).expect("float")),
        2 => Mask::Float(b.to_dtype(DType::F64).expect("f64")),
        _ => Mask::Bool(b.to_dtype(DType::U32).expect("u32")),
    }
}

fn run_mha(d: &MhaDraw) -> Result<(), TestCaseError> {
    let mut cfg = MhaConfig::new(d.e, d.h)
        .with_bias(d.bias)
        .with_add_bias_kv(d.bias_kv)
        .with_add_zero_attn(d.zero_attn)
        .with_batch_first(d.batch_first);
    cfg.kdim = d.kdim;
    cfg.vdim = d.vdim;
    let vm = VarMap::new();
    let m = MultiheadAttention::new(cfg.clone(), VarBuilder::from_varmap(&vm, DType::F32, &dev()))
        .map_err(|e| TestCaseError::fail(format!("valid config rejected: {e}")))?;
    // Deterministic parameters (candle's initialisation cannot be seeded).
    for (i, var) in vm.all_vars().iter().enumerate() {
        let t = make(var.dims(), DType::F32, 5.0 + i as f64, View::Plain, Poison::None);
        var.set(&t.affine(0.5, 0.0).map_err(|e| TestCaseError::fail(e.to_string()))?)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    let (pq, pk, pv, pp) = d.poisons;
    if let Poison::Nan(i) | Poison::PosInf(i) | Poison::NegInf(i) = pp {
        // Poison one parameter.
        let vars = vm.all_vars();
        if let Some(var) = vars.get(i % vars.len().max(1)) {
            let t = make(var.dims(), DType::F32, 9.0, View::Plain, pp);
            var.set(&t).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
    }
    let dt = if d.input_f64 { DType::F64 } else { DType::F32 };
    let shape = |len: usize, feat: usize| -> Vec<usize> {
        if d.unbatched {
            vec![len, feat]
        } else if d.batch_first {
            vec![d.n, len, feat]
        } else {
            vec![len, d.n, feat]
        }
    };
    let qf = d.e + d.bad_feat as usize;
    let q = make(&shape(d.l, qf), dt, 1.0, d.views.0, pq);
    let (k, v) = if d.self_attn {
        (q.clone(), q.clone())
    } else {
        (
            make(&shape(d.s, cfg.kdim()), dt, 2.0, d.views.1, pk),
            make(&shape(d.s, cfg.vdim()), dt, 3.0, d.views.2, pv),
        )
    };
    let s = if d.self_attn { d.l } else { d.s };
    let nb = if d.unbatched { 1 } else { d.n };
    let mut opts = MhaOptions::default()
        .need_weights(d.need_weights)
        .average_attn_weights(d.average)
        .is_causal(d.is_causal);
    opts.attn_mask = match d.attn_mask {
        0 => None,
        1 => Some(mask_tensor(&[d.l, s], d.mask_kind, 0.1)),
        2 if d.unbatched => Some(mask_tensor(&[d.h, d.l, s], d.mask_kind, 0.2)),
        2 => Some(mask_tensor(&[nb * d.h, d.l, s], d.mask_kind, 0.2)),
        _ => Some(mask_tensor(&[d.l + 1, s], d.mask_kind, 0.3)),
    };
    let kpm_shape = if d.unbatched { vec![s] } else { vec![nb, s] };
    opts.key_padding_mask = match d.kpm {
        0 => None,
        1 => Some(mask_tensor(&kpm_shape, d.kpm_float as u8, 0.4)),
        _ => Some(mask_tensor(&[nb + 1, s + 1], d.kpm_float as u8, 0.5)),
    };
    // With gradients, a float mask is learned (a Var): its gradient is compared below.
    let learn = |m: Option<Mask>| -> Result<Option<Mask>, TestCaseError> {
        Ok(match m {
            Some(Mask::Float(t)) if d.grad => {
                let v = candle_core::Var::from_tensor(&t)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                Some(Mask::Float(v.as_tensor().clone()))
            }
            m => m,
        })
    };
    opts.attn_mask = learn(opts.attn_mask.take())?;
    opts.key_padding_mask = learn(opts.key_padding_mask.take())?;
    let (q, k, v) = if d.grad {
        let var = |t: &Tensor| candle_core::Var::from_tensor(t).map(|v| v.as_tensor().clone());
        let q2 = var(&q).map_err(|e| TestCaseError::fail(e.to_string()))?;
        if d.self_attn {
            (q2.clone(), q2.clone(), q2)
        } else {
            let k2 = var(&k).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let v2 = var(&v).map_err(|e| TestCaseError::fail(e.to_string()))?;
            (q2, k2, v2)
        }
    } else {
        (q, k, v)
    };
    let poisoned = [pq, pk, pv, pp].iter().any(|&p| !matches!(p, Poison::None));
    let masks: Vec<Tensor> = [&opts.attn_mask, &opts.key_padding_mask]
        .into_iter()
        .filter_map(|m| match m {
            Some(Mask::Float(t)) if d.grad => Some(t.clone()),
            _ => None,
        })
        .collect();
    // The outputs, then (with gradients and clean inputs) each learned mask's gradient of the
    // sum of the outputs.
    let call = |b: Backend| -> multihead::Result<Vec<Tensor>> {
        let o = opts.clone().backend(b);
        let out = if d.grad {
            m.forward(&q, &k, &v, &o)?
        } else {
            no_grad(|| m.forward(&q, &k, &v, &o))?
        };
        let mut ts = vec![out.output.clone()];
        ts.extend(out.attn_weights.clone());
        if !masks.is_empty() && !poisoned {
            let mut loss = out.output.sum_all()?;
            if let Some(w) = &out.attn_weights {
                loss = (loss + w.sum_all()?)?;
            }
            let grads = loss.backward()?;
            for t in &masks {
                ts.push(grads.get(t).cloned().unwrap_or(t.zeros_like()?));
            }
        }
        Ok(ts)
    };
    let infs = [pq, pk, pv, pp].iter().any(|&p| is_inf(p));
    agree(call(Backend::Composed), call(Backend::Auto), |t| t.clone(), !infs)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn fuzz_linear(d in linear_draw()) {
        run_linear(&d)?;
    }

    #[test]
    fn fuzz_multihead_attention(d in mha_draw()) {
        run_mha(&d)?;
    }

    #[test]
    fn fuzz_corrupt_safetensors(seed in any::<u64>(), edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8), cut in prop::option::of(any::<usize>())) {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/mha/packed_self_nomask_f32/case.safetensors");
        let mut bytes = std::fs::read(&path).expect("fixture");
        // The 8-byte header length and the JSON header are where corruption bites hardest.
        let hot = 8 + (seed as usize % 200);
        for (i, b) in &edits {
            let at = if i % 2 == 0 { i % hot.min(bytes.len()) } else { i % bytes.len() };
            bytes[at] = *b;
        }
        if let Some(c) = cut {
            bytes.truncate(c % (bytes.len() + 1));
        }
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("x.safetensors");
        std::fs::write(&file, &bytes).expect("write");
        // Ok or a typed error; the loaded tensors are readable.
        if let Ok(map) = multihead::state_dict::load_safetensors(&file, &dev()) {
            for t in map.values() {
                prop_assert!(t.flatten_all().is_ok());
            }
        }
    }

    #[test]
    fn fuzz_corrupt_case_json(edits in prop::collection::vec((any::<usize>(), 0u8..128), 1..4)) {
        let src = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/transformer/enc_layer_basic_f32");
        let mut text = std::fs::read(src.join("case.json")).expect("fixture");
        // Corrupt only the part before "tensors" (the part that changes the computation).
        let head = text.windows(9).position(|w| w == b"\"tensors\"").unwrap_or(text.len()).max(1);
        for (i, b) in &edits {
            text[i % head] = *b;
        }
        let scratch = tempfile::tempdir().expect("dir");
        let dir = scratch.path();
        std::fs::write(dir.join("case.json"), &text).expect("write");
        std::fs::copy(src.join("case.safetensors"), dir.join("case.safetensors")).expect("copy");
        let report = multihead_parity::check_dir(dir);
        if let Err(msg) = &report.checks {
            prop_assert!(!msg.is_empty());
        }
    }
}
