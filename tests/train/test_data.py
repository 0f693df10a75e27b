"""The data pipeline: exact masks per format, truncation, packing, loading, every bad-row kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowvram.errors import DataError, RecipeError
from lowvram.recipe import parse_recipe
from lowvram.train.data.build import build_datasets
from lowvram.train.data.collate import make_collator
from lowvram.train.data.format import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, format_example
from lowvram.train.types import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"


def recipe(tmp_path: Path, datasets: list[dict], seq_len: int = 256, **data_keys):
    """A recipe file in tmp_path; data paths resolve against it."""
    doc = {
        "model": {"name_or_path": "tiny"},
        "data": {"datasets": datasets, **data_keys},
        "training": {"seq_len": seq_len, "seed": 7},
    }
    path = tmp_path / "r.yaml"
    text = json.dumps(doc)  # JSON is YAML
    path.write_text(text)
    return parse_recipe(text, str(path), source=path)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tok(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build(tmp_path, tokenizer, rows, fmt="alpaca", name="d.jsonl", seq_len=256, spec=None, **data_keys):
    write_jsonl(tmp_path / name, rows)
    return build_datasets(
        recipe(tmp_path, [{"path": name, "format": fmt, **(spec or {})}], seq_len, **data_keys), tokenizer
    )


ALPACA_ROW = {"instruction": "Explain LoRA.", "input": "", "output": "LoRA trains small adapters."}


# --------------------------------------------------------------------------------------------
# Exact masks


def test_alpaca_labels_are_exactly_the_response_and_eos(tmp_path, tiny_tokenizer):
    b = build(tmp_path, tiny_tokenizer, [ALPACA_ROW])
    prompt = tok(tiny_tokenizer, ALPACA_PROMPT_NO_INPUT.format(instruction="Explain LoRA."))
    response = tok(tiny_tokenizer, "LoRA trains small adapters.") + [tiny_tokenizer.eos_token_id]
    row = b.train[0]
    assert row["input_ids"] == prompt + response
    assert row["labels"] == [IGNORE_INDEX] * len(prompt) + response
    assert row["attention_mask"] == [1] * len(prompt + response)
    assert b.stats.response_tokens == len(response)
    assert b.stats.train_tokens == len(prompt + response)
    assert (b.stats.train_rows, b.stats.eval_rows, b.eval) == (1, 0, None)


def test_alpaca_prompt_with_input_uses_the_input_template():
    from lowvram.recipe import DatasetSpec

    row = {"instruction": "Summarize.", "input": "A long text.", "output": "Short."}
    prompt, response = format_example(row, DatasetSpec(path="x.jsonl"))
    assert prompt == ALPACA_PROMPT.format(instruction="Summarize.", input="A long text.")
    assert prompt.startswith("Below is an instruction that describes a task, paired with an input")
    assert prompt.endswith("### Instruction:\nSummarize.\n\n### Input:\nA long text.\n\n### Response:\n")
    assert response == "Short."
    no_input, _ = format_example({**row, "input": ""}, DatasetSpec(path="x.jsonl"))
    assert no_input.endswith("### Instruction:\nSummarize.\n\n### Response:\n")
    assert "### Input:" not in no_input


def test_completion_labels(tmp_path, tiny_tokenizer):
    b = build(tmp_path, tiny_tokenizer, [{"prompt": "What is the capital of France?", "completion": " Paris."}],
              fmt="completion")
    prompt = tok(tiny_tokenizer, "What is the capital of France?")
    response = tok(tiny_tokenizer, " Paris.") + [tiny_tokenizer.eos_token_id]
    assert b.train[0]["input_ids"] == prompt + response
    assert b.train[0]["labels"] == [IGNORE_INDEX] * len(prompt) + response


def test_chat_labels_cover_assistant_turns_only(tmp_path, tiny_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "Fine."},
    ]
    b = build(tmp_path, tiny_tokenizer, [{"messages": messages}], fmt="chat")
    t = lambda s: tok(tiny_tokenizer, s)  # noqa: E731
    p1 = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    a1 = "Paris.<|im_end|>\n"
    p2 = "<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n"
    a2 = "Fine.<|im_end|>\n"
    assert p1 + a1 + p2 + a2 == tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    row = b.train[0]
    assert row["input_ids"] == t(p1) + t(a1) + t(p2) + t(a2)
    m = [IGNORE_INDEX]
    assert row["labels"] == m * len(t(p1)) + t(a1) + m * len(t(p2)) + t(a2)
    trained = [i for i in row["labels"] if i != IGNORE_INDEX]
    assert tiny_tokenizer.decode(trained) == a1 + a2  # the end-of-turn token is trained: stop
    assert tiny_tokenizer.eos_token_id in trained


def test_train_on_inputs_labels_everything(tmp_path, tiny_tokenizer):
    b = build(tmp_path, tiny_tokenizer, [ALPACA_ROW], train_on_inputs=True)
    assert b.train[0]["labels"] == b.train[0]["input_ids"]
    assert b.stats.response_tokens == b.stats.train_tokens


def test_text_format_trains_on_all_and_ends_with_eos(tmp_path, tiny_tokenizer):
    b = build(tmp_path, tiny_tokenizer, [{"text": "The quick brown fox."}], fmt="text")
    ids = tok(tiny_tokenizer, "The quick brown fox.") + [tiny_tokenizer.eos_token_id]
    assert b.train[0]["input_ids"] == ids
    assert b.train[0]["labels"] == ids


def test_bos_prefix_is_added_for_tokenizers_that_add_one(tmp_path):
    from lowvram.testing import build_tokenizer

    t = build_tokenizer(chat_template=False)
    from tokenizers import processors

    bos = t.convert_tokens_to_ids("<|endoftext|>")
    t._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    assert t("a")["input_ids"][0] == bos
    b = build(tmp_path, t, [{"prompt": "Q", "completion": "A"}], fmt="completion")
    assert b.train[0]["input_ids"] == [bos] + tok(t, "Q") + tok(t, "A") + [t.eos_token_id]
    assert b.train[0]["labels"][: 1 + len(tok(t, "Q"))] == [IGNORE_INDEX] * (1 + len(tok(t, "Q")))


# --------------------------------------------------------------------------------------------
# Truncation and packing


def test_truncation_counts_and_drops_samples_without_response(tmp_path, tiny_tokenizer):
    short = {"prompt": "Q", "completion": "A"}
    long_answer = {"prompt": "Q", "completion": "The quick brown fox jumps over the lazy dog. " * 4}
    long_prompt = {"prompt": "The quick brown fox jumps over the lazy dog. " * 4, "completion": "A"}
    q = len(tok(tiny_tokenizer, "Q"))
    b = build(tmp_path, tiny_tokenizer, [short, long_answer, long_prompt], fmt="completion", seq_len=20)
    assert (b.stats.truncated, b.stats.dropped_no_response, b.stats.train_rows) == (2, 1, 2)
    cut = b.train[1]
    assert len(cut["input_ids"]) == 20
    assert cut["labels"][q:] == cut["input_ids"][q:]  # the kept part of the answer is still trained
    assert tiny_tokenizer.eos_token_id not in cut["input_ids"]


def test_everything_dropped_is_an_error(tmp_path, tiny_tokenizer):
    rows = [{"prompt": "The quick brown fox jumps over the lazy dog.", "completion": "A"}]
    with pytest.raises(DataError, match="no training samples left"):
        build(tmp_path, tiny_tokenizer, rows, fmt="completion", seq_len=4)


def test_packing_fills_windows_with_whole_samples(tmp_path, tiny_tokenizer):
    rows = [{"prompt": "Q", "completion": "hello world"}] * 5
    plain = build(tmp_path, tiny_tokenizer, rows, fmt="completion", seq_len=64)
    n = len(plain.train[0]["input_ids"])
    per_window = 2
    b = build(tmp_path, tiny_tokenizer, rows, fmt="completion", seq_len=2 * n + 1, packing=True)
    assert b.stats.packed and b.stats.train_samples == 5
    assert b.stats.train_rows == 3  # 2 + 2 + 1 samples; never split across windows
    assert len(b.train[2]["input_ids"]) == n
    first = b.train[0]
    assert len(first["input_ids"]) == per_window * n
    assert first["position_ids"] == list(range(n)) * per_window
    sample_labels = plain.train[0]["labels"]
    assert first["labels"] == ([IGNORE_INDEX] + sample_labels[1:]) * per_window
    assert b.stats.train_tokens == 5 * n


def test_packed_rows_attend_within_their_own_sample(tmp_path, tiny_model_dir, tiny_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    rows = [{"prompt": "Q", "completion": "hello world"}, {"prompt": "What is", "completion": " LoRA?"}]
    b = build(tmp_path, tiny_tokenizer, rows, fmt="completion", seq_len=64, packing=True)
    assert b.stats.train_rows == 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model.config.use_cache = False  # a cache disables packed-sequence detection in transformers
    batch = make_collator(tiny_tokenizer, pad_to_multiple_of=8)([b.train[0]])
    assert "attention_mask" not in batch
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        plain = build(tmp_path, tiny_tokenizer, rows, fmt="completion", seq_len=64)
        start = 0
        for r in plain.train:
            alone = model(input_ids=torch.tensor([r["input_ids"]])).logits[0]
            torch.testing.assert_close(packed[start:start + len(alone)], alone, atol=1e-5, rtol=1e-5)
            start += len(alone)


# --------------------------------------------------------------------------------------------
# Fields, several datasets, validation


def test_fields_map_user_columns(tmp_path, tiny_tokenizer):
    rows = [{"question": "Explain LoRA.", "response": "LoRA trains small adapters."}]
    b = build(tmp_path, tiny_tokenizer, rows, spec={"fields": {"instruction": "question", "output": "response"}})
    plain = build(tmp_path, tiny_tokenizer, [ALPACA_ROW], name="p.jsonl")
    assert b.train[0] == plain.train[0]


def test_misspelled_field_name_is_reported(tmp_path, tiny_tokenizer):
    # refused with the recipe (validate), before any row or model is read
    with pytest.raises(RecipeError) as e:
        build(tmp_path, tiny_tokenizer, [ALPACA_ROW], spec={"format": "alpaca", "fields": {"ouptut": "response"}})
    assert "'ouptut' is not a field of format alpaca (did you mean 'output'?" in e.value.message


def test_several_datasets_concatenate_with_max_samples(tmp_path, tiny_tokenizer):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "completion": "x"} for i in range(10)])
    write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(4)])
    r = recipe(tmp_path, [
        {"path": "a.jsonl", "format": "completion", "max_samples": 3},
        {"path": "b.jsonl", "format": "text"},
    ])
    b = build_datasets(r, tiny_tokenizer)
    assert b.stats.train_rows == 7
    firsts = [tiny_tokenizer.decode(row["input_ids"]) for row in b.train]
    assert firsts[:3] == ["a0x<|im_end|>", "a1x<|im_end|>", "a2x<|im_end|>"]
    assert firsts[3:] == [f"b{i}<|im_end|>" for i in range(4)]


def test_validation_fraction_holds_out_rows_with_the_seed(tmp_path, tiny_tokenizer):
    rows = [{"prompt": f"q{i}", "completion": "a"} for i in range(20)]
    b1 = build(tmp_path, tiny_tokenizer, rows, fmt="completion", validation=0.25)
    b2 = build(tmp_path, tiny_tokenizer, rows, fmt="completion", validation=0.25)
    assert (b1.stats.train_rows, b1.stats.eval_rows) == (15, 5)
    train = {tuple(r["input_ids"]) for r in b1.train}
    held = {tuple(r["input_ids"]) for r in b1.eval}
    assert not train & held and len(train | held) == 20
    assert b2.eval["input_ids"] == b1.eval["input_ids"]  # same seed, same split


def test_validation_split_name_loads_that_split_from_the_hub(tmp_path, tiny_tokenizer, monkeypatch):
    import datasets

    calls = []

    def fake_load(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        n = 2 if split.startswith("test") else 5
        return datasets.Dataset.from_list([{"prompt": f"{split}{i}", "completion": "a"} for i in range(n)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    r = recipe(tmp_path, [{"path": "someone/qa", "name": "main", "format": "completion", "max_samples": 4}],
               validation="test")
    b = build_datasets(r, tiny_tokenizer)
    assert calls == [("someone/qa", "main", "train[:4]"), ("someone/qa", "main", "test")]
    assert (b.stats.train_rows, b.stats.eval_rows) == (4, 2)


def test_hub_failure_is_a_data_error(tmp_path, tiny_tokenizer, monkeypatch):
    import datasets

    def fail(*a, **kw):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(DataError, match="cannot load dataset 'nobody/nothing'") as e:
        build_datasets(recipe(tmp_path, [{"path": "nobody/nothing"}]), tiny_tokenizer)
    assert "hub id" in e.value.hint


def test_validation_split_name_with_a_local_file_is_an_error(tmp_path, tiny_tokenizer):
    with pytest.raises(DataError, match="only the 'train' split"):
        build(tmp_path, tiny_tokenizer, [ALPACA_ROW], validation="test")


# --------------------------------------------------------------------------------------------
# Bad rows


BAD_ROWS = [
    ("alpaca", {"instruction": "x"}, "d.jsonl:2: missing field 'output'"),
    ("alpaca", {"instruction": "x", "output": 5}, "d.jsonl:2: field 'output': expected text, got int 5"),
    ("alpaca", {"instruction": "", "output": "y"}, "d.jsonl:2: field 'instruction': expected non-empty text"),
    ("alpaca", {"instruction": "x", "input": 3, "output": "y"}, "d.jsonl:2: field 'input': expected text, got int"),
    ("alpaca", ["x", "y"], "d.jsonl:2: expected an object with fields, got list"),
    ("completion", {"prompt": "x", "completion": None}, "d.jsonl:2: missing field 'completion'"),
    ("text", {"text": ["a"]}, "d.jsonl:2: field 'text': expected text, got list"),
    ("chat", {"messages": "hi"}, "d.jsonl:2: field 'messages': expected a list of {role, content} objects, got str"),
    ("chat", {"messages": [{"content": "hi"}]}, "d.jsonl:2: field 'messages', message 0: expected a list of {role, content}"),
    ("chat", {"messages": [{"role": "user", "content": 1}]}, "d.jsonl:2: field 'messages', message 0: 'content' must be text, got int"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "d.jsonl:2: field 'messages': expected a list of {role, content} objects with at least one non-empty assistant message"),
]
GOOD = {
    "alpaca": ALPACA_ROW,
    "completion": {"prompt": "a", "completion": "b"},
    "text": {"text": "a"},
    "chat": {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
}


@pytest.mark.parametrize("fmt,bad,message", BAD_ROWS)
def test_bad_row_error_names_file_row_and_field(tmp_path, tiny_tokenizer, fmt, bad, message):
    with pytest.raises(DataError) as e:
        build(tmp_path, tiny_tokenizer, [GOOD[fmt], bad, GOOD[fmt]], fmt=fmt)
    assert e.value.message.startswith(message), e.value.message
    assert "skip_bad_rows" in e.value.hint


def test_invalid_json_line_is_reported_with_its_line(tmp_path, tiny_tokenizer):
    (tmp_path / "d.jsonl").write_text(json.dumps(ALPACA_ROW) + "\n\n{broken\n")
    with pytest.raises(DataError, match=r"^d.jsonl:3: invalid JSON"):
        build_datasets(recipe(tmp_path, [{"path": "d.jsonl"}]), tiny_tokenizer)


def test_skip_bad_rows_counts_them(tmp_path, tiny_tokenizer):
    rows = [ALPACA_ROW, {"instruction": "x"}, {"instruction": "x", "output": 5}, ALPACA_ROW]
    b = build(tmp_path, tiny_tokenizer, rows, skip_bad_rows=True)
    assert (b.stats.skipped_bad_rows, b.stats.train_rows) == (2, 2)


def test_mapped_field_error_names_the_column(tmp_path, tiny_tokenizer):
    with pytest.raises(DataError, match=r"missing field 'output' \(column 'response'\)"):
        build(tmp_path, tiny_tokenizer, [ALPACA_ROW], spec={"fields": {"output": "response"}})


# --------------------------------------------------------------------------------------------
# Files


def test_missing_file(tmp_path, tiny_tokenizer):
    with pytest.raises(DataError, match="data file not found") as e:
        build_datasets(recipe(tmp_path, [{"path": "nope.jsonl"}]), tiny_tokenizer)
    assert "relative to the recipe" in e.value.hint


@pytest.mark.parametrize("name", ["e.jsonl", "e.csv", "e.txt", "e.json", "e.parquet"])
def test_empty_file(tmp_path, tiny_tokenizer, name):
    (tmp_path / name).write_text("\n" if not name.endswith(".parquet") else "")
    with pytest.raises(DataError, match="empty"):
        build_datasets(recipe(tmp_path, [{"path": name}]), tiny_tokenizer)


def test_not_utf8(tmp_path, tiny_tokenizer):
    (tmp_path / "l.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"l.jsonl: not UTF-8 text \(byte 13, line 1\)"):
        build_datasets(recipe(tmp_path, [{"path": "l.jsonl", "format": "text"}]), tiny_tokenizer)


@pytest.mark.parametrize("name", ["d.tsv", "d.xlsx"])
def test_unknown_extension(tmp_path, tiny_tokenizer, name):
    (tmp_path / name).write_text("a\tb\n")
    with pytest.raises(DataError, match="unknown data file extension"):
        build_datasets(recipe(tmp_path, [{"path": name}]), tiny_tokenizer)


def test_chat_needs_a_chat_template(tmp_path):
    from lowvram.testing import build_tokenizer

    with pytest.raises(DataError, match="no chat template") as e:
        build(tmp_path, build_tokenizer(chat_template=False), [GOOD["chat"]], fmt="chat")
    assert "format: alpaca" in e.value.hint


def test_csv_reads_every_column_as_text(tmp_path, tiny_tokenizer):
    (tmp_path / "d.csv").write_text('instruction,output\n"Add 2 and 2.",4\nSay NA,NA\n')
    b = build_datasets(recipe(tmp_path, [{"path": "d.csv"}]), tiny_tokenizer)
    answers = [tiny_tokenizer.decode([i for i in r["labels"] if i != IGNORE_INDEX]) for r in b.train]
    assert answers == ["4<|im_end|>", "NA<|im_end|>"]


def test_csv_bad_row_is_named_by_its_line(tmp_path, tiny_tokenizer):
    # FILE:LINE as for JSON Lines (the header is line 1; a quoted field may span lines)
    (tmp_path / "d.csv").write_text('instruction,output\na,"b\nb"\n\nc,\n')
    with pytest.raises(DataError, match=r"^d.csv:5: field 'output': expected non-empty text"):
        build_datasets(recipe(tmp_path, [{"path": "d.csv"}]), tiny_tokenizer)


def test_a_json_array_with_one_element_per_line_is_named_by_line(tmp_path, tiny_tokenizer):
    (tmp_path / "d.json").write_text(json.dumps([ALPACA_ROW, {"instruction": "x"}], indent=2))
    with pytest.raises(DataError, match=r"^d.json:7: missing field 'output'"):
        build_datasets(recipe(tmp_path, [{"path": "d.json"}]), tiny_tokenizer)


def test_parquet_loading_and_type_errors(tmp_path, tiny_tokenizer):
    import datasets

    datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}] * 3).to_parquet(str(tmp_path / "d.parquet"))
    b = build_datasets(recipe(tmp_path, [{"path": "d.parquet", "format": "completion"}]), tiny_tokenizer)
    assert b.stats.train_rows == 3
    datasets.Dataset.from_list([{"prompt": "a", "completion": 1}]).to_parquet(str(tmp_path / "n.parquet"))
    with pytest.raises(DataError, match=r"^n.parquet: row 1: field 'completion': expected text, got int 1"):
        build_datasets(recipe(tmp_path, [{"path": "n.parquet", "format": "completion"}]), tiny_tokenizer)


def test_txt_gives_one_text_row_per_non_blank_line(tmp_path, tiny_tokenizer):
    (tmp_path / "d.txt").write_text("first line\n\nsecond line\n")
    b = build_datasets(recipe(tmp_path, [{"path": "d.txt", "format": "text"}]), tiny_tokenizer)
    assert [tiny_tokenizer.decode(r["input_ids"]) for r in b.train] == ["first line<|im_end|>", "second line<|im_end|>"]


def test_json_list_file(tmp_path, tiny_tokenizer):
    (tmp_path / "d.json").write_text(json.dumps([ALPACA_ROW, {"instruction": "x"}]))
    with pytest.raises(DataError, match=r"^d.json: row 2: missing field 'output'"):
        build_datasets(recipe(tmp_path, [{"path": "d.json"}]), tiny_tokenizer)


def test_committed_fixtures_load(tmp_path, tiny_tokenizer):
    r = recipe(tmp_path, [
        {"path": str(DATA / "alpaca.jsonl")},
        {"path": str(DATA / "chat.jsonl"), "format": "chat"},
    ])
    b = build_datasets(r, tiny_tokenizer)
    assert b.stats.train_rows == 6 and b.stats.truncated == 0


# --------------------------------------------------------------------------------------------
# Collator


def test_collator_pads_per_batch():
    import torch

    class Tok:
        pad_token_id = 0
        eos_token_id = 3

    features = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]},
        {"input_ids": [8], "attention_mask": [1], "labels": [8]},
    ]
    batch = make_collator(Tok())(features)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert "attention_mask" not in batch  # causal LM: a right-padded tail is never attended to
    masked = make_collator(Tok(), padding_mask=True)(features)
    assert masked["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["input_ids"].dtype == torch.long
    padded = make_collator(Tok(), pad_to_multiple_of=4)(features)
    assert padded["input_ids"].shape == (2, 4)
    Tok.pad_token_id = None
    assert make_collator(Tok())(features)["input_ids"].tolist()[1] == [8, 3, 3]


def test_no_padding_mask_gives_the_same_loss_and_gradients(tiny_model_dir):
    """Dropping the mask of a right-padded causal batch changes nothing the loss sees."""
    import torch
    from transformers import AutoModelForCausalLM

    class Tok:
        pad_token_id = 0

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    features = [{"input_ids": list(range(5, 25)), "labels": [-100] * 5 + list(range(10, 25))},
                {"input_ids": list(range(30, 37)), "labels": [-100, -100] + list(range(32, 37))}]
    grads = []
    for padding_mask in (True, False):
        model.zero_grad()
        batch = make_collator(Tok(), padding_mask=padding_mask)(features)
        loss = model(**batch).loss
        loss.backward()
        grads.append((loss.item(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    assert abs(grads[0][0] - grads[1][0]) < 1e-5
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)


def test_collator_pads_packed_rows_with_their_own_positions():
    class Tok:
        pad_token_id = 0

    features = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 0, 1]},
                {"input_ids": [8], "labels": [-100], "position_ids": [0]}]
    batch = make_collator(Tok())(features)
    assert batch["position_ids"].tolist() == [[0, 0, 1], [0, 0, 1]]
    assert "attention_mask" not in batch


# --------------------------------------------------------------------------------------------
# The quickstart dataset


def test_quickstart_dataset_is_well_formed(tmp_path, tiny_tokenizer):
    path = REPO / "recipes" / "data" / "lowvram_instruct.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert 300 <= len(rows) <= 400
    assert all(set(r) == {"instruction", "input", "output"} for r in rows)
    assert len({(r["instruction"], r["input"]) for r in rows}) == len(rows)  # no duplicate prompts
    b = build_datasets(recipe(tmp_path, [{"path": str(path)}], seq_len=1024, validation=0.1), tiny_tokenizer)
    assert b.stats.skipped_bad_rows == 0 and b.stats.truncated == 0
