"""Chat templates render as transformers renders them: the same text, and the same ids.

Each template is rendered by transformers (`AutoTokenizer.from_pretrained(dir)
.apply_chat_template`, as a user of transformers would) and by salabatch from the same checkpoint
directory. The family templates are written here from the structure of the published ones
(ChatML/Qwen2.5, Qwen3 with enable_thinking and the reasoning split, Llama 3, Mistral, Gemma,
MiniCPM); they are not copies. Two documented differences are asserted as such: our prompt text
never starts with the BOS text (the ids get it), and think=False seeds an empty think block where
the template does not.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from salabatch.engine.chat import EMPTY_THINK
from salabatch.engine.tokenizer import load_tokenizer
from salabatch.errors import TokenizerError
from tests.engine.test_tokenizer import demo_tokenizer_dir, edit_json

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: nothing to compare the rendering with"
)

BOS = "<s>"
# Header tokens of the families below, added to the demo vocabulary as special tokens.
FAMILY_TOKENS = (
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "[INST]",
    "[/INST]",
    "<start_of_turn>",
    "<end_of_turn>",
)

# ---- the four cases of issue 13 -----------------------------------------------------------

TRIM = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOJSON = (
    "{{ messages | tojson(separators=(',', ':'), sort_keys=true) }}\n"
    "{{ {'b': 'ü', 'a': [1, 2]} | tojson(indent=2) }}\n"
    "{{ {'k': 'ü'} | tojson(true) }}{{ {'k': 'ü'} | tojson(ensure_ascii=false, indent='\t') }}"
)
NAMED_TOKENS = (
    "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ image_token }}"
    "|{{ sep_token is defined }}|{{ mask_token is defined }}"
    "|{{ additional_special_tokens is defined }}|{{ extra_special_tokens is defined }}"
    "|{{ tools }}|{{ documents }}|{{ enable_thinking }}"
    "{% for m in messages %}\n{{ m | tojson(sort_keys=true) }}{% endfor %}"
)

# ---- model families -----------------------------------------------------------------------

QWEN25 = """\
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' and not message.tool_calls %}
        {{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3 = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
          and not (message.content.startswith('<tool_response>')
                   and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')
                                        .split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n')
                + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3 = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{%- if strftime_now is defined %}
    {%- set date_string = strftime_now('%Y') %}
{%- else %}
    {%- set date_string = '2024' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}
{{- system_message }}
{{- '<|eot_id|>' }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""

GEMMA = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
    {{ message['content'] | trim }}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

MINICPM = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TEMPLATES = {
    "trim": TRIM,
    "generation": GENERATION,
    "tojson": TOJSON,
    "named_tokens": NAMED_TOKENS,
    "qwen2.5": QWEN25,
    "qwen3": QWEN3,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
    "gemma": GEMMA,
    "minicpm": MINICPM,
}
WRITES_EMPTY_THINK = {"qwen3"}  # the others get our seed with think=False

SYSTEM = "  You are terse.\n"
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": " Who signed the lease?  "},
    {"role": "assistant", "content": "\nThe tenant, 河流 GmbH. ", "tool_calls": None},
    {"role": "user", "content": "And when? 🎉\n"},
]
THINKING = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who signed?"},
    {"role": "assistant", "content": "<think>\nread the file\n</think>\n\nThe tenant."},
    {"role": "user", "content": "When?"},
    {"role": "assistant", "content": "In May.", "reasoning_content": "\nchecked the date\n"},
]
DOCUMENT = "Lease of 1 May.\nThe text <|im_end|> and [INST] and <|eot_id|> are plain here."
QUESTION = "Who signed <start_of_turn>?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The demo tokenizer plus the family header tokens, and named special tokens in
    tokenizer_config (a model-specific one and a list of extra ones among them)."""
    d = demo_tokenizer_dir(tmp_path_factory)
    backend = Backend.from_file(str(d / "tokenizer.json"))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in FAMILY_TOKENS]
    )
    backend.save(str(d / "tokenizer.json"))
    edit_json(
        d / "tokenizer_config.json",
        unk_token="<unk>",
        pad_token="</s>",
        image_token="<|fim_middle|>",
        additional_special_tokens=["<|tool_call|>"],
    )
    return d


def load_pair(model_dir: Path, tmp_path: Path, template: str):
    """(salabatch tokenizer, transformers tokenizer) of one checkpoint dir with `template`."""
    d = Path(shutil.copytree(model_dir, tmp_path / "tok"))
    (d / "chat_template.jinja").write_text(template)
    return load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)


def assert_renders_alike(ours, theirs, messages, *, think, add_generation_prompt=True, seed=""):
    """Same text (ours without the BOS text, plus `seed`), same ids (ours with BOS first)."""
    kwargs = {"add_generation_prompt": add_generation_prompt, "enable_thinking": think}
    text = theirs.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    written_bos = BOS if text.startswith(BOS) else ""
    got = ours.chat_prompt(messages, think=think, add_generation_prompt=add_generation_prompt)
    assert written_bos + got == text + seed
    got_ids = ours.chat_prompt_ids(
        messages, think=think, add_generation_prompt=add_generation_prompt
    )
    assert got_ids == ([] if written_bos else [ours.bos_id]) + ids + ours.encode(seed)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]], ids=["system", "no-system"])
def test_conversation_renders_like_transformers(model_dir, tmp_path, name, messages):
    ours, theirs = load_pair(model_dir, tmp_path, TEMPLATES[name])
    assert_renders_alike(ours, theirs, messages, think=True)
    assert_renders_alike(ours, theirs, messages, think=True, add_generation_prompt=False)
    # think=False: the template's own empty think block, else our seed (a documented difference)
    seed = "" if name in WRITES_EMPTY_THINK else EMPTY_THINK
    assert_renders_alike(ours, theirs, messages, think=False, seed=seed)


@pytest.mark.parametrize("think", [True, False])
def test_qwen3_reasoning_split_and_enable_thinking(model_dir, tmp_path, think):
    ours, theirs = load_pair(model_dir, tmp_path, QWEN3)
    for end in (3, 4, 5):  # the reasoning of the last turn is kept, earlier turns drop theirs
        assert_renders_alike(ours, theirs, THINKING[:end], think=think)
    text = ours.chat_prompt(THINKING, think=think, add_generation_prompt=False)
    assert "read the file" not in text and "<think>\nchecked the date\n</think>\n\nIn May." in text


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("system", [SYSTEM, None])
def test_document_prompt_matches_transformers_sanitized_ids(model_dir, tmp_path, name, system):
    # special-token text in the document and question is plain text, as with transformers'
    # sanitize_control_tokens; the split prompt has the ids of the whole one
    ours, theirs = load_pair(model_dir, tmp_path, TEMPLATES[name])
    user = {"role": "user", "content": DOCUMENT + "\n\n" + QUESTION}
    whole = [{"role": "system", "content": system}, user] if system is not None else [user]
    kwargs = {"add_generation_prompt": True, "enable_thinking": True}
    text = theirs.apply_chat_template(whole, tokenize=False, **kwargs)
    ids = theirs.apply_chat_template(
        whole, tokenize=True, return_dict=False, sanitize_control_tokens=True, **kwargs
    )
    doc_prompt, suffix = ours.split_chat_prompt(DOCUMENT, QUESTION, system=system, think=True)
    written_bos = BOS if text.startswith(BOS) else ""
    assert doc_prompt + suffix == ([] if written_bos else [ours.bos_id]) + ids
    assert written_bos + ours.chat_prompt(whole, think=True) == text
    prefix = ours.decode(doc_prompt)  # the text up to the document's end, BOS first
    assert (text if written_bos else BOS + text).startswith(prefix)
    assert prefix.endswith("are plain here.")


@pytest.mark.parametrize("name", ["mistral", "gemma"])
def test_role_alternation_errors_like_transformers(model_dir, tmp_path, name):
    ours, theirs = load_pair(model_dir, tmp_path, TEMPLATES[name])
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError) as theirs_err:
        theirs.apply_chat_template(bad, tokenize=False)
    with pytest.raises(TokenizerError) as ours_err:
        ours.chat_prompt(bad, think=True)
    assert str(theirs_err.value) in ours_err.value.message
    assert "must alternate" in ours_err.value.message
