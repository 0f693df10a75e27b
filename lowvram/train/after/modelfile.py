"""An Ollama Modelfile for an exported GGUF (https://github.com/ollama/ollama/blob/main/docs/modelfile.md):
FROM the file, the chat template in Ollama's Go template syntax, the stop tokens.

The template families translated, recognised by their markers: ChatML (<|im_start|> / <|im_end|>:
SmolLM2, Qwen, OLMo-2's Tulu), Llama-3 (<|start_header_id|> / <|eot_id|>), Gemma
(<start_of_turn> / <end_of_turn>, "model" for the assistant, a system prompt folded into the first
user turn as Gemma's template does) and Phi-3 (<|user|> / <|assistant|> / <|end|>). A Jinja
template is a program; any other is not guessed at: the Modelfile says so and carries no TEMPLATE, and Ollama
falls back to the template it detects from the GGUF's tokenizer.chat_template.
"""

from __future__ import annotations

CHATML = ('TEMPLATE """{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
          '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
          '<|im_start|>assistant\n"""')
LLAMA3 = ('TEMPLATE """{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}'
          '{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}'
          '<|start_header_id|>assistant<|end_header_id|>\n\n"""')

# Gemma has no system role: its template puts the system prompt at the head of the first user turn.
GEMMA = ('TEMPLATE """{{- range $i, $m := .Messages }}<start_of_turn>{{ if eq $m.Role "assistant" }}model'
         '{{ else }}user{{ end }}\n{{ if and (eq $i 0) $.System }}{{ $.System }}\n\n{{ end }}'
         '{{ $m.Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n"""')
PHI3 = ('TEMPLATE """{{- if .System }}<|system|>\n{{ .System }}<|end|>\n{{ end }}'
        '{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n"""')
_FAMILIES = {
    "chatml": (CHATML, ("<|im_end|>", "<|im_start|>")),
    "llama3": (LLAMA3, ("<|eot_id|>", "<|start_header_id|>")),
    "gemma": (GEMMA, ("<end_of_turn>",)),
    "phi3": (PHI3, ("<|end|>", "<|endoftext|>")),
}


def template_family(chat_template: str | None) -> str | None:
    """chatml | llama3 | gemma | phi3 | None (no template, or one not translated)."""
    t = chat_template or ""
    if "<|im_start|>" in t and "<|im_end|>" in t:
        return "chatml"
    if "<|start_header_id|>" in t and "<|eot_id|>" in t:
        return "llama3"
    if "<start_of_turn>" in t and "<end_of_turn>" in t:
        return "gemma"
    if "<|assistant|>" in t and "<|end|>" in t:
        return "phi3"
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
    elif family is not None:
        template, stops = _FAMILIES[family]
        lines += [template, *(f'PARAMETER stop "{s}"' for s in stops)]
    else:
        note = ("the tokenizer's chat template is none of ChatML, Llama-3, Gemma, Phi-3: not translated to Ollama's "
                "syntax (Ollama uses the template it detects from the GGUF)" if chat_template else
                "the tokenizer has no chat template: the Modelfile has no TEMPLATE")
        lines.insert(1, f"# {note}")
    if system:
        lines.append(f'SYSTEM """{system}"""')
    return "\n".join(lines) + "\n", note
