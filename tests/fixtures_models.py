"""Build the generated test assets (tiny model, demo data, a tool-calling warm start) once and
cache them outside git.

Assets live under $MOLT_CACHE_DIR (default ~/.cache/molt). Each directory name carries a hash
of its generator's source, so editing a generator makes a fresh directory instead of reusing a
stale one. Directories are built in a temporary sibling and renamed into place, so a crashed or
concurrent build never leaves a half-written asset behind.
"""

import hashlib
import importlib.util
import inspect
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

TOOLS_DIR = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """Import tools/<name>.py as a module (tools/ is scripts, not a package)."""
    path = TOOLS_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"molt_tools_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cache_root() -> Path:
    return Path(os.environ.get("MOLT_CACHE_DIR", Path.home() / ".cache" / "molt"))


def generator_version(tool_name: str) -> str:
    """Short hash of a generator's source: the cache key for what it writes."""
    return hashlib.sha256((TOOLS_DIR / f"{tool_name}.py").read_bytes()).hexdigest()[:10]


def build_cached(target: Path, build: Callable[[Path], object]) -> Path:
    """Return `target`, first running `build(dir)` into a temp dir renamed to it if missing."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the asset is meant to be shared
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():  # not a lost race with another builder
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_cached_tiny_model(*, preset: str = "tiny", seed: int = 0) -> Path:
    version = generator_version("make_tiny_model")
    target = cache_root() / "models" / f"{preset}-seed{seed}-{version}"
    tool = load_tool("make_tiny_model")
    return build_cached(target, lambda out_dir: tool.make_tiny_model(out_dir, preset=preset, seed=seed))


def build_cached_demo_data(*, seed: int = 0) -> Path:
    """The demo task in both formats: train/eval .jsonl and .parquet side by side."""
    version = generator_version("make_demo_data")
    target = cache_root() / "data" / f"demo-seed{seed}-{version}"
    tool = load_tool("make_demo_data")

    def build(out_dir: Path) -> None:
        for file_format in ("jsonl", "parquet"):
            tool.make_demo_data(out_dir, seed=seed, file_format=file_format)

    return build_cached(target, build)


# The calculator tool as each agent in tests/agents/ declares it through its framework (what
# reaches the chat template), and the demo's own declaration.
_CALCULATOR = {"name": "calculator", "description": "solve the question"}
FRAMEWORK_TOOLS = {
    "demo": [{"type": "function", "function": {**_CALCULATOR, "parameters": {"type": "object"}}}],
    "langchain": [{"type": "function", "function": {**_CALCULATOR,
                                                    "parameters": {"properties": {}, "type": "object"}}}],
    "openai_agents": [{"type": "function", "function": {**_CALCULATOR, "parameters": {
        "properties": {}, "title": "calculator_args", "type": "object", "additionalProperties": False,
        "required": []}, "strict": True}}],
    # pydantic-ai: its calculator, and the output tool that ends the run with a structured Answer.
    "pydantic_ai": [
        {"type": "function", "function": {**_CALCULATOR, "parameters": {
            "additionalProperties": False, "properties": {}, "type": "object"}}},
        {"type": "function", "function": {
            "name": "final_result", "description": "The final response which ends this conversation",
            "parameters": {"properties": {"answer": {"type": "integer"}}, "required": ["answer"], "type": "object",
                           "additionalProperties": False}, "strict": True}}],
}
TOOL_WARM_START = {"steps": 150, "batch_size": 16, "learning_rate": 1e-2}


def without_strict(tools: list[dict]) -> list[dict]:
    """The declaration without the `strict` flags, which an endpoint may not pass to the template."""
    return [{**tool, "function": {k: v for k, v in tool["function"].items() if k != "strict"}} for tool in tools]


def build_tool_conversation(row: dict, tools: list[dict]) -> list[dict]:
    """The question, a calculator call, its result, and the answer: as text, or through
    pydantic-ai's `final_result` tool where the tools offer it."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {}}}
    turns = [row["messages"][-1], {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": row["label"]}]
    if any(tool["function"]["name"] == "final_result" for tool in tools):
        answer = {"type": "function", "function": {"name": "final_result", "arguments": {"answer": int(row["label"])}}}
        return turns + [{"role": "assistant", "content": "", "tool_calls": [answer]}]
    return turns + [{"role": "assistant", "content": row["label"]}]


def tokenize_conversation(tokenizer, turns: list[dict], tools: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids, 0/1 loss mask): assistant turns up to their end-of-turn token are trained, the
    rest is context, each piece tokenized on its own as the session endpoint appends it."""
    ids, mask, rendered = [], [], ""
    for count in range(1, len(turns) + 1):
        is_reply = turns[count - 1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(turns[:count], tools=tools, tokenize=False,
                                             add_generation_prompt=not is_reply)
        piece = text[len(rendered):]
        if is_reply:
            end = piece.index(tokenizer.eos_token) + len(tokenizer.eos_token)
            piece, text = piece[:end], rendered + piece[:end]
        piece_ids = tokenizer.encode(piece, add_special_tokens=False)
        ids += piece_ids
        mask += [int(is_reply)] * len(piece_ids)
        rendered = text
    return ids, mask


def pad_batch(batch: list[tuple[list[int], list[int]]], pad_token_id: int):
    """(token ids, 0/1 loss mask) pairs -> input_ids, labels (-100 where not trained) and
    attention_mask, each [batch, longest], right-padded."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_token_id)
    labels = torch.full((len(batch), width), -100)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, mask) in enumerate(batch):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, :len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
        attention_mask[row, :len(ids)] = 1
    return input_ids, labels, attention_mask


def train_tool_calls(model_dir: Path, data_path: Path, out_dir: Path, *, steps: int, batch_size: int,
                     learning_rate: float, seed: int) -> None:
    """Supervised steps on calculator conversations under every framework's tool declaration."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a shared box, and reproducible
    try:
        _train_tool_calls(model_dir, data_path, out_dir, steps=steps, batch_size=batch_size,
                          learning_rate=learning_rate, seed=seed)
    finally:
        torch.set_num_threads(threads)


def _train_tool_calls(model_dir: Path, data_path: Path, out_dir: Path, *, steps: int, batch_size: int,
                      learning_rate: float, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [json.loads(line) for line in data_path.read_text().splitlines() if line.strip()]
    # Each declaration as sent and as the template may render it, so that the call does not hinge on either.
    declarations = [variant for tools in FRAMEWORK_TOOLS.values() for variant in (tools, without_strict(tools))]
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    for _ in range(steps):
        batch = []
        for row in rng.sample(rows, batch_size):
            tools = rng.choice(declarations)
            batch.append(tokenize_conversation(tokenizer, build_tool_conversation(row, tools), tools))
        input_ids, labels, attention_mask = pad_batch(batch, tokenizer.pad_token_id)
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def build_cached_tool_model(*, seed: int = 0) -> Path:
    """The seed-0 "tiny" model after a short supervised warm start (TOOL_WARM_START, ~1 min on 2
    cores) that teaches it to call the calculator in the first turn under any framework's tool
    declaration, then to answer with the tool's result (pydantic-ai: through `final_result`)."""
    base, data = build_cached_tiny_model(seed=seed), build_cached_demo_data(seed=seed)
    builders = (without_strict, build_tool_conversation, tokenize_conversation, train_tool_calls, _train_tool_calls,
                pad_batch)
    recipe = repr(sorted(TOOL_WARM_START.items())) + repr(FRAMEWORK_TOOLS) + "".join(map(inspect.getsource, builders))
    version = hashlib.sha256(f"{base.name}/{data.name}/{recipe}".encode()).hexdigest()[:10]
    target = cache_root() / "models" / f"tiny-tool-seed{seed}-{version}"
    return build_cached(target, lambda out_dir: train_tool_calls(base, data / "train.jsonl", out_dir, seed=seed,
                                                                 **TOOL_WARM_START))
