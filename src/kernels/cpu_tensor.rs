//! Borrowing the f32 data of a CPU tensor (no copy) for the kernels.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Storage, StorageRef, Tensor};

use crate::error::{Error, Result};
use crate::kernels::gemm::matrix::MatRef;

/// A read lock on a CPU f32 tensor's storage, with the tensor's layout.
pub(crate) struct CpuF32<'a> {
    guard: StorageRef<'a>,
    layout: &'a Layout,
    name: &'static str,
}

impl<'a> CpuF32<'a> {
    /// Borrows `t`, which must be an f32 tensor on the CPU.
    pub fn new(t: &'a Tensor, name: &'static str) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        let this = Self {
            guard,
            layout,
            name,
        };
        this.slice()?;
        Ok(this)
    }

    /// The whole storage (the view starts at `layout().start_offset()`).
    pub fn slice(&self) -> Result<&[f32]> {
        match &*self.guard {
            Storage::Cpu(CpuStorage::F32(v)) => Ok(v.as_slice()),
            other => Err(Error::Kernel(format!(
                "`{}` must be f32 on the CPU for this kernel, found {:?} on {:?}",
                self.name,
                other.dtype(),
                other.device().location()
            ))),
        }
    }

    /// The values of a contiguous tensor, in order.
    pub fn contiguous(&self) -> Result<&[f32]> {
        match self.layout.contiguous_offsets() {
            Some((start, end)) => self
                .slice()?
                .get(start..end)
                .ok_or_else(|| Error::Kernel(format!("`{}` runs past its storage", self.name))),
            None => Err(Error::Kernel(format!(
                "`{}` must be contiguous, found dims {:?} strides {:?}",
                self.name,
                self.layout.dims(),
                self.layout.stride()
            ))),
        }
    }

    pub fn layout(&self) -> &Layout {
        self.layout
    }

    /// A rank-2 tensor as a matrix view.
    pub fn matrix(&self) -> Result<MatRef<'_>> {
        let stride = self.layout.stride();
        let dims = self.layout.dims();
        if dims.len() != 2 {
            return Err(Error::Kernel(format!(
                "`{}` must be a matrix, found dims {dims:?}",
                self.name
            )));
        }
        MatRef::new(
            self.slice()?,
            self.layout.start_offset(),
            dims[0],
            dims[1],
            stride[0],
            stride[1],
        )
    }

    /// A rank-1 tensor as a contiguous slice (copied only when it is strided).
    pub fn vector(&self) -> Result<std::borrow::Cow<'_, [f32]>> {
        let dims = self.layout.dims();
        if dims.len() != 1 {
            return Err(Error::Kernel(format!(
                "`{}` must be a vector, found dims {dims:?}",
                self.name
            )));
        }
        let (n, s, o) = (dims[0], self.layout.stride()[0], self.layout.start_offset());
        let data = self.slice()?;
        if s == 1 || n <= 1 {
            let end = o + n;
            if end > data.len() {
                return Err(Error::Kernel(format!(
                    "`{}` runs past its storage",
                    self.name
                )));
            }
            Ok(std::borrow::Cow::Borrowed(&data[o..end]))
        } else {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                let x = data.get(o + i * s).copied().ok_or_else(|| {
                    Error::Kernel(format!("`{}` runs past its storage", self.name))
                })?;
                v.push(x);
            }
            Ok(std::borrow::Cow::Owned(v))
        }
    }
}

/// The values of a contiguous f32 storage view (what a candle custom op's forward sees).
pub(crate) fn storage_f32<'a>(s: &'a CpuStorage, l: &Layout, name: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        return Err(Error::Kernel(format!(
            "`{name}` must be f32 for the differentiable CPU kernels, found {:?}",
            s.dtype()
        )));
    };
    match l.contiguous_offsets() {
        Some((start, end)) if end <= v.len() => Ok(&v[start..end]),
        _ => Err(Error::Kernel(format!(
            "`{name}` must be contiguous, found dims {:?} strides {:?}",
            l.dims(),
            l.stride()
        ))),
    }
}
