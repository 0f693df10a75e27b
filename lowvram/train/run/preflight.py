"""`validate` and `train --dry-run`: the recipe's local files exist, its first rows parse and
the model folder's JSON and weight files are whole (runfiles.folder_problem).

The same rules as training uses (data.py decides what is a local file and what a hub id,
model.py where a model folder is), without loading a model or a whole dataset: a few
milliseconds, so a missing file is reported before anything heavy starts, not after the model
has loaded. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import LowvramError
from lowvram.plan.memory.preference import RL_OBJECTIVES

if TYPE_CHECKING:
    from lowvram.recipe import Recipe

_HEAD_BYTES = 1 << 16  # the first rows of a JSON Lines file: enough for a few rows, read in microseconds


def input_problems(recipe: Recipe) -> list[str]:
    """One line per missing or unreadable input (empty when all are there)."""
    from lowvram.hub import download_problem
    from lowvram.runfiles import folder_problem
    from lowvram.train.build.model import resolve_model_location
    from lowvram.train.data.read import is_local

    problems = ordinary_problems(recipe)
    if problems:  # a FIFO or a device is not opened, not even to look at its first rows
        return problems
    try:
        location = resolve_model_location(recipe)
        damaged = folder_problem(Path(location), model_files(recipe))  # a hub id: no folder
        if damaged:
            problems.append(f"{damaged[0]} is damaged: {damaged[1]}")
        if not Path(location).is_dir() and (why := download_problem(location)):
            problems.append(why)  # said in seconds, not after huggingface_hub's retries
    except LowvramError as e:
        problems.append(e.message)
    for spec in recipe.data.datasets:
        path = recipe.resolve_path(spec.path)
        suffix = path.suffix.lower()
        if not is_local(path, spec.path):
            continue  # a hub dataset: checked when it downloads
        if not path.is_file():
            problems.append(f"data file not found: {path}" if not path.exists() else f"{path} is a folder, not a data file")
        elif suffix in (".jsonl", ".ndjson", ".txt"):
            problems += _lines_problem(path, recipe.training.seq_len,
                                       parse=suffix != ".txt" and not recipe.data.skip_bad_rows)
    return problems


def ordinary_problems(recipe: Recipe) -> list[str]:
    """The recipe's inputs that exist and are not ordinary files: a local data file, an entry of
    the model or tokenizer folder, a tokenizer file that is a FIFO, a device, a socket or a link
    to one (lowvram.inputfiles). Cheap (stat calls only): `train` asks before planning."""
    from lowvram.inputfiles import not_ordinary, ordinary_entries_problem
    from lowvram.train.build.model import resolve_model_location
    from lowvram.train.data.read import is_local

    problems = []
    for spec in recipe.data.datasets:
        path = recipe.resolve_path(spec.path)
        why = not_ordinary(path) if is_local(path, spec.path) else None
        if why and why != "a folder":
            problems.append(f"data file {path} is {why}, not an ordinary file")
    try:
        folders = [Path(resolve_model_location(recipe))]
    except LowvramError:
        folders = []  # input_problems names the missing model
    if recipe.model.tokenizer:
        tok = recipe.resolve_path(recipe.model.tokenizer)
        why = not_ordinary(tok)
        if why and why != "a folder":
            problems.append(f"model.tokenizer {tok} is {why}, not an ordinary file")
        folders.append(tok)
    problems += [why for folder in dict.fromkeys(folders) if (why := ordinary_entries_problem(folder))]
    return problems


def check_ordinary_inputs(recipe: Recipe) -> None:
    """LowvramError listing the recipe's inputs that are not ordinary files (ordinary_problems)."""
    problems = ordinary_problems(recipe)
    if problems:
        raise LowvramError(
            f"{len(problems)} input{'s' if len(problems) != 1 else ''} of the recipe "
            f"{'is' if len(problems) == 1 else 'are'} not an ordinary file:\n  " + "\n  ".join(problems),
            "lowvram reads regular files only, never pipes, devices or sockets: point the recipe at the files themselves",
        )


def model_files(recipe: Recipe) -> tuple[str, ...] | None:
    """The files of the model folder that training reads and that runfiles.folder_problem
    checks: a GGUF model's gguf_file only (a folder may hold several quantizations); else all."""
    return (recipe.model.gguf_file,) if recipe.model.gguf_file else None


def _lines_problem(path: Path, seq_len: int, parse: bool) -> list[str]:
    """A line past inputfiles.line_limit_bytes(seq_len) anywhere in the file (the whole file is
    read, a line at a time, never more than the limit of one), or the first of its first rows
    (_HEAD_BYTES) that is not JSON (``parse``)."""
    from lowvram.inputfiles import (
        LineTooLong,
        bounded_lines,
        line_limit_bytes,
        open_ordinary,
        too_long_error,
    )
    from lowvram.train.data.read import BadRow, jsonl_rows

    seen, bad, blank = 0, [], True
    with open_ordinary(path, "data file") as f:
        try:
            for number, _, raw in bounded_lines(f, line_limit_bytes(seq_len)):
                blank = blank and not raw.strip()
                if not parse or seen >= _HEAD_BYTES or bad:
                    continue
                seen += len(raw)
                try:
                    text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    return [f"{path}: not UTF-8 text (byte {seen - len(raw) + e.start}, line {number})"]
                bad += [f"{r.where}: {r.data}" for r in jsonl_rows(text.rstrip("\n"), path.name, number)
                        if isinstance(r.data, BadRow)]
        except LineTooLong as e:
            return [too_long_error(f"{path}:{e.line}", seq_len).message]
    if blank:
        return [f"{path}: the data file is empty"]
    return bad[:1]  # the first; training reports each, or skips them with data.skip_bad_rows


def check_model_download(recipe: Recipe) -> None:
    """ModelError when the model is a hub id that is not in the hub cache and cannot be downloaded
    now (HF_HUB_OFFLINE, or no network: one connection attempt of a few seconds)."""
    from lowvram.errors import ModelError
    from lowvram.hub import download_problem
    from lowvram.train.build.model import resolve_model_location

    location = resolve_model_location(recipe)
    if not Path(location).is_dir() and (why := download_problem(location)):
        raise ModelError(why, _inputs_hint([why]))


def check_inputs(recipe: Recipe) -> None:
    problems = input_problems(recipe)
    if problems:
        raise LowvramError(
            f"{len(problems)} input{'s' if len(problems) != 1 else ''} of the recipe cannot be read:\n  "
            + "\n  ".join(problems), _inputs_hint(problems, recipe))


def _inputs_hint(problems: list[str], recipe: Recipe | None = None) -> str:
    """The way out for what is wrong: a path (not found, a folder) or a file's content; a missing
    model alone: the model finder's own hint (e.g. `make demo` links the quickstart model)."""
    if recipe is not None and len(problems) == 1 and problems[0].startswith("model not found"):
        from lowvram.train.build.model import resolve_model_location

        try:
            resolve_model_location(recipe)
        except LowvramError as e:
            return e.hint
    if any(p.startswith("no network") or "HF_HUB_OFFLINE is set" in p for p in problems):
        return "download the model where there is network (`hf download ORG/NAME`) and set model.name_or_path to its folder"
    content = ("the data file is empty", "not UTF-8 text", "invalid JSON", "is damaged", "is longer than")
    if all(any(c in p for c in content) for p in problems):
        if all("the data file is empty" in p for p in problems):
            return "add examples to the file (one JSON object per line for .jsonl) or remove it from data.datasets"
        return "fix the file named above (save data as UTF-8, one JSON object per line for .jsonl) and run " \
               "`lowvram validate RECIPE` again"
    return "paths in a recipe are relative to the recipe file; fix them and run `lowvram validate RECIPE` again"


# --------------------------------------------------------------------------------------------
# What the data and the model can hold: a full optimizer step, seq_len positions


def check_shape(recipe: Recipe, train_rows: int | None = None) -> None:
    """LowvramError when one optimizer step needs more rows than the training data has, or
    seq_len is beyond the model's positions without rope scaling (`validate`; `train` once its
    data is built). ``train_rows``: the rows (packed windows) training built; None: counted here
    from local JSON Lines files (an upper bound: bad rows and empty samples are dropped later),
    skipped when a file cannot be counted cheaply (a hub dataset, another format, packing).
    `train --dry-run` checks neither: it shows the plan for the recipe as it is."""
    _check_batch(recipe, train_rows if train_rows is not None else _counted_train_rows(recipe))
    check_seq_len(recipe)


def _check_batch(recipe: Recipe, rows: int | None) -> None:
    batch = recipe.training.batch_size
    if recipe.training.objective in RL_OBJECTIVES:
        return _check_prompts(recipe, rows)
    if rows is None or rows >= batch:
        return
    what = "packed windows" if recipe.data.packing else "rows"
    held = " after data.validation's hold-out" if isinstance(recipe.data.validation, float) else ""
    raise LowvramError(
        f"training.batch_size {batch:,} is more than the training data holds: one optimizer step takes "
        f"{batch:,} samples, the data has {rows:,} training {what}{held}",
        f"lower training.batch_size to {rows:,} or less, or add rows to the data",
    )


def _check_prompts(recipe: Recipe, rows: int | None) -> None:
    """grpo/rloo: a row is a prompt, completed num_generations times; TRL's sampler draws whole
    generation batches of prompts (RepeatSampler, batch_size = generation_batch_size /
    num_generations), so the data must hold one generation batch's prompts."""
    g, batch = recipe.grpo, recipe.training.batch_size
    completions = max(batch, g.generation_batch_size if isinstance(g.generation_batch_size, int) else 0)
    prompts = completions // g.num_generations
    if rows is None or rows >= prompts:
        return
    raise LowvramError(
        f"the data holds {rows:,} prompts, fewer than one generation batch needs: {completions:,} completions "
        f"are {prompts:,} prompts x {g.num_generations} generations",
        f"add prompts, or lower training.batch_size to {rows * g.num_generations:,} or less",
    )


def _counted_train_rows(recipe: Recipe) -> int | None:
    """Training rows of local .jsonl/.ndjson files (non-blank lines, capped by max_samples, less the
    validation fraction as collate.hold_out takes it); None when any dataset cannot be counted."""
    from lowvram.train.data.read import is_local

    if recipe.data.packing:
        return None  # windows are known only after tokenizing
    total = 0
    for spec in recipe.data.datasets:
        path = recipe.resolve_path(spec.path)
        if not is_local(path, spec.path) or path.suffix.lower() not in (".jsonl", ".ndjson") or not path.is_file():
            return None
        n = _non_blank_lines(path)
        if n is None:
            return None
        total += min(n, spec.max_samples) if spec.max_samples else n
    fraction = recipe.data.validation
    if isinstance(fraction, float) and total >= 2:
        total -= min(total - 1, max(1, round(total * fraction)))  # collate.hold_out's n_eval
    return total


def _non_blank_lines(path: Path) -> int | None:
    """None when a line is past the limit of any seq_len read (input_problems says so)."""
    from lowvram.inputfiles import LineTooLong, bounded_lines, line_limit_bytes, open_ordinary

    n = 0
    with open_ordinary(path, "data file") as f:
        try:
            for _, _, line in bounded_lines(f, line_limit_bytes(1 << 20)):
                n += bool(line.strip())
        except LineTooLong:
            return None
    return n


def check_seq_len(recipe: Recipe) -> None:
    positions, scaled = _model_positions(recipe)
    seq_len = recipe.training.seq_len
    if positions is None or seq_len <= positions or scaled:
        return
    raise LowvramError(
        f"training.seq_len {seq_len:,} is beyond the model's max_position_embeddings {positions:,}, and its "
        "config.json sets no rope scaling: positions past it were never trained",
        f"lower training.seq_len to {positions:,} or less, or use a model whose config.json sets rope_scaling "
        "(rope_parameters) with a factor for longer contexts",
    )


def _model_positions(recipe: Recipe) -> tuple[int | None, bool]:
    """(max_position_embeddings, whether rope scaling is set) from the model's config.json (a
    local folder or the hub cache; plan.catalog.local_config), else the catalog; (None, False)
    when neither knows the model (a GGUF file: its own metadata)."""
    from lowvram.plan.model.catalog import local_config, resolve_model
    from lowvram.train.build.model import resolve_model_location

    if recipe.model.gguf_file:
        return None, False
    try:
        ref = resolve_model_location(recipe)
    except LowvramError:
        return None, False  # input_problems names the missing model
    cfg = local_config(ref)
    if cfg is None:
        try:
            return resolve_model(ref).max_position_embeddings, False
        except LowvramError:
            return None, False
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    # The keys plan.readers.spec_from_config reads the positions from (GPT-2: n_positions).
    for source in (cfg, text):
        positions = next((source[k] for k in ("max_position_embeddings", "n_positions", "seq_length")
                          if isinstance(source.get(k), int)), None)
        if positions is not None:
            return positions, _rope_scaled(source)
    return None, False


def _rope_scaled(cfg: dict) -> bool:
    """Rope scaling with a factor: ``rope_scaling`` (transformers 4) or ``rope_parameters``
    (transformers 5, modeling_rope_utils: linear, dynamic, yarn, longrope and llama3 all carry
    ``factor``), also per layer type (Gemma-3: {"full_attention": {...}, ...})."""
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if not isinstance(value, dict):
            continue
        for params in (value, *(v for v in value.values() if isinstance(v, dict))):
            factor = params.get("factor")
            if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
                return True
    return False


# --------------------------------------------------------------------------------------------
# The data, row by row (lowvram.train.data.check), with the tokenizer when it is on this machine


def check_recipe_data(recipe: Recipe, samples: int = 0, tokens: bool = True):
    """check_data with the recipe's local tokenizer (when there is one and ``tokens``), and its
    processor for format image_chat (image tokens measured); a DataError listing every bad row (the
    first MAX_LISTED, then a count) when any row would stop training."""
    from lowvram.train.data.check import DataReport, check_data

    structure = check_data(recipe)
    _refuse_bad_rows(recipe, structure.problems)
    tokenizer, why = local_tokenizer(recipe) if tokens else (None, None)
    if tokenizer is None:
        return DataReport(structure.files, structure.problems, structure.notes, tokenizer=None, skipped_tokens=why)
    images, why_images = None, None
    if any(d.format == "image_chat" for d in recipe.data.datasets):
        from lowvram.train.build.processor import local_image_inputs

        images, why_images = local_image_inputs(recipe)
    report = check_data(recipe, tokenizer, samples, images)
    _refuse_bad_rows(recipe, report.problems)
    if why_images:  # image_chat rows not measured: say why
        import dataclasses

        report = dataclasses.replace(report, skipped_tokens=f"format image_chat: image tokens not counted ({why_images})")
    return report


def _refuse_bad_rows(recipe: Recipe, problems: tuple[str, ...]) -> None:
    from lowvram.errors import DataError
    from lowvram.train.data.check import MAX_LISTED

    if not problems or recipe.data.skip_bad_rows:
        return
    shown = list(problems[:MAX_LISTED])
    more = len(problems) - len(shown)
    cut = any("would cut into its images" in p for p in problems)  # image_check: a row over seq_len
    raise DataError(
        shown[0] if len(shown) == 1 else f"{len(problems)} problems in the data:\n  "
        + "\n  ".join(shown) + (f"\n  ... and {more} more" if more else ""),
        ("raise training.seq_len, or put the images before the long text; " if cut else "")
        + "fix the rows, set the dataset's format: and map your column names with fields: {...} (and "
        "roles: {...} for chat speakers), or set data.skip_bad_rows: true to skip and count bad rows",
    )


def local_tokenizer(recipe: Recipe):
    """The recipe's tokenizer when it is on this machine (a model folder, or model.tokenizer as a
    folder), else (None, why): the data check never downloads."""
    from lowvram.train.build.model import load_tokenizer, resolve_model_location

    if recipe.model.tokenizer and not recipe.resolve_path(recipe.model.tokenizer).is_dir():
        return None, f"model.tokenizer {recipe.model.tokenizer} is a hub id: token counts need it on this machine"
    try:
        source = resolve_model_location(recipe)
    except LowvramError as e:
        return None, e.message
    tok_path = recipe.resolve_path(recipe.model.tokenizer) if recipe.model.tokenizer else None
    if not Path(source).is_dir() and not (tok_path and tok_path.is_dir()):
        return None, f"{recipe.model.name_or_path} is a hub id: token counts need the model on this machine"
    if recipe.model.gguf_file and not (tok_path and tok_path.is_dir()):
        from lowvram.train.build.gguf import cached_gguf_folder

        converted = cached_gguf_folder(source, recipe.model.gguf_file)
        if converted is None:
            return None, "the GGUF model is converted at its first `lowvram train`: token counts after that"
        source = str(converted)
    try:
        return load_tokenizer(recipe, source), None
    except LowvramError as e:
        return None, e.message


def measured_images(recipe: Recipe) -> tuple[int, int] | None:
    """Format image_chat under objective sft: (images per row, tokens an image) the plan of
    `lowvram train` and `lowvram plan RECIPE` is sized for, from the recipe's local data under the
    model's own processor (image_check.data_image_extent): the most images a row holds, and
    tokens an image such that a row of them holds as many image tokens as the data's fullest row
    (the pixels and the tower's forward follow the batch's patches in all; its images of other
    sizes the plan need not tell apart). Eager attention (the recipe's: the search never picks
    it) also sizes each image as the costliest, whose tower attention scores it counts. None
    where the data or the model folder is not on this machine, or cannot be read: the plan then
    bounds from data.images_per_row and the pixel limits (the data check names the problem)."""
    if recipe.training.objective != "sft" or not any(d.format == "image_chat" for d in recipe.data.datasets):
        return None
    from lowvram.train.build.processor import local_image_inputs
    from lowvram.train.data.image_check import data_image_extent

    try:
        inputs, _ = local_image_inputs(recipe)
        extent = inputs and data_image_extent(recipe, inputs.processor, expands=not inputs.cross_attention)
    except LowvramError:
        return None
    if not extent:
        return None
    per_row, row_tokens, largest = extent
    tokens = -(-row_tokens // per_row)  # ceil: per_row x tokens >= the fullest row's image tokens
    return per_row, max(tokens, largest if recipe.techniques.attention == "eager" else 0)
