//! `multihead::sum_f32`: the sum of every element in f32 against an f64 reference and candle's
//! `sum_all`, the same bits for any thread count, and its gradient (every element the sum's
//! gradient, in the input's dtype) through a strided view and a bf16 tensor.

use candle_core::{DType, Tensor, Var};

use crate::common::dev;

/// `n` values in [-1, 1) from a sine ramp.
fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i as f32) * 0.618_034).sin()).collect()
}

#[test]
fn sum_f32_is_the_f32_sum_for_any_thread_count() {
    for n in [0usize, 1, 17, 16_384, 100_003] {
        let v = ramp(n);
        let exact: f64 = v.iter().map(|&x| x as f64).sum();
        let t = Tensor::from_vec(v, n, &dev()).unwrap();
        let mut seen = Vec::new();
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let s = pool.install(|| multihead::sum_f32(&t)).unwrap();
            assert_eq!(s.dims(), &[] as &[usize]);
            seen.push(s.to_scalar::<f32>().unwrap().to_bits());
        }
        assert!(seen.windows(2).all(|w| w[0] == w[1]), "n {n}: {seen:?}");
        let s = f32::from_bits(seen[0]) as f64;
        assert!((s - exact).abs() <= 1e-6 * (n as f64 + 1.0), "n {n}: {s} vs {exact}");
        let candle = t.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
        assert!((s - candle).abs() <= 1e-6 * (n as f64 + 1.0), "n {n}: {s} vs candle {candle}");
    }
    let nan = Tensor::new(&[1.0f32, f32::NAN], &dev()).unwrap();
    assert!(multihead::sum_f32(&nan).unwrap().to_scalar::<f32>().unwrap().is_nan());
}

#[test]
fn sum_f32_gradients_fill_the_input_shape_and_dtype() {
    // f32 through a transposed (strided) view: each element's gradient is 2 (from `* 2`).
    let x =
        Var::from_tensor(&Tensor::new(ramp(12), &dev()).unwrap().reshape((3, 4)).unwrap()).unwrap();
    let y = (x.as_tensor().t().unwrap() * 2.0).unwrap();
    let loss = multihead::sum_f32(&y).unwrap();
    let want: f32 = ramp(12).iter().map(|v| v * 2.0).sum();
    assert!((loss.to_scalar::<f32>().unwrap() - want).abs() <= 1e-5);
    let g = loss.backward().unwrap();
    let gx = g.get(x.as_tensor()).expect("x has a gradient");
    assert_eq!(gx.dims(), &[3, 4]);
    assert!(gx.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|&v| v == 2.0));

    // bf16: the sum is of the bf16 values, in f32; the gradient is bf16, as candle's own
    // `to_dtype(F32).sum_all()` gives.
    let xb = Var::from_tensor(
        &multihead::cast(&Tensor::new(ramp(1000), &dev()).unwrap(), DType::BF16).unwrap(),
    )
    .unwrap();
    let ours = multihead::sum_f32(xb.as_tensor()).unwrap();
    let theirs = xb.as_tensor().to_dtype(DType::F32).unwrap().sum_all().unwrap();
    let (a, b) = (ours.to_scalar::<f32>().unwrap(), theirs.to_scalar::<f32>().unwrap());
    assert_eq!(ours.dtype(), DType::F32);
    assert!((a - b).abs() <= 1e-3, "{a} vs {b}");
    let (ga, gb) = (ours.backward().unwrap(), theirs.backward().unwrap());
    let (ga, gb) = (ga.get(xb.as_tensor()).unwrap(), gb.get(xb.as_tensor()).unwrap());
    assert_eq!(ga.dtype(), DType::BF16);
    let bits = |t: &Tensor| -> Vec<u16> {
        t.to_vec1::<half::bf16>().unwrap().iter().map(|v| v.to_bits()).collect()
    };
    assert_eq!(bits(ga), bits(gb));
}

#[test]
fn sum_f32_takes_other_dtypes_through_candle() {
    let x = Tensor::new(&[1.5f64, 2.25, -1.0], &dev()).unwrap();
    let s = multihead::sum_f32(&x).unwrap();
    assert_eq!((s.dtype(), s.to_scalar::<f32>().unwrap()), (DType::F32, 2.75));
    // A huge broadcast view is copied before it is summed: an error, not an abort.
    let big = Tensor::new(1f32, &dev()).unwrap().broadcast_as((1 << 22, 1 << 22)).unwrap();
    let e = multihead::sum_f32(&big).unwrap_err().to_string();
    assert!(e.contains("sum_f32"), "{e}");
}
