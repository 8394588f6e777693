"""Writes tests/fixtures/chat_templates.json: chat templates rendered by transformers' own
renderer (`transformers.utils.chat_template_utils.render_jinja_template`, what
`apply_chat_template` calls: its Jinja environment with trim_blocks, lstrip_blocks, loop
controls, `raise_exception` and its `tojson`), the references `tests/chat.rs` checks
`candle_attention::ChatTemplate` against, with no Python at test time.

The first template is SmolLM2's (`tokenizer.chat_template` of
tests/fixtures/gguf/smollm2_tokenizer.gguf); the others are written here in the styles of
real checkpoints' templates (LLaMA 3, Mistral, Qwen2, Gemma), to exercise the Jinja features
those use. Each is rendered with the file's special tokens (`bos_token`, `eos_token`,
`unk_token`, `pad_token`: the tokens at the file's ids, as transformers passes its
tokenizer's). For SmolLM2's template the ids of each rendered text are kept too, from
llama.cpp's tokenizer on the same file (special tokens parsed, none added): transformers
builds a GGUF's tokenizer only with torch installed, and the two agree on SmolLM2's prompts
(tests/fixtures/gguf/smollm2.json).

    pip install transformers jinja2 gguf numpy llama-cpp-python==0.3.36   # no torch needed
    python scripts/gen_chat_fixtures.py
"""

import hashlib
import json
import pathlib
import sys

import gguf
import jinja2
import llama_cpp
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "gguf" / "smollm2_tokenizer.gguf"
OUT = ROOT / "tests" / "fixtures" / "chat_templates.json"

LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if system_message %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" + system_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL = """{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'].strip() + eos_token }}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"""

QWEN2 = """{% for message in messages %}
{% if loop.first and messages[0]['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}
{{ message['content'] }}<|im_end|>
{% else %}
{{ message['content'] | tojson }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

GEMMA = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if loop.index0 > 5 %}{% break %}{% endif %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"""

JSON = """{%- for m in messages %}{{ m | tojson }}
{% endfor %}{{ messages[0] | tojson(indent=2) }}
{{ {'b': 1, 'a': [true, none, 2.5, 'x"y\\z'], 'c': {}} | tojson(sort_keys=true) }}
{{ messages[-1]['content'] | tojson(ensure_ascii=true) }}|{{ messages | length }}
{%- if add_generation_prompt %}{{ bos_token }}{% endif %}"""

# LLaMA 3.1's opening: variables transformers passes as None (`tools`, `documents`) and
# ones it does not pass at all (`tools_in_user_message`, `date_string`).
TOOLS = """{{- bos_token }}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{{- "tools: " + (tools is none) | string + ", " + (tools is not none) | string + ", documents: " + (documents is none) | string + "\n" }}
{{- "in user message: " + tools_in_user_message | string + ", date: " + date_string + "\n" }}
{%- for message in messages %}
    {%- if loop.last and message.role == 'user' %}{{- 'last user: ' + message.content + '\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'assistant:' }}{%- endif %}"""

# transformers' `{% generation %}` blocks, next to a comment, a string and a raw block that
# hold tag-like text.
GENERATION = """{# a {% b #}{{ '{%' }}
{%- for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}
{%- else %}({{ m.content }}){% endif %}{% endfor %}
{%- raw %}{% generation %}{% endraw %}{{ '|' ~ messages | join(', ', attribute='role') }}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "  You answer in one word.  "},
        {"role": "user", "content": "Capital of Italy?"},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": " Hello! How can I help? "},
        {"role": "user", "content": "Ünïcödé naïve café — 日本語 🚀\nTwo lines."},
    ],
]


def field(reader: gguf.GGUFReader, key: str):
    """A metadata value: a string, a number, or a list of strings."""
    f = reader.fields.get(key)
    if f is None:
        return None
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    return f.parts[f.data[0]][0].item()


def main() -> None:
    reader = gguf.GGUFReader(str(FIXTURE))
    tokens = field(reader, "tokenizer.ggml.tokens")
    special = {}
    for name in ("bos", "eos", "unk", "pad"):
        key = "padding" if name == "pad" else ("unknown" if name == "unk" else name)
        i = field(reader, f"tokenizer.ggml.{key}_token_id")
        if i is not None:
            special[f"{name}_token"] = tokens[i]
    own = field(reader, "tokenizer.chat_template")
    vocab = llama_cpp.Llama(model_path=str(FIXTURE), vocab_only=True, verbose=False)
    templates = [
        ("smollm2", own),
        ("llama3_style", LLAMA3),
        ("mistral_style", MISTRAL),
        ("qwen2_style", QWEN2),
        ("gemma_style", GEMMA),
        ("json_style", JSON),
        ("tools_style", TOOLS),
        ("generation_style", GENERATION),
    ]
    cases = []
    for name, template in templates:
        for messages in CONVERSATIONS:
            for generation in (True, False):
                case = {
                    "template": name,
                    "messages": messages,
                    "add_generation_prompt": generation,
                }
                try:
                    rendered, _ = render_jinja_template(
                        conversations=[messages],
                        chat_template=template,
                        add_generation_prompt=generation,
                        **special,
                    )
                    text = rendered[0]
                    case["text"] = text
                    if name == "smollm2":
                        ids = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)
                        case["ids"] = list(ids)
                except jinja2.exceptions.TemplateError as e:
                    case["error"] = str(e)
                cases.append(case)
    doc = {
        "generated_by": {
            "transformers": transformers.__version__,
            "jinja2": jinja2.__version__,
            "llama_cpp_python": llama_cpp.__version__,
            "python": sys.version.split()[0],
        },
        "tokenizer": {
            "file": "tests/fixtures/gguf/smollm2_tokenizer.gguf",
            "sha256": hashlib.sha256(FIXTURE.read_bytes()).hexdigest(),
        },
        "special_tokens": special,
        "templates": dict(templates),
        "cases": cases,
    }
    OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}: {len(cases)} cases")


if __name__ == "__main__":
    main()
