//! Chat templates against transformers' renderer (`tests/fixtures/chat_templates.json`,
//! written by `scripts/gen_chat_fixtures.py`): SmolLM2's template from its GGUF file and
//! templates in the styles of LLaMA 3 / 3.1 (`tools` and `documents` none, variables
//! undefined), Mistral, Qwen2 and Gemma, and `tojson`'s keywords: the same text (or the same
//! refusal) for each conversation; SmolLM2's rendered prompts tokenized to llama.cpp's ids.

mod common;

use candle_attention::{ChatMessage, ChatTemplate, Error, GgufFile, TextEncoder};
use common::repo_path;

struct Case {
    template: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    text: Option<String>,
    error: Option<String>,
    ids: Option<Vec<u32>>,
}

fn fixture() -> anyhow::Result<(serde_json::Value, Vec<Case>)> {
    let text = std::fs::read_to_string(repo_path("tests/fixtures/chat_templates.json"))?;
    let doc: serde_json::Value = serde_json::from_str(&text)?;
    let str_of = |v: &serde_json::Value| v.as_str().map(str::to_string);
    let cases = doc["cases"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("no cases"))?
        .iter()
        .map(|c| Case {
            template: str_of(&c["template"]).unwrap_or_default(),
            messages: c["messages"]
                .as_array()
                .map(|m| {
                    m.iter()
                        .map(|m| {
                            ChatMessage::new(
                                m["role"].as_str().unwrap_or_default(),
                                m["content"].as_str().unwrap_or_default(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
            add_generation_prompt: c["add_generation_prompt"].as_bool().unwrap_or_default(),
            text: str_of(&c["text"]),
            error: str_of(&c["error"]),
            ids: c["ids"].as_array().map(|ids| {
                ids.iter()
                    .filter_map(|i| i.as_u64().map(|i| i as u32))
                    .collect()
            }),
        })
        .collect();
    Ok((doc, cases))
}

fn smollm2() -> anyhow::Result<GgufFile> {
    Ok(GgufFile::open(repo_path(
        "tests/fixtures/gguf/smollm2_tokenizer.gguf",
    ))?)
}

#[test]
fn templates_render_as_transformers_renders_them() -> anyhow::Result<()> {
    let (doc, cases) = fixture()?;
    assert!(cases.len() >= 42);
    let special = doc["special_tokens"]
        .as_object()
        .ok_or_else(|| anyhow::anyhow!("no special tokens"))?;
    let mut refused = 0;
    for case in &cases {
        let source = doc["templates"][&case.template]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("no template {}", case.template))?;
        let mut template = ChatTemplate::new(source)?;
        for (name, token) in special {
            template = template.with_special_token(name, token.as_str().unwrap_or_default());
        }
        let got = template.render(&case.messages, case.add_generation_prompt);
        let what = format!("{} {:?}", case.template, case.messages);
        match (&case.text, &case.error) {
            (Some(want), _) => assert_eq!(&got?, want, "{what}"),
            (None, Some(why)) => {
                refused += 1;
                match got {
                    Err(Error::ChatTemplate(m)) => assert!(m.contains(why.as_str()), "{m}"),
                    other => panic!("{what}: {other:?}, expected the refusal {why:?}"),
                }
            }
            (None, None) => anyhow::bail!("a case with neither text nor error"),
        }
    }
    assert!(refused >= 2, "the refusals are checked too");
    Ok(())
}

#[test]
fn smollm2_s_template_from_its_gguf_gives_llama_cpp_ids() -> anyhow::Result<()> {
    let (doc, cases) = fixture()?;
    let file = smollm2()?;
    let template = ChatTemplate::from_gguf(&file)?
        .ok_or_else(|| anyhow::anyhow!("SmolLM2's file has a chat template"))?;
    assert_eq!(
        Some(template.source()),
        doc["templates"]["smollm2"].as_str()
    );
    assert_eq!(template.special_token("bos_token"), Some("<|im_start|>"));
    assert_eq!(template.special_token("eos_token"), Some("<|im_end|>"));
    let text = TextEncoder::from_gguf(&file)?;
    let mut checked = 0;
    for case in cases.iter().filter(|c| c.template == "smollm2") {
        let rendered = template.render(&case.messages, case.add_generation_prompt)?;
        assert_eq!(Some(&rendered), case.text.as_ref());
        let ids = text
            .tokenizer()
            .encode(rendered.as_str(), false)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        assert_eq!(Some(ids.get_ids()), case.ids.as_deref(), "{rendered:?}");
        // The template's control tokens count as special (the tokenizer added none).
        let item = text.encode_as_is(&rendered)?;
        assert_eq!(item.ids, ids.get_ids());
        for (token, special) in item.tokens.iter().zip(&item.special) {
            assert_eq!(
                *special,
                token.starts_with("<|im_"),
                "{token:?} in {rendered:?}"
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 6);
    Ok(())
}

#[test]
fn a_gguf_without_a_template_has_none() -> anyhow::Result<()> {
    let file = GgufFile::open(repo_path("tests/fixtures/gguf/llama_gqa.q8_0.gguf"))?;
    assert!(ChatTemplate::from_gguf(&file)?.is_none());
    Ok(())
}

#[test]
fn a_checkpoint_directory_s_template_is_found_as_transformers_finds_it() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("candle-attention-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let message = [ChatMessage::new("user", "hi")];
    let config = |body: &str| std::fs::write(dir.join("tokenizer_config.json"), body);

    // No template: none.
    config(r#"{"bos_token": "<s>"}"#)?;
    assert!(ChatTemplate::from_dir(&dir)?.is_none());

    // A string, with the special tokens as strings or added-token objects.
    config(
        r#"{"chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}{{ eos_token }}",
            "bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "pad_token": null}"#,
    )?;
    let t = ChatTemplate::from_dir(&dir)?.ok_or_else(|| anyhow::anyhow!("a template"))?;
    assert_eq!(t.render(&message, true)?, "<s>[hi]</s>");
    assert_eq!(t.special_token("pad_token"), None);

    // A list of named templates: the default one.
    config(
        r#"{"chat_template": [{"name": "tool_use", "template": "tools"},
                              {"name": "default", "template": "plain {{ messages | length }}"}]}"#,
    )?;
    let t = ChatTemplate::from_dir(&dir)?.ok_or_else(|| anyhow::anyhow!("a template"))?;
    assert_eq!(t.render(&message, true)?, "plain 1");
    config(r#"{"chat_template": [{"name": "tool_use", "template": "tools"}]}"#)?;
    assert!(matches!(
        ChatTemplate::from_dir(&dir),
        Err(Error::Config { .. })
    ));

    // `chat_template.jinja` before the config's.
    config(r#"{"chat_template": "config"}"#)?;
    std::fs::write(dir.join("chat_template.jinja"), "file\n")?;
    let t = ChatTemplate::from_dir(&dir)?.ok_or_else(|| anyhow::anyhow!("a template"))?;
    assert_eq!(t.render(&message, true)?, "file");

    // The legacy special_tokens_map.json where the config names no token; read, not guessed.
    std::fs::write(
        dir.join("special_tokens_map.json"),
        r#"{"bos_token": "<b>"}"#,
    )?;
    std::fs::write(dir.join("chat_template.jinja"), "{{ bos_token }}")?;
    let t = ChatTemplate::from_dir(&dir)?.ok_or_else(|| anyhow::anyhow!("a template"))?;
    assert_eq!(t.render_turn(None, "hi")?, "<b>");
    std::fs::write(dir.join("special_tokens_map.json"), "{")?;
    assert!(matches!(
        ChatTemplate::from_dir(&dir),
        Err(Error::Config { .. })
    ));
    std::fs::remove_file(dir.join("special_tokens_map.json"))?;

    // A template that does not parse: an error naming it.
    std::fs::write(dir.join("chat_template.jinja"), "{% if %}")?;
    assert!(matches!(
        ChatTemplate::from_dir(&dir),
        Err(Error::ChatTemplate(_))
    ));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
