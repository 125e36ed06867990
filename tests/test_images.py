"""Images without an engine: reading image references, the processor's expansion (equal to the
Hugging Face processor on the whole prompt), request normalization for the three APIs, segments
and experiences that carry images through msgpack and the payload store, and prompt rows."""

import base64
import io
import json
import secrets

import msgpack
import pytest
import torch
from PIL import Image, ImageDraw

from molt.controller.prompts import load_prompt_rows
from molt.endpoint.anthropic_messages import convert_messages
from molt.endpoint.errors import RequestError
from molt.endpoint.images import PromptImages, image_digests
from molt.endpoint.messages import normalize_messages
from molt.endpoint.openai_responses import convert_input
from molt.trace.experience import Experience, Segment, split_at_version_changes
from molt.trace.images import ImageEncoder, ImageError, ImageInputs, data_uri, image_digest, load_image_bytes, row_messages
from molt.transport.payloads import PayloadClient, PayloadRef, PayloadStore, offload_record, reload_record


def png(text: str, size=(96, 64)) -> bytes:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((4, 4), text, fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def processor(tiny_vlm_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vlm_path)


def test_image_references_are_read_or_refused_naming_the_part(tmp_path):
    blob = png("7")
    uri = data_uri(blob)
    assert uri.startswith("data:image/png;base64,") and load_image_bytes(uri, where="p", file_root=None) == blob
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "a.png").write_bytes(blob)
    (tmp_path / "outside.png").write_bytes(blob)
    assert load_image_bytes(str(tmp_path / "allowed" / "a.png"), where="p", file_root=str(tmp_path / "allowed")) == blob
    assert load_image_bytes(f"file://{tmp_path}/allowed/a.png", where="p", file_root=str(tmp_path / "allowed")) == blob
    with pytest.raises(ImageError, match="agent.image_root"):
        load_image_bytes(str(tmp_path / "allowed" / "a.png"), where="p", file_root=None)
    with pytest.raises(ImageError, match="outside agent.image_root"):
        load_image_bytes(str(tmp_path / "allowed" / ".." / "outside.png"), where="p", file_root=str(tmp_path / "allowed"))
    with pytest.raises(ImageError, match="not fetched"):
        load_image_bytes("https://example.com/a.png", where="p", file_root=None)
    with pytest.raises(ImageError, match="does not decode"):
        load_image_bytes("data:image/png;base64,@@@", where="messages[0]", file_root=None)
    with pytest.raises(ImageError, match="messages\\[0\\].*not an image file"):
        load_image_bytes("data:image/png;base64," + base64.b64encode(b"not a png").decode(), where="messages[0]",
                         file_root=None)
    image = Image.open(io.BytesIO(blob))
    assert Image.open(io.BytesIO(load_image_bytes(image, where="p", file_root=None))).size == image.size


def test_placeholder_expansion_equals_the_processor_on_the_whole_prompt(tiny_vlm_path, processor):
    blobs = [png("3+4"), png("5", (64, 64)), png("3+4")]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "sum?"}, {"type": "image"}]},
                {"role": "assistant", "content": "8"},
                {"role": "user", "content": [{"type": "text", "text": "and?"}, {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    reference = processor(text=[text], images=[[Image.open(io.BytesIO(b)).convert("RGB") for b in blobs]],
                          return_tensors="pt", add_special_tokens=False)
    encoder = ImageEncoder(str(tiny_vlm_path))
    ids, images = encoder.expand(processor.tokenizer.encode(text, add_special_tokens=False), blobs)
    assert ids == reference["input_ids"][0].tolist()
    assert torch.equal(images.tensors["pixel_values"], reference["pixel_values"][0])
    assert torch.equal(images.tensors["pixel_attention_mask"], reference["pixel_attention_mask"][0].bool())
    assert images.tensors["pixel_attention_mask"].dtype == torch.bool  # an eighth of the int64 mask's bytes
    rendered = processor.tokenizer.encode(text, add_special_tokens=False)
    assert images.counts == [5, 5, 5] and images.encoded == blobs
    assert len(ids) == len(rendered) - 3 + sum(images.lengths)  # each placeholder became its run
    image_token = encoder.placeholder_id
    assert all(ids[p - 1] != image_token and image_token in ids[p:p + 20] for p in images.positions)
    with pytest.raises(ImageError, match="2 image placeholders .* for 1 images"):
        encoder.expand(rendered[:-7], blobs[:1])


def test_image_parts_of_the_three_apis_normalize_alike():
    blob = png("2+2")
    uri = data_uri(blob)
    chat = normalize_messages([{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": uri}}]}])
    responses = normalize_messages(convert_input([{"role": "user", "content": [
        {"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": uri}]}]))
    anthropic = normalize_messages(convert_messages([{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(blob).decode()}}]}], None))
    assert chat == responses == anthropic == [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image", "url": uri}]}]
    assert normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]) \
        == [{"role": "user", "content": "ab"}]  # text-only stays a string, as before images
    tool = normalize_messages(convert_messages([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "screen"}, {"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": base64.b64encode(blob).decode()}}]}]}], None))
    assert tool[-1]["role"] == "tool" and image_digests(PromptImages("unused").resolve(tool, {}, {})) == [image_digest(blob)]
    with pytest.raises(RequestError, match="assistant turn with an image"):
        normalize_messages([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": uri}}]}])
    with pytest.raises(RequestError, match="image_url must be"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_resolved_images_compare_by_content_wherever_they_came_from(tmp_path):
    blob = png("9")
    (tmp_path / "shot.png").write_bytes(blob)
    images, blobs, known = PromptImages("unused", file_root=str(tmp_path)), {}, {}
    by_uri = images.resolve(normalize_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(blob)}}]}]), blobs, known)
    by_path = images.resolve(normalize_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(tmp_path / "shot.png")}}]}]), blobs, known)
    assert by_uri == by_path == [{"role": "user", "content": [{"type": "image", "image": image_digest(blob)}]}]
    assert blobs == {image_digest(blob): blob} and known == {data_uri(blob): image_digest(blob)}
    # A rewritten file is read again (paths are not cached); a resent data URI is not decoded again.
    other = png("8")
    (tmp_path / "shot.png").write_bytes(other)
    again = images.resolve(normalize_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(tmp_path / "shot.png")}}]}]), blobs, known)
    assert image_digests(again) == [image_digest(other)]
    with pytest.raises(RequestError, match="agent.image_root") as refused:
        PromptImages("unused").resolve(normalize_messages([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(tmp_path / "shot.png")}}]}]), {}, {})
    assert refused.value.status == 400


def image_inputs(num_images: int, start: int = 0) -> ImageInputs:
    return ImageInputs(encoded=[png(str(i)) for i in range(num_images)],
                       tensors={"pixel_values": torch.randn(2 * num_images, 3, 4, 4),
                                "pixel_attention_mask": torch.rand(2 * num_images, 4, 4) > 0.5},
                       counts=[2] * num_images, positions=[start + 3 * i for i in range(num_images)],
                       lengths=[2] * num_images)


def test_segments_and_experiences_carry_images_through_msgpack_and_version_splits():
    segment = Segment()
    segment.add_context([1, 2, 3, 4, 5, 6], image_inputs(2))
    segment.add_action([7, 8], [-0.5, -0.25], 0)
    segment.add_context([9, 10, 11], image_inputs(1))
    segment.add_action([12], [-1.0], 1)
    assert segment.images.positions == [0, 3, 8] and segment.images.counts == [2, 2, 2]
    assert segment.copy().images is segment.images  # shared, not copied per turn
    back = Segment.from_dict(msgpack.unpackb(msgpack.packb(segment.to_dict()), raw=False))
    assert back.images.encoded == segment.images.encoded and back.images.positions == [0, 3, 8]
    for name, tensor in segment.images.tensors.items():
        assert torch.equal(back.images.tensors[name], tensor) and back.images.tensors[name].dtype == tensor.dtype
    experience = Experience(token_ids=segment.token_ids, action_mask=segment.action_mask,
                            behavior_logprobs=segment.logprobs, policy_versions=segment.versions,
                            images=segment.images, reward=1.0, score=1.0, group_id=0, rollout_id=0)
    first, second = split_at_version_changes(experience)
    assert first.images.num_images == 2 and torch.equal(first.images.tensors["pixel_values"],
                                                        segment.images.tensors["pixel_values"][:4])
    assert second.images is experience.images
    again = Experience.from_dict(msgpack.unpackb(msgpack.packb(experience.to_dict()), raw=False))
    assert again.images.counts == [2, 2, 2] and torch.equal(again.images.tensors["pixel_values"],
                                                            experience.images.tensors["pixel_values"])


def test_images_go_into_the_payload_store_and_come_back_bit_exact(tmp_path):
    node = f"test{secrets.token_hex(4)}"
    experience = Experience(token_ids=list(range(12)), action_mask=[0] * 10 + [1, 1],
                            behavior_logprobs=[0.0] * 10 + [-0.5, -0.5], policy_versions=[-1] * 10 + [0, 0],
                            images=image_inputs(3), reward=1.0, score=1.0, group_id=0, rollout_id=0)
    with PayloadStore(node, spill_dir=str(tmp_path / "spill"), serve=False) as store:
        light = offload_record(store, experience)
        wire = msgpack.packb(light.to_dict())
        assert light.payload is not None and light.images is None
        assert len(wire) < 1024 < experience.images.nbytes  # the record stays small; the images stay here
        client = PayloadClient(node, store=store)
        try:
            full = reload_record(client, Experience.from_dict(msgpack.unpackb(wire, raw=False)))
        finally:
            client.close()
    assert full.images.encoded == experience.images.encoded and full.images.positions == experience.images.positions
    for name, tensor in experience.images.tensors.items():
        assert torch.equal(full.images.tensors[name], tensor) and full.images.tensors[name].dtype == tensor.dtype


def test_prompt_rows_carry_images_as_paths_data_uris_or_bytes(tmp_path):
    blob = png("1+1")
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(blob)
    rows = [{"prompt": "sum?", "label": "2", "images": ["img/a.png"]},
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "img/a.png"}},
                                                       {"type": "text", "text": "sum?"}]}], "label": "2"},
            {"prompt": "sum?", "label": "2", "images": [{"bytes": blob, "path": None}]}]
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n")
    pq.write_table(pa.Table.from_pylist(rows[2:]), tmp_path / "rows.parquet")
    loaded = load_prompt_rows(tmp_path / "rows.jsonl") + load_prompt_rows(tmp_path / "rows.parquet")
    assert loaded[0].images == [str(tmp_path / "img" / "a.png")]
    assert loaded[2].images[0].startswith("data:image/png;base64,")
    for row in loaded:
        messages, blobs = row_messages(row.messages, row.images)
        assert blobs == [blob]
        parts = messages[0]["content"]
        assert parts[0] == {"type": "image_url", "image_url": {"url": data_uri(blob)}} and parts[-1]["text"] == "sum?"
    (tmp_path / "both.jsonl").write_text(json.dumps({**rows[1], "images": ["img/a.png"]}) + "\n")
    with pytest.raises(ValueError, match="both.jsonl:1: the row has both"):
        load_prompt_rows(tmp_path / "both.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x", "images": [3]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: images\\[0\\] must be"):
        load_prompt_rows(tmp_path / "bad.jsonl")


def test_sft_image_rows_become_the_processors_ids_with_the_images_as_context(tmp_path, tiny_vlm_path, processor):
    from transformers import AutoTokenizer

    from molt.sft import load_examples

    image = Image.new("RGB", (128, 64), "white")
    ImageDraw.Draw(image).text((10, 10), "3+4", fill="black")
    rows = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(png_of(image))}},
                                                       {"type": "text", "text": "sum?"}]},
                          {"role": "assistant", "content": "3+4=7"}]},
            {"prompt": "sum?", "label": "3+4=7", "images": [data_uri(png_of(image))]}]
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_path)
    first, second = load_examples(str(tmp_path / "sft.jsonl"), tokenizer)
    assert first.token_ids == second.token_ids and first.action_mask == second.action_mask
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "sum?"}]}],
                                           add_generation_prompt=True, tokenize=False)
    reference = processor(text=[prompt], images=[[image]], return_tensors="pt", add_special_tokens=False)
    length = reference["input_ids"].shape[1]
    assert first.token_ids[:length] == reference["input_ids"][0].tolist()
    assert torch.equal(first.images.tensors["pixel_values"], reference["pixel_values"][0])
    assert not any(first.action_mask[:length])  # the image and the question are context
    reply = processor.tokenizer.decode([t for t, m in zip(first.token_ids, first.action_mask) if m])
    assert reply.startswith("3+4=7")


def png_of(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_rollout_whose_policy_sampled_the_image_placeholder_fails():
    from molt.agents.base import RolloutOutcome
    from molt.rollout.rank import refuse_sampled_placeholders

    placeholder = 99
    images = ImageInputs(encoded=[png("1")], counts=[1], positions=[2], lengths=[3])
    clean = [1, 2, 7, placeholder, 7, 5, 6]  # the run [7, 99, 7] holds the image's own placeholder
    stray = clean + [placeholder]  # ...and the policy sampled one more

    def outcome(token_ids):
        return RolloutOutcome(rollout_id=0, group_id=0, experiences=[Experience(
            token_ids=token_ids, action_mask=[0] * 5 + [1] * (len(token_ids) - 5),
            behavior_logprobs=[0.0] * len(token_ids), policy_versions=[0] * len(token_ids), images=images,
            reward=1.0, score=1.0, group_id=0, rollout_id=0)])

    kept, failed = outcome(clean), outcome(stray)
    refuse_sampled_placeholders(kept, placeholder)
    refuse_sampled_placeholders(failed, placeholder)
    assert kept.failure == "" and len(kept.experiences) == 1
    assert failed.failure == "sampled_image_token" and failed.experiences == [] and "token 99" in failed.error
