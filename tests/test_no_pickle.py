"""No pickle in the package (RELIABILITY 20): a static scan of molt/ for the calls that unpickle,
naming the file and line of each."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "molt"
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib"}
UNPICKLING_NAMES = {"load", "loads", "Unpickler"}


def find_unpickling(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each call or import in `tree` that can unpickle."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in PICKLE_MODULES:
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if a.name in UNPICKLING_NAMES | {"*"}]
        if isinstance(node, ast.Attribute) and node.attr in {"recv_pyobj", "send_pyobj"}:
            found.append((node.lineno, node.attr))
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        keywords = {k.arg: k.value for k in node.keywords}
        if owner in PICKLE_MODULES and node.func.attr in UNPICKLING_NAMES:
            found.append((node.lineno, f"{owner}.{node.func.attr}"))
        if owner == "torch" and node.func.attr == "load":
            weights_only = keywords.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append((node.lineno, "torch.load without weights_only=True"))
        allow_pickle = keywords.get("allow_pickle")
        if allow_pickle is not None and not (isinstance(allow_pickle, ast.Constant) and allow_pickle.value is False):
            found.append((node.lineno, f"{node.func.attr}(allow_pickle=...)"))
    return found


def test_the_scan_catches_each_forbidden_call():
    source = """
import pickle, torch, numpy
from pickle import loads
pickle.loads(b"")
socket.recv_pyobj()
torch.load("x")
torch.load("x", weights_only=False)
torch.load("x", weights_only=True)
numpy.load("x", allow_pickle=True)
"""
    assert sorted(line for line, _ in find_unpickling(ast.parse(source))) == [3, 4, 5, 6, 7, 9]


def test_the_package_never_unpickles():
    offences = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
                for path in sorted(PACKAGE.rglob("*.py"))
                for line, what in find_unpickling(ast.parse(path.read_text(), filename=str(path)))]
    assert not offences, "pickle can run code from the wire; use msgpack or safetensors:\n" + "\n".join(offences)
