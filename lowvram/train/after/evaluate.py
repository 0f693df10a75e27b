"""`lowvram eval`: a trained run and its base, side by side, on held-out data.

- the held-out loss (the mean token cross-entropy over the trained tokens, labels as training
  masked them) and its perplexity, exp(loss), on the rows training held out (data.validation) or
  on a given file, tokenized as training did (train/data/heldout.py);
- exact-match and contains scores of greedy answers to prompt-answer rows (scoring.py);
- lm-eval tasks from local task files, where the [eval] extra is installed (lmeval.py).

The trained model is loaded as `lowvram generate` loads it (generate.load_generator); an adapter
run's base is the same loaded model with its adapter disabled (peft's ``disable_adapter``), a full
run's base is loaded from the recipe's model after the trained one is freed. Memory is planned
before anything loads: the weights (as generate counts them) + the float32 logits of the longest
row and their log-softmax (transformers' ForCausalLMLoss upcasts the logits; our loss here does
the same) and, on the GPU, the CUDA context; on the GPU when that fits its free memory, else on the
CPU when the host RAM holds it (footprint.plan_footprint, as merge and export choose), else refused
with the figures. The results are appended to the run's ``evals.json``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lowvram.errors import LowvramError
from lowvram.past_runs import read_json, read_yaml_dict
from lowvram.runfiles import EVALS, PLAN, RECIPE
from lowvram.train.after.artifacts import (
    BaseModel,
    LoadSize,
    dense_size,
    find_base_model,
    merge_dtype,
    read_adapter_run,
    run_prompt_format,
    run_trusts_code,
    trained_size,
)
from lowvram.train.data.heldout import EvalSet

DEFAULT_ANSWERS = 32  # held-out rows answered by generation (the loss reads every row)
MAX_NEW_TOKENS = 256
LOGIT_COPIES = 2
ALPACA_STOP = "\n### "  # float32 logits + their log-softmax in the cross-entropy


@dataclass(frozen=True)
class EvalPlan:
    run_dir: str  # the folder evaluated (a run, or a checkpoint in one)
    kind: str  # adapter | full
    base_source: str
    data: str  # where the rows come from
    rows: int
    tokens: int  # trained tokens the loss averages over
    answers: int  # rows answered by generation (prompt-answer rows, at most --answers)
    max_new_tokens: int
    tasks: tuple[str, ...]
    task_dir: str | None
    prompt_format: str | None  # the run's (artifacts.run_prompt_format): alpaca answers stop at the next "### "
    device: str  # cuda | cpu
    weights_bytes: int
    logits_bytes: int
    needed_bytes: int  # on the device chosen (on the GPU: with the CUDA context)
    available_bytes: int
    notes: tuple[str, ...] = ()
    eval_set: EvalSet | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("eval_set")
        return d


@dataclass(frozen=True)
class ModelScores:
    loss: float
    perplexity: float
    exact_match: float | None  # fraction of the answered rows (None: no prompt-answer rows)
    contains: float | None
    tasks: dict[str, float] = field(default_factory=dict)  # "task metric" -> value
    samples: tuple[tuple[str, str, str], ...] = ()  # (where, reference, answer) of the first rows


@dataclass(frozen=True)
class EvalResult:
    plan: EvalPlan
    base: ModelScores
    trained: ModelScores
    seconds: float
    recorded: str | None  # the evals.json written (None: a read-only run folder)

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "base": asdict(self.base), "trained": asdict(self.trained),
                "seconds": self.seconds, "recorded": self.recorded}


# --------------------------------------------------------------------------------------------
# Planning: what is evaluated, on which rows, and where it fits


def run_root(p: Path) -> Path:
    """The run folder of ``p`` (itself, or the run above a checkpoint)."""
    from lowvram.past_runs import read_run

    if (p / RECIPE).is_file() and (p / PLAN).is_file():
        return p
    if (p.parent / RECIPE).is_file() and ((p / "config.json").is_file() or (p / "adapter_config.json").is_file()):
        return p.parent
    read_run(p)  # the precise error: missing, or not a run
    return p  # pragma: no cover - read_run raised


def run_recipe(root: Path):
    """The run's recipe.yaml as a Recipe, its relative paths read from the original recipe's
    folder (its first line names it), else from the run folder."""
    from lowvram.recipe.load import parse_recipe

    text = (root / RECIPE).read_text()
    head = text.split("\n", 1)[0]
    original = Path(head[len("# recipe: "):].strip()) if head.startswith("# recipe: ") else None
    source = original if original is not None and original.parent.is_dir() else (root / RECIPE).resolve()
    return parse_recipe(text, str(root / RECIPE), source=source)


def plan_eval(run_dir: str | Path, data: str | Path | None = None, tasks: tuple[str, ...] = (),
              task_dir: str | Path | None = None, answers: int = DEFAULT_ANSWERS,
              max_new_tokens: int = MAX_NEW_TOKENS, cpu: bool = False) -> EvalPlan:
    from lowvram.train.after.artifacts import load_run_tokenizer
    from lowvram.train.build.model import quiet_libraries
    from lowvram.train.data.heldout import file_set, held_out_set

    quiet_libraries()
    p = Path(run_dir)
    root = run_root(p)
    recipe_dict, plan = read_yaml_dict(root / RECIPE), read_json(root / PLAN)
    if tasks:
        from lowvram.train.after.lmeval import check_tasks

        check_tasks(tasks, task_dir)
    if (p / "adapter_config.json").is_file():
        p, adapter, _, _ = read_adapter_run(p)
        base = find_base_model(p, adapter, recipe_dict)
        kind = "adapter"
        weights = _adapter_size(base, recipe_dict, plan, p)
    elif (p / "config.json").is_file():
        base = find_base_model(root, {}, recipe_dict)
        kind = "full"
        weights = _full_size(p)
    else:
        read_adapter_run(p)  # raises the precise error: an unfinished run and its checkpoints
        raise LowvramError(f"no model in {p}", "pass a finished run or one of its checkpoints")  # pragma: no cover
    trust = run_trusts_code(recipe_dict)
    tokenizer = load_run_tokenizer(p if (p / "tokenizer_config.json").is_file() else base.source, trust)
    recipe = run_recipe(root)
    if data is not None:
        data = Path(data)
        if not data.is_file():
            raise LowvramError(f"--data {data}: no such file", "pass a .jsonl/.json/.csv/.parquet file of rows")
        eval_set = file_set(recipe, tokenizer, data)
    else:
        eval_set = held_out_set(recipe, tokenizer)
    logits = max(len(r.input_ids) for r in eval_set.rows) * _vocab(base.source, tokenizer) * 4 * LOGIT_COPIES
    needed = weights.needed_bytes + logits if weights.needed_bytes is not None else None
    scored = [r for r in eval_set.rows if r.prompt_ids is not None and r.answer is not None]
    fp = _choose_device(needed, weights, base.source, cpu)
    device, notes = fp.device, fp.notes
    available = fp.gpu_free_bytes if device == "cuda" else fp.ram_available_bytes
    if kind == "full":
        notes = (*notes, "the base is loaded after the trained model is freed (one at a time)")
    return EvalPlan(str(p), kind, base.source, eval_set.source, len(eval_set.rows), _trained_tokens(eval_set),
                    min(answers, len(scored)), max_new_tokens, tuple(tasks), str(task_dir) if task_dir else None,
                    run_prompt_format(p), device, weights.needed_bytes, logits, fp.gpu_bytes or fp.ram_bytes, available, notes, eval_set)


def _adapter_size(base: BaseModel, recipe: dict, plan: dict, folder: Path) -> LoadSize:
    """What generate loads for an adapter run: a QLoRA base as it trained, else dense."""
    if plan.get("quantization", "none") != "none":
        return trained_size(base, plan)
    return dense_size(base, merge_dtype(recipe, plan), folder)


def _full_size(folder: Path) -> LoadSize:
    from lowvram.train.after.generate import _stored_dtype

    return dense_size(BaseModel(str(folder), "folder"), _stored_dtype(folder), folder)


def _vocab(source: str, tokenizer) -> int:
    """The logits' width: config.json's vocab_size (the lm_head rows), else the tokenizer's size."""
    from lowvram.plan.model.catalog import local_config

    config = local_config(source) or {}
    text = config.get("text_config") or {}
    return int(config.get("vocab_size") or text.get("vocab_size") or len(tokenizer))


def _trained_tokens(eval_set: EvalSet) -> int:
    from lowvram.train.types import IGNORE_INDEX

    return sum(sum(lab != IGNORE_INDEX for lab in r.labels[1:]) for r in eval_set.rows)


def _choose_device(needed: int | None, weights: LoadSize, source: str, cpu: bool):
    """The GPU when the weights, the logits and the CUDA context fit its free memory, else the CPU
    when the host RAM holds them (footprint.plan_footprint, merge's and export's choice); refused
    with the figures when neither does, or when the model cannot be counted (never a guess)."""
    from lowvram.plan.setup import cuda_overheads
    from lowvram.train.after.footprint import Usage, plan_footprint

    if needed is None:
        raise LowvramError(f"cannot count the parameters of {source}: the evaluation's memory cannot be planned",
                           "eval needs the base's config.json in a folder lowvram can read (transformers' own model types)")
    counted = f"{weights.counted} + the float32 logits of the longest row and their log-softmax"
    on_gpu = Usage(needed + cuda_overheads().context_bytes, 0, counted + " + the CUDA context")
    return plan_footprint("eval", on_gpu, Usage(0, needed, counted), 0, Path.cwd(), "nothing written but evals.json",
                          "cpu" if cpu else "auto",
                          ram_hint="evaluate shorter rows (--data FILE), close other programs, or use a machine with more memory")


# --------------------------------------------------------------------------------------------
# Running


def run_eval(plan: EvalPlan, progress=None) -> EvalResult:
    """Load the trained model, score it, score its base, record both. ``progress(text)`` is told
    what runs (the CLI prints it on stderr)."""
    from lowvram.train.after.generate import load_generator

    say = progress or (lambda _text: None)
    t0 = time.perf_counter()
    gen = load_generator(plan.run_dir, cpu=plan.device == "cpu")
    say(f"trained model loaded on {gen.device}: scoring {plan.rows} rows, answering {plan.answers}")
    trained = score_model(gen.model, gen.tokenizer, plan)
    if plan.kind == "adapter":
        say("base model (the same weights, adapter disabled)")
        with gen.model.disable_adapter():
            base = score_model(gen.model, gen.tokenizer, plan)
    else:
        base = _score_full_base(plan, gen)
    result = EvalResult(plan, base, trained, round(time.perf_counter() - t0, 3), None)
    recorded = record(result)
    return EvalResult(plan, base, trained, result.seconds, recorded)


def _score_full_base(plan: EvalPlan, gen) -> ModelScores:
    import gc

    from lowvram.train.after.artifacts import load_base

    root = run_root(Path(plan.run_dir))
    recipe, run_plan = read_yaml_dict(root / RECIPE), read_json(root / PLAN)
    tokenizer = gen.tokenizer
    del gen
    gc.collect()
    base = find_base_model(root, {}, recipe)
    model = load_base(base, merge_dtype(recipe, run_plan), plan.device)
    model.eval()
    return score_model(model, tokenizer, plan)


def score_model(model, tokenizer, plan: EvalPlan) -> ModelScores:
    rows = plan.eval_set.rows
    loss = mean_token_loss(model, rows)
    exact, contains, samples = answer_scores(model, tokenizer, rows, plan)
    tasks = {}
    if plan.tasks:
        from lowvram.train.after.lmeval import run_tasks

        tasks = run_tasks(model, tokenizer, plan.tasks, plan.task_dir)
    return ModelScores(loss, math.exp(loss), exact, contains, tasks, samples)


def mean_token_loss(model, rows) -> float:
    """Cross-entropy summed over every trained token of every row (float32 logits, the label of
    position t+1 predicted at t, as transformers' causal-LM loss shifts), over their number: the
    token-weighted mean (one row at a time: no padding can change a number)."""
    import torch
    import torch.nn.functional as F

    from lowvram.train.types import IGNORE_INDEX

    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            labels = torch.tensor(r.labels[1:], device=model.device)
            n = int((labels != IGNORE_INDEX).sum())
            if n == 0:
                continue
            ids = torch.tensor([r.input_ids], device=model.device)
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            total += float(F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"))
            count += n
    if count == 0:
        raise LowvramError("no trained tokens in the evaluated rows",
                           "evaluate rows with an answer (the tokens the run trained on)")
    return total / count


def answer_scores(model, tokenizer, rows, plan: EvalPlan):
    """Greedy answers to the first ``plan.answers`` prompt-answer rows, scored."""
    import torch

    from lowvram.train.after.scoring import score

    scored = [r for r in rows if r.prompt_ids is not None and r.answer is not None][:plan.answers]
    if not scored:
        return None, None, ()
    longest = max(len(tokenizer(r.answer, add_special_tokens=False)["input_ids"]) for r in scored)
    budget = min(plan.max_new_tokens, longest + 32)
    stop = {"stop_strings": [ALPACA_STOP], "tokenizer": tokenizer} if plan.prompt_format == "alpaca" else {}
    eos = _stop_ids(model, tokenizer)
    exact = contains = 0
    samples = []
    with torch.no_grad():
        for r in scored:
            ids = torch.tensor([r.prompt_ids], device=model.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, **stop)
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            if stop:  # a model prompted with the Alpaca template may go on with the next section (as in generate)
                text = text.split(ALPACA_STOP, 1)[0]
            text = text.strip()
            s = score(text, r.answer)
            exact += s.exact
            contains += s.contains
            if len(samples) < 3:
                samples.append((r.where, r.answer, text))
    return exact / len(scored), contains / len(scored), tuple(samples)


def _stop_ids(model, tokenizer) -> list[int]:
    """The tokenizer's eos (what non-chat training appends) and the model's generation_config
    eos ids (a chat model's end-of-turn)."""
    ids = [tokenizer.eos_token_id]
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra]
    return [i for i in dict.fromkeys(ids) if i is not None]


# --------------------------------------------------------------------------------------------
# Recording


def record(result: EvalResult) -> str | None:
    """Append the evaluation to the run's evals.json (a read-only run folder: not recorded)."""
    root = run_root(Path(result.plan.run_dir))
    path = root / EVALS
    try:
        rows = json.loads(path.read_text()) if path.is_file() else []
    except (OSError, ValueError):
        rows = []
    rows = rows if isinstance(rows, list) else []
    p = result.plan
    rows.append({"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": p.run_dir, "data": p.data,
                 "rows": p.rows, "tokens": p.tokens, "answers": p.answers, "tasks": list(p.tasks),
                 "device": p.device, "base": _scores_dict(result.base), "trained": _scores_dict(result.trained)})
    try:
        path.write_text(json.dumps(rows, indent=2) + "\n")
    except OSError:
        return None
    return str(path)


def _scores_dict(s: ModelScores) -> dict:
    return {"loss": s.loss, "perplexity": s.perplexity, "exact_match": s.exact_match, "contains": s.contains,
            "tasks": dict(s.tasks)}
