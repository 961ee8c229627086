//! Kernel-vs-reference tests over awkward shapes, masks, layouts, SIMD levels and thread counts.

#![allow(clippy::unwrap_used)]

use super::reference;
use super::*;
use crate::bf16gemm::{with_bf16_kernel, Bf16Kernel};
use crate::dropout::DropoutKey;

use crate::testutil::{levels, rand_vec};

mod exp2;
mod tiles;
mod variants;

#[derive(Clone, Copy, Debug, PartialEq)]
enum MaskKind {
    /// Additive [L, S], broadcast over batch and heads, with some -inf.
    AddLS,
    /// Bool key padding (N, S) viewed with strides [s, 0, 0, 1], true = masked.
    KeyPad,
    /// Bool [L, S] with true = attend.
    BoolAttend,
    /// Additive per-head [B*H, L, S].
    PerHead,
    /// Key padding that masks every key of batch 0 and row 1 of an [L, S] bool mask.
    FullRows,
    /// Additive [L, S] stored transposed ([S, L] in memory: strides [0, 0, 1, l]).
    AddTransposed,
    /// Additive per key, [B, H, 1, S] viewed with strides [h·s, s, 0, 1] (the same for every
    /// query: built once per key), finite values and a `-inf` suffix.
    AddKeys,
}

#[derive(Clone, Debug)]
struct Case {
    b: usize,
    hq: usize,
    hkv: usize,
    l: usize,
    s: usize,
    d: usize,
    dv: usize,
    causal: bool,
    scale: Option<f32>,
    masks: Vec<MaskKind>,
    dropout: Option<f64>,
    /// q, k, v read out of a packed [B, L, 3, H, D] buffer; out/dq written as [B, L, H, D].
    packed: bool,
    /// The variants: diagonal offset, window, key lengths, soft cap.
    offset: isize,
    window: Window,
    lens: Option<Vec<usize>>,
    softcap: Option<f32>,
    cap_after_masks: bool,
    /// ALiBi slopes and attention sinks, one per query head.
    alibi: Option<Vec<f32>>,
    sinks: Option<Vec<f32>>,
}

impl Case {
    fn new(b: usize, h: usize, l: usize, s: usize, d: usize) -> Self {
        Case {
            b,
            hq: h,
            hkv: h,
            l,
            s,
            d,
            dv: d,
            causal: false,
            scale: None,
            masks: vec![],
            dropout: None,
            packed: false,
            offset: 0,
            window: Window::default(),
            lens: None,
            softcap: None,
            cap_after_masks: false,
            alibi: None,
            sinks: None,
        }
    }
}

/// Owned mask data for a case.
enum MaskData {
    F(Vec<f32>, [usize; 4]),
    B(Vec<u8>, [usize; 4], bool),
}

fn make_mask(c: &Case, kind: MaskKind, seed: u64) -> MaskData {
    let (b, h, l, s) = (c.b, c.hq, c.l, c.s);
    let r = rand_vec(b * h * l * s + l * s + b * s + 1, seed);
    match kind {
        MaskKind::AddLS => {
            let data = (0..l * s)
                .map(|x| if r[x] > 0.8 { f32::NEG_INFINITY } else { r[x] * 2.0 })
                .collect();
            MaskData::F(data, [0, 0, s, 1])
        }
        MaskKind::KeyPad => {
            // Mask a suffix of the keys per batch (never all of them).
            let data = (0..b * s)
                .map(|x| {
                    let (bb, j) = (x / s, x % s);
                    (j > 0 && j >= s - (bb % 3).min(s - 1)) as u8
                })
                .collect();
            MaskData::B(data, [s, 0, 0, 1], true)
        }
        MaskKind::BoolAttend => {
            let data = (0..l * s).map(|x| (x % s == 0 || r[x] > -0.5) as u8).collect();
            MaskData::B(data, [0, 0, s, 1], false)
        }
        MaskKind::AddTransposed => {
            let data = (0..l * s).map(|x| r[x] * 2.0).collect();
            MaskData::F(data, [0, 0, 1, l])
        }
        MaskKind::PerHead => {
            let data = (0..b * h * l * s).map(|x| r[x] * 3.0).collect();
            MaskData::F(data, [h * l * s, l * s, s, 1])
        }
        MaskKind::AddKeys => {
            let data = (0..b * h * s)
                .map(|x| if x % s + 1 + (x / s) % 4 > s { f32::NEG_INFINITY } else { r[x] * 3.0 })
                .collect();
            MaskData::F(data, [h * s, s, 0, 1])
        }
        MaskKind::FullRows => {
            // Viewed as [B, 1, L, S] bool (true = masked): batch 0 fully masked, row 1 of
            // every other batch fully masked, the rest open.
            let data = (0..b * l * s)
                .map(|x| {
                    let (bb, i) = (x / (l * s), x / s % l);
                    (bb == 0 || i == 1) as u8
                })
                .collect();
            MaskData::B(data, [l * s, 0, s, 1], true)
        }
    }
}

fn view(m: &MaskData) -> MaskView<'_> {
    match m {
        MaskData::F(d, st) => MaskView::Additive { data: d, strides: *st },
        MaskData::B(d, st, t) => MaskView::Bool { data: d, strides: *st, true_means_masked: *t },
    }
}

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
    ql: Layout4,
    kl: Layout4,
    vl: Layout4,
    /// Offsets of q, k, v inside their buffers (packed layout shares one buffer).
    qo: usize,
    ko: usize,
    vo: usize,
    ol: Layout4,
    out_len: usize,
    dql: Layout4,
    dq_len: usize,
    /// Layouts of dout (read) and of dk, dv (written): `[B, L, H, D]` rows when packed, as
    /// inside `MultiheadAttention`.
    dol: Layout4,
    dkl: Layout4,
    dvl: Layout4,
}

fn inputs(c: &Case, seed: u64) -> Inputs {
    let dol = Layout4::contiguous(c.hq, c.l, c.dv);
    let dout = rand_vec(c.b * c.hq * c.l * c.dv, seed + 7);
    if c.packed {
        assert!(c.l == c.s && c.hq == c.hkv && c.d == c.dv);
        let (h, l, d) = (c.hq, c.l, c.d);
        let buf = rand_vec(c.b * l * 3 * h * d, seed);
        let lay = Layout4 { batch: l * 3 * h * d, head: d, seq: 3 * h * d };
        let blhd = Layout4 { batch: l * h * d, head: d, seq: h * d };
        let _ = dol;
        Inputs {
            dol: blhd,
            dkl: blhd,
            dvl: blhd,
            q: buf.clone(),
            k: buf.clone(),
            v: buf,
            dout,
            ql: lay,
            kl: lay,
            vl: lay,
            qo: 0,
            ko: h * d,
            vo: 2 * h * d,
            ol: blhd,
            out_len: c.b * l * h * d,
            dql: blhd,
            dq_len: c.b * l * h * d,
        }
    } else {
        Inputs {
            dol,
            dkl: Layout4::contiguous(c.hkv, c.s, c.d),
            dvl: Layout4::contiguous(c.hkv, c.s, c.dv),
            q: rand_vec(c.b * c.hq * c.l * c.d, seed),
            k: rand_vec(c.b * c.hkv * c.s * c.d, seed + 1),
            v: rand_vec(c.b * c.hkv * c.s * c.dv, seed + 2),
            dout,
            ql: Layout4::contiguous(c.hq, c.l, c.d),
            kl: Layout4::contiguous(c.hkv, c.s, c.d),
            vl: Layout4::contiguous(c.hkv, c.s, c.dv),
            qo: 0,
            ko: 0,
            vo: 0,
            ol: Layout4::contiguous(c.hq, c.l, c.dv),
            out_len: c.b * c.hq * c.l * c.dv,
            dql: Layout4::contiguous(c.hq, c.l, c.d),
            dq_len: c.b * c.hq * c.l * c.d,
        }
    }
}

/// |got - exp| <= tol + tol·|exp| for every element of a `[b, h, n, w]` view, NaN/inf must match.
#[allow(clippy::too_many_arguments)]
fn assert_close(
    what: &str,
    c: &Case,
    got: &[f32],
    gl: Layout4,
    exp: &[f64],
    sizes: [usize; 4],
    tol: f64,
) {
    let el = Layout4::contiguous(sizes[1], sizes[2], sizes[3]);
    for b in 0..sizes[0] {
        for h in 0..sizes[1] {
            for i in 0..sizes[2] {
                for x in 0..sizes[3] {
                    let g = got[gl.offset(b, h, i) + x] as f64;
                    let e = exp[el.offset(b, h, i) + x];
                    let ok = if e.is_finite() {
                        (g - e).abs() <= tol + tol * e.abs()
                    } else {
                        g == e || (g.is_nan() && e.is_nan())
                    };
                    assert!(
                        ok,
                        "{what}[{b},{h},{i},{x}]: got {g}, expected {e} (level {:?}) in {c:?}",
                        simd_level()
                    );
                }
            }
        }
    }
}

struct Results {
    out: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    w: Vec<f32>,
    wavg: Vec<f32>,
    /// The sinks' gradient (empty without sinks).
    dsinks: Vec<f32>,
    /// The scores' gradient (`flash_backward_dscores`), `[b, hq, l, s]`.
    dscores: Vec<f32>,
}

fn params<'a>(c: &'a Case, masks: &'a [MaskData]) -> AttnParams<'a> {
    let mut p = AttnParams::new(AttnDims {
        batch: c.b,
        heads_q: c.hq,
        heads_kv: c.hkv,
        l: c.l,
        s: c.s,
        d: c.d,
        dv: c.dv,
    });
    if let Some(s) = c.scale {
        p.scale = s;
    }
    p.causal = c.causal;
    for (slot, m) in p.masks.iter_mut().zip(masks) {
        *slot = Some(view(m));
    }
    p.dropout = c.dropout.map(|pr| (pr, DropoutKey { seed: 5, offset: 9 }));
    (p.offset, p.window, p.kv_lengths, p.softcap) =
        (c.offset, c.window, c.lens.as_deref(), c.softcap);
    p.softcap_after_masks = c.cap_after_masks;
    (p.alibi, p.sinks) = (c.alibi.as_deref(), c.sinks.as_deref());
    p
}

fn run_kernels(c: &Case, p: &AttnParams<'_>, x: &Inputs) -> Results {
    let dm = p.dims;
    let mut out = vec![f32::NAN; x.out_len];
    let rows = dm.batch * dm.heads_q * dm.l;
    let mut lse = vec![f32::NAN; 2 * rows];
    let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
    flash_forward(p, q, x.ql, k, x.kl, v, x.vl, &mut out, x.ol, &mut lse).unwrap();
    // Into memory given as uninitialised, without statistics: the same bits, and every
    // element `flash_forward` wrote is written (a skipped one would keep its NaN here and
    // differ from the other's value, or from the reference).
    let mut bare = vec![std::mem::MaybeUninit::new(f32::NAN); x.out_len];
    flash_forward_uninit(p, q, x.ql, k, x.kl, v, x.vl, &mut bare, x.ol, None).unwrap();
    // SAFETY: every element was initialised (to NaN) before the call.
    let bare: Vec<u32> = bare.iter().map(|x| unsafe { x.assume_init() }.to_bits()).collect();
    assert!(bare == out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "uninit forward");
    let mut dq = vec![f32::NAN; x.dq_len];
    let mut dk = vec![f32::NAN; c.b * c.hkv * c.s * c.d];
    let mut dv = vec![f32::NAN; c.b * c.hkv * c.s * c.dv];
    flash_backward(
        p, q, x.ql, k, x.kl, v, x.vl, &out, x.ol, &x.dout, x.dol, &lse, &mut dq, x.dql, &mut dk,
        x.dkl, &mut dv, x.dvl,
    )
    .unwrap();
    let mut w = vec![f32::NAN; c.b * c.hq * c.l * c.s];
    attention_weights(p, q, x.ql, k, x.kl, &lse, false, &mut w).unwrap();
    let mut wavg = vec![f32::NAN; c.b * c.l * c.s];
    attention_weights(p, q, x.ql, k, x.kl, &lse, true, &mut wavg).unwrap();
    // The log-sum-exp from the two halves of the row statistics, for comparison.
    let lse_sum = (0..rows).map(|r| lse[r] + lse[rows + r]).collect();
    // Again with the scores' gradient: the same dq, dk, dv bit for bit.
    let mut dscores = vec![f32::NAN; c.b * c.hq * c.l * c.s];
    let (mut dq2, mut dk2, mut dv2) = (dq.clone(), dk.clone(), dv.clone());
    flash_backward_dscores(
        p,
        q,
        x.ql,
        k,
        x.kl,
        v,
        x.vl,
        &out,
        x.ol,
        &x.dout,
        x.dol,
        &lse,
        &mut dq2,
        x.dql,
        &mut dk2,
        x.dkl,
        &mut dv2,
        x.dvl,
        &mut dscores,
    )
    .unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&dq2) == bits(&dq) && bits(&dk2) == bits(&dk) && bits(&dv2) == bits(&dv));
    let mut dsinks = vec![f32::NAN; if p.sinks.is_some() { c.hq } else { 0 }];
    if p.sinks.is_some() {
        sink_grad(p, &out, x.ol, &x.dout, x.dol, &lse, &mut dsinks).unwrap();
    }
    Results { out, lse: lse_sum, dq, dk, dv, w, wavg, dsinks, dscores }
}

fn check_case(c: &Case) {
    let masks: Vec<MaskData> =
        c.masks.iter().enumerate().map(|(n, &k)| make_mask(c, k, 100 + n as u64)).collect();
    let p = params(c, &masks);
    let x = inputs(c, 42);
    let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
    let (eout, else_) = reference::forward(&p, q, x.ql, k, x.kl, v, x.vl);
    let (edq, edk, edv) = reference::backward(&p, q, x.ql, k, x.kl, v, x.vl, &x.dout, x.dol);
    let ew = reference::weights(&p, q, x.ql, k, x.kl, false);
    let ewavg = reference::weights(&p, q, x.ql, k, x.kl, true);
    let (.., edsc) =
        reference::backward_with_dscores(&p, q, x.ql, k, x.kl, v, x.vl, &x.dout, x.dol);
    let esinks = reference::sink_grad(&p, q, x.ql, k, x.kl, v, x.vl, &x.dout, x.dol);
    let lsel = Layout4::contiguous(c.hq, c.l, 1);
    for level in levels() {
        with_simd_level(level, || {
            let r = run_kernels(c, &p, &x);
            let (b, hq, hkv, l, s) = (c.b, c.hq, c.hkv, c.l, c.s);
            assert_close("out", c, &r.out, x.ol, &eout, [b, hq, l, c.dv], 1e-5);
            assert_close("lse", c, &r.lse, lsel, &else_, [b, hq, l, 1], 1e-5);
            assert_close("dq", c, &r.dq, x.dql, &edq, [b, hq, l, c.d], 1e-4);
            assert_close("dk", c, &r.dk, x.dkl, &edk, [b, hkv, s, c.d], 1e-4);
            assert_close("dv", c, &r.dv, x.dvl, &edv, [b, hkv, s, c.dv], 1e-4);
            let wl = Layout4::contiguous(hq, l, s);
            assert_close("weights", c, &r.w, wl, &ew, [b, hq, l, s], 1e-5);
            let wal = Layout4::contiguous(1, l, s);
            assert_close("weights(avg)", c, &r.wavg, wal, &ewavg, [b, 1, l, s], 1e-5);
            let dl = Layout4::contiguous(hq, l, s);
            assert_close("dscores", c, &r.dscores, dl, &edsc, [b, hq, l, s], 1e-4);
            if c.sinks.is_some() {
                let hl = Layout4::contiguous(1, 1, 1);
                assert_close("dsinks", c, &r.dsinks, hl, &esinks, [1, hq, 1, 1], 1e-4);
            }
            for g in [&r.dq, &r.dk, &r.dv] {
                assert!(g.iter().all(|x| x.is_finite()), "non-finite gradient in {c:?}");
            }
        });
    }
}

#[test]
fn plain_sizes() {
    for &(l, s, d) in &[
        (1, 1, 1),
        (3, 3, 7),
        (63, 65, 32),
        (64, 64, 64),
        (65, 63, 80),
        (257, 257, 64),
        (1, 257, 128),
        (257, 3, 7),
        (65, 257, 128),
        (130, 64, 32),
    ] {
        check_case(&Case::new(2, 2, l, s, d));
    }
}

#[test]
fn value_dim_differs() {
    let mut c = Case::new(1, 2, 65, 63, 32);
    c.dv = 80;
    check_case(&c);
    let mut c = Case::new(2, 1, 3, 257, 7);
    c.dv = 1;
    check_case(&c);
}

#[test]
fn causal_shapes() {
    for &(l, s, d) in
        &[(64, 64, 64), (63, 257, 32), (257, 65, 64), (3, 1, 7), (1, 3, 80), (200, 200, 128)]
    {
        let mut c = Case::new(2, 2, l, s, d);
        c.causal = true;
        check_case(&c);
    }
}

#[test]
fn custom_scales() {
    for &scale in &[-0.37f32, 0.0, 2.5] {
        let mut c = Case::new(1, 2, 65, 64, 32);
        c.scale = Some(scale);
        check_case(&c);
    }
}

#[test]
fn every_mask_kind() {
    for &kind in &[
        MaskKind::AddLS,
        MaskKind::KeyPad,
        MaskKind::BoolAttend,
        MaskKind::PerHead,
        MaskKind::FullRows,
        MaskKind::AddTransposed,
        MaskKind::AddKeys,
    ] {
        let mut c = Case::new(3, 2, 65, 257, 32);
        c.masks = vec![kind];
        check_case(&c);
    }
}

#[test]
fn two_masks_and_causal() {
    let mut c = Case::new(3, 2, 63, 65, 64);
    c.masks = vec![MaskKind::AddLS, MaskKind::KeyPad];
    check_case(&c);
    c.causal = true;
    c.masks = vec![MaskKind::PerHead, MaskKind::BoolAttend];
    check_case(&c);
    // A row-major float mask as the second (accumulated) mask, and a transposed one.
    c.masks = vec![MaskKind::KeyPad, MaskKind::AddLS];
    check_case(&c);
    c.causal = false;
    c.masks = vec![MaskKind::AddTransposed, MaskKind::PerHead];
    check_case(&c);
    // Two masks the same for every query: summed once per key.
    c.masks = vec![MaskKind::AddKeys, MaskKind::KeyPad];
    check_case(&c);
    c.causal = true;
    check_case(&c);
}

#[test]
fn fully_masked_rows_give_zeros_and_finite_grads() {
    let mut c = Case::new(2, 2, 65, 64, 32);
    c.masks = vec![MaskKind::FullRows];
    check_case(&c);
    c.masks = vec![MaskKind::FullRows, MaskKind::AddLS];
    c.dropout = Some(0.2);
    check_case(&c);
    // S = 0: every row is fully masked.
    check_case(&Case::new(1, 2, 5, 0, 8));
}

#[test]
fn grouped_query_attention() {
    let mut c = Case::new(2, 4, 65, 63, 32);
    c.hkv = 2;
    check_case(&c);
    let mut c = Case::new(1, 6, 64, 130, 64);
    c.hkv = 1;
    c.causal = true;
    c.masks = vec![MaskKind::KeyPad];
    check_case(&c);
}

#[test]
fn dropout_matches_reference() {
    let mut c = Case::new(2, 2, 65, 257, 32);
    c.dropout = Some(0.3);
    check_case(&c);
    c.causal = true;
    c.hkv = 1;
    c.dropout = Some(0.9);
    check_case(&c);
}

#[test]
fn packed_strided_inputs() {
    let mut c = Case::new(2, 3, 65, 65, 32);
    c.packed = true;
    check_case(&c);
    c.causal = true;
    c.masks = vec![MaskKind::KeyPad];
    c.dropout = Some(0.1);
    check_case(&c);
    // Rows 2 KiB apart (H·D = 512 floats), the stride that the contiguous copies are for;
    // several query blocks over one key block read the keys in place.
    let mut c = Case::new(1, 8, 70, 70, 64);
    c.packed = true;
    check_case(&c);
    // More than a key block (s > 256) re-read by several query blocks: copied contiguous.
    let mut c = Case::new(1, 2, 300, 300, 16);
    c.packed = true;
    assert!(crate::attention::forward_copies_keys(c.l, c.s, c.hq, c.hkv));
    check_case(&c);
    c.causal = true;
    c.masks = vec![MaskKind::KeyPad];
    check_case(&c);
    // One query block per head (l ≤ 64): the keys and values are read in place, not copied.
    for l in [17, 64] {
        let mut c = Case::new(2, 4, l, l, 32);
        c.packed = true;
        c.causal = l == 64;
        c.masks = vec![MaskKind::KeyPad];
        check_case(&c);
    }
}

/// The packed backwards write into one `[B, L, 3, H, D]` gradient (or dq apart and one
/// `[B, S, 2, H, D]` key/value gradient) exactly what the three-output backward writes into its
/// three `[B, L, H, D]` gradients, and refuse what they cannot do.
#[test]
fn packed_backward_equals_three_gradients() {
    let mut c = Case::new(2, 3, 70, 70, 32);
    c.packed = true;
    c.causal = true;
    c.masks = vec![MaskKind::KeyPad];
    let masks: Vec<MaskData> = c.masks.iter().map(|&k| make_mask(&c, k, 11)).collect();
    let p = params(&c, &masks);
    let x = inputs(&c, 5);
    let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
    let (w, n) = (c.hq * c.d, c.b * c.l * c.hq * c.d);
    let dl = Layout4 { batch: c.l * 3 * w, head: c.d, seq: 3 * w };
    for level in levels() {
        with_simd_level(level, || {
            let r = run_kernels(&c, &p, &x);
            let mut dqkv = vec![f32::NAN; 3 * n];
            let ins = (&r.out, x.ol, &x.dout, x.dol);
            let lse = {
                // The forward's row statistics again (run_kernels keeps only their sum).
                let mut out = vec![0.0; x.out_len];
                let mut lse = vec![0.0; 2 * c.b * c.hq * c.l];
                flash_forward(&p, q, x.ql, k, x.kl, v, x.vl, &mut out, x.ol, &mut lse).unwrap();
                lse
            };
            // With the scores' gradient: the same bits as flash_backward_dscores's.
            let mut ds = vec![f32::NAN; r.dscores.len()];
            flash_backward_packed(
                &p,
                q,
                x.ql,
                k,
                x.kl,
                v,
                x.vl,
                ins.0,
                ins.1,
                ins.2,
                ins.3,
                &lse,
                &mut dqkv,
                dl,
                Some(&mut ds),
            )
            .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ds), bits(&r.dscores), "packed dscores ({level:?})");
            // Into a buffer that was never initialised (here: garbage bits): the same bits.
            let mut raw = vec![std::mem::MaybeUninit::new(f32::from_bits(0x7fc0_1234)); 3 * n];
            flash_backward_packed(
                &p, q, x.ql, k, x.kl, v, x.vl, ins.0, ins.1, ins.2, ins.3, &lse, &mut raw, dl, None,
            )
            .unwrap();
            // SAFETY: on `Ok` every element was written (what this assertion checks).
            let raw: Vec<f32> = raw.iter().map(|x| unsafe { x.assume_init() }).collect();
            assert_eq!(bits(&raw), bits(&dqkv), "uninit packed backward ({level:?})");
            for (part, (what, g, gl)) in
                [("dq", &r.dq, x.dql), ("dk", &r.dk, x.dkl), ("dv", &r.dv, x.dvl)]
                    .iter()
                    .enumerate()
            {
                let mut got = vec![0.0f32; n];
                for b in 0..c.b {
                    for h in 0..c.hq {
                        for i in 0..c.l {
                            for e in 0..c.d {
                                let o = dl.offset(b, h, i) + part * w + e;
                                got[gl.offset(b, h, i) + e] = dqkv[o];
                            }
                        }
                    }
                }
                assert_eq!(bits(&got), bits(g), "{what} differs ({level:?})");
            }
            // k and v packed, q apart: [B, S, 2, H, D] and the query's own layout.
            let kvl = Layout4 { batch: c.s * 2 * w, head: c.d, seq: 2 * w };
            let (mut dq, mut dkv) = (vec![f32::NAN; x.dq_len], vec![f32::NAN; 2 * n]);
            let mut ds = vec![f32::NAN; r.dscores.len()];
            flash_backward_kv_packed(
                &p,
                q,
                x.ql,
                k,
                x.kl,
                v,
                x.vl,
                ins.0,
                ins.1,
                ins.2,
                ins.3,
                &lse,
                &mut dq,
                x.dql,
                &mut dkv,
                kvl,
                Some(&mut ds),
            )
            .unwrap();
            assert_eq!(bits(&ds), bits(&r.dscores), "kv-packed dscores ({level:?})");
            assert_eq!(bits(&dq), bits(&r.dq), "dq differs with k and v packed ({level:?})");
            for (part, (what, g, gl)) in
                [("dk", &r.dk, x.dkl), ("dv", &r.dv, x.dvl)].iter().enumerate()
            {
                for b in 0..c.b {
                    for h in 0..c.hq {
                        for j in 0..c.s {
                            let got = &dkv[kvl.offset(b, h, j) + part * w..][..c.d];
                            let exp = &g[gl.offset(b, h, j)..][..c.d];
                            assert_eq!(bits(got), bits(exp), "{what} ({b},{h},{j}) ({level:?})");
                        }
                    }
                }
            }
        });
    }
    // Errors, not panics: unequal heads or lengths, a short buffer, an overlapping layout.
    let lse = vec![0.0; 2 * c.b * c.hq * c.l];
    let o = vec![0.0; x.out_len];
    let run = |p: &AttnParams<'_>, buf: &mut [f32], dl: Layout4| {
        let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
        let ds = None;
        flash_backward_packed(
            p, q, x.ql, k, x.kl, v, x.vl, &o, x.ol, &x.dout, x.dol, &lse, buf, dl, ds,
        )
    };
    let mut buf = vec![0.0; 3 * n];
    let mut p2 = p;
    p2.dims.heads_kv = 1;
    assert!(matches!(run(&p2, &mut buf, dl), Err(KernelError::InvalidArgument { .. })));
    let mut short = vec![0.0; 3 * n - 1];
    assert!(matches!(run(&p, &mut short, dl), Err(KernelError::SliceTooShort { .. })));
    let overlapping = Layout4 { head: 1, ..dl };
    assert!(matches!(run(&p, &mut buf, overlapping), Err(KernelError::OverlappingOutput { .. })));
    // A scores' gradient shorter than `[b, hq, l, s]`.
    let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
    let mut ds = vec![0.0; c.b * c.hq * c.l * c.s - 1];
    let e = flash_backward_packed(
        &p,
        q,
        x.ql,
        k,
        x.kl,
        v,
        x.vl,
        &o,
        x.ol,
        &x.dout,
        x.dol,
        &lse,
        &mut buf,
        dl,
        Some(&mut ds),
    );
    assert!(matches!(e, Err(KernelError::SliceTooShort { name: "dscores", .. })), "{e:?}");
    // The key/value one: d != dv, a short buffer.
    let kvl = Layout4 { batch: c.s * 2 * w, head: c.d, seq: 2 * w };
    let run_kv = |p: &AttnParams<'_>, buf: &mut [f32]| {
        let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
        let mut dq = vec![0.0; x.dq_len];
        flash_backward_kv_packed(
            p, q, x.ql, k, x.kl, v, x.vl, &o, x.ol, &x.dout, x.dol, &lse, &mut dq, x.dql, buf, kvl,
            None,
        )
    };
    let mut p3 = p;
    p3.dims.dv = c.d - 1;
    let mut kv = vec![0.0; 2 * n];
    assert!(matches!(run_kv(&p3, &mut kv), Err(KernelError::InvalidArgument { .. })));
    let mut short = vec![0.0; 2 * n - 1];
    assert!(matches!(run_kv(&p, &mut short), Err(KernelError::SliceTooShort { .. })));
    // No keys: an empty key/value gradient, and dq all zeros as the three-output backward has it.
    let c = Case::new(1, 2, 5, 0, 8);
    let (p, x) = (params(&c, &[]), inputs(&c, 3));
    let r = run_kernels(&c, &p, &x);
    let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
    let (mut dq, mut dkv) = (vec![f32::NAN; x.dq_len], Vec::new());
    let kvl = Layout4 { batch: 0, head: c.d, seq: 2 * c.hq * c.d };
    let lse = vec![0.0; 2 * c.b * c.hq * c.l];
    flash_backward_kv_packed(
        &p, q, x.ql, k, x.kl, v, x.vl, &r.out, x.ol, &x.dout, x.dol, &lse, &mut dq, x.dql,
        &mut dkv, kvl, None,
    )
    .unwrap();
    assert!(dq.iter().all(|&g| g == 0.0) && r.dq.iter().all(|&g| g == 0.0));
}

/// Keys beyond one backward chunk (`(1 << 16) / (d + dv)` keys, at least one key block):
/// dK and dV accumulate per chunk and dQ sums the chunks' shares.
#[test]
fn keys_in_several_backward_chunks() {
    // d = dv = 128: chunks of 256 keys.
    let mut c = Case::new(1, 2, 40, 600, 128);
    check_case(&c);
    c.causal = true;
    c.l = 600;
    check_case(&c);
    c.causal = false;
    c.l = 70;
    c.hq = 4;
    c.masks = vec![MaskKind::KeyPad, MaskKind::AddLS];
    c.dropout = Some(0.2);
    check_case(&c);
    // Strided: one packed buffer of 2 heads (L = S = 300 with 256-key chunks).
    let mut c = Case::new(1, 2, 300, 300, 128);
    c.packed = true;
    c.causal = true;
    check_case(&c);
}

#[test]
fn thread_count_does_not_change_bits() {
    let mut c = Case::new(2, 4, 200, 131, 64);
    c.hkv = 2;
    c.causal = true;
    c.masks = vec![MaskKind::AddLS];
    c.dropout = Some(0.25);
    let masks: Vec<MaskData> = c.masks.iter().map(|&k| make_mask(&c, k, 3)).collect();
    let p = params(&c, &masks);
    let x = inputs(&c, 1);
    for level in levels() {
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| with_simd_level(level, || run_kernels(&c, &p, &x)))
        };
        let a = run(1);
        for threads in [2, 3] {
            let b = run(threads);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (what, x, y) in [
                ("out", &a.out, &b.out),
                ("lse", &a.lse, &b.lse),
                ("dq", &a.dq, &b.dq),
                ("dk", &a.dk, &b.dk),
                ("dv", &a.dv, &b.dv),
                ("w", &a.w, &b.w),
                ("wavg", &a.wavg, &b.wavg),
            ] {
                assert!(bits(x) == bits(y), "{what} differs at {threads} threads ({level:?})");
            }
        }
    }
}

#[test]
fn plus_inf_score_gives_nan_row() {
    let c = Case::new(1, 1, 2, 3, 4);
    let mut mask = vec![0.0f32; 6];
    mask[4] = f32::INFINITY; // row 1, key 1
    let mut p = params(&c, &[]);
    p.masks[0] = Some(MaskView::Additive { data: &mask, strides: [0, 0, 3, 1] });
    let x = inputs(&c, 3);
    for level in levels() {
        with_simd_level(level, || {
            let mut out = vec![0.0; 8];
            let mut lse = vec![0.0; 4];
            flash_forward(&p, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse)
                .unwrap();
            assert!(out[..4].iter().all(|v| v.is_finite()));
            assert!(out[4..].iter().all(|v| v.is_nan()), "{out:?}");
        });
    }
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let c = Case::new(2, 2, 5, 6, 4);
    let p = params(&c, &[]);
    let x = inputs(&c, 1);
    let mut out = vec![0.0; x.out_len];
    let mut lse = vec![0.0; 40];
    // q too short.
    let e = flash_forward(&p, &x.q[..10], x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse);
    assert!(matches!(e, Err(KernelError::SliceTooShort { name: "q", .. })), "{e:?}");
    // lse too short.
    let e = flash_forward(&p, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse[..3]);
    assert!(matches!(e, Err(KernelError::SliceTooShort { name: "lse", .. })));
    // Overlapping output layout.
    let ol = Layout4 { batch: 0, head: 4, seq: 4 };
    let e = flash_forward(&p, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, ol, &mut lse);
    assert!(matches!(e, Err(KernelError::OverlappingOutput { name: "out" })));
    // Rows overlapping inside the head dimension.
    let ol = Layout4 { batch: 40, head: 20, seq: 2 };
    let e = flash_forward(&p, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, ol, &mut lse);
    assert!(matches!(e, Err(KernelError::OverlappingOutput { .. })));
    // Heads.
    let mut p2 = p;
    p2.dims.heads_kv = 3;
    let e = flash_forward(&p2, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse);
    assert!(matches!(e, Err(KernelError::InvalidHeads { .. })));
    p2.dims.heads_kv = 0;
    let e = flash_forward(&p2, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse);
    assert!(matches!(e, Err(KernelError::InvalidHeads { .. })));
    // Dropout.
    for bad in [1.0, -0.1, f64::NAN] {
        let mut p3 = p;
        p3.dropout = Some((bad, DropoutKey { seed: 0, offset: 0 }));
        let e = flash_forward(&p3, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse);
        assert!(matches!(e, Err(KernelError::InvalidDropout { .. })));
    }
    // Mask too short for its strides.
    let m = [0.0f32; 5];
    let mut p4 = p;
    p4.masks[1] = Some(MaskView::Additive { data: &m, strides: [0, 0, 6, 1] });
    let e = flash_forward(&p4, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse);
    assert!(matches!(e, Err(KernelError::SliceTooShort { name: "masks[1]", .. })));
    // Overflowing strides.
    let huge = Layout4 { batch: usize::MAX / 2, head: 1, seq: 1 };
    let e = flash_forward(&p, &x.q, huge, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse);
    assert!(matches!(
        e,
        Err(KernelError::Overflow { .. }) | Err(KernelError::SliceTooShort { .. })
    ));
    // Backward and weights outputs.
    let mut small = vec![0.0; 3];
    let mut dk = vec![0.0; 2 * 2 * 6 * 4];
    let mut dv = dk.clone();
    let dol = x.ol;
    let e = flash_backward(
        &p, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &out, x.ol, &x.dout, dol, &lse, &mut small, x.dql,
        &mut dk, x.kl, &mut dv, x.vl,
    );
    assert!(matches!(e, Err(KernelError::SliceTooShort { name: "dq", .. })));
    let e = attention_weights(&p, &x.q, x.ql, &x.k, x.kl, &lse, false, &mut small);
    assert!(matches!(e, Err(KernelError::SliceTooShort { name: "weights", .. })));
    assert!(!format!("{}", e.unwrap_err()).is_empty());
}

#[test]
fn empty_shapes_are_fine() {
    for (b, h, l, s, d) in [(0, 2, 3, 3, 4), (1, 2, 0, 3, 4), (1, 1, 3, 3, 0)] {
        check_case(&Case::new(b, h, l, s, d));
    }
}

// ---------------------------------------------------------------------------------------------
// The vector exp

#[test]
fn exp_low_is_exp_bit_for_bit_up_to_110() {
    // Every float from -200 to 110 in steps, the ends of the zero mask and of the clamp,
    // -inf, signed zeros and NaN.
    let mut xs: Vec<f32> = (0..310_001).map(|i| -200.0 + 310.0 * i as f32 / 310_000.0).collect();
    xs.extend([f32::NEG_INFINITY, -87.33, -87.329_99, -110.0, 110.0, -0.0, 0.0, f32::NAN]);
    xs.extend([f32::MIN, -1e30, f32::from_bits(0xFFC1_2345), -1e-30]);
    xs.resize(xs.len().div_ceil(16) * 16, 0.0);
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512dq")]
        unsafe fn both(x: &[f32]) -> (Vec<u32>, Vec<u32>) {
            use super::simd::{Avx512, Simd};
            let (mut a, mut b) = (vec![0u32; x.len()], vec![0u32; x.len()]);
            for (i, c) in x.chunks(16).enumerate() {
                // SAFETY: 16 floats per chunk; AVX-512 enabled (the caller checked the CPU).
                unsafe {
                    let v = Avx512::load(c.as_ptr());
                    let (e, l) = (Avx512::exp(v), Avx512::exp_low(v));
                    Avx512::store(a.as_mut_ptr().add(16 * i) as *mut f32, e);
                    Avx512::store(b.as_mut_ptr().add(16 * i) as *mut f32, l);
                }
            }
            (a, b)
        }
        if detected_simd_level() >= SimdLevel::Avx512 {
            // SAFETY: checked above.
            let (e, l) = unsafe { both(&xs) };
            for i in 0..xs.len() {
                assert_eq!(
                    e[i],
                    l[i],
                    "exp({}) = {:e} but exp_low gives {:e}",
                    xs[i],
                    f32::from_bits(e[i]),
                    f32::from_bits(l[i])
                );
            }
            return;
        }
    }
    // Elsewhere `exp_low` is `exp` itself (the trait's default): nothing differs to compare,
    // so check the scalar exp is finite and ordered on the range instead.
    use super::simd::{Scalar, Simd};
    // SAFETY: scalar code runs anywhere.
    let ys: Vec<f32> = xs.iter().map(|&x| unsafe { Scalar::exp_low(x) }).collect();
    let ok = xs.iter().zip(&ys).all(|(&x, &y)| x.is_nan() == y.is_nan());
    assert!(ok, "exp_low keeps NaN exactly where its argument has one");
}

fn exp_max_rel_error(level: SimdLevel) -> f64 {
    use super::simd::Simd;
    let xs: Vec<f32> = (0..200_001)
        .map(|i| -87.0 + 97.0 * i as f32 / 200_000.0)
        .chain([0.0, -0.0, 1e-8, -1e-8, 0.5 * std::f32::consts::LN_2])
        .collect();
    fn run<S: Simd>(xs: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; xs.len() + 16];
        let mut x = xs.to_vec();
        x.resize(xs.len().div_ceil(16) * 16, 0.0);
        for (i, chunk) in x.chunks(S::LANES).enumerate() {
            // SAFETY: only called at a level the CPU supports; chunks hold LANES floats.
            unsafe { S::store(out.as_mut_ptr().add(i * S::LANES), S::exp(S::load(chunk.as_ptr()))) }
        }
        out.truncate(xs.len());
        out
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run512(xs: &[f32]) -> Vec<f32> {
        run::<super::simd::Avx512>(xs)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run256(xs: &[f32]) -> Vec<f32> {
        run::<super::simd::Avx2>(xs)
    }
    let ys = match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `levels()` only yields supported levels.
        SimdLevel::Avx512 => unsafe { run512(&xs) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { run256(&xs) },
        _ => run::<super::simd::Scalar>(&xs),
    };
    xs.iter()
        .zip(&ys)
        .map(|(&x, &y)| {
            let e = (x as f64).exp();
            ((y as f64 - e) / e).abs()
        })
        .fold(0.0, f64::max)
}

#[test]
fn vector_exp_is_accurate_and_handles_specials() {
    for level in levels() {
        let err = exp_max_rel_error(level);
        assert!(err < 2e-7, "{level:?}: max relative error {err}");
    }
    #[cfg(target_arch = "x86_64")]
    {
        use super::simd::Simd;
        #[target_feature(enable = "avx512f")]
        unsafe fn specials512() -> [f32; 16] {
            let mut x = [0f32; 16];
            x[..6].copy_from_slice(&[
                f32::NEG_INFINITY,
                -200.0,
                -100.0,
                f32::NAN,
                200.0,
                f32::INFINITY,
            ]);
            let mut y = [0f32; 16];
            // SAFETY: 16 floats each; AVX-512F enabled.
            unsafe {
                super::simd::Avx512::store(
                    y.as_mut_ptr(),
                    super::simd::Avx512::exp(super::simd::Avx512::load(x.as_ptr())),
                )
            };
            y
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn specials256() -> [f32; 16] {
            let mut x = [0f32; 16];
            x[..6].copy_from_slice(&[
                f32::NEG_INFINITY,
                -200.0,
                -100.0,
                f32::NAN,
                200.0,
                f32::INFINITY,
            ]);
            let mut y = [0f32; 16];
            for c in 0..2 {
                // SAFETY: 8 floats per chunk; AVX2 enabled.
                unsafe {
                    super::simd::Avx2::store(
                        y.as_mut_ptr().add(8 * c),
                        super::simd::Avx2::exp(super::simd::Avx2::load(x.as_ptr().add(8 * c))),
                    )
                };
            }
            y
        }
        let mut outs = vec![];
        if detected_simd_level() >= SimdLevel::Avx512 {
            // SAFETY: checked above.
            outs.push(unsafe { specials512() });
        }
        if detected_simd_level() >= SimdLevel::Avx2 {
            // SAFETY: checked above.
            outs.push(unsafe { specials256() });
        }
        for y in outs {
            assert_eq!(&y[..3], &[0.0, 0.0, 0.0]);
            assert!(y[3].is_nan());
            assert_eq!(&y[4..6], &[f32::INFINITY, f32::INFINITY]);
        }
    }
}

/// Pair words of two vectors, through one instruction set.
type PairWords = dyn Fn(&[f32], &[f32]) -> Vec<u32>;

/// `store_bf16_pairs` of `lo` and `hi` (each `S::LANES` floats), through `S`.
///
/// # Safety
/// `S` is available on this CPU.
#[inline(always)]
unsafe fn pairs_of<S: super::simd::Simd>(lo: &[f32], hi: &[f32]) -> Vec<u32> {
    let mut out = vec![0u32; S::LANES];
    // SAFETY: `S::LANES` floats each and `S::LANES` words; the caller's instruction set.
    unsafe { S::store_bf16_pairs(out.as_mut_ptr(), S::load(lo.as_ptr()), S::load(hi.as_ptr())) };
    out
}

/// 64 inputs for the pair-word tests: ties both ways, the largest values that round to
/// infinity and stay finite, subnormals, the smallest normal, signed zeros, infinities, NaNs
/// with payloads (quieted), and random bit patterns from `seed`.
fn pair_word_inputs(seed: u32) -> Vec<f32> {
    let mut x = vec![
        1.0f32,
        f32::from_bits(0x3F80_8000),
        f32::from_bits(0x3F81_8000),
        f32::from_bits(0x3F80_7FFF),
        f32::MAX,
        f32::from_bits(0x7F7F_7FFF),
        f32::from_bits(0x0000_8001),
        f32::from_bits(0x807F_FFFF),
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0xFF80_0001),
        f32::from_bits(0x7FC1_2345),
        -3.5e-39,
        f32::MIN_POSITIVE,
    ];
    let mut state = seed;
    while x.len() < 64 {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        x.push(f32::from_bits(state));
    }
    x
}

#[test]
fn bf16_pair_words_round_as_the_scalar_conversion() {
    use crate::convert::f32_to_bf16_bits as bf;
    let x = pair_word_inputs(7);
    let (lo, hi) = (&x[..32], &x[32..]);
    let want: Vec<u32> =
        lo.iter().zip(hi).map(|(&a, &b)| u32::from(bf(a)) | u32::from(bf(b)) << 16).collect();
    let check = |level: SimdLevel, lanes: usize, run: &PairWords| {
        for c in (0..32).step_by(lanes) {
            let got = run(&lo[c..c + lanes], &hi[c..c + lanes]);
            assert_eq!(got, want[c..c + lanes], "{level:?} lanes {c}..");
        }
    };
    // SAFETY: scalar code runs anywhere.
    check(SimdLevel::Scalar, 1, &|a, b| unsafe { pairs_of::<super::simd::Scalar>(a, b) });
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512dq")]
        unsafe fn wide(a: &[f32], b: &[f32]) -> Vec<u32> {
            // SAFETY: AVX-512 enabled (the caller checked the CPU).
            unsafe { pairs_of::<super::simd::Avx512>(a, b) }
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn narrow(a: &[f32], b: &[f32]) -> Vec<u32> {
            // SAFETY: AVX2 enabled (the caller checked the CPU).
            unsafe { pairs_of::<super::simd::Avx2>(a, b) }
        }
        if detected_simd_level() >= SimdLevel::Avx512 {
            // SAFETY: checked above.
            check(SimdLevel::Avx512, 16, &|a, b| unsafe { wide(a, b) });
        }
        if detected_simd_level() >= SimdLevel::Avx2 {
            // SAFETY: checked above.
            check(SimdLevel::Avx2, 8, &|a, b| unsafe { narrow(a, b) });
        }
    }
}

#[test]
fn native_bf16_pair_words_are_the_scalar_conversions_but_for_subnormals() {
    use crate::convert::f32_to_bf16_bits as bf;
    // As above, with every subnormal read as a zero of its sign (the instruction's rule).
    let x = pair_word_inputs(11);
    let flushed = |v: f32| if v.is_subnormal() { 0.0f32.copysign(v) } else { v };
    let (lo, hi) = (&x[..32], &x[32..]);
    let want: Vec<u32> = lo
        .iter()
        .zip(hi)
        .map(|(&a, &b)| u32::from(bf(flushed(a))) | u32::from(bf(flushed(b))) << 16)
        .collect();
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512bf16")]
        unsafe fn native(a: &[f32], b: &[f32]) -> Vec<u32> {
            use super::simd::{Avx512, Simd};
            let mut out = vec![0u32; 16];
            // SAFETY: 16 floats each and 16 words; the caller checked the CPU.
            unsafe {
                let (a, b) = (Avx512::load(a.as_ptr()), Avx512::load(b.as_ptr()));
                Avx512::store_bf16_pairs_native(out.as_mut_ptr(), a, b);
            }
            out
        }
        if super::simd::native_bf16_pairs() {
            for c in (0..32).step_by(16) {
                // SAFETY: checked above.
                let got = unsafe { native(&lo[c..c + 16], &hi[c..c + 16]) };
                assert_eq!(got, want[c..c + 16], "lanes {c}..");
            }
            return;
        }
    }
    // Without the instruction the softmax takes the portable words: the scalar conversion,
    // which agrees with the flushed words wherever nothing is subnormal.
    let normal: Vec<usize> =
        (0..32).filter(|&i| !lo[i].is_subnormal() && !hi[i].is_subnormal()).collect();
    for i in normal {
        assert_eq!(u32::from(bf(lo[i])) | u32::from(bf(hi[i])) << 16, want[i], "lane {i}");
    }
}

/// `bf16::lane_dots` of 16 rows (`n` floats each, row `i` at `i * n`) for the kernel the
/// current choice resolves to, with the rows as lanes of `S` (16 / `LANES` calls).
///
/// # Safety
/// `S` is available on this CPU.
#[inline(always)]
unsafe fn lane_dots<S: super::simd::Simd>(o: &[f32], g: &[f32], n: usize) -> Vec<f32> {
    // Channel-major, the rows as lanes (as the backward packs `O` and `dO`).
    let t = |x: &[f32]| (0..n * 16).map(|e| x[(e % 16) * n + e / 16]).collect::<Vec<f32>>();
    let (ot, gt) = (t(o), t(g));
    let kern = crate::bf16gemm::micro::kernel();
    let mut out = vec![0f32; 16];
    for r in (0..16).step_by(S::LANES) {
        // SAFETY: `LANES` rows from `r` of every channel, 16 floats apart; the caller's level.
        unsafe {
            let rows = (ot.as_ptr().add(r), gt.as_ptr().add(r));
            S::store(out.as_mut_ptr().add(r), super::bf16::lane_dots::<S>(kern, rows, 16, n));
        }
    }
    out
}

#[test]
fn lane_dots_are_the_kernels_products_bit_for_bit() {
    // The backward's `D` with the rows as lanes against the diagonal of `O · dOᵀ` computed by
    // each bf16 kernel (real AMX tiles and `vdpbf16ps` where this CPU has them): random rows,
    // rows of ties and values that round to infinity, NaN, negative zeros, and tiny values
    // (subnormal bf16 inputs, products and sums near the subnormal range), at widths that
    // end inside a tile step.
    use crate::bf16gemm::{amx_available, bf16_dot_available, matmul_bf16, BfMat};
    let mut kernels = vec![Bf16Kernel::Portable, Bf16Kernel::AmxEmulated];
    if bf16_dot_available() {
        kernels.push(Bf16Kernel::Avx512Bf16);
    }
    if amx_available() {
        kernels.push(Bf16Kernel::Amx);
    }
    for n in [5, 37, 64, 80] {
        let mut o = rand_vec(16 * n, 11 + n as u64);
        let mut g = rand_vec(16 * n, 12 + n as u64);
        for c in 0..n {
            (o[n + c], g[n + c]) = (f32::from_bits(0x3F80_8000 + c as u32 * 0x1_0000), 1.5);
            (o[2 * n + c], g[2 * n + c]) = (f32::MAX, if c == 3 { -1.0 } else { 0.0 });
            (o[3 * n + c], g[3 * n + c]) = (-0.0, 2.0);
            // Products around 2^-126: fused chains keep what separate roundings lose.
            (o[5 * n + c], g[5 * n + c]) = (o[5 * n + c] * 2f32.powi(-60), 2f32.powi(-66));
            // Subnormal bf16 inputs against large ones.
            (o[6 * n + c], g[6 * n + c]) = (o[6 * n + c] * 1e-39, 2f32.powi(100));
            // Normal products whose sums cancel into the subnormal range.
            let sign = if c % 2 == 0 { 1.0 } else { -1.0 };
            (o[7 * n + c], g[7 * n + c]) =
                (sign * 2f32.powi(-63), 2f32.powi(-63) * (1.0 + c as f32 / 64.0));
        }
        o[4 * n + n / 2] = f32::NAN;
        let gt: Vec<f32> = (0..n * 16).map(|e| g[(e % 16) * n + e / 16]).collect();
        for choice in kernels.iter().copied() {
            let want: Vec<u32> = with_bf16_kernel(choice, || {
                let mut c = vec![0f32; 256];
                let (a, b) = (BfMat::f32(&o, 16, n), BfMat::f32(&gt, n, 16));
                matmul_bf16(a, b, &mut c, 16, false).unwrap();
                (0..16).map(|i| c[i * 17].to_bits()).collect()
            });
            let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            with_bf16_kernel(choice, || {
                // SAFETY: scalar code runs anywhere.
                let got = unsafe { lane_dots::<super::simd::Scalar>(&o, &g, n) };
                assert_eq!(bits(got), want, "{choice:?} scalar n {n}");
                #[cfg(target_arch = "x86_64")]
                {
                    #[target_feature(enable = "avx512f,avx512dq")]
                    unsafe fn wide(o: &[f32], g: &[f32], n: usize) -> Vec<f32> {
                        // SAFETY: AVX-512 enabled (the caller checked the CPU).
                        unsafe { lane_dots::<super::simd::Avx512>(o, g, n) }
                    }
                    #[target_feature(enable = "avx2,fma")]
                    unsafe fn narrow(o: &[f32], g: &[f32], n: usize) -> Vec<f32> {
                        // SAFETY: AVX2 enabled (the caller checked the CPU).
                        unsafe { lane_dots::<super::simd::Avx2>(o, g, n) }
                    }
                    if detected_simd_level() >= SimdLevel::Avx512 {
                        // SAFETY: checked above.
                        assert_eq!(bits(unsafe { wide(&o, &g, n) }), want, "{choice:?} avx512");
                    }
                    if detected_simd_level() >= SimdLevel::Avx2 {
                        // SAFETY: checked above.
                        assert_eq!(bits(unsafe { narrow(&o, &g, n) }), want, "{choice:?} avx2");
                    }
                }
            });
        }
    }
}

/// NaN at `(pos, col)` of K or V in a `[1, 1, s, d]` tensor (or in query row `pos % l`); a key
/// padding mask hides keys `200..`; the kernels' output and weights have the reference's NaN
/// positions and values at every SIMD level, also when the NaN sits in a fully masked key tile
/// (PyTorch adds masks, so NaN + -inf and 0·NaN are NaN), and with causal masking instead of
/// the padding. With bf16 products (keys and values scanned as they are packed once per
/// head) the NaN positions are the same.
#[test]
fn nan_in_masked_keys_and_values_follows_the_reference_at_tile_boundaries() {
    let (l, s, d) = (70usize, 600usize, 4usize);
    let dims = AttnDims { batch: 1, heads_q: 1, heads_kv: 1, l, s, d, dv: d };
    let (ql, kl) = (Layout4::contiguous(1, l, d), Layout4::contiguous(1, s, d));
    let pad: Vec<u8> = (0..s).map(|j| (j >= 200) as u8).collect();
    for (causal, bf16) in [(false, false), (true, false), (false, true), (true, true)] {
        for pos in [0usize, 255, 256, 511, 599] {
            for at in ["k", "v", "q"] {
                let mut q = rand_vec(l * d, 1);
                let mut k = rand_vec(s * d, 2);
                let mut v = rand_vec(s * d, 3);
                match at {
                    "k" => k[pos * d + 1] = f32::NAN,
                    "v" => v[pos * d + 1] = f32::NAN,
                    _ => q[pos % l * d + 1] = f32::NAN,
                }
                let mut p = AttnParams::new(dims);
                (p.causal, p.bf16_products) = (causal, bf16);
                if !causal {
                    p.masks[0] = Some(MaskView::Bool {
                        data: &pad,
                        strides: [s, 0, 0, 1],
                        true_means_masked: true,
                    });
                }
                let (eout, _) = reference::forward(&p, &q, ql, &k, kl, &v, kl);
                let ew = reference::weights(&p, &q, ql, &k, kl, false);
                for level in levels() {
                    with_simd_level(level, || {
                        let mut out = vec![0f32; l * d];
                        let mut lse = vec![0f32; 2 * l];
                        flash_forward(&p, &q, ql, &k, kl, &v, kl, &mut out, ql, &mut lse).unwrap();
                        let mut w = vec![0f32; l * s];
                        attention_weights(&p, &q, ql, &k, kl, &lse, false, &mut w).unwrap();
                        let what = format!("{level:?} causal {causal} bf16 {bf16} pos {pos} {at}");
                        for (name, got, want) in [("out", &out, &eout), ("weights", &w, &ew)] {
                            for (i, (&g, &e)) in got.iter().zip(want.iter()).enumerate() {
                                assert_eq!(
                                    g.is_nan(),
                                    e.is_nan(),
                                    "{what}: {name}[{i}] {g} vs {e}"
                                );
                                // The bf16 products round: only their NaN positions are exact.
                                if e.is_finite() && !bf16 {
                                    assert!(
                                        (g as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()),
                                        "{what}: {name}[{i}]"
                                    );
                                }
                            }
                        }
                        // A NaN key, visible or not, makes every row NaN; a NaN value makes its
                        // column NaN in every row (0·NaN is NaN); a NaN query its own row.
                        for (i, x) in out.iter().enumerate() {
                            let hit = match at {
                                "k" => true,
                                "v" => i % d == 1,
                                _ => i / d == pos % l,
                            };
                            assert_eq!(x.is_nan(), hit, "{what}: out[{i}] = {x}");
                        }
                    });
                }
            }
        }
    }
}

/// A NaN in the upstream gradient `dO` reaches every key's gradient of its head through
/// `dS = P ∘ (dP − D)` (0·NaN is NaN, masked keys included, as in PyTorch's backward): the
/// backward must not skip the masked or causal tiles of such a head, nor write its unreached
/// query blocks' `dQ` as 0. The other head stays finite and keeps its skipping.
#[test]
fn nan_in_the_upstream_gradient_follows_the_reference_past_masked_tiles() {
    let (l, s, d) = (70usize, 300usize, 4usize);
    let dims = AttnDims { batch: 1, heads_q: 2, heads_kv: 2, l, s, d, dv: d };
    let (ql, kl) = (Layout4::contiguous(2, l, d), Layout4::contiguous(2, s, d));
    // Keys 0..256 hidden (two whole key tiles of the backward), the rest visible.
    let pad: Vec<u8> = (0..s).map(|j| (j < 256) as u8).collect();
    let (q, k, v) = (rand_vec(2 * l * d, 21), rand_vec(2 * s * d, 22), rand_vec(2 * s * d, 23));
    for (causal, bf16) in [(false, false), (true, false), (false, true), (true, true)] {
        for row in [0usize, 69] {
            let mut dout = rand_vec(2 * l * d, 24);
            dout[row * d + 2] = f32::NAN; // head 0 only
            let mut p = AttnParams::new(dims);
            (p.causal, p.bf16_products) = (causal, bf16);
            if !causal {
                p.masks[0] = Some(MaskView::Bool {
                    data: &pad,
                    strides: [s, 0, 0, 1],
                    true_means_masked: true,
                });
            }
            let (edq, edk, edv) = reference::backward(&p, &q, ql, &k, kl, &v, kl, &dout, ql);
            for level in levels() {
                with_simd_level(level, || {
                    let mut out = vec![0f32; 2 * l * d];
                    let mut lse = vec![0f32; 4 * l];
                    flash_forward(&p, &q, ql, &k, kl, &v, kl, &mut out, ql, &mut lse).unwrap();
                    let (mut dq, mut dk, mut dv) =
                        (vec![0f32; 2 * l * d], vec![0f32; 2 * s * d], vec![0f32; 2 * s * d]);
                    flash_backward(
                        &p, &q, ql, &k, kl, &v, kl, &out, ql, &dout, ql, &lse, &mut dq, ql,
                        &mut dk, kl, &mut dv, kl,
                    )
                    .unwrap();
                    let what = format!("{level:?} causal {causal} bf16 {bf16} row {row}");
                    for (name, got, want) in
                        [("dq", &dq, &edq), ("dk", &dk, &edk), ("dv", &dv, &edv)]
                    {
                        for (i, (&g, &e)) in got.iter().zip(want.iter()).enumerate() {
                            assert_eq!(g.is_nan(), e.is_nan(), "{what}: {name}[{i}] {g} vs {e}");
                        }
                    }
                    // Every key gradient of head 0 is NaN (0·NaN), none of head 1's.
                    assert!(dk[..s * d].iter().all(|x| x.is_nan()), "{what}: dk of head 0");
                    assert!(dk[s * d..].iter().all(|x| x.is_finite()), "{what}: dk of head 1");
                });
            }
        }
    }
}

/// Query, key and value as views into one packed buffer (rows `[q | k | v | gap]`), as packed
/// projections give them: a NaN in a masked key still reaches every row (the one-pass scan of
/// the buffer sees it and the heads fall back to reading every key), and a NaN in the gap,
/// which no view covers, changes nothing.
#[test]
fn packed_views_with_nan_in_masked_keys_or_outside_the_views_follow_the_reference() {
    let (l, d) = (300usize, 4usize);
    let ld = 3 * d + 1;
    let dims = AttnDims { batch: 1, heads_q: 1, heads_kv: 1, l, s: l, d, dv: d };
    let lay = Layout4 { batch: l * ld, head: d, seq: ld };
    let pad: Vec<u8> = (0..l).map(|j| (j >= 100) as u8).collect();
    let mut p = AttnParams::new(dims);
    p.masks[0] =
        Some(MaskView::Bool { data: &pad, strides: [l, 0, 0, 1], true_means_masked: true });
    for nan_at in [None, Some(250 * ld + d + 2), Some(250 * ld + 3 * d)] {
        let mut buf = rand_vec(l * ld, 21);
        if let Some(i) = nan_at {
            buf[i] = f32::NAN;
        }
        let (q, k, v) = (&buf[..], &buf[d..], &buf[2 * d..]);
        let (eout, _) = reference::forward(&p, q, lay, k, lay, v, lay);
        for level in levels() {
            with_simd_level(level, || {
                let ol = Layout4::contiguous(1, l, d);
                let (mut out, mut lse) = (vec![0f32; l * d], vec![0f32; 2 * l]);
                flash_forward(&p, q, lay, k, lay, v, lay, &mut out, ol, &mut lse).unwrap();
                let what = format!("{level:?} nan at {nan_at:?}");
                for (i, (&g, &e)) in out.iter().zip(&eout).enumerate() {
                    assert_eq!(g.is_nan(), e.is_nan(), "{what}: out[{i}] {g} vs {e}");
                    if e.is_finite() {
                        assert!((g as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()), "{what}: [{i}]");
                    }
                }
                // The masked key's NaN makes every row NaN; the gap's leaves all finite.
                let key_nan = nan_at == Some(250 * ld + d + 2);
                assert!(out.iter().all(|x| x.is_nan() == key_nan), "{what}");
            });
        }
    }
}

/// A row masked by a huge finite value everywhere (HF-style `-1e9` or `f32::MIN` masks) gets
/// uniform weights, as the composed softmax gives, also in the weights pass and the backward.
#[test]
fn rows_with_a_huge_finite_mask_keep_their_precision() {
    let (l, s, d) = (3usize, 5usize, 4usize);
    let dims = AttnDims { batch: 1, heads_q: 1, heads_kv: 1, l, s, d, dv: d };
    let (ql, kl) = (Layout4::contiguous(1, l, d), Layout4::contiguous(1, s, d));
    let (q, k, v) = (rand_vec(l * d, 4), rand_vec(s * d, 5), rand_vec(s * d, 6));
    for fill in [-1e9f32, f32::MIN, -3.0e38] {
        // Row 0 is masked by `fill` everywhere; row 1 at two keys; row 2 is open.
        let mut mask = vec![0f32; l * s];
        mask[..s].iter_mut().for_each(|m| *m = fill);
        mask[s] = fill;
        mask[s + 3] = fill;
        let mut p = AttnParams::new(dims);
        p.masks[0] = Some(MaskView::Additive { data: &mask, strides: [0, 0, s, 1] });
        let ew = reference::weights(&p, &q, ql, &k, kl, false);
        for level in levels() {
            with_simd_level(level, || {
                let mut out = vec![0f32; l * d];
                let mut lse = vec![0f32; 2 * l];
                flash_forward(&p, &q, ql, &k, kl, &v, kl, &mut out, ql, &mut lse).unwrap();
                let mut w = vec![0f32; l * s];
                attention_weights(&p, &q, ql, &k, kl, &lse, false, &mut w).unwrap();
                // Row 0: in f32, score + fill rounds to fill for every key (|score| < 32), so
                // the weights are uniform, as PyTorch's f32 softmax gives. (The f64 reference
                // keeps the scores' differences there, so it is the oracle for rows 1 and 2.)
                for (j, &g) in w[..s].iter().enumerate() {
                    assert!(
                        (g - 1.0 / s as f32).abs() <= 1e-6,
                        "{level:?} fill {fill}: w[0][{j}] {g}"
                    );
                }
                for (i, (&g, &e)) in w.iter().zip(&ew).enumerate().skip(s) {
                    assert!(
                        (g as f64 - e).abs() <= 1e-5,
                        "{level:?} fill {fill}: w[{i}] {g} vs {e}"
                    );
                }
            });
        }
    }
}

/// A NaN query in a query block whose keys are all masked: the row is NaN (NaN + -inf), as
/// the reference and PyTorch give, not the zero row of a skipped tile.
#[test]
fn nan_query_in_a_fully_masked_block_is_nan() {
    let (l, s, d) = (70usize, 300usize, 4usize);
    let dims = AttnDims { batch: 1, heads_q: 1, heads_kv: 1, l, s, d, dv: d };
    let (ql, kl) = (Layout4::contiguous(1, l, d), Layout4::contiguous(1, s, d));
    let mut q = rand_vec(l * d, 7);
    q[66 * d] = f32::NAN; // in the second query block, which is fully masked
    let (k, v) = (rand_vec(s * d, 8), rand_vec(s * d, 9));
    let mut mask = vec![0f32; l * s];
    mask[64 * s..].iter_mut().for_each(|m| *m = f32::NEG_INFINITY);
    let mut p = AttnParams::new(dims);
    p.masks[0] = Some(MaskView::Additive { data: &mask, strides: [0, 0, s, 1] });
    let (eout, _) = reference::forward(&p, &q, ql, &k, kl, &v, kl);
    for level in levels() {
        with_simd_level(level, || {
            let mut out = vec![0f32; l * d];
            let mut lse = vec![0f32; 2 * l];
            flash_forward(&p, &q, ql, &k, kl, &v, kl, &mut out, ql, &mut lse).unwrap();
            for (i, (&g, &e)) in out.iter().zip(&eout).enumerate() {
                assert_eq!(g.is_nan(), e.is_nan(), "{level:?}: out[{i}] {g} vs {e}");
            }
            assert!(out[66 * d..67 * d].iter().all(|x| x.is_nan()));
            assert!(out[65 * d..66 * d].iter().all(|&x| x == 0.0));
        });
    }
}

/// The kernels run with subnormal results flushed to zero (`crate::fpenv`: on Intel each
/// subnormal result costs an assist) and leave the calling thread's setting as it was: values
/// of 2^-130 (subnormal, read as they are) attended with weight 1/2 give 2^-131 exactly in the
/// reference and 0 here; values of 2^-100 give 2^-101 in both.
#[test]
fn subnormal_results_are_flushed_inside_the_kernels_only() {
    let (l, s, d) = (3usize, 2usize, 4usize);
    let dims = AttnDims { batch: 1, heads_q: 1, heads_kv: 1, l, s, d, dv: d };
    let (ql, kl) = (Layout4::contiguous(1, l, d), Layout4::contiguous(1, s, d));
    let (q, k) = (vec![0.0f32; l * d], vec![0.0f32; s * d]);
    let p = AttnParams::new(dims);
    for (exp, flushed) in [(-130, true), (-100, false)] {
        let v: Vec<f32> = (0..s * d).map(|i| if i < d { 2f32.powi(exp) } else { 0.0 }).collect();
        let (eout, _) = reference::forward(&p, &q, ql, &k, kl, &v, kl);
        assert_eq!(eout[0], 2f64.powi(exp - 1));
        for level in levels() {
            with_simd_level(level, || {
                let mut out = vec![1f32; l * d];
                let mut lse = vec![0f32; 2 * l];
                flash_forward(&p, &q, ql, &k, kl, &v, kl, &mut out, ql, &mut lse).unwrap();
                let want = if flushed { 0.0 } else { eout[0] as f32 };
                assert!(out.iter().all(|&o| o == want), "{level:?}, 2^{exp}: {out:?}");
            });
        }
    }
    // This small call ran its tasks on this thread; subnormal results are back here.
    let tiny = std::hint::black_box(2f32.powi(-100)) * std::hint::black_box(2f32.powi(-30));
    assert_eq!(tiny, 2f32.powi(-130));
}

/// A saturated softmax (each row one-hot: the best key's score leads by hundreds) has query
/// and key gradients of 0 (the f64 reference: below 1e-100), because `dP_j - D` cancels
/// exactly when `O = V_j`. The kernel's `D` must be summed as `dP` is for that: summed in
/// another order it left rounding noise of ~1e-4 here, which the scale and the projections
/// of a MultiheadAttention amplify (PyTorch's kernel gives 0). With bf16 products `dP` is the
/// bf16 kernel's sum, in its order (the tiles' even and odd chains, `vdpbf16ps`' pairs), and
/// `D` follows it (a sequential `D` left up to 3e-6 here with keys of 10, 1.4e13 with keys
/// of 1e20).
#[test]
fn saturated_softmax_gives_zero_query_and_key_gradients() {
    let runs: Vec<(SimdLevel, Bf16Kernel, bool)> = levels()
        .into_iter()
        .map(|l| (l, Bf16Kernel::Auto, false))
        .chain(product_runs().into_iter().map(|(l, k)| (l, k, true)))
        .collect();
    for &(l, d, causal) in
        &[(4usize, 4usize, false), (40, 16, false), (70, 70, false), (33, 33, true), (9, 80, false)]
    {
        let s = d;
        let dims = AttnDims { batch: 2, heads_q: 1, heads_kv: 1, l, s, d, dv: d };
        let (ql, kl) = (Layout4::contiguous(1, l, d), Layout4::contiguous(1, s, d));
        // Keys 10·e_j; query i near e_(i mod s): its score for key i mod s leads by ~900.
        let mut k = vec![0f32; 2 * s * d];
        (0..2 * s).for_each(|j| k[j * d + j % s] = 10.0);
        let mut q: Vec<f32> = rand_vec(2 * l * d, 11).iter().map(|x| 0.05 * x).collect();
        (0..2 * l).for_each(|i| q[i * d + (i % l) % s] += 1.0);
        let (v, dout) = (rand_vec(2 * s * d, 12), rand_vec(2 * l * d, 13));
        let mut p = AttnParams::new(dims);
        (p.scale, p.causal) = (100.0, causal);
        for &(level, kern, bf) in &runs {
            // With bf16 products `dV` sums the rounded `dO` rows (the probabilities are 0 and
            // 1, exact in bf16).
            let (q, dout) = match bf {
                true => (round_bf16(&q), round_bf16(&dout)),
                false => (q.clone(), dout.clone()),
            };
            let v = if bf { round_bf16(&v) } else { v.clone() };
            let (edq, edk, edv) = reference::backward(&p, &q, ql, &k, kl, &v, kl, &dout, ql);
            assert!(edq.iter().chain(&edk).all(|x| x.abs() < 1e-100), "not saturated");
            let p = AttnParams { bf16_products: bf, ..p };
            with_simd_level(level, || {
                with_bf16_kernel(kern, || {
                    let mut out = vec![0f32; 2 * l * d];
                    let mut lse = vec![0f32; 4 * l];
                    flash_forward(&p, &q, ql, &k, kl, &v, kl, &mut out, ql, &mut lse).unwrap();
                    let (mut dq, mut dk, mut dv) =
                        (vec![1f32; 2 * l * d], vec![1f32; 2 * s * d], vec![0f32; 2 * s * d]);
                    flash_backward(
                        &p, &q, ql, &k, kl, &v, kl, &out, ql, &dout, ql, &lse, &mut dq, ql,
                        &mut dk, kl, &mut dv, kl,
                    )
                    .unwrap();
                    let what = format!("{level:?} {kern:?} bf16 {bf} l {l} d {d} causal {causal}");
                    let worst = |g: &[f32]| g.iter().fold(0f32, |m, x| m.max(x.abs()));
                    assert!(worst(&dq) <= 1e-7, "{what}: |dq| up to {}", worst(&dq));
                    assert!(worst(&dk) <= 1e-7, "{what}: |dk| up to {}", worst(&dk));
                    for (i, (&g, &e)) in dv.iter().zip(&edv).enumerate() {
                        assert!(
                            (g as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()),
                            "{what}: dv[{i}] {g} vs {e}"
                        );
                    }
                })
            });
        }
    }
}

/// `x` rounded to bf16 (nearest even) and back.
fn round_bf16(x: &[f32]) -> Vec<f32> {
    use crate::convert::{bf16_bits_to_f32, f32_to_bf16_bits};
    x.iter().map(|&v| bf16_bits_to_f32(f32_to_bf16_bits(v))).collect()
}

/// A case's masks, inputs, and its q, k and v rounded to bf16 (the operands the bf16 products
/// see, for the exact reference).
fn rounded_case(c: &Case) -> (Vec<MaskData>, Inputs, [Vec<f32>; 3]) {
    let masks = c.masks.iter().enumerate().map(|(n, &k)| make_mask(c, k, 100 + n as u64)).collect();
    let x = inputs(c, 42);
    let r = [&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]].map(round_bf16);
    (masks, x, r)
}

/// The products' runs of the bf16 tests: every SIMD level on the default kernel, and the tile
/// kernels (their emulation; real AMX tiles where granted) at the detected level.
fn product_runs() -> Vec<(SimdLevel, Bf16Kernel)> {
    let mut runs: Vec<_> = levels().into_iter().map(|l| (l, Bf16Kernel::Auto)).collect();
    runs.push((detected_simd_level(), Bf16Kernel::AmxEmulated));
    if crate::bf16gemm::amx_available() {
        runs.push((detected_simd_level(), Bf16Kernel::Amx));
    }
    runs
}

#[test]
fn bf16_products_multiply_rounded_operands_and_round_the_probabilities() {
    let mut odd = Case::new(2, 2, 70, 300, 33);
    odd.dv = 17;
    odd.masks = vec![MaskKind::AddLS, MaskKind::KeyPad];
    let mut gqa = Case::new(1, 4, 65, 65, 64);
    (gqa.hkv, gqa.causal, gqa.scale) = (2, true, Some(-0.3));
    let mut packed = Case::new(2, 2, 40, 40, 16);
    packed.packed = true;
    let mut full = Case::new(3, 2, 9, 20, 8);
    full.masks = vec![MaskKind::FullRows];
    let mut drop = Case::new(1, 2, 33, 33, 24);
    drop.dropout = Some(0.2);
    for c in [odd, gqa, packed, full, drop] {
        let (masks, x, [qr, kr, vr]) = rounded_case(&c);
        let p = params(&c, &masks);
        let pb = AttnParams { bf16_products: true, ..params(&c, &masks) };
        let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
        // The exact attention of the rounded operands.
        let (eout, else_) = reference::forward(&p, &qr, x.ql, &kr, x.kl, &vr, x.vl);
        let rows = c.b * c.hq * c.l;
        let lsel = Layout4::contiguous(c.hq, c.l, 1);
        for (level, kern) in product_runs() {
            with_simd_level(level, || {
                with_bf16_kernel(kern, || {
                    let run = |p: &AttnParams, q: &[f32], k: &[f32], v: &[f32]| {
                        let mut out = vec![f32::NAN; x.out_len];
                        let mut lse = vec![f32::NAN; 2 * rows];
                        flash_forward(p, q, x.ql, k, x.kl, v, x.vl, &mut out, x.ol, &mut lse)
                            .unwrap();
                        let lse: Vec<f32> = (0..rows).map(|r| lse[r] + lse[rows + r]).collect();
                        (out, lse)
                    };
                    let (out, lse) = run(&pb, q, k, v);
                    // Scores from the rounded q and k (the statistics are that exact), outputs
                    // within the rounding of the probabilities (half a bf16 step of each).
                    assert_close("lse", &c, &lse, lsel, &else_, [c.b, c.hq, c.l, 1], 2e-5);
                    let sizes = [c.b, c.hq, c.l, c.dv];
                    assert_close("out", &c, &out, x.ol, &eout, sizes, 4e-3);
                    // ... and the probabilities were rounded: the f32 kernel on the same rounded
                    // operands differs.
                    let (out32, _) = run(&p, &qr, &kr, &vr);
                    let diff =
                        out.iter().zip(&out32).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(diff > 0.0, "no rounding seen in {c:?}");
                })
            });
        }
    }
}

#[test]
fn native_bf16_probabilities_give_the_portable_bits() {
    // The softmax's pair words from `vcvtne2ps2bf16` and from the portable rounding: the same
    // outputs and statistics, bit for bit, with masks, a causal band, dropout, odd widths and
    // a NaN query. Where the CPU lacks the instruction both runs take the portable words.
    use std::sync::atomic::Ordering;
    let mut odd = Case::new(2, 2, 70, 300, 33);
    (odd.dv, odd.masks) = (17, vec![MaskKind::AddLS, MaskKind::KeyPad]);
    let mut causal = Case::new(1, 4, 130, 130, 64);
    (causal.hkv, causal.causal, causal.dropout) = (2, true, Some(0.2));
    for c in [odd, causal] {
        let (masks, mut x, _) = rounded_case(&c);
        x.q[x.qo + 5] = f32::NAN;
        let pb = AttnParams { bf16_products: true, ..params(&c, &masks) };
        let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
        let rows = c.b * c.hq * c.l;
        let run = || {
            let mut out = vec![f32::NAN; x.out_len];
            let mut lse = vec![f32::NAN; 2 * rows];
            flash_forward(&pb, q, x.ql, k, x.kl, v, x.vl, &mut out, x.ol, &mut lse).unwrap();
            (
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                lse.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            )
        };
        #[cfg(target_arch = "x86_64")]
        super::simd::PORTABLE_PAIRS.store(true, Ordering::Relaxed);
        let portable = run();
        #[cfg(target_arch = "x86_64")]
        super::simd::PORTABLE_PAIRS.store(false, Ordering::Relaxed);
        let native = run();
        assert!(portable.0.iter().any(|&b| f32::from_bits(b).is_finite() && b != 0), "{c:?}");
        assert_eq!(portable, native, "{c:?}");
    }
}

#[test]
fn bf16_keys_and_values_packed_once_per_head_give_the_per_block_bits() {
    // The query blocks are independent: the rows of a long call (keys and values packed once
    // per head) equal, bit for bit, the same rows computed by short calls of one query block
    // each (which pack their own key blocks; a causal one with its diagonal moved to the
    // block's first row). Keys past one block and not a multiple of it, odd head dimensions,
    // GQA, with and without a key padding mask (the blocks it trims pack their own), keys and
    // values strided in one packed projection (packed from their rows as they are, without the
    // contiguous copy), and causal calls, whose query blocks read the first keys of a packed
    // block (in whole tile steps) or pack their own (an odd count, bottom-right with a
    // cache), on every kernel this CPU runs.
    let mut cases = Vec::new();
    let mut causal = Case::new(1, 4, 300, 300, 64);
    (causal.hkv, causal.causal) = (2, true);
    cases.push(causal);
    let mut cached = Case::new(1, 2, 130, 401, 40);
    (cached.causal, cached.offset) = (true, 271);
    cases.push(cached);
    for masks in [vec![], vec![MaskKind::KeyPad]] {
        let mut c = Case::new(2, 4, 150, 300, 33);
        (c.hkv, c.dv, c.masks) = (2, 17, masks);
        cases.push(c);
    }
    let mut packed = Case::new(1, 2, 300, 300, 24);
    packed.packed = true;
    cases.push(packed);
    for c in cases {
        let (masks, x, _) = rounded_case(&c);
        let p = AttnParams { bf16_products: true, ..params(&c, &masks) };
        let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
        for (level, kern) in product_runs() {
            with_simd_level(level, || {
                with_bf16_kernel(kern, || {
                    let rows = c.b * c.hq * c.l;
                    let mut out = vec![f32::NAN; x.out_len];
                    let mut lse = vec![f32::NAN; 2 * rows];
                    flash_forward(&p, q, x.ql, k, x.kl, v, x.vl, &mut out, x.ol, &mut lse).unwrap();
                    for i0 in (0..c.l).step_by(FWD_BR) {
                        let n = FWD_BR.min(c.l - i0);
                        let dims = AttnDims { l: n, ..p.dims };
                        let offset = p.offset + i0 as isize;
                        let short = AttnParams { dims, offset, ..p };
                        let ol = Layout4::contiguous(c.hq, n, c.dv);
                        let mut o = vec![f32::NAN; c.b * c.hq * n * c.dv];
                        let mut ls = vec![f32::NAN; 2 * c.b * c.hq * n];
                        let qs = &q[i0 * x.ql.seq..];
                        flash_forward(&short, qs, x.ql, k, x.kl, v, x.vl, &mut o, ol, &mut ls)
                            .unwrap();
                        for (b, h, i, ch) in (0..c.b).flat_map(|b| {
                            (0..c.hq).flat_map(move |h| {
                                (0..n).flat_map(move |i| (0..c.dv).map(move |ch| (b, h, i, ch)))
                            })
                        }) {
                            let long = out[x.ol.offset(b, h, i0 + i) + ch];
                            let one = o[ol.offset(b, h, i) + ch];
                            assert_eq!(
                                long.to_bits(),
                                one.to_bits(),
                                "{kern:?} {level:?} masks {:?} row {} of ({b}, {h}) channel {ch}",
                                c.masks,
                                i0 + i
                            );
                        }
                    }
                })
            });
        }
    }
}

#[test]
fn bf16_bits_in_give_the_bits_of_their_f32_values() {
    // `flash_forward_bf16_uninit` reads q, k and v as bf16 bits where `flash_forward_uninit`
    // rounds f32 values to them: its output is the f32 output rounded once, and the
    // statistics are the same bits. Query blocks
    // over prepacked keys and single blocks, odd head and value widths, GQA, masks, causal
    // bands with a cache offset, a window, dropout, packed (strided) projections, a NaN query
    // and an infinite key, on every kernel this CPU runs; and without the bf16 products the
    // bits are refused with an error.
    use crate::convert::f32_to_bf16_bits;
    let mut cases = Vec::new();
    let mut odd = Case::new(2, 4, 150, 300, 33);
    (odd.hkv, odd.dv, odd.masks) = (2, 17, vec![MaskKind::AddLS, MaskKind::KeyPad]);
    cases.push(odd);
    let mut causal = Case::new(1, 2, 200, 260, 64);
    (causal.causal, causal.offset) = (true, 60);
    cases.push(causal);
    let mut window = Case::new(1, 2, 130, 130, 24);
    (window.causal, window.window) = (true, Window { left: Some(40), right: None });
    cases.push(window);
    let mut small = Case::new(3, 2, 9, 20, 8);
    small.dropout = Some(0.25);
    cases.push(small);
    let mut packed = Case::new(2, 2, 100, 100, 16);
    packed.packed = true;
    cases.push(packed);
    for (n, c) in cases.iter().enumerate() {
        let (masks, mut x, _) = rounded_case(c);
        if n == 1 {
            // A NaN query and an infinite key in the causal case, and in the second head an
            // infinite value at the last key, which every row of that head then reads (a
            // non-finite head skips no key block: the packed blocks' scan must see it).
            x.q[x.qo + 5] = f32::NAN;
            x.k[x.ko + 3 * x.kl.seq] = f32::INFINITY;
            x.v[x.vo + x.vl.head + (c.s - 1) * x.vl.seq] = f32::INFINITY;
        }
        let bits = |v: &[f32]| -> Vec<u16> { v.iter().map(|&f| f32_to_bf16_bits(f)).collect() };
        let (qb, kb, vb) = (bits(&x.q), bits(&x.k), bits(&x.v));
        let p = AttnParams { bf16_products: true, ..params(c, &masks) };
        let rows = c.b * c.hq * c.l;
        for (level, kern) in product_runs() {
            with_simd_level(level, || {
                with_bf16_kernel(kern, || {
                    let mut o32 = vec![f32::NAN; x.out_len];
                    let mut l32 = vec![f32::NAN; 2 * rows];
                    let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
                    flash_forward(&p, q, x.ql, k, x.kl, v, x.vl, &mut o32, x.ol, &mut l32).unwrap();
                    let mut o16: Vec<u16> = Vec::with_capacity(x.out_len);
                    let mut l16 = vec![f32::NAN; 2 * rows];
                    let (q, k, v) = (&qb[x.qo..], &kb[x.ko..], &vb[x.vo..]);
                    let dst = &mut o16.spare_capacity_mut()[..x.out_len];
                    // Elements a strided output view skips keep their NaN, as in `o32`.
                    dst.iter_mut().for_each(|slot| {
                        slot.write(f32_to_bf16_bits(f32::NAN));
                    });
                    let (ql, kl, vl, ol) = (x.ql, x.kl, x.vl, x.ol);
                    let lse = Some(&mut l16[..]);
                    flash_forward_bf16_uninit(&p, q, ql, k, kl, v, vl, dst, ol, lse).unwrap();
                    // SAFETY: every element was written above (NaN), then by the kernel.
                    unsafe { o16.set_len(x.out_len) };
                    // The output is the f32 entry's, rounded once; the statistics its own.
                    let rounded: Vec<u16> = o32.iter().map(|&f| f32_to_bf16_bits(f)).collect();
                    let differ = rounded.iter().zip(&o16).filter(|(a, b)| a != b).count();
                    assert_eq!(differ, 0, "{kern:?} {level:?} out, {c:?}");
                    let differ = l32.iter().zip(&l16).filter(|(a, b)| a.to_bits() != b.to_bits());
                    assert_eq!(differ.count(), 0, "{kern:?} {level:?} lse, {c:?}");
                    if n == 1 {
                        let nan = o16.iter().any(|&v| v & 0x7f80 == 0x7f80 && v & 0x7f != 0);
                        assert!(nan, "the NaN query reached the output");
                    }
                })
            });
        }
        let off = AttnParams { bf16_products: false, ..p };
        let mut o: Vec<u16> = Vec::with_capacity(x.out_len);
        let dst = &mut o.spare_capacity_mut()[..x.out_len];
        let (q, k, v) = (&qb[x.qo..], &kb[x.ko..], &vb[x.vo..]);
        let e = flash_forward_bf16_uninit(&off, q, x.ql, k, x.kl, v, x.vl, dst, x.ol, None);
        assert!(matches!(e, Err(KernelError::InvalidArgument { name: "bf16_products", .. })));
    }
}

#[test]
fn bf16_packed_keys_give_the_same_bits_in_buffers_a_previous_call_left() {
    // A thread keeps the packed key and value buffers of its last forward for the next one
    // (`prepack::KEPT`): the words a task reads are all written again (zero padding past the
    // head dimension and the last keys included), so a thread whose buffers hold the words of
    // non-finite keys and values from a larger call gives the bits of a fresh thread. Odd
    // head dimensions, keys past a whole block, GQA and causal blocks.
    let mut odd = Case::new(2, 4, 150, 300, 33);
    (odd.hkv, odd.dv) = (2, 17);
    let mut causal = Case::new(1, 2, 200, 200, 24);
    causal.causal = true;
    let mut big = Case::new(2, 4, 300, 700, 64);
    big.hkv = 4;
    let (bmasks, mut bx, _) = rounded_case(&big);
    bx.k.iter_mut().for_each(|x| *x = f32::NAN);
    bx.v.iter_mut().for_each(|x| *x = f32::INFINITY);
    let bp = AttnParams { bf16_products: true, ..params(&big, &bmasks) };
    for c in [odd, causal] {
        let (masks, x, _) = rounded_case(&c);
        let p = AttnParams { bf16_products: true, ..params(&c, &masks) };
        let run = |p: &AttnParams, x: &Inputs, rows: usize| {
            let mut out = vec![f32::NAN; x.out_len];
            let mut lse = vec![f32::NAN; 2 * rows];
            let (q, k, v) = (&x.q[x.qo..], &x.k[x.ko..], &x.v[x.vo..]);
            flash_forward(p, q, x.ql, k, x.kl, v, x.vl, &mut out, x.ol, &mut lse).unwrap();
            out
        };
        for (level, kern) in product_runs() {
            let on = |stale: bool| {
                std::thread::scope(|s| {
                    s.spawn(|| {
                        with_simd_level(level, || {
                            with_bf16_kernel(kern, || {
                                if stale {
                                    run(&bp, &bx, big.b * big.hq * big.l);
                                }
                                run(&p, &x, c.b * c.hq * c.l)
                            })
                        })
                    })
                    .join()
                    .unwrap()
                })
            };
            let (fresh, reused) = (on(false), on(true));
            assert!(fresh.iter().all(|v| v.is_finite()), "{kern:?} {level:?} {c:?}");
            let same = fresh.iter().zip(&reused).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{kern:?} {level:?} {c:?}: reused buffers changed the output");
        }
    }
}

#[test]
fn bf16_backward_packing_keys_once_per_chunk_gives_the_per_block_bits() {
    // The backward packs a chunk's keys and values once for all its query blocks (rounded
    // rows for the score tiles, transposed key pairs for dQ) where each key block packed its
    // own: dq, dk and dv are the same bits. Several chunks (1500 keys), causal blocks cut at
    // whole tile steps and bottom-right ones cut anywhere, odd head dimensions, GQA, masks,
    // dropout and strided packed projections, on every kernel this CPU runs.
    let mut long = Case::new(1, 2, 200, 1500, 64);
    (long.hkv, long.masks) = (1, vec![MaskKind::AddLS, MaskKind::KeyPad]);
    let mut causal = Case::new(2, 2, 300, 300, 40);
    (causal.causal, causal.dv) = (true, 24);
    let mut cached = Case::new(1, 2, 90, 1111, 20);
    (cached.causal, cached.offset) = (true, 1021);
    let mut drop = Case::new(1, 2, 130, 130, 64);
    (drop.dropout, drop.causal) = (Some(0.2), true);
    let mut packed = Case::new(2, 2, 100, 100, 16);
    packed.packed = true;
    for c in [long, causal, cached, drop, packed] {
        let (masks, x, _) = rounded_case(&c);
        let p = AttnParams { bf16_products: true, ..params(&c, &masks) };
        for (level, kern) in product_runs() {
            with_simd_level(level, || {
                with_bf16_kernel(kern, || {
                    use std::sync::atomic::Ordering::Relaxed;
                    let once = run_kernels(&c, &p, &x);
                    backward::PACK_PER_BLOCK.store(true, Relaxed);
                    let per_block = run_kernels(&c, &p, &x);
                    backward::PACK_PER_BLOCK.store(false, Relaxed);
                    for (what, a, b) in [
                        ("dq", &once.dq, &per_block.dq),
                        ("dk", &once.dk, &per_block.dk),
                        ("dv", &once.dv, &per_block.dv),
                    ] {
                        let same = a.iter().zip(b.iter()).all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(same, "{kern:?} {level:?} {what} differs in {c:?}");
                    }
                })
            });
        }
    }
}

#[test]
fn bf16_products_backward_matches_the_gradients_of_the_rounded_operands() {
    let mut odd = Case::new(2, 2, 70, 200, 33);
    odd.dv = 80; // two 64-column panels of dV
    odd.masks = vec![MaskKind::AddLS, MaskKind::KeyPad];
    let mut gqa = Case::new(1, 4, 65, 65, 64);
    (gqa.hkv, gqa.causal) = (2, true);
    let mut packed = Case::new(2, 2, 40, 40, 16);
    packed.packed = true;
    let mut drop = Case::new(1, 2, 33, 33, 24);
    drop.dropout = Some(0.2);
    for c in [odd, gqa, packed, drop] {
        let (masks, x, [qr, kr, vr]) = rounded_case(&c);
        let p = params(&c, &masks);
        let pb = AttnParams { bf16_products: true, ..params(&c, &masks) };
        let (edq, edk, edv) =
            reference::backward(&p, &qr, x.ql, &kr, x.kl, &vr, x.vl, &x.dout, x.dol);
        let (dkl, dvl) = (x.dkl, x.dvl);
        for (level, kern) in product_runs() {
            with_simd_level(level, || {
                with_bf16_kernel(kern, || {
                    let r = run_kernels(&c, &pb, &x);
                    // Each product rounds its operands (dO, P, dS) to bf16: half a step each.
                    let within = |what: &str, got: &[f32], gl: Layout4, exp: &[f64], sizes| {
                        let scale = exp.iter().fold(0f64, |m, v| m.max(v.abs()));
                        assert_close(what, &c, got, gl, exp, sizes, 2f64.powi(-6) * scale);
                    };
                    within("dq", &r.dq, x.dql, &edq, [c.b, c.hq, c.l, c.d]);
                    within("dk", &r.dk, dkl, &edk, [c.b, c.hkv, c.s, c.d]);
                    within("dv", &r.dv, dvl, &edv, [c.b, c.hkv, c.s, c.dv]);
                    // The f32 kernels on the rounded operands differ: the products rounded.
                    let r32 = run_kernels(
                        &c,
                        &p,
                        &Inputs {
                            q: round_bf16(&x.q),
                            k: round_bf16(&x.k),
                            v: round_bf16(&x.v),
                            dout: x.dout.clone(),
                            ..x
                        },
                    );
                    assert_ne!(r.dk, r32.dk, "no rounding seen in {c:?}");
                })
            });
        }
    }
}
