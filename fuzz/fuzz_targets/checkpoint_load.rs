//! Checkpoint loading from arbitrary bytes: opening, listing, every layout with and
//! without a prefix, and a tiny forward pass when a layer loads. Errors are fine;
//! panics, aborts and hangs are bugs.
#![no_main]

use candle_attention::{AttentionConfig, Checkpoint, MultiHeadSelfAttention, WeightLayout};
use candle_core::{DType, Device, Tensor};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(ckpt) = Checkpoint::from_bytes(data.to_vec(), "fuzz.safetensors") else {
        return;
    };
    let names: Vec<String> = ckpt.names().map(str::to_string).collect();
    for name in names.iter().take(16) {
        let _ = ckpt.tensor(name, &Device::Cpu);
        let _ = ckpt.missing(name);
    }
    let _ = ckpt.check_prefix("attn");
    for layout in WeightLayout::ALL {
        for prefix in ["", "attn"] {
            for heads in [1usize, 2, 3] {
                let vb = ckpt.var_builder(DType::F32, &Device::Cpu);
                let vb = if prefix.is_empty() { vb } else { vb.pp(prefix) };
                let cfg = AttentionConfig::new(layout, heads);
                let Ok(attn) = MultiHeadSelfAttention::load(vb, &cfg) else {
                    continue;
                };
                let d = attn.hidden_size();
                if d == 0 || d > 256 {
                    continue;
                }
                if let Ok(x) = Tensor::ones((1, 3, d), DType::F32, &Device::Cpu) {
                    let _ = attn.forward_with_weights(&x, None);
                    let _ = attn.forward(&x, None);
                    if let Ok(kv) = Tensor::ones((1, 2, d), DType::F32, &Device::Cpu) {
                        let _ = attn.cross_attention(&x, &kv, None, true);
                    }
                }
            }
        }
    }
});
