"""Images in endpoint requests: each image part is read once (a data URI, or a file under
agent.image_root) and replaced by its content digest, so a conversation that resends the same
images compares equal to the one recorded and its segment continues; the model's processor then
turns each rendered placeholder into the image's token run (molt.trace.images.ImageEncoder)."""

from __future__ import annotations

from molt.endpoint.errors import RequestError
from molt.trace.images import ImageEncoder, ImageError, image_digest, load_image_bytes


class PromptImages:
    """One per endpoint: the file root agents may name, and the model's processor (loaded at the
    first image, so text-only models never need one)."""

    def __init__(self, model_path: str, *, file_root: str | None = None):
        self.model_path = model_path
        self.file_root = file_root or None
        self._encoder: ImageEncoder | None = None

    @property
    def encoder(self) -> ImageEncoder:
        if self._encoder is None:
            try:
                self._encoder = ImageEncoder(self.model_path)
            except (ImageError, OSError, ValueError) as error:
                raise RequestError(400, f"this model takes no images: {error}", param="messages") from None
        return self._encoder

    def resolve(self, messages: list[dict], blobs: dict[str, bytes], known: dict[str, str]) -> list[dict]:
        """`messages` with each image part's `url` read and replaced by {"type": "image", "image":
        digest}; the files go into `blobs` (digest -> bytes). `known` (data URI -> digest) spares
        decoding again the images a conversation resends with every request; paths are read every
        time (a screenshot file may be rewritten between turns)."""
        resolved = []
        for index, message in enumerate(messages):
            content = message["content"]
            if isinstance(content, list):
                content = [self._resolve_part(part, f"messages[{index}].content[{position}]", blobs, known)
                           for position, part in enumerate(content)]
                message = {**message, "content": content}
            resolved.append(message)
        return resolved

    def _resolve_part(self, part: dict, where: str, blobs: dict[str, bytes], known: dict[str, str]) -> dict:
        if part["type"] != "image" or "url" not in part:
            return part
        if part["url"] in known:
            return {"type": "image", "image": known[part["url"]]}
        try:
            blob = load_image_bytes(part["url"], where=where, file_root=self.file_root)
        except ImageError as error:
            raise RequestError(400, str(error), param=where) from None
        digest = image_digest(blob)
        blobs[digest] = blob
        if part["url"].startswith("data:"):
            known[part["url"]] = digest
        return {"type": "image", "image": digest}

    def expand(self, token_ids: list[int], digests: list[str], blobs: dict[str, bytes]):
        """The rendered ids with each placeholder expanded, and their ImageInputs (None without images)."""
        if not digests:
            return token_ids, None
        try:
            return self.encoder.expand(token_ids, [blobs[digest] for digest in digests])
        except ImageError as error:
            raise RequestError(400, str(error), param="messages") from None


def image_digests(messages: list[dict]) -> list[str]:
    """The digests of the resolved messages' images, in the order the template renders them."""
    return [part["image"] for message in messages if isinstance(message["content"], list)
            for part in message["content"] if part["type"] == "image"]
