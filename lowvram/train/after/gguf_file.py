"""Write a transformers causal LM as a GGUF file with the maintained `gguf` package (llama.cpp's
own gguf-py): GGUFWriter, its tensor-name maps (gguf.get_tensor_name_map), its quantizers and
SpecialVocab. The families, their metadata and tensor changes: gguf_family.py; the tokenizer:
gguf_vocab.py. As llama.cpp's converter does: 1-D tensors (norms, biases) kept in F32, and Q8_0 only
for rows a multiple of its 32-wide block (others F16).

Only what transformers' GGUF loader reads back is written, so every export is checked (gguf_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lowvram.train.after.footprint import model_shapes
from lowvram.train.after.gguf_family import (
    converted,
    family_of,
    gguf_names,
    head_dim,
    rope_factors,
    uses_llama3_rope,
    write_metadata,
)
from lowvram.train.after.gguf_vocab import write_vocab

QUANTIZATIONS = ("f16", "bf16", "q8_0")


@dataclass(frozen=True)
class TensorPlan:
    name: str  # the GGUF name
    shape: tuple[int, ...]
    kind: str  # f32 | f16 | bf16 | q8_0


def tensor_kind(name: str, shape: tuple[int, ...], quantization: str) -> str:
    """F32 for 1-D tensors (norms, biases), the chosen type for matrices; Q8_0 needs rows in 32s."""
    if len(shape) < 2:
        return "f32"
    if quantization == "q8_0" and shape[-1] % 32 != 0:
        return "f16"
    return quantization


def tensor_bytes(shape: tuple[int, ...], kind: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return {"f32": 4 * n, "f16": 2 * n, "bf16": 2 * n, "q8_0": n // 32 * 34}[kind]


def planned_tensors(config: dict, quantization: str) -> tuple[list[TensorPlan], int]:
    """Every tensor the file will hold, and the model's parameter count, from config.json alone
    (the model built on the meta device, no weights), for the plan. LowvramError for a family or
    tensor the writer cannot write."""
    family = family_of(config)
    shapes, parameters = model_shapes(config)
    planned = [TensorPlan(new, shapes[hf], tensor_kind(new, shapes[hf], quantization))
               for hf, new in gguf_names(family, config, shapes).items()]
    if uses_llama3_rope(config):
        planned.append(TensorPlan("rope_freqs.weight", (head_dim(config) // 2,), "f32"))
    return planned, parameters


def write_gguf(model, tokenizer, tokenizer_dir: Path, path: Path, quantization: str, name: str) -> None:
    """Write ``model`` (a transformers causal LM, any dtype, on the CPU) and its tokenizer to ``path``."""
    import gguf
    import numpy as np
    import torch

    config = model.config.to_dict()
    family = family_of(config)
    ftype = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quantization]
    w = gguf.GGUFWriter(path, family.arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_metadata(w, config, family)
    write_vocab(w, tokenizer, tokenizer_dir, int(config["vocab_size"]))

    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    state = model.state_dict()
    for hf_name, new in gguf_names(family, config, {k: tuple(v.shape) for k, v in state.items()}).items():
        data = converted(family, new, state[hf_name].detach().to("cpu", torch.float32).numpy(), config)
        kind = tensor_kind(new, data.shape, quantization)
        packed = gguf.quants.quantize(np.ascontiguousarray(data), qtype[kind])
        w.add_tensor(new, packed, raw_dtype=qtype[kind])
    if uses_llama3_rope(config):  # F32, as llama.cpp's converter writes it
        w.add_tensor("rope_freqs.weight", rope_factors(model.config).numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
