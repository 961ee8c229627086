//! The variants against the reference: diagonal offsets, windows, key lengths, soft caps,
//! ALiBi and sinks, alone and with masks, dropout, grouped heads, packed views, non-finite keys and bf16
//! products.

use super::*;

fn window(left: Option<usize>, right: Option<usize>) -> Window {
    Window { left, right }
}

#[test]
fn causal_with_an_offset_is_bottom_right_or_shifted() {
    // Bottom-right (s - l), past the end, before the start, at tile boundaries.
    for &(l, s, offset) in &[
        (65, 300, 235),
        (300, 65, -235),
        (64, 257, 193),
        (5, 5, -3),
        (70, 70, 100),
        (70, 70, -100),
        (1, 257, 256),
    ] {
        let mut c = Case::new(2, 2, l, s, 32);
        (c.causal, c.offset) = (true, offset);
        check_case(&c);
    }
}

#[test]
fn windows_skip_and_hide_the_keys_outside() {
    for &(l, s, left, right, causal) in &[
        (300, 300, Some(40), None, true), // Mistral: sliding window, causal
        (300, 300, Some(0), Some(0), false), // only the diagonal
        (257, 257, Some(64), Some(17), false), // two-sided
        (70, 600, None, Some(3), false),  // right only
        (65, 65, Some(1000), Some(1000), false), // wider than the sequence
        (200, 130, Some(256), None, true), // one tile wide
        (129, 129, Some(5), Some(usize::MAX), false), // unbounded in effect
    ] {
        let mut c = Case::new(2, 2, l, s, 32);
        (c.causal, c.window) = (causal, window(left, right));
        check_case(&c);
    }
    // A window around the bottom-right diagonal, as a chunk after a cache.
    let mut c = Case::new(1, 2, 64, 320, 64);
    (c.causal, c.offset, c.window) = (true, 256, window(Some(100), None));
    check_case(&c);
}

#[test]
fn huge_windows_at_extreme_offsets_follow_the_reference() {
    // Bounds beyond isize: `offset + right` and `offset - left` overflow a saturating sum.
    let far = isize::MAX - 3;
    for &(offset, left, right) in &[
        (-far, None, Some(usize::MAX)),
        (far, Some(usize::MAX), None),
        (-far, Some(usize::MAX), Some(usize::MAX)),
        (far, Some(usize::MAX - 1), Some(usize::MAX)),
        (-far, Some(5), Some(usize::MAX)),
    ] {
        let mut c = Case::new(1, 2, 40, 70, 8);
        (c.offset, c.window) = (offset, window(left, right));
        check_case(&c);
    }
}

#[test]
fn key_lengths_hide_the_padded_keys() {
    let mut c = Case::new(4, 2, 65, 300, 32);
    c.lens = Some(vec![300, 0, 1, 257]);
    check_case(&c);
    (c.causal, c.window) = (true, window(Some(50), None));
    c.offset = 235;
    check_case(&c);
    // With a key padding mask and dropout.
    let mut c = Case::new(3, 2, 33, 65, 16);
    (c.lens, c.masks, c.dropout) = (Some(vec![64, 65, 10]), vec![MaskKind::KeyPad], Some(0.2));
    check_case(&c);
}

#[test]
fn softcap_caps_scores_before_the_masks() {
    for &cap in &[0.3f32, 1.0, 30.0] {
        let mut c = Case::new(2, 2, 70, 260, 32);
        (c.softcap, c.scale) = (Some(cap), Some(1.5));
        check_case(&c);
    }
    let mut c = Case::new(3, 4, 65, 257, 32);
    (c.hkv, c.softcap, c.causal) = (2, Some(0.5), true);
    c.masks = vec![MaskKind::AddLS, MaskKind::KeyPad];
    check_case(&c);
    (c.dropout, c.masks) = (Some(0.3), vec![MaskKind::FullRows]);
    (c.window, c.lens) = (window(Some(20), None), Some(vec![257, 100, 3]));
    check_case(&c);
    let mut c = Case::new(2, 2, 130, 130, 16);
    (c.packed, c.softcap, c.causal, c.window) = (true, Some(0.7), true, window(Some(9), None));
    check_case(&c);
}

/// ONNX's placement: the masks are inside the tanh; a `-inf` entry stays hidden.
#[test]
fn softcap_after_the_masks() {
    for masks in [
        vec![MaskKind::AddLS],
        vec![MaskKind::PerHead, MaskKind::KeyPad],
        vec![MaskKind::AddKeys],
        vec![MaskKind::FullRows, MaskKind::AddTransposed],
    ] {
        let mut c = Case::new(3, 2, 65, 257, 32);
        (c.softcap, c.cap_after_masks, c.scale, c.masks) = (Some(0.6), true, Some(1.3), masks);
        check_case(&c);
        (c.causal, c.dropout, c.window) = (true, Some(0.2), window(Some(30), None));
        check_case(&c);
    }
    // Without a mask it is the same as before the masks.
    let mut c = Case::new(1, 2, 40, 50, 16);
    (c.softcap, c.cap_after_masks) = (Some(0.5), true);
    check_case(&c);
}

/// Scores far past the soft cap (the scale up to 1e10): every capped score is exactly `±c`, its
/// slope 0, so no gradient reaches the queries and keys (the f64 reference's are 0 too); the
/// approximation's last value below `c` had left a slope of 2.4e-7 that the scale multiplied
/// (dq of -2384 at a scale of 1e10). An infinite key under the cap gives `0·inf`, NaN, in the
/// query gradients as in the reference.
#[test]
fn a_saturated_soft_cap_passes_no_gradient() {
    let (l, s, d) = (3usize, 5usize, 4usize);
    let dims = AttnDims { batch: 1, heads_q: 1, heads_kv: 1, l, s, d, dv: d };
    let (ql, kl) = (Layout4::contiguous(1, l, d), Layout4::contiguous(1, s, d));
    let q: Vec<f32> = rand_vec(l * d, 1).iter().map(|x| x.abs() + 0.5).collect();
    let k0: Vec<f32> = rand_vec(s * d, 2).iter().map(|x| x.abs() + 0.5).collect();
    let (v, dout) = (rand_vec(s * d, 3), rand_vec(l * d, 4));
    for (scale, after, inf_key) in
        [(1e3f32, false, false), (1e10, false, false), (1e10, true, false), (1.0, false, true)]
    {
        let mut k = k0.clone();
        if inf_key {
            k[2 * d + 1] = f32::INFINITY;
        }
        let mut p = AttnParams::new(dims);
        (p.scale, p.softcap, p.softcap_after_masks) = (scale, Some(30.0), after);
        let (edq, edk, edv) = reference::backward(&p, &q, ql, &k, kl, &v, kl, &dout, ql);
        for level in levels() {
            with_simd_level(level, || {
                let mut out = vec![0f32; l * d];
                let mut lse = vec![0f32; 2 * l];
                flash_forward(&p, &q, ql, &k, kl, &v, kl, &mut out, ql, &mut lse).unwrap();
                let (mut dq, mut dk, mut dv) =
                    (vec![1f32; l * d], vec![1f32; s * d], vec![0f32; s * d]);
                flash_backward(
                    &p, &q, ql, &k, kl, &v, kl, &out, ql, &dout, ql, &lse, &mut dq, ql, &mut dk,
                    kl, &mut dv, kl,
                )
                .unwrap();
                let what = format!("{level:?} scale {scale} after {after} inf key {inf_key}");
                for (name, got, want) in [("dq", &dq, &edq), ("dk", &dk, &edk), ("dv", &dv, &edv)] {
                    for (i, (&g, &e)) in got.iter().zip(want.iter()).enumerate() {
                        let ok = match e.is_nan() {
                            true => g.is_nan(),
                            false => (g as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()),
                        };
                        assert!(ok, "{what}: {name}[{i}] {g} vs {e}");
                    }
                }
                if !inf_key {
                    assert!(dq.iter().chain(&dk).all(|&x| x == 0.0), "{what}: {dq:?} {dk:?}");
                }
            });
        }
    }
}

/// An infinite score (here an infinite key; a huge finite one overflows the same way) under the
/// soft cap applied after an additive mask: the cap makes it `c`, a finite row, as in the
/// reference and PyTorch; the tile's `-inf` bookkeeping once computed `inf − inf` there and
/// made the whole row NaN.
#[test]
fn an_infinite_score_capped_after_the_masks_is_the_cap() {
    let (l, s, d) = (3usize, 5usize, 4usize);
    let dims = AttnDims { batch: 1, heads_q: 1, heads_kv: 1, l, s, d, dv: d };
    let (ql, kl) = (Layout4::contiguous(1, l, d), Layout4::contiguous(1, s, d));
    let q: Vec<f32> = rand_vec(l * d, 1).iter().map(|x| x.abs() + 0.5).collect();
    let mut k: Vec<f32> = rand_vec(s * d, 2).iter().map(|x| x.abs() + 0.5).collect();
    k[2 * d + 1] = f32::INFINITY;
    let (v, dout) = (rand_vec(s * d, 3), rand_vec(l * d, 4));
    // Zeros, and one key hidden by -inf.
    let mask: Vec<f32> =
        (0..l * s).map(|i| if i % s == 4 { f32::NEG_INFINITY } else { 0.0 }).collect();
    let mut p = AttnParams::new(dims);
    (p.softcap, p.softcap_after_masks) = (Some(30.0), true);
    p.masks[0] = Some(MaskView::Additive { data: &mask, strides: [0, 0, s, 1] });
    let (eout, _) = reference::forward(&p, &q, ql, &k, kl, &v, kl);
    assert!(eout.iter().all(|x| x.is_finite()), "the reference row is finite");
    let (edq, edk, edv) = reference::backward(&p, &q, ql, &k, kl, &v, kl, &dout, ql);
    for level in levels() {
        with_simd_level(level, || {
            let mut out = vec![0f32; l * d];
            let mut lse = vec![0f32; 2 * l];
            flash_forward(&p, &q, ql, &k, kl, &v, kl, &mut out, ql, &mut lse).unwrap();
            for (i, (&g, &e)) in out.iter().zip(&eout).enumerate() {
                assert!(
                    (g as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()),
                    "{level:?} out[{i}] {g} vs {e}"
                );
            }
            let (mut dq, mut dk, mut dv) =
                (vec![0f32; l * d], vec![0f32; s * d], vec![0f32; s * d]);
            flash_backward(
                &p, &q, ql, &k, kl, &v, kl, &out, ql, &dout, ql, &lse, &mut dq, ql, &mut dk, kl,
                &mut dv, kl,
            )
            .unwrap();
            for (name, got, want) in [("dq", &dq, &edq), ("dk", &dk, &edk), ("dv", &dv, &edv)] {
                for (i, (&g, &e)) in got.iter().zip(want.iter()).enumerate() {
                    let ok = match e.is_nan() {
                        true => g.is_nan(),
                        false => (g as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()),
                    };
                    assert!(ok, "{level:?}: {name}[{i}] {g} vs {e}");
                }
            }
        });
    }
}

/// A NaN in a float mask at a key hidden by index (a window, key lengths, with the cap before,
/// after or without it): NaN + `-inf` is NaN, so the row is NaN as in the reference (the tiles
/// once skipped such keys, or overwrote them with `-inf`).
#[test]
fn a_nan_mask_value_at_a_key_hidden_by_index_follows_the_reference() {
    let (l, s, d) = (70usize, 300usize, 4usize);
    let dims = AttnDims { batch: 2, heads_q: 1, heads_kv: 1, l, s, d, dv: d };
    let (ql, kl) = (Layout4::contiguous(1, l, d), Layout4::contiguous(1, s, d));
    let (q, k, v) = (rand_vec(2 * l * d, 1), rand_vec(2 * s * d, 2), rand_vec(2 * s * d, 3));
    let mut mask = vec![0f32; l * s];
    mask[3 * s + 200] = f32::NAN; // row 3, key 200: outside the window and past length 150
    let lens: &[usize] = &[150, 300];
    for case in 0..4 {
        let mut p = AttnParams::new(dims);
        p.masks[0] = Some(MaskView::Additive { data: &mask, strides: [0, 0, s, 1] });
        match case {
            0 => p.window = window(Some(4), Some(0)),
            1 => p.kv_lengths = Some(lens),
            2 => {
                (p.window, p.softcap, p.softcap_after_masks) =
                    (window(Some(4), Some(0)), Some(5.0), true)
            }
            _ => (p.kv_lengths, p.softcap) = (Some(lens), Some(5.0)),
        }
        let (eout, _) = reference::forward(&p, &q, ql, &k, kl, &v, kl);
        for level in levels() {
            with_simd_level(level, || {
                let mut out = vec![0f32; 2 * l * d];
                let mut lse = vec![0f32; 4 * l];
                flash_forward(&p, &q, ql, &k, kl, &v, kl, &mut out, ql, &mut lse).unwrap();
                for (i, (&g, &e)) in out.iter().zip(&eout).enumerate() {
                    assert_eq!(
                        g.is_nan(),
                        e.is_nan(),
                        "{level:?} case {case}: out[{i}] {g} vs {e}"
                    );
                }
                assert!(out.iter().any(|x| x.is_nan()), "{level:?} case {case}: no NaN row");
            });
        }
    }
}

/// Slopes as ALiBi's geometric sequence for `h` heads (and a negative one, which the kernels
/// accept: a bias growing with the distance).
fn slopes(h: usize) -> Vec<f32> {
    let mut m: Vec<f32> = (1..=h).map(|i| 2f32.powf(-8.0 * i as f32 / h as f32)).collect();
    m[h - 1] = -0.01;
    m
}

/// Slopes so large that the bias of distant keys overflows to -inf in f32: whole tiles of -inf
/// scores give those keys no weight, as in the reference, never NaN.
#[test]
fn an_overflowing_alibi_bias_hides_keys() {
    let mut c = Case::new(1, 2, 200, 300, 16);
    c.alibi = Some(vec![1e36, 0.5]);
    check_case(&c);
    c.causal = true;
    check_case(&c);
}

#[test]
fn alibi_adds_the_distance_bias() {
    // Plain, causal at an offset (bottom-right), with masks, dropout and grouped heads.
    let mut c = Case::new(2, 4, 70, 300, 32);
    c.alibi = Some(slopes(4));
    check_case(&c);
    (c.causal, c.offset, c.hkv) = (true, 230, 2);
    check_case(&c);
    (c.masks, c.dropout) = (vec![MaskKind::AddLS, MaskKind::KeyPad], Some(0.2));
    (c.window, c.lens) = (window(Some(40), None), Some(vec![300, 120]));
    check_case(&c);
    // Through a soft cap before and after the masks (the bias joins the masks).
    for after in [false, true] {
        let mut c = Case::new(2, 2, 65, 257, 16);
        (c.alibi, c.softcap, c.cap_after_masks) = (Some(vec![0.3, 0.05]), Some(2.0), after);
        c.masks = vec![MaskKind::PerHead];
        check_case(&c);
    }
    let mut c = Case::new(2, 2, 130, 130, 16);
    (c.packed, c.alibi, c.causal) = (true, Some(slopes(2)), true);
    check_case(&c);
}

#[test]
fn sinks_join_the_denominator() {
    // Large and small sinks, a -inf sink (none), with fully masked rows (only the sink is
    // seen), dropout, grouped heads and a window.
    let mut c = Case::new(2, 4, 70, 300, 32);
    c.sinks = Some(vec![0.5, -3.0, 8.0, f32::NEG_INFINITY]);
    check_case(&c);
    (c.hkv, c.causal, c.offset, c.window) = (2, true, 230, window(Some(60), None));
    (c.masks, c.dropout) = (vec![MaskKind::FullRows], Some(0.25));
    check_case(&c);
    (c.alibi, c.softcap) = (Some(slopes(4)), Some(1.5));
    check_case(&c);
    let mut c = Case::new(3, 2, 40, 65, 16);
    (c.sinks, c.lens) = (Some(vec![1.0, -1.0]), Some(vec![65, 0, 7]));
    check_case(&c);
}

/// A NaN or `+inf` sink makes its head's rows NaN, as a softmax over a row holding it does.
#[test]
fn a_nan_or_infinite_sink_gives_nan_rows() {
    let c = Case::new(1, 2, 5, 6, 4);
    let x = inputs(&c, 3);
    for bad in [f32::NAN, f32::INFINITY] {
        let sinks = [0.0, bad];
        let p = AttnParams { sinks: Some(&sinks), ..params(&c, &[]) };
        let r = run_kernels(&c, &p, &x);
        let (head0, head1) = r.out.split_at(5 * 4);
        assert!(head0.iter().all(|v| v.is_finite()) && head1.iter().all(|v| v.is_nan()));
        assert!(r.dsinks[1].is_nan() && r.dsinks[0].is_finite());
    }
}

#[test]
fn every_variant_at_once_is_bitwise_the_same_for_any_thread_count() {
    let mut c = Case::new(2, 4, 200, 331, 64);
    (c.hkv, c.causal, c.offset, c.window) = (2, true, 131, window(Some(70), None));
    (c.lens, c.softcap, c.dropout) = (Some(vec![300, 331]), Some(2.0), Some(0.25));
    (c.alibi, c.sinks) = (Some(slopes(4)), Some(vec![0.0, 1.0, -1.0, 2.0]));
    c.masks = vec![MaskKind::AddLS];
    check_case(&c);
    let masks: Vec<MaskData> = c.masks.iter().map(|&k| make_mask(&c, k, 3)).collect();
    let p = params(&c, &masks);
    let x = inputs(&c, 1);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for level in levels() {
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| with_simd_level(level, || run_kernels(&c, &p, &x)))
        };
        let (a, b) = (run(1), run(3));
        let pairs = [(&a.out, &b.out), (&a.dq, &b.dq), (&a.dk, &b.dk), (&a.w, &b.w)];
        for (x, y) in pairs.into_iter().chain([(&a.dsinks, &b.dsinks)]) {
            assert!(bits(x) == bits(y), "{level:?}");
        }
    }
}

/// A NaN key outside a head's window or past its length still makes every row NaN (the band's
/// `-inf` is added, as on the composed path), and a NaN value its column.
#[test]
fn nan_outside_the_band_follows_the_reference() {
    let (l, s, d) = (70usize, 600usize, 4usize);
    let dims = AttnDims { batch: 1, heads_q: 1, heads_kv: 1, l, s, d, dv: d };
    let (ql, kl) = (Layout4::contiguous(1, l, d), Layout4::contiguous(1, s, d));
    let q = rand_vec(l * d, 1);
    let lens = [300usize];
    for variant in 0..3 {
        for (pos, in_v) in [(0usize, false), (599, false), (599, true), (256, true)] {
            let mut k = rand_vec(s * d, 2);
            let mut v = rand_vec(s * d, 3);
            let x = if in_v { &mut v } else { &mut k };
            x[pos * d + 1] = f32::NAN;
            let mut p = AttnParams::new(dims);
            match variant {
                0 => (p.causal, p.window) = (true, window(Some(8), None)),
                1 => p.kv_lengths = Some(&lens),
                _ => (p.window, p.softcap) = (window(Some(3), Some(3)), Some(1.0)),
            }
            let (eout, _) = reference::forward(&p, &q, ql, &k, kl, &v, kl);
            for level in levels() {
                with_simd_level(level, || {
                    let mut out = vec![0f32; l * d];
                    let mut lse = vec![0f32; 2 * l];
                    flash_forward(&p, &q, ql, &k, kl, &v, kl, &mut out, ql, &mut lse).unwrap();
                    for (i, (&g, &e)) in out.iter().zip(&eout).enumerate() {
                        let what = format!("{level:?} variant {variant} pos {pos} out[{i}]");
                        assert_eq!(g.is_nan(), e.is_nan(), "{what}: {g} vs {e}");
                        assert_eq!(g.is_nan(), !in_v || i % d == 1, "{what}");
                    }
                });
            }
        }
    }
}

#[test]
fn bf16_products_with_variants_match_the_rounded_reference() {
    let mut c = Case::new(2, 2, 70, 300, 32);
    (c.causal, c.offset, c.window) = (true, 230, window(Some(90), None));
    (c.softcap, c.lens) = (Some(0.8), Some(vec![290, 300]));
    (c.alibi, c.sinks) = (Some(vec![0.2, 0.01]), Some(vec![0.5, -0.5]));
    let (masks, x, [qr, kr, vr]) = rounded_case(&c);
    let p = params(&c, &masks);
    let pb = AttnParams { bf16_products: true, ..params(&c, &masks) };
    let (eout, else_) = reference::forward(&p, &qr, x.ql, &kr, x.kl, &vr, x.vl);
    let (edq, edk, edv) = reference::backward(&p, &qr, x.ql, &kr, x.kl, &vr, x.vl, &x.dout, x.dol);
    let rows = c.b * c.hq * c.l;
    for level in levels() {
        with_simd_level(level, || {
            let r = run_kernels(&c, &pb, &x);
            let lse: Vec<f32> = r.lse[..rows].to_vec();
            let lsel = Layout4::contiguous(c.hq, c.l, 1);
            assert_close("lse", &c, &lse, lsel, &else_, [c.b, c.hq, c.l, 1], 2e-5);
            assert_close("out", &c, &r.out, x.ol, &eout, [c.b, c.hq, c.l, c.dv], 4e-3);
            let (hq, hk) = (c.hq, c.hkv);
            assert_close("dq", &c, &r.dq, x.dql, &edq, [c.b, hq, c.l, c.d], 2e-2);
            assert_close("dk", &c, &r.dk, x.dkl, &edk, [c.b, hk, c.s, c.d], 2e-2);
            assert_close("dv", &c, &r.dv, x.dvl, &edv, [c.b, hk, c.s, c.dv], 2e-2);
        });
    }
}

#[test]
fn bad_variant_arguments_are_errors() {
    let c = Case::new(2, 2, 5, 6, 4);
    let x = inputs(&c, 1);
    let mut out = vec![0.0; x.out_len];
    let mut lse = vec![0.0; 40];
    let base = params(&c, &[]);
    for cap in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
        let p = AttnParams { softcap: Some(cap), ..base };
        let e = flash_forward(&p, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse);
        assert!(matches!(e, Err(KernelError::InvalidArgument { name: "softcap", .. })), "{e:?}");
    }
    for (alibi, sinks) in [(Some(&[0.1f32][..]), None), (None, Some(&[0.0f32, 1.0, 2.0][..]))] {
        let p = AttnParams { alibi, sinks, ..base };
        let e = flash_forward(&p, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse);
        let name = if alibi.is_some() { "alibi" } else { "sinks" };
        assert!(matches!(e, Err(KernelError::InvalidArgument { name: n, .. }) if n == name));
    }
    let p = AttnParams { alibi: Some(&[0.1, f32::NAN]), ..base };
    let e = flash_forward(&p, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse);
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "alibi", .. })), "{e:?}");
    let mut ds = [0f32; 2];
    let e = sink_grad(&base, &out, x.ol, &x.dout, x.dol, &lse, &mut ds);
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "sinks", .. })), "{e:?}");
    for lens in [&[6usize][..], &[6, 7], &[1, 2, 3]] {
        let p = AttnParams { kv_lengths: Some(lens), ..base };
        let e = flash_forward(&p, &x.q, x.ql, &x.k, x.kl, &x.v, x.vl, &mut out, x.ol, &mut lse);
        assert!(matches!(e, Err(KernelError::InvalidArgument { name: "kv_lengths", .. })), "{e:?}");
        let mut w = vec![0.0; 2 * 2 * 5 * 6];
        let e = attention_weights(&p, &x.q, x.ql, &x.k, x.kl, &lse, false, &mut w);
        assert!(matches!(e, Err(KernelError::InvalidArgument { name: "kv_lengths", .. })));
    }
}

/// The largest error of the vector soft cap `c·tanh(x/c)` over a fine grid of `x/c` and the
/// specials, in units of `f32::EPSILON · c · max(|tanh(x/c)|, 2^-10)` (relative near 0,
/// absolute near ±c); a NaN input must give NaN.
fn softcap_max_error(level: SimdLevel, c: f32) -> f64 {
    use super::super::simd::Simd;
    let mut xs: Vec<f32> = (-100_000..=100_000).map(|i| i as f32 * 1e-4 * c).collect();
    xs.extend([1e-30, -1e-30, 1e-6, -3e-4, 7.9, 8.0, -8.0, 1e30, -1e30].map(|x| x * c));
    xs.extend([f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    let inv = 1.0 / c;
    let run = |xs: &[f32]| match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `levels()` only yields supported levels.
        SimdLevel::Avx512 => unsafe { run512(xs, c, inv) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { run256(xs, c, inv) },
        _ => run_at::<super::super::simd::Scalar>(xs, c, inv),
    };
    fn run_at<S: Simd>(xs: &[f32], c: f32, inv: f32) -> Vec<f32> {
        let mut x = xs.to_vec();
        x.resize(xs.len().div_ceil(16) * 16, 0.0);
        let mut out = vec![0.0; x.len()];
        for (i, chunk) in x.chunks(S::LANES).enumerate() {
            // SAFETY: only called at a level the CPU supports; chunks hold LANES floats.
            unsafe {
                let y = S::softcap(S::load(chunk.as_ptr()), c, inv);
                S::store(out.as_mut_ptr().add(i * S::LANES), y)
            }
        }
        out.truncate(xs.len());
        out
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run512(xs: &[f32], c: f32, inv: f32) -> Vec<f32> {
        run_at::<super::super::simd::Avx512>(xs, c, inv)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run256(xs: &[f32], c: f32, inv: f32) -> Vec<f32> {
        run_at::<super::super::simd::Avx2>(xs, c, inv)
    }
    let ys = run(&xs);
    let mut worst = 0f64;
    for (&x, &y) in xs.iter().zip(&ys) {
        if x.is_nan() {
            assert!(y.is_nan(), "{level:?}: softcap(NaN, {c}) = {y}");
            continue;
        }
        let e = (x as f64 / c as f64).tanh();
        let unit = f32::EPSILON as f64 * c as f64 * e.abs().max(1.0 / 1024.0);
        worst = worst.max((y as f64 - c as f64 * e).abs() / unit);
    }
    worst
}

#[test]
fn vector_softcap_is_accurate_and_keeps_nan() {
    for level in levels() {
        for c in [1.0, 0.5, 30.0, 50.0, 1e-3, 1e30, 1e38, f32::MAX] {
            let err = softcap_max_error(level, c);
            assert!(err < 4.0, "{level:?}, cap {c}: largest error {err} eps");
            // As the kernels run it: subnormal results flushed (a huge cap's 1/c is one).
            let err = {
                let _ftz = crate::fpenv::FlushToZero::on();
                softcap_max_error(level, c)
            };
            assert!(err < 4.0, "{level:?}, cap {c}, flush-to-zero: largest error {err} eps");
        }
    }
}
