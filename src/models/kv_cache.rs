//! A key/value cache for one attention layer, owned by the caller: preallocated to a
//! capacity, grown by doubling (no quadratic copying), keys and values stored once per K/V
//! head (never repeated per query head).

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// Keys `(batch, kv_heads, capacity, head_dim)` and values `(batch, kv_heads, capacity,
/// v_head_dim)`, of which the first `len` positions are filled.
#[derive(Debug, Clone)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
    capacity: usize,
    /// How many times the buffers were allocated (for tests of the steady state).
    allocations: usize,
}

impl KvCache {
    /// An empty cache that allocates room for `capacity` positions on first use.
    pub fn new(capacity: usize) -> Self {
        Self {
            k: None,
            v: None,
            len: 0,
            capacity: capacity.max(1),
            allocations: 0,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the buffers hold before they grow.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// How many times the buffers were allocated (1 after the first append while the
    /// capacity suffices).
    pub fn allocations(&self) -> usize {
        self.allocations
    }

    /// Forgets every position (the buffers are kept).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Keeps the first `len` positions (for reuse of a shared prefix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Appends `k` and `v` and returns every cached position (views, no copy).
    ///
    /// # Shapes
    /// - `k`: `(batch, kv_heads, seq, head_dim)`, `v`: `(batch, kv_heads, seq, v_head_dim)`
    /// - returns `(batch, kv_heads, len, head_dim)` and `(batch, kv_heads, len, v_head_dim)`
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, h, t, dk) = k.dims4()?;
        let (bv, hv, tv, dv) = v.dims4()?;
        if (bv, hv, tv) != (b, h, t) {
            return Err(Error::input(
                "v",
                format!("(batch, kv_heads, seq) = ({b}, {h}, {t}) like k"),
                format!("shape {:?}", v.dims()),
            ));
        }
        let need = self.len + t;
        let fits = |buf: &Option<Tensor>, d: usize| -> Result<bool> {
            Ok(match buf {
                Some(x) => {
                    let (xb, xh, cap, xd) = x.dims4()?;
                    (xb, xh, xd) == (b, h, d) && cap >= need && x.dtype() == k.dtype()
                }
                None => false,
            })
        };
        if !fits(&self.k, dk)? || !fits(&self.v, dv)? {
            self.grow(b, h, (dk, dv), need, k.dtype(), k.device())?;
        }
        let (kb, vb) = match (&self.k, &self.v) {
            (Some(kb), Some(vb)) => (kb, vb),
            _ => return Err(Error::Kernel("cache buffers missing after growth".into())),
        };
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len = need;
        Ok((kb.narrow(2, 0, need)?, vb.narrow(2, 0, need)?))
    }

    /// The cached positions `(k, v)` (views), `None` when empty.
    pub fn current(&self) -> Result<Option<(Tensor, Tensor)>> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) if self.len > 0 => {
                Ok(Some((k.narrow(2, 0, self.len)?, v.narrow(2, 0, self.len)?)))
            }
            _ => Ok(None),
        }
    }

    /// New buffers of at least `need` positions (doubling), the held positions copied over.
    fn grow(
        &mut self,
        b: usize,
        h: usize,
        (dk, dv): (usize, usize),
        need: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<()> {
        let mut cap = self.capacity;
        while cap < need {
            cap *= 2;
        }
        let nk = Tensor::zeros((b, h, cap, dk), dtype, device)?;
        let nv = Tensor::zeros((b, h, cap, dv), dtype, device)?;
        if let (Some(ok), Some(ov), true) = (&self.k, &self.v, self.len > 0) {
            if ok.dims4()?.0 == b && ok.dims4()?.1 == h && ok.dims4()?.3 == dk {
                nk.slice_set(&ok.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
                nv.slice_set(&ov.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
            } else {
                return Err(Error::input(
                    "k",
                    format!("the cache's (batch, kv_heads, head_dim) {:?}", ok.dims()),
                    format!("batch {b}, kv_heads {h}, head_dim {dk}"),
                ));
            }
        }
        self.k = Some(nk);
        self.v = Some(nv);
        self.capacity = cap;
        self.allocations += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_grow_by_doubling_and_keep_the_positions() -> Result<()> {
        let dev = Device::Cpu;
        let mut c = KvCache::new(4);
        let step = |i: usize| -> Result<(Tensor, Tensor)> {
            let k = Tensor::full(i as f32, (1, 2, 1, 3), &dev)?;
            let v = Tensor::full(-(i as f32), (1, 2, 1, 5), &dev)?;
            Ok((k, v))
        };
        let (k0, v0) = (
            Tensor::zeros((1, 2, 3, 3), DType::F32, &dev)?,
            Tensor::zeros((1, 2, 3, 5), DType::F32, &dev)?,
        );
        c.append(&k0, &v0)?;
        assert_eq!((c.len(), c.allocations()), (3, 1));
        for i in 3..20 {
            let (k, v) = step(i)?;
            let (ka, va) = c.append(&k, &v)?;
            assert_eq!(ka.dims(), &[1, 2, i + 1, 3]);
            assert_eq!(va.dims(), &[1, 2, i + 1, 5]);
            let last: Vec<f32> = ka.narrow(2, i, 1)?.flatten_all()?.to_vec1()?;
            assert!(last.iter().all(|&x| x == i as f32));
        }
        // 3 -> 4 -> 8 -> 16 -> 32 positions: four allocations for twenty positions.
        assert_eq!((c.capacity(), c.allocations()), (32, 4));
        let (k, _) = c.current()?.expect("held");
        let first: Vec<f32> = k.narrow(2, 5, 1)?.flatten_all()?.to_vec1()?;
        assert!(first.iter().all(|&x| x == 5.0));
        c.truncate(6);
        c.reset();
        assert!(c.is_empty());
        let (k, v) = step(1)?;
        c.append(&k, &v)?;
        assert_eq!(
            (c.len(), c.allocations()),
            (1, 4),
            "reuse without reallocating"
        );
        Ok(())
    }
}
