"""The FSDP2 trainer on the tiny Idefics3 vision-language model: experiences whose token ids hold
expanded image placeholders are scored and trained like a plain Hugging Face forward on the same
inputs, padded or packed, on one rank or two, with text-only experiences beside them."""

import io
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from safetensors import safe_open
from transformers import AutoModelForImageTextToText, AutoProcessor

from molt.distributed.parallelize import ShardingPlan, TrainerMesh
from molt.models.vision_language import format_image_inputs
from molt.trace.experience import Experience
from molt.trace.images import ImageInputs
from molt.trainer.actor import Actor, PolicyLoss
from molt.trainer.sharded_model import build_actor_model
from molt.trainer.batch import build_micro_batches
from molt.trainer.optimizer import OptimizerSettings

CPU = torch.device("cpu")
TEMPERATURE = 0.875
PPO = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28)
# fp32 throughout; the trainer's chunked log-probs and FSDP's sums differ from the plain forward by rounding.
ATOL = 2e-5
VISION_WEIGHT = "model.vision_model.encoder.layers.0.self_attn.q_proj.weight"


def noise_image(width: int, height: int, seed: int):
    """Random pixels: a uniform image would normalise to all-zero tiles, which Idefics3 drops as padding."""
    from PIL import Image

    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def make_experience(processor, rollout_id: int, question: str, answer: str, images: list) -> Experience:
    """A user turn with `images` then `question`, and the reply `answer` as the action tokens."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    text = prompt + answer + "<|im_end|>"
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    token_ids = inputs["input_ids"][0].tolist()
    num_actions = len(processor.tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False))
    action_mask = [0] * (len(token_ids) - num_actions) + [1] * num_actions
    rng = random.Random(rollout_id)
    image_inputs = None
    if images:
        counts = [len(processor.image_processor([image], return_tensors="pt")["pixel_values"][0]) for image in images]
        # Each image's run holds one <fake_token_around_image> per tile and a closing one.
        fake = processor.tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
        starts = [i for i, token in enumerate(token_ids) if token == fake]
        firsts = [sum(count + 1 for count in counts[:k]) for k in range(len(images))]
        positions = [starts[first] for first in firsts]
        lengths = [starts[first + count] - starts[first] + 1 for first, count in zip(firsts, counts)]
        encoded = []
        for image in images:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            encoded.append(buffer.getvalue())
        image_inputs = ImageInputs(encoded=encoded, counts=counts, positions=positions, lengths=lengths,
                                   tensors={"pixel_values": inputs["pixel_values"][0],
                                            "pixel_attention_mask": inputs["pixel_attention_mask"][0]})
    return Experience(token_ids=token_ids, action_mask=action_mask,
                      behavior_logprobs=[-5.0 + rng.gauss(0, 0.3) if a else 0.0 for a in action_mask],
                      policy_versions=[0 if a else -1 for a in action_mask], images=image_inputs,
                      reward=0.0, score=0.0, group_id=0, rollout_id=rollout_id)


@pytest.fixture(scope="module")
def experiences(tiny_vlm_path) -> list[Experience]:
    """Two text-only experiences and three with images (one, two, one: squares and tall/wide ones)."""
    processor = AutoProcessor.from_pretrained(tiny_vlm_path)
    return [
        make_experience(processor, 0, "2+2=", "4", []),
        make_experience(processor, 1, "3+5=", "8", [noise_image(40, 40, seed=1)]),
        make_experience(processor, 2, "What is shown?", "13",
                        [noise_image(52, 40, seed=2), noise_image(30, 64, seed=3)]),
        make_experience(processor, 3, "1+1=", "2", []),
        make_experience(processor, 4, "7+9=", "16", [noise_image(64, 48, seed=4)]),
    ]


def reference_logprobs(model, experience: Experience) -> torch.Tensor:
    """[tokens] log-probs of one experience alone through the plain Hugging Face forward (0 at token 0)."""
    ids = torch.tensor([experience.token_ids])
    images = {} if experience.images is None else format_image_inputs(model.config, experience.images.tensors)
    logits = model(input_ids=ids, **images).logits[0].double() / TEMPERATURE
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1, dtype=logprobs.dtype), logprobs])


def reference_window_loss(model, experiences: list[Experience], advantages: list[float]) -> torch.Tensor:
    """PPO-clip, token mean over the window, one experience at a time."""
    terms = []
    for experience, advantage in zip(experiences, advantages):
        logprobs = reference_logprobs(model, experience)
        for t, action in enumerate(experience.action_mask):
            if action:
                behavior = torch.tensor(experience.behavior_logprobs[t], dtype=torch.float32).double()
                ratio = torch.exp(logprobs[t] - behavior)
                clipped = ratio.clamp(1 - PPO.clip_eps_low, 1 + PPO.clip_eps_high)
                terms.append(-torch.minimum(ratio * advantage, clipped * advantage))
    return torch.stack(terms).mean()


def make_actor(model_path) -> Actor:
    group = dist.group.WORLD
    model = build_actor_model(str(model_path), mesh=TrainerMesh.from_group(group, "cpu"), device=CPU,
                              plan=ShardingPlan(param_dtype=torch.float32))
    return Actor(model, group=group, device=CPU, temperature=TEMPERATURE, max_grad_norm=1e9,
                 optimizer=OptimizerSettings(lr=1e-3))


def score_rank(rank: int, world_size: int, model_path, shares: list[list[Experience]]) -> dict:
    """This rank's share scored in one micro-batch per layout, as padded rows."""
    actor = make_actor(model_path)
    mine = shares[rank]
    scores = {}
    for layout in ("padded", "rows", "row"):
        micro_batch = build_micro_batches(mine, max_tokens_per_micro_batch=10_000, pad_token_id=0, layout=layout,
                                          temperature=TEMPERATURE)[0]
        logprobs = actor.score(micro_batch)
        row_of = {index: row for row, index in enumerate(micro_batch.rows)}
        scores[layout] = [logprobs[row_of[index], :experience.num_tokens] for index, experience in enumerate(mine)]
    return {"scores": scores, "names": [name for name, _ in actor.model.named_parameters()]}


def train_rank(rank: int, world_size: int, model_path, shares, advantages) -> dict:
    """The window's gradient (one micro-batch per rank), then one optimizer step."""
    actor = make_actor(model_path)
    micro_batches = build_micro_batches(shares[rank], advantages[rank], max_tokens_per_micro_batch=10_000,
                                        pad_token_id=0, layout="rows", temperature=TEMPERATURE)
    actor.compute_window_gradients(micro_batches, PPO)
    grads = {name: p.grad.full_tensor().clone() for name, p in actor.model.named_parameters() if p.grad is not None}
    actor.optimizer.zero_grad(set_to_none=True)
    before = {name: p.full_tensor().clone() for name, p in actor.model.named_parameters()}
    result = actor.train_window(micro_batches, PPO)
    after = {name: p.full_tensor().clone() for name, p in actor.model.named_parameters()}
    return {"grads": grads, "before": before, "after": after, "stepped": result.stepped}


@pytest.fixture(scope="module")
def reference_model(tiny_vlm_path):
    return AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32).eval()


def test_one_rank_scores_images_padded_and_packed_like_hugging_face(tiny_vlm_path, experiences, reference_model):
    result = run_ranks(score_rank, 1, tiny_vlm_path, [experiences])[0]
    with torch.no_grad():
        expected = [reference_logprobs(reference_model, e).float() for e in experiences]
    for layout, scores in result["scores"].items():
        for index, (got, want) in enumerate(zip(scores, expected)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"{layout} experience {index}: {m}")
    # The images matter: without them the image tokens' embeddings are the token's own.
    with torch.no_grad():
        blind = reference_model(input_ids=torch.tensor([experiences[1].token_ids])).logits
        seeing = reference_model(input_ids=torch.tensor([experiences[1].token_ids]),
                                 **format_image_inputs(reference_model.config, experiences[1].images.tensors)).logits
    assert (blind - seeing).abs().max() > 1e-3


def test_trainer_parameter_names_are_the_checkpoint_names(tiny_vlm_path, experiences):
    """What refit sends and what the trainer loads: every parameter under its checkpoint key."""
    result = run_ranks(score_rank, 1, tiny_vlm_path, [experiences[:1]])[0]
    with safe_open(tiny_vlm_path / "model.safetensors", framework="pt") as checkpoint:
        assert sorted(result["names"]) == sorted(checkpoint.keys())
    assert VISION_WEIGHT in result["names"] and "lm_head.weight" in result["names"]


def test_two_ranks_score_and_train_images_beside_text_only_ranks(tiny_vlm_path, experiences, reference_model):
    # Rank 0 holds text only (its vision tower runs on no image), rank 1 mixes text and images.
    shares = [[experiences[0], experiences[3]], [experiences[1], experiences[2], experiences[4]]]
    advantages = [[0.7, -1.1], [1.3, -0.4, 0.9]]
    scored = run_ranks(score_rank, 2, tiny_vlm_path, shares)
    with torch.no_grad():
        for rank, share in enumerate(shares):
            expected = [reference_logprobs(reference_model, e).float() for e in share]
            for layout, scores in scored[rank]["scores"].items():
                for got, want in zip(scores, expected):
                    torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"rank {rank} {layout}: {m}")

    trained = run_ranks(train_rank, 2, tiny_vlm_path, shares, advantages)
    reference = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32)
    reference_window_loss(reference, shares[0] + shares[1], advantages[0] + advantages[1]).backward()
    grads = trained[0]["grads"]
    assert grads.keys() == {name for name, p in reference.named_parameters()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert grads[VISION_WEIGHT].abs().sum() > 0, "the loss reaches the vision tower"
    assert trained[0]["stepped"]
    for name in trained[0]["before"]:
        if name.startswith(("model.vision_model", "model.connector")):
            assert not torch.equal(trained[0]["before"][name], trained[0]["after"][name]), name
    torch.testing.assert_close(trained[0]["after"][VISION_WEIGHT], trained[1]["after"][VISION_WEIGHT], atol=0, rtol=0)


def refit_rank(rank: int, world_size: int, model_path, port_file: str, experience: Experience) -> list[float]:
    """Perturb every shard (the vision tower's too), refit the engine, and score `experience` at temperature 1."""
    from molt.trainer.scoring import score_tokens
    from molt.refit.gloo import RefitSender

    model = build_actor_model(str(model_path), mesh=TrainerMesh.from_group(dist.group.WORLD, "cpu"), device=CPU,
                              plan=ShardingPlan(param_dtype=torch.float32))
    sender = RefitSender(model, is_sender=rank == 0, bucket_bytes=256 << 10, timeout_seconds=60)
    if rank == 0:  # tells the test the rendezvous port, as the join message tells the engines
        port = sender.group_message("127.0.0.1", 2)["port"]
        Path(f"{port_file}.tmp").write_text(str(port))
        os.replace(f"{port_file}.tmp", port_file)
        sender.connect()
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local()
            local.add_(torch.randn(local.shape, generator=generator) * 0.05)
    sender.broadcast()
    ids = torch.tensor([experience.token_ids])
    with torch.no_grad():
        logprobs = score_tokens(model, ids, temperature=1.0, attention_mask=torch.ones_like(ids),
                                image_inputs=experience.images.tensors)[0]
    model.reshard()
    return logprobs[0].tolist()


def engine_image_logprobs(engine, experience: Experience, image_token_id: int) -> tuple[list[int], list[float]]:
    """vLLM's prompt ids and log-probs of an experience sent as vLLM takes it: one <image> per image, PIL images."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from molt.trace.images import collapse_placeholders, open_image

    collapsed = collapse_placeholders(experience.token_ids, experience.images, image_token_id)
    prompt = TokensPrompt(prompt_token_ids=collapsed,
                          multi_modal_data={"image": [open_image(blob) for blob in experience.images.encoded]})
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)

    async def score():
        final = None
        async for output in engine.engine.llm.generate(prompt, params, request_id=f"vision-refit-{time.monotonic()}"):
            final = output
        return final

    final = engine.run(score())
    ids = list(final.prompt_token_ids)
    return ids, [0.0] + [float(step[token].logprob) for token, step in zip(ids[1:], final.prompt_logprobs[1:])]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_refit_from_two_fsdp_ranks_moves_the_engines_image_logprobs_to_the_trainers(
        vlm_engine, tiny_vlm_path, experiences, tmp_path):
    """The trainer's Idefics3 parameter names (the checkpoint's) load into vLLM's idefics3 as they
    are, vision tower included: after a refit of perturbed weights the engine scores an image
    prompt as the trainer does."""
    from test_refit import send_weights_to_engine

    from molt.refit.gloo import RefitSender

    experience = experiences[2]  # two images
    processor = AutoProcessor.from_pretrained(tiny_vlm_path)
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    ids, before = engine_image_logprobs(vlm_engine, experience, image_token_id)
    assert ids == experience.token_ids, "vLLM expands each <image> as the processor did"

    port_file, results = tmp_path / "refit-port", {}

    def trainers():
        try:
            results["ranks"] = run_ranks(refit_rank, 2, tiny_vlm_path, str(port_file), experience, timeout_seconds=240)
        except BaseException as error:  # surfaced below
            results["error"] = error

    reference = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, dtype=torch.float32)
    plan = RefitSender(reference, is_sender=False, bucket_bytes=256 << 10, timeout_seconds=60).wire_plan
    thread = threading.Thread(target=trainers)
    thread.start()
    deadline = time.monotonic() + 240
    while not port_file.exists():
        assert thread.is_alive() and time.monotonic() < deadline, f"trainer rank 0 named no port: {results}"
        time.sleep(0.1)
    vlm_engine.run(vlm_engine.engine.join_refit_group(host="127.0.0.1", port=int(port_file.read_text()), rank=1,
                                                      world_size=2, timeout_seconds=60, plan=plan), timeout_seconds=240)
    vlm_engine.run(vlm_engine.engine.receive_weights(1), timeout_seconds=120)
    _, after = engine_image_logprobs(vlm_engine, experience, image_token_id)
    thread.join(240)
    if "error" in results:
        raise results["error"]
    trainer = results["ranks"][0]
    assert max(abs(a - b) for a, b in zip(before[1:], trainer[1:])) > 1e-2, "the perturbation must show"
    assert max(abs(a - b) for a, b in zip(after[1:], trainer[1:])) <= 1e-4

    send_weights_to_engine(vlm_engine, reference)  # the generated weights back, for the other tests sharing it
    assert engine_image_logprobs(vlm_engine, experience, image_token_id)[1] == pytest.approx(before, abs=1e-6)


def test_an_unknown_vision_language_model_is_refused_by_name():
    from transformers import LlavaConfig, Qwen3Config

    from molt.models.vision_language import auto_model_class

    with pytest.raises(ValueError, match="'llava' is a vision-language model"):
        auto_model_class(LlavaConfig())
    with pytest.raises(ValueError, match="'llava' is a vision-language model"):
        format_image_inputs(LlavaConfig(), {"pixel_values": torch.zeros(1, 3, 4, 4)})
    with pytest.raises(ValueError, match="'qwen3' is a text model"):
        format_image_inputs(Qwen3Config(), {"pixel_values": torch.zeros(1, 3, 4, 4)})
    assert auto_model_class(Qwen3Config()).__name__ == "AutoModelForCausalLM"


def test_micro_batches_gather_images_in_the_order_the_model_reads_them(experiences):
    """Row order, padded or packed (packed rows keep the rows' order); text-only rows add nothing."""
    for layout in ("padded", "rows", "row"):
        micro_batch = build_micro_batches(experiences, max_tokens_per_micro_batch=10_000, pad_token_id=0,
                                          layout=layout)[0]
        ordered = [experiences[index].images for index in micro_batch.rows if experiences[index].images]
        expected = torch.cat([images.tensors["pixel_values"] for images in ordered])
        torch.testing.assert_close(micro_batch.image_inputs["pixel_values"], expected, atol=0, rtol=0)
        image_token = max(experiences[1].token_ids, key=experiences[1].token_ids.count)  # <image> is the commonest
        read = micro_batch.model_inputs()["input_ids"]
        assert (read == image_token).sum() == 4 * len(expected), "4 <image> tokens per tile"
        assert micro_batch.to(CPU).image_inputs.keys() == {"pixel_values", "pixel_attention_mask"}
    text_only = build_micro_batches([experiences[0]], max_tokens_per_micro_batch=100, pad_token_id=0)[0]
    assert text_only.image_inputs is None and "image_inputs" not in text_only.model_inputs()
