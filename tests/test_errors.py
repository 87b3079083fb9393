"""ds4.errors: pickling, importability, unique codes, the three kinds, and
agreement with the codes, stages and classes of the Rust core (rust/error.rs)."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pickle
import re

import pytest

import ds4.errors as E

ROOT = pathlib.Path(__file__).resolve().parent.parent
KINDS = (E.CorruptCheckpointError, E.IncompatibleCheckpointError, E.CheckpointMismatchError)
KIND_NAME = {
    E.CorruptCheckpointError: "corrupt",
    E.IncompatibleCheckpointError: "incompatible",
    E.CheckpointMismatchError: "mismatch",
}

BASE_CHECKPOINT_CLASSES = [E.CheckpointError, *KINDS]
# one class may own several codes (BlockError: every block_* code), so the set
CHECKPOINT_CLASSES = sorted(
    {c for c in E.ERROR_CODES.values() if c not in BASE_CHECKPOINT_CLASSES}, key=lambda c: c.code
)
OTHER_CLASSES = [
    E.Ds4Error,
    E.SessionError,
    E.InvalidSessionError,
    E.EmptyPromptError,
    E.ChatTemplateError,
    E.ChatTemplateSegmentsError,
    E.NoChatTemplateError,
    E.EngineError,
    E.StoreError,
    E.StoreFullError,
]
PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)


def round_trips(e):
    """``(protocol, e pickled and unpickled with it)`` for every protocol."""
    return [(proto, pickle.loads(pickle.dumps(e, protocol=proto))) for proto in PROTOCOLS]


def _all_subclasses(cls):
    out, stack = [], [cls]
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(c.__subclasses__())
    return out


def test_error_codes_nonempty_and_exported():
    assert len(E.ERROR_CODES) >= 25
    for code, cls in E.ERROR_CODES.items():
        # a class's code, or one of the codes it owns (BlockError.codes)
        assert code in cls.__dict__.get("codes", cls.code).split()
        assert E.from_core(code, "m").code == code
        assert cls.__name__ in E.__all__, cls
        assert getattr(E, cls.__name__) is cls
    for name in E.__all__:
        assert hasattr(E, name), name


def test_error_codes_only_concrete_classes():
    """ERROR_CODES maps codes to concrete failure classes; an abstract base in it
    would let from_core() build an error that is none of corrupt/incompatible/mismatch."""
    bases = {c.__name__: code for code, c in E.ERROR_CODES.items() if c in BASE_CHECKPOINT_CLASSES}
    assert not bases, f"abstract base classes in ERROR_CODES: {bases}"


@pytest.mark.parametrize("cls", CHECKPOINT_CLASSES + BASE_CHECKPOINT_CLASSES, ids=lambda c: c.__name__)
def test_checkpoint_errors_pickle(cls):
    for stage in (None, "engine"):
        e = cls("something went wrong at byte 17", path="/tmp/x/0123.kv", stage=stage)
        for proto, r in round_trips(e):
            assert type(r) is cls, f"protocol {proto}, stage {stage}"
            assert (r.code, r.stage, r.reason, r.path, r.kind) == (e.code, e.stage, e.reason, e.path, e.kind), (
                f"protocol {proto}, stage {stage}"
            )
            assert str(r) == str(e), f"protocol {proto}, stage {stage}"
            assert r.args == e.args, f"protocol {proto}, stage {stage}"
            if stage is not None:
                assert r.stage == "engine", f"protocol {proto}"
    # default reason (first doc line) and no path survive too
    e = cls()
    for proto, r in round_trips(e):
        assert type(r) is cls and r.reason == e.reason and r.reason and r.path is None and r.stage == cls.stage, (
            f"protocol {proto}, default reason"
        )


@pytest.mark.parametrize("cls", OTHER_CLASSES, ids=lambda c: c.__name__)
def test_other_errors_pickle(cls):
    e = cls("the store ran out of budget")
    for proto, r in round_trips(e):
        assert type(r) is cls and r.args == e.args and str(r) == str(e), f"protocol {proto}"


def test_context_overflow_pickle():
    e = E.ContextOverflowError(5000, 4096)
    for proto, r in round_trips(e):
        assert type(r) is E.ContextOverflowError, f"protocol {proto}"
        assert (r.n_tokens, r.ctx, str(r)) == (5000, 4096, str(e)), f"protocol {proto}"


def test_store_error_keeps_errno():
    e = E.StoreError(28, "No space left on device", "/cache/x.kv")
    for proto, r in round_trips(e):
        assert type(r) is E.StoreError and (r.errno, r.strerror, r.filename) == (
            28,
            "No space left on device",
            "/cache/x.kv",
        ), f"protocol {proto}"


@pytest.mark.parametrize(
    "cls",
    CHECKPOINT_CLASSES + BASE_CHECKPOINT_CLASSES + OTHER_CLASSES + [E.ContextOverflowError],
    ids=lambda c: c.__name__,
)
def test_importable_from_its_module(cls):
    mod = importlib.import_module(cls.__module__)
    assert mod.__name__ == "ds4.errors"
    obj = mod
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part)
    assert obj is cls


def test_codes_unique():
    """ERROR_CODES is a dict keyed by code, so a duplicate would silently hide
    a class: count the codes of every class that defines one."""
    seen = {}
    for c in _all_subclasses(E.CheckpointError):
        if "code" in c.__dict__:
            assert c.code not in seen, f"{c.__name__} and {seen[c.code].__name__} share code {c.code!r}"
            seen[c.code] = c
            assert re.fullmatch(r"[a-z][a-z0-9_]*", c.code), c.code
    leaves = {c for c in _all_subclasses(E.CheckpointError) if c not in BASE_CHECKPOINT_CLASSES}
    assert leaves == set(CHECKPOINT_CLASSES), "every concrete class needs its own code"


@pytest.mark.parametrize("cls", CHECKPOINT_CLASSES, ids=lambda c: c.__name__)
def test_exactly_one_kind(cls):
    kinds = [k for k in KINDS if issubclass(cls, k)]
    assert len(kinds) == 1, (cls, kinds)
    assert cls.kind == KIND_NAME[kinds[0]]
    assert issubclass(cls, E.CheckpointError) and issubclass(cls, E.Ds4Error) and issubclass(cls, ValueError)
    assert cls.stage in ("open", "header", "text", "payload", "engine", "block")
    assert inspect.getdoc(cls), "the first doc line is the default reason"


@pytest.mark.parametrize("code", sorted(E.ERROR_CODES))
def test_from_core(code):
    e = E.from_core(code, "msg", "/p/a.kv")
    assert type(e) is E.ERROR_CODES[code] and e.reason == "msg" and e.path == "/p/a.kv"


def test_from_core_unknown_code_is_corrupt():
    e = E.from_core("no_such_code_ever", "msg")
    assert type(e) is E.CorruptCheckpointError and e.path is None


# -- agreement with rust/error.rs ---------------------------------------------


def _rust_fn_body(src: str, name: str) -> str:
    m = re.search(rf"pub fn {name}\(&self\)[^{{]*\{{", src)
    assert m, f"fn {name} not found in rust/error.rs"
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        i += 1
    return src[m.end() : i - 1]


def _rust_arms(body: str, value_re: str) -> dict[str, str]:
    """variant -> value for a `match self { Error::A | Error::B => value, ... }`;
    a `_ => value` arm is returned under the key "_"."""
    out, pending = {}, []
    for m in re.finditer(rf"Error::(\w+)|(?<![\w:(])(_)(?=\s*=>)|=>\s*(?:\{{\s*)?({value_re})", body):
        if m.group(1):
            pending.append(m.group(1))
        elif m.group(2):
            pending.append("_")
        else:
            for v in pending:
                out[v] = m.group(3)
            pending = []
    assert not pending, pending
    return out


@pytest.fixture(scope="module")
def rust_error_src():
    return (ROOT / "rust" / "error.rs").read_text()


def test_rust_codes_exist_in_python(rust_error_src):
    codes = _rust_arms(_rust_fn_body(rust_error_src, "code"), r'"[a-z0-9_]+"')
    codes = {v: c.strip('"') for v, c in codes.items()}
    assert len(codes) >= 20
    # every literal in code() (sanity: the arm parser saw them all)
    literals = set(re.findall(r'"([a-z0-9_]+)"', _rust_fn_body(rust_error_src, "code")))
    assert literals == set(codes.values())
    missing = literals - {"io"} - set(E.ERROR_CODES)
    assert not missing, f"Rust error codes with no ds4.errors class: {sorted(missing)}"
    # "io" must never name a checkpoint class: it becomes OSError
    assert "io" not in E.ERROR_CODES


def test_rust_classes_and_stages_agree(rust_error_src):
    codes = {v: c.strip('"') for v, c in _rust_arms(_rust_fn_body(rust_error_src, "code"), r'"[a-z0-9_]+"').items()}
    classes = _rust_arms(_rust_fn_body(rust_error_src, "class"), r"Class::\w+")
    stages = {v: s.strip('"') for v, s in _rust_arms(_rust_fn_body(rust_error_src, "stage"), r'"[a-z]+"').items()}
    default_class = classes.pop("_", None)
    problems = []
    for variant, code in codes.items():
        if code == "io":
            continue
        cls = E.ERROR_CODES[code]
        py_stage = E.from_core(code, "m").stage  # a class of several codes may stage them apart
        rust_class = classes.get(variant, default_class)
        assert rust_class is not None, variant
        if rust_class.split("::")[1].lower() != cls.kind:
            problems.append(f"{variant}/{code}: Rust {rust_class}, Python {cls.__name__}.kind={cls.kind}")
        if stages.get(variant) != py_stage:
            problems.append(f"{variant}/{code}: Rust stage {stages.get(variant)!r}, Python {py_stage!r}")
    assert not problems, "\n".join(problems)
