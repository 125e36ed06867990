"""Images through the real engine (vLLM CPU, tiny Idefics3): both SDKs through the session endpoint,
multi-turn prefix continuation with images in history and new turns, the Env path's
Result.images, file roots and body caps. Each test checks the captured ids against the Hugging
Face processor and the behaviour log-probs against a plain Hugging Face forward with the pixels,
which is what the trainer computes."""

import asyncio
import base64
import io

import anthropic
import openai
import pytest
import torch
from PIL import Image, ImageDraw

from molt.agents.base import Result, RolloutRequest, SamplingParams
from molt.agents.env import Env, StepEnvRunner
from molt.trace.images import data_uri

pytestmark = pytest.mark.e2e


def picture(text: str, size=(96, 64)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((4, 4), text, fill="black")
    return image


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_url(image: Image.Image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_uri(png(image))}}


@pytest.fixture(scope="module")
def hf_model(tiny_vlm_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(tiny_vlm_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vlm_path)


def hf_logprobs(model, token_ids: list[int], images) -> torch.Tensor:
    """[tokens] log p(token t | tokens before it, the images) at temperature 1; 0 at position 0."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=images.tensors["pixel_values"][None],
                       pixel_attention_mask=images.tensors["pixel_attention_mask"][None]).logits[0].float()
    scores = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), scores])


def assert_engine_matches_hf(model, segment_or_experience) -> None:
    """The action tokens' behaviour log-probs equal the plain forward's with the recorded pixels."""
    trace = segment_or_experience
    logprobs = getattr(trace, "logprobs", None) or trace.behavior_logprobs
    reference = hf_logprobs(model, trace.token_ids, trace.images)
    actions = torch.tensor(trace.action_mask).bool()
    gap = (torch.tensor(logprobs)[actions] - reference[actions]).abs().max().item()
    assert actions.sum() > 0 and gap < 1e-4, gap


def test_openai_sdk_images_in_history_and_new_turns_continue_one_segment(vlm_endpoint, hf_model, processor):
    first, second, other = picture("3+4"), picture("5+1", (64, 64)), picture("9+9")
    session = vlm_endpoint.open_session(max_tokens=6)

    async def converse():
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        messages = [{"role": "user", "content": [image_url(first), {"type": "text", "text": "sum?"}]}]
        reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": [{"type": "text", "text": "and"}, image_url(second)]}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        # The same history with its first image changed is another conversation: a new segment.
        messages[0] = {"role": "user", "content": [image_url(other), {"type": "text", "text": "sum?"}]}
        await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        await client.close()

    try:
        vlm_endpoint.engine_thread.run(converse())
        assert dict(session.ledger.counts) == {"first_turn": 1, "continued": 1, "history_rewrite": 1}
        continued, rewritten = session.all_segments()
    finally:
        vlm_endpoint.close_session(session)
    assert continued.images.encoded == [png(first), png(second)] and rewritten.images.encoded[0] == png(other)
    # The prompt ids are the processor's on the rendered first turn; the pixels are its pixels.
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                            "text": "sum?"}]}],
                                         add_generation_prompt=True, tokenize=False)
    reference = processor(text=[text], images=[[first]], return_tensors="pt", add_special_tokens=False)
    prompt_length = continued.action_mask.index(1)
    assert continued.token_ids[:prompt_length] == reference["input_ids"][0].tolist()
    assert torch.equal(continued.images.tensors["pixel_values"][:5], reference["pixel_values"][0])
    for segment in (continued, rewritten):
        assert_engine_matches_hf(hf_model, segment)


def test_anthropic_image_blocks_record_the_ids_the_openai_sdk_does(vlm_endpoint, hf_model):
    image = picture("2+6")
    prompts = []
    for api in ("openai", "anthropic"):
        session = vlm_endpoint.open_session(max_tokens=4)

        async def ask():
            if api == "openai":
                client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
                await client.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                    image_url(image), {"type": "text", "text": "sum?"}]}])
            else:
                client = anthropic.AsyncAnthropic(base_url=session.session_url, api_key=session.api_key,
                                                  max_retries=0)
                await client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": base64.b64encode(png(image)).decode()}},
                    {"type": "text", "text": "sum?"}]}])
            await client.close()

        try:
            vlm_endpoint.engine_thread.run(ask())
            (segment,) = session.all_segments()
        finally:
            vlm_endpoint.close_session(session)
        assert_engine_matches_hf(hf_model, segment)
        prompts.append((segment.token_ids[:segment.action_mask.index(1)], segment.images.encoded))
    assert prompts[0] == prompts[1]


def test_image_paths_need_the_image_root_and_images_count_against_the_body_cap(vlm_engine, tmp_path):
    from molt.endpoint.server import SessionEndpoint

    root = tmp_path / "screens"
    root.mkdir()
    (root / "a.png").write_bytes(png(picture("1+1")))
    (tmp_path / "outside.png").write_bytes(png(picture("1+1")))
    endpoint = SessionEndpoint(vlm_engine.engine, vlm_engine.engine.tokenizer, model_name="m",
                               image_root=str(root), max_body_bytes=64 * 1024)
    vlm_engine.run(endpoint.start())
    session = endpoint.open_session(sampling=SamplingParams(max_tokens=2), max_length=256)
    noise = Image.frombytes("RGB", (160, 160), torch.randint(0, 256, (160 * 160 * 3,), dtype=torch.uint8,
                                                             generator=torch.Generator().manual_seed(0)).numpy().tobytes())

    async def ask(url: str):
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        try:
            return await client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}])
        finally:
            await client.close()

    try:
        assert vlm_engine.run(ask(str(root / "a.png"))).choices[0].message is not None
        with pytest.raises(openai.BadRequestError, match="outside agent.image_root"):
            vlm_engine.run(ask(str(root / ".." / "outside.png")))
        with pytest.raises(openai.BadRequestError, match="not fetched"):
            vlm_engine.run(ask("https://example.com/a.png"))
        big = data_uri(png(noise))
        assert len(big) > 64 * 1024
        with pytest.raises(openai.APIStatusError) as refused:
            vlm_engine.run(ask(big))
        assert refused.value.status_code == 413
        (segment,) = session.all_segments()  # only the accepted request was recorded
        assert segment.images.num_images == 1
    finally:
        endpoint.close_session(session)
        vlm_engine.run(endpoint.stop())


class ScreenshotEnv(Env):
    """Shows a new screenshot with every observation for three turns."""

    async def step(self, state):
        if state.turn == 2:
            return Result(reward=1.0)
        return Result(reward=0.0, terminated=False, observation=f"screen {state.turn}",
                      images=[picture(f"turn {state.turn}", (64 + 32 * state.turn, 64))])


def test_env_results_show_their_images_with_the_next_observation(vlm_engine, hf_model):
    row_image = picture("4+4")
    request = RolloutRequest(rollout_id=0, group_id=0, sample_index=0,
                             messages=[{"role": "user", "content": "what do you see?"}], label="", tools=None,
                             sampling=SamplingParams(max_tokens=4, temperature=1.0), max_length=400, max_turns=3,
                             policy_version=0, images=[data_uri(png(row_image))])
    engine = vlm_engine.engine
    outcome = vlm_engine.run(StepEnvRunner(ScreenshotEnv).run(request, engine, engine.tokenizer))
    (experience,) = outcome.experiences
    images = experience.images
    assert images.encoded == [png(row_image), png(picture("turn 0", (64, 64))), png(picture("turn 1", (96, 64)))]
    # Each image's run starts inside the context before the action it was shown to.
    actions = [i for i, a in enumerate(experience.action_mask) if a and not experience.action_mask[i - 1]]
    assert images.positions[0] < actions[0] < images.positions[1] < actions[1] < images.positions[2] < actions[2]
    assert_engine_matches_hf(hf_model, experience)
