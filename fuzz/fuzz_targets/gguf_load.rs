//! GGUF loading from arbitrary bytes: parsing, every metadata getter, every tensor's bytes
//! and its dequantization, the configuration, the tokenizer and the chat template from the
//! metadata. Errors are fine; panics, aborts, hangs and allocations the bytes
//! merely ask for are bugs.
#![no_main]

use candle_attention::GgufFile;
use candle_core::Device;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec(), "fuzz.gguf") else {
        return;
    };
    let keys: Vec<String> = file.metadata().map(|(k, _)| k.to_string()).collect();
    for key in keys.iter().take(64) {
        let _ = file.require_u64(key);
        let _ = file.require_f64(key);
        let _ = file.require_str(key);
    }
    let names: Vec<String> = file.tensors().iter().map(|t| t.name.clone()).collect();
    for name in names.iter().take(16) {
        let _ = file.tensor_data(name);
        let _ = file.dequantize(name, &Device::Cpu);
    }
    let _ = file.tensor_info("missing");
    // The model configuration and the tokenizer built from the metadata (byte-level or
    // SentencePiece, merges from the file or derived from the scores, rope_freqs).
    let _ = candle_attention::LlamaConfig::from_gguf(&file);
    let _ = file.end_of_generation_ids();
    let _ = candle_attention::TextEncoder::from_gguf(&file);
    // The chat template in the metadata, parsed and rendered (its work is bounded).
    if let Ok(Some(template)) = candle_attention::ChatTemplate::from_gguf(&file) {
        let _ = template.render(&[candle_attention::ChatMessage::new("user", "hi")], true);
    }
});
