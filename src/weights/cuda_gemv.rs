//! One f32 row times a weight in its blocks on CUDA, exact: for the 32-value block types
//! candle's `dequantize_mul_mat_vec_*` kernels (llama.cpp's former DMMV), which turn each
//! pair of a block's values into f32 in registers, as gguf-py makes them (`d * q + m`,
//! `(q - 16) * d`, `q * d`: each product exact in f32), and multiply-add them into f32 sums;
//! for the K-quants this crate's `exact_gemv_k.cu` (compiled by build.rs), each value made
//! as gguf-py makes it (candle's K-quant kernels scale each group's sum instead). One launch
//! a product. Without it a decode step dequantized every weight into a transient f32 copy
//! (written and read again: ~7x the blocks' bytes for a 4-bit type) and then multiplied it.
//! candle reaches its kernels only through a process-wide switch (`set_force_dmmv`), hence
//! this custom op.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{kernels, WrapErr};
use candle_core::quantized::QTensor;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, Shape};

use crate::kernels::quant::blocks::{QuantType, QK_K};

/// Values a warp covers per step of its row in candle's kernels (their `2 *
/// GGML_CUDA_DMMV_X`): a row of another width would read into the next row.
const ROW_STEP: usize = 64;

/// The K-quant kernels' PTX (build.rs).
const EXACT_K_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/exact_gemv_k.ptx"));

/// Rows a launch block of the K-quant kernels takes (one warp each).
const K_ROWS_PER_BLOCK: u32 = 4;

/// Where a kernel comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// candle-kernels' quantized module.
    Candle,
    /// This crate's `exact_gemv_k.cu`.
    ExactK,
}

/// `x W^T` for one f32 row `x` `(..., cols)` and the blocks `w` `(rows, cols)` on the same
/// CUDA device.
pub(crate) struct ExactGemv {
    pub w: Arc<QTensor>,
    pub ty: QuantType,
    pub rows: usize,
    pub cols: usize,
}

impl ExactGemv {
    /// The kernel for `ty` whose values are gguf-py's, one by one, when the row width fits
    /// its steps: candle's for the 32-value block types, ours for the K-quants (whole
    /// 256-value blocks).
    pub fn kernel(ty: QuantType, cols: usize) -> Option<(&'static str, Source)> {
        if cols == 0 {
            return None;
        }
        let candle = |name| (cols % ROW_STEP == 0).then_some((name, Source::Candle));
        let ours = |name| (cols % QK_K == 0).then_some((name, Source::ExactK));
        match ty {
            QuantType::Q4_0 => candle("dequantize_mul_mat_vec_q4_0_cuda"),
            QuantType::Q4_1 => candle("dequantize_mul_mat_vec_q4_1_cuda"),
            QuantType::Q5_0 => candle("dequantize_mul_mat_vec_q5_0_cuda"),
            QuantType::Q5_1 => candle("dequantize_mul_mat_vec_q5_1_cuda"),
            QuantType::Q8_0 => candle("dequantize_mul_mat_vec_q8_0_cuda"),
            QuantType::Q2K => ours("exact_gemv_q2_k"),
            QuantType::Q3K => ours("exact_gemv_q3_k"),
            QuantType::Q4K => ours("exact_gemv_q4_k"),
            QuantType::Q5K => ours("exact_gemv_q5_k"),
            QuantType::Q6K => ours("exact_gemv_q6_k"),
            _ => None,
        }
    }
}

impl CustomOp1 for ExactGemv {
    fn name(&self) -> &'static str {
        "exact-gemv"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("exact-gemv runs on CUDA (the CPU has its own row kernels)")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let Some((name, source)) = Self::kernel(self.ty, self.cols) else {
            candle_core::bail!(
                "exact-gemv: no kernel for {} rows of {}",
                self.ty,
                self.cols
            )
        };
        let dims = layout.shape().dims();
        if dims.last() != Some(&self.cols) || layout.shape().elem_count() != self.cols {
            candle_core::bail!("exact-gemv: one row of {} values, got {dims:?}", self.cols)
        }
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("exact-gemv: the row must be contiguous")
        };
        if !self
            .w
            .device()
            .same_device(&candle_core::Device::Cuda(x.device().clone()))
        {
            candle_core::bail!("exact-gemv: the blocks are on another device")
        }
        let dev = x.device().clone();
        let xs = x.as_cuda_slice::<f32>()?.slice(start..end);
        let func = match source {
            Source::Candle => dev.get_or_load_func(name, &kernels::QUANTIZED)?,
            Source::ExactK => dev.get_or_load_custom_func(name, "exact_gemv_k", EXACT_K_PTX)?,
        };
        // SAFETY: the kernel writes each of the `rows` outputs (one warp a row).
        let out = unsafe { dev.alloc::<f32>(self.rows)? };
        // The blocks as candle keeps them: `rows * cols` values of `ty` (and padding).
        let blocks = self.w.device_ptr()? as u64;
        let (cols, rows) = (self.cols as i32, self.rows as i32);
        // One warp a row: candle's one a block, ours `K_ROWS_PER_BLOCK` a block.
        let per_block = match source {
            Source::Candle => 1,
            Source::ExactK => K_ROWS_PER_BLOCK,
        };
        let cfg = LaunchConfig {
            grid_dim: ((self.rows as u32).div_ceil(per_block), 1, 1),
            block_dim: (32, per_block, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = func.builder();
        launch.arg(&blocks);
        launch.arg(&xs);
        launch.arg(&out);
        launch.arg(&cols);
        launch.arg(&rows);
        // SAFETY: the arguments are the kernel's (blocks, f32 row of `cols`, `rows` outputs,
        // `cols`, `rows`); the blocks hold `rows` rows of `cols` values of `ty`, on the
        // device of `x`, whose stream the function was loaded on.
        unsafe { launch.launch(cfg) }.w()?;
        let mut shape = dims.to_vec();
        if let Some(last) = shape.last_mut() {
            *last = self.rows;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from_dims(&shape),
        ))
    }
}
