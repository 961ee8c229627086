//! `multihead::cast` gives candle's `to_dtype` bits, forward and backward, on the values where
//! rounding decides (ties, the edge of overflow, subnormals, NaN, infinities, signed zeros) and
//! on strided views.

use candle_core::{DType, Tensor, Var};

use crate::common::dev;

/// f32 values where the rounding to bf16 matters, then a ramp of ordinary ones.
fn awkward() -> Vec<f32> {
    let mut v = vec![
        1.0 + 1.0 / 256.0,    // a tie: rounds to the even 1.0
        1.0 + 3.0 / 256.0,    // a tie: rounds up
        -(1.0 + 1.0 / 256.0), // a negative tie
        f32::MAX,             // rounds to infinity
        3.389_531_4e38,       // just below bf16's largest finite value
        1e-39,                // an f32 subnormal
        -1e-45,               // the smallest negative subnormal
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001), // a signalling NaN (comes out quieted)
        f32::from_bits(0xffc0_1234), // a negative NaN with a payload
    ];
    v.extend((0..1000).map(|i| (i as f32 * 0.7331).sin() * 10f32.powi(i % 9 - 4)));
    v
}

fn bits_f32(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

fn bits_bf16(t: &Tensor) -> Vec<u16> {
    let v = t.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn cast_rounds_and_widens_as_candle_does() {
    let x = Tensor::new(awkward().as_slice(), &dev()).unwrap();
    let ours = multihead::cast(&x, DType::BF16).unwrap();
    let theirs = x.to_dtype(DType::BF16).unwrap();
    assert_eq!(ours.dtype(), DType::BF16);
    assert_eq!(bits_bf16(&ours), bits_bf16(&theirs));
    let wide = multihead::cast(&theirs, DType::F32).unwrap();
    assert_eq!(bits_f32(&wide), bits_f32(&theirs.to_dtype(DType::F32).unwrap()));
    // The tie went to the even value (so the comparison above is not of two wrong answers).
    assert_eq!(wide.get(0).unwrap().to_scalar::<f32>().unwrap(), 1.0);
    assert_eq!(wide.get(3).unwrap().to_scalar::<f32>().unwrap(), f32::INFINITY);
}

#[test]
fn cast_reads_strided_and_broadcast_views() {
    let v = awkward();
    let x = Tensor::new(&v[..1014], &dev()).unwrap().reshape((39, 26)).unwrap();
    for view in [
        x.t().unwrap(),
        x.narrow(1, 3, 7).unwrap(),
        x.get(5).unwrap().broadcast_as((4, 26)).unwrap(),
    ] {
        let ours = multihead::cast(&view, DType::BF16).unwrap();
        assert_eq!(ours.dims(), view.dims());
        assert_eq!(bits_bf16(&ours), bits_bf16(&view.to_dtype(DType::BF16).unwrap()));
    }
    // Same dtype: the tensor itself.
    assert_eq!(bits_f32(&multihead::cast(&x, DType::F32).unwrap()), bits_f32(&x));
}

#[test]
fn cast_passes_gradients_back_as_to_dtype_does() {
    // bf16 parameter -> f32 -> a weighted sum: the gradient is the weights rounded to bf16.
    let w: Vec<f32> = awkward()[14..114].to_vec();
    let weights = Tensor::new(w.as_slice(), &dev()).unwrap();
    let p = Var::from_tensor(&Tensor::ones(100, DType::BF16, &dev()).unwrap()).unwrap();
    let grad = |cast: &dyn Fn(&Tensor) -> Tensor| {
        let loss = (cast(p.as_tensor()) * &weights).unwrap().sum_all().unwrap();
        bits_bf16(loss.backward().unwrap().get(p.as_tensor()).unwrap())
    };
    let ours = grad(&|t| multihead::cast(t, DType::F32).unwrap());
    let theirs = grad(&|t| t.to_dtype(DType::F32).unwrap());
    assert_eq!(ours, theirs);
    assert_ne!(ours, vec![0u16; 100], "the gradient is not all zero");
    // And the other way: an f32 parameter through bf16.
    let q = Var::new(w.as_slice(), &dev()).unwrap();
    let grad = |cast: &dyn Fn(&Tensor) -> Tensor| {
        let y = cast(q.as_tensor()).to_dtype(DType::F32).unwrap();
        let loss = (y * &weights).unwrap().sum_all().unwrap();
        bits_f32(loss.backward().unwrap().get(q.as_tensor()).unwrap())
    };
    let ours = grad(&|t| multihead::cast(t, DType::BF16).unwrap());
    let theirs = grad(&|t| t.to_dtype(DType::BF16).unwrap());
    assert_eq!(ours, theirs);
    // An f64 parameter through bf16 (rounded through f32): its gradient is the weights' f64s,
    // as candle's direct conversion gives it.
    let r = Var::from_tensor(&q.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
    let grad = |cast: &dyn Fn(&Tensor) -> Tensor| {
        let y = cast(r.as_tensor()).to_dtype(DType::F32).unwrap();
        let loss = (y * &weights).unwrap().sum_all().unwrap();
        let g = loss.backward().unwrap().get(r.as_tensor()).unwrap().clone();
        g.to_vec1::<f64>().unwrap()
    };
    let ours = grad(&|t| multihead::cast(t, DType::BF16).unwrap());
    assert_eq!(ours, grad(&|t| t.to_dtype(DType::BF16).unwrap()));
    assert!(ours.iter().any(|&g| g != 0.0), "the gradient is not all zero");
}

#[test]
fn cast_takes_candles_conversion_for_other_dtypes() {
    let x = Tensor::new(&awkward()[..200], &dev()).unwrap();
    for dtype in [DType::F16, DType::F64, DType::U8, DType::U32] {
        let ours = multihead::cast(&x, dtype).unwrap();
        let theirs = x.to_dtype(dtype).unwrap();
        assert_eq!(ours.dtype(), dtype);
        // Compare through f64, which holds every value of these dtypes exactly (NaN aside).
        let wide = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
        for (i, (a, b)) in wide(&ours).iter().zip(wide(&theirs)).enumerate() {
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{dtype:?} {i}");
        }
    }
}

/// f64 to bf16 rounds through f32, as PyTorch's `t.to(torch.bfloat16)` does (its bf16 is built
/// from a float). Values just past a bf16 midpoint by less than an f32 step: PyTorch 2.15 gives
/// the `want` column (checked with `torch.tensor(v, dtype=torch.float64).to(torch.bfloat16)`),
/// one rounding of the double the other neighbour. f64 to f16 also rounds through f32 in both.
#[test]
fn cast_of_f64_to_bf16_rounds_through_f32_as_pytorch() {
    let cases = [
        (-0.499023437498181f64, -0.5f32),
        (-0.998046874996362, -1.0),
        (-1.996093749992724, -2.0),
        (1.0039062500001, 1.0),
        (1.01171875, 1.015625), // a tie in both: to even
        (3.0, 3.0),
    ];
    let x = Tensor::new(&cases.map(|c| c.0)[..], &dev()).unwrap();
    for via_state_dict in [false, true] {
        let b = if via_state_dict {
            let state = std::collections::HashMap::from([("weight".to_string(), x.clone())]);
            let build =
                |vb: candle_nn::VarBuilder| multihead::LayerNorm::new(cases.len(), 1e-5, false, vb);
            let ln = multihead::state_dict::load_strict(&state, DType::BF16, &dev(), build);
            use multihead::state_dict::NamedParameters;
            ln.unwrap().0.named_parameters().remove(0).1
        } else {
            multihead::cast(&x, DType::BF16).unwrap()
        };
        let got = b.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, cases.map(|c| c.1), "state_dict {via_state_dict}");
    }
    // NaN and the infinities stay what they are.
    let special = Tensor::new(&[f64::NAN, f64::INFINITY, f64::NEG_INFINITY], &dev()).unwrap();
    let got = multihead::cast(&special, DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
    let got = got.to_vec1::<f32>().unwrap();
    assert!(got[0].is_nan() && got[1] == f32::INFINITY && got[2] == f32::NEG_INFINITY, "{got:?}");
    // The direct rounding differs in the first four: the test can tell the two apart.
    let direct = x.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
    assert_ne!(direct.to_vec1::<f32>().unwrap()[..4], cases.map(|c| c.1)[..4]);
    // f64 to f16 through f32 too, as PyTorch (1 + 2^-11 + 2^-40 and 2^-25 + 2^-60 become ties
    // in f32, which go to even: 1 and 0, where one rounding gives 1 + 2^-10 and 2^-24).
    let h = Tensor::new(
        &[1.0 + 2f64.powi(-11) + 2f64.powi(-40), 2f64.powi(-25) + 2f64.powi(-60)],
        &dev(),
    );
    let h = multihead::cast(&h.unwrap(), DType::F16).unwrap().to_dtype(DType::F64).unwrap();
    assert_eq!(h.to_vec1::<f64>().unwrap(), [1.0, 0.0]);
}

#[test]
fn cast_of_a_view_too_large_to_allocate_is_an_error_naming_cast() {
    // A broadcast view of one value standing for 2^40 elements: 4 TiB once converted.
    let x = Tensor::zeros((1, 1), DType::F32, &dev()).unwrap();
    let huge = x.broadcast_as((1usize << 20, 1usize << 20)).unwrap();
    for dtype in [DType::BF16, DType::F64] {
        let e = multihead::cast(&huge, dtype).expect_err("4 TiB");
        assert!(matches!(e, multihead::Error::Alloc { op: "cast", .. }), "{dtype:?}: {e:?}");
        assert!(e.to_string().contains("cast"), "{e}");
    }
    // f64 to bf16 through its f32 intermediate: refused before either is allocated.
    let one = Tensor::zeros((1, 1), DType::F64, &dev()).unwrap();
    let huge64 = one.broadcast_as((1usize << 20, 1usize << 20)).unwrap();
    let e = multihead::cast(&huge64, DType::BF16).expect_err("f64 to bf16, 2 TiB");
    assert!(matches!(e, multihead::Error::Alloc { op: "cast", .. }), "{e:?}");
}
