"""Tiny random drafters built with the reference implementations' own code (SpecForge's
`specforge.modeling.draft`, z-lab's `dflash`), saved the way they save checkpoints
(`save_pretrained`: config.json + model.safetensors), for the formats conformance tests."""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from tiny import tiny_model

VOCAB, DIM, TARGET_LAYERS = 64, 32, 3
TAPS = [0, 2]
MASK_ID = 5


def tiny_target(seed: int = 0, vocab: int = VOCAB, layers: int = TARGET_LAYERS, scale: float = 3.0):
    """A tiny suite target wrapped like a loading.LoadedModel (what the loaders read)."""
    model = tiny_model(vocab=vocab, dim=DIM, layers=layers, seed=seed, scale=scale, qk_norm=True)
    return SimpleNamespace(model=model, name=f"tiny-{seed}", fingerprint=f"tiny-{seed}", tokenizer=None,
                           eos_token_ids=[])


def qwen3_config(vocab: int = VOCAB, layers: int = 2, **extra):
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    for k, v in extra.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = "eager"
    return cfg


def randomize(module: torch.nn.Module, seed: int, std: float = 0.25) -> torch.nn.Module:
    """Every parameter random (norm weights around 1), so no weight name can be silently skipped."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            g = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()) % 100_000)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return module.eval()


def specforge_dspark(markov_head_type="vanilla", rank=6, confidence=True, with_markov=True, block_size=4, seed=1,
                     vocab=VOCAB, mask_id=MASK_ID, std=0.25):
    from specforge.modeling.draft.dspark import DSparkDraftModel

    cfg = qwen3_config(vocab=vocab, block_size=block_size, num_target_layers=TARGET_LAYERS)
    dc = {"target_layer_ids": TAPS, "mask_token_id": mask_id, "markov_rank": rank,
          "enable_confidence_head": confidence, "confidence_head_with_markov": with_markov}
    if rank:
        dc["markov_head_type"] = markov_head_type
    cfg.dflash_config = dc
    return randomize(DSparkDraftModel(cfg), seed, std)


def specforge_dflash(block_size=4, seed=2):
    from specforge.modeling.draft.dflash import DFlashDraftModel

    cfg = qwen3_config(block_size=block_size, num_target_layers=TARGET_LAYERS)
    cfg.dflash_config = {"target_layer_ids": TAPS, "mask_token_id": MASK_ID}
    return randomize(DFlashDraftModel(cfg), seed)


def zlab_dflash(block_size=4, seed=3):
    from dflash.model import DFlashDraftModel

    cfg = qwen3_config(block_size=block_size, num_target_layers=TARGET_LAYERS)
    cfg.dflash_config = {"target_layer_ids": TAPS, "mask_token_id": MASK_ID}
    return randomize(DFlashDraftModel(cfg), seed)


def save(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def context_inputs(target, n_ctx: int, batch: int = 2, seed: int = 0, taps=TAPS):
    """Target features of a random context (raw outputs of the tapped layers, as the reference
    code's `extract_context_feature` gives them) and anchors, for both implementations."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, n_ctx), generator=g)
    anchors = torch.randint(0, VOCAB, (batch,), generator=g)
    model = target.model
    model.setup_cache(batch, 64)
    positions = torch.arange(n_ctx)[None].expand(batch, n_ctx)
    mask = torch.ones(batch, n_ctx, n_ctx, dtype=torch.bool).tril()
    mask = torch.cat([mask, torch.zeros(batch, n_ctx, 64 - n_ctx, dtype=torch.bool)], dim=-1)
    _, features, _ = model(tokens, positions, positions, mask, taps=tuple(taps), logits=False)
    return features, anchors



def hf_tokenizer(vocab: int = VOCAB, prefix: str = "t"):
    """A word-level tokenizer over `vocab` ids ("t0" … ), eos "t2", built offline with tokenizers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"{prefix}{i}": i for i in range(vocab)}, unk_token=f"{prefix}0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"{prefix}2", unk_token=f"{prefix}0",
                                   pad_token=f"{prefix}0")


def hf_target_dir(path: Path, seed: int = 0, vocab: int = VOCAB, layers: int = TARGET_LAYERS, hidden: int = DIM,
                  tokenizer=None, tied: bool = False) -> Path:
    """A tiny random Qwen3 target saved with transformers (config.json, model.safetensors, tokenizer)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied, eos_token_id=2,
                      bos_token_id=None, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # sharp next-token distributions (no argmax near-ties)
        model.lm_head.weight.mul_(4.0 if tied else 60.0)
    model.save_pretrained(path)
    (tokenizer or hf_tokenizer(vocab)).save_pretrained(path)
    return Path(path)


EAGLE3_DRAFT_VOCAB = 40


def specforge_eagle3(seed=4, fc_norm=False):
    from transformers import LlamaConfig

    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    cfg.draft_vocab_size = EAGLE3_DRAFT_VOCAB
    cfg.fc_norm = fc_norm
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    model = randomize(LlamaForCausalLMEagle3(cfg), seed, std=0.1)  # O(1) activations: fp32 rounding ≪ 1e-5
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(VOCAB, generator=g)[:EAGLE3_DRAFT_VOCAB].sort().values  # SpecForge's d2t: id − index
    model.d2t.copy_(ids - torch.arange(EAGLE3_DRAFT_VOCAB))
    model.t2d.zero_()
    model.t2d[ids] = True
    return model


def reference_ttt(ref, features, tokens, steps):
    """SpecForge's training-time test: step i feeds step i−1's output with the tokens shifted by i,
    its attention caching every step's keys (cache_hidden)."""
    B, T, _ = features.shape
    padded = torch.cat([tokens, tokens.new_zeros(B, steps + 1)], dim=1)
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
    positions = torch.arange(T)[None].expand(B, T)
    hidden = ref.project_hidden_states(features)
    cache = [[], []]
    outs = []
    with torch.no_grad():
        for i in range(steps):
            emb = ref.embed_input_ids(padded[:, 1 + i : T + 1 + i])
            hidden = ref.backbone(emb, hidden, cache, mask, positions)
            outs.append(hidden)
    return outs


def deepspec_checkpoint(tmp_path, ref, seed=9):
    """A DeepSpec-layout checkpoint of the same weights: the config fields DeepSpec's
    build_draft_config writes and its own (here: deliberately not the target's) embed/lm_head."""
    d = save(ref, tmp_path / "sf")
    config = json.loads((d / "config.json").read_text())
    dc = config.pop("dflash_config")
    config.update({"architectures": ["Qwen3DSparkModel"], "target_layer_ids": dc["target_layer_ids"],
                   "mask_token_id": dc["mask_token_id"], "num_anchors": 512, "markov_rank": dc["markov_rank"],
                   "enable_confidence_head": dc["enable_confidence_head"]})
    if dc["markov_rank"]:
        config["markov_head_type"] = dc["markov_head_type"]
    if dc["enable_confidence_head"]:
        config["confidence_head_with_markov"] = dc["confidence_head_with_markov"]
    state = load_file(d / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    state["embed_tokens.weight"] = torch.randn(VOCAB, DIM, generator=g)
    state["lm_head.weight"] = 0.5 * torch.randn(VOCAB, DIM, generator=g)
    out = tmp_path / "deepspec"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(state, out / "model.safetensors")
    return out, state


