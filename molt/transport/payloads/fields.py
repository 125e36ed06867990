"""Which parts of an experience travel as a payload (DESIGN sections 5, 7): the token-axis fields,
as tensors, and optional extras (multimodal tensors, raw images as uint8 [height, width, channels],
routed experts as [tokens, layers, top_k]). The light record keeps the rest and the reference, or,
for a short experience, everything: its payload travels inline (`offload_record`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from molt.trace.experience import Experience, summarize_tokens
from molt.trace.images import ImageInputs
from molt.trace.routes import ROUTE_DTYPE
from molt.transport.payloads.reference import ALIGNMENT, PayloadRef
from molt.transport.payloads.store import PayloadStore

if TYPE_CHECKING:
    from molt.transport.payloads.client import PayloadClient

# Field -> payload dtype. Log-probs are float32, as the engine computes them and the trainer uses
# them (molt.trainer.batch); token ids and versions fit int32.
TOKEN_FIELDS = {"token_ids": torch.int32, "action_mask": torch.uint8, "behavior_logprobs": torch.float32,
                "policy_versions": torch.int32}
# Token-axis fields that may be None (then absent from the payload, and None again on reload).
# Temperatures are float32, as the engine divides the logits by them and the trainer does (molt.trainer.batch).
OPTIONAL_TOKEN_FIELDS = {"temperatures": torch.float32}
# Routed experts travel as the [tokens, layers, top_k] tensor they are (molt.trace.routes), when set.
ROUTES_FIELD = "routed_experts"
# An experience's images (molt.trace.images.ImageInputs) travel as tensors named with this prefix: each
# processor tensor, the files back to back as uint8, and the per-image file sizes, row counts,
# token positions and placeholder lengths as int64.
IMAGE_PREFIX = "image."


def experience_tensors(experience: Experience) -> dict[str, torch.Tensor]:
    """The experience's token-axis fields, each a [tokens] tensor (optional ones only when set)."""
    tensors = {name: torch.tensor(getattr(experience, name), dtype=dtype) for name, dtype in TOKEN_FIELDS.items()}
    for name, dtype in OPTIONAL_TOKEN_FIELDS.items():
        if getattr(experience, name) is not None:
            tensors[name] = torch.tensor(getattr(experience, name), dtype=dtype)
    if experience.routed_experts is not None:
        tensors[ROUTES_FIELD] = experience.routed_experts.to(ROUTE_DTYPE).contiguous()
    if experience.images is not None:
        tensors.update(image_tensors(experience.images))
    return tensors


def image_tensors(images: ImageInputs) -> dict[str, torch.Tensor]:
    """The payload tensors of an experience's images (IMAGE_PREFIX)."""
    files = b"".join(images.encoded)
    return {**{IMAGE_PREFIX + "tensor." + name: t.contiguous() for name, t in images.tensors.items()},
            IMAGE_PREFIX + "files": torch.frombuffer(bytearray(files), dtype=torch.uint8) if files
            else torch.zeros(0, dtype=torch.uint8),
            IMAGE_PREFIX + "sizes": torch.tensor([len(blob) for blob in images.encoded], dtype=torch.int64),
            IMAGE_PREFIX + "counts": torch.tensor(images.counts, dtype=torch.int64),
            IMAGE_PREFIX + "positions": torch.tensor(images.positions, dtype=torch.int64),
            IMAGE_PREFIX + "lengths": torch.tensor(images.lengths, dtype=torch.int64)}


def images_from_tensors(tensors: dict[str, torch.Tensor]) -> ImageInputs | None:
    """The images `image_tensors` stored, None if there are none."""
    if IMAGE_PREFIX + "sizes" not in tensors:
        return None
    files, encoded, start = tensors[IMAGE_PREFIX + "files"].numpy().tobytes(), [], 0
    for size in tensors[IMAGE_PREFIX + "sizes"].tolist():
        encoded.append(files[start:start + size])
        start += size
    prefix = IMAGE_PREFIX + "tensor."
    return ImageInputs(encoded=encoded, tensors={name[len(prefix):]: t for name, t in tensors.items()
                                                 if name.startswith(prefix)},
                       counts=tensors[IMAGE_PREFIX + "counts"].tolist(),
                       positions=tensors[IMAGE_PREFIX + "positions"].tolist(),
                       lengths=tensors[IMAGE_PREFIX + "lengths"].tolist())


def payload_nbytes(experience: Experience) -> int:
    """The bytes the experience's token-axis fields would take in a payload, each aligned, without
    building it (every such field has the experience's length; routes, layers x top_k per token)."""
    fields = TOKEN_FIELDS if experience.temperatures is None else {**TOKEN_FIELDS, **OPTIONAL_TOKEN_FIELDS}
    num_tokens = len(experience.token_ids)
    sizes = [num_tokens * dtype.itemsize for dtype in fields.values()]
    if experience.routed_experts is not None:
        sizes.append(experience.routed_experts.numel() * ROUTE_DTYPE.itemsize)
    if experience.images is not None:
        sizes += [t.numel() * t.element_size() for t in image_tensors(experience.images).values()]
    return sum(-(-size // ALIGNMENT) * ALIGNMENT for size in sizes)


def offload_experience(store: PayloadStore, experience: Experience,
                       extras: dict[str, torch.Tensor] | None = None) -> tuple[Experience, PayloadRef]:
    """Moves the experience's token-axis fields and `extras` into `store`. Returns the light
    experience (token-axis lists empty) and the reference that `restore_experience` undoes."""
    extras = extras or {}
    clashes = {name for name in extras if name in (*TOKEN_FIELDS, *OPTIONAL_TOKEN_FIELDS, ROUTES_FIELD)
               or name.startswith(IMAGE_PREFIX)}
    if clashes:
        raise ValueError(f"extra payload tensors may not be named like token-axis or image fields: {sorted(clashes)}")
    ref = store.offload({**experience_tensors(experience), **extras})
    light = dataclasses.replace(experience, token_ids=[], action_mask=[], behavior_logprobs=[],
                                policy_versions=[], temperatures=None, routed_experts=None, images=None,
                                info=dict(experience.info))
    return light, ref


def restore_experience(light: Experience,
                       tensors: dict[str, torch.Tensor]) -> tuple[Experience, dict[str, torch.Tensor]]:
    """The full experience from its light record and reloaded payload, and the payload's extras."""
    missing = set(TOKEN_FIELDS) - set(tensors)
    if missing:
        raise ValueError(f"payload lacks token-axis fields {sorted(missing)}; it has {sorted(tensors)}")
    fields = {name: tensors[name].tolist() for name in TOKEN_FIELDS}
    fields.update({name: tensors[name].tolist() if name in tensors else None for name in OPTIONAL_TOKEN_FIELDS})
    fields[ROUTES_FIELD] = tensors.get(ROUTES_FIELD)
    fields["images"] = images_from_tensors(tensors)
    extras = {name: t for name, t in tensors.items() if name not in fields and not name.startswith(IMAGE_PREFIX)}
    return dataclasses.replace(light, **fields), extras


def offload_record(store: PayloadStore, experience: Experience) -> Experience:
    """The light record that travels instead of `experience`: its token-axis fields in `store`,
    `payload` the reference to them, `summary` what the controller reads of them. A short
    experience, whose payload the store admits inline (`PayloadStore.admit_inline`), is its own
    record: its lists travel as msgpack, `payload` stays None, and reloading it is a no-op. An
    experience with images is always stored: however small, images never pass through the controller."""
    if experience.images is None and store.admit_inline(payload_nbytes(experience)):
        return experience
    light, ref = offload_experience(store, experience)
    light.payload, light.summary = ref.to_dict(), summarize_tokens(experience)
    return light


def reload_record(client: PayloadClient, light: Experience, *, consume: bool = True) -> Experience:
    """The full experience of a light record (`consume`: frees its payload at the owner once it is
    here); a record whose payload travelled inline is already whole."""
    if light.payload is None:
        return light
    full, _ = restore_experience(light, client.reload(PayloadRef.from_dict(light.payload), consume=consume))
    full.payload = full.summary = None
    return full
