import json
import string

import pytest
import torch
from fixtures_models import load_tool
from transformers import AutoModelForCausalLM, AutoTokenizer

make_tiny_model = load_tool("make_tiny_model")

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}

TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "3+5="},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3+5"}}},
            {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "5+3"}'}},
        ],
    },
    {"role": "tool", "content": "8"},
    {"role": "tool", "content": "8"},
    {"role": "assistant", "content": "8"},
    {"role": "user", "content": "2+2="},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_printable_ascii_round_trips(tokenizer):
    text = string.printable + "".join(reversed(string.printable))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_digits_are_single_tokens_and_answers_stay_separate(tokenizer):
    digit_ids = [tokenizer.encode(str(d), add_special_tokens=False) for d in range(10)]
    assert all(len(ids) == 1 for ids in digit_ids)
    for a in range(10):
        for b in range(10):
            prompt, answer = f"{a}+{b}=", str(a + b)
            joined = tokenizer.encode(prompt + answer, add_special_tokens=False)
            split = tokenizer.encode(prompt, add_special_tokens=False) + [digit_ids[int(d)][0] for d in answer]
            assert joined == split, (prompt, answer)


def test_special_tokens_and_config_agree(tokenizer, tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    generation_config = json.loads((tiny_model_dir / "generation_config.json").read_text())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_id == im_end == config["eos_token_id"] == generation_config["eos_token_id"]
    assert tokenizer.pad_token_id == pad == config["pad_token_id"]
    assert config["vocab_size"] == len(tokenizer) <= 320
    assert config["head_dim"] == 64
    for token in ["<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]:
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]
    # Tool markers must survive skip_special_tokens so tool-call parsers see them.
    call = tokenizer.encode("<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(call, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"


def test_chat_template_renders_tools_tool_calls_and_results(tokenizer):
    text = tokenizer.apply_chat_template(TOOL_CONVERSATION[:6], tools=[CALCULATOR_TOOL], tokenize=False)
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(CALCULATOR_TOOL)
        + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n3+5=<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+5"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5+3"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n8\n</tool_response>\n<tool_response>\n8\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n8<|im_end|>\n"
    )
    assert text == expected


def test_chat_template_has_no_default_system_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "3+5="}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n3+5=<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("tools", [None, [CALCULATOR_TOOL]])
def test_chat_template_is_prefix_preserving(tokenizer, tools):
    assistant_turns = [k for k, message in enumerate(TOOL_CONVERSATION) if message["role"] == "assistant"]
    for k in assistant_turns:
        prompt = tokenizer.apply_chat_template(
            TOOL_CONVERSATION[:k], tools=tools, tokenize=False, add_generation_prompt=True
        )
        with_reply = tokenizer.apply_chat_template(TOOL_CONVERSATION[: k + 1], tools=tools, tokenize=False)
        full = tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=tools, tokenize=False)
        assert with_reply.startswith(prompt) and with_reply.endswith("<|im_end|>\n")
        assert full.startswith(with_reply)
        if not TOOL_CONVERSATION[k].get("tool_calls"):
            assert with_reply == prompt + TOOL_CONVERSATION[k]["content"] + "<|im_end|>\n"
        # RL concatenates token ids, so the prefix must also hold after tokenization.
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        full_ids = tokenizer.encode(full, add_special_tokens=False)
        assert full_ids[: len(prompt_ids)] == prompt_ids


def test_model_loads_in_transformers_with_finite_logits(tiny_model_dir, tokenizer):
    model, loading_info = AutoModelForCausalLM.from_pretrained(tiny_model_dir, output_loading_info=True)
    assert not loading_info["missing_keys"] and not loading_info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    input_ids = torch.tensor([tokenizer.encode("3+5="), tokenizer.encode("7+9=")])
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (2, 4, model.config.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_moe_preset_loads_in_transformers(tmp_path):
    out_dir = make_tiny_model.make_tiny_model(tmp_path / "moe", preset="moe")
    model, loading_info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    assert not loading_info["missing_keys"] and not loading_info["unexpected_keys"]
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_size_overrides_keep_head_dim(tmp_path):
    out_dir = make_tiny_model.make_tiny_model(tmp_path / "wide", hidden_size=256, num_layers=3, intermediate_size=512)
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (256, 3, 512)
    assert config["num_attention_heads"] * config["head_dim"] == 256
    with pytest.raises(ValueError, match="multiple of head_dim"):
        make_tiny_model.make_tiny_model(tmp_path / "bad", hidden_size=100)


def test_generation_is_deterministic_from_seed(tmp_path, tiny_model_dir):
    first = make_tiny_model.make_tiny_model(tmp_path / "first", seed=0)
    other_seed = make_tiny_model.make_tiny_model(tmp_path / "other", seed=1)
    for name in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"]:
        assert (first / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other_seed / "model.safetensors").read_bytes()


def _noise_image(width: int, height: int, seed: int):
    """Random RGB pixels: a uniform image would normalise to an all-zero tile, which Idefics3 drops as padding."""
    from PIL import Image

    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def test_vlm_preset_expands_an_image_and_trains_its_vision_tower(tiny_vlm_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vlm_path)
    assert type(processor).__name__ == "Idefics3Processor"
    tokenizer = processor.tokenizer
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "3+5="}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n<image>3+5=<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(text=text, images=[_noise_image(40, 40, seed=0)], return_tensors="pt")

    # A square image: a 2 x 2 grid of 64-pixel tiles and the global view, 4 <image> tokens each,
    # every marker one token.
    def tile(marker: str) -> str:
        return f"<fake_token_around_image>{marker}" + "<image>" * 4

    expanded = (tile("<row_1_col_1>") + tile("<row_1_col_2>") + "\n" + tile("<row_2_col_1>") + tile("<row_2_col_2>")
                + "\n\n" + tile("<global-img>") + "<fake_token_around_image>")
    expected_ids = tokenizer.encode(f"<|im_start|>user\n{expanded}3+5=<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False)
    assert inputs["input_ids"][0].tolist() == expected_ids
    assert expected_ids.count(tokenizer.convert_tokens_to_ids("<image>")) == 20
    assert len(expected_ids) == 46
    assert inputs["pixel_values"].shape == (1, 5, 3, 64, 64)

    model, loading_info = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path, output_loading_info=True)
    assert not loading_info["missing_keys"] and not loading_info["unexpected_keys"]
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<image>")
    assert model.lm_head.weight.data_ptr() != model.model.text_model.embed_tokens.weight.data_ptr()
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert model.model.vision_model.embeddings.patch_embedding.weight.grad.abs().sum() > 0


def test_vlm_preset_keeps_text_chat_and_is_deterministic(tmp_path, tiny_vlm_path, tokenizer):
    vlm_tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_path)
    # String content and tool calls render exactly as in the text presets, to the same ids.
    text = vlm_tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=[CALCULATOR_TOOL], tokenize=False)
    assert text == tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=[CALCULATOR_TOOL], tokenize=False)
    assert vlm_tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    with_image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                               {"type": "text", "text": "2+2="}]}]
    assert "<image>2+2=" in vlm_tokenizer.apply_chat_template(with_image, tokenize=False)
    again = make_tiny_model.make_tiny_model(tmp_path / "vlm", preset="vlm")
    for name in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
                 "processor_config.json"]:
        assert (again / name).read_bytes() == (tiny_vlm_path / name).read_bytes(), name


@pytest.mark.parametrize("preset", ["tiny", "moe", "vlm"])
def test_every_normalisation_layer_starts_as_the_identity(tmp_path, preset):
    """RMSNorm and LayerNorm weights at one, LayerNorm biases at zero, found by module type: the vlm
    preset's vision LayerNorms (layer_norm1/2) once drew random N(0, 0.02^2) weights, which shrank
    the tower's activations ~50x; the warm-started model then lost its accuracy within 25 RL steps."""
    from transformers import AutoModelForImageTextToText

    out_dir = make_tiny_model.make_tiny_model(tmp_path / preset, preset=preset)
    auto_class = AutoModelForImageTextToText if preset == "vlm" else AutoModelForCausalLM
    model = auto_class.from_pretrained(out_dir)
    norms = {name: module for name, module in model.named_modules()
             if isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")}
    assert len(norms) >= 5 + 4 * (preset == "vlm")  # 2 per decoder layer and the final one; the vision tower's 5
    for name, module in norms.items():
        assert torch.equal(module.weight, torch.ones_like(module.weight)), name
        if getattr(module, "bias", None) is not None:
            assert torch.equal(module.bias, torch.zeros_like(module.bias)), name
