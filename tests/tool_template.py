"""A tokenizer directory whose chat template renders tools, tool calls and tool results (Hermes / Qwen
style, written for these tests): the default model's vocabulary with a template that takes `tools`."""

from __future__ import annotations

import shutil
from pathlib import Path

TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

Functions you can call, one JSON object per line:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}To call one, answer with <tool_call>
{"name": "<name>", "arguments": {<arguments>}}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}{% for call in message.tool_calls or [] %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def tool_template_dir(model_dir: Path, target: Path) -> Path:
    """`target` holding the default model's tokenizer files with TOOL_TEMPLATE as its chat template."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, target / name)
    (target / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return target
