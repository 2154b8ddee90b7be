"""`specbench export`, proven against the reference code: the suite's own DSpark / DFlash drafters
written in DeepSpec's layout and EAGLE heads in SpecForge's EAGLE-3 layout are loaded by the
reference modules (SpecForge's DSparkDraftModel on the DeepSpec fields; LlamaForCausalLMEagle3's
from_pretrained), which then compute the same outputs as the suite (fp32, ≤ 1e-5); the export
also loads back into the suite unchanged; what cannot be exported exactly is refused (exit 2)."""
from __future__ import annotations

import json
import zlib

import pytest
import torch
from safetensors.torch import load_file

from published import VOCAB, hf_target_dir, randomize
from specbench.cli.main import main
from specbench.drafters.dspark import DSparkArgs, build_drafter, load_dspark_drafter
from specbench.drafters.eagle import EagleArgs, build_head, load_eagle_head
from specbench.drafters.formats import load_published
from specbench.engine.loading import load_model
from specbench.engine.model import ModelArgs
from specbench.train.common import save_drafter

TOL = 1e-5
TAPS = [0, 2]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(str(hf_target_dir(tmp_path_factory.mktemp("target") / "tiny-qwen3")))


def suite_block_drafter(target, out, variant="dspark", seed=3, draft_vocab=0, qk_norm=None):
    args = DSparkArgs.for_target(target.model.args, tap_layers=TAPS, variant=variant, n_layers=2, block_size=4,
                                 markov_rank=6, draft_vocab=draft_vocab, qk_norm=qk_norm)
    drafter = build_drafter(args, target.model)
    if draft_vocab:
        drafter.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_vocab])
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            g = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()) % 1000)
            p.copy_((1.0 + 0.2 * torch.randn(p.shape, generator=g)) if name.endswith("norm.weight")
                    else 0.25 * torch.randn(p.shape, generator=g))
    save_drafter(out, args.kind, args.to_dict(), drafter.state_dict(), target, {"note": "random, for a test"})
    return load_dspark_drafter(str(out), target)


def features_and_anchors(target, n_ctx=6, batch=2, taps=TAPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, n_ctx), generator=g)
    anchors = torch.randint(3, VOCAB, (batch,), generator=g)  # never the mask id (the eos, 2)
    model = target.model
    model.setup_cache(batch, 64)
    pos = torch.arange(n_ctx)[None].expand(batch, n_ctx)
    mask = torch.cat([torch.ones(batch, n_ctx, n_ctx, dtype=torch.bool).tril(),
                      torch.zeros(batch, n_ctx, 64 - n_ctx, dtype=torch.bool)], dim=-1)
    _, features, _ = model(tokens, pos, pos, mask, taps=tuple(taps), logits=False)
    return tokens, features, anchors


def specforge_from_deepspec(out):
    """DeepSpec's checkpoint fields mapped onto SpecForge's DSparkDraftModel (the same modules as
    DeepSpec's Qwen3DSparkModel; DeepSpec itself is not an installable package)."""
    from transformers import Qwen3Config

    from specforge.modeling.draft.dspark import DSparkDraftModel

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    dc = {k: config[k] for k in ("target_layer_ids", "mask_token_id", "markov_rank", "enable_confidence_head")}
    for k in ("markov_head_type", "confidence_head_with_markov"):
        if k in config:
            dc[k] = config[k]
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings")
    cfg = Qwen3Config(**{k: config[k] for k in keys}, tie_word_embeddings=False)
    cfg.block_size, cfg.num_target_layers, cfg.dflash_config = config["block_size"], config["num_target_layers"], dc
    cfg._attn_implementation = "eager"
    model = DSparkDraftModel(cfg)
    state = load_file(out / "model.safetensors")
    embed, lm_head = state.pop("embed_tokens.weight"), state.pop("lm_head.weight")
    model.load_state_dict(state, strict=True)
    return model.eval(), embed, lm_head, config["mask_token_id"]


@pytest.mark.parametrize("variant", ["dspark", "dflash"])
def test_export_deepspec(tmp_path, target, variant):
    drafter = suite_block_drafter(target, tmp_path / "suite", variant)
    out = tmp_path / "deepspec"
    assert main(["export", "--drafter", str(tmp_path / "suite"), "--target", target.path,
                 "--format", "deepspec", "--out", str(out)]) == 0
    matches_reference(drafter, out, target)


def matches_reference(drafter, out, target):
    """The export at `out` loaded by the reference module and re-imported by the suite both draft
    what the suite's `drafter` drafts."""
    ref, embed, lm_head, mask_id = specforge_from_deepspec(out)
    assert mask_id == target.eos_token_ids[0]
    _, features, anchors = features_and_anchors(target)
    n_ctx = features.shape[1]
    block = torch.full((len(anchors), 4), mask_id)
    block[:, 0] = anchors
    with torch.no_grad():
        h_ref = ref(position_ids=torch.arange(n_ctx + 4)[None].expand(len(anchors), -1), noise_embedding=embed[block],
                    target_hidden=features, attention_mask=None)
        base_ref = h_ref @ lm_head.T
        if ref.markov_head is not None:
            tokens_ref, logits_ref = ref.markov_head.sample_block_tokens(base_ref, first_prev_token_ids=anchors,
                                                                         hidden_states=h_ref)
            conf_ref = ref.predict_confidence(h_ref, prev_token_ids=torch.cat([anchors[:, None], tokens_ref[:, :-1]], 1))
        else:
            tokens_ref, logits_ref, conf_ref = base_ref.argmax(-1), base_ref, None
    for model in (drafter, load_published(str(out), target)[1]):  # the suite's original, and the export re-imported
        model.setup_cache(len(anchors), 64)
        model.append_context(features)
        assert (model.block_hidden(anchors) - h_ref).abs().max() <= TOL
        tokens, _, conf, logits = model.draft_block(anchors, None, 0.0, return_logits=True)
        assert torch.equal(tokens, tokens_ref)
        assert (logits - logits_ref).abs().max() <= TOL * 10
        assert (conf is None) == (conf_ref is None)
        if conf is not None:
            assert (conf - conf_ref).abs().max() <= TOL


@pytest.fixture(scope="module")
def tied_target(tmp_path_factory):
    """A target with tied embeddings (as SmolLM2 and small Qwen3s): embed and head share storage."""
    return load_model(str(hf_target_dir(tmp_path_factory.mktemp("tied") / "tiny-tied", tied=True)))


@pytest.mark.parametrize("tied", [False, True])
def test_export_specforge_eagle3(tmp_path, target, tied_target, monkeypatch, tied):
    target = tied_target if tied else target
    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # SpecForge's RMSNorm is @torch.compile'd
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    from published import reference_ttt

    margs = ModelArgs(**{**target.model.args.to_dict(), "n_layers": 1, "qk_norm": False})
    head = build_head(EagleArgs(model_args=margs, tap_layers=[0, 1, 2]), target.model)
    randomize(head, seed=8, std=0.1)
    save_drafter(tmp_path / "suite", "eagle", head.args.to_dict(), head.state_dict(), target, {"note": "random"})
    head = load_eagle_head(str(tmp_path / "suite"), target)
    out = tmp_path / "eagle3"
    assert main(["export", "--drafter", str(tmp_path / "suite"), "--target", target.path,
                 "--format", "specforge", "--out", str(out)]) == 0
    # SpecForge's own config reader and registry build the model; the weights go in with a strict
    # load_state_dict (its from_pretrained under transformers 5 leaves the rope cos/sin caches
    # uninitialised: NaN, whatever the checkpoint).
    ref = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(out / "config.json")))
    ref.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    ref.eval()
    assert type(ref).__name__ == "LlamaForCausalLMEagle3"
    tokens, features, _ = features_and_anchors(target, taps=[0, 1, 2])
    outs_ref = reference_ttt(ref, features, tokens, 3)
    with torch.no_grad():
        outs = head.forward_ttt(features, tokens, 3)
        for h, h_ref in zip(outs, outs_ref):
            assert (h - h_ref).abs().max() <= TOL
            assert (head.logits(h) - ref.compute_logits(h_ref)).abs().max() <= TOL * 10


def test_export_refusals(tmp_path, target, capsys):
    suite_block_drafter(target, tmp_path / "suite")
    for fmt in ("specforge", "dflash"):
        assert main(["export", "--drafter", str(tmp_path / "suite"), "--target", target.path,
                     "--format", fmt, "--out", str(tmp_path / fmt)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--format deepspec" in err
        assert not (tmp_path / fmt).exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep")
    assert main(["export", "--drafter", str(tmp_path / "suite"), "--target", target.path,
                 "--format", "deepspec", "--out", str(tmp_path / "busy")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["x"]


def test_export_lifts_reduced_vocabulary(tmp_path, target, capsys):
    """A reduced-vocabulary drafter: refused as it is; with --full-vocabulary the reference module's
    corrected logits on the subset's tokens equal the suite's, and the confidences are unchanged."""
    drafter = suite_block_drafter(target, tmp_path / "suite", draft_vocab=20)
    args = ["export", "--drafter", str(tmp_path / "suite"), "--target", target.path, "--format", "deepspec"]
    assert main(args + ["--out", str(tmp_path / "exact")]) == 2
    assert "--full-vocabulary" in capsys.readouterr().err and not (tmp_path / "exact").exists()
    out = tmp_path / "lifted"
    assert main(args + ["--out", str(out), "--full-vocabulary"]) == 0
    ref, embed, lm_head, mask_id = specforge_from_deepspec(out)
    _, features, anchors = features_and_anchors(target)
    n_ctx = features.shape[1]
    block = torch.full((len(anchors), 4), mask_id)
    block[:, 0] = anchors
    prev = torch.cat([anchors[:, None], torch.randint(3, VOCAB, (len(anchors), 3), generator=torch.Generator().manual_seed(2))], 1)
    with torch.no_grad():
        h_ref = ref(position_ids=torch.arange(n_ctx + 4)[None].expand(len(anchors), -1), noise_embedding=embed[block],
                    target_hidden=features, attention_mask=None)
        logits_ref = ref.apply_logits_head(h_ref @ lm_head.T, prev_token_ids=prev, hidden_states=h_ref)
        conf_ref = ref.predict_confidence(h_ref, prev_token_ids=prev)
    drafter.setup_cache(len(anchors), 64)
    drafter.append_context(features)
    h = drafter.block_hidden(anchors)
    assert (h - h_ref).abs().max() <= TOL
    assert (drafter.block_logits(h, prev) - logits_ref[..., drafter.vocab_ids]).abs().max() <= TOL * 10
    assert (drafter.confidence_logits(h, prev) - conf_ref).abs().max() <= TOL


def test_export_refuses_llama_layers(tmp_path, capsys):
    """A drafter of a Llama-family target (no q/k norms) has no exact Qwen3DSparkModel form."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from published import hf_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    hf_tokenizer().save_pretrained(tmp_path / "llama")
    llama = load_model(str(tmp_path / "llama"))
    suite_block_drafter(llama, tmp_path / "suite")
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["export", "--drafter", str(tmp_path / "suite"), "--target", llama.path, "--format", "deepspec",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Qwen3 layers" in err and "--qk-norm" in err and err.count("\n") == 1 and not (tmp_path / "out").exists()
    # trained with q/k norms (train --qk-norm), the same target's drafter has the Qwen3 layout
    drafter = suite_block_drafter(llama, tmp_path / "suite-qk", qk_norm=True)
    assert main(["export", "--drafter", str(tmp_path / "suite-qk"), "--target", llama.path, "--format", "deepspec",
                 "--out", str(tmp_path / "out")]) == 0
    matches_reference(drafter, tmp_path / "out", llama)


def test_eagle3_export_for_vllm_drops_the_identity_vocabulary_maps(tmp_path, target, monkeypatch):
    """vLLM's EAGLE-3 model refuses d2t / t2d for a full-vocabulary head: the cached export for
    `vllm-eagle3` is the specforge export without them, written once."""
    from specbench.bench import vllm_engine

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    margs = ModelArgs(**{**target.model.args.to_dict(), "n_layers": 1, "qk_norm": False})
    head = build_head(EagleArgs(model_args=margs, tap_layers=[0, 1, 2]), target.model)
    randomize(head, seed=8, std=0.1)
    save_drafter(tmp_path / "suite", "eagle", head.args.to_dict(), head.state_dict(), target, {"note": "random"})
    out = vllm_engine.export_eagle3(str(tmp_path / "suite"), target)
    state = load_file(out / "model.safetensors")
    assert "d2t" not in state and "t2d" not in state
    assert {"fc.weight", "lm_head.weight", "embed_tokens.weight"} <= set(state)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == target.model.args.vocab_size
    assert vllm_engine.export_eagle3(str(tmp_path / "suite"), target) == out
