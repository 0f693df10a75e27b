"""Rewards of recipes/smollm2-135m-grpo.yaml: a prompt "What is A + B? Reply with the number only."
scored on two counts. Copy this file to write your own: TRL's reward signature (GRPOTrainer, TRL 1.16).

- ``prompts``: the prompts of the batch; ``completions``: one per prompt (a chat prompt's completion
  is ``[{"role": "assistant", "content": "..."}]``, a text prompt's a string);
- every other column of the data arrives by its name (here ``answer``), one value per completion;
- TRL also passes ``completion_ids``, ``trainer_state``, ``log_extra`` and ``log_metric``: keep ``**kwargs``;
- return one float per completion (None: no reward for it). It runs in the training process.
"""
import re

NUMBER = re.compile(r"-?\d+")


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 where the reply's last number is the sum ("4 + 11 = 15" and "15" both count), else 0.0:
    the base model answers "A + B = C", so its first number is A, not its answer."""
    out = []
    for completion, expected in zip(completions, answer):
        found = NUMBER.findall(_text(completion))
        out.append(float(bool(found) and found[-1] == expected))
    return out


def brief(prompts, completions, **kwargs) -> list[float]:
    """1.0 for a reply of one word (the number only), falling by 1/15 for each further word."""
    return [max(0.0, 1.0 - (len(_text(c).split()) - 1) / 15) if _text(c).strip() else 0.0 for c in completions]
