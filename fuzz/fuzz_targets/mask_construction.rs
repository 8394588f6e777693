//! Mask construction and application from arbitrary bytes: padding masks with arbitrary
//! values and shapes, keep/block/bias masks of arbitrary rank and shape, causal offsets,
//! combinations, applied to attention of arbitrary small sizes. Errors are fine; panics,
//! NaN in the weights of a valid call and hangs are bugs.
#![no_main]

use candle_attention::{scaled_dot_product_attention, AttentionMask, SdpaOptions};
use candle_core::{DType, Device, Tensor};
use libfuzzer_sys::fuzz_target;

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn small(&mut self, max: u8) -> usize {
        (self.byte() % (max + 1)) as usize
    }
    fn shape(&mut self) -> Vec<usize> {
        let rank = self.small(5);
        (0..rank).map(|_| self.small(5)).collect()
    }
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| match self.byte() {
                250 => f32::NEG_INFINITY,
                251 => f32::INFINITY,
                252 => f32::NAN,
                b => (b as f32 - 128.0) / 32.0,
            })
            .collect()
    }
    fn tensor(&mut self) -> Option<Tensor> {
        let shape = self.shape();
        let n = shape.iter().product();
        let v = self.values(n);
        let t = Tensor::from_vec(v, shape, &Device::Cpu).ok()?;
        match self.byte() % 4 {
            0 => Some(t),
            1 => t.to_dtype(DType::U8).ok(),
            2 => t.to_dtype(DType::I64).ok(),
            _ => t.to_dtype(DType::F16).ok(),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut r = Bytes(data);
    let (b, kv, g) = (1 + r.small(2), 1 + r.small(2), 1 + r.small(2));
    let (sq, sk, dk) = (1 + r.small(5), 1 + r.small(5), 1 + r.small(4));
    let h = kv * g;
    let mut mask = AttentionMask::none();
    let mut any_float_bias = false;
    for _ in 0..r.small(3) {
        let part = match r.byte() % 5 {
            0 => Some(AttentionMask::causal_with_offset(r.small(6))),
            1 => r.tensor().and_then(|t| AttentionMask::padding(&t).ok()),
            2 => r.tensor().and_then(|t| AttentionMask::keep(&t).ok()),
            3 => r.tensor().and_then(|t| AttentionMask::block(&t).ok()),
            _ => {
                any_float_bias = true;
                r.tensor().and_then(|t| AttentionMask::bias(&t).ok())
            }
        };
        if let Some(p) = part {
            mask = mask.and(p);
        }
    }
    let _ = mask.to_bias(b, h, sq, sk, &Device::Cpu);
    let dtype = match r.byte() % 3 {
        0 => DType::F32,
        1 => DType::F16,
        _ => DType::BF16,
    };
    let make = |r: &mut Bytes, shape: (usize, usize, usize, usize)| {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        Tensor::from_vec(
            r.values(n).into_iter().map(|x| if x.is_finite() { x } else { 1.0 }).collect::<Vec<_>>(),
            shape,
            &Device::Cpu,
        )
        .and_then(|t| t.to_dtype(dtype))
    };
    let (Ok(q), Ok(k), Ok(v)) = (
        make(&mut r, (b, h, sq, dk)),
        make(&mut r, (b, kv, sk, dk)),
        make(&mut r, (b, kv, sk, 1 + dk % 3)),
    ) else {
        return;
    };
    let Ok(out) = scaled_dot_product_attention(&q, &k, &v, Some(&mask), SdpaOptions::with_weights())
    else {
        return;
    };
    // With finite inputs and no user float bias (which may itself hold NaN/inf), the
    // weights must be finite.
    if !any_float_bias {
        if let Ok(w) = out.weights.expect("weights requested").flatten_all().and_then(|t| t.to_vec1::<f32>()) {
            assert!(w.iter().all(|x| x.is_finite()), "non-finite attention weights");
        }
    }
});
