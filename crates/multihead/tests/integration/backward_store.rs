//! The workspace's candle-core stores a first gradient as its op's backward returned it,
//! instead of adding it to a `zeros_like` (vendor/candle-core/PATCHED.md): the same numbers,
//! one allocation and one pass over memory fewer per graph edge. Fails if the `[patch]` goes.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor, Var};

use crate::common::dev;

/// `y = 2x`, whose backward keeps the gradient it returns so the test can find it again.
struct Double {
    returned: Arc<Mutex<Option<Tensor>>>,
}

impl CustomOp1 for Double {
    fn name(&self) -> &'static str {
        "double"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(v) = s else { candle_core::bail!("f32 only") };
        let (a, b) =
            l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("layout".into()))?;
        let out: Vec<f32> = v[a..b].iter().map(|x| 2.0 * x).collect();
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad.affine(2.0, 0.0)?.contiguous()?;
        *self.returned.lock().map_err(|_| candle_core::Error::Msg("poisoned".into()))? =
            Some(g.clone());
        Ok(Some(g))
    }
}

#[test]
fn a_first_gradient_is_stored_as_returned() {
    let x = Var::new(&[1f32, -2.0, 3.0], &dev()).unwrap();
    let returned = Arc::new(Mutex::new(None));
    let y = x.as_tensor().apply_op1(Double { returned: returned.clone() }).unwrap();
    let grads = (y * 3.0).unwrap().sum_all().unwrap().backward().unwrap();
    let gx = grads.get(x.as_tensor()).unwrap();
    assert_eq!(gx.to_vec1::<f32>().unwrap(), vec![6.0, 6.0, 6.0]);
    let returned = returned.lock().unwrap().clone().unwrap();
    assert_eq!(gx.id(), returned.id(), "the gradient was copied into zeros, not stored");
    // A tensor used twice still sums its gradients.
    let z = (x.as_tensor() + x.as_tensor()).unwrap();
    let grads = z.sum_all().unwrap().backward().unwrap();
    assert_eq!(grads.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap(), vec![2.0; 3]);
}
