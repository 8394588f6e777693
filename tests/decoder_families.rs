//! The decoder families beside LLaMA (Qwen3, Gemma 3, Phi-3, GPT-2, GPT-NeoX / Pythia)
//! against transformers: prompt
//! logits, every layer's eager attentions (1e-5), greedy ids with the cache, and the
//! dump's JSON; the cache against the full forward; fields the crate does not implement and
//! stray tensors refused by name. Fixtures: `scripts/gen_decoder_family_fixtures.py`.

mod common;

use std::path::{Path, PathBuf};

use candle_attention::{argmax_ids, Checkpoint, LlamaModel};
use candle_core::{DType, Device, IndexOp, Tensor};
use common::{
    assert_close, ids_in as u32s, largest_abs as largest, max_abs_diff, repo_path, TempDir,
};

const CASES: [&str; 5] = ["qwen3", "gemma3", "phi3", "gpt2", "pythia"];

fn case_dir(case: &str) -> PathBuf {
    repo_path(&format!("tests/fixtures/decoders/{case}"))
}

/// Greedy decoding with the cache (from a small capacity): the ids.
fn greedy(model: &LlamaModel, prompt: &[u32], n: usize) -> anyhow::Result<Vec<u32>> {
    let dev = Device::Cpu;
    let mut caches = model.new_caches(4);
    let ids = Tensor::new(prompt, &dev)?.unsqueeze(0)?;
    let mut out = argmax_ids(&model.forward_last(&ids, &mut caches)?)?;
    while out.len() < n {
        let ids = Tensor::new(&[out[out.len() - 1]], &dev)?.unsqueeze(0)?;
        out.extend(argmax_ids(&model.forward_last(&ids, &mut caches)?)?);
    }
    Ok(out)
}

#[test]
fn logits_attentions_and_greedy_ids_equal_transformers() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for case in CASES {
        let dir = case_dir(case);
        let model = LlamaModel::from_dir(&dir, DType::F32, &dev)?;
        let exp = Checkpoint::open(dir.join("expected.safetensors"))?;
        let prompt = u32s(&exp, "input_ids")?;
        let ids = Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?;
        let mut caches = model.new_caches(prompt.len());
        let logits = model.forward(&ids, &mut caches)?.squeeze(0)?;
        let want = exp.tensor("logits", &dev)?;
        let d = max_abs_diff(&logits, &want)?;
        assert!(
            d <= 1e-4 * largest(&want)?,
            "{case}: prompt logits off by {d:e}"
        );
        let attentions = Tensor::stack(&model.attentions(&ids)?, 0)?.squeeze(1)?; // (l, h, t, t)
        let want = exp.tensor("attentions", &dev)?;
        assert_close(&attentions, &want, 1e-5, &format!("{case} attentions"))?;
        let want_ids = u32s(&exp, "generated_ids")?;
        assert_eq!(
            greedy(&model, &prompt, want_ids.len())?,
            want_ids,
            "{case}: greedy ids"
        );
    }
    Ok(())
}

#[test]
fn decoding_step_by_step_equals_the_full_causal_forward() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for case in CASES {
        let model = LlamaModel::from_dir(case_dir(case), DType::F32, &dev)?;
        let vocab = model.config().vocab_size as u32;
        let prompt: Vec<u32> = (0..19u32).map(|i| (i * 37 + 5) % vocab).collect();
        let mut caches = model.new_caches(prompt.len());
        let all = Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?;
        let full = model.forward(&all, &mut caches)?.squeeze(0)?;
        let mut caches = model.new_caches(prompt.len());
        let first = Tensor::new(&prompt[..7], &dev)?.unsqueeze(0)?;
        let mut rows = vec![model.forward(&first, &mut caches)?.squeeze(0)?];
        for &t in &prompt[7..] {
            let one = Tensor::new(&[t], &dev)?.unsqueeze(0)?;
            rows.push(model.forward(&one, &mut caches)?.squeeze(0)?);
        }
        let d = max_abs_diff(&Tensor::cat(&rows, 0)?, &full)?;
        assert!(
            d <= 1e-5 * largest(&full)?.max(1.0),
            "{case}: stepped vs full {d:e}"
        );
    }
    Ok(())
}

/// `attention_dump --model DIR --format json`: every layer's and head's weights over the
/// model's own tokens equal transformers'.
#[test]
fn attention_dump_json_matches_transformers() -> anyhow::Result<()> {
    let bin = common::example_bin("attention_dump")?;
    for case in CASES {
        let exp = Checkpoint::open(case_dir(case).join("expected.safetensors"))?;
        let text = prompt_text(&case_dir(case), &u32s(&exp, "input_ids")?)?;
        let out = std::process::Command::new(&bin)
            .arg("--model")
            .arg(case_dir(case))
            .args(["--format", "json", &text])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let want = exp.tensor("attentions", &Device::Cpu)?;
        let (l, h, t, _) = want.dims4()?;
        assert_eq!(line["shape"], serde_json::json!([l, h, t, t]), "{case}");
        let flat = common::json_floats(&line["attentions"]);
        let got = Tensor::from_vec(flat, (l, h, t, t), &Device::Cpu)?;
        assert_close(&got, &want, 1e-5, &format!("{case} dump"))?;
    }
    Ok(())
}

/// The words of the fixture's word-level tokenizer that give `ids` after its `<s>`.
fn prompt_text(dir: &Path, ids: &[u32]) -> anyhow::Result<String> {
    let tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json"))?)?;
    let vocab = tok["model"]["vocab"]
        .as_object()
        .ok_or_else(|| anyhow::anyhow!("no vocab"))?;
    let word = |id: u32| {
        vocab
            .iter()
            .find(|(_, v)| v.as_u64() == Some(id as u64))
            .map(|(w, _)| w.clone())
    };
    Ok(ids
        .iter()
        .skip(1)
        .filter_map(|&id| word(id))
        .collect::<Vec<_>>()
        .join(" "))
}

/// A copy of a case with its config edited and, optionally, a tensor added.
fn edited_copy(
    case: &str,
    edit: impl FnOnce(&mut serde_json::Value),
    extra_tensor: Option<&str>,
) -> anyhow::Result<TempDir> {
    common::edited_model_copy(&case_dir(case), case, edit, extra_tensor)
}

/// For each family, a field changed to a value the crate does not implement is refused with
/// its name, and so is a tensor the decoder would not read.
#[test]
fn unsupported_fields_and_stray_tensors_are_refused() -> anyhow::Result<()> {
    use serde_json::json;
    let cases = [
        ("gemma3", "final_logit_softcapping", json!(30.0)),
        ("gemma3", "attn_logit_softcapping", json!(50.0)),
        ("gemma3", "hidden_activation", json!("relu2")),
        (
            "qwen3",
            "layer_types",
            json!(["chunked_attention", "full_attention"]),
        ),
        (
            "qwen3",
            "rope_parameters",
            json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
        ),
        (
            "phi3",
            "rope_parameters",
            json!({"rope_type": "longrope", "rope_theta": 1e4}),
        ),
        ("phi3", "model_type", json!("phimoe")),
        ("gpt2", "scale_attn_by_inverse_layer_idx", json!(true)),
        ("gpt2", "scale_attn_weights", json!(false)),
        ("pythia", "hidden_act", json!("swiglu")),
        (
            "pythia",
            "rope_parameters",
            json!({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
        ),
    ];
    for (case, field, value) in cases {
        let dir = edited_copy(case, |cfg| cfg[field] = value.clone(), None)?;
        let err = match LlamaModel::from_dir(&dir.0, DType::F32, &Device::Cpu) {
            Ok(_) => anyhow::bail!("{case}: {field} = {value} was accepted"),
            Err(e) => e.to_string(),
        };
        let named = match field {
            "rope_parameters" => value["rope_type"].as_str().unwrap_or(field).to_string(),
            "model_type" => value.as_str().unwrap_or(field).to_string(),
            "hidden_activation" => "hidden_act".to_string(),
            _ => field.to_string(),
        };
        assert!(err.contains(&named), "{case} {field}: {err}");
    }
    for (case, stray) in [
        ("qwen3", "model.layers.0.self_attn.sinks"),
        ("gemma3", "model.layers.2.mlp.down_proj.weight"),
        ("phi3", "model.layers.0.self_attn.q_proj.weight"),
        ("gpt2", "transformer.h.0.attn.c_attn.scale"),
        ("pythia", "gpt_neox.layers.0.attention.query_key_value.lora"),
        ("pythia", "gpt_neox.emb_dropout.weight"),
    ] {
        let dir = edited_copy(case, |_| {}, Some(stray))?;
        let err = match LlamaModel::from_dir(&dir.0, DType::F32, &Device::Cpu) {
            Ok(_) => anyhow::bail!("{case}: a stray {stray} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(stray), "{case}: {err}");
    }
    Ok(())
}

/// Gemma 3's sliding layer sees only its last `sliding_window` keys; its global layer all.
#[test]
fn gemma3_sliding_layers_see_their_window_only() -> anyhow::Result<()> {
    let model = LlamaModel::from_dir(case_dir("gemma3"), DType::F32, &Device::Cpu)?;
    let w = model.config().sliding_window.unwrap_or(0);
    assert!(w > 0);
    let ids = Tensor::new(&[17u32, 3, 5, 8, 2, 9, 11, 4, 6, 1], &Device::Cpu)?.unsqueeze(0)?;
    let att = model.attentions(&ids)?;
    let (sliding, global) = (att[0].i((0, 0))?, att[1].i((0, 0))?); // (t, t)
    let (s, g): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (sliding.to_vec2()?, global.to_vec2()?);
    for i in 0..s.len() {
        for j in 0..=i {
            assert_eq!(s[i][j] == 0.0, i - j >= w, "sliding ({i}, {j})");
            assert!(g[i][j] > 0.0, "global ({i}, {j})");
        }
    }
    Ok(())
}
