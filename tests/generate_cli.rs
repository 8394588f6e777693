//! The contract of `examples/generate.rs` on the decoder fixtures, as directories and as
//! GGUF files: JSON output fields, greedy ids and `--logits` rows equal transformers', EOS
//! handling, clear errors.

mod common;

use std::process::Command;

use candle_attention::Checkpoint;
use candle_core::{DType, Device};
use common::{max_abs_diff, repo_path, TempDir};

fn run(args: &[&str]) -> anyhow::Result<std::process::Output> {
    Ok(Command::new(common::example_bin("generate")?)
        .args(args)
        .current_dir(repo_path(""))
        .output()?)
}

/// The JSON `generate` prints for `args`; an error with its stderr when it fails.
fn run_json(args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let out = run(args)?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_str(String::from_utf8(out.stdout)?.trim())?)
}

#[test]
fn json_ids_and_logits_equal_transformers() -> anyhow::Result<()> {
    let dir = TempDir::new("generate-cli")?;
    let sources = [
        ("llama_gqa", "tests/fixtures/decoders/llama_gqa"),
        ("qwen2_tied", "tests/fixtures/decoders/qwen2_tied"),
        ("mistral_window", "tests/fixtures/decoders/mistral_window"),
        // The same models as llama.cpp writes them (F32, rotary rows permuted).
        ("llama_gqa", "tests/fixtures/gguf/llama_gqa.f32.gguf"),
        ("qwen2_tied", "tests/fixtures/gguf/qwen2_tied.f32.gguf"),
    ];
    for (n, (case, source)) in sources.into_iter().enumerate() {
        let model = repo_path(source);
        let exp = Checkpoint::open(repo_path(&format!(
            "tests/fixtures/decoders/{case}/expected.safetensors"
        )))?;
        let prompt: Vec<i64> = exp
            .tensor("input_ids", &Device::Cpu)?
            .squeeze(0)?
            .to_vec1()?;
        let want: Vec<i64> = exp.tensor("generated_ids", &Device::Cpu)?.to_vec1()?;
        let prompt_arg = prompt
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let logits = dir.file(&format!("{case}-{n}.safetensors"));
        let n = want.len().to_string();
        let out = run(&[
            "--model",
            model.to_str().unwrap_or_default(),
            "--prompt-ids",
            &prompt_arg,
            "--max-new-tokens",
            &n,
            "--ignore-eos",
            "--format",
            "json",
            "--logits",
            logits.to_str().unwrap_or_default(),
        ])?;
        anyhow::ensure!(
            out.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout)?;
        assert_eq!(
            stdout.trim().lines().count(),
            1,
            "{case}: one JSON object: {stdout}"
        );
        let obj: serde_json::Value = serde_json::from_str(stdout.trim())?;
        let ids = |k: &str| -> Vec<i64> {
            obj[k]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_i64())
                .collect()
        };
        assert_eq!(ids("prompt_ids"), prompt, "{case}");
        assert_eq!(ids("generated_ids"), want, "{case}");
        assert!(
            obj["prefill_ms"].as_f64().is_some_and(|v| v > 0.0),
            "{case}: {obj}"
        );
        assert!(
            obj["decode_tokens_per_s"].as_f64().is_some_and(|v| v > 0.0),
            "{case}: {obj}"
        );
        assert!(obj.get("text").is_none(), "{case}: no tokenizer, no text");
        let got = candle_core::safetensors::load(&logits, &Device::Cpu)?;
        let got = &got["logits"];
        assert_eq!(got.dtype(), DType::F32);
        let want_rows = exp.tensor("generation_logits", &Device::Cpu)?;
        assert_eq!(
            got.dims(),
            want_rows.dims(),
            "{case}: (prompt + N - 1, vocab)"
        );
        let scale = want_rows.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            max_abs_diff(got, &want_rows)? <= 1e-4 * scale,
            "{case}: logits"
        );
    }
    Ok(())
}

#[test]
fn stops_at_the_eos_token_unless_told_not_to() -> anyhow::Result<()> {
    // The llama_gqa fixture's eos_token_id is 2; a prompt whose greedy continuation reaches
    // it is searched for among short prompts, then generation must stop right after it.
    let model = repo_path("tests/fixtures/decoders/llama_gqa");
    let model = model.to_str().unwrap_or_default();
    // The generated ids of a 40-token run, with `extra` flags.
    let ids = |prompt: &str, extra: &[&str]| -> anyhow::Result<Vec<i64>> {
        let mut args = vec![
            "--model",
            model,
            "--prompt-ids",
            prompt,
            "--max-new-tokens",
            "40",
            "--format",
            "json",
        ];
        args.extend_from_slice(extra);
        let obj = run_json(&args)?;
        Ok(obj["generated_ids"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_i64())
            .collect())
    };
    let mut seen = false;
    for first in 3..60u32 {
        let prompt = format!("1,{first},{}", (first * 7) % 120 + 3);
        let got = ids(&prompt, &[])?;
        if let Some(pos) = got.iter().position(|&t| t == 2) {
            assert_eq!(pos, got.len() - 1, "stops right after EOS: {got:?}");
            assert_eq!(ids(&prompt, &["--ignore-eos"])?.len(), 40, "--ignore-eos");
            seen = true;
            break;
        }
    }
    assert!(seen, "no short prompt reached EOS within 40 tokens");
    Ok(())
}

/// The generated ids of `model` for a fixed prompt, 12 at most, with `extra` flags.
fn generated_ids(model: &std::path::Path, extra: &[&str]) -> anyhow::Result<Vec<u32>> {
    let model = model.to_str().unwrap_or_default();
    let mut args = vec![
        "--model",
        model,
        "--prompt-ids",
        "1,17,42,5",
        "--max-new-tokens",
        "12",
        "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    Ok(run_json(&args)?["generated_ids"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_u64())
        .map(|v| v as u32)
        .collect())
}

/// The first position after the first whose id is new in `ids` and not `eos`.
fn fresh_position(ids: &[u32], eos: u32) -> Option<usize> {
    (1..ids.len()).find(|&k| ids[k] != eos && !ids[..k].contains(&ids[k]))
}

#[test]
fn stops_at_generation_config_s_ids_and_a_gguf_file_s_end_of_turn_id() -> anyhow::Result<()> {
    use candle_core::quantized::gguf_file;
    // A directory: generation_config.json's list names one more id than config.json (2).
    let dir = common::chat_decoder_dir("generate-end-ids")?;
    let free = generated_ids(&dir.0, &["--ignore-eos"])?;
    let k = fresh_position(&free, 2).ok_or_else(|| anyhow::anyhow!("no fresh id: {free:?}"))?;
    dir.write(
        "generation_config.json",
        format!(r#"{{"eos_token_id": [2, {}]}}"#, free[k]).as_bytes(),
    )?;
    assert_eq!(generated_ids(&dir.0, &[])?, free[..=k], "directory");
    assert_eq!(generated_ids(&dir.0, &["--ignore-eos"])?, free);

    // A GGUF file: the same file with `tokenizer.ggml.eot_token_id` added.
    let source = repo_path("tests/fixtures/gguf/llama_gqa.q8_0.gguf");
    let free = generated_ids(&source, &["--ignore-eos"])?;
    let k = fresh_position(&free, 2).ok_or_else(|| anyhow::anyhow!("no fresh id: {free:?}"))?;
    let mut reader = std::fs::File::open(&source)?;
    let content = gguf_file::Content::read(&mut reader)?;
    let eot = gguf_file::Value::U32(free[k]);
    let mut metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    metadata.push(("tokenizer.ggml.eot_token_id", &eot));
    let tensors = content
        .tensor_infos
        .keys()
        .map(|name| {
            Ok((
                name.clone(),
                content.tensor(&mut reader, name, &Device::Cpu)?,
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let tensors: Vec<(&str, &candle_core::quantized::QTensor)> =
        tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let path = dir.file("eot.gguf");
    gguf_file::write(&mut std::fs::File::create(&path)?, &metadata, &tensors)?;
    assert_eq!(generated_ids(&path, &[])?, free[..=k], "GGUF eot");
    assert_eq!(generated_ids(&path, &["--ignore-eos"])?, free);
    Ok(())
}

#[test]
fn int8_activations_say_where_they_do_not_apply() -> anyhow::Result<()> {
    let ids = [
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "2",
        "--format",
        "json",
    ];
    for (model, noted) in [
        ("tests/fixtures/decoders/llama_gqa", true),
        ("tests/fixtures/gguf/llama_gqa.q8_0.gguf", false),
    ] {
        let path = repo_path(model);
        let mut args = vec![
            "--model",
            path.to_str().unwrap_or_default(),
            "--int8-activations",
        ];
        args.extend(ids);
        let out = run(&args)?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{model}: {err}");
        assert_eq!(
            err.contains("--int8-activations applies to .gguf"),
            noted,
            "{model}: {err}"
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(
            json["generated_ids"].as_array().map(Vec::len),
            Some(2),
            "{model}"
        );
    }
    Ok(())
}

#[test]
fn text_output_and_prompt_text_need_a_tokenizer() -> anyhow::Result<()> {
    let model = repo_path("tests/fixtures/decoders/llama_gqa");
    let model = model.to_str().unwrap_or_default();
    for args in [
        vec!["--model", model, "--prompt", "hello"],
        vec!["--model", model, "--prompt-ids", "1,2,3"],
    ] {
        let out = run(&args)?;
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("error: ") && err.contains("tokenizer.json"),
            "{err}"
        );
    }
    // A GGUF file without tokenizer metadata: the error says what is missing.
    let gguf = repo_path("tests/fixtures/gguf/llama_gqa.q8_0.gguf");
    let out = run(&[
        "--model",
        gguf.to_str().unwrap_or_default(),
        "--prompt",
        "hello",
    ])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("tokenizer.ggml.model") && err.contains("--prompt-ids"),
        "{err}"
    );
    for missing in ["/nonexistent/model.gguf", "/nonexistent/dir"] {
        let out = run(&["--model", missing, "--prompt-ids", "1", "--format", "json"])?;
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains(missing));
    }
    let out = run(&[
        "--model",
        "/nonexistent/dir",
        "--prompt-ids",
        "1",
        "--format",
        "json",
    ])?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/dir"));
    Ok(())
}

/// `--chat`: the prompt in the directory's chat template (`tokenizer_config.json`), after
/// `--system`'s message, tokenized with no special tokens added (the tokenizer would put
/// `<s>` first); a model without a template, or `--system` without `--chat`, is refused.
#[test]
fn chat_puts_the_prompt_in_the_model_s_template() -> anyhow::Result<()> {
    let dir = common::chat_decoder_dir("generate-chat")?;
    let model = dir.0.to_str().unwrap_or_default().to_string();
    let prompt_ids = |extra: &[&str]| -> anyhow::Result<Vec<u64>> {
        let mut args = vec![
            "--model",
            &model,
            "--prompt",
            "Hi there",
            "--max-new-tokens",
            "1",
        ];
        args.extend_from_slice(&["--format", "json"]);
        args.extend_from_slice(extra);
        let json = run_json(&args)?;
        Ok(json["prompt_ids"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
            .unwrap_or_default())
    };
    assert_eq!(prompt_ids(&[])?, [1, 10, 11]);

    // No template yet: refused, naming where it was looked for.
    let out = run(&["--model", &model, "--prompt", "Hi", "--chat"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--chat needs a chat template") && err.contains("tokenizer_config.json"),
        "{err}"
    );

    common::add_chat_template(&dir)?;
    assert_eq!(prompt_ids(&["--chat"])?, [3, 6, 10, 11, 4, 3, 7]);
    assert_eq!(
        prompt_ids(&["--chat", "--system", "Be brief"])?,
        [3, 5, 8, 9, 4, 3, 6, 10, 11, 4, 3, 7]
    );

    // `--system` needs `--chat`, and `--chat` a text prompt.
    for (args, says) in [
        (
            ["--system", "Be brief", "--prompt", "Hi"],
            "required arguments were not provided",
        ),
        (
            ["--chat", "--prompt-ids", "1,2", "--ignore-eos"],
            "cannot be used with",
        ),
    ] {
        let mut all = vec!["--model", model.as_str()];
        all.extend_from_slice(&args);
        let out = run(&all)?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            err.contains(says) && err.contains("--chat"),
            "{args:?}: {err}"
        );
    }
    Ok(())
}
