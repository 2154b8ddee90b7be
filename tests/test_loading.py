"""specbench.engine.loading on tiny random checkpoints (no downloads, no default model)."""
from __future__ import annotations

import json
import time

import huggingface_hub.constants
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from specbench.errors import UserError
from specbench.engine.loading import load_hf_reference, load_model, save_state_dict

VOCAB = 96
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|>{% endif %}"


def save_tokenizer(folder) -> None:
    """A word-level tokenizer over VOCAB ids, with a chat template and eos, saved like a real one."""
    words = ["<|end|>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)


CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=0),
    "llama-tied-llama3rope": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16, "rope_theta": 500000.0}),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=128, eos_token_id=0),
}


def make_hf_dir(tmp_path, kind: str):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    folder = tmp_path / kind
    hf.save_pretrained(folder)
    save_tokenizer(folder)
    return folder, hf


def ours_logits(model, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Prefill ids[:, :split], then feed the rest one token per step through the KV cache."""
    n = ids.shape[1]
    model.setup_cache(1, n)
    pos = torch.arange(split)[None]
    logits, _, _ = model(ids[:, :split], pos, pos, torch.ones(split, split, dtype=torch.bool).tril()[None])
    out = [logits]
    for p in range(split, n):
        pos = torch.tensor([[p]])
        logits, _, _ = model(ids[:, p:p + 1], pos, pos, torch.ones(1, 1, p + 1, dtype=torch.bool))
        out.append(logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_local_dir_matches_transformers(tmp_path, kind):
    folder, hf = make_hf_dir(tmp_path, kind)
    lm = load_model(str(folder))
    assert not lm.model.training and not any(p.requires_grad for p in lm.model.parameters())
    assert lm.name == kind and lm.source == f"dir:{folder.resolve()}"
    assert lm.eos_token_ids == [0]
    assert lm.tokenizer.apply_chat_template([{"role": "user", "content": "w3 w4"}], add_generation_prompt=True,
                                            tokenize=False) == "<|user|>w3 w4<|end|><|assistant|>"
    if hf.config.tie_word_embeddings:
        assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight

    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits
    got = ours_logits(lm.model, ids, split=9)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5

    # The reference loader reads the same directory into transformers' own class.
    ref2 = load_hf_reference(str(folder))(ids).logits
    torch.testing.assert_close(ref2, ref)


def test_fingerprint_tracks_weights_not_dtype(tmp_path):
    folder, _ = make_hf_dir(tmp_path, "llama")
    a = load_model(str(folder))
    assert len(a.fingerprint) == 16
    assert load_model(str(folder), dtype=torch.bfloat16).fingerprint == a.fingerprint
    # Same config, other weights (sharded this time): another fingerprint.
    sd = {k: v + 1e-3 for k, v in a.model.state_dict().items()}
    (folder / "model.safetensors").unlink()
    save_state_dict(sd, folder, max_shard_bytes=20_000)
    assert json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    b = load_model(str(folder))
    assert b.fingerprint != a.fingerprint
    torch.testing.assert_close(b.model.lm_head.weight, sd["lm_head.weight"])


def one_line_user_error(spec: str) -> str:
    with pytest.raises(UserError) as info:
        load_model(spec)
    msg = str(info.value)
    assert "\n" not in msg and msg
    return msg


def test_bogus_alias_and_missing_path():
    msg = one_line_user_error("smollm3-bogus")
    assert "smollm2-135m" in msg and "unknown model" in msg
    msg = one_line_user_error("/nonexistent/dir/model")
    assert "smollm2-135m" in msg
    assert "no such GGUF file" in one_line_user_error("/nonexistent/model.gguf")


def test_unsupported_architecture(tmp_path):
    folder, _ = make_hf_dir(tmp_path, "llama")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    assert "not supported" in one_line_user_error(str(folder))


def test_hub_id_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable at import time, and transformers imported it already.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    t0 = time.time()
    msg = one_line_user_error("specbench-test/no-such-model")
    assert time.time() - t0 < 5
    assert msg.startswith("cannot download 'specbench-test/no-such-model' (offline?)") and "smollm2-135m" in msg
