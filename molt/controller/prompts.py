"""Prompt rows and the resumable loader that feeds them to the rollout controller (DESIGN section 2).

A row is chat-format: `messages` (or a plain-text `prompt`, which becomes one user message), a
`label` for the reward, and optional `tools`, `images` and `metadata`. Rows are read from JSONL
or Parquet and validated once, up front: molt.train reads the whole file on rank 0 before the
process group, the models or the engines start (the loader holds every row anyway, so this is the
only pass over the file), and `--dry-run` checks its first rows. A bad row fails naming its file
and line, the key and what was expected; a key that is not a row key is ignored, with one warning.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import Dataset, Sampler

from molt.config import ConfigError
from molt.trace.images import ImageError, check_image, data_uri, has_image_parts
from torchdata.stateful_dataloader import StatefulDataLoader

logger = logging.getLogger("molt")

VALID_ROLES = ("system", "user", "assistant", "tool")
ROW_KEYS = ("messages", "prompt", "label", "tools", "images", "metadata")
# Keys other datasets use for the same thing, for the unknown-key warning's suggestion.
KEY_ALIASES = {"answer": "label", "answers": "label", "solution": "label", "ground_truth": "label",
               "target": "label", "reference": "label", "expected": "label", "output": "label",
               "question": "prompt", "problem": "prompt", "query": "prompt", "instruction": "prompt",
               "input": "prompt", "text": "prompt", "conversations": "messages", "conversation": "messages",
               "chat": "messages", "dialog": "messages", "image": "images", "functions": "tools",
               "meta": "metadata", "info": "metadata", "extra_info": "metadata"}


@dataclass(kw_only=True)
class PromptRow:
    """One prompt: the conversation to continue and what the reward compares against."""

    messages: list[dict]  # OpenAI-style chat messages, at least one
    label: str = ""  # reference answer for the reward; "" when the agent does not need one
    tools: list[dict] | None = None  # OpenAI-style tool schemas offered to the model
    images: list[str] | None = None  # image paths, URLs or data URIs
    metadata: dict | None = None  # free-form, passed through to the agent and logs
    index: int = -1  # position in the prompt file (the run's record of which prompts it trained on)


def parse_prompt_row(record: object, where: str) -> PromptRow:
    """Validate one decoded record; `where` ("file:line") prefixes every error."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object per row, got {type(record).__name__}")
    if record.get("messages") is not None:
        messages = record["messages"]
    elif record.get("prompt") is not None:
        if not isinstance(record["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string, got {type(record['prompt']).__name__}")
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        raise ValueError(
            f"{where}: row has neither 'messages' nor 'prompt' (keys: {sorted(record)}); add "
            '"messages": [{"role": "user", "content": "..."}] or "prompt": "..."'
        )
    row = PromptRow(
        messages=_check_messages(messages, where),
        label=_check_label(record.get("label"), where),
        tools=_check_tools(record.get("tools"), where),
        images=_check_images(record.get("images"), where),
        metadata=_check_metadata(record.get("metadata"), where),
    )
    if row.images and has_image_parts(row.messages):
        raise ValueError(f"{where}: the row has both an 'images' column and image parts in its messages; put "
                         f"its images in one place (the column's go first in the first user message)")
    return row


def _check_messages(messages: object, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of chat messages, got {messages!r}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in VALID_ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise ValueError(
                f"{where}: messages[{index}] has role {role!r}; each message needs a 'role' "
                f"in {VALID_ROLES} and a 'content'"
            )
        # Parquet stores every struct field, so absent keys come back as None; drop them so
        # the chat template sees the same message a JSONL row would give.
        message = {key: value for key, value in message.items() if value is not None}
        if "content" not in message and not message.get("tool_calls"):
            raise ValueError(f"{where}: messages[{index}] ({message['role']}) has no 'content'")
        checked.append(message)
    return checked


def _check_label(label: object, where: str) -> str:
    if label is None:
        return ""
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise ValueError(f"{where}: 'label' must be a string or number, got {label!r}")
    return str(label)


def _check_tools(tools: object, where: str) -> list[dict] | None:
    if isinstance(tools, str):  # Parquet datasets often keep heterogeneous schemas as JSON text
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: 'tools' is a string but not valid JSON ({error})") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: 'tools' must be a list of tool schemas (objects), got {tools!r}")
    return tools or None


def _check_images(images: object, where: str) -> list[str] | None:
    """Paths and data URIs as they are; image bytes (Parquet binary, or Hugging Face's {"bytes",
    "path"} image struct) as data URIs, so every row travels as text."""
    if images is None:
        return None
    if not isinstance(images, list):
        raise ValueError(f"{where}: 'images' must be a list of paths, data URIs or image bytes, got {images!r:.80}")
    checked = []
    for index, image in enumerate(images):
        if isinstance(image, dict):
            image = image.get("bytes") or image.get("path")
        if isinstance(image, (bytes, bytearray)):
            try:
                check_image(bytes(image), f"{where}: images[{index}]")
            except ImageError as error:
                raise ValueError(str(error)) from None
            image = data_uri(bytes(image))
        if not isinstance(image, str) or not image:
            raise ValueError(f"{where}: images[{index}] must be a path, a data URI or image bytes, got {image!r:.80}")
        checked.append(image)
    return checked or None


def resolve_image_paths(row: PromptRow, directory: Path) -> PromptRow:
    """The row with relative image paths (its `images` column and its messages' image_url parts)
    made relative to the prompt file's directory, where they are written from."""
    def resolve(ref: str) -> str:
        if ref.startswith(("data:", "http://", "https://", "file://")) or Path(ref).is_absolute():
            return ref
        return str(directory / ref)

    if row.images:
        row.images = [resolve(image) for image in row.images]
    for message in row.messages:
        for part in message.get("content") if isinstance(message.get("content"), list) else []:
            url = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
            if isinstance(url, dict) and isinstance(url.get("url"), str):
                url["url"] = resolve(url["url"])
            elif isinstance(url, str):
                part["image_url"] = resolve(url)
    return row


def _check_metadata(metadata: object, where: str) -> dict | None:
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"{where}: 'metadata' must be an object, got {metadata!r}")
    return metadata


def load_prompt_rows(path: str | Path, *, max_rows: int | None = None) -> list[PromptRow]:
    """Read and validate every row (or the first `max_rows`) of a .jsonl or .parquet prompt file;
    warns once per key that is not a row key (ROW_KEYS) and is therefore ignored."""
    path = Path(path)
    if path.suffix == ".jsonl":
        records = _read_jsonl(path)
    elif path.suffix == ".parquet":
        records = _read_parquet(path)
    else:
        raise ValueError(f"prompt file {path} has suffix {path.suffix!r}; use .jsonl or .parquet")
    rows, unknown_keys = [], UnknownKeys()
    try:
        for where, record in records:
            unknown_keys.note(record, where)
            rows.append(resolve_image_paths(parse_prompt_row(record, where), path.parent))
            if len(rows) == max_rows:
                break
    finally:  # also before a bad row's error: an unknown key may be the row's mistake
        unknown_keys.warn()
    if not rows:
        raise ValueError(f"prompt file {path} has no rows")
    logger.info("loaded %d prompt rows from %s", len(rows), path)
    return rows


def load_field_rows(field: str, path: str, *, max_rows: int | None = None) -> list[PromptRow]:
    """`load_prompt_rows` of the file a config field names: a bad file or row is a ConfigError naming `field`."""
    try:
        return load_prompt_rows(path, max_rows=max_rows)
    except ValueError as error:
        raise ConfigError(f"{field}: {error}") from None


def _read_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    """("file:line", decoded record) per non-blank line; bytes, so a bad encoding names its line too."""
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                yield where, json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ValueError(f"{where}: not valid JSON ({error}); each line must be one UTF-8 JSON "
                                 f"object") from None


def _read_parquet(path: Path) -> Iterator[tuple[str, object]]:
    """("file:row N", record) per row, N from 0, a record batch at a time."""
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            yield f"{path}:row {index}", record
            index += 1


class UnknownKeys:
    """Row keys that are not in ROW_KEYS: where each first appears and in how many rows."""

    def __init__(self):
        self.first_seen: dict[str, str] = {}
        self.counts: dict[str, int] = {}

    def note(self, record: object, where: str) -> None:
        if not isinstance(record, dict):
            return  # parse_prompt_row refuses it
        for key in record.keys() - ROW_KEYS:
            self.first_seen.setdefault(key, where)
            self.counts[key] = self.counts.get(key, 0) + 1

    def warn(self) -> None:
        for key, where in self.first_seen.items():
            logger.warning("%s: key %r (in %d row(s)) is not a prompt-row key and is ignored%s; row keys are %s",
                           where, key, self.counts[key], _suggest_key(key), ", ".join(ROW_KEYS))


def _suggest_key(key: str) -> str:
    closest = KEY_ALIASES.get(key.lower()) or (difflib.get_close_matches(key.lower(), ROW_KEYS, n=1) or [None])[0]
    return f" (did you mean {closest!r}?)" if closest else ""


class PromptDataset(Dataset):
    """Map-style dataset over validated prompt rows."""

    def __init__(self, rows: list[PromptRow]):
        # A row that knows its file position keeps it (the training part of a file an eval set was
        # held out of, molt.controller.evaluation); others are numbered in order.
        self.rows = [dataclasses.replace(row, index=index if row.index < 0 else row.index)
                     for index, row in enumerate(rows)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]


class EpochOrderSampler(Sampler[int]):
    """Visits every row once per epoch, in an order that depends only on (seed, epoch).

    torch's RandomSampler draws each epoch's order from one running generator, which a resumed
    loader does not reproduce for the epochs after the one it resumed in; here a resumed run
    replays exactly the orders of an uninterrupted one. Its state is (epoch, rows yielded).
    """

    def __init__(self, num_rows: int, *, shuffle: bool, seed: int):
        self.num_rows = num_rows
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.num_yielded = 0  # rows of the current epoch already handed out
        self.resume_from = 0  # position to start the next iteration at, set by load_state_dict

    def __len__(self) -> int:
        return self.num_rows

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(f"prompt-order:{self.seed}:{self.epoch}").shuffle(order)
        start, self.resume_from = self.resume_from, 0
        for position in range(start, self.num_rows):
            self.num_yielded = position + 1
            yield order[position]
        self.epoch += 1
        self.num_yielded = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "num_yielded": self.num_yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]
        self.num_yielded = self.resume_from = state["num_yielded"]


def build_prompt_loader(
    path: str | Path,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    drop_last: bool = True,
    rows: list[PromptRow] | None = None,
) -> StatefulDataLoader:
    """A resumable loader of `batch_size`-row lists; one pass over it is one epoch.

    Its state_dict (epoch and position) goes into checkpoints, so a resumed run neither repeats
    nor skips a prompt and sees the same order as an uninterrupted one. The caller starts the
    next epoch by iterating the loader again. `rows`: the file's rows when already read (molt.train
    reads them before the job starts); None reads `path`.
    """
    dataset = PromptDataset(load_prompt_rows(path) if rows is None else rows)
    if drop_last and len(dataset) < batch_size:
        raise ValueError(
            f"prompt file {path} has {len(dataset)} rows, fewer than batch_size={batch_size}; "
            "lower the batch size or add rows"
        )
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EpochOrderSampler(len(dataset), shuffle=shuffle, seed=seed),
        drop_last=drop_last,
        collate_fn=list,  # a batch stays a plain list: rows go to agents as text, never as tensors
    )
