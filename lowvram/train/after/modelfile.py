"""An Ollama Modelfile for an exported GGUF (https://github.com/ollama/ollama/blob/main/docs/modelfile.md):
FROM the file, the chat template in Ollama's Go template syntax, the stop tokens.

Only two template families are translated, recognised by their markers: ChatML (<|im_start|> /
<|im_end|>: SmolLM2, Qwen) and Llama-3 (<|start_header_id|> / <|eot_id|>). A Jinja template is a
program; any other is not guessed at: the Modelfile says so and carries no TEMPLATE, and Ollama
falls back to the template it detects from the GGUF's tokenizer.chat_template.
"""

from __future__ import annotations

CHATML = ('TEMPLATE """{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
          '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
          '<|im_start|>assistant\n"""')
LLAMA3 = ('TEMPLATE """{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}'
          '{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}'
          '<|start_header_id|>assistant<|end_header_id|>\n\n"""')


def template_family(chat_template: str | None) -> str | None:
    """chatml | llama3 | None (no template, or one not translated)."""
    t = chat_template or ""
    if "<|im_start|>" in t and "<|im_end|>" in t:
        return "chatml"
    if "<|start_header_id|>" in t and "<|eot_id|>" in t:
        return "llama3"
    return None


def modelfile_text(gguf_name: str, chat_template: str | None, prompt_format: str | None,
                   system: str | None = None) -> tuple[str, str | None]:
    """(the Modelfile, a note for the user or None)."""
    family = template_family(chat_template)
    lines = ["# written by lowvram export; build it with: ollama create NAME -f Modelfile", f"FROM ./{gguf_name}"]
    note = None
    if prompt_format not in (None, "chat"):
        note = (f"the run trained on the {prompt_format} prompt format, not the chat template: "
                "the Modelfile has no TEMPLATE (write one that matches your prompts)")
        lines.insert(1, f"# {note}")
    elif family == "chatml":
        lines += [CHATML, 'PARAMETER stop "<|im_end|>"', 'PARAMETER stop "<|im_start|>"']
    elif family == "llama3":
        lines += [LLAMA3, 'PARAMETER stop "<|eot_id|>"', 'PARAMETER stop "<|start_header_id|>"']
    else:
        note = ("the tokenizer's chat template is neither ChatML nor Llama-3: not translated to Ollama's "
                "syntax (Ollama uses the template it detects from the GGUF)" if chat_template else
                "the tokenizer has no chat template: the Modelfile has no TEMPLATE")
        lines.insert(1, f"# {note}")
    if system:
        lines.append(f'SYSTEM """{system}"""')
    return "\n".join(lines) + "\n", note
