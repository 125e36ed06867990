"""The images of a segment: the files as the agent sent them and the tensors the model's processor
made of them, in the order their placeholder tokens appear in the segment's token ids.

Token ids already hold each image's expanded placeholder run (Idefics3: rows of `<image>` tokens
between tile markers), so counting tokens counts image tokens. The tensors are the processor's
outputs for each image concatenated along dim 0 (Idefics3: `pixel_values` [tiles, 3, H, W] and
`pixel_attention_mask` [tiles, H, W]); `counts` says how many of those rows each image owns.
vLLM expands placeholders itself, so the engine gets each run back as the one placeholder token
the chat template rendered (`collapse_placeholders`) and its expansion is checked against ours.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class ImageInputs:
    """A segment's images, in placeholder order."""
    encoded: list[bytes]  # [images] each image's file bytes (PNG, JPEG, ...) as received
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # processor outputs, [rows over all images, ...]
    counts: list[int] = field(default_factory=list)  # [images] rows of dim 0 of every tensor each image owns
    positions: list[int] = field(default_factory=list)  # [images] index in token_ids of each image's first token
    lengths: list[int] = field(default_factory=list)  # [images] tokens of each image's placeholder run

    def __post_init__(self) -> None:
        if not len(self.encoded) == len(self.counts) == len(self.positions) == len(self.lengths):
            raise ValueError(f"ImageInputs needs one count, position and length per image: {len(self.encoded)} "
                             f"images, {len(self.counts)} counts, {len(self.positions)} positions, "
                             f"{len(self.lengths)} lengths")
        rows = sum(self.counts)
        for name, tensor in self.tensors.items():
            if len(tensor) != rows:
                raise ValueError(f"ImageInputs.tensors[{name!r}] has {len(tensor)} rows; the images own {rows}")

    @property
    def num_images(self) -> int:
        return len(self.encoded)

    @property
    def nbytes(self) -> int:
        """Bytes of the files and tensors (what a payload carries for them)."""
        return sum(map(len, self.encoded)) + sum(t.numel() * t.element_size() for t in self.tensors.values())

    def before(self, num_tokens: int) -> ImageInputs | None:
        """The images whose placeholders start before token `num_tokens` (a segment cut there keeps
        them; a cut never falls inside a placeholder run, which is context), None when none do."""
        keep = sum(1 for position in self.positions if position < num_tokens)
        if keep == self.num_images:
            return self
        if keep == 0:
            return None
        rows = sum(self.counts[:keep])
        return ImageInputs(encoded=self.encoded[:keep], tensors={k: t[:rows] for k, t in self.tensors.items()},
                           counts=self.counts[:keep], positions=self.positions[:keep], lengths=self.lengths[:keep])

    def to_dict(self) -> dict:
        """For msgpack: tensors as (dtype, shape, raw bytes)."""
        return {"encoded": list(self.encoded), "counts": list(self.counts), "positions": list(self.positions),
                "lengths": list(self.lengths), "tensors": {name: encode_tensor(t) for name, t in self.tensors.items()}}

    @classmethod
    def from_dict(cls, data: dict | None) -> ImageInputs | None:
        if data is None:
            return None
        return cls(encoded=list(data["encoded"]), counts=list(data["counts"]), positions=list(data["positions"]),
                   lengths=list(data["lengths"]), tensors={name: decode_tensor(t) for name, t in data["tensors"].items()})

    def for_engine(self) -> ImageInputs:
        """What an engine needs of them (files, positions, lengths): no tensors, vLLM processes the files."""
        return ImageInputs(encoded=self.encoded, counts=self.counts, positions=self.positions, lengths=self.lengths)


def count_stray_placeholders(token_ids: list[int], images: ImageInputs, placeholder_id: int) -> int:
    """Placeholder tokens outside the images' runs (ones the policy sampled)."""
    inside = sum(token_ids[position:position + length].count(placeholder_id)
                 for position, length in zip(images.positions, images.lengths))
    return token_ids.count(placeholder_id) - inside


def collapse_placeholders(token_ids: list[int], images: ImageInputs, placeholder_id: int) -> list[int]:
    """`token_ids` with each image's placeholder run back to the one placeholder token the chat
    template rendered (what vLLM expands itself)."""
    collapsed, start = [], 0
    for position, length in zip(images.positions, images.lengths):
        collapsed += token_ids[start:position]
        collapsed.append(placeholder_id)
        start = position + length
    return collapsed + token_ids[start:]


def concat_image_inputs(parts: list[ImageInputs], offsets: list[int]) -> ImageInputs | None:
    """Several segments' images as one, each part's positions shifted by its offset in the
    concatenated token stream; None when no part has any."""
    present = [(part, offset) for part, offset in zip(parts, offsets) if part is not None and part.num_images]
    if not present:
        return None
    names = set(present[0][0].tensors)
    if any(set(part.tensors) != names for part, _ in present):
        raise ValueError(f"images processed differently cannot be batched: tensors {[sorted(p.tensors) for p, _ in present]}")
    return ImageInputs(encoded=[blob for part, _ in present for blob in part.encoded],
                       tensors={name: torch.cat([part.tensors[name] for part, _ in present]) for name in sorted(names)},
                       counts=[count for part, _ in present for count in part.counts],
                       positions=[position + offset for part, offset in present for position in part.positions],
                       lengths=[length for part, _ in present for length in part.lengths])


DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                                          torch.int16, torch.uint8, torch.bool)}


def encode_tensor(tensor: torch.Tensor) -> dict:
    tensor = tensor.detach().contiguous().cpu()
    raw = tensor.view(torch.uint8) if tensor.dtype != torch.bool else tensor.to(torch.uint8)
    return {"dtype": str(tensor.dtype), "shape": list(tensor.shape), "data": raw.numpy().tobytes()}


def decode_tensor(data: dict) -> torch.Tensor:
    dtype = DTYPES[data["dtype"]]
    raw = torch.frombuffer(bytearray(data["data"]), dtype=torch.uint8)
    if dtype == torch.bool:
        return raw.to(torch.bool).view(data["shape"])
    return raw.view(dtype).view(data["shape"])


# -- image files, from what agents and datasets send -------------------------------------------------


class ImageError(ValueError):
    """An image reference that cannot be used: says which and why."""


def load_image_bytes(ref, *, where: str, file_root: str | None) -> bytes:
    """The file bytes of one image reference: a `data:` URI (base64), a PIL image (PNG-encoded),
    raw bytes, or a local path / `file://` URL, read only when `file_root` is set and the path lies
    under it ('/' for a dataset's own files). Web URLs are refused: rollout ranks fetch nothing."""
    if isinstance(ref, (bytes, bytearray, memoryview)):
        blob = bytes(ref)
    elif hasattr(ref, "save") and hasattr(ref, "mode"):  # a PIL image
        buffer = io.BytesIO()
        ref.save(buffer, format="PNG")
        blob = buffer.getvalue()
    elif isinstance(ref, str) and ref.startswith("data:"):
        blob = decode_data_uri(ref, where)
    elif isinstance(ref, str) and ref.startswith(("http://", "https://")):
        raise ImageError(f"{where}: image URL {ref[:80]!r} is not fetched (rollout ranks may have no network); "
                         f"send the image as a data URI (data:image/png;base64,...)")
    elif isinstance(ref, str):
        blob = read_image_file(ref.removeprefix("file://"), where=where, file_root=file_root)
    else:
        raise ImageError(f"{where}: an image must be a data URI, a path, bytes or a PIL image, got {type(ref).__name__}")
    check_image(blob, where)
    return blob


def decode_data_uri(uri: str, where: str) -> bytes:
    header, _, data = uri.partition(",")
    if not header.startswith("data:image/") or not header.endswith(";base64"):
        raise ImageError(f"{where}: a data URI image must look like data:image/<type>;base64,<data>, "
                         f"got {header[:60]!r}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"{where}: the data URI's base64 does not decode ({error})") from None


def read_image_file(path: str, *, where: str, file_root: str | None) -> bytes:
    if not file_root:
        raise ImageError(f"{where}: local image path {path!r} refused: set agent.image_root to the directory "
                         f"agents may read images from, or send a data URI")
    resolved, root = os.path.realpath(path), os.path.realpath(file_root)
    if os.path.commonpath([resolved, root]) != root:
        raise ImageError(f"{where}: image path {path!r} is outside agent.image_root={file_root!r}")
    try:
        with open(resolved, "rb") as file:
            return file.read()
    except OSError as error:
        raise ImageError(f"{where}: cannot read image {path!r}: {error.strerror}") from None


def check_image(blob: bytes, where: str) -> None:
    """Refuse bytes that are not an image file PIL can read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(blob)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ImageError(f"{where}: the image data is not an image file ({len(blob)} bytes: {error})") from None


def open_image(blob: bytes):
    """A PIL RGB image of the file bytes."""
    from PIL import Image

    with Image.open(io.BytesIO(blob)) as image:
        return image.convert("RGB")


def image_digest(blob: bytes) -> str:
    """A short content digest: equal images compare equal wherever they came from."""
    return hashlib.sha256(blob).hexdigest()[:24]


def data_uri(blob: bytes) -> str:
    """The file bytes as a data URI, for an SDK's image part."""
    from PIL import Image

    with Image.open(io.BytesIO(blob)) as image:
        kind = (image.format or "png").lower()
    return f"data:image/{kind};base64,{base64.b64encode(blob).decode()}"


# -- the model's processor ---------------------------------------------------------------------------

# Processor outputs that come with a leading dim of one per text (Idefics3: [1, tiles, ...]); they
# are stored without it and the trainer puts it back (molt.trainer.scoring). Other outputs are per image already.
BATCHED_OUTPUTS = {"idefics3": ("pixel_values", "pixel_attention_mask")}


@dataclass(kw_only=True)
class EncodedImage:
    """What the processor makes of one image: its placeholder run and its tensors."""
    token_ids: list[int]  # the expanded placeholder run that takes the place of one image token
    tensors: dict[str, torch.Tensor]  # [rows, ...] each
    num_rows: int


class ImageEncoder:
    """The model's Hugging Face processor on one image at a time. A chat template renders each image
    as one placeholder token; `expand` puts in its place the run the processor makes of that image,
    so the ids equal the processor's on the whole prompt (and vLLM's expansion of the placeholder,
    which the engine checks). Encodings are cached by content, so a screenshot repeated in every
    turn is processed once."""
    def __init__(self, model_path: str, *, cache_size: int = 256):
        from transformers import AutoConfig, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_path)
        self.model_type = AutoConfig.from_pretrained(model_path).model_type
        self.placeholder = getattr(self.processor, "image_token", None)
        if self.placeholder is None or not hasattr(self.processor, "image_processor"):
            raise ImageError(f"model.path={model_path!r} has no image processor with an image token; images need a "
                             f"vision-language model (e.g. tools/make_tiny_model.py --preset vlm)")
        tokenizer = self.processor.tokenizer
        self.placeholder_id = tokenizer.convert_tokens_to_ids(self.placeholder)
        self.cache_size = cache_size
        self._cache: dict[str, EncodedImage] = {}

    def encode(self, blob: bytes) -> EncodedImage:
        key = image_digest(blob)
        if key in self._cache:
            self._cache[key] = self._cache.pop(key)  # most recently used last
            return self._cache[key]
        outputs = self.processor(text=[self.placeholder], images=[[open_image(blob)]], return_tensors="pt",
                                 add_special_tokens=False)
        batched = BATCHED_OUTPUTS.get(self.model_type, ())
        tensors = {name: (value[0] if name in batched else value) for name, value in outputs.items()
                   if name not in ("input_ids", "attention_mask") and isinstance(value, torch.Tensor)}
        # Masks come as int64 0/1 (8 bytes a pixel); as bool they take an eighth of the payload.
        tensors = {name: value.bool() if name.endswith("attention_mask") else value for name, value in tensors.items()}
        rows = {len(t) for t in tensors.values()}
        if len(rows) != 1:
            raise ImageError(f"the {self.model_type} processor's outputs disagree on rows per image: "
                             f"{ {k: tuple(v.shape) for k, v in tensors.items()} }")
        encoded = EncodedImage(token_ids=outputs["input_ids"][0].tolist(), tensors=tensors, num_rows=rows.pop())
        self._cache[key] = encoded
        while len(self._cache) > self.cache_size:
            self._cache.pop(next(iter(self._cache)))
        return encoded

    def expand(self, token_ids: list[int], blobs: list[bytes]) -> tuple[list[int], ImageInputs | None]:
        """`token_ids` with the i-th placeholder token replaced by the i-th image's run, and the
        images (positions in the returned ids). The counts must agree."""
        slots = [index for index, token in enumerate(token_ids) if token == self.placeholder_id]
        if len(slots) != len(blobs):
            raise ImageError(f"the rendered prompt has {len(slots)} image placeholders ({self.placeholder!r}) for "
                             f"{len(blobs)} images: does the chat template render each image part once?")
        if not blobs:
            return list(token_ids), None
        expanded, positions, start = [], [], 0
        encodings = [self.encode(blob) for blob in blobs]
        for slot, encoding in zip(slots, encodings):
            expanded += token_ids[start:slot]
            positions.append(len(expanded))
            expanded += encoding.token_ids
            start = slot + 1
        expanded += token_ids[start:]
        names = encodings[0].tensors.keys()
        return expanded, ImageInputs(
            encoded=list(blobs), tensors={name: torch.cat([e.tensors[name] for e in encodings]) for name in names},
            counts=[e.num_rows for e in encodings], positions=positions,
            lengths=[len(e.token_ids) for e in encodings])


# -- a prompt row's images -----------------------------------------------------------------------------


def row_messages(messages: list[dict], images: list[str] | None) -> tuple[list[dict], list[bytes]]:
    """A prompt row's messages with its images read: the `images` column's go first in the first
    user message, and every image part becomes an OpenAI `image_url` part holding a data URI, so an
    agent can send the messages through an SDK as they are. Also the image files in order. Dataset
    files are the run's own, so any local path is read."""
    blobs: list[bytes] = []

    def image_part(ref, where: str) -> dict:
        blobs.append(load_image_bytes(ref, where=where, file_root="/"))
        return {"type": "image_url", "image_url": {"url": data_uri(blobs[-1])}}

    leading, result = list(images or []), []
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            content = [image_part(part_url(part), f"messages[{index}].content[{position}]")
                       if part.get("type") in IMAGE_PART_TYPES else part for position, part in enumerate(content)]
        if leading and message.get("role") == "user":  # a row has either an images column or image parts
            parts = [image_part(ref, f"images[{i}]") for i, ref in enumerate(leading)]
            content, leading = parts + ([{"type": "text", "text": content}] if isinstance(content, str) else content), []
        result.append({**message, "content": content})
    if leading:
        raise ImageError("the row has images but no user message to put them in")
    return result, blobs


IMAGE_PART_TYPES = ("image_url", "input_image", "image")


def has_image_parts(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                                          for p in m["content"]) for m in messages)


def part_url(part: dict):
    """The image reference of an OpenAI image_url / input_image part, or of an {"type": "image", "image": ...} part."""
    url = part.get("image_url", part.get("image"))
    return url.get("url") if isinstance(url, dict) else url
