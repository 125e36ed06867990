"""Write a tiny, randomly initialised Qwen3 model directory for tests and the demo task.

The output is a standard Hugging Face directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with a ChatML chat template)
that both `transformers` and vLLM load. Everything is a pure function of the arguments, so two
runs with the same seed produce byte-identical weights.

The "vlm" preset writes a tiny Idefics3 (SmolVLM v1 architecture) vision-language model instead:
a Llama text tower, a SigLIP-style vision tower and the processor files, so that
`AutoProcessor` and `AutoModelForImageTextToText` load it and vLLM serves it with images.

    python tools/make_tiny_model.py OUT_DIR [--preset tiny|bench|moe|vlm] [--seed 0]
"""

import argparse
import copy
import json
import string
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    Idefics3Config,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Idefics3's image markers, each one special token. One image becomes tiles of
# <fake_token_around_image><row_i_col_j> followed by IMAGE_SEQ_LEN <image> tokens, then the global view.
IMAGE_TOKEN = "<image>"
MAX_GRID = 6  # the processor knows <row_i_col_j> up to 6 x 6
IMAGE_TOKENS = [IMAGE_TOKEN, "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, MAX_GRID + 1) for j in range(1, MAX_GRID + 1)
]

# Byte-level BPE merges learned on top of the printable-ASCII alphabet; together with the
# alphabet and the added tokens this keeps the vocabulary around 320 entries.
BPE_VOCAB_SIZE = 313

PRESETS: dict[str, dict] = {
    "tiny": dict(
        architecture="Qwen3ForCausalLM",
        hidden_size=128,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=384,
    ),
    # "tiny" with two KV heads, so tensor parallelism of 2 (trainer or engine) splits whole heads.
    "tiny-tp": dict(
        architecture="Qwen3ForCausalLM",
        hidden_size=128,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=384,
    ),
    # Large enough (about 220 MB of fp32 weights) for weight-transfer and refit benchmarks.
    "bench": dict(
        architecture="Qwen3ForCausalLM",
        hidden_size=1024,
        num_layers=6,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=2048,
    ),
    "moe": dict(
        architecture="Qwen3MoeForCausalLM",
        hidden_size=128,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=384,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
    ),
    # Idefics3 (SmolVLM v1): vLLM's idefics3 hard-codes a Llama text tower. An image is resized to
    # a longest edge of 128 and cut into 64 x 64 tiles (2 x 2 for a square image) plus a 64 x 64
    # global view; each tile is 4 x 4 patches, pixel-shuffled by 2 into IMAGE_SEQ_LEN = 4 tokens,
    # so a square image is 5 x 4 = 20 <image> tokens.
    "vlm": dict(
        architecture="Idefics3ForConditionalGeneration",
        hidden_size=128,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=384,
        vision_hidden_size=64,
        vision_num_layers=2,
        vision_num_attention_heads=1,
        vision_intermediate_size=128,
        image_size=64,
        patch_size=16,
        scale_factor=2,
        resized_longest_edge=128,
    ),
}

HEAD_DIM = 64  # vLLM's CPU attention backend does not support head sizes below 64.
MAX_POSITION_EMBEDDINGS = 1024
INIT_STD = 0.02

# ChatML in the Qwen style, without a default system prompt. Every assistant turn renders as
# "<|im_start|>assistant\n" + reply + "<|im_end|>\n", so the prompt for turn k followed by the
# reply is a prefix of the rendering of later turns (what multi-turn RL rollouts rely on).
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages and messages[0].role == 'system' -%}{{- render_content(messages[0].content) + '\\n\\n' -}}{%- endif -%}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' + render_content(message.content) -}}
{%- for tool_call in message.tool_calls or [] -%}
{%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
{%- if not loop.first or message.content -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' -}}
{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# The same template, with image content parts ({"type": "image"} or {"type": "image_url"}) rendered
# as the <image> marker the processor expands.
VLM_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}",
    "{%- if part.type == 'text' -%}{{- part.text -}}"
    "{%- elif part.type in ['image', 'image_url'] -%}{{- '" + IMAGE_TOKEN + "' -}}{%- endif -%}",
)


def printable_alphabet() -> list[str]:
    """The byte-level symbols of every printable ASCII character (string.printable)."""
    byte_to_symbol = _bytes_to_unicode()
    return [byte_to_symbol[ord(c)] for c in string.printable]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map, as used by the ByteLevel pre-tokenizer."""
    visible = list(range(ord("!"), ord("~") + 1))
    visible += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in visible}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def build_training_corpus() -> list[str]:
    """Text of the demo task as the chat template renders it, without the special tokens."""
    texts = []
    for a in range(10):
        for b in range(10):
            texts.append(f"user\n{a}+{b}=\nassistant\n{a + b}\n")
    tool = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The expression"}},
                "required": ["expression"],
            },
        },
    }
    tool_preamble = (
        "system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{json.dumps(tool)}\n</tools>\n\nFor each function call, return a json object with "
        "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
    )
    tool_turn = (
        'assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+5"}}\n'
        "</tool_call>\nuser\n<tool_response>\n8\n</tool_response>\n"
    )
    texts += [tool_preamble, tool_turn] * 20
    texts.append("system\nYou are a helpful assistant. The answer is a number.\n")
    return texts


def build_tokenizer(image_tokens: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE over printable ASCII in which every digit is its own token; `image_tokens`
    (the vlm preset) are added as special tokens after all the others."""
    tokenizer = Tokenizer(models.BPE())
    # Digits are split off before the byte-level step, so no merge can glue a digit to "=" or
    # to another digit: "3+5=" / "8" always yields the answer as separate digit tokens.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=printable_alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(build_training_corpus(), trainer=trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    # Tool markers are ordinary added tokens (not special), so they survive skip_special_tokens
    # and a tool-call parser sees them in the decoded text.
    tokenizer.add_tokens(TOOL_TOKENS)
    if image_tokens:
        tokenizer.add_special_tokens(image_tokens)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START] + (image_tokens or []),
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
        chat_template=VLM_CHAT_TEMPLATE if image_tokens else CHAT_TEMPLATE,
    )


def text_tower_fields(vocab_size: int, token_ids: dict[str, int], sizes: dict, *, tied: bool) -> dict:
    """The decoder's config fields, shared by the text presets and the vlm preset's text tower."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_hidden_layers=sizes["num_layers"],
        num_attention_heads=sizes["num_attention_heads"],
        num_key_value_heads=sizes["num_key_value_heads"],
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INIT_STD,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=token_ids[PAD_TOKEN],
        eos_token_id=token_ids[IM_END],
        pad_token_id=token_ids[PAD_TOKEN],
        dtype="float32",
    )


def build_config(vocab_size: int, token_ids: dict[str, int], sizes: dict) -> Qwen3Config | Qwen3MoeConfig:
    """The transformers config for a preset's sizes."""
    common = text_tower_fields(vocab_size, token_ids, sizes, tied=True)
    if sizes["architecture"] == "Qwen3MoeForCausalLM":
        config = Qwen3MoeConfig(
            **common,
            num_experts=sizes["num_experts"],
            num_experts_per_tok=sizes["num_experts_per_tok"],
            moe_intermediate_size=sizes["moe_intermediate_size"],
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    else:
        config = Qwen3Config(**common)
    config.architectures = [sizes["architecture"]]
    return config


def build_vlm_config(vocab_size: int, token_ids: dict[str, int], sizes: dict) -> Idefics3Config:
    """The Idefics3 config: a Llama text tower and a SigLIP-style vision tower."""
    text_config = LlamaConfig(**text_tower_fields(vocab_size, token_ids, sizes, tied=False))
    vision_config = dict(
        hidden_size=sizes["vision_hidden_size"],
        intermediate_size=sizes["vision_intermediate_size"],
        num_hidden_layers=sizes["vision_num_layers"],
        num_attention_heads=sizes["vision_num_attention_heads"],
        image_size=sizes["image_size"],
        patch_size=sizes["patch_size"],
        initializer_range=INIT_STD,
    )
    config = Idefics3Config(
        text_config=text_config.to_dict(),
        vision_config=vision_config,
        image_token_id=token_ids[IMAGE_TOKEN],
        scale_factor=sizes["scale_factor"],
        tie_word_embeddings=False,
        pad_token_id=token_ids[PAD_TOKEN],
        bos_token_id=token_ids[PAD_TOKEN],
        eos_token_id=token_ids[IM_END],
        dtype="float32",
    )
    config.architectures = [sizes["architecture"]]
    return config


def build_vlm_processor(tokenizer: PreTrainedTokenizerFast, sizes: dict) -> Idefics3Processor:
    """The pillow-only image processor (no torchvision) and the processor that expands <image>."""
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": sizes["resized_longest_edge"]},
        max_image_size={"longest_edge": sizes["image_size"]},
        do_image_splitting=True,
    )
    image_seq_len = (sizes["image_size"] // sizes["patch_size"]) ** 2 // sizes["scale_factor"] ** 2
    return Idefics3Processor(image_processor, tokenizer, image_seq_len=image_seq_len, chat_template=VLM_CHAT_TEMPLATE)


def build_state_dict(config: Qwen3Config | Qwen3MoeConfig | Idefics3Config, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights for every parameter: norms at one (their biases at zero), everything else
    N(0, INIT_STD^2)."""
    auto_class = AutoModelForImageTextToText if isinstance(config, Idefics3Config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto_class.from_config(config)
    # Tied output embeddings are stored once, as in released Qwen3 checkpoints.
    shapes = {}
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        shapes.update(_checkpoint_shapes(name, tuple(tensor.shape)))
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for name in sorted(shapes):
        if _is_norm(name, "weight"):
            state_dict[name] = torch.ones(shapes[name], dtype=torch.float32)
        elif _is_norm(name, "bias"):
            state_dict[name] = torch.zeros(shapes[name], dtype=torch.float32)
        else:
            state_dict[name] = torch.randn(shapes[name], generator=generator) * INIT_STD
    return state_dict


def _is_norm(name: str, leaf: str) -> bool:
    """Whether `name` is the `leaf` ("weight" or "bias") of a normalisation layer: the RMSNorms
    (input_layernorm, q_norm, norm, ...) and the vision tower's LayerNorms (layer_norm1/2,
    post_layernorm)."""
    module, _, last = name.rpartition(".")
    return last == leaf and "norm" in module.rpartition(".")[2]


def _checkpoint_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Names and shapes as released checkpoints store them.

    transformers keeps MoE experts fused in memory ([experts, 2 * intermediate, hidden]) but
    checkpoints, and vLLM's loader, hold one gate/up/down matrix per expert.
    """
    if name.endswith("experts.gate_up_proj"):
        num_experts, double_intermediate, hidden = shape
        prefix = name.removesuffix("gate_up_proj")
        return {
            f"{prefix}{e}.{proj}.weight": (double_intermediate // 2, hidden)
            for e in range(num_experts)
            for proj in ("gate_proj", "up_proj")
        }
    if name.endswith("experts.down_proj"):
        num_experts, hidden, intermediate = shape
        prefix = name.removesuffix("down_proj")
        return {f"{prefix}{e}.down_proj.weight": (hidden, intermediate) for e in range(num_experts)}
    return {name: shape}


def write_generation_config(out_dir: Path, token_ids: dict[str, int]) -> None:
    generation_config = {
        "bos_token_id": token_ids[PAD_TOKEN],
        "eos_token_id": token_ids[IM_END],
        "pad_token_id": token_ids[PAD_TOKEN],
        "do_sample": True,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")


def make_tiny_model(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    hidden_size: int | None = None,
    num_layers: int | None = None,
    intermediate_size: int | None = None,
) -> Path:
    """Write a seeded model directory for `preset` to `out_dir` and return its path.

    hidden_size / num_layers / intermediate_size override the preset's sizes; the number of
    attention heads follows hidden_size so head_dim stays 64.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    sizes = dict(PRESETS[preset])
    is_vlm = sizes["architecture"] == "Idefics3ForConditionalGeneration"
    if hidden_size is not None:
        if hidden_size % HEAD_DIM != 0:
            raise ValueError(f"hidden_size={hidden_size} must be a multiple of head_dim={HEAD_DIM}")
        ratio = sizes["num_attention_heads"] // sizes["num_key_value_heads"]
        sizes["hidden_size"] = hidden_size
        sizes["num_attention_heads"] = hidden_size // HEAD_DIM
        sizes["num_key_value_heads"] = max(1, sizes["num_attention_heads"] // ratio)
    if num_layers is not None:
        sizes["num_layers"] = num_layers
    if intermediate_size is not None:
        sizes["intermediate_size"] = intermediate_size

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(IMAGE_TOKENS if is_vlm else None)
    token_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS + [IMAGE_TOKEN]}
    if is_vlm:
        config = build_vlm_config(len(tokenizer), token_ids, sizes)
    else:
        config = build_config(len(tokenizer), token_ids, sizes)
    state_dict = build_state_dict(config, seed)

    if is_vlm:
        # The processor rewrites its tokenizer's special-token list, so it gets a copy; the
        # tokenizer files written after it keep <|im_start|> and the image markers special.
        processor = build_vlm_processor(copy.deepcopy(tokenizer), sizes)
        processor.save_pretrained(out_dir, save_jinja_files=False)
        processor.image_processor.save_pretrained(out_dir)  # preprocessor_config.json, for older readers
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    config.save_pretrained(out_dir)
    write_generation_config(out_dir, token_ids)
    save_file(state_dict, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="directory to write the model into (created if missing)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--intermediate-size", type=int, default=None)
    args = parser.parse_args()
    out_dir = make_tiny_model(
        args.out_dir,
        preset=args.preset,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        intermediate_size=args.intermediate_size,
    )
    weights = out_dir / "model.safetensors"
    num_params = sum(tensor.numel() for tensor in load_file(weights).values())
    config = json.loads((out_dir / "config.json").read_text())
    print(f"wrote {args.preset} model to {out_dir}")
    vocab_size = config.get("text_config", config)["vocab_size"]
    print(f"  architecture {config['architectures'][0]}, vocab_size {vocab_size}")
    print(f"  {num_params:,} parameters, model.safetensors {weights.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
